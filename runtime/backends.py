"""Execution backends with one face, one per device: onnxruntime on the CPU, onnxruntime on CUDA, TensorRT.

Every backend keeps the recurrent states itself (on the device where it runs) and exposes:

    run(graph, token_ids[S]) -> logits [Vp] float32 on the host   (graph "prefill": 1..max rows; "decode": 1)
    reset()  get_state() -> (conv [L,E,K-1], ssm [L,E,N])  set_state(conv, ssm)  close()

and is a context manager (``with open_backend(bundle) as backend:`` closes it). :class:`Backend` does the checks
and bookkeeping shared by all of them; a subclass only binds buffers and executes. Input and output of one execution
never share a buffer: device backends keep the states in :class:`StateBuffers` (two buffers per state, read A write
B, then swap), shared by the prefill and decode graphs. Each graph's inputs and outputs are checked against the I/O
contract (:mod:`mambatrt.contract`) when it is opened.

For serving, ``open_pool`` gives a :class:`SlotPool`: the decode slots of continuous batching and the staging rows
where prompts are prefilled (several per launch where the prefill graph takes a batch), on the backend's device.
Needs numpy, plus onnxruntime or TensorRT.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from mambatrt.contract import (
    CONV_STATE,
    DECODE,
    FLAVOURS,
    FUSED,
    KERNELS,
    LOGITS,
    NEXT_TOKEN,
    PORTABLE,
    PREFILL,
    SSM_STATE,
    STATE_PAIRS,
    STATES,
    TOKEN_IDS,
    GraphContract,
)
from mambatrt.errors import BundleError, InputError
from mambatrt.runtime.bundle import Bundle
from mambatrt.tensorrt_flavour import find_tensorrt, import_polygraphy

BACKENDS = ("auto", "ort", "trt")
DEVICES = ("cpu", "cuda")
GRAPH_CHOICES = ("auto", *FLAVOURS)


class Backend:
    """Shared part of every backend: chunk checks, state shapes, graph availability."""

    name = "base"

    def __init__(self, bundle: Bundle, device: str) -> None:
        self.bundle = bundle
        self.device = device
        self.config = bundle.config
        self.graphs = bundle.graphs
        self.flavour = PORTABLE  # which graph files run (onnxruntime may run the "fused" ones)
        self.notes: list[str] = []
        self.max_rows = {DECODE: 1, PREFILL: bundle.max_prefill_rows}
        # the graphs' states carry a batch axis from schema 2 on; one sequence is a batch of one
        self.lead: tuple[int, ...] = (1,) if bundle.manifest.batched else ()

    @functools.cached_property
    def layout(self) -> StateLayout:
        """How the graphs of the flavour this backend runs take the states (made once: the launches of the
        one-sequence path read it; a subclass sets its flavour before anything asks)."""
        return StateLayout(self.bundle.contract(DECODE, self.flavour), self.config)

    def check_chunk(self, graph: str, token_ids: np.ndarray) -> np.ndarray:
        """Validate one chunk for ``graph``; returns it as contiguous int64 [S]."""
        if graph not in self.graphs:
            raise InputError(f"this '{self.bundle.layout}' bundle has no {graph} graph")
        try:
            ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(-1)
        except OverflowError:
            raise InputError(f"a token id is outside the vocabulary [0, {self.config.vocab_size})") from None
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

    def graph_state(self, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's states ([L, E, K-1], [L, E, N]) as contiguous float32 in the graphs' shapes."""
        conv = np.ascontiguousarray(conv, dtype=np.float32)
        ssm = np.ascontiguousarray(ssm, dtype=np.float32)
        if conv.shape != self.config.conv_state_shape or ssm.shape != self.config.ssm_state_shape:
            raise InputError(
                f"state shapes {conv.shape}, {ssm.shape} do not fit this bundle "
                f"({self.config.conv_state_shape}, {self.config.ssm_state_shape})"
            )
        return conv.reshape(self.lead + conv.shape), ssm.reshape(self.lead + ssm.shape)

    def sequence_state(self, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The graphs' state arrays as one sequence's states [L, E, K-1], [L, E, N]."""
        return conv.reshape(self.config.conv_state_shape), ssm.reshape(self.config.ssm_state_shape)

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

    def linear(self, graph: str) -> bool:
        """Whether this backend's session of ``graph`` runs a copy of the kernels graph with its products as
        MambaLinear: only onnxruntime's providers have them (:meth:`OrtCudaBackend.linear`,
        :meth:`OrtCpuBackend.linear`)."""
        return False

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        """State slots for continuous batching (:class:`SlotPool`) on this backend's device, prompts prefilled on
        ``graph``; one slot on any backend (its own state is the slot: what `mambatrt run` uses)."""
        if max_batch == 1:
            return _SinglePool(self, 1)
        raise InputError(f"continuous batching is not available on the {self.name} backend yet; use --backend ort")

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the state tensors, by input name (what :class:`StateBuffers` allocates)."""
        return {
            CONV_STATE: self.lead + self.config.conv_state_shape,
            SSM_STATE: self.lead + self.config.ssm_state_shape,
        }


