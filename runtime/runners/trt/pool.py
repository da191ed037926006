"""The slot pool of the TensorRT runner: decode slots and staging rows in device memory, for continuous batching.

The portable graphs' states are stacked ([rows, L, E, ..]): a sequence's state is one contiguous row, so a launch
over rows start..start+k-1 binds one block, and moving a state is one copy. A decode launch over slots 0..n-1 reads
one of two slot buffers and writes the other; a prefill launch reads staging rows and writes a second staging
buffer, whence its rows are copied back. Every launch and copy is queued on the runner's stream, in order: the
engine runs this pool's launches in turn, prefill and decode alike. Tokens are picked on the host.
"""

from __future__ import annotations

import numpy as np

from mambatrt.contract import CONV_STATE, DECODE, SSM_STATE, STATES

from ..base import SlotPool, prefill_batch
from ..states import StateBuffers
from .runner import StateBinds, TrtRunner


class TrtPool(SlotPool):
    """Slots and staging rows of a :class:`TrtRunner` (see the module docstring)."""

    state_buffers = 2

    def __init__(self, runner: TrtRunner, max_batch: int, graph: str) -> None:
        super().__init__(runner, max_batch)
        self.layout = layout = runner.layout
        self.staging_rows = prefill_batch(runner, graph, max_batch)
        self.states = StateBuffers({k: layout.buffer_shape(k, max_batch) for k in STATES}, runner.alloc)
        self.staging = {k: runner.alloc(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.staging_out = {k: runner.alloc(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        vp = runner.config.vocab_padded
        ids = max(max_batch, self.staging_rows * runner.max_rows[graph])
        self.ids = runner.alloc((ids,), np.int64)
        self.logits = runner.alloc((max(max_batch, self.staging_rows), vp))
        self.host_logits = np.empty((max(max_batch, self.staging_rows), vp), np.float32)
        self.n = 0  # rows of the last launch's logits on the host

    @property
    def staging_bytes(self) -> int:
        return 2 * self.staging_rows * self.slot_bytes  # the staged states and the launches' outputs

    def _row(self, buffer, kind: str, row: int) -> int:
        """The address of row ``row`` of a state buffer."""
        return buffer.ptr + self.layout.offset(kind, row)

    def _binds(self, read: dict, write: dict, start: int, k: int) -> StateBinds:
        """The state binds of a launch over rows start..start+k-1 of the buffers ``read`` and ``write``."""
        binds = []
        for name, out_name, kind, shape, offset in self.layout.binds(0, start, k):
            binds.append((name, out_name, shape, read[kind].ptr + offset, write[kind].ptr + offset))
        return binds

    def _launch(self, graph: str, ids: np.ndarray, binds: StateBinds, k: int) -> None:
        """Queue one launch of ``graph`` (flat ids) and bring its k rows of logits to the host."""
        runner = self.runner
        flat = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        runner.copy(self.ids.ptr, flat.ctypes.data, flat.nbytes)
        runner.launch(graph, self.ids.ptr, flat.size, binds, self.logits.ptr)
        self.n = k
        runner.copy(self.host_logits.ctypes.data, self.logits.ptr, 4 * k * self.host_logits.shape[1])
        runner.stream.synchronize()

    def _move(self, dst_buffer, dst: int, src_buffer, src: int, kind: str, k: int = 1) -> None:
        self.runner.copy(self._row(dst_buffer, kind, dst), self._row(src_buffer, kind, src), k * self.layout.step[kind])

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        if conv is None:
            for kind in STATES:
                zeros = np.zeros(k * self.layout.step[kind] // 4, np.float32)
                self.runner.copy(self._row(self.staging[kind], kind, row), zeros.ctypes.data, zeros.nbytes)
        else:
            conv, ssm = self.runner.graph_state(conv, ssm)  # shapes checked, contiguous
            for kind, host in ((CONV_STATE, conv), (SSM_STATE, ssm)):
                self.runner.copy(self._row(self.staging[kind], kind, row), host.ctypes.data, host.nbytes)
        self.runner.stream.synchronize()  # the host arrays go out of scope

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        k = ids.shape[0]
        self._launch(graph, ids, self._binds(self.staging, self.staging_out, start, k), k)
        for kind in STATES:  # the written rows back where the staged states live
            self._move(self.staging[kind], start, self.staging_out[kind], start, kind, k)
        self._logits = self.host_logits[:k]

    def prefill_logits(self, i: int) -> np.ndarray:
        return self._logits[i].copy()

    def _host_state(self, buffer: dict, row: int, out: tuple | None) -> tuple[np.ndarray, np.ndarray]:
        shapes = self.layout.shapes
        hosts = out if out is not None else tuple(np.empty(shapes[k], np.float32) for k in STATES)
        for kind, host in zip(STATES, hosts, strict=True):
            assert host.flags.c_contiguous and host.dtype == np.float32 and host.shape == tuple(shapes[kind])
            self.runner.copy(host.ctypes.data, self._row(buffer[kind], kind, row), host.nbytes)
        self.runner.stream.synchronize()
        return hosts[0], hosts[1]

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._host_state(self.staging, row, out)

    def move_staged(self, src: int, dst: int) -> None:
        for kind in STATES:
            self._move(self.staging[kind], dst, self.staging[kind], src, kind)

    def admit(self, slot: int, row: int, k: int = 1) -> None:
        for kind in STATES:
            self._move(self.states.read(kind), slot, self.staging[kind], row, kind, k)

    def decode(self, ids: np.ndarray) -> np.ndarray:
        n = ids.size
        slots = {k: self.states.read(k) for k in STATES}
        out = {k: self.states.write(k) for k in STATES}
        self._launch(DECODE, ids, self._binds(slots, out, 0, n), n)
        self.states.swap()
        return self.host_logits[:n].copy()  # new: callers keep rows

    def last_logits(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self.host_logits[row].copy()
        out[...] = self.host_logits[row, : out.size]
        return out

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._host_state({k: self.states.read(k) for k in STATES}, slot, out)

    def move(self, src: int, dst: int) -> None:
        for kind in STATES:
            buffer = self.states.read(kind)
            self._move(buffer, dst, buffer, src, kind)

    def close(self) -> None:
        for buf in self.states.buffers() + [*self.staging.values(), *self.staging_out.values(), self.ids, self.logits]:
            buf.free()
