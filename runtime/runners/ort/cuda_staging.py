"""The staging rows of the CUDA slot pool: where prompts are prefilled, several per launch.

``buffers`` [S, ...] hold the staged prompts' states; a prefill launch over rows start..start+k-1 reads them there,
writes ``out`` and copies its rows back (no parity: a launch over some rows leaves the others where they are). It
runs in the runner's own prefill session (no second copy of the weights), or, for a "single" bundle's prompts fed
token by token, in the pool's decode session; a launch of full chunks from row 0 (k prompts, each the longest chunk
a k-prompt launch takes: :meth:`Runner.chunk_rows`) is captured when it repeats (and at warm-up), other shapes run
plainly, their token ids in one device buffer of the largest launch's, bound where they lie (a binding and a buffer
per shape grew with every prompt length a server met, up to the kernels graph's 2048 rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mambatrt.contract import CONV_STATE, DECODE, LOGITS, PREFILL, SSM_STATE, STATES, TOKEN_IDS

from .. import cudart
from ..base import prefill_batch
from ..cudart import DeviceRow
from ..states import bind_states
from .cuda import RUNS_TO_CAPTURE

if TYPE_CHECKING:
    from .cuda_pool import CudaPool, Place


class CudaStaging:
    """The staging rows of a :class:`~.cuda_pool.CudaPool` and the prefill launches over them."""

    def __init__(self, pool: CudaPool, graph: str) -> None:
        self.pool = pool
        self.runner = runner = pool.runner
        self.rows = prefill_batch(runner, graph, pool.max_batch)  # prompts one launch prefills
        layout = pool.layout
        self.buffers = {k: pool.alloc(layout.buffer_shape(k, self.rows)) for k in STATES}
        self.out = {k: pool.alloc(layout.buffer_shape(k, self.rows)) for k in STATES}
        self.ids: dict[int, Any] = {}  # rows k x T -> device int64 [k x T] (captured launches' ids)
        self.logits: dict[int, Any] = {}  # k -> device float32 [k, Vp]
        self.replays: dict[tuple, tuple] = {}  # (graph, k, T) -> (binding, run options) of captured launches
        self.seen: set[tuple] = set()  # (graph, k, T) run once: captured when it comes again
        self.capture = True  # False once onnxruntime failed to capture a staging launch
        self.plain: dict[tuple, Any] = {}  # (graph, start, k) -> binding of a launch run plainly (ids bound per launch)
        self.flat: dict[str, Any] = {}  # graph -> device int64 [its largest launch's rows]: plain launches' ids
        self.sessions: dict[str, Any] = {}  # graph -> the session the bindings above belong to
        self.k = 1  # the last prefill launch's batch
        self.graph = PREFILL  # the last prefill launch's graph
        self.host: np.ndarray | None = None  # [S, Vp] pinned: the last launch's logits, once fetched
        self.fetched = False  # whether ``host`` holds the last launch's logits

    def row(self, name: str, row: int, out: bool = False) -> Place:
        """The place of staging row ``row`` of state ``name`` (``out``: in the launches' output buffer)."""
        buffer = (self.out if out else self.buffers)[name]
        layout = self.pool.layout
        return buffer.data_ptr() + layout.offset(name, row), layout.pitch(name, self.rows)

    def session(self, graph: str) -> tuple[Any, bool]:
        """(session, captured) that runs ``graph``'s staging launches: the runner's prefill session, or the pool's
        decode session (a "single" bundle's prompts, token by token)."""
        if graph == DECODE:
            return self.pool.session, self.pool.captured
        graph_runner = self.runner.graph_runners[graph]
        return graph_runner.session, graph_runner.captured

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        pool = self.pool
        if conv is None:
            for name in STATES:
                address, pitch = self.row(name, row)
                status = cudart.cudart().cudaMemset2D(address, pitch, 0, *pool.layout.extent(name, k))
                cudart.check(status, "cudaMemset2D")
            pool.unsettled = True
            return
        if isinstance(conv, DeviceRow):  # a cached state: it never left the device
            pool.on_device(lambda name: self.row(name, row), pool.cached(conv, ssm))
            return
        conv, ssm = self.runner.graph_state(conv, ssm)  # contiguous float32
        for name, host in ((CONV_STATE, conv), (SSM_STATE, ssm)):
            pool.copy2d(self.row(name, row), pool.host(name, host), name)
        pool.unsettled = True  # a copy from pageable memory may still be on its way to the device

    def _binding(self, graph: str, start: int, k: int) -> Any:
        """A binding of one staging launch over rows start..start+k-1: its logits and states (the caller binds the
        token ids)."""
        session, _ = self.session(graph)
        ort, vp = self.runner.ort, self.runner.config.vocab_padded
        if k not in self.logits:
            self.logits[k] = ort.OrtValue.ortvalue_from_shape_and_type([k, vp], np.float32, "cuda", 0)
        binding = session.io_binding()
        binding.bind_ortvalue_output(LOGITS, self.logits[k])
        bind_states(binding, "cuda", self.pool.layout, (self.rows, start, k), self.buffers.get, self.out.get)
        return binding

    def _captured_ids(self, n: int) -> Any:
        """The device buffer of a captured launch's n ids (a captured graph reads them where it was captured)."""
        if n not in self.ids:
            self.ids[n] = self.runner.ort.OrtValue.ortvalue_from_numpy(np.zeros(n, np.int64), "cuda", 0)
        return self.ids[n]

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        """One launch: chunk ``ids[i]`` (ids [k, T] int64) to staging row start + i, for i < k."""
        k, rows = ids.shape
        flat = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        session, captured = self.session(graph)
        if session is not self.sessions.setdefault(graph, session):  # the runner reopened its graph plainly
            self.sessions[graph] = session
            self.plain, self.replays = {}, {}  # bindings belong to a session
        key = (graph, k, rows)
        full = start == 0 and rows == self.runner.chunk_rows(graph, k)
        replay = self.capture and captured and full and key in self.seen
        self.seen.add(key)
        if replay:
            if key not in self.replays:
                options = self.runner.ort.RunOptions()  # graph ids apart from the runner's own and the decode's
                options.add_run_config_entry("gpu_graph_id", str(100000 + 2 * k + (graph == DECODE)))
                binding = self._binding(graph, 0, k)
                binding.bind_ortvalue_input(TOKEN_IDS, self._captured_ids(k * rows))
                self.replays[key] = (binding, options)
            binding, options = self.replays[key]
            self.ids[k * rows].update_inplace(flat)
        else:
            binding, options = self._plain_launch(graph, start, k, flat, captured)
        self.pool.settle()
        try:
            session.run_with_iobinding(binding, options)
        except Exception as exc:  # onnxruntime's own types; a capture it cannot make: no more staging captures
            if not replay:
                raise
            self.runner.notes.append(
                f"batched prefill: CUDA graph capture failed, launches run node by node (slower): {str(exc)[:200]}"
            )
            self.capture = False
            binding, options = self._plain_launch(graph, start, k, flat, captured)
            self.pool.settle()
            session.run_with_iobinding(binding, options)
        for name in STATES:  # the written rows back where the states live
            self.pool.copy2d(self.row(name, start), self.row(name, start, out=True), name, k)
        self.pool.unsettled = True
        self.k, self.graph = k, graph
        self.fetched = False

    def _plain_launch(self, graph: str, start: int, k: int, flat: np.ndarray, captured: bool) -> tuple[Any, Any]:
        """(binding, run options) of a staging launch of the ids ``flat`` (int64 [k x T], copied to the device
        here) run plainly; a session with CUDA graphs enabled runs it under graph id -1."""
        if (graph, start, k) not in self.plain:
            self.plain[graph, start, k] = self._binding(graph, start, k)
        if graph not in self.flat:  # the largest launch's ids: a chunk per staging row within a launch's rows
            n = self.runner.staged_launch_rows(graph, self.rows)
            self.flat[graph] = self.runner.ort.OrtValue.ortvalue_from_numpy(np.zeros(n, np.int64), "cuda", 0)
        ids = self.flat[graph].data_ptr()
        cudart.copy(ids, flat.ctypes.data, flat.nbytes)
        self.pool.unsettled = True  # a copy from pageable memory may still be on its way to the device
        binding = self.plain[graph, start, k]
        binding.bind_input(TOKEN_IDS, "cuda", 0, np.int64, [flat.size], ids)
        options = None
        if captured:
            options = self.runner.ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", "-1")
        return binding, options

    def logits_row(self, i: int) -> np.ndarray:
        """Row i of the last launch's logits. The first call after a launch brings all k rows to pinned memory in
        one copy: a launch that finishes 16 prompts needs all 16 (their first tokens), and 16 copies of 0.2 MB
        into fresh pageable arrays cost more than the one of 3.2 MB."""
        if not self.fetched:
            if self.host is None:
                self.host = cudart.pinned((self.rows, self.runner.config.vocab_padded))
            rows = self.host[: self.k]
            cudart.copy(rows.ctypes.data, self.logits[self.k].data_ptr(), rows.nbytes)
            self.fetched = True
        return self.host[i].copy()

    def sample(self, params: np.ndarray) -> np.ndarray:
        """The first token after each row of the last launch, picked on the device (:meth:`CudaPool.sample`): on the
        stream of the launch's session, from this thread (the decode thread samples on its own stream meanwhile;
        the sampler keeps device buffers per stream)."""
        stream = self.pool.stream if self.graph == DECODE else self.runner.stream
        return self.pool.sample(self.logits[self.k], params, stream)

    def warm(self, graph: str) -> int:
        """Capture every staging launch of k full chunks from row 0 (k = 1..rows, each chunk the longest a k-prompt
        launch takes), on the thread that will run the prefill launches (see :meth:`CudaPool.warm_decode`); returns
        how many shapes."""
        _, captured = self.session(graph)
        if not (self.pool.captured and captured and self.capture):
            return 0
        for k in range(1, self.rows + 1):
            for row in range(k):
                self.stage(row)
            ids = np.zeros((k, self.runner.chunk_rows(graph, k)), np.int64)
            for _ in range(1 + RUNS_TO_CAPTURE):  # the first runs plainly (a shape seen once), then its graph id
                self.prefill(graph, 0, ids)
        return self.rows