class StateLayout:
    """Where the states of several sequences lie, one buffer per kind of state (STATES), and how a launch binds them.

    Stacked graphs (schema 1-3; the portable and fused graphs) take a kind as one tensor [B, L, E, ..]: the buffer is
    [rows, L, E, ..] and a launch over rows start..start+k-1 binds one block. Layered graphs (schema 4's kernels
    graphs) take L tensors [B, E, ..]: the buffer is layer-major, [L, rows, E, ..], and a launch binds L blocks, one
    per layer, so the graph splits and joins nothing. One sequence's state is then L pieces of one layer each,
    ``pitch`` bytes apart: device copies are 2-D copies, host copies numpy views (:meth:`rows`). A buffer of one row
    is the same memory in both layouts: a sequence's [L, E, ..].
    """

    def __init__(self, contract: GraphContract, config) -> None:
        self.io = contract.state_io  # (input, output, kind, layer)
        self.layered = contract.layered
        self.batched = contract.max_batch is not None
        self.layers = config.n_layer
        self.shapes = {CONV_STATE: config.conv_state_shape, SSM_STATE: config.ssm_state_shape}  # [L, E, ..] each
        self.row_bytes = {kind: 4 * int(np.prod(shape)) for kind, shape in self.shapes.items()}
        # the bytes one step of :meth:`offset` moves: a layer's row (layered) or a sequence's row (stacked)
        self.step = {kind: b // self.layers if self.layered else b for kind, b in self.row_bytes.items()}

    def buffer_shape(self, kind: str, rows: int) -> tuple[int, ...]:
        """The shape of a buffer of ``rows`` sequences' states of ``kind``."""
        shape = self.shapes[kind]
        return (shape[0], rows, *shape[1:]) if self.layered else (rows, *shape)

    def rows(self, array: np.ndarray, start: int, stop: int | None = None) -> np.ndarray:
        """View of row ``start`` of a host buffer ([L, E, ..]), or of rows start..stop-1 in the buffer's layout."""
        index = start if stop is None else slice(start, stop)
        return array[:, index] if self.layered else array[index]

    def binds(self, capacity: int, start: int, k: int) -> list[tuple[str, str, str, tuple[int, ...], int]]:
        """(input, output, kind, shape, byte offset) of each state tensor of a launch over rows start..start+k-1 of
        buffers of ``capacity`` rows: the offset from the buffer's start, of the input's and the output's buffer
        alike."""
        out = []
        for name, out_name, kind, layer in self.io:
            shape = self.shapes[kind]
            if layer is None:  # schema 1 has no batch axis (one sequence)
                out.append((name, out_name, kind, ((k,) if self.batched else ()) + shape, start * self.step[kind]))
            else:
                out.append((name, out_name, kind, (k, *shape[1:]), (layer * capacity + start) * self.step[kind]))
        return out

    def feed(self, conv: np.ndarray, ssm: np.ndarray) -> dict[str, np.ndarray]:
        """Stacked states [B, L, E, ..] as a session's state inputs (each layer's piece, contiguous, where layered)."""
        stacked = {CONV_STATE: conv, SSM_STATE: ssm}
        if not self.layered:
            return stacked
        return {name: np.ascontiguousarray(stacked[kind][:, layer]) for name, _, kind, layer in self.io}

    def stacked(self, outputs: list[np.ndarray]) -> list[np.ndarray]:
        """A session's outputs [logits, state outputs...] as [logits, conv [B, L, E, K-1], ssm [B, L, E, N]]."""
        if not self.layered:
            return outputs
        logits, *pieces = outputs
        half = len(pieces) // 2  # conv states first (:attr:`io`)
        return [logits, np.stack(pieces[:half], axis=1), np.stack(pieces[half:], axis=1)]

    def offset(self, kind: str, row: int) -> int:
        """Byte offset of row ``row``'s (first) piece in a buffer."""
        return row * self.step[kind]

    def extent(self, kind: str, k: int = 1) -> tuple[int, int]:
        """(bytes per piece, pieces) of k consecutive rows: the width and height of a 2-D copy of them."""
        return k * self.step[kind], self.layers if self.layered else 1

    def pitch(self, kind: str, capacity: int) -> int:
        """Bytes from one piece of a row to the next in a buffer of ``capacity`` rows (host arrays of one
        sequence: capacity 1)."""
        return capacity * self.step[kind]


class StateBuffers:
    """Two device buffers per state tensor: a launch reads one and writes the other, then :meth:`swap`.

    Input and output of one execution must not share memory; the prefill and decode graphs share these buffers, so a
    prompt's state flows into the decode steps without a copy. ``alloc(shape)`` makes one device buffer; a batch of
    sequences is the same thing with a leading batch axis in ``shapes``.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], alloc: Callable[[tuple[int, ...]], Any]) -> None:
        self.pairs = {name: (alloc(shape), alloc(shape)) for name, shape in shapes.items()}
        self.parity = 0  # which buffer of each pair holds the current state

    def read(self, name: str) -> Any:
        """The buffer holding the current value of state ``name`` (a launch's input)."""
        return self.pairs[name][self.parity]

    def write(self, name: str) -> Any:
        """The other buffer of ``name`` (a launch's output)."""
        return self.pairs[name][1 - self.parity]

    def swap(self) -> None:
        """After a launch: what was written is now the current state."""
        self.parity ^= 1

    def buffers(self) -> list[Any]:
        """Every buffer (to free them)."""
        return [b for pair in self.pairs.values() for b in pair]


def bind_states(
    binding, device: str, layout: StateLayout, rows: tuple[int, int, int], read: Callable, write: Callable
) -> None:
    """Bind the state inputs and outputs of a launch over ``rows`` = (capacity, start, k): rows start..start+k-1 of
    buffers of ``capacity`` rows, ``read(kind)`` the buffer of the inputs and ``write(kind)`` that of the outputs
    (numpy arrays on the CPU, OrtValues on CUDA); onnxruntime IOBinding on ``device`` "cpu" or "cuda"."""
    for name, out_name, kind, shape, offset in layout.binds(*rows):
        binding.bind_input(name, device, 0, np.float32, list(shape), _address(read(kind)) + offset)
        binding.bind_output(out_name, device, 0, np.float32, list(shape), _address(write(kind)) + offset)


def _address(buffer) -> int:
    """Where a state buffer's memory starts: a numpy array's, or an OrtValue's on the device."""
    return buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()


class SlotPool:
    """The states of continuous batching on the backend's device: ``max_batch`` decode slots and
    ``staging_rows`` staging rows, where prompts are prefilled.

    Decoding sequences occupy slots 0..n-1 so that one batched decode launch takes the first n rows of the pool.
    Prompts are prefilled in staging rows, chunk by chunk; one launch feeds a chunk of the same length to each of
    the consecutive rows start..start+k-1 (:meth:`prefill`; k up to the prefill graph's batch: ``staging_rows``),
    then :meth:`admit` copies a prefilled row's state into a free slot; states leave the device only for the prefix
    cache (:meth:`staged`, :meth:`slot_state`). This base class stages one prompt in the backend's own
    single-sequence state (the graphs that take one sequence per prefill launch, and ``run``).
    """

    device_greedy = False  # whether decode_greedy picks greedy tokens where the logits are (no logits copy)
    device_sample = False  # whether decode_sample picks tokens (greedy or by temperature) where the logits are
    concurrent = False  # whether a prefill launch may run (in another thread) beside a decode launch
    shared_staging = False  # whether staging a prompt overwrites slot 0 (then no prompt is staged while it runs)
    staging_rows = 1  # prompts prefilled at once (the prefill graph's batch)
    state_buffers = 1  # copies of the slots' states (2: a decode launch reads one buffer and writes the other)
    linear = False  # whether decode batches of 2 and more run the kernels graph's CUDA copy (MambaLinear)
    async_decode = False  # whether begin_decode returns while the launch runs (the host meanwhile does other work)
    launch_times: tuple[float, float | None] | None = None  # the last finished decode launch's device times (timed)
    can_feed = True  # whether feed() can begin a greedy launch from the picks of one not finished

    def __init__(self, backend: Backend, max_batch: int) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self._logits: np.ndarray | None = None  # [k, Vp]: the last prefill launch's logits on the host
        # the decode launches begun and not finished, oldest first: their ids [n], or n where the launch before's
        # picks feed it (:meth:`feed`)
        self._begun: collections.deque[np.ndarray | int] = collections.deque()
        self._picks: np.ndarray | None = None  # the last greedy launch's picks (a fed launch's ids)

    def begin_decode(self, ids: np.ndarray, how: str = "logits") -> None:
        """Begin the decode launch for slots 0..n-1 (ids [n] int64); :meth:`finish_decode` ends it, as ``how`` says
        (a pool may queue the picks behind the launch). Where ``async_decode``, this returns while the launch runs:
        until it is finished the caller may touch the staging rows, the prefix cache's rows and the host, never the
        slots. Here the launch runs when it is finished."""
        self._begun.append(ids)

    def feed(self, n: int) -> None:
        """Begin the next greedy decode launch over the same n slots as the last one begun, a greedy one not
        finished yet: that launch's picks are this one's ids where they are (on a GPU the launch is queued behind
        it, and the device does not wait for the host between the two). :meth:`finish_decode` ends the begun
        launches in turn, oldest first; the slots' sequences must not change in between (no slot admitted, moved
        or freed). Here the launch runs when it is finished, with the picks of the one finished before it."""
        self._begun.append(n)

    def time_launches(self) -> bool:
        """Time each decode launch on the device from now on, where the pool can (its launches on a stream of its
        own): after :meth:`finish_decode`, :attr:`launch_times` holds (seconds the launch took on the device,
        seconds its stream stood idle since the launch before ended, None for the first). Returns whether it
        can. What the host's clock cannot tell: how long the device waited for the host between two launches."""
        return False

    def finish_decode(self, how: str, params: np.ndarray | None = None) -> np.ndarray:
        """End the launch :meth:`begin_decode` began, as ``how`` asks (begun with the same): "greedy"
        (:meth:`decode_greedy`), "sample" (:meth:`decode_sample`, with ``params``) or "logits" (:meth:`decode`);
        the oldest launch begun and not finished, where several are (:meth:`feed`)."""
        ids = self._begun.popleft()
        if not isinstance(ids, np.ndarray):  # fed: the picks of the launch finished before it
            assert how == "greedy" and self._picks is not None and self._picks.size == ids
            ids = self._picks
        if how == "greedy":
            self._picks = self.decode_greedy(ids)
            return self._picks
        return self.decode_sample(ids, params) if how == "sample" else self.decode(ids)

    def abandon(self) -> None:
        """Forget the decode launches begun and not finished (the engine stops; their picks go unused)."""
        self._begun.clear()

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's state (one slot)."""
        c = self.backend.config
        return 4 * (int(np.prod(c.conv_state_shape)) + int(np.prod(c.ssm_state_shape)))

    @property
    def slots_bytes(self) -> int:
        """Bytes of every slot's state, in every buffer."""
        return self.state_buffers * self.max_batch * self.slot_bytes

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging rows (0 here: the backend's own state is the staging row)."""
        return 0

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        """Start staging row ``row`` from host states [L, E, K-1], [L, E, N] (a cached prefix), or zeros: then
        rows row..row+k-1."""
        if conv is None:
            assert row + k <= self.staging_rows
            self.backend.reset()
        else:
            self.backend.set_state(conv, ssm)

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        """One launch: chunk ``ids[i]`` (ids [k, T] int64) to staging row start + i, for i < k."""
        self._logits = self.backend.run(graph, ids[0])[None]

    def prefill_logits(self, i: int) -> np.ndarray:
        """Row ``i`` of the last :meth:`prefill` launch: the logits [Vp] after its chunk, on the host."""
        return self._logits[i]

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of staging row ``row``'s states: into ``out`` (the state cache's arrays) when given."""
        return _into(out, *self.backend.get_state())

    def host_array(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 host array that this pool copies into quickly (pinned on CUDA)."""
        return np.empty(shape, np.float32)

    def cache_rows(self, capacity: int, shapes: tuple[tuple[int, ...], ...]) -> list:
        """The state cache's storage, made once: for each of an entry's arrays (conv, ssm, logits) ``capacity``
        rows, indexable by entry. The states' rows are where :meth:`staged`, :meth:`slot_state` and :meth:`stage`
        copy fastest: host arrays here, device memory on CUDA. Written once here, so that the memory is the
        process's from the start (a machine short of it fails now, not mid-request) and no request pays the page
        faults of a row's first use (20x the copy itself: BENCHMARKS.md, session 13)."""
        rows = [self.host_array((capacity, *shape)) for shape in shapes]
        for a in rows:
            a.fill(0.0)
        return rows

    def move_staged(self, src: int, dst: int) -> None:
        """Copy staging row ``src`` over row ``dst`` (the staged rows stay consecutive)."""
        raise AssertionError("one staging row never moves")

    def warm_decode(self) -> int:
        """Run once, before serving, every decode launch shape that is captured on first use (returns how many), so
        that no request pays for a capture; on the thread that will decode. Nothing to do here: only the CUDA pool
        captures."""
        return 0

    def warm_prefill(self, graph: str) -> int:
        """As :meth:`warm_decode` for the prefill launches of ``graph``, on the thread that will run them."""
        return 0

    # -- per device -------------------------------------------------------------------------------------------
    def admit(self, slot: int, row: int, k: int = 1) -> None:
        """Copy the states of staging rows row..row+k-1 into slots slot..slot+k-1 (a prefill launch's prompts
        taking consecutive slots: one copy per state on the device instead of one per prompt, made while the GPU's
        decode waits)."""
        raise NotImplementedError

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """One decode launch for slots 0..n-1 (ids [n] int64); logits [n, Vp] float32 on the host."""
        raise NotImplementedError

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The states of ``slot`` on the host, copied into ``out`` when given (else the caller copies them if it
        keeps them)."""
        raise NotImplementedError

    def decode_greedy(self, ids: np.ndarray) -> np.ndarray:
        """One decode launch for slots 0..n-1, then the greedy token of each (int64 [n] on the host); the logits
        stay on the device (:meth:`last_logits`). Only where ``device_greedy``."""
        raise NotImplementedError

    def decode_sample(self, ids: np.ndarray, params: np.ndarray) -> np.ndarray:
        """One decode launch for slots 0..n-1, then each sequence's token picked where the logits are (int64 [n] on
        the host), as :func:`~mambatrt.runtime.generate.sample_token` picks it for a temperature alone: ``params``
        float64 [n, 2] holds each row's temperature (0: greedy) and uniform draw. The logits stay on the device
        (:meth:`last_logits`). Only where ``device_sample``."""
        raise NotImplementedError

    def prefill_sample(self, params: np.ndarray) -> np.ndarray:
        """The token after each row of the last :meth:`prefill` launch (a prompt's first token), picked where the
        logits are as :meth:`decode_sample` picks them: ``params`` float64 [k, 2] for the launch's k rows (int64 [k]
        on the host). Only where ``device_sample``."""
        raise NotImplementedError

    def last_logits(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        """Row ``row`` of the last :meth:`decode_greedy` or :meth:`decode_sample` launch's logits [Vp] on the host;
        into ``out`` (a contiguous float32 array of at most Vp: the first out.size logits) when given."""
        raise NotImplementedError

    def prev_slot_state(
        self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """While a launch begun with :meth:`begin_decode` is not finished: ``slot``'s states before it (the last
        finished launch's output), as :meth:`slot_state`. Here the begun launch has not run yet: the slot's states."""
        return self.slot_state(slot, out)

    def prev_logits(self, row: int, out: np.ndarray | None = None) -> np.ndarray:
        """While a launch begun with :meth:`begin_decode` is not finished: row ``row`` of the last finished
        launch's logits, as :meth:`last_logits`. Here the begun launch has not run yet: the last launch's."""
        return self.last_logits(row, out)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` over slot ``dst`` (a finished sequence's slot goes to the last one)."""
        raise NotImplementedError


def _into(out: tuple[np.ndarray, np.ndarray] | None, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, ...]:
    """(conv, ssm), or ``out`` with them copied in."""
    if out is None:
        return conv, ssm
    out[0][...], out[1][...] = conv, ssm
    return out


class _SinglePool(SlotPool):
    """One slot, which is the backend's own state: the staging sequence is the slot (``shared_staging``), so
    admitting copies nothing and a decode step is a plain launch. Works on every backend."""

    shared_staging = True

    def admit(self, slot: int, row: int, k: int = 1) -> None:
        pass  # the prompt's state is already where the slot is (one slot: k is 1)

    def decode(self, ids: np.ndarray) -> np.ndarray:
        return self.backend.run(DECODE, ids)[None]  # [1, Vp]

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return _into(out, *self.backend.get_state())

    def move(self, src: int, dst: int) -> None:
        raise AssertionError("a pool of one slot never moves a state")


def prefill_batch(backend: Backend, graph: str, max_batch: int) -> int:
    """Prompts one launch of ``graph`` can prefill on this backend: the prefill graph's batch, or the decode graph's
    (a "single" bundle's prompts go token by token through the batched decode graph)."""
    if graph == PREFILL:
        return backend.bundle.prefill_batch(backend.flavour)
    return max_batch if backend.bundle.manifest.batched else 1


def _host_zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, np.float32)


