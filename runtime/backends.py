"""Execution backends with one face: onnxruntime (CPU or CUDA) and TensorRT (``tensorrt`` or ``tensorrt_rtx``).

Every backend keeps the recurrent states itself (on the device where it runs) and exposes:

    run(graph, token_ids[S]) -> logits [Vp] float32 on the host   (graph "prefill": 1..max rows; "decode": 1)
    reset()  get_state() -> (conv [L,E,K-1], ssm [L,E,N])  set_state(conv, ssm)  close()

:class:`Backend` does the checks and bookkeeping shared by all of them; a subclass only binds buffers and executes.
Input and output of one execution never share a buffer: device backends alternate two buffers per state
(read A write B, then swap), shared by the prefill and decode graphs. Needs numpy, plus onnxruntime or TensorRT.
"""

from __future__ import annotations

import numpy as np

from mambatrt.contract import CONV_STATE, DECODE, LOGITS, PREFILL, SSM_STATE, STATE_PAIRS, TOKEN_IDS
from mambatrt.errors import BundleError, InputError
from mambatrt.runtime.bundle import Bundle
from mambatrt.tensorrt_flavour import find_tensorrt, import_polygraphy

BACKENDS = ("auto", "ort", "trt")
DEVICES = ("cpu", "cuda")


class Backend:
    """Shared part of every backend: chunk checks, state shapes, graph availability."""

    name = "base"

    def __init__(self, bundle: Bundle, device: str) -> None:
        self.bundle = bundle
        self.device = device
        self.config = bundle.config
        self.graphs = bundle.graphs
        self.max_rows = {DECODE: 1, PREFILL: bundle.max_prefill_rows}

    def check_chunk(self, graph: str, token_ids: np.ndarray) -> np.ndarray:
        """Validate one chunk for ``graph``; returns it as contiguous int64 [S]."""
        if graph not in self.graphs:
            raise InputError(f"this '{self.bundle.layout}' bundle has no {graph} graph")
        ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(-1)
        limit = self.max_rows[graph]
        if ids.size == 0:
            raise InputError("empty chunk: pass at least one token")
        if ids.size > limit:
            raise InputError(f"chunk of {ids.size} rows exceeds the {graph} engine's limit of {limit} rows")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise InputError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def run(self, graph: str, token_ids) -> np.ndarray:
        """Advance the state by one chunk on ``graph``; returns the last row's logits [Vp] (float32, host)."""
        return self._execute(graph, self.check_chunk(graph, token_ids))

    def zero_states(self) -> tuple[np.ndarray, np.ndarray]:
        """Host zeros of the state shapes."""
        return (
            np.zeros(self.config.conv_state_shape, np.float32),
            np.zeros(self.config.ssm_state_shape, np.float32),
        )

    def _check_state(self, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        conv = np.ascontiguousarray(conv, dtype=np.float32)
        ssm = np.ascontiguousarray(ssm, dtype=np.float32)
        if conv.shape != self.config.conv_state_shape or ssm.shape != self.config.ssm_state_shape:
            raise InputError(
                f"state shapes {conv.shape}, {ssm.shape} do not fit this bundle "
                f"({self.config.conv_state_shape}, {self.config.ssm_state_shape})"
            )
        return conv, ssm

    def reset(self) -> None:
        """Zero the states (start of a new sequence)."""
        self.set_state(*self.zero_states())

    # -- implemented by each backend ---------------------------------------------------------------------------
    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        """Copy of the current states on the host."""
        raise NotImplementedError

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        """Replace the current states."""
        raise NotImplementedError

    def close(self) -> None:
        """Release sessions, contexts and device memory."""


# ---------------------------------------------------------------------------------------------------------------
class OrtBackend(Backend):
    """onnxruntime. CPU: states as numpy arrays. CUDA: IOBinding with the states in two device buffers each."""

    name = "ort"

    def __init__(self, bundle: Bundle, device: str = "cpu", threads: int = 0, cuda_graph: bool = True) -> None:
        """Open one session per graph of ``bundle`` on ``device``.

        ``cuda_graph`` (CUDA only): replay decode steps and prefill chunks as captured CUDA graphs, one per row
        count and state-buffer parity, which removes onnxruntime's per-node launch overhead. onnxruntime runs a
        new graph id plainly a few times before it captures it; captured graphs replay in turn on one stream, so
        they share the scratch memory of the session's arena. A graph onnxruntime refuses to capture (e.g. a node
        placed on the CPU) runs plainly, and ``self.notes`` says why.
        """
        super().__init__(bundle, device)
        try:
            import onnxruntime as ort
        except ImportError:
            raise BundleError("onnxruntime is not installed; pip install onnxruntime (or onnxruntime-gpu)") from None
        self.ort = ort
        self.notes: list[str] = []
        self.cuda_opts = {"use_tf32": "0"}  # TF32 matmuls change fp32 logits at the 1e-1 level on 130m models
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BundleError("onnxruntime has no CUDA provider here; install onnxruntime-gpu or use --device cpu")
            providers = [("CUDAExecutionProvider", self.cuda_opts), "CPUExecutionProvider"]
        else:
            if bundle.precision == "bf16":
                raise BundleError(
                    "onnxruntime's CPU provider has no bf16 kernels; run this bf16 bundle with --device cuda "
                    "or --backend trt, or build an fp32/fp16 bundle"
                )
            providers = ["CPUExecutionProvider"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        if device == "cpu":
            # the prefill and decode sessions each own a thread pool; idle threads that keep spinning after a run
            # take the cores from the other session (2-core CPU: decode 15.4 -> 13.1 ms/token, prefill -6 %)
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        self.session_options, self.providers = opts, providers
        self.sessions = {}
        self.bindings = {}  # CUDA, plain sessions: one IOBinding each, rebound per chunk
        self.captured: dict[str, bool] = {}  # graph -> its session replays captured CUDA graphs
        for graph in self.graphs:
            self._open(graph, capture=device == "cuda" and cuda_graph)
        if device == "cuda":
            self.buffers = {
                name: [ort.OrtValue.ortvalue_from_numpy(z, "cuda", 0) for _ in range(2)]
                for name, z in zip((CONV_STATE, SSM_STATE), self.zero_states(), strict=True)
            }
            self.parity = 0
            self.logits_buffer = ort.OrtValue.ortvalue_from_shape_and_type(
                [1, self.config.vocab_padded], np.float32, "cuda", 0
            )
            self.ids_buffers: dict[int, object] = {}  # rows -> device int64 [rows]
            self.replays: dict[tuple[str, int, int], tuple] = {}  # (graph, rows, parity) -> (binding, run options)
        else:
            self.state = self.zero_states()

    def _open(self, graph: str, capture: bool = False) -> None:
        """(Re)open ``graph``'s session: with ``capture``, one that replays captured CUDA graphs, unless
        onnxruntime refuses (then ``notes`` says why and the session is plain)."""
        path = self.bundle.graph_path(graph)
        if capture:
            providers = [("CUDAExecutionProvider", {**self.cuda_opts, "enable_cuda_graph": "1"})]
            try:
                self.sessions[graph] = self.ort.InferenceSession(str(path), self.session_options, providers=providers)
                self.captured[graph] = True
                return
            except Exception as exc:  # onnxruntime refuses graphs it cannot capture; run them plainly
                self.notes.append(f"{graph}: CUDA graph not used: {str(exc).splitlines()[0][:200]}")
        try:
            self.sessions[graph] = self.ort.InferenceSession(str(path), self.session_options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own exception types for unreadable graphs
            raise BundleError(f"{path}: onnxruntime cannot load it ({exc})") from None
        self.captured[graph] = False
        if self.device == "cuda":
            self.bindings[graph] = self.sessions[graph].io_binding()

    def _replay(self, graph: str, rows: int, read: int) -> tuple:
        """Binding and run options of the captured graph for (graph, rows, read parity), made on first use.

        A captured CUDA graph replays with the addresses it was captured with, so each one has its own fixed
        bindings: the token ids buffer of that row count, the logits buffer, state buffers ``read`` -> 1-``read``.
        onnxruntime captures on the first runs with a new graph id and replays afterwards.
        """
        key = (graph, rows, read)
        if key not in self.replays:
            ort = self.ort
            if rows not in self.ids_buffers:
                self.ids_buffers[rows] = ort.OrtValue.ortvalue_from_numpy(np.zeros(rows, np.int64), "cuda", 0)
            binding = self.sessions[graph].io_binding()
            binding.bind_ortvalue_input(TOKEN_IDS, self.ids_buffers[rows])
            binding.bind_ortvalue_output(LOGITS, self.logits_buffer)
            for name, out_name in STATE_PAIRS:
                binding.bind_ortvalue_input(name, self.buffers[name][read])
                binding.bind_ortvalue_output(out_name, self.buffers[name][1 - read])
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(2 * rows + read + 1))
            self.replays[key] = (binding, options)
        return self.replays[key]

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        session = self.sessions[graph]
        if self.device == "cpu":
            conv, ssm = self.state
            logits, conv, ssm = session.run(None, {TOKEN_IDS: ids, CONV_STATE: conv, SSM_STATE: ssm})
            self.state = (conv, ssm)
            return logits[0]
        read, write = self.parity, 1 - self.parity
        if self.captured[graph]:
            binding, options = self._replay(graph, ids.size, read)
            self.ids_buffers[ids.size].update_inplace(ids)
            try:
                session.run_with_iobinding(binding, options)
            except Exception as exc:  # a capture onnxruntime cannot make: reopen the graph plainly, run again
                self.notes.append(f"{graph}: CUDA graph capture failed, running plainly: {str(exc)[:200]}")
                self.replays = {k: v for k, v in self.replays.items() if k[0] != graph}
                self._open(graph)
                return self._execute(graph, ids)  # the read buffers are untouched: the chunk runs again
            self.parity = write
            return self.logits_buffer.numpy()[0]
        binding = self.bindings[graph]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(TOKEN_IDS, ids)
        binding.bind_output(LOGITS, "cpu")  # bound first: outputs come back in binding order
        for name, out_name in STATE_PAIRS:
            binding.bind_ortvalue_input(name, self.buffers[name][read])
            binding.bind_ortvalue_output(out_name, self.buffers[name][write])
        session.run_with_iobinding(binding)
        self.parity = write
        return binding.get_outputs()[0].numpy()[0]  # logits only; the states stay on the device

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        if self.device == "cpu":
            return self.state[0].copy(), self.state[1].copy()
        return tuple(self.buffers[name][self.parity].numpy() for name in (CONV_STATE, SSM_STATE))

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self._check_state(conv, ssm)
        if self.device == "cpu":
            self.state = (conv.copy(), ssm.copy())
            return
        for name, value in ((CONV_STATE, conv), (SSM_STATE, ssm)):
            self.buffers[name][self.parity].update_inplace(value)


# ---------------------------------------------------------------------------------------------------------------
def check_plan_flavour(bundle: Bundle, graph: str, flavour: str, version: str) -> None:
    """A plan runs only on the TensorRT flavour and major.minor version that built it."""
    record = bundle.plan(graph)
    if record is None:
        raise BundleError(f"{bundle.path}: no TensorRT plan for the {graph} graph; rebuild with --engines polygraphy")
    built = (record.tensorrt_flavour, ".".join(record.tensorrt_version.split(".")[:2]))
    here = (flavour, ".".join(version.split(".")[:2]))
    if built != here:
        raise BundleError(
            f"{bundle.plan_path(graph).name} was built with {built[0]} {record.tensorrt_version}, this runtime has "
            f"{flavour} {version}; rebuild the bundle on this machine (mambatrt bundle ... --force)"
        )


def check_plans(bundle: Bundle) -> None:
    """Every graph of the bundle has a plan built by the TensorRT flavour and version installed here."""
    trt = find_tensorrt()
    if trt is None:
        raise BundleError("no TensorRT runtime found (tensorrt or tensorrt_rtx); use --backend ort")
    for graph in bundle.graphs:
        check_plan_flavour(bundle, graph, trt.flavour, trt.version)


class TrtBackend(Backend):
    """TensorRT plans. Device buffers through polygraphy.cuda (no torch); both contexts share the state buffers."""

    name = "trt"

    def __init__(self, bundle: Bundle, device: str = "cuda") -> None:
        super().__init__(bundle, "cuda")
        check_plans(bundle)
        trt = find_tensorrt()
        cuda = import_polygraphy("polygraphy.cuda")
        self.trt = trt.module
        self.cuda = cuda
        self.stream = cuda.Stream()
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.ERROR))
        self.engines, self.contexts = {}, {}
        for graph in self.graphs:
            engine = self.runtime.deserialize_cuda_engine(bundle.plan_path(graph).read_bytes())
            if engine is None:
                raise BundleError(f"{bundle.plan_path(graph)}: TensorRT could not deserialize the plan (corrupt?)")
            self.engines[graph] = engine
            self.contexts[graph] = engine.create_execution_context()
        conv, ssm = self.zero_states()
        self.states = {
            CONV_STATE: [cuda.DeviceArray(shape=conv.shape, dtype=np.float32) for _ in range(2)],
            SSM_STATE: [cuda.DeviceArray(shape=ssm.shape, dtype=np.float32) for _ in range(2)],
        }
        self.parity = 0
        max_rows = max(self.max_rows[g] for g in self.graphs)
        self.ids = cuda.DeviceArray(shape=(max_rows,), dtype=np.int64)
        self.logits = cuda.DeviceArray(shape=(1, self.config.vocab_padded), dtype=np.float32)
        self.host_logits = np.empty((1, self.config.vocab_padded), np.float32)
        self.set_state(conv, ssm)

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        ctx = self.contexts[graph]
        self.ids.copy_from(ids, stream=self.stream)
        ctx.set_input_shape(TOKEN_IDS, ids.shape)
        read, write = self.parity, 1 - self.parity
        ctx.set_tensor_address(TOKEN_IDS, self.ids.ptr)
        for name, out_name in STATE_PAIRS:
            ctx.set_tensor_address(name, self.states[name][read].ptr)
            ctx.set_tensor_address(out_name, self.states[name][write].ptr)
        ctx.set_tensor_address(LOGITS, self.logits.ptr)
        if not ctx.execute_async_v3(self.stream.ptr):
            raise RuntimeError(f"TensorRT execution of the {graph} plan failed")
        self.parity = write
        self.logits.copy_to(self.host_logits, stream=self.stream)
        self.stream.synchronize()
        return self.host_logits[0].copy()

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for name in (CONV_STATE, SSM_STATE):
            buf = self.states[name][self.parity]
            host = np.empty(buf.shape, np.float32)
            buf.copy_to(host, stream=self.stream)
            out.append(host)
        self.stream.synchronize()
        return out[0], out[1]

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self._check_state(conv, ssm)
        self.states[CONV_STATE][self.parity].copy_from(conv, stream=self.stream)
        self.states[SSM_STATE][self.parity].copy_from(ssm, stream=self.stream)
        self.stream.synchronize()

    def close(self) -> None:
        for bufs in self.states.values():
            for b in bufs:
                b.free()
        self.ids.free()
        self.logits.free()
        self.stream.free()


