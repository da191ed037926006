"""Find the TensorRT Python module: ``tensorrt`` (full TensorRT) first, else ``tensorrt_rtx`` (TensorRT for RTX).

Both expose the same builder and runtime API for what mambatrt uses. Which one was found is always reported
(``flavour``), recorded in bundle manifests, and checked when a plan is loaded: a plan only runs on the flavour
(and version) that built it.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType

FLAVOURS = ("tensorrt", "tensorrt_rtx")


@dataclass(frozen=True)
class TensorRT:
    """An imported TensorRT module and its flavour name and version."""

    module: ModuleType
    flavour: str
    version: str


def find_tensorrt(flavour: str | None = None) -> TensorRT | None:
    """Import ``flavour`` (or the first importable of FLAVOURS); None when none is installed."""
    for name in (flavour,) if flavour else FLAVOURS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return TensorRT(module, name, str(module.__version__))
    return None


def import_polygraphy(name: str = "polygraphy") -> ModuleType:
    """Import a polygraphy module the way this project needs it; every import of polygraphy goes through here.

    Polygraphy picks TensorRT-RTX only when POLYGRAPHY_USE_TENSORRT_RTX=1 is set before polygraphy is first
    imported, so the variable is set here whenever ``tensorrt_rtx`` is the flavour found (and no full TensorRT).
    """
    if "polygraphy" not in sys.modules:
        trt = find_tensorrt()
        if trt is not None and trt.flavour == "tensorrt_rtx":
            os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"
    return importlib.import_module(name)
