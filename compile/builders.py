"""ONNX graph -> TensorRT plan, with Polygraphy's Python API or with trtexec.

Both builders take the same :class:`PlanRequest` (profiles come from :mod:`mambatrt.contract`), reuse one
timing cache across builds, and return the :class:`~mambatrt.manifest.PlanInfo` that the manifest stores.
The graphs are strongly typed: precision comes from the ONNX types, so no precision flags are passed.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mambatrt import envs
from mambatrt.errors import InputError, MambatrtError, Terminated
from mambatrt.manifest import PlanInfo
from mambatrt.tensorrt_flavour import TensorRT, find_tensorrt, import_polygraphy

BUILDERS = ("polygraphy", "trtexec")


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


def build_with_polygraphy(request: PlanRequest, trt: TensorRT | None = None) -> PlanInfo:
    """Build one plan with Polygraphy's loaders (strongly typed network, one optimization profile)."""
    trt = trt or find_tensorrt()
    if trt is None:
        raise BuildError("no TensorRT module found; pip install tensorrt-rtx-cu13 (builds on any machine) or tensorrt")
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


def trtexec_path() -> str | None:
    """The trtexec executable on PATH, if any."""
    return shutil.which("trtexec")


def build_with_trtexec(request: PlanRequest, trt: TensorRT | None = None) -> PlanInfo:
    """Build one plan with trtexec (same profile and timing cache); its log is kept beside the plan."""
    exe = trtexec_path()
    if exe is None:
        raise BuildError("trtexec is not on PATH; install TensorRT's trtexec or use --engines polygraphy")
    trt = trt or find_tensorrt()
    cmd = [
        exe,
        f"--onnx={request.onnx_path}",
        f"--saveEngine={request.plan_path}",
        f"--timingCacheFile={request.timing_cache}",
        "--stronglyTyped",
        "--noTF32",  # fp32 products in full fp32, as Polygraphy's CreateConfig does by default (the scan's sums)
        "--skipInference",
    ]
    for flag, i in (("--minShapes", 0), ("--optShapes", 1), ("--maxShapes", 2)):
        if request.shapes:
            dims = ",".join(f"{name}:{'x'.join(map(str, s[i]))}" for name, s in request.shapes.items())
            cmd.append(f"{flag}={dims}")
    log_path = request.plan_path.with_suffix(".trtexec.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not request.plan_path.is_file():
        raise BuildError(f"trtexec failed with exit code {proc.returncode}; see {log_path}")
    version_line = next((ln for ln in log_path.read_text().splitlines() if "TensorRT version" in ln), "")
    version = version_line.rsplit(":", 1)[-1].strip() if version_line else (trt.version if trt else "unknown")
    flavour = trt.flavour if trt else "tensorrt"
    seconds = time.perf_counter() - start
    return PlanInfo(request.plan_path.name, "trtexec", flavour, version, request.profile(), seconds, log=log_path.name)


def choose_builder(engines: str) -> str | None:
    """Resolve ``--engines`` before any work: auto -> trtexec if on PATH, else polygraphy if TensorRT imports, else
    None; a builder asked for by name must be usable here, or InputError says what to install."""
    if engines == "none":
        return None
    if engines == "auto":
        if trtexec_path():
            return "trtexec"
        return "polygraphy" if find_tensorrt() else None
    if engines not in BUILDERS:
        raise InputError(f"unknown --engines '{engines}'; choose auto, none, {', '.join(BUILDERS)}")
    if engines == "trtexec" and trtexec_path() is None:
        raise InputError("--engines trtexec: trtexec is not on PATH; install TensorRT's trtexec or use --engines auto")
    if engines == "polygraphy" and find_tensorrt() is None:
        raise InputError(
            "--engines polygraphy: no TensorRT module (tensorrt or tensorrt_rtx) is installed; "
            "pip install tensorrt-rtx-cu13, or use --engines none for an ONNX-only bundle"
        )
    return engines


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


def build_plan(builder: str, request: PlanRequest) -> PlanInfo:
    """Build with the named builder; Ctrl-C or SIGTERM during the build stops the bundle when the build returns."""
    with deferred_signals():
        return (build_with_trtexec if builder == "trtexec" else build_with_polygraphy)(request)
