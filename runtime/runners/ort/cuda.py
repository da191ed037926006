"""onnxruntime on CUDA, one sequence: the states in device buffers bound with IOBinding, each graph replayed as
captured CUDA graphs (one per row count and state-buffer parity). The slot pool for many sequences is
:mod:`.cuda_pool`."""

from __future__ import annotations

from typing import Any

import numpy as np

from mambatrt.contract import CONV_STATE, KERNELS, LOGITS, PORTABLE, PREFILL, SSM_STATE, TOKEN_IDS
from mambatrt.errors import BundleError, MambatrtError

from ...bundle import Bundle
from .. import cudart
from ..base import Runner, SinglePool, SlotPool
from ..scorer import Scorer, open_scorer
from ..states import StateBuffers, bind_states
from .loader import OrtLoadError, import_ort, kernels_stream, ort_session, partition_stream, session_options

# Launches of one (rows, parity) before onnxruntime replays it: its CUDA provider runs a graph id once normally
# (allocations), captures it on the next run; x2 parities, +2 so that both parities' captures have replayed once.
CAPTURE_RUNS = 6
# Runs of one graph id that leave it captured, whichever onnxruntime: one or two regular runs (by version), then the
# capture (the pool's warm-up)
RUNS_TO_CAPTURE = 3
# Row counts of one graph that a runner captures at most (each for both parities): the kernels prefill graph takes up
# to 2048 rows, and a captured graph per prompt length met would grow with every length; further row counts run
# plainly (at many rows a launch's kernels, not their launching, take its time)
CAPTURED_ROWS = 64
# The share of the GPU's SMs that prefill launches get while they run beside decode launches (serving): at fp32
# mamba-130m concurrency 64 on an H200, 64-80 of its 132 SMs gave ITL p50 1.15-1.22 ms against 1.29-1.30 on the
# whole GPU, 96 gave 1.25 and 48 lost tokens/s (docs/experiments.md); half (72 after Hopper's rounding to 8) is
# among the best of them and leaves prefill the most SMs
PREFILL_SM_SHARE = 0.5


class CaptureFailed(Exception):
    """onnxruntime could not capture or replay a CUDA graph; the graph then runs plainly."""


class PlainGraph:
    """One graph on the CUDA provider, node by node: an IOBinding rebound per chunk, the logits into the runner's
    device buffer."""

    captured = False

    def __init__(self, runner: OrtCudaRunner, graph: str) -> None:
        self.runner = runner
        self.session = runner.open_session(graph, capture=False, copy=runner.prefill_copy(graph))
        self.binding = self.session.io_binding()

    def run(self, ids: np.ndarray) -> None:
        runner, binding = self.runner, self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(TOKEN_IDS, ids)
        binding.bind_ortvalue_output(LOGITS, runner.logits)
        runner.bind(binding)
        runner.settle()  # states set by copies on the legacy stream
        self.session.run_with_iobinding(binding)


