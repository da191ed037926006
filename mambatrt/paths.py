"""Checks of output paths, run before any long work so that a bad path fails in a second, not after an export."""

from __future__ import annotations

import os
from pathlib import Path

from mambatrt.errors import InputError


def check_output_folder(path: str | Path, flag: str = "--out") -> None:
    """``path`` can be (or already is) a folder this process may write: not a file, and its nearest existing
    ancestor is a folder it may create entries in. Raises InputError naming the problem."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path}: is a file; {flag} takes a folder")
    parent = next((p for p in [path.resolve(), *path.resolve().parents] if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise InputError(f"{parent}: cannot create {path} there (not a writable folder); choose another {flag}")
