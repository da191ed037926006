"""What onnxruntime's runners are built from: sessions of a bundle's graphs (their I/O checked against the
contract), their options, and the bundle's kernels library as ctypes sees it (its CUDA check, streams, sampler).

The kernels library is an onnxruntime custom-op library (docs/kernels.md). onnxruntime loads it into each session
(``register_custom_ops_library``); ctypes loads the same file here, which gives the same handle in this process,
for what the sessions do not do: make the CUDA streams the sessions run on, pick tokens on the GPU.
"""

from __future__ import annotations

import ctypes
import functools

from mambatrt.contract import DECODE, KERNELS, PORTABLE
from mambatrt.errors import BundleError, InputError

from ...bundle import Bundle
from ..states import check_io

_DTYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(float16)": "float16"}
# what the runtime calls in a kernels library built with its CUDA kernels
_CUDA_SYMBOLS = ("mambatrt_ops_cuda_check", "mambatrt_ops_new_stream", "mambatrt_ops_new_stream_on_sms")


class OrtLoadError(BundleError):
    """onnxruntime could not open a graph or the kernels library (unreadable, built for another machine, or a
    provider option it refuses, such as CUDA graph capture)."""


def import_ort():
    """onnxruntime, or a BundleError saying how to install it."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise BundleError("onnxruntime is not installed; pip install onnxruntime (or onnxruntime-gpu)") from None
    return ort


def ort_session(bundle: Bundle, graph: str, options, providers: list, flavour: str = PORTABLE, copy: str = ""):
    """One onnxruntime session of ``graph`` in ``flavour``, its I/O checked against the contract; ``copy``
    "cuda" or "cpu": the kernels graph's copy for that provider, whose products are MambaLinear
    (:meth:`Bundle.graph_path`)."""
    ort = import_ort()
    path = bundle.graph_path(graph, flavour, cuda=copy == "cuda", cpu=copy == "cpu")
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise OrtLoadError(f"{path}: onnxruntime cannot load it ({exc})") from None
    io = [
        [(t.name, _DTYPES.get(t.type, t.type), t.shape) for t in ts]
        for ts in (session.get_inputs(), session.get_outputs())
    ]
    check_io(bundle.contract(graph, flavour), *io, str(path))
    return session


def session_options(ort, bundle: Bundle, flavour: str, threads: int = 0):
    """Session options shared by a runner's sessions: the "kernels" flavour registers the bundle's op library;
    ``threads``: the intra-op threads (0: onnxruntime's default, one per core)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if flavour == KERNELS:
        library = bundle.kernels_library
        try:
            options.register_custom_ops_library(str(library))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise OrtLoadError(f"{library}: onnxruntime cannot load the kernels library ({exc})") from None
    return options


def cuda_library(bundle: Bundle) -> ctypes.CDLL:
    """The bundle's kernels library loaded with ctypes, its CUDA kernels checked against the GPU here (once per
    library file and process). OrtLoadError where it has none or they cannot run here."""
    if not bundle.kernels_cuda:
        raise OrtLoadError(f"{bundle.path}: its kernels library has no CUDA kernels (built where nvcc was not found)")
    return _checked_library(str(bundle.kernels_library))


@functools.cache
def _checked_library(path: str) -> ctypes.CDLL:
    library = ctypes.CDLL(path)
    missing = [name for name in _CUDA_SYMBOLS if not hasattr(library, name)]
    if missing:
        raise OrtLoadError(f"{path}: a kernels library of another mambatrt (no {missing[0]}); rebuild the bundle")
    library.mambatrt_ops_cuda_check.restype = ctypes.c_char_p
    why = library.mambatrt_ops_cuda_check()
    if why:  # e.g. a GPU older than the library's architectures
        raise OrtLoadError(f"{path}: its CUDA kernels cannot run on this GPU ({why.decode()}); rebuild the bundle here")
    return library


def kernels_stream(bundle: Bundle, urgent: bool = False) -> int:
    """A new non-blocking CUDA stream of the kernels library, for onnxruntime's CUDA provider to run a session on
    (its user_compute_stream): the custom kernels then launch on it, ordered with onnxruntime's own, and land in its
    CUDA graphs. It neither waits for nor holds up the legacy default stream's copies, so a launch waits for those
    itself. ``urgent``: of the device's highest priority (decode, whose short kernels then go before the prefill
    kernels queued beside them)."""
    library = cuda_library(bundle)
    library.mambatrt_ops_new_stream.restype = ctypes.c_void_p
    library.mambatrt_ops_new_stream.argtypes = [ctypes.c_int]
    stream = library.mambatrt_ops_new_stream(int(urgent))
    if not stream:
        raise BundleError("the kernels library could not create a CUDA stream")
    return stream


def partition_stream(bundle: Bundle, sms: int) -> tuple[int, int]:
    """A new non-blocking stream (as :func:`kernels_stream`) whose kernels run on ``sms`` of the GPU's SMs only, a
    green context's partition; and how many it got (the request rounded up to the device's granularity, 8 SMs on
    Hopper). Streams of the whole device still use every SM, those of the partition too when they are free: prefill
    launches on such a stream cannot fill the GPU, so the decode kernels beside them always find SMs (a prefill
    launch of 16 prompts takes every SM for milliseconds otherwise, and a decode kernel's blocks wait for its blocks
    to end, priority or not). InputError saying why where the driver cannot make the partition."""
    fn = cuda_library(bundle).mambatrt_ops_new_stream_on_sms
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p)]
    granted, why = ctypes.c_int(0), ctypes.c_char_p()
    stream = fn(0, sms, ctypes.byref(granted), ctypes.byref(why))
    if not stream:
        raise InputError(f"no stream on {sms} SMs: {(why.value or b'no stream').decode()}")
    return stream, granted.value


