"""ONNX graph -> TensorRT plan, with Polygraphy's Python API (TensorRT or TensorRT-RTX, whichever imports).

A :class:`PlanRequest` names the graph, the plan and the optimization profile (from :mod:`mambatrt.contract`); every
build reuses one timing cache per TensorRT flavour and version, and returns the :class:`~mambatrt.manifest.PlanInfo`
that the manifest stores. The graphs are strongly typed: precision comes from the ONNX types, so no precision flags
are passed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mambatrt import envs
from mambatrt.errors import InputError, MambatrtError, Terminated
from mambatrt.manifest import PlanInfo
from mambatrt.tensorrt_flavour import TensorRT, find_tensorrt, import_polygraphy

PLAN_CHOICES = ("auto", "none")  # --plans: auto builds plans when a TensorRT module imports; none never


class BuildError(MambatrtError):
    """A plan could not be built (parser or builder failure, missing tool)."""


@dataclass(frozen=True)
class PlanRequest:
    """One plan to build: ONNX path, plan path, and the optimization profile of its dynamic inputs.

    ``shapes``: input name -> (min, opt, max) shapes, from :meth:`mambatrt.contract.GraphContract.profile`.
    """

    onnx_path: Path
    plan_path: Path
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    timing_cache: Path

    def profile(self) -> dict:
        """The profile as a manifest records it."""
        return {name: dict(zip(("min", "opt", "max"), map(list, s), strict=True)) for name, s in self.shapes.items()}


def find_builder(plans: str) -> TensorRT | None:
    """Resolve ``--plans`` before any work: "auto" -> the TensorRT module that imports (tensorrt, else
    tensorrt_rtx), or None for an ONNX-only bundle; "none" -> None."""
    if plans not in PLAN_CHOICES:
        raise InputError(f"unknown --plans '{plans}'; choose {' or '.join(PLAN_CHOICES)}")
    return find_tensorrt() if plans == "auto" else None


def timing_cache_path(trt: TensorRT) -> Path:
    """One timing cache per TensorRT flavour and version, shared by every build on this machine."""
    root = envs.MAMBATRT_CACHE
    root.mkdir(parents=True, exist_ok=True)
    return root / f"timing-{trt.flavour}-{trt.version}.cache"


def build_plan(request: PlanRequest, trt: TensorRT) -> PlanInfo:
    """Build one plan with Polygraphy's loaders (strongly typed network, one optimization profile). Ctrl-C or
    SIGTERM during the build stops the bundle when the build returns (:func:`deferred_signals`)."""
    with deferred_signals():
        return _build_with_polygraphy(request, trt)


def _build_with_polygraphy(request: PlanRequest, trt: TensorRT) -> PlanInfo:
    """The build itself."""
    trt_loaders = import_polygraphy("polygraphy.backend.trt")
    CreateConfig, EngineBytesFromNetwork = trt_loaders.CreateConfig, trt_loaders.EngineBytesFromNetwork
    NetworkFromOnnxPath, Profile = trt_loaders.NetworkFromOnnxPath, trt_loaders.Profile
    G_LOGGER = import_polygraphy("polygraphy.logger").G_LOGGER

    # TensorRT-RTX logs CUDA errors while it builds on a machine without a GPU; they are harmless there.
    verbose = envs.MAMBATRT_VERBOSE
    G_LOGGER.module_severity = G_LOGGER.INFO if verbose else G_LOGGER.CRITICAL
    profile = Profile()
    for name, (lo, opt, hi) in request.shapes.items():
        profile.add(name, min=lo, opt=opt, max=hi)
    cache = request.timing_cache
    config = CreateConfig(profiles=[profile], load_timing_cache=str(cache) if cache.exists() else None)
    network = NetworkFromOnnxPath(str(request.onnx_path), strongly_typed=True)
    start = time.perf_counter()
    try:
        engine_bytes = EngineBytesFromNetwork(network, config=config, save_timing_cache=str(cache))()
    except Exception as exc:  # Polygraphy raises PolygraphyException and TensorRT's own errors
        hint = "" if verbose else " (set MAMBATRT_VERBOSE=1 to see TensorRT's messages)"
        raise BuildError(f"{request.onnx_path.name}: {trt.flavour} could not build a plan: {exc}{hint}") from None
    if engine_bytes is None:
        raise BuildError(f"{request.onnx_path.name}: {trt.flavour} returned no plan; see the messages above")
    request.plan_path.write_bytes(bytes(engine_bytes))
    seconds = time.perf_counter() - start
    return PlanInfo(request.plan_path.name, "polygraphy", trt.flavour, trt.version, request.profile(), seconds)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while native code runs, and raise them when it returns.

    TensorRT calls Python back (its logger) while it builds, and a KeyboardInterrupt raised inside that callback is
    caught and printed by TensorRT, not propagated: the build would finish and the bundle would be written as if
    nothing happened. Here the signal is only recorded, and raised (KeyboardInterrupt or Terminated) as soon as the
    build returns, so the caller's cleanup runs and the previous bundle stays.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in received:
        raise Terminated()
    if received:
        raise KeyboardInterrupt()


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
