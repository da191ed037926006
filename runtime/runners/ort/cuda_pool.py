"""The slot pool of onnxruntime's CUDA provider: decode slots in device memory, launched as captured CUDA graphs.

A launch for n sequences runs the smallest bucket b >= n (:func:`batch_buckets`) over slots 0..b-1: rows past n
hold free slots, computed and ignored. Each (b, parity) has fixed bindings (pointers into the pool), so it is
captured once and replayed. Prompts are staged and prefilled by :class:`~.cuda_staging.CudaStaging`.

With the kernels graphs the decode launches run on a stream of their own, of the device's highest priority, beside
the runner's prefill stream; a launch is queued without the host waiting for it (``async_decode``), a greedy
launch's picker and the copy of its picks to the host queued behind it, and the next greedy launch can be queued
behind that, fed those picks on the device (:meth:`CudaPool.feed`): the GPU then runs decode launches back to back.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np

from mambatrt.contract import CONV_STATE, DECODE, LOGITS, NEXT_TOKEN, PREFILL, SSM_STATE, STATES, TOKEN_IDS

from .. import cudart
from ..base import SlotPool
from ..cudart import DeviceRow, DeviceRows
from ..states import StateBuffers, bind_states
from .cuda import RUNS_TO_CAPTURE, OrtCudaRunner
from .cuda_staging import CudaStaging
from .loader import kernels_stream, sampler

Place = tuple[int, int]  # (device or host address, pitch in bytes) of one sequence's state of one kind


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the decode launch is padded to: powers of two, from 32 on in quarters of each octave (32, 40, 48,
    56, 64, 80, ...), and max_batch; few captured graphs, each reused. A server at concurrency 64 decodes ~40-64
    sequences (the others are being prefilled): padded to powers of two alone, the launches of 33-48 computed up
    to a third more rows than they needed, and in halves of the octave (48) up to 15 rows more (a decode launch
    of 48 sequences took 0.963 ms on the H200, of 64 1.028)."""
    sizes = {min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)}
    quarters = {q * 2**i for i in range(3, max_batch.bit_length()) for q in (5, 6, 7)}
    return sorted(sizes | {b for b in quarters if b < max_batch})