def sampler(bundle: Bundle):
    """The kernels library's sampler (``mambatrt_ops_sample``) as a ctypes function, or None where the bundle's
    library cannot run its CUDA kernels here (the host then samples)."""
    try:
        library = cuda_library(bundle)
    except (OrtLoadError, OSError):
        return None
    fn = getattr(library, "mambatrt_ops_sample", None)
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]  # logits, rows, stride, vocab, params, picks, stream
    return fn


def cpu_linear_copy(bundle: Bundle, flavour: str, graph: str = DECODE) -> bool:
    """Whether a CPU runner's session of ``graph`` runs the kernels graph's CPU copy (its products as MambaLinear):
    the bundle has one and its library's kernel for the bundle's weights is the fast one on this CPU. fp32 weights:
    the packed AVX-512 kernel (``mambatrt_ops_cpu_linear``), which beats MLAS's Gemms at a decode launch's rows on
    one thread and is no slower at a prefill launch's; fp16 and int8 weights: the strip kernel, AVX-512 or AVX2
    (``mambatrt_ops_cpu_linear_rows``), which reads them in their own type, where onnxruntime multiplies fp16 in a
    slow fallback and int8 as a folded fp32 copy (docs/benchmarks.md)."""
    if flavour != KERNELS or bundle.graph_path(graph, flavour, cpu=True) == bundle.graph_path(graph, flavour):
        return False
    symbol = "mambatrt_ops_cpu_linear" if bundle.precision == "fp32" else "mambatrt_ops_cpu_linear_rows"
    return _cpu_linear_library(str(bundle.kernels_library), symbol)


@functools.cache
def _cpu_linear_library(path: str, symbol: str = "mambatrt_ops_cpu_linear") -> bool:
    fast = getattr(ctypes.CDLL(path), symbol, None)
    return bool(fast and fast())


_TYPED_OPS = {"fp32": "MambaLinear", "fp16": "MambaLinear16", "bf16": "MambaLinearBF16", "int8": "MambaLinear8"}


def cpu_products(bundle: Bundle, flavour: str) -> str:
    """How a CPU runner of ``flavour`` multiplies the bundle's matrices on this machine, in words for ``bench``:
    the library's kernel and instruction-set build where it runs the CPU copies, else onnxruntime's Gemms."""
    if flavour != KERNELS or bundle.kernels_library is None:
        return "products: onnxruntime's Gemms"
    library = ctypes.CDLL(str(bundle.kernels_library))
    isa_fn = getattr(library, "mambatrt_ops_cpu_isa", None)
    if isa_fn is not None:
        isa_fn.restype = ctypes.c_char_p
    isa = isa_fn().decode() if isa_fn is not None else "unknown"
    if not cpu_linear_copy(bundle, flavour, DECODE):
        folded = " (int8 weights folded to fp32)" if bundle.precision == "int8" else ""
        return f"products: onnxruntime's Gemms{folded}; CPU kernels: {isa} build"
    if bundle.precision == "fp32":
        kernel = "packed AVX-512 kernel"
    else:  # the strip kernel of the build that runs (an AVX-512 CPU's, else AVX2's)
        kernel = f"{bundle.precision} weights as stored, {'AVX-512' if isa == 'avx512' else 'AVX2'} strip kernel"
    return f"products: {_TYPED_OPS.get(bundle.precision, 'MambaLinear')}, {kernel}; CPU kernels: {isa} build"
