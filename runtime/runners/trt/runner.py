"""TensorRT plans: one sequence on the runner (both execution contexts share its state buffers), many in its slot
pool (:mod:`.pool`). Device buffers and copies through Polygraphy's CUDA wrapper (no torch)."""

from __future__ import annotations

import numpy as np

from mambatrt.contract import CONV_STATE, LOGITS, PREFILL, SSM_STATE, STATE_PAIRS, TOKEN_IDS
from mambatrt.tensorrt_flavour import find_tensorrt, import_polygraphy

from ...bundle import Bundle
from ..base import Runner, SinglePool, SlotPool
from ..states import StateBuffers
from .loader import check_plans, load_engines

# (input, output, shape, input address, output address) of each state tensor of one launch
StateBinds = list[tuple[str, str, tuple[int, ...], int, int]]


class TrtRunner(Runner):
    """TensorRT plans of the portable graphs: an execution context per plan, launched on one stream."""

    name = "tensorrt"

    def __init__(self, bundle: Bundle) -> None:
        super().__init__(bundle, "cuda")
        check_plans(bundle)
        trt = find_tensorrt()
        self.cuda = import_polygraphy("polygraphy.cuda")
        self.trt = trt.module
        self.stream = self.cuda.Stream()
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.ERROR))
        self.engines = load_engines(bundle, self.runtime, self.trt)
        self.contexts = {graph: engine.create_execution_context() for graph, engine in self.engines.items()}
        self.states = StateBuffers(self._state_shapes(), self.alloc)
        self.ids = self.alloc((max(self.max_rows[g] for g in self.graphs),), np.int64)
        self.logits = self.alloc((1, self.config.vocab_padded))
        self.host_logits = np.empty((1, self.config.vocab_padded), np.float32)
        self.reset()

    def alloc(self, shape: tuple[int, ...], dtype=np.float32):
        """A device array (Polygraphy's) of ``shape``; its ``ptr`` is its address."""
        return self.cuda.DeviceArray(shape=shape, dtype=dtype)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """A copy between two addresses, host or device, ordered with this runner's stream."""
        if nbytes:
            self.cuda.wrapper().memcpy(dst, src, nbytes, self.cuda.MemcpyKind.Default, self.stream.ptr)

    def launch(self, graph: str, ids_ptr: int, rows: int, states: StateBinds, logits_ptr: int) -> None:
        """Queue one execution of ``graph``'s plan on the stream: ``rows`` token ids at ``ids_ptr``, the states as
        ``states`` binds them, the logits to ``logits_ptr``. Input and output of one execution never share a
        buffer."""
        ctx = self.contexts[graph]
        ctx.set_input_shape(TOKEN_IDS, (rows,))
        ctx.set_tensor_address(TOKEN_IDS, ids_ptr)
        for name, out_name, shape, src, dst in states:
            ctx.set_input_shape(name, shape)  # the batch axis of a decode plan is dynamic
            ctx.set_tensor_address(name, src)
            ctx.set_tensor_address(out_name, dst)
        ctx.set_tensor_address(LOGITS, logits_ptr)
        if not ctx.execute_async_v3(self.stream.ptr):
            raise RuntimeError(f"TensorRT execution of the {graph} plan failed")

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        states = self.states
        self.ids.copy_from(ids, stream=self.stream)
        binds = [
            (name, out, states.read(name).shape, states.read(name).ptr, states.write(name).ptr)
            for name, out in STATE_PAIRS
        ]
        self.launch(graph, self.ids.ptr, ids.size, binds, self.logits.ptr)
        states.swap()
        self.copy(self.host_logits.ctypes.data, self.logits.ptr, self.host_logits.nbytes)
        self.stream.synchronize()
        return self.host_logits[0].copy()

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for name in (CONV_STATE, SSM_STATE):
            buf = self.states.read(name)
            host = np.empty(buf.shape, np.float32)
            self.copy(host.ctypes.data, buf.ptr, host.nbytes)
            out.append(host)
        self.stream.synchronize()
        return self.sequence_state(out[0], out[1])

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.graph_state(conv, ssm)
        self.states.read(CONV_STATE).copy_from(conv, stream=self.stream)
        self.states.read(SSM_STATE).copy_from(ssm, stream=self.stream)
        self.stream.synchronize()

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        if max_batch > 1 and self.bundle.manifest.batched:
            from .pool import TrtPool

            return TrtPool(self, max_batch, graph)
        return SinglePool(self, 1)

    def close(self) -> None:
        for buf in self.states.buffers() + [self.ids, self.logits]:
            buf.free()
        self.stream.free()
