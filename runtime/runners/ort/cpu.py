"""onnxruntime on the CPU: the runner (one sequence, the states as numpy arrays) and its slot pool (many)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mambatrt.contract import CONV_STATE, DECODE, LOGITS, PORTABLE, PREFILL, SSM_STATE, STATES, TOKEN_IDS
from mambatrt.errors import BundleError

from ...bundle import Bundle
from ..base import Runner, SinglePool, SlotPool, into, prefill_batch
from ..scorer import Scorer, open_scorer
from ..states import StateBuffers, bind_states
from .loader import cpu_linear_copy, import_ort, ort_session, session_options


class OrtCpuRunner(Runner):
    """onnxruntime on the CPU: one session per graph, the states as numpy arrays; each session runs the kernels
    graph's CPU copy where :func:`cpu_linear_copy` says."""

    name = "onnxruntime"

    def __init__(self, bundle: Bundle, flavour: str = PORTABLE, threads: int = 0) -> None:
        super().__init__(bundle, "cpu")
        self.flavour = flavour
        ort = import_ort()
        # bf16 products run only as the CPU copies' MambaLinearBF16 (onnxruntime's CPU provider has no bf16 Gemm)
        if bundle.precision == "bf16" and not all(cpu_linear_copy(bundle, flavour, g) for g in self.graphs):
            raise BundleError(
                "onnxruntime's CPU provider has no bf16 matrix products and this bundle's kernels graphs' CPU copies "
                "cannot run here (they need the kernels library and an AVX2 CPU); run it with --device cuda or "
                "--device tensorrt, or build an fp32/fp16 bundle"
            )
        opts = session_options(ort, bundle, flavour, threads)
        # the prefill and decode sessions each own a thread pool; idle threads that keep spinning after a run take
        # the cores from the other session (decode after prefill on a 2-core CPU)
        opts.add_session_config_entry("session.force_spinning_stop", "1")
        self.options = opts
        self._scorer: Scorer | None = None
        self.cpu_linear = {g: cpu_linear_copy(bundle, flavour, g) for g in self.graphs}
        self.sessions = {}
        for graph in self.graphs:
            copy = "cpu" if self.cpu_linear[graph] else ""
            self.sessions[graph] = ort_session(bundle, graph, opts, ["CPUExecutionProvider"], flavour, copy)
        # the sequence's states: stacked, and for layered graphs also (or only, after a launch) as each layer's
        # pieces, which go from one launch's outputs to the next one's inputs as they are: feeding and stacking
        # them on every launch cost ~10 % of a default-model decode step
        self.state: tuple[np.ndarray, np.ndarray] | None = self.graph_state(*self.zero_states())
        self.pieces: dict[str, np.ndarray] | None = None
        inputs = {out: name for name, out, *_ in self.layout.io}  # each state output feeds the input of its name
        # graph -> the state input each of its state outputs (in the session's order) feeds
        self.feeds = {g: [inputs.get(o.name) for o in s.get_outputs()[1:]] for g, s in self.sessions.items()}

    def scorer(self) -> Scorer | None:
        if self._scorer is None:
            self._scorer = open_scorer(self, self.options, ["CPUExecutionProvider"])
        return self._scorer

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        layout = self.layout
        if not layout.layered:
            logits, *self.state = self.run_states(graph, ids, *self.state)
            return logits[0]
        if self.pieces is None:
            self.pieces = layout.feed(*self.state)
        logits, *pieces = self.sessions[graph].run(None, {TOKEN_IDS: ids, **self.pieces})
        self.pieces = dict(zip(self.feeds[graph], pieces, strict=True))
        self.state = None  # stacked again when asked for (get_state)
        return logits[0]

    def _stacked_state(self) -> tuple[np.ndarray, np.ndarray]:
        if self.state is None:
            _, conv, ssm = self.layout.stacked([None, *(self.pieces[name] for name, *_ in self.layout.io)])
            self.state = (conv, ssm)
        return self.state

    def run_states(self, graph: str, ids: np.ndarray, conv: np.ndarray, ssm: np.ndarray) -> list[np.ndarray]:
        """One launch on stacked states the caller owns (decode takes B sequences, ids [B] and states
        [B, L, ...]); returns [logits, conv', ssm'] as new arrays. Layered graphs get each layer's piece and give
        theirs back stacked (the slot pool binds its layer-major buffers instead: :class:`HostPool`)."""
        layout = self.layout
        return layout.stacked(self.sessions[graph].run(None, {TOKEN_IDS: ids, **layout.feed(conv, ssm)}))

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(a.copy() for a in self.sequence_state(*self._stacked_state()))

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.graph_state(conv, ssm)
        self.state, self.pieces = (conv.copy(), ssm.copy()), None

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        if max_batch > 1 and self.bundle.manifest.batched:
            return HostPool(self, max_batch, graph)
        return SinglePool(self, 1)