class CapturedGraph:
    """One graph replayed as captured CUDA graphs, one per row count and state-buffer parity.

    A captured graph replays with the addresses it was captured with, so each (rows, parity) has its own fixed
    bindings: a token-ids buffer of that row count, the runner's logits buffer, and the state buffers of that
    parity. Captured graphs replay in turn on one stream, so they share the scratch memory of the session's arena.

    Capturing costs far more than one plain run, and a one-shot ``run`` meets most chunk lengths once: a (rows,
    parity) is run plainly (graph id -1) the first time and captured only when it comes again, for the first
    CAPTURED_ROWS row counts that do; a plain run's ids go to one device buffer of the graph's most rows, bound where
    they lie.
    """

    captured = True

    def __init__(self, runner: OrtCudaRunner, graph: str) -> None:
        self.runner = runner
        self.session = runner.open_session(graph, capture=True, copy=runner.prefill_copy(graph))
        self.ids: dict[int, Any] = {}  # rows -> device int64 [rows] of a captured row count
        self.replays: dict[tuple[int, int], tuple] = {}  # (rows, parity) -> (binding, run options)
        self.first_run: set[tuple[int, int]] = set()  # seen once: run plainly
        ids = np.zeros(runner.max_rows[graph], np.int64)
        self.flat = runner.ort.OrtValue.ortvalue_from_numpy(ids, "cuda", 0)  # plain runs' ids
        self.plain: dict[int, Any] = {}  # parity -> binding of a plain run (its ids bound per run)
        self.plain_options = runner.ort.RunOptions()
        self.plain_options.add_run_config_entry("gpu_graph_id", "-1")

    def _replay(self, rows: int) -> tuple:
        runner = self.runner
        key = (rows, runner.states.parity)
        if key not in self.replays:
            ort = runner.ort
            if rows not in self.ids:
                self.ids[rows] = ort.OrtValue.ortvalue_from_numpy(np.zeros(rows, np.int64), "cuda", 0)
            binding = self.session.io_binding()
            binding.bind_ortvalue_input(TOKEN_IDS, self.ids[rows])
            binding.bind_ortvalue_output(LOGITS, runner.logits)
            runner.bind(binding)
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(2 * rows + runner.states.parity + 1))
            self.replays[key] = (binding, options)
        return self.replays[key]

    def _plain(self, ids: np.ndarray) -> tuple:
        """(binding, run options) of a plain run of ``ids``, copied to the plain runs' buffer."""
        runner = self.runner
        parity = runner.states.parity
        if parity not in self.plain:
            binding = self.session.io_binding()
            binding.bind_ortvalue_output(LOGITS, runner.logits)
            runner.bind(binding)
            self.plain[parity] = binding
        address = self.flat.data_ptr()
        cudart.copy(address, ids.ctypes.data, ids.nbytes)
        self.plain[parity].bind_input(TOKEN_IDS, "cuda", 0, np.int64, [ids.size], address)
        return self.plain[parity], self.plain_options

    def run(self, ids: np.ndarray) -> None:
        rows = ids.size
        key = (rows, self.runner.states.parity)
        if key in self.first_run and (rows in self.ids or len(self.ids) < CAPTURED_ROWS):
            binding, options = self._replay(rows)
            self.ids[rows].update_inplace(ids)
        else:
            self.first_run.add(key)
            binding, options = self._plain(ids)
        self.runner.settle()
        try:
            self.session.run_with_iobinding(binding, options)
        except Exception as exc:  # onnxruntime's own exception types; the read buffers are untouched
            raise CaptureFailed(str(exc)[:200]) from None


