"""Checks of output paths, run before any long work so that a bad path fails in a second, not after an export."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .errors import InputError

# The export's staging folder, beside its output folder: .export-PID-random
EXPORT_STAGE_PREFIX = ".export-"


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (a bundle's manifest records its files' digests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_output_folder(path: str | Path, flag: str = "--out") -> None:
    """``path`` can be (or already is) a folder this process may write: not a file, and its nearest existing
    ancestor is a folder it may create entries in. Raises InputError naming the problem."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path}: is a file; {flag} takes a folder")
    parent = next((p for p in [path.resolve(), *path.resolve().parents] if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise InputError(f"{parent}: cannot create {path} there (not a writable folder); choose another {flag}")


def check_output_file(path: str | Path, flag: str, example: str = "") -> None:
    """``path`` can be written as a file by this process: not a folder, in an existing folder it may write
    (``example``: a file name to suggest when ``path`` is a folder). Raises InputError naming the problem."""
    path = Path(path)
    if path.is_dir():
        such = f" such as {path / example}" if example else ""
        raise InputError(f"{path}: is a folder; {flag} takes a file name{such}")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent}: folder not found; create it first or choose another {flag}")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise InputError(f"{path.parent}: not a writable folder; choose another {flag}")


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through a temporary file beside it, filled by ``write(file)``: a failed or interrupted write
    leaves the old file as it was and no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_dead_stages(folder: Path, prefix: str) -> list[Path]:
    """Remove ``folder/{prefix}{pid}-*`` staging folders whose process is gone (a build killed with -9, a crash).

    Staging folders carry the pid of the process that made them; those of a live process are left alone.
    """
    removed = []
    for stage in folder.glob(f"{prefix}*"):
        pid = stage.name.removeprefix(prefix).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and stage.is_dir():
            shutil.rmtree(stage, ignore_errors=True)
            removed.append(stage)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