def _host_zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, np.float32)


class HostPool(SlotPool):
    """Slots and staging rows as numpy arrays, run by onnxruntime on the CPU (batched graphs).

    Every launch binds its inputs and outputs where they lie (IOBinding, bindings kept per launch shape): a decode
    launch reads the slots' states in one of two buffers and writes them to the other (:class:`StateBuffers`), its
    logits into one array; a prefill launch reads staging rows and writes them to a second staging buffer, whence
    its rows are copied back. So nothing is copied around a launch but those rows (onnxruntime's own outputs cost a
    copy of every state per step), and layered graphs get their layers as they lie.
    """

    concurrent = True  # prefill (staging arrays, the prefill session) and decode (slots, the decode session) apart
    # the greedy tokens of a launch in one argmax over its rows (the engine would otherwise take one per sequence)
    device_greedy = True
    state_buffers = 2

    def __init__(self, runner: OrtCpuRunner, max_batch: int, graph: str) -> None:
        super().__init__(runner, max_batch)
        c = runner.config
        self.vocab = c.vocab_size
        self.layout = layout = runner.layout
        self.staging_rows = prefill_batch(runner, graph, max_batch)
        self.states = StateBuffers({k: layout.buffer_shape(k, max_batch) for k in STATES}, _host_zeros)
        self.staging = {k: _host_zeros(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.staging_out = {k: _host_zeros(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.ids = np.zeros(max_batch, np.int64)
        # the token ids of the largest prefill launch: a chunk per staging row, within the rows of one launch
        self.stage_ids = np.zeros(runner.staged_launch_rows(graph, self.staging_rows), np.int64)
        self.logits = np.zeros((max_batch, c.vocab_padded), np.float32)  # the last decode launch's [:n]
        self.stage_logits = np.zeros((self.staging_rows, c.vocab_padded), np.float32)
        self.n = 0  # sequences of the last decode launch
        self.bindings: dict[tuple, Any] = {}  # (graph, start, k, parity) -> IOBinding

    @property
    def staging_bytes(self) -> int:
        return 2 * self.staging_rows * self.slot_bytes  # the staged states and the launches' outputs

    def _binding(self, graph: str, start: int, k: int, staging: bool) -> Any:
        """The binding of a launch of ``graph`` over rows start..start+k-1 of the staging buffers (``staging``) or
        of the slots (the current parity's buffers), its token ids and logits in this pool's arrays."""
        parity = -1 if staging else self.states.parity
        key = (graph, start, k, parity)
        if key not in self.bindings:
            binding = self.runner.sessions[graph].io_binding()
            logits = self.stage_logits if staging else self.logits
            binding.bind_output(LOGITS, "cpu", 0, np.float32, [k, logits.shape[1]], logits.ctypes.data)
            if staging:
                rows, read, write = (self.staging_rows, start, k), self.staging.get, self.staging_out.get
            else:
                rows, read, write = (self.max_batch, start, k), self.states.read, self.states.write
            bind_states(binding, "cpu", self.layout, rows, read, write)
            self.bindings[key] = binding
        return self.bindings[key]

    def warm_decode(self) -> int:
        """One decode launch of every slot, so that onnxruntime's arena takes, before serving, the memory of the
        largest decode launch: the resident size a server reports at idle is then the one it returns to after any
        load. The slots are zeroed again (nothing is captured: 0 shapes)."""
        self._launch(np.zeros(self.max_batch, np.int64))
        for buffer in self.states.buffers():
            buffer.fill(0.0)
        return 0

    def warm_prefill(self, graph: str) -> int:
        """As :meth:`warm_decode`, for the largest prefill launches: every staging row with the longest chunk each
        that a launch's rows allow, and one sequence with the longest chunk (the arena's blocks of the two differ:
        warmed with one alone, a server grew by ~20 MB at its first launch of the other, default model)."""
        shapes = {
            (self.staging_rows, self.runner.chunk_rows(graph, self.staging_rows)),
            (1, self.runner.max_rows[graph]),
        }
        for k, rows in sorted(shapes, reverse=True):
            self.stage(0, k=k)
            self.prefill(graph, 0, np.zeros((k, rows), np.int64))
        self.stage(0, k=self.staging_rows)
        return 0

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        rows = self.layout.rows
        if conv is None:
            for kind in STATES:
                rows(self.staging[kind], row, row + k)[...] = 0.0
        else:
            conv, ssm = self.runner.graph_state(conv, ssm)  # shapes checked
            conv, ssm = self.runner.sequence_state(conv, ssm)
            rows(self.staging[CONV_STATE], row)[...], rows(self.staging[SSM_STATE], row)[...] = conv, ssm

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        k = ids.shape[0]
        binding = self._binding(graph, start, k, staging=True)
        flat = self.stage_ids[: ids.size]
        flat[...] = ids.reshape(-1)
        binding.bind_input(TOKEN_IDS, "cpu", 0, np.int64, [flat.size], flat.ctypes.data)
        self.runner.sessions[graph].run_with_iobinding(binding)
        for kind in STATES:  # the written rows back where the staged states live
            self.layout.rows(self.staging[kind], start, start + k)[...] = self.layout.rows(
                self.staging_out[kind], start, start + k
            )
        self._logits = self.stage_logits[:k]

    def prefill_logits(self, i: int) -> np.ndarray:
        return self._logits[i].copy()

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        conv, ssm = (self.layout.rows(self.staging[k], row) for k in STATES)
        return (conv.copy(), ssm.copy()) if out is None else into(out, conv, ssm)

    def move_staged(self, src: int, dst: int) -> None:
        for kind in STATES:
            self.layout.rows(self.staging[kind], dst)[...] = self.layout.rows(self.staging[kind], src)

    def admit(self, slot: int, row: int, k: int = 1) -> None:
        for kind in STATES:
            dst = self.layout.rows(self.states.read(kind), slot, slot + k)
            dst[...] = self.layout.rows(self.staging[kind], row, row + k)

    def _launch(self, ids: np.ndarray) -> None:
        n = self.n = ids.size
        binding = self._binding(DECODE, 0, n, staging=False)
        self.ids[:n] = ids
        binding.bind_input(TOKEN_IDS, "cpu", 0, np.int64, [n], self.ids.ctypes.data)
        self.runner.sessions[DECODE].run_with_iobinding(binding)
        self.states.swap()

    def decode(self, ids: np.ndarray) -> np.ndarray:
        self._launch(ids)
        return self.logits[: self.n].copy()  # new: callers keep rows

    def decode_greedy(self, ids: np.ndarray) -> np.ndarray:
        self._launch(ids)  # ties: the first index, as the greedy graph's
        return self.logits[: self.n, : self.vocab].argmax(axis=1)

    def last_logits(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self.logits[row].copy()
        out[...] = self.logits[row, : out.size]
        return out

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        conv, ssm = (self.layout.rows(self.states.read(k), slot) for k in STATES)
        return into(out, conv, ssm) if out is not None else (conv.copy(), ssm.copy())

    def move(self, src: int, dst: int) -> None:
        for kind in STATES:
            buffer = self.states.read(kind)
            self.layout.rows(buffer, dst)[...] = self.layout.rows(buffer, src)