class OrtCudaRunner(Runner):
    """onnxruntime's CUDA provider: the states in :class:`StateBuffers` on the device, bound with IOBinding, every
    graph replayed as captured CUDA graphs (:class:`CapturedGraph`); a graph onnxruntime refuses to capture (e.g. a
    node placed on the CPU) runs plainly (:class:`PlainGraph`), and ``notes`` says so.

    With the kernels graphs the sessions run on non-blocking streams of the kernels library, each of its own, so a
    slot pool's decode session runs beside this runner's prefill session (``concurrent``). ``prefill_beside_decode``
    (serving): this runner's stream, where prefill launches run, is confined to PREFILL_SM_SHARE of the GPU's SMs
    where the driver can make the partition (else the whole GPU; ``notes`` says why).
    """

    name = "onnxruntime"

    def __init__(
        self, bundle: Bundle, flavour: str = PORTABLE, threads: int = 0, prefill_beside_decode: bool = False
    ) -> None:
        super().__init__(bundle, "cuda")
        self.flavour = flavour
        ort = self.ort = import_ort()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BundleError("onnxruntime has no CUDA provider here; install onnxruntime-gpu or use --device cpu")
        self.concurrent = flavour == KERNELS  # each session on a stream of its own
        self.prefill_sms = 0  # the SMs this runner's stream may use (0: all of them)
        self.stream = self._prefill_stream(prefill_beside_decode) if self.concurrent else None
        self.cuda_opts = {"use_tf32": "0"}  # TF32 matmuls change fp32 logits at the 1e-1 level on 130m models
        if self.stream is not None:
            self.cuda_opts["user_compute_stream"] = str(self.stream)
        self.options = session_options(ort, bundle, flavour, threads)
        self._scorer: Scorer | None = None

        def alloc(shape: tuple[int, ...]):
            return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), "cuda", 0)

        self.states = StateBuffers(self._state_shapes(), alloc)
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([1, self.config.vocab_padded], np.float32, "cuda", 0)
        self.graph_runners = {graph: self._graph_runner(graph) for graph in self.graphs}
        self._warm_up()

    def _prefill_stream(self, beside_decode: bool) -> int:
        """The stream of this runner's sessions: on PREFILL_SM_SHARE of the SMs when prefill runs beside decode
        and the driver can make the partition, else a stream of the whole GPU."""
        sms = int(cudart.sm_count() * PREFILL_SM_SHARE) if beside_decode else 0
        if sms:
            try:
                stream, self.prefill_sms = partition_stream(self.bundle, sms)
                return stream
            except MambatrtError as exc:  # the driver's or the library's reason
                self.notes.append(f"prefill launches may use the whole GPU ({exc})")
        return kernels_stream(self.bundle)

    def _warm_up(self) -> None:
        """Launches of each graph at load (a decode step, a full prefill chunk), then zero states: the CUDA
        context, cuBLAS handles, kernel modules and the memory arena (to the largest launch's) are set up here
        rather than inside the first request's time to first token. A decode step and a full chunk are captured
        here too, for both state-buffer parities: a one-shot ``run`` goes through decode steps, whose plain runs
        cost several times their replays, and a prompt longer than a chunk through full chunks; other row counts
        are captured when they repeat."""
        for graph, runner in self.graph_runners.items():
            rows = self.max_rows[graph]
            if isinstance(runner, CapturedGraph):
                runner.first_run.update({(rows, 0), (rows, 1)})  # straight to the graph ids, no plain first run
            for _ in range(CAPTURE_RUNS if runner.captured else 1):
                self._execute(graph, np.zeros(rows, np.int64))
        self.reset()

    @property
    def captured(self) -> dict[str, bool]:
        """graph -> whether it replays captured CUDA graphs."""
        return {graph: runner.captured for graph, runner in self.graph_runners.items()}

    def settle(self) -> None:
        """Wait for the copies queued on the legacy default stream (host-to-device copies of token ids and states,
        the pool's state copies) before a launch on a non-blocking stream, which would not wait for them; a no-op
        where the sessions' stream is ordered with the legacy stream."""
        if self.concurrent:
            cudart.check(cudart.cudart().cudaStreamSynchronize(None), "cudaStreamSynchronize")

    def bind(self, binding) -> None:
        """Bind the one sequence's states (read the current buffers, write the others)."""
        bind_states(binding, "cuda", self.layout, (1, 0, 1), self.states.read, self.states.write)

    def scorer(self) -> Scorer | None:
        """On this runner's stream, where the prefill launches run (a chunk is scored after the launches before it)."""
        if self._scorer is None:
            providers = [("CUDAExecutionProvider", self.cuda_opts), "CPUExecutionProvider"]
            self._scorer = open_scorer(self, self.options, providers)
        return self._scorer

    def provider_options(self, stream: int | None = None) -> dict[str, str]:
        """The CUDA provider's options of this runner's sessions, on ``stream`` when given instead of its own."""
        return self.cuda_opts if stream is None else {**self.cuda_opts, "user_compute_stream": str(stream)}

    def open_session(self, graph: str, capture: bool, stream: int | None = None, copy: str = ""):
        """A session of ``graph`` on the CUDA provider (with CUDA graph capture enabled, or plain), on the runner's
        stream or on ``stream``; ``copy`` "cuda": the kernels graph's CUDA copy (MambaLinear)."""
        cuda = self.provider_options(stream)
        if capture:
            providers = [("CUDAExecutionProvider", {**cuda, "enable_cuda_graph": "1"})]
        else:
            providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
        try:
            return ort_session(self.bundle, graph, self.options, providers, self.flavour, copy)
        except OrtLoadError as exc:
            if capture:  # e.g. a node onnxruntime would place on the CPU: run the graph plainly
                raise CaptureFailed(str(exc).splitlines()[0][:200]) from None
            raise

    def linear_copy(self, graph: str) -> bool:
        """Whether ``graph`` can run as the kernels graph's CUDA copy (MambaLinear) here: the bundle has one, and
        the GPU has compute capability 8.0 or more (MambaLinear's tensor-core kernels need sm_80; the library's
        fallback before it is a plain fp32 kernel, far slower than cuBLAS)."""
        bundle, flavour = self.bundle, self.flavour
        if bundle.graph_path(graph, flavour, cuda=True) == bundle.graph_path(graph, flavour):
            return False
        return cudart.compute_major() >= 8

    def prefill_copy(self, graph: str) -> str:
        """ "cuda" where this runner's session of ``graph`` runs the kernels graph's CUDA copy: the prefill graph's
        (a launch's rows are many: MambaLinear's products, CUTLASS's from 16 rows on, beat cuBLAS's fp32 kernels
        there); never the decode graph's (one sequence: cuBLAS's GEMV is faster; the slot pool's batches take the
        copy in a session of their own)."""
        return "cuda" if graph == PREFILL and self.linear_copy(graph) else ""

    def _graph_runner(self, graph: str) -> PlainGraph | CapturedGraph:
        try:
            return CapturedGraph(self, graph)
        except CaptureFailed as exc:  # onnxruntime refuses graphs it cannot capture; run them plainly
            self.notes.append(f"{graph}: CUDA graph not used, launches run node by node (slower): {exc}")
        return PlainGraph(self, graph)

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        self.launch(graph, ids)
        return self.logits.numpy()[0]

    def launch(self, graph: str, ids: np.ndarray) -> None:
        """Advance the state by one checked chunk; its last row's logits stay on the device (:attr:`logits`)."""
        try:
            self.graph_runners[graph].run(ids)
        except CaptureFailed as exc:  # a capture onnxruntime cannot make: reopen the graph plainly, run again
            self.notes.append(f"{graph}: CUDA graph capture failed, launches run node by node (slower): {exc}")
            self.graph_runners[graph] = PlainGraph(self, graph)
            self.graph_runners[graph].run(ids)
        self.states.swap()

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.sequence_state(self.states.read(CONV_STATE).numpy(), self.states.read(SSM_STATE).numpy())

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.graph_state(conv, ssm)
        self.states.read(CONV_STATE).update_inplace(conv)
        self.states.read(SSM_STATE).update_inplace(ssm)
        self.settle()

    def reset(self) -> None:
        """Zero the states where they are (a memset on the device, where copying host zeros moved 2.8 MB across
        PCIe for mamba-130m: ~1 ms of every prompt's time to first token)."""
        lib = cudart.cudart()
        for name in (CONV_STATE, SSM_STATE):
            buffer = self.states.read(name)
            cudart.check(lib.cudaMemset(buffer.data_ptr(), 0, 4 * int(np.prod(buffer.shape()))), "cudaMemset")
        # the memsets, on the legacy stream, before any launch on the sessions' streams
        cudart.check(lib.cudaStreamSynchronize(None), "cudaStreamSynchronize")

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        if max_batch > 1 and self.bundle.manifest.batched:
            from .cuda_pool import CudaPool

            return CudaPool(self, max_batch, graph)
        return SinglePool(self, 1)
