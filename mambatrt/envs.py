"""Every environment variable mambatrt reads, declared once: its name, type, default and meaning.

Read them as attributes of this module (``envs.MAMBATRT_CACHE``): each read evaluates the variable anew, so a test
or a caller that sets one sees it at once. Nothing else in mambatrt reads ``os.environ``; ``grep envs.`` finds every
use. None of them changes what the tool computes or which implementation runs: they say where things are and how
much to print.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _path_or_none(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


ENVIRONMENT_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "MAMBATRT_CACHE": (
        lambda: Path(os.environ.get("MAMBATRT_CACHE") or Path.home() / ".cache" / "mambatrt"),
        "Folder for what `mambatrt bundle` reuses across builds on this machine: the compiled kernels library "
        "(kernels/) and TensorRT's timing cache. Default: ~/.cache/mambatrt.",
    ),
    "MAMBATRT_NVCC": (
        lambda: os.environ.get("MAMBATRT_NVCC") or None,
        "The CUDA compiler `mambatrt bundle` builds the kernels library's CUDA kernels with. Default: nvcc on PATH.",
    ),
    "MAMBATRT_CXX": (
        lambda: os.environ.get("MAMBATRT_CXX") or None,
        "The C++ compiler for the kernels library's CPU-only build (where no CUDA compiler runs). Default: g++, "
        "else c++, on PATH.",
    ),
    "MAMBATRT_CUTLASS_INCLUDE": (
        lambda: _path_or_none("MAMBATRT_CUTLASS_INCLUDE"),
        "Folder of CUTLASS's C++ headers (holding cutlass/gemm/device/gemm.h) for the kernels library's CUDA "
        "build. Default: the headers of the nvidia-cutlass package when it is installed.",
    ),
    "MAMBATRT_API_KEY": (
        lambda: os.environ.get("MAMBATRT_API_KEY") or None,
        "The API key `mambatrt serve` requires as a bearer token (`serve --api-key` takes precedence), and that "
        "`mambatrt eval --url` and `bench-serve` send. Default: none (the endpoint is open).",
    ),
    "MAMBATRT_VERBOSE": (
        lambda: os.environ.get("MAMBATRT_VERBOSE", "") not in ("", "0"),
        "Set to 1 to see TensorRT's own messages while `mambatrt bundle` builds plans. Default: off.",
    ),
}


def __getattr__(name: str) -> Any:
    try:
        read, _ = ENVIRONMENT_VARIABLES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return read()


def __dir__() -> list[str]:
    return list(ENVIRONMENT_VARIABLES)


def describe() -> str:
    """The variables and their meanings, one paragraph each (for help texts and docs)."""
    return "\n".join(f"{name}: {doc}" for name, (_, doc) in ENVIRONMENT_VARIABLES.items())