def tensorrt_runtime_available() -> str | None:
    """None when TensorRT plans can run here, else the reason they cannot."""
    trt = find_tensorrt()
    if trt is None:
        return "no TensorRT module (tensorrt or tensorrt_rtx) is installed"
    try:
        cuda = import_polygraphy("polygraphy.cuda")
        G_LOGGER = import_polygraphy("polygraphy.logger").G_LOGGER
    except ImportError:
        return "polygraphy (used for CUDA buffers) is not installed; pip install polygraphy"
    severity = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.CRITICAL + 10
    try:
        cuda.Stream().free()
    except Exception as exc:  # no driver, no device, or no CUDA runtime library
        return f"{trt.flavour} is installed but CUDA is not usable here ({str(exc).split('. ')[0]})"
    finally:
        G_LOGGER.module_severity = severity
    return None


def open_backend(bundle: Bundle, backend: str = "auto", device: str | None = None, cuda_graph: bool = True) -> Backend:
    """The backend to run a bundle: ``auto`` picks TensorRT when a runtime and the plans are present, else ort.

    ``cuda_graph``: onnxruntime on CUDA replays decode steps and prefill chunks as captured CUDA graphs (see
    :class:`OrtBackend`).
    """
    if backend not in BACKENDS:
        raise InputError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if device is not None and device not in DEVICES:
        raise InputError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    if backend == "auto":
        has_plans = all(bundle.plan(g) for g in bundle.graphs)
        use_trt = has_plans and device != "cpu" and tensorrt_runtime_available() is None
        backend = "trt" if use_trt else "ort"
    if backend == "trt":
        if device == "cpu":
            raise InputError("the TensorRT backend runs on CUDA devices only; use --backend ort for --device cpu")
        check_plans(bundle)
        reason = tensorrt_runtime_available()
        if reason:
            raise BundleError(f"cannot use the TensorRT backend: {reason}; use --backend ort")
        return TrtBackend(bundle)
    return OrtBackend(bundle, device or "cpu", cuda_graph=cuda_graph)
