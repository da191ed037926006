"""Runners: one face (:class:`~.base.Runner`) over every way a bundle runs, each with its slot pool beside it.

    cpu        onnxruntime's CPU provider         (:mod:`.ort.cpu`)
    cuda       onnxruntime's CUDA provider        (:mod:`.ort.cuda`, :mod:`.ort.cuda_pool`)
    tensorrt   the bundle's TensorRT plans        (:mod:`.trt.runner`, :mod:`.trt.pool`)

onnxruntime runs the bundle's "kernels" graphs (mambatrt's own ops, docs/kernels.md) where the bundle's library
runs on the device, else its "portable" graphs (standard ONNX, several times slower), and says so in the runner's
``notes``. TensorRT runs plans built from the portable graphs. Needs numpy plus onnxruntime or TensorRT; never
torch.
"""

from __future__ import annotations

from mambatrt.contract import KERNELS, PORTABLE
from mambatrt.errors import BundleError, InputError

from ..bundle import Bundle
from .base import Runner, SinglePool, SlotPool
from .ort.loader import OrtLoadError, cuda_library, import_ort

DEVICES = ("auto", "cpu", "cuda", "tensorrt")
DEVICE_HELP = (
    "where the model runs: cpu (onnxruntime's CPU provider), cuda (onnxruntime's CUDA provider; needs "
    "onnxruntime-gpu), tensorrt (the bundle's TensorRT plans on the GPU); auto: tensorrt where the bundle has plans "
    "that this machine's TensorRT runs, else cuda where onnxruntime has a CUDA provider and a GPU, else cpu"
)

__all__ = ["DEVICES", "DEVICE_HELP", "Runner", "SinglePool", "SlotPool", "open_runner", "pick_device"]


def open_runner(bundle: Bundle, device: str = "auto", threads: int = 0, prefill_beside_decode: bool = False) -> Runner:
    """The runner of ``bundle`` on ``device`` (:data:`DEVICES`). ``threads``: onnxruntime's intra-op threads (0:
    one per core); ``prefill_beside_decode`` (serving on cuda): prefill launches get part of the GPU's SMs, so
    that decode launches beside them always find some."""
    if device not in DEVICES:
        raise InputError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    notes: list[str] = []
    if device == "auto":
        device = pick_device(bundle, notes)
    if device == "tensorrt":
        from .trt.loader import check_plans, tensorrt_runtime_available
        from .trt.runner import TrtRunner

        check_plans(bundle)  # plans of another TensorRT: the bundle's problem, said first
        reason = tensorrt_runtime_available()
        if reason:
            raise InputError(f"cannot run TensorRT plans here: {reason}; use --device cpu or cuda")
        runner: Runner = TrtRunner(bundle)
    else:
        runner = _ort_runner(bundle, device, threads, prefill_beside_decode, notes)
    runner.notes[:0] = notes
    return runner


def pick_device(bundle: Bundle, notes: list[str]) -> str:
    """``--device auto``: tensorrt, cuda or cpu, as :data:`DEVICE_HELP` says; why a GPU runner was passed over
    goes to ``notes`` where the bundle asked for it (it has plans)."""
    if all(bundle.plan(graph) for graph in bundle.graphs):
        from .trt.loader import check_plans, tensorrt_runtime_available

        reason = tensorrt_runtime_available()
        if reason is None:
            try:
                check_plans(bundle)
                return "tensorrt"
            except BundleError as exc:  # plans of another TensorRT
                reason = str(exc)
        notes.append(f"the bundle's TensorRT plans do not run here ({reason})")
    return "cuda" if _cuda_usable() else "cpu"


def _cuda_usable() -> bool:
    """Whether onnxruntime has a CUDA provider and the CUDA runtime sees a GPU."""
    try:
        ort = import_ort()
    except BundleError:  # onnxruntime is not installed
        return False
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    from . import cudart

    return cudart.device_count() > 0


def _ort_runner(bundle: Bundle, device: str, threads: int, beside: bool, notes: list[str]) -> Runner:
    """onnxruntime's runner on ``device``: the kernels graphs where they run, else the portable graphs."""
    from .ort.cpu import OrtCpuRunner
    from .ort.cuda import OrtCudaRunner

    flavour = _kernels_or_why(bundle, device, notes)

    def open_(flavour: str) -> Runner:
        if device == "cuda":
            return OrtCudaRunner(bundle, flavour, threads, prefill_beside_decode=beside)
        return OrtCpuRunner(bundle, flavour, threads)

    if flavour == PORTABLE:
        return open_(PORTABLE)
    try:
        return open_(KERNELS)
    except OrtLoadError as exc:  # e.g. a library built for another CPU or onnxruntime
        notes.append(f"the kernels graphs do not run here ({str(exc).splitlines()[0][:200]}); {_PORTABLE_COST}")
        return open_(PORTABLE)


_PORTABLE_COST = "the portable graphs run instead, several times slower"


def _kernels_or_why(bundle: Bundle, device: str, notes: list[str]) -> str:
    """KERNELS where the bundle's kernels graphs can run on ``device``; else PORTABLE, with the reason in
    ``notes``."""
    if KERNELS not in bundle.flavours:
        notes.append(f"{bundle.path} has no kernels graphs (built with --kernels none or without a compiler); "
                     f"{_PORTABLE_COST}")  # fmt: skip
        return PORTABLE
    if device == "cuda":
        try:
            cuda_library(bundle)
        except OrtLoadError as exc:
            notes.append(f"{exc}; {_PORTABLE_COST}")
            return PORTABLE
    return KERNELS