class _HostPool(SlotPool):
    """Slots and staging rows as numpy arrays, run by onnxruntime on the CPU (batched graphs: a schema-1 bundle gets
    one slot, :class:`_SinglePool`).

    Every launch binds its inputs and outputs where they lie (IOBinding, bindings kept per launch shape): a decode
    launch reads the slots' states in one of two buffers and writes them to the other (:class:`StateBuffers`), its
    logits into one array; a prefill launch reads staging rows and writes them to a second staging buffer, whence
    its rows are copied back. So nothing is copied around a launch but those rows (onnxruntime's own outputs cost a
    copy of every state per step), and layered graphs (:class:`StateLayout`) get their layers as they lie.
    """

    concurrent = True  # prefill (staging arrays, the prefill session) and decode (slots, the decode session) apart
    # the greedy tokens of a launch in one argmax over its rows (the engine would otherwise take one per sequence)
    device_greedy = True
    state_buffers = 2

    def __init__(self, backend: OrtCpuBackend, max_batch: int, graph: str) -> None:
        super().__init__(backend, max_batch)
        c = backend.config
        self.vocab = c.vocab_size
        self.layout = layout = backend.layout
        self.staging_rows = prefill_batch(backend, graph, max_batch)
        self.states = StateBuffers({k: layout.buffer_shape(k, max_batch) for k in STATES}, _host_zeros)
        self.staging = {k: _host_zeros(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.staging_out = {k: _host_zeros(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.ids = np.zeros(max_batch, np.int64)
        self.stage_ids = np.zeros(self.staging_rows * backend.max_rows[graph], np.int64)
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
            session = self.backend.sessions[graph]
            binding = session.io_binding()
            logits = self.stage_logits if staging else self.logits
            binding.bind_output(LOGITS, "cpu", 0, np.float32, [k, logits.shape[1]], logits.ctypes.data)
            if staging:
                rows, read, write = (self.staging_rows, start, k), self.staging.get, self.staging_out.get
            else:
                rows, read, write = (self.max_batch, start, k), self.states.read, self.states.write
            bind_states(binding, "cpu", self.layout, rows, read, write)
            self.bindings[key] = binding
        return self.bindings[key]

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        rows = self.layout.rows
        if conv is None:
            for kind in STATES:
                rows(self.staging[kind], row, row + k)[...] = 0.0
        else:
            conv, ssm = self.backend.graph_state(conv, ssm)  # shapes checked
            conv, ssm = self.backend.sequence_state(conv, ssm)
            rows(self.staging[CONV_STATE], row)[...], rows(self.staging[SSM_STATE], row)[...] = conv, ssm

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        k = ids.shape[0]
        binding = self._binding(graph, start, k, staging=True)
        flat = self.stage_ids[: ids.size]
        flat[...] = ids.reshape(-1)
        binding.bind_input(TOKEN_IDS, "cpu", 0, np.int64, [flat.size], flat.ctypes.data)
        self.backend.sessions[graph].run_with_iobinding(binding)
        for kind in STATES:  # the written rows back where the staged states live
            self.layout.rows(self.staging[kind], start, start + k)[...] = self.layout.rows(
                self.staging_out[kind], start, start + k
            )
        self._logits = self.stage_logits[:k]

    def prefill_logits(self, i: int) -> np.ndarray:
        return self._logits[i].copy()

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        conv, ssm = (self.layout.rows(self.staging[k], row) for k in STATES)
        return (conv.copy(), ssm.copy()) if out is None else _into(out, conv, ssm)

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
        self.backend.sessions[DECODE].run_with_iobinding(binding)
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
        return _into(out, conv, ssm) if out is not None else (conv.copy(), ssm.copy())

    def move(self, src: int, dst: int) -> None:
        for kind in STATES:
            buffer = self.states.read(kind)
            self.layout.rows(buffer, dst)[...] = self.layout.rows(buffer, src)


_DTYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(float16)": "float16"}


def check_io(contract: GraphContract, inputs: list[tuple], outputs: list[tuple], where: str) -> None:
    """A graph's or plan's I/O, as (name, dtype, shape) triples, against the contract it was built to.

    Names, dtypes and ranks must match, and a fixed dimension must equal the contract's; a dimension the graph
    leaves symbolic (a str, None or -1: the rows axis, or an expression the exporter could not fold) is not
    compared. A mismatch means a bundle from another mambatrt or a hand-edited graph: BundleError.
    """
    for kind, found, specs in (("inputs", inputs, contract.inputs), ("outputs", outputs, contract.outputs)):
        names = [f[0] for f in found]
        if sorted(names) != sorted(t.name for t in specs):
            raise BundleError(
                f"{where}: {kind} {names} do not match the I/O contract {[t.name for t in specs]}; rebuild the bundle"
            )
        by_name = {f[0]: f for f in found}
        for spec in specs:
            _, dtype, shape = by_name[spec.name]
            shape = list(shape)
            fixed = [isinstance(d, int) and d >= 0 for d in shape]
            if (
                dtype != spec.dtype
                or len(shape) != len(spec.shape)
                or any(f and isinstance(w, int) and d != w for f, d, w in zip(fixed, shape, spec.shape, strict=True))
            ):
                raise BundleError(
                    f"{where}: {spec.name} is {dtype} {shape}, the contract says {spec.dtype} {list(spec.shape)}; "
                    "rebuild the bundle"
                )


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise BundleError("onnxruntime is not installed; pip install onnxruntime (or onnxruntime-gpu)") from None
    return ort


class _OrtLoadError(BundleError):
    """onnxruntime could not open a graph (unreadable, or a provider option it refuses, such as CUDA capture)."""


def _ort_session(
    bundle: Bundle,
    graph: str,
    options,
    providers: list,
    flavour: str = PORTABLE,
    linear: bool = False,
    cpu_linear: bool = False,
):
    """One onnxruntime session of ``graph`` in ``flavour``, its I/O checked against the contract; ``linear``: the
    kernels graph's CUDA copy where the bundle has one (:meth:`Bundle.graph_path`), for batched launches;
    ``cpu_linear``: its CPU copy likewise."""
    ort = _import_ort()
    path = bundle.graph_path(graph, flavour, cuda=linear, cpu=cpu_linear)
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise _OrtLoadError(f"{path}: onnxruntime cannot load it ({exc})") from None
    io = [
        [(t.name, _DTYPES.get(t.type, t.type), t.shape) for t in ts]
        for ts in (session.get_inputs(), session.get_outputs())
    ]
    check_io(bundle.contract(graph, flavour), *io, str(path))
    return session


def session_options(ort, bundle: Bundle, flavour: str, threads: int = 0, options=None):
    """Session options shared by a backend's sessions (``options`` if given, else new ones): the "kernels" flavour
    registers the bundle's op library."""
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if flavour == KERNELS:
        library = bundle.kernels_library
        try:
            options.register_custom_ops_library(str(library))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise _OrtLoadError(f"{library}: onnxruntime cannot load the kernels library ({exc})") from None
    return options


def cuda_provider_options(bundle: Bundle, flavour: str, stream: int | None = None) -> dict[str, str]:
    """The CUDA provider's options: TF32 off (TF32 matmuls change fp32 logits at the 1e-1 level on 130m models); for
    the "kernels" flavour a stream of the kernels library as onnxruntime's compute stream: ``stream`` when given
    (:func:`kernels_stream`), else the library's one stream per process."""
    options = {"use_tf32": "0"}
    if flavour == KERNELS:
        options["user_compute_stream"] = str(stream if stream is not None else kernels_stream(bundle))
    return options


def _kernels_cuda(bundle: Bundle):
    """The bundle's kernels library loaded with ctypes (the same handle onnxruntime's dlopen gets), its CUDA kernels
    checked against the GPU here: once per library file and process (a CUDA backend asks for it per stream)."""
    if not bundle.kernels_cuda:
        raise InputError(
            f"{bundle.path}: its kernels library was built without CUDA (no nvcc); rebuild the bundle where nvcc "
            "runs, or use --graphs fused"
        )
    return _checked_library(str(bundle.kernels_library))


@functools.cache
def _checked_library(path: str):
    import ctypes

    library = ctypes.CDLL(path)
    library.mambatrt_ops_cuda_check.restype = ctypes.c_char_p
    why = library.mambatrt_ops_cuda_check()
    if why:  # e.g. a GPU older than the library's architectures: --graphs auto then runs the fused graphs
        raise _OrtLoadError(
            f"{path}: its CUDA kernels cannot run on this GPU ({why.decode()}); rebuild the bundle on this machine, "
            "or use --graphs fused"
        )
    return library


def _sampler(bundle: Bundle):
    """The kernels library's sampler (``mambatrt_ops_sample``, libraries from session 21 on) as a ctypes function,
    or None where the bundle's library has none or cannot run its CUDA kernels here (the host then samples)."""
    import ctypes

    try:
        library = _kernels_cuda(bundle)  # InputError without a library built with CUDA
    except (InputError, _OrtLoadError, OSError):
        return None
    fn = getattr(library, "mambatrt_ops_sample", None)
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]  # logits, rows, stride, vocab, params, picks, stream
    return fn


def session_streams(bundle: Bundle) -> bool:
    """Whether the bundle's kernels library launches on each session's own stream (libraries from session 12 on),
    so that sessions given two streams (:func:`kernels_stream` with ``own``) run side by side. Older libraries
    launch on one stream per process, which every session must then share."""
    return hasattr(_kernels_cuda(bundle), "mambatrt_ops_new_stream")


def kernels_stream(bundle: Bundle, own: bool = False, urgent: bool = False) -> int:
    """A CUDA stream for onnxruntime's CUDA provider to run on (its user_compute_stream) under the "kernels" flavour:
    the custom kernels then launch on it, ordered with onnxruntime's own, and land in its CUDA graphs. ``own``: a new
    non-blocking stream (:func:`session_streams` libraries only; it neither waits for nor holds up the legacy
    default stream's copies, so a launch must wait for those itself), else the library's one stream per process;
    ``urgent`` (with ``own``): of the device's highest priority (decode, whose short kernels then go before the
    prefill kernels queued beside them)."""
    import ctypes

    library = _kernels_cuda(bundle)
    if own:
        library.mambatrt_ops_new_stream.restype = ctypes.c_void_p
        library.mambatrt_ops_new_stream.argtypes = [ctypes.c_int]
        stream = library.mambatrt_ops_new_stream(int(urgent))
    else:
        library.mambatrt_ops_stream.restype = ctypes.c_void_p
        stream = library.mambatrt_ops_stream()
    if not stream:
        raise BundleError("the kernels library could not create a CUDA stream; use --graphs fused")
    return stream


def partition_stream(bundle: Bundle, sms: int) -> tuple[int, int]:
    """A new non-blocking stream (as :func:`kernels_stream` with ``own``) whose kernels run on ``sms`` of the GPU's
    SMs only, a green context's partition; and how many it got (the request rounded up to the device's granularity,
    8 SMs on Hopper). Streams of the whole device still use every SM, those of the partition too when they are free:
    prefill launches on such a stream cannot fill the GPU, so the decode kernels beside them always find SMs (a
    prefill launch of 16 prompts takes every SM for milliseconds otherwise, and a decode kernel's blocks wait for
    its blocks to end, priority or not)."""
    import ctypes

    library = _kernels_cuda(bundle)
    if not hasattr(library, "mambatrt_ops_new_stream_on_sms"):
        raise InputError(f"{bundle.path}: its kernels library predates --prefill-sms; rebuild the bundle")
    fn = library.mambatrt_ops_new_stream_on_sms
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p)]
    granted, why = ctypes.c_int(0), ctypes.c_char_p()
    stream = fn(0, sms, ctypes.byref(granted), ctypes.byref(why))
    if not stream:
        raise InputError(f"--prefill-sms {sms}: {(why.value or b'no stream').decode()}")
    return stream, granted.value


def cpu_linear_copy(bundle: Bundle, flavour: str, graph: str = DECODE) -> bool:
    """Whether a CPU backend's session of ``graph`` runs the kernels graph's CPU copy (its products as MambaLinear):
    the bundle has one (MAMBATRT_CPU_LINEAR=0 does not turn it off) and its library runs MambaLinear's packed
    AVX-512 kernel on this CPU (``mambatrt_ops_cpu_linear``, libraries from session 31 on; it splits a product's
    columns over the session's threads). BENCHMARKS.md, session 31: against MLAS's Gemms, on one thread a decode
    launch's products 20-40 % faster, a prefill launch's 0-8 %; on two no slower."""
    if flavour != KERNELS or bundle.graph_path(graph, flavour, cpu=True) == bundle.graph_path(graph, flavour):
        return False
    return _cpu_linear_library(str(bundle.kernels_library))


@functools.cache
def _cpu_linear_library(path: str) -> bool:
    import ctypes

    packs = getattr(ctypes.CDLL(path), "mambatrt_ops_cpu_linear", None)
    return bool(packs and packs())


class OrtCpuBackend(Backend):
    """onnxruntime on the CPU: one session per graph, the states as numpy arrays; each on the kernels graph's CPU
    copy where :func:`cpu_linear_copy` says (:meth:`linear`)."""

    name = "ort"

    def __init__(self, bundle: Bundle, threads: int = 0, flavour: str = PORTABLE) -> None:
        super().__init__(bundle, "cpu")
        self.flavour = flavour
        ort = _import_ort()
        if bundle.precision == "bf16":
            raise BundleError(
                "onnxruntime's CPU provider has no bf16 kernels; run this bf16 bundle with --device cuda "
                "or --backend trt, or build an fp32/fp16 bundle"
            )
        opts = session_options(ort, bundle, flavour, threads)
        # the prefill and decode sessions each own a thread pool; idle threads that keep spinning after a run take
        # the cores from the other session (BENCHMARKS.md: decode after prefill on a 2-core CPU)
        opts.add_session_config_entry("session.force_spinning_stop", "1")
        self.cpu_linear = {g: cpu_linear_copy(bundle, flavour, g) for g in self.graphs}
        self.sessions = {}
        for graph in self.graphs:
            cpu = ["CPUExecutionProvider"]
            self.sessions[graph] = _ort_session(bundle, graph, opts, cpu, flavour, cpu_linear=self.linear(graph))
        # the sequence's states: stacked, and for layered graphs also (or only, after a launch) as each layer's
        # pieces, which go from one launch's outputs to the next one's inputs as they are: feeding and stacking
        # them on every launch cost ~10 % of a default-model decode step
        self.state: tuple[np.ndarray, np.ndarray] | None = self.graph_state(*self.zero_states())
        self.pieces: dict[str, np.ndarray] | None = None
        inputs = {out: name for name, out, *_ in self.layout.io}  # each state output feeds the input of its name
        # graph -> the state input each of its state outputs (in the session's order) feeds
        self.feeds = {g: [inputs.get(o.name) for o in s.get_outputs()[1:]] for g, s in self.sessions.items()}

    def linear(self, graph: str) -> bool:
        """Whether the session of ``graph`` runs the kernels graph's CPU copy (:func:`cpu_linear_copy`)."""
        return self.cpu_linear.get(graph, False)

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
        """One launch on stacked states the caller owns (schema 2: decode takes B sequences, ids [B] and states
        [B, L, ...]); returns [logits, conv', ssm'] as new arrays. Layered graphs get each layer's piece and give
        theirs back stacked (the serving pool binds its layer-major buffers instead: :class:`_HostPool`)."""
        layout = self.layout
        return layout.stacked(self.sessions[graph].run(None, {TOKEN_IDS: ids, **layout.feed(conv, ssm)}))

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(a.copy() for a in self.sequence_state(*self._stacked_state()))

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        return _HostPool(self, max_batch, graph) if max_batch > 1 else super().open_pool(1)

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.graph_state(conv, ssm)
        self.state, self.pieces = (conv.copy(), ssm.copy()), None


# Launches of one (rows, parity) before onnxruntime replays it: its CUDA provider runs a graph id once normally
# (allocations), captures it on the next run; x2 parities, +2 so that both parities' captures have replayed once.
_CAPTURE_RUNS = 6
# Runs of one graph id that leave it captured, whichever onnxruntime: one or two regular runs (by version), then the
# capture (the pool's warm-up)
_RUNS_TO_CAPTURE = 3


class _CaptureFailed(Exception):
    """onnxruntime could not capture or replay a CUDA graph; the graph then runs plainly."""


class _PlainRunner:
    """One graph on the CUDA provider, node by node: an IOBinding rebound per chunk, logits copied to the host."""

    captured = False

    def __init__(self, backend: OrtCudaBackend, graph: str) -> None:
        self.backend = backend
        self.session = backend.open_session(graph, capture=False, linear=backend.linear(graph))
        self.binding = self.session.io_binding()

    def run(self, ids: np.ndarray) -> np.ndarray:
        states, binding = self.backend.states, self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(TOKEN_IDS, ids)
        binding.bind_output(LOGITS, "cpu")  # bound first: outputs come back in binding order
        self.backend.bind(binding, states)
        self.backend.settle()  # states set by copies on the legacy stream
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]  # logits only; the states stay on the device


