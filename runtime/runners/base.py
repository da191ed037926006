"""The one face of every runner (onnxruntime on the CPU, onnxruntime on CUDA, TensorRT) and of its slot pool.

A :class:`Runner` runs one sequence and keeps its recurrent states itself, on its device::

    run(graph, token_ids [S]) -> logits [Vp] float32 on the host   (graph "prefill": 1..max_rows; "decode": 1)
    reset()   get_state() -> (conv [L, E, K-1], ssm [L, E, N])   set_state(conv, ssm)   close()

It is a context manager (``with open_runner(bundle) as runner:`` closes it). :class:`Runner` does the checks and
bookkeeping shared by all of them; a subclass binds buffers and executes. Each graph's inputs and outputs are
checked against the I/O contract (:mod:`mambatrt.contract`) when it is opened.

For many sequences, ``open_pool`` gives a :class:`SlotPool` beside the runner: the decode slots of continuous
batching and the staging rows where prompts are prefilled, on the runner's device. The engine
(:mod:`mambatrt.runtime.engine`) drives a pool; `mambatrt run` is the engine with one slot, which is the runner's
own state (:class:`SinglePool`).
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from mambatrt.contract import CONV_STATE, DECODE, PORTABLE, PREFILL, SSM_STATE
from mambatrt.errors import InputError

from ..bundle import Bundle
from .states import StateLayout


class Runner:
    """Shared part of every runner: chunk checks, state shapes, graph availability."""

    name = "base"  # "onnxruntime" or "tensorrt"

    def __init__(self, bundle: Bundle, device: str) -> None:
        self.bundle = bundle
        self.device = device  # "cpu" or "cuda"
        self.config = bundle.config
        self.graphs = bundle.graphs
        self.flavour = PORTABLE  # which graph files run (onnxruntime runs the "kernels" ones where it can)
        self.notes: list[str] = []  # what the user should know about how this runner runs (a fallback, its cost)
        # the graphs' states carry a batch axis from schema 2 on; one sequence is a batch of one
        self.lead: tuple[int, ...] = (1,) if bundle.manifest.batched else ()

    @functools.cached_property
    def max_rows(self) -> dict[str, int]:
        """graph -> rows per sequence of one launch in the flavour this runner runs (a subclass sets its flavour
        first): the kernels prefill graph's own limit (2048 in bundles built now), the portable graphs' and plans'
        ``max_prefill_rows`` (64)."""
        return {DECODE: 1, PREFILL: self.bundle.manifest.prefill_rows(self.flavour)}

    @functools.cached_property
    def launch_rows(self) -> dict[str, int]:
        """graph -> rows of one launch over all its sequences: the decode graph's batch, the prefill graph's rows
        shared by the sequences of a batched launch (:meth:`Manifest.prefill_launch_rows`)."""
        manifest = self.bundle.manifest
        return {DECODE: manifest.max_batch, PREFILL: manifest.prefill_launch_rows(self.flavour)}

    def chunk_rows(self, graph: str, k: int) -> int:
        """The most rows per sequence of a launch of ``graph`` over k sequences."""
        return max(1, min(self.max_rows[graph], self.launch_rows[graph] // k))

    def staged_launch_rows(self, graph: str, k: int) -> int:
        """The rows of the largest launch of ``graph`` over k staged prompts: a full chunk each, within the rows of
        one launch (the size of a pool's token-ids buffer, and the scheduler's rows per launch)."""
        return min(k * self.max_rows[graph], self.launch_rows[graph])

    @functools.cached_property
    def layout(self) -> StateLayout:
        """How the graphs of the flavour this runner runs take the states (a subclass sets its flavour first)."""
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
            raise InputError(f"chunk of {ids.size} rows exceeds the {graph} graph's limit of {limit} rows")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise InputError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def scorer(self):
        """The :class:`~.scorer.Scorer` of the bundle's scoring graph on this runner's device, or None where the
        bundle or the runner has none (prompts are then scored one decode launch per token)."""
        return None

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

    # -- implemented by each runner ------------------------------------------------------------------------------
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

    def open_pool(self, max_batch: int, graph: str = PREFILL) -> SlotPool:
        """State slots for continuous batching on this runner's device, prompts prefilled on ``graph``; one slot
        is the runner's own state (:class:`SinglePool`, what `mambatrt run` uses)."""
        return SinglePool(self, 1)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the state tensors of one sequence, by input name (what :class:`StateBuffers` allocates)."""
        return {
            CONV_STATE: self.lead + self.config.conv_state_shape,
            SSM_STATE: self.lead + self.config.ssm_state_shape,
        }


def prefill_batch(runner: Runner, graph: str, max_batch: int) -> int:
    """Prompts one launch of ``graph`` can prefill on this runner: the prefill graph's batch, or the decode graph's
    (a "single" bundle's prompts go token by token through the batched decode graph)."""
    if graph == PREFILL:
        return runner.bundle.prefill_batch(runner.flavour)
    return max_batch if runner.bundle.manifest.batched else 1


def into(out: tuple[np.ndarray, np.ndarray] | None, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, ...]:
    """(conv, ssm), or ``out`` with them copied in."""
    if out is None:
        return conv, ssm
    out[0][...], out[1][...] = conv, ssm
    return out


class SlotPool:
    """The states of continuous batching on a runner's device: ``max_batch`` decode slots and ``staging_rows``
    staging rows, where prompts are prefilled.

    Decoding sequences occupy slots 0..n-1 so that one batched decode launch takes the first n rows of the pool.
    Prompts are prefilled in staging rows, chunk by chunk; one launch feeds a chunk of the same length to each of
    the consecutive rows start..start+k-1 (:meth:`prefill`; k up to the prefill graph's batch: ``staging_rows``),
    then :meth:`admit` copies a prefilled row's state into a free slot; states leave the device only for the prefix
    cache (:meth:`staged`, :meth:`slot_state`). This base class stages one prompt in the runner's own
    single-sequence state.
    """

    device_greedy = False  # whether decode_greedy picks greedy tokens where the logits are (no logits copy)
    device_sample = False  # whether decode_sample picks tokens (greedy or by temperature) where the logits are
    concurrent = False  # whether a prefill launch may run (in another thread) beside a decode launch
    shared_staging = False  # whether staging a prompt overwrites slot 0 (then no prompt is staged while it runs)
    staging_rows = 1  # prompts prefilled at once (the prefill graph's batch)
    state_buffers = 1  # copies of the slots' states (2: a decode launch reads one buffer and writes the other)
    async_decode = False  # whether begin_decode returns while the launch runs (the host meanwhile does other work)
    can_feed = True  # whether feed() can begin a greedy launch from the picks of one not finished
    captured = False  # whether launches replay captured CUDA graphs (captured on first use, or by warm_*)

    def __init__(self, runner: Runner, max_batch: int) -> None:
        self.runner = runner
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

    def finish_decode(self, how: str, params: np.ndarray | None = None) -> np.ndarray:
        """End the oldest launch begun and not finished, as ``how`` asks (begun with the same): "greedy"
        (:meth:`decode_greedy`), "sample" (:meth:`decode_sample`, with ``params``) or "logits" (:meth:`decode`)."""
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
        c = self.runner.config
        return 4 * (int(np.prod(c.conv_state_shape)) + int(np.prod(c.ssm_state_shape)))

    @property
    def slots_bytes(self) -> int:
        """Bytes of every slot's state, in every buffer."""
        return self.state_buffers * self.max_batch * self.slot_bytes

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging rows (0 here: the runner's own state is the staging row)."""
        return 0

    def stage(self, row: int, conv: np.ndarray | None = None, ssm: np.ndarray | None = None, k: int = 1) -> None:
        """Start staging row ``row`` from host states [L, E, K-1], [L, E, N] (a cached prefix), or zeros: then
        rows row..row+k-1."""
        if conv is None:
            assert row + k <= self.staging_rows
            self.runner.reset()
        else:
            self.runner.set_state(conv, ssm)

    def prefill(self, graph: str, start: int, ids: np.ndarray) -> None:
        """One launch: chunk ``ids[i]`` (ids [k, T] int64) to staging row start + i, for i < k."""
        self._logits = self.runner.run(graph, ids[0])[None]

    def prefill_logits(self, i: int) -> np.ndarray:
        """Row ``i`` of the last :meth:`prefill` launch: the logits [Vp] after its chunk, on the host."""
        return self._logits[i]

    def staged(self, row: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of staging row ``row``'s states: into ``out`` (the state cache's arrays) when given."""
        return into(out, *self.runner.get_state())

    def host_array(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 host array that this pool copies into quickly (pinned on CUDA)."""
        return np.empty(shape, np.float32)

    def cache_rows(self, capacity: int, shapes: tuple[tuple[int, ...], ...]) -> list:
        """The state cache's storage, made once: for each of an entry's arrays (conv, ssm, logits) ``capacity``
        rows, indexable by entry. The states' rows are where :meth:`staged`, :meth:`slot_state` and :meth:`stage`
        copy fastest: host arrays here, device memory on CUDA. Written once here, so that the memory is the
        process's from the start (a machine short of it fails now, not mid-request) and no request pays the page
        faults of a row's first use (20x the copy itself)."""
        rows = [self.host_array((capacity, *shape)) for shape in shapes]
        for a in rows:
            a.fill(0.0)
        return rows

    def move_staged(self, src: int, dst: int) -> None:
        """Copy staging row ``src`` over row ``dst`` (the staged rows stay consecutive)."""
        raise AssertionError("one staging row never moves")

    def warm_decode(self) -> int:
        """Run once, before serving, every decode launch shape that is captured on first use (returns how many), so
        that no request pays for a capture; on the thread that will decode. Nothing to do where nothing is
        captured."""
        return 0

    def warm_prefill(self, graph: str) -> int:
        """As :meth:`warm_decode` for the prefill launches of ``graph``, on the thread that will run them."""
        return 0

    # -- per device -------------------------------------------------------------------------------------------
    def admit(self, slot: int, row: int, k: int = 1) -> None:
        """Copy the states of staging rows row..row+k-1 into slots slot..slot+k-1 (a prefill launch's prompts
        taking consecutive slots: one copy per state)."""
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
        the host), as :func:`~mambatrt.runtime.engine.sampling.sample_token` picks it for a temperature alone:
        ``params`` float64 [n, 2] holds each row's temperature (0: greedy) and uniform draw. The logits stay on the
        device (:meth:`last_logits`). Only where ``device_sample``."""
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

    def close(self) -> None:
        """Free what the pool holds on its device (the engine has stopped using it)."""


class SinglePool(SlotPool):
    """One slot, which is the runner's own state: the staging sequence is the slot (``shared_staging``), so
    admitting copies nothing and a decode step is a plain launch. Works on every runner."""

    shared_staging = True

    def admit(self, slot: int, row: int, k: int = 1) -> None:
        pass  # the prompt's state is already where the slot is (one slot: k is 1)

    def decode(self, ids: np.ndarray) -> np.ndarray:
        return self.runner.run(DECODE, ids)[None]  # [1, Vp]

    def slot_state(self, slot: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        return into(out, *self.runner.get_state())

    def move(self, src: int, dst: int) -> None:
        raise AssertionError("a pool of one slot never moves a state")
