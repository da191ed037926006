"""The process's memory as the server reports and bounds it: resident bytes, and handing freed heap back.

glibc keeps memory a process freed in its heap for reuse: after a long prompt (its ids, its request's text and
JSON) the resident size stays at the request's peak while the server idles. :func:`trim` returns the free pages
to the system (``malloc_trim``); the engine calls it each time it turns idle, a front end each time its last
request ends, so the resident size goes back to the idle figure after every burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = None
if os.name == "posix":
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim  # noqa: B018  (glibc's; musl and macOS have none)
    except (OSError, AttributeError):
        _libc = None


def trim() -> None:
    """Give the heap's free pages back to the system (a no-op where the C library has no ``malloc_trim``)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