class _CapturedRunner:
    """One graph replayed as captured CUDA graphs, one per row count and state-buffer parity.

    A captured graph replays with the addresses it was captured with, so each (rows, parity) has its own fixed
    bindings: a token-ids buffer of that row count, the backend's logits buffer, and the state buffers of that
    parity. Captured graphs replay in turn on one stream, so they share the scratch memory of the session's arena.

    Capturing costs far more than one plain run, and a one-shot ``run`` meets most chunk lengths once: a (rows,
    parity) is run plainly (graph id -1) the first time and captured only when it comes again.
    """

    captured = True

    def __init__(self, backend: OrtCudaBackend, graph: str) -> None:
        self.backend = backend
        self.session = backend.open_session(graph, capture=True, linear=backend.linear(graph))
        self.ids: dict[int, Any] = {}  # rows -> device int64 [rows]
        self.replays: dict[tuple[int, int], tuple] = {}  # (rows, parity) -> (binding, run options)
        self.first_run: set[tuple[int, int]] = set()  # seen once: run plainly

    def _replay(self, rows: int) -> tuple:
        states = self.backend.states
        key = (rows, states.parity)
        if key not in self.first_run:
            self.first_run.add(key)
            plain = self.backend.ort.RunOptions()
            plain.add_run_config_entry("gpu_graph_id", "-1")
        else:
            plain = None
        if key not in self.replays:
            ort = self.backend.ort
            if rows not in self.ids:
                self.ids[rows] = ort.OrtValue.ortvalue_from_numpy(np.zeros(rows, np.int64), "cuda", 0)
            binding = self.session.io_binding()
            binding.bind_ortvalue_input(TOKEN_IDS, self.ids[rows])
            binding.bind_ortvalue_output(LOGITS, self.backend.logits)
            self.backend.bind(binding, states)
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(2 * rows + states.parity + 1))
            self.replays[key] = (binding, options)
        binding, options = self.replays[key]
        return binding, plain or options

    def run(self, ids: np.ndarray) -> np.ndarray:
        binding, options = self._replay(ids.size)
        self.ids[ids.size].update_inplace(ids)
        self.backend.settle()
        try:
            self.session.run_with_iobinding(binding, options)
        except Exception as exc:  # onnxruntime's own exception types; the read buffers are untouched
            raise _CaptureFailed(str(exc)[:200]) from None
        return self.backend.logits.numpy()[0]


