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


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set size in bytes (0 where /proc is absent or the process has gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes(pid: int | str = "self") -> int:
    """A process's largest resident set size so far, in bytes (VmHWM; 0 where /proc is absent)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((line for line in f if line.startswith("VmHWM:")), "")
        return int(line.split()[1]) * 1024 if line else 0
    except (OSError, ValueError, IndexError):
        return 0


# What one request can hold beyond the idle server, measured on the default model (docs/serving.md, "Memory"):
PROMPT_TOKEN_BYTES = 8  # its ids, int32, in the engine and in the front end that took it
COMPLETION_TOKEN_BYTES = 56  # int32 ids in both processes, and a whole response's text and JSON in the front end
LOGPROB_BYTES = 650  # one log-probability held for the answer (a scored prompt token, or one of top_logprobs)
BODY_TOKEN_BYTES = 60  # a prompt sent as token ids, while its front end reads it (one body at a time)


def memory_bound(idle: int, max_batch: int, max_queue: int, front_ends: int, limits: dict[str, int]) -> int:
    """The resident bytes a server stays within: ``idle`` (every process, ready), plus each request it can hold at
    its limits (``limits``: prompt_tokens, new_tokens, logprobs a request): a waiting request holds its prompt, a
    running one its completion or its log-probabilities too, and each front end one body being read."""
    prompt = PROMPT_TOKEN_BYTES * limits["prompt_tokens"]
    answer = max(COMPLETION_TOKEN_BYTES * limits["new_tokens"], LOGPROB_BYTES * limits["logprobs"])
    reading = front_ends * BODY_TOKEN_BYTES * limits["prompt_tokens"]
    return idle + (max_batch + max_queue) * prompt + max_batch * answer + reading
