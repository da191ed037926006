"""A conversation saved to a file (``run --save-state``) and continued later (``--load-state``) without re-reading
it: the recurrent states, the token generated last (not fed yet) and the bundle's identity, in an .npz."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import IO

import numpy as np

from mambatrt.errors import InputError
from mambatrt.paths import write_atomic

STATE_FORMAT = "mambatrt-state"
STATE_VERSION = 1


def write_state(path: str | Path, identity: str, conv: np.ndarray, ssm: np.ndarray, pending: int | None) -> None:
    """A conversation's states, its pending token (generated, not fed yet) and the bundle's identity to ``path``
    (.npz), atomically."""

    def save(f: IO[bytes]) -> None:
        np.savez(
            f,
            format=np.array(STATE_FORMAT),
            version=np.array(STATE_VERSION),
            bundle=np.array(identity),
            conv_state=conv,
            ssm_state=ssm,
            pending=np.array(-1 if pending is None else pending, dtype=np.int64),
        )

    try:
        write_atomic(path, save)
    except OSError as exc:  # permissions, a full disk: the user's to fix
        raise InputError(f"{path}: cannot write the state ({exc.strerror or exc})") from None


def read_state(path: str | Path, identity: str, vocab: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """(conv, ssm, pending token or None) from a file :func:`write_state` wrote for the bundle ``identity``."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: state file not found")
    wrong = f"{path}: not a {STATE_FORMAT} v{STATE_VERSION} file (one written by `mambatrt run --save-state`)"
    try:
        with np.load(path, allow_pickle=False) as data:
            fields = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # not an .npz, truncated, or pickled objects
        raise InputError(wrong) from None
    needed = {"format", "version", "bundle", "conv_state", "ssm_state", "pending"}
    if not needed <= set(fields) or any(fields[k].shape != () for k in ("format", "version", "bundle", "pending")):
        raise InputError(wrong)
    if str(fields["format"]) != STATE_FORMAT or fields["version"].dtype.kind not in "iu":
        raise InputError(wrong)
    if int(fields["version"]) != STATE_VERSION:
        raise InputError(f"{path}: state format version {int(fields['version'])}, this mambatrt reads {STATE_VERSION}")
    if str(fields["bundle"]) != identity:
        raise InputError(f"{path}: this state was saved with another bundle (different model); start afresh")
    conv, ssm, pending = fields["conv_state"], fields["ssm_state"], fields["pending"]
    if conv.dtype.kind != "f" or ssm.dtype.kind != "f" or not (np.isfinite(conv).all() and np.isfinite(ssm).all()):
        raise InputError(f"{path}: the saved states are not finite floating-point arrays; start afresh")
    if pending.dtype.kind not in "iu" or not -1 <= int(pending) < vocab:
        raise InputError(f"{path}: the saved pending token is not a token id of this model; start afresh")
    return conv, ssm, (None if int(pending) < 0 else int(pending))