class OrtCudaBackend(Backend):
    """onnxruntime's CUDA provider: the states in :class:`StateBuffers` on the device, bound with IOBinding.

    ``cuda_graph``: replay decode steps and prefill chunks as captured CUDA graphs (:class:`_CapturedRunner`),
    which removes onnxruntime's per-node launch overhead; a graph onnxruntime refuses to capture (e.g. a node placed
    on the CPU) runs plainly (:class:`_PlainRunner`), and ``notes`` says why. ``prefill_sms`` (the kernels
    graphs): this backend's own stream, where prefill launches run, confined to that many SMs
    (:func:`partition_stream`); 0: the whole GPU; None: half of the GPU's SMs where the bundle's library and the
    driver can make the partition, else the whole GPU (``notes`` says why): serve's default, AUTO_PREFILL_SHARE.
    """

    name = "ort"

    def __init__(
        self,
        bundle: Bundle,
        cuda_graph: bool = True,
        threads: int = 0,
        flavour: str = PORTABLE,
        prefill_sms: int | None = 0,
    ) -> None:
        super().__init__(bundle, "cuda")
        self.flavour = flavour
        ort = self.ort = _import_ort()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BundleError("onnxruntime has no CUDA provider here; install onnxruntime-gpu or use --device cpu")
        # the kernels on a non-blocking stream of this backend's sessions, so that a pool's decode session (on a
        # stream of its own) runs beside the prefill launches of this backend's prefill session
        self.concurrent = flavour == KERNELS and session_streams(bundle)
        self.prefill_sms = 0  # the SMs this backend's stream may use (0: all of them), :func:`partition_stream`
        self.stream = None
        if prefill_sms is None and self.concurrent:  # a share of the GPU where it can be had, else the whole GPU
            sms = int(_sm_count(_cudart()) * AUTO_PREFILL_SHARE)
            try:
                self.stream, self.prefill_sms = partition_stream(bundle, sms) if sms else (None, 0)
            except InputError as exc:
                self.notes.append(f"prefill launches may use the whole GPU ({exc})")
        elif prefill_sms and not self.concurrent:
            raise InputError("--prefill-sms needs the kernels graphs (--graphs kernels) of a bundle built with nvcc")
        elif prefill_sms:
            self.stream, self.prefill_sms = partition_stream(bundle, prefill_sms)
        if self.stream is None:
            self.stream = kernels_stream(bundle, own=True) if self.concurrent else None
        self.cuda_opts = cuda_provider_options(bundle, flavour, self.stream)
        self.cudart = _cudart() if self.concurrent else None
        self.options = session_options(ort, bundle, flavour, threads)

        def alloc(shape: tuple[int, ...]):
            return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), "cuda", 0)

        self.states = StateBuffers(self._state_shapes(), alloc)
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([1, self.config.vocab_padded], np.float32, "cuda", 0)
        self.runners: dict[str, _PlainRunner | _CapturedRunner] = {}
        for graph in self.graphs:
            self.runners[graph] = self._runner(graph, cuda_graph)
        self._warm_up()

    def _warm_up(self) -> None:
        """Launches of each graph at load (a decode step, a full prefill chunk), then zero states: the CUDA
        context, cuBLAS handles, kernel modules and the memory arena are set up here rather than inside the first
        request's time to first token. A captured graph's decode step and full chunk are captured here too, for
        both state-buffer parities: every prompt of a one-shot ``run`` goes through full chunks and decode steps,
        whose plain runs cost several times their replays; other row counts are captured when they repeat."""
        for graph, runner in self.runners.items():
            rows = self.max_rows[graph]
            if isinstance(runner, _CapturedRunner):
                runner.first_run.update({(rows, 0), (rows, 1)})  # straight to the graph ids, no plain first run
            for _ in range(_CAPTURE_RUNS if runner.captured else 1):
                self._execute(graph, np.zeros(rows, np.int64))
        self.reset()

    @property
    def captured(self) -> dict[str, bool]:
        """graph -> whether it replays captured CUDA graphs."""
        return {graph: runner.captured for graph, runner in self.runners.items()}

    def settle(self) -> None:
        """Wait for the copies queued on the legacy default stream (host-to-device copies of token ids and states,
        the pool's state copies) before a launch on a non-blocking stream, which would not wait for them; a no-op
        where the sessions' stream is ordered with the legacy stream."""
        if self.concurrent and self.cudart.cudaStreamSynchronize(None) != 0:
            raise RuntimeError("cudaStreamSynchronize failed")

    def bind(self, binding, states: StateBuffers) -> None:
        """Bind the one sequence's states of ``states`` (read the current buffers, write the others)."""
        bind_states(binding, "cuda", self.layout, (1, 0, 1), states.read, states.write)

    def provider_options(self, stream: int | None = None) -> dict[str, str]:
        """The CUDA provider's options of this backend's sessions, on ``stream`` (:func:`kernels_stream`) when
        given instead of the backend's own."""
        return self.cuda_opts if stream is None else {**self.cuda_opts, "user_compute_stream": str(stream)}

    def open_session(self, graph: str, capture: bool, stream: int | None = None, linear: bool = False):
        """A session of ``graph`` on the CUDA provider (with CUDA graph capture enabled, or plain), on the
        backend's stream or on ``stream`` (:meth:`provider_options`); ``linear``: the kernels graph's CUDA copy
        (MambaLinear) where the bundle has one."""
        cuda = self.provider_options(stream)
        if capture:
            providers = [("CUDAExecutionProvider", {**cuda, "enable_cuda_graph": "1"})]
        else:
            providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
        try:
            return _ort_session(self.bundle, graph, self.options, providers, self.flavour, linear)
        except _OrtLoadError as exc:
            if capture:  # e.g. a node onnxruntime would place on the CPU: run the graph plainly
                raise _CaptureFailed(str(exc).splitlines()[0][:200]) from None
            raise

    def linear_copy(self, graph: str) -> bool:
        """Whether ``graph`` can run as the kernels graph's CUDA copy (MambaLinear) here: the bundle has one (and
        MAMBATRT_CUDA_LINEAR=0 does not turn it off), and the GPU has compute capability 8.0 or more (MambaLinear's
        tensor-core kernels need sm_80; the library's fallback before it is a plain fp32 kernel, far slower than
        cuBLAS)."""
        bundle, flavour = self.bundle, self.flavour
        if bundle.graph_path(graph, flavour, cuda=True) == bundle.graph_path(graph, flavour):
            return False
        return _compute_major(self.cudart or _cudart()) >= 8

    def linear(self, graph: str) -> bool:
        """Whether this backend's session of ``graph`` runs the kernels graph's CUDA copy: the prefill graph's, where
        it can (:meth:`linear_copy`; a launch's rows are many: MambaLinear's products, CUTLASS's from 16 rows on, beat
        cuBLAS's fp32 kernels there); never the decode graph's (one sequence: cuBLAS's GEMV is faster, and the serving
        pool's batches take the copy in a session of their own, :meth:`_CudaPool._decode_sessions`)."""
        return graph == PREFILL and self.linear_copy(graph)

    def _runner(self, graph: str, capture: bool) -> _PlainRunner | _CapturedRunner:
        if capture:
            try:
                return _CapturedRunner(self, graph)
            except _CaptureFailed as exc:  # onnxruntime refuses graphs it cannot capture; run them plainly
                self.notes.append(f"{graph}: CUDA graph not used: {exc}")
        return _PlainRunner(self, graph)

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        try:
            logits = self.runners[graph].run(ids)
        except _CaptureFailed as exc:  # a capture onnxruntime cannot make: reopen the graph plainly, run again
            self.notes.append(f"{graph}: CUDA graph capture failed, running plainly: {exc}")
            self.runners[graph] = _PlainRunner(self, graph)
            logits = self.runners[graph].run(ids)
        self.states.swap()
        return logits

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.sequence_state(self.states.read(CONV_STATE).numpy(), self.states.read(SSM_STATE).numpy())

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.graph_state(conv, ssm)
        self.states.read(CONV_STATE).update_inplace(conv)
        self.states.read(SSM_STATE).update_inplace(ssm)
        self.settle()

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        return _CudaPool(self, max_batch, graph) if max_batch > 1 else super().open_pool(1)


def _device_attribute(cudart, attribute: int) -> int:
    """An attribute of the current device (cudaDeviceGetAttribute), 0 when the runtime cannot say."""
    import ctypes

    device, value = ctypes.c_int(0), ctypes.c_int(0)
    if cudart.cudaGetDevice(ctypes.byref(device)) != 0:
        return 0
    if cudart.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device.value) != 0:
        return 0
    return value.value


def _compute_major(cudart) -> int:
    """The current device's compute capability major (0 when the runtime cannot say)."""
    return _device_attribute(cudart, 75)  # cudaDevAttrComputeCapabilityMajor


def _sm_count(cudart) -> int:
    """The current device's SMs (0 when the runtime cannot say)."""
    return _device_attribute(cudart, 16)  # cudaDevAttrMultiProcessorCount


def _cudart():
    """The CUDA runtime library onnxruntime's CUDA provider has loaded (for copies between slots: onnxruntime's
    Python API copies whole buffers only). ``cudaMemcpy`` with kind cudaMemcpyDefault copies either way."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so", "cudart64_13.dll", "cudart64_12.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaMemcpy.restype = ctypes.c_int
        lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.cudaMemset.restype = ctypes.c_int
        size = ctypes.c_size_t
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaMemcpy2D.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size, ctypes.c_int]
        lib.cudaMemcpy2D.restype = ctypes.c_int
        lib.cudaMemset2D.argtypes = [ctypes.c_void_p, size, ctypes.c_int, size, size]
        lib.cudaMemset2D.restype = ctypes.c_int
        lib.cudaDeviceSynchronize.restype = ctypes.c_int
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaStreamSynchronize.restype = ctypes.c_int
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostAlloc.restype = ctypes.c_int
        lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        lib.cudaFreeHost.restype = ctypes.c_int
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaGetDevice.restype = ctypes.c_int
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaDeviceGetAttribute.restype = ctypes.c_int
        lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaEventCreateWithFlags.restype = ctypes.c_int
        lib.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaEventSynchronize.restype = ctypes.c_int
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventRecord.restype = ctypes.c_int
        lib.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventElapsedTime.restype = ctypes.c_int
        return lib
    raise BundleError("serving on CUDA needs the CUDA runtime library (libcudart) that onnxruntime-gpu uses; not found")


class DeviceRow:
    """One row of :class:`DeviceRows`: a device address (a cached state that stays on the GPU)."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address


class DeviceRows:
    """Rows of float32 arrays of ``shape`` in one device buffer (an onnxruntime OrtValue [rows, *shape]);
    ``rows[i]`` is row i's :class:`DeviceRow`."""

    def __init__(self, buffer, shape: tuple[int, ...]) -> None:
        self.buffer = buffer  # keeps the memory
        self.base, self.row_bytes = buffer.data_ptr(), 4 * int(np.prod(shape))

    def __getitem__(self, i: int) -> DeviceRow:
        return DeviceRow(self.base + i * self.row_bytes)