class CudaPool(SlotPool):
    """Slots in device memory (:class:`StateBuffers` of [max_batch, ...]), decoded by onnxruntime's CUDA provider;
    see the module docstring."""

    state_buffers = 2

    def __init__(self, runner: OrtCudaRunner, max_batch: int, graph: str = PREFILL) -> None:
        super().__init__(runner, max_batch)
        ort, c = runner.ort, runner.config
        self.captured = runner.captured.get(DECODE, False)  # as the runner's own decode graph could be
        self.concurrent = runner.concurrent
        # decode on a stream of its own beside the runner's (prefill) stream: launches of both can overlap, and the
        # decode kernels, of higher priority, are not held up behind the prefill kernels
        self.stream = kernels_stream(runner.bundle, urgent=True) if runner.concurrent else None
        # a launch on the pool's own stream need not be waited for inside onnxruntime's run: finish_decode waits for
        # that stream, and the engine thread does its host work meanwhile
        self.async_decode = self.stream is not None
        self.session, self.batched = self._decode_sessions()
        self.layout = layout = runner.layout
        self.shapes = layout.shapes  # one sequence's [L, E, ..] per kind
        self.states = StateBuffers({k: layout.buffer_shape(k, max_batch) for k in STATES}, self.alloc)
        self.sampler = sampler(runner.bundle)  # the kernels library's sampler on the device, when it has one
        self.device_sample = self.sampler is not None
        self.greedy = None  # the bundle's greedy picker on the device, when it has one
        if runner.bundle.greedy_path is not None:
            # on the decode stream: after the decode launch, not behind a prefill launch
            providers = [("CUDAExecutionProvider", runner.provider_options(self.stream))]
            self.greedy = ort.InferenceSession(str(runner.bundle.greedy_path), runner.options, providers=providers)
            self.device_greedy = True
        self.buckets = batch_buckets(max_batch)
        self.ids = {b: ort.OrtValue.ortvalue_from_numpy(np.zeros(b, np.int64), "cuda", 0) for b in self.buckets}
        # (bucket, parity) -> logits: one set per state buffer, so that a launch's logits outlive the next launch
        # (:meth:`prev_logits`: the engine caches a finished sequence's while the next launch runs)
        self.logits = {(b, p): self.alloc((b, c.vocab_padded)) for b in self.buckets for p in (0, 1)}
        self.launched = ((1, 1), (1, 0))  # (bucket, parity) of the last launch but one and of the last
        self.host_ids = np.zeros(max(self.buckets), np.int64)
        # pinned, one per launch parity (a fed launch's picks land while the host reads the launch before's)
        self.host_picks = [self.host_array((max(self.buckets) * 2,)).view(np.int64) for _ in range(2)]
        # begun launches not finished, oldest first: (n, (bucket, parity), picks queued behind it, index)
        self._begun: collections.deque[tuple[int, tuple[int, int], bool, int]] = collections.deque()
        # per launch parity: recorded on the decode stream once a greedy launch's picks are on the host
        self.done = [cudart.new_event() for _ in range(2)] if self.async_decode else []
        self._no_wait = ort.RunOptions()  # a run that returns once queued on its stream
        self._no_wait.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.next = {b: ort.OrtValue.ortvalue_from_numpy(np.zeros(b, np.int64), "cuda", 0) for b in self.buckets}
        self.picks: dict[tuple[int, int], Any] = {}  # (bucket, parity) -> the greedy picker's binding
        self.replays: dict[tuple[int, int], tuple] = {}
        self.unsettled = False  # copies or memsets queued on the default stream since the last launch
        self.count = 0  # decode launches begun: the next one's index
        self.prompts = CudaStaging(self, graph)
        self.staging_rows = self.prompts.rows

    def alloc(self, shape: tuple[int, ...]) -> Any:
        """A float32 device buffer (an OrtValue)."""
        return self.runner.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, "cuda", 0)

    @property
    def staging_bytes(self) -> int:
        return 2 * self.staging_rows * self.slot_bytes  # the staged states and the launches' outputs

    def _decode_sessions(self) -> tuple[Any, Any]:
        """The decode sessions: for one sequence the kernels graph, for more its CUDA copy where the bundle has one
        (MambaLinear runs a batch's projections faster than cuBLAS, one sequence's slower than cuBLAS's GEMV) and it
        can run (:meth:`OrtCudaRunner.linear_copy`), else the same session. The copy's session holds a second copy
        of the weights on the device."""
        open_ = self.runner.open_session
        plain = open_(DECODE, capture=self.captured, stream=self.stream)
        if not self.runner.linear_copy(DECODE):
            return plain, plain
        return plain, open_(DECODE, capture=self.captured, stream=self.stream, copy="cuda")

    @property
    def linear(self) -> bool:
        """Whether decode batches of 2 and more run the kernels graph's CUDA copy (MambaLinear)."""
        return self.batched is not self.session

    def _decode_session(self, b: int) -> Any:
        """The session of a decode launch of bucket ``b`` (:meth:`_decode_sessions`)."""
        return self.session if b == 1 else self.batched

    # -- states between places: slots, staging rows, the cache's rows, the host ------------------------------
    def host_array(self, shape: tuple[int, ...]) -> np.ndarray:
        """Pinned host memory (:func:`cudart.pinned`)."""
        return cudart.pinned(shape)

    def cache_rows(self, capacity: int, shapes: tuple[tuple[int, ...], ...]) -> list:
        """The cached states in device memory (:class:`DeviceRows`: a state is cached and restored by one
        device-to-device copy, ~3 us for mamba-130m's 2.8 MB, where a copy to pinned host memory took 0.07-0.1 ms
        and its round trip 13 % of the tokens/s at concurrency 64 on the H200); the logits in pinned host memory,
        where sampling reads them."""
        rows: list = []
        for shape in shapes[:2]:
            buffer = self.alloc((capacity, *shape))
            rows.append(DeviceRows(buffer, buffer.data_ptr(), shape))
        return rows + [self.host_array((capacity, *shape)) for shape in shapes[2:]]

    def states_out(self, where: Callable[[str], Place], out: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's states, copied out of the device places ``where(name)``: into ``out`` when given
        (contiguous float32 host arrays of the states' shapes, or the state cache's :class:`DeviceRow` s: then the
        copy stays on the device), else into new host arrays."""
        if out is not None and isinstance(out[0], DeviceRow):
            self.on_device(self.cached(*out), where)
            return out
        hosts = []
        for i, name in enumerate(STATES):
            host = np.empty(self.shapes[name], np.float32) if out is None else out[i]
            assert host.flags.c_contiguous and host.dtype == np.float32 and host.shape == tuple(self.shapes[name])
            self.copy2d(self.host(name, host), where(name), name)
            hosts.append(host)
        return hosts[0], hosts[1]

    def host(self, name: str, host: np.ndarray) -> Place:
        """The place of one sequence's contiguous host array [L, E, ..] of state ``name``."""
        return host.ctypes.data, self.layout.pitch(name, 1)

    def cached(self, conv: DeviceRow, ssm: DeviceRow) -> Callable[[str], Place]:
        """State name -> the place of a cached state's rows (one sequence's contiguous [L, E, ..])."""
        rows = {CONV_STATE: conv.address, SSM_STATE: ssm.address}
        return lambda name: (rows[name], self.layout.pitch(name, 1))

    def on_device(self, dst: Callable[[str], Place], src: Callable[[str], Place], k: int = 1) -> None:
        """Copy the states of k consecutive sequences from the places ``src(name)`` to ``dst(name)``. The copy
        returns before it finishes; the default stream runs such copies in order, and the next launch waits for
        them (:meth:`settle`)."""
        for name in STATES:
            self.copy2d(dst(name), src(name), name, k)
        self.unsettled = True

    def settle(self) -> None:
        """Wait for the copies and memsets queued since the last launch (on the default stream, which
        onnxruntime's own stream need not wait for): one wait per launch, not one per copy. On non-blocking streams
        (``concurrent``) the wait is for the legacy stream alone, every time (the token ids' copy too), so a decode
        launch does not wait for a prefill launch running beside it."""
        if self.concurrent:
            self.runner.settle()
        elif self.unsettled:
            cudart.check(cudart.cudart().cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            self.unsettled = False

    def copy2d(self, dst: Place, src: Place, name: str, k: int = 1) -> None:
        """Copy k consecutive rows of state ``name`` between two places: one 2-D copy, of one piece per layer where
        the states are layered."""
        cudart.copy2d(dst, src, *self.layout.extent(name, k))

    def slot(self, name: str, slot: int, prev: bool = False) -> Place:
        """The place of ``slot``'s state ``name`` in the current buffer (``prev``: the other one, which a begun
        launch reads and the launch before wrote)."""
        buffer = self.states.write(name) if prev else self.states.read(name)
        return buffer.data_ptr() + self.layout.offset(name, slot), self.layout.pitch(name, self.max_batch)

    def admit(self, slot: int, row: int, k: int = 1) -> None:
        self.on_device(lambda name: self.slot(name, slot), lambda name: self.prompts.row(name, row), k)

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.states_out(lambda name: self.slot(name, slot), out)

    def prev_slot_state(
        self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        return self.states_out(lambda name: self.slot(name, slot, prev=True), out)

    def move(self, src: int, dst: int) -> None:
        self.on_device(lambda name: self.slot(name, dst), lambda name: self.slot(name, src))

    # -- prompts: the staging rows (:class:`CudaStaging`) ------------------------------------------------------
    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        self.prompts.stage(row, conv, ssm, k)

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        self.prompts.prefill(graph, start, ids)

    def prefill_logits(self, i: int) -> np.ndarray:
        return self.prompts.logits_row(i)

    def prefill_sample(self, params: np.ndarray) -> np.ndarray:
        return self.prompts.sample(params)

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.states_out(lambda name: self.prompts.row(name, row), out)

    def move_staged(self, src: int, dst: int) -> None:
        self.on_device(lambda name: self.prompts.row(name, dst), lambda name: self.prompts.row(name, src))

    def warm_prefill(self, graph: str) -> int:
        return self.prompts.warm(graph)

    # -- decode launches ----------------------------------------------------------------------------------------
    def warm_decode(self) -> int:
        """Capture every decode bucket (both state parities); returns how many shapes. onnxruntime keeps a captured
        graph in the capturing thread's context, so this runs on the thread that will decode. Each graph id runs
        three times (RUNS_TO_CAPTURE). The slots hold no sequence yet: the launches compute on zeros and leave them
        free."""
        if not self.captured:
            return 0
        ids = np.zeros(self.max_batch, np.int64)
        for b in self.buckets:
            for _ in range(2 * RUNS_TO_CAPTURE):  # the parities alternate
                self.decode_greedy(ids[:b]) if self.greedy is not None else self._launch(ids[:b])
        return 2 * len(self.buckets)

    def _replay(self, b: int) -> tuple:
        key = (b, self.states.parity)
        if key not in self.replays:
            binding = self._decode_session(b).io_binding()
            binding.bind_ortvalue_input(TOKEN_IDS, self.ids[b])
            binding.bind_ortvalue_output(LOGITS, self.logits[key])
            bind_states(binding, "cuda", self.layout, (self.max_batch, 0, b), self.states.read, self.states.write)
            both = []
            for wait in (True, False):
                options = self.runner.ort.RunOptions()
                if self.captured:  # graph ids apart from the runner's own (2 * rows + parity + 1 <= 2 * 64 + 2)
                    options.add_run_config_entry("gpu_graph_id", str(1000 + 2 * b + self.states.parity))
                if not wait:  # onnxruntime returns once the launch is queued on the stream
                    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
                both.append(options)
            self.replays[key] = (binding, *both)
        return self.replays[key]

    def _launch(self, ids: np.ndarray | None, wait: bool = True, n: int = 0) -> int:
        """The decode launch of n = ids.size sequences, padded to a bucket; returns the bucket. ``wait`` False:
        return once it is queued (``async_decode`` only). ``ids`` None: the n sequences of the launch before, fed
        its picks (:meth:`feed`)."""
        n = n if ids is None else ids.size
        b = next(b for b in self.buckets if b >= n)
        if ids is not None:
            self.host_ids[:b] = 0
            self.host_ids[:n] = ids
            self.ids[b].update_inplace(self.host_ids[:b])
        binding, *both = self._replay(b)
        self.settle()  # copies on the default stream first: the cache's, of the states the launch overwrites
        if ids is None:  # the picks of the launch before (the same bucket) on the stream, padding rows' too
            status = cudart.cudart().cudaMemcpyAsync(
                self.ids[b].data_ptr(), self.next[b].data_ptr(), 8 * b, cudart.MEMCPY_DEVICE_TO_DEVICE, self.stream
            )
            cudart.check(status, "cudaMemcpyAsync")
        try:
            self._decode_session(b).run_with_iobinding(binding, both[0 if wait else 1])
        except Exception as exc:  # onnxruntime's own types; a capture it cannot make: run plainly from now on
            if not self.captured:
                raise
            self.runner.notes.append(
                f"batched decode: CUDA graph capture failed, launches run node by node (slower): {str(exc)[:200]}"
            )
            self.captured, self.replays = False, {}
            self.session, self.batched = self._decode_sessions()
            binding, *both = self._replay(b)
            self._decode_session(b).run_with_iobinding(binding, both[0])
        self.launched = (self.launched[1], (b, self.states.parity))
        self.states.swap()
        return b

    def begin_decode(self, ids: np.ndarray, how: str = "logits") -> None:
        """Where the launch runs without the host waiting for it (``async_decode``), a greedy launch's picker and the
        copy of its picks to the host are queued behind it on its stream: :meth:`finish_decode` then waits once and
        reads them, where it ran the picker and copied its picks after the launch, the GPU idle meanwhile."""
        self._launch(ids, wait=not self.async_decode)
        self._queue_picks(how, ids.size)

    @property
    def can_feed(self) -> bool:
        """Whether :meth:`feed` queues a launch behind the one begun (a greedy launch's picks stay on the device)."""
        return self.async_decode and self.greedy is not None

    def feed(self, n: int) -> None:
        """The next launch queued on the decode stream behind the last one begun, its ids that launch's picks (a
        device-to-device copy on the stream): the device runs the two back to back, where the host would otherwise
        wait for the picks, then begin the next launch."""
        assert self.can_feed and self._begun and self._begun[-1][2] and self._begun[-1][0] == n
        self._launch(None, wait=False, n=n)
        self._queue_picks("greedy", n)

    def _queue_picks(self, how: str, n: int) -> None:
        """After a launch of n sequences: queue a greedy launch's picker and the copy of its picks to the host
        behind it (``async_decode``), and note it as begun."""
        queued = how == "greedy" and self.async_decode
        key, index = self.launched[1], self.count
        if queued:
            self.greedy.run_with_iobinding(self._picker(key), self._no_wait)
            host = self.host_picks[index % 2]
            status = cudart.cudart().cudaMemcpyAsync(
                host.ctypes.data, self.next[key[0]].data_ptr(), 8 * n, cudart.MEMCPY_DEVICE_TO_HOST, self.stream
            )
            cudart.check(status, "cudaMemcpyAsync")
            cudart.check(cudart.cudart().cudaEventRecord(self.done[index % 2], self.stream), "cudaEventRecord")
        self._begun.append((n, key, queued, index))
        self.count += 1

    def _picker(self, key: tuple[int, int]) -> Any:
        """The greedy picker's binding for launch ``key`` (bucket, parity): its logits in, the picks to ``next``."""
        if key not in self.picks:
            binding = self.greedy.io_binding()
            binding.bind_ortvalue_input(LOGITS, self.logits[key])
            binding.bind_ortvalue_output(NEXT_TOKEN, self.next[key[0]])
            self.picks[key] = binding
        return self.picks[key]

    def finish_decode(self, how: str, params: np.ndarray | None = None) -> np.ndarray:
        n, key, queued, index = self._begun.popleft()
        if queued:  # the picks are on their way to the host (begin_decode): wait for them, not for the stream
            assert how == "greedy"
            cudart.check(cudart.cudart().cudaEventSynchronize(self.done[index % 2]), "cudaEventSynchronize")
            return self.host_picks[index % 2][:n].copy()
        assert not self._begun  # only a launch whose picks stay on the device has one queued behind it
        if self.async_decode:
            cudart.check(cudart.cudart().cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        b, logits = key[0], self.logits[key]
        if how == "greedy":
            self.greedy.run_with_iobinding(self._picker(key))
            out = np.empty(n, np.int64)
            cudart.copy(out.ctypes.data, self.next[b].data_ptr(), out.nbytes)
            return out
        if how == "sample":
            stream = self.stream if self.stream is not None else self.runner.stream
            return self.sample(logits, params, stream)
        out = np.empty((n, self.runner.config.vocab_padded), np.float32)  # new: callers keep rows
        cudart.copy(out.ctypes.data, logits.data_ptr(), out.nbytes)
        return out

    def decode(self, ids: np.ndarray) -> np.ndarray:
        self.begin_decode(ids)
        return self.finish_decode("logits")

    def decode_greedy(self, ids: np.ndarray) -> np.ndarray:
        self.begin_decode(ids, "greedy")
        return self.finish_decode("greedy")

    def decode_sample(self, ids: np.ndarray, params: np.ndarray) -> np.ndarray:
        self.begin_decode(ids, "sample")
        return self.finish_decode("sample", params)

    def sample(self, logits: Any, params: np.ndarray, stream: int | None) -> np.ndarray:
        """The kernels library's sampler over the first n rows of the device logits ``logits`` [b >= n, Vp], n
        being the rows of ``params`` float64 [n, 2]; the picks int64 [n] on the host."""
        params = np.ascontiguousarray(params, dtype=np.float64)
        n = params.shape[0]
        assert params.shape == (n, 2) and n <= logits.shape()[0]
        out = np.empty(n, np.int64)
        c = self.runner.config
        why = self.sampler(
            logits.data_ptr(), n, c.vocab_padded, c.vocab_size, params.ctypes.data, out.ctypes.data, stream
        )
        if why:
            raise RuntimeError(f"sampling on the device failed: {why.decode()}")
        return out

    def last_logits(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        return self._logits_row(self.launched[1], row, out)

    def prev_logits(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        return self._logits_row(self.launched[0], row, out)

    def _logits_row(self, key: tuple[int, int], row: int, out: np.ndarray | None) -> np.ndarray:
        vp = self.runner.config.vocab_padded
        out = np.empty(vp, np.float32) if out is None else out
        assert out.flags.c_contiguous and out.dtype == np.float32 and out.size <= vp
        cudart.copy(out.ctypes.data, self.logits[key].data_ptr() + row * 4 * vp, out.nbytes)
        return out