def _batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the decode launch is padded to: powers of two, from 32 on in quarters of each octave (32, 40, 48,
    56, 64, 80, ...), and max_batch; few captured graphs, each reused. A server at concurrency 64 decodes ~40-64
    sequences (the others are being prefilled): padded to powers of two alone, the launches of 33-48 computed up
    to a third more rows than they needed, and in halves of the octave (48) up to 15 rows more (a decode launch
    of 48 sequences took 0.963 ms on the H200, of 64 1.028: BENCHMARKS.md, session 25)."""
    sizes = {min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)}
    quarters = {q * 2**i for i in range(3, max_batch.bit_length()) for q in (5, 6, 7)}
    return sorted(sizes | {b for b in quarters if b < max_batch})


class _CudaPool(SlotPool):
    """Slots in device memory (:class:`StateBuffers` of [max_batch, ...]), decoded by onnxruntime's CUDA provider.

    A launch for n sequences runs the smallest bucket b >= n (:func:`_batch_buckets`) over slots 0..b-1: rows past n
    hold free slots, computed and ignored. Each (b, parity) has fixed bindings (pointers into the pool), so with
    CUDA graphs it is captured once and replayed. Batched graphs only (a schema-1 bundle gets :class:`_SinglePool`).

    Staging rows: ``staging`` [S, ...] holds the staged prompts' states; a prefill launch over rows start..start+k-1
    reads them there, writes ``staging_out`` and copies its rows back (no parity: a launch over some rows leaves the
    others where they are). It runs in the backend's own prefill session (no second copy of the weights); a launch
    of full chunks from row 0 is captured when it repeats, other shapes run plainly.
    """

    state_buffers = 2

    def __init__(self, backend: OrtCudaBackend, max_batch: int, graph: str = PREFILL) -> None:
        super().__init__(backend, max_batch)
        ort, c = backend.ort, backend.config
        self.cudart = _cudart()
        self.captured = backend.captured.get(DECODE, False)  # as the backend's own decode graph could be
        # decode on a stream of its own beside the backend's (prefill) stream: launches of both can overlap, and
        # the decode kernels, of higher priority, are not held up behind the prefill kernels
        self.stream = kernels_stream(backend.bundle, own=True, urgent=True) if backend.concurrent else None
        self.concurrent = backend.concurrent
        # a launch on the pool's own stream need not be waited for inside onnxruntime's run: finish_decode waits
        # for that stream, and the engine thread does its host work meanwhile (BENCHMARKS.md, session 23)
        self.async_decode = self.stream is not None
        self.session, self.batched = self._decode_sessions()
        self.layout = layout = backend.layout
        self.shapes = layout.shapes  # one sequence's [L, E, ..] per kind

        def alloc(shape: tuple[int, ...]):
            return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, "cuda", 0)

        self.states = StateBuffers({k: layout.buffer_shape(k, max_batch) for k in STATES}, alloc)
        self.sampler = _sampler(backend.bundle)  # the kernels library's sampler on the device, when it has one
        self.device_sample = self.sampler is not None
        self.greedy = None  # the bundle's greedy picker on the device, when it has one
        if backend.bundle.greedy_path is not None:
            # on the decode stream: after the decode launch, not behind a prefill launch
            providers = [("CUDAExecutionProvider", backend.provider_options(self.stream))]
            self.greedy = ort.InferenceSession(str(backend.bundle.greedy_path), backend.options, providers=providers)
            self.device_greedy = True
        self.buckets = _batch_buckets(max_batch)
        self.ids = {b: ort.OrtValue.ortvalue_from_numpy(np.zeros(b, np.int64), "cuda", 0) for b in self.buckets}
        # (bucket, parity) -> logits: one set per state buffer, so that a launch's logits outlive the next launch
        # (:meth:`prev_logits`: the engine caches a finished sequence's while the next launch runs)
        self.logits = {
            (b, p): ort.OrtValue.ortvalue_from_shape_and_type([b, c.vocab_padded], np.float32, "cuda", 0)
            for b in self.buckets
            for p in (0, 1)
        }
        self.launched = ((1, 1), (1, 0))  # (bucket, parity) of the last launch but one and of the last
        self.host_ids = np.zeros(max(self.buckets), np.int64)
        # pinned, one per launch parity (a fed launch's picks land while the host reads the launch before's)
        self.host_picks = [self.host_array((max(self.buckets) * 2,)).view(np.int64) for _ in range(2)]
        # begun launches not finished, oldest first: (n, (bucket, parity), picks queued behind it, index)
        self._begun: collections.deque[tuple[int, tuple[int, int], bool, int]] = collections.deque()
        # per launch parity: recorded on the decode stream once a greedy launch's picks are on the host
        self.done = [self._event(timing=False) for _ in range(2)] if self.async_decode else []
        self._no_wait = backend.ort.RunOptions()  # a run that returns once queued on its stream
        self._no_wait.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.next = {b: ort.OrtValue.ortvalue_from_numpy(np.zeros(b, np.int64), "cuda", 0) for b in self.buckets}
        self.picks: dict[tuple[int, int], Any] = {}  # (bucket, parity) -> the greedy picker's binding
        self.replays: dict[tuple[int, int], tuple] = {}
        self.staging_rows = prefill_batch(backend, graph, max_batch)
        self.staging = {k: alloc(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.staging_out = {k: alloc(layout.buffer_shape(k, self.staging_rows)) for k in STATES}
        self.stage_ids: dict[int, Any] = {}  # rows k x T -> device int64 [k x T] (captured launches' ids)
        self.stage_logits: dict[int, Any] = {}  # k -> device float32 [k, Vp]
        self.stage_replays: dict[tuple, tuple] = {}  # (graph, k, T) -> (binding, run options) of captured launches
        self.stage_seen: set[tuple] = set()  # (graph, k, T) run once: captured when it comes again
        self.stage_capture = True  # False once onnxruntime failed to capture a staging launch
        self.stage_plain: dict[tuple, Any] = {}  # (graph, start, k, T) -> binding of a launch run plainly
        self.stage_sessions: dict[str, Any] = {}  # graph -> the session the bindings above belong to
        self.stage_k = 1  # the last prefill launch's batch
        self.stage_graph = PREFILL  # the last prefill launch's graph
        self.stage_host: np.ndarray | None = None  # [S, Vp] pinned: the last launch's logits, once fetched
        self.stage_fetched = False  # whether stage_host holds the last launch's logits
        self.unsettled = False  # copies or memsets queued on the default stream since the last launch
        self.events: list[tuple[Any, Any]] = []  # timed: (start, end) CUDA events of launch k at k % 4
        self.count = 0  # decode launches begun: the next one's index
        self.timed_from = 0  # the first timed launch's index

    @property
    def staging_bytes(self) -> int:
        return 2 * self.staging_rows * self.slot_bytes  # the staged states and the launches' outputs

    def _staging_row(self, name: str, row: int, out: bool = False) -> tuple[int, int]:
        """(device address, pitch) of staging row ``row`` of state ``name`` (``out``: in the launches' output
        buffer; :class:`StateLayout`)."""
        buffer = (self.staging_out if out else self.staging)[name]
        return buffer.data_ptr() + self.layout.offset(name, row), self.layout.pitch(name, self.staging_rows)

    def _decode_sessions(self) -> tuple[Any, Any]:
        """The decode sessions: for one sequence the kernels graph, for more its CUDA copy where the bundle has one
        (MambaLinear runs a batch's projections faster than cuBLAS, one sequence's slower than cuBLAS's GEMV:
        BENCHMARKS.md, session 15) where it can run (:meth:`OrtCudaBackend.linear_copy`), else the same session. The
        copy's session holds a second copy of the weights on the device."""
        open_ = self.backend.open_session
        plain = open_(DECODE, capture=self.captured, stream=self.stream)
        if not self.backend.linear_copy(DECODE):
            return plain, plain
        return plain, open_(DECODE, capture=self.captured, stream=self.stream, linear=True)

    @property
    def linear(self) -> bool:
        """Whether decode batches of 2 and more run the kernels graph's CUDA copy (MambaLinear)."""
        return self.batched is not self.session

    def _decode_session(self, b: int) -> Any:
        """The session of a decode launch of bucket ``b`` (:meth:`_decode_sessions`)."""
        return self.session if b == 1 else self.batched

    def _prefill_session(self, graph: str) -> tuple[Any, bool]:
        """(session, captured) that runs ``graph``'s staging launches: the backend's prefill runner, or this pool's
        decode session (a "single" bundle's prompts, token by token)."""
        if graph == DECODE:
            return self.session, self.captured
        runner = self.backend.runners[graph]
        return runner.session, runner.captured

    def _stage_binding(self, graph: str, start: int, k: int, rows: int) -> Any:
        """A binding of one staging launch over rows start..start+k-1, its ids in the device buffer of k x rows
        ids (as a captured graph needs them; the caller fills it)."""
        session, _ = self._prefill_session(graph)
        ort, vp = self.backend.ort, self.backend.config.vocab_padded
        if k not in self.stage_logits:
            self.stage_logits[k] = ort.OrtValue.ortvalue_from_shape_and_type([k, vp], np.float32, "cuda", 0)
        if k * rows not in self.stage_ids:
            self.stage_ids[k * rows] = ort.OrtValue.ortvalue_from_numpy(np.zeros(k * rows, np.int64), "cuda", 0)
        binding = session.io_binding()
        binding.bind_ortvalue_input(TOKEN_IDS, self.stage_ids[k * rows])
        binding.bind_ortvalue_output(LOGITS, self.stage_logits[k])
        rows = (self.staging_rows, start, k)
        bind_states(binding, "cuda", self.layout, rows, self.staging.get, self.staging_out.get)
        return binding

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        if conv is None:
            for name in STATES:
                address, pitch = self._staging_row(name, row)
                if self.cudart.cudaMemset2D(address, pitch, 0, *self.layout.extent(name, k)) != 0:
                    raise RuntimeError("cudaMemset2D failed")
            self.unsettled = True
            return
        if isinstance(conv, DeviceRow):  # a cached state: it never left the device
            self._on_device(lambda name: self._staging_row(name, row), self._cached(conv, ssm))
            return
        conv, ssm = self.backend.graph_state(conv, ssm)  # contiguous float32
        for name, host in ((CONV_STATE, conv), (SSM_STATE, ssm)):
            self._copy2d(self._staging_row(name, row), self._host(name, host), name)
        self.unsettled = True  # a copy from pageable memory may still be on its way to the device

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        k, rows = ids.shape
        flat = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        session, captured = self._prefill_session(graph)
        if session is not self.stage_sessions.setdefault(graph, session):  # the runner reopened its graph plainly
            self.stage_sessions[graph] = session
            self.stage_plain, self.stage_replays = {}, {}  # bindings belong to a session
        key = (graph, k, rows)
        full = start == 0 and rows == self.backend.max_rows[graph]
        replay = self.stage_capture and captured and full and key in self.stage_seen
        self.stage_seen.add(key)
        if replay:
            if key not in self.stage_replays:
                options = self.backend.ort.RunOptions()  # graph ids apart from the runner's own and the decode's
                options.add_run_config_entry("gpu_graph_id", str(100000 + 2 * k + (graph == DECODE)))
                self.stage_replays[key] = (self._stage_binding(graph, 0, k, rows), options)
            binding, options = self.stage_replays[key]
        else:
            binding, options = self._plain_launch(graph, start, k, rows, captured)
        self.stage_ids[k * rows].update_inplace(flat)
        self._settle()
        try:
            session.run_with_iobinding(binding, options)
        except Exception as exc:  # onnxruntime's own types; a capture it cannot make: no more staging captures
            if not replay:
                raise
            self.backend.notes.append(f"batched prefill: CUDA graph capture failed, running plainly: {str(exc)[:200]}")
            self.stage_capture = False
            session.run_with_iobinding(*self._plain_launch(graph, start, k, rows, captured))
        for name in STATES:  # the written rows back where the states live
            self._copy2d(self._staging_row(name, start), self._staging_row(name, start, out=True), name, k)
        self.unsettled = True
        self.stage_k, self.stage_graph = k, graph
        self.stage_fetched = False

    def _plain_launch(self, graph: str, start: int, k: int, rows: int, captured: bool) -> tuple[Any, Any]:
        """(binding, run options) of a staging launch run plainly; a session with CUDA graphs enabled runs it under
        graph id -1."""
        if (graph, start, k, rows) not in self.stage_plain:
            self.stage_plain[graph, start, k, rows] = self._stage_binding(graph, start, k, rows)
        options = None
        if captured:
            options = self.backend.ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", "-1")
        return self.stage_plain[graph, start, k, rows], options

    def prefill_logits(self, i: int) -> np.ndarray:
        """Row i of the last launch's logits. The first call after a launch brings all k rows to pinned memory in
        one copy: a launch that finishes 16 prompts needs all 16 (their first tokens), and 16 copies of 0.2 MB
        into fresh pageable arrays cost more than the one of 3.2 MB."""
        if not self.stage_fetched:
            if self.stage_host is None:
                self.stage_host = self.host_array((self.staging_rows, self.backend.config.vocab_padded))
            rows = self.stage_host[: self.stage_k]
            self._copy(rows.ctypes.data, self.stage_logits[self.stage_k].data_ptr(), rows.nbytes)
            self.stage_fetched = True
        return self.stage_host[i].copy()

    def warm_decode(self) -> int:
        """Capture every decode bucket (both state parities); returns how many shapes. onnxruntime keeps a captured
        graph in the capturing thread's context, so this runs on the thread that will decode. Each graph id runs
        three times (:data:`_RUNS_TO_CAPTURE`). The slots hold no sequence
        yet: the launches compute on zeros and leave them free."""
        if not self.captured:
            return 0
        ids = np.zeros(self.max_batch, np.int64)
        for b in self.buckets:
            for _ in range(2 * _RUNS_TO_CAPTURE):  # the parities alternate
                self.decode_greedy(ids[:b]) if self.greedy is not None else self._launch(ids[:b])
        return 2 * len(self.buckets)

    def warm_prefill(self, graph: str) -> int:
        """Capture every staging launch of k full chunks from row 0 (k = 1..staging_rows), on the thread that will
        run the prefill launches (see :meth:`warm_decode`); returns how many shapes."""
        _, captured = self._prefill_session(graph)
        if not (self.captured and captured and self.stage_capture):
            return 0
        rows = self.backend.max_rows[graph]
        for k in range(1, self.staging_rows + 1):
            for row in range(k):
                self.stage(row)
            for _ in range(1 + _RUNS_TO_CAPTURE):  # the first runs plainly (a shape seen once), then its graph id
                self.prefill(graph, 0, np.zeros((k, rows), np.int64))
        return self.staging_rows

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._states_out(lambda name: self._staging_row(name, row), out)

    def host_array(self, shape: tuple[int, ...]) -> np.ndarray:
        """Pinned (page-locked) host memory: a state copies into it in one DMA, with no page faults; freed with
        the array. Pageable numpy memory when CUDA cannot pin it."""
        import ctypes

        n = int(np.prod(shape))
        ptr = ctypes.c_void_p()
        if n == 0 or self.cudart.cudaHostAlloc(ctypes.byref(ptr), 4 * n, 0) != 0:
            return np.empty(shape, np.float32)
        buffer = (ctypes.c_float * n).from_address(ptr.value)
        # freed when the last view of it is gone; not at exit, where the process's memory goes anyway
        weakref.finalize(buffer, self.cudart.cudaFreeHost, ptr.value).atexit = False
        return np.ctypeslib.as_array(buffer).reshape(shape)

    def move_staged(self, src: int, dst: int) -> None:
        self._on_device(lambda name: self._staging_row(name, dst), lambda name: self._staging_row(name, src))

    def cache_rows(self, capacity: int, shapes: tuple[tuple[int, ...], ...]) -> list:
        """The cached states in device memory (:class:`DeviceRows`: a state is cached and restored by one
        device-to-device copy, ~3 us for mamba-130m's 2.8 MB, where a copy to pinned host memory took 0.07-0.1 ms
        and its round trip 13 % of the tokens/s at concurrency 64 on the H200); the logits in pinned host memory,
        where sampling reads them."""
        ort = self.backend.ort
        rows: list = [
            DeviceRows(ort.OrtValue.ortvalue_from_shape_and_type([capacity, *shape], np.float32, "cuda", 0), shape)
            for shape in shapes[:2]
        ]
        return rows + [self.host_array((capacity, *shape)) for shape in shapes[2:]]

    def _states_out(
        self, where: Callable[[str], tuple[int, int]], out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's states, copied out of the device places (address, pitch) ``where(name)``: into ``out``
        when given (contiguous float32 host arrays of the states' shapes, or the state cache's :class:`DeviceRow` s:
        then the copy stays on the device), else into new host arrays."""
        if out is not None and isinstance(out[0], DeviceRow):
            self._on_device(self._cached(*out), where)
            return out
        hosts = []
        for i, name in enumerate(STATES):
            host = np.empty(self.shapes[name], np.float32) if out is None else out[i]
            assert host.flags.c_contiguous and host.dtype == np.float32 and host.shape == tuple(self.shapes[name])
            self._copy2d(self._host(name, host), where(name), name)
            hosts.append(host)
        return hosts[0], hosts[1]

    def _host(self, name: str, host: np.ndarray) -> tuple[int, int]:
        """(address, pitch) of one sequence's contiguous host array [L, E, ..] of state ``name``."""
        return host.ctypes.data, self.layout.pitch(name, 1)

    def _cached(self, conv: DeviceRow, ssm: DeviceRow) -> Callable[[str], tuple[int, int]]:
        """State name -> (device address, pitch) of a cached state's rows (one sequence's contiguous [L, E, ..])."""
        rows = {CONV_STATE: conv.address, SSM_STATE: ssm.address}
        return lambda name: (rows[name], self.layout.pitch(name, 1))

    def _on_device(
        self, dst: Callable[[str], tuple[int, int]], src: Callable[[str], tuple[int, int]], k: int = 1
    ) -> None:
        """Copy the states of k consecutive sequences from the device places (address, pitch) ``src(name)`` to
        ``dst(name)``. The copy returns before it finishes; the default stream runs such copies in order, and the
        next launch waits for them (:meth:`_settle`)."""
        for name in STATES:
            self._copy2d(dst(name), src(name), name, k)
        self.unsettled = True

    def _settle(self) -> None:
        """Wait for the copies and memsets queued since the last launch (on the default stream, which
        onnxruntime's own stream need not wait for): one wait per launch, not one per copy. An iteration that
        admits 16 prompts queues several copies per prompt (staging, cache stores, admission, the moved staging
        row), each once followed by its own wait (BENCHMARKS.md, session 11: the prefill iterations' times). On
        non-blocking streams (:attr:`concurrent`) the wait is for the legacy stream alone, every time (the token
        ids' copy too), so a decode launch does not wait for a prefill launch running beside it."""
        if self.concurrent:
            self.backend.settle()
        elif self.unsettled:
            self.cudart.cudaDeviceSynchronize()
            self.unsettled = False

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        if self.cudart.cudaMemcpy(dst, src, nbytes, 4) != 0:  # 4: cudaMemcpyDefault
            raise RuntimeError("cudaMemcpy failed")

    def _copy2d(self, dst: tuple[int, int], src: tuple[int, int], name: str, k: int = 1) -> None:
        """Copy k consecutive rows of state ``name`` between two (address, pitch) places (:class:`StateLayout`):
        one 2-D copy, of one piece per layer where the states are layered."""
        width, height = self.layout.extent(name, k)
        if self.cudart.cudaMemcpy2D(dst[0], dst[1], src[0], src[1], width, height, 4) != 0:  # cudaMemcpyDefault
            raise RuntimeError("cudaMemcpy2D failed")

    def _slot(self, name: str, slot: int, prev: bool = False) -> tuple[int, int]:
        """(device address, pitch) of ``slot``'s state ``name`` in the current buffer (``prev``: the other one, which
        a begun launch reads and the launch before wrote)."""
        buffer = self.states.write(name) if prev else self.states.read(name)
        return buffer.data_ptr() + self.layout.offset(name, slot), self.layout.pitch(name, self.max_batch)

    def _replay(self, b: int) -> tuple:
        key = (b, self.states.parity)
        if key not in self.replays:
            binding = self._decode_session(b).io_binding()
            binding.bind_ortvalue_input(TOKEN_IDS, self.ids[b])
            binding.bind_ortvalue_output(LOGITS, self.logits[key])
            bind_states(binding, "cuda", self.layout, (self.max_batch, 0, b), self.states.read, self.states.write)
            both = []
            for wait in (True, False):
                options = self.backend.ort.RunOptions()
                if self.captured:  # graph ids apart from the backend's own (2 * rows + parity + 1 <= 2 * 64 + 2)
                    options.add_run_config_entry("gpu_graph_id", str(1000 + 2 * b + self.states.parity))
                if not wait:  # onnxruntime returns once the launch is queued on the stream
                    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
                both.append(options)
            self.replays[key] = (binding, *both)
        return self.replays[key]

    def time_launches(self) -> bool:
        """Two CUDA events per launch on the decode stream (a few us of the host's time per launch): one before
        the launch, one after it and what is queued behind it (a greedy launch's picker and the copy of its
        picks)."""
        if self.stream is None:
            return False
        self.events = [(self._event(), self._event()) for _ in range(4)]
        self.timed_from = self.count
        return True

    def _event(self, timing: bool = True) -> Any:
        """A new CUDA event (without timing: cheaper to record and wait for)."""
        import ctypes

        event = ctypes.c_void_p()
        if self.cudart.cudaEventCreateWithFlags(ctypes.byref(event), 0 if timing else 2) != 0:  # 2: DisableTiming
            raise RuntimeError("cudaEventCreateWithFlags failed")
        return event

    def _mark(self, end: bool) -> None:
        """Record launch ``count``'s start (before it is begun) or end event on the decode stream (timed)."""
        if self.events and self.cudart.cudaEventRecord(self.events[self.count % 4][end], self.stream) != 0:
            raise RuntimeError("cudaEventRecord failed")

    def _times(self, k: int) -> None:
        """:attr:`launch_times` of launch ``k``, once it has ended (timed)."""
        if not self.events or k < self.timed_from:
            return
        import ctypes

        ms = ctypes.c_float()

        def elapsed(a: Any, b: Any) -> float:
            if self.cudart.cudaEventElapsedTime(ctypes.byref(ms), a, b) != 0:
                raise RuntimeError("cudaEventElapsedTime failed")
            return ms.value / 1e3

        start, end = self.events[k % 4]
        idle = elapsed(self.events[(k - 1) % 4][1], start) if k > self.timed_from else None
        self.launch_times = (elapsed(start, end), idle)

    def begin_decode(self, ids: np.ndarray, how: str = "logits") -> None:
        """Where the launch runs without the host waiting (``async_decode``), a greedy launch's picker and the copy
        of its picks to the host are queued behind it on its stream: :meth:`finish_decode` then waits once and
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
        wait for the picks, then begin the next launch (BENCHMARKS.md, session 26: the stream's idle time between
        launches)."""
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
            if self.cudart.cudaMemcpyAsync(host.ctypes.data, self.next[key[0]].data_ptr(), 8 * n, 2, self.stream):
                raise RuntimeError("cudaMemcpyAsync failed")  # 2: cudaMemcpyDeviceToHost
            if self.cudart.cudaEventRecord(self.done[index % 2], self.stream) != 0:
                raise RuntimeError("cudaEventRecord failed")
        self._mark(end=True)
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
            if self.cudart.cudaEventSynchronize(self.done[index % 2]) != 0:
                raise RuntimeError("cudaEventSynchronize failed")
            self._times(index)
            return self.host_picks[index % 2][:n].copy()
        assert not self._begun  # only a launch whose picks stay on the device has one queued behind it
        if self.async_decode and self.cudart.cudaStreamSynchronize(self.stream) != 0:
            raise RuntimeError("cudaStreamSynchronize failed")
        self._times(index)
        b, logits = key[0], self.logits[key]
        if how == "greedy":
            self.greedy.run_with_iobinding(self._picker(key))
            out = np.empty(n, np.int64)
            self._copy(out.ctypes.data, self.next[b].data_ptr(), out.nbytes)
            return out
        if how == "sample":
            stream = self.stream if self.stream is not None else self.backend.stream
            return self._sample(logits, params, stream)
        out = np.empty((n, self.backend.config.vocab_padded), np.float32)  # new: callers keep rows
        self._copy(out.ctypes.data, logits.data_ptr(), out.nbytes)
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

    def prefill_sample(self, params: np.ndarray) -> np.ndarray:
        # on the stream of the launch's session (:meth:`_prefill_session`), from this thread: the decode thread
        # samples on its own stream meanwhile (the sampler keeps device buffers per stream)
        stream = self.stream if self.stage_graph == DECODE else self.backend.stream
        return self._sample(self.stage_logits[self.stage_k], params, stream)

    def _sample(self, logits: Any, params: np.ndarray, stream: int | None) -> np.ndarray:
        """The kernels library's sampler over the first n rows of the device logits ``logits`` [b >= n, Vp], n
        being the rows of ``params`` float64 [n, 2]; the picks int64 [n] on the host."""
        params = np.ascontiguousarray(params, dtype=np.float64)
        n = params.shape[0]
        assert params.shape == (n, 2) and n <= logits.shape()[0]
        out = np.empty(n, np.int64)
        c = self.backend.config
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
        vp = self.backend.config.vocab_padded
        out = np.empty(vp, np.float32) if out is None else out
        assert out.flags.c_contiguous and out.dtype == np.float32 and out.size <= vp
        self._copy(out.ctypes.data, self.logits[key].data_ptr() + row * 4 * vp, out.nbytes)
        return out

    def prev_slot_state(
        self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        return self._states_out(lambda name: self._slot(name, slot, prev=True), out)

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
        self._settle()  # copies on the default stream first: the cache's, of the states the launch overwrites
        self._mark(end=False)
        if ids is None:  # the picks of the launch before (the same bucket) on the stream, padding rows' too
            if self.cudart.cudaMemcpyAsync(self.ids[b].data_ptr(), self.next[b].data_ptr(), 8 * b, 3, self.stream):
                raise RuntimeError("cudaMemcpyAsync failed")  # 3: cudaMemcpyDeviceToDevice
        try:
            self._decode_session(b).run_with_iobinding(binding, both[0 if wait else 1])
        except Exception as exc:  # onnxruntime's own types; a capture it cannot make: run plainly from now on
            if not self.captured:
                raise
            self.backend.notes.append(f"batched decode: CUDA graph capture failed, running plainly: {str(exc)[:200]}")
            self.captured, self.replays = False, {}
            self.session, self.batched = self._decode_sessions()
            binding, *both = self._replay(b)
            self._decode_session(b).run_with_iobinding(binding, both[0])
        self.launched = (self.launched[1], (b, self.states.parity))
        self.states.swap()
        return b

    def admit(self, slot: int, row: int, k: int = 1) -> None:
        self._on_device(lambda name: self._slot(name, slot), lambda name: self._staging_row(name, row), k)

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._states_out(lambda name: self._slot(name, slot), out)

    def move(self, src: int, dst: int) -> None:
        self._on_device(lambda name: self._slot(name, dst), lambda name: self._slot(name, src))


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

    def __init__(self, bundle: Bundle) -> None:
        super().__init__(bundle, "cuda")
        check_plans(bundle)
        trt = find_tensorrt()
        cuda = import_polygraphy("polygraphy.cuda")
        self.trt = trt.module
        self.stream = cuda.Stream()
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.ERROR))
        self.engines, self.contexts = {}, {}
        for graph in self.graphs:
            engine = self.runtime.deserialize_cuda_engine(bundle.plan_path(graph).read_bytes())
            if engine is None:
                raise BundleError(f"{bundle.plan_path(graph)}: TensorRT could not deserialize the plan (corrupt?)")
            check_io(bundle.contract(graph), *self._engine_io(engine), str(bundle.plan_path(graph)))
            self.engines[graph] = engine
            self.contexts[graph] = engine.create_execution_context()

        def alloc(shape: tuple[int, ...]):
            return cuda.DeviceArray(shape=shape, dtype=np.float32)

        self.states = StateBuffers(self._state_shapes(), alloc)
        max_rows = max(self.max_rows[g] for g in self.graphs)
        self.ids = cuda.DeviceArray(shape=(max_rows,), dtype=np.int64)
        self.logits = cuda.DeviceArray(shape=(1, self.config.vocab_padded), dtype=np.float32)
        self.host_logits = np.empty((1, self.config.vocab_padded), np.float32)
        self.reset()

    def _engine_io(self, engine) -> tuple[list[tuple], list[tuple]]:
        """(inputs, outputs) of a plan as (name, dtype, shape) triples; -1 marks a dynamic dimension."""
        trt = self.trt
        dtypes = {trt.DataType.INT64: "int64", trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16"}
        io: tuple[list[tuple], list[tuple]] = ([], [])
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = engine.get_tensor_dtype(name)
            found = (name, dtypes.get(dtype, str(dtype)), tuple(engine.get_tensor_shape(name)))
            io[0 if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else 1].append(found)
        return io

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        ctx, states = self.contexts[graph], self.states
        self.ids.copy_from(ids, stream=self.stream)
        ctx.set_input_shape(TOKEN_IDS, ids.shape)
        ctx.set_tensor_address(TOKEN_IDS, self.ids.ptr)
        for name, out_name in STATE_PAIRS:
            ctx.set_input_shape(name, states.read(name).shape)  # the batch axis of a decode plan is dynamic
            ctx.set_tensor_address(name, states.read(name).ptr)
            ctx.set_tensor_address(out_name, states.write(name).ptr)
        ctx.set_tensor_address(LOGITS, self.logits.ptr)
        if not ctx.execute_async_v3(self.stream.ptr):
            raise RuntimeError(f"TensorRT execution of the {graph} plan failed")
        states.swap()
        self.logits.copy_to(self.host_logits, stream=self.stream)
        self.stream.synchronize()
        return self.host_logits[0].copy()

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for name in (CONV_STATE, SSM_STATE):
            buf = self.states.read(name)
            host = np.empty(buf.shape, np.float32)
            buf.copy_to(host, stream=self.stream)
            out.append(host)
        self.stream.synchronize()
        return self.sequence_state(out[0], out[1])

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.graph_state(conv, ssm)
        self.states.read(CONV_STATE).copy_from(conv, stream=self.stream)
        self.states.read(SSM_STATE).copy_from(ssm, stream=self.stream)
        self.stream.synchronize()

    def close(self) -> None:
        for buf in self.states.buffers() + [self.ids, self.logits]:
            buf.free()
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


def open_backend(
    bundle: Bundle,
    backend: str = "auto",
    device: str | None = None,
    cuda_graph: bool = True,
    graphs: str = "auto",
    threads: int = 0,
    prefill_sms: int | None = 0,
) -> Backend:
    """The backend to run a bundle: ``auto`` picks TensorRT when a runtime and the plans are present, else
    onnxruntime on ``device`` (default cpu). ``cuda_graph``, ``prefill_sms``: see :class:`OrtCudaBackend`.
    ``graphs``: the graph flavour onnxruntime runs (:func:`pick_flavour`); TensorRT plans are built from the portable
    graphs."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if device is not None and device not in DEVICES:
        raise InputError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    if graphs not in GRAPH_CHOICES:
        raise InputError(f"unknown graphs '{graphs}'; choose one of {', '.join(GRAPH_CHOICES)}")
    if graphs in (FUSED, KERNELS) and backend == "trt":
        raise InputError(f"TensorRT runs the portable graphs only; use --backend ort with --graphs {graphs}")
    if graphs in (FUSED, KERNELS) and graphs not in bundle.flavours:
        why = "built by an older mambatrt" if graphs == FUSED else "built with --kernels none or without a compiler"
        raise InputError(f"{bundle.path} has no {graphs} graphs ({why}); rebuild it or use --graphs portable")
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
    device = device or "cpu"
    flavour = pick_flavour(bundle, graphs, device)
    cls = OrtCudaBackend if device == "cuda" else OrtCpuBackend
    if prefill_sms and device != "cuda":
        raise InputError("--prefill-sms applies to --device cuda")
    kwargs = {"cuda_graph": cuda_graph, "prefill_sms": prefill_sms} if device == "cuda" else {}
    notes = []
    while True:
        try:
            opened = cls(bundle, threads=threads, flavour=flavour, **kwargs)
            opened.notes[:0] = notes
            return opened
        except _OrtLoadError as exc:
            if graphs != "auto" or flavour == PORTABLE:
                raise
            # e.g. an onnxruntime without the fused ops (before 1.31): the next flavour, down to the portable graphs
            notes.append(f"{flavour} graphs not used: {str(exc).splitlines()[0][:200]}")
            fused_next = flavour == KERNELS and FUSED in bundle.flavours and device in AUTO_FUSED_DEVICES
            flavour = FUSED if fused_next else PORTABLE


# Where ``--graphs auto`` falls back on the fused graphs without the kernels library (BENCHMARKS.md, "Graph
# flavours"): on CUDA they launch far fewer kernels per step; on the CPU the portable graphs are as fast or faster
AUTO_FUSED_DEVICES = ("cuda",)
# serve's default share of the GPU's SMs for prefill launches beside decode (--prefill-sms auto): at fp32 mamba-130m
# concurrency 64 on an H200, 64-80 of its 132 SMs gave ITL p50 1.15-1.22 ms against 1.29-1.30 on the whole GPU,
# 96 gave 1.25 and 48 lost tokens/s (BENCHMARKS.md, session 31); half (72 after Hopper's rounding to 8) is among the
# best of them and leaves prefill the most SMs
AUTO_PREFILL_SHARE = 0.5


def pick_flavour(bundle: Bundle, graphs: str, device: str) -> str:
    """The flavour onnxruntime runs: as asked, or for ``auto`` the kernels graphs where the bundle's library has
    kernels for the device (every library has CPU kernels; since session 12 they vectorize: 128-token prefill 6.2
    against the portable graphs' 17.3 ms on the default model, BENCHMARKS.md), else on :data:`AUTO_FUSED_DEVICES`
    the fused graphs when the bundle has them, else the portable graphs."""
    if graphs != "auto":
        return graphs
    if device not in AUTO_FUSED_DEVICES:
        return KERNELS if KERNELS in bundle.flavours else PORTABLE
    if KERNELS in bundle.flavours and bundle.kernels_cuda:
        return KERNELS
    return FUSED if FUSED in bundle.flavours else PORTABLE
