"""The scheduler: which sequences are prefilled and which decode, in which rows and slots of the slot pool.

Sequences wait (FIFO), then are staged in the pool's staging rows, each from the longest prefix the state cache
holds, and prefilled chunk by chunk, the oldest prompt first: while sequences decode, at most ``prefill_rows`` prompt
rows per iteration (so the decoding sequences keep a steady inter-token latency), with nothing decoding up to a
full launch's rows. A chunk is as long as the runner's prefill graph takes (the kernels graphs' 2048 rows, the
portable graphs' 64) and the iteration's rows allow; one launch feeds a chunk of the same length to each of several
neighbouring staged prompts where the prefill graph takes a batch, within the rows of one launch. Prefilled
sequences move into free slots, the oldest first; the decoding sequences occupy slots 0..n-1, so one decode launch
takes the pool's first n rows, and a finished sequence's slot is filled at once by the last one (one copy of a
state).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..runners.base import SlotPool
from .config import EngineConfig
from .request import Sequence
from .sampling import sampler_rows, token_logprob
from .state_cache import StateCache


@dataclass
class Launch:
    """One planned prefill launch: staging rows lo..lo+k-1 fed ``ids`` [k, rows]; ``boundaries``: the positions in
    the launch whose chunk ends at a chunk boundary of a longer prompt (their states go into the cache); ``want``:
    those whose logits the engine needs, which the launch fills into ``logits``; ``first``: those whose first
    tokens the pool picks from the launch's logits with the sampler's rows ``draws`` (:meth:`Scheduler.first_draws`),
    into ``picks``."""

    lo: int
    ids: np.ndarray  # [k, rows] int64
    boundaries: list[int]
    want: list[int]
    first: list[int] = field(default_factory=list)
    draws: np.ndarray | None = None  # [k, 2] float64: (temperature, uniform draw) per row
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    picks: dict[int, int] = field(default_factory=dict)
    score: bool = False  # one prompt on the scoring graph: every row's logits into ``rows``
    rows: np.ndarray | None = None  # [rows, V]


def leading_run(rows: list[int], limit: int) -> int:
    """How many of ``rows`` (at least one, at most ``limit``) follow the first one by one (r, r + 1, ...): staging
    rows that one call zeroes, or one copy moves into consecutive slots."""
    k = 1
    while k < min(len(rows), limit) and rows[k] == rows[0] + k:
        k += 1
    return k


class Scheduler:
    """Where every sequence is (waiting, staged in row i, decoding in slot i) and what the next launches carry."""

    def __init__(self, pool: SlotPool, config: EngineConfig, max_batch: int, graph: str, on_cuda: bool) -> None:
        """``graph``: the graph prompts are prefilled on (the decode graph: one row per prompt and launch)."""
        runner = pool.runner
        self.pool, self.max_batch = pool, max_batch
        self.chunk = runner.max_rows[graph]  # rows per prompt of one launch
        self.launch = runner.staged_launch_rows(graph, pool.staging_rows)  # rows of one launch
        # the portable prefill graph's chunk (64): the unit of the CPU's rows per iteration, and the scoring graph's
        self.score_chunk = runner.bundle.max_prefill_rows
        self.base = base = min(self.chunk, self.score_chunk)
        # a k-prompt launch costs far less than k one-prompt launches on a GPU (16 x 64 rows: 8.7 ms against 16 x
        # 1.8 ms on the H200), k times one on a CPU core; on the H200 a 64-row chunk per staging row (one full
        # launch, beside the decode launches) served more tokens/s at concurrency 32-128 with lower TTFT and ITL
        # than four chunks
        default = self.launch if on_cuda else base * min(4, pool.staging_rows)
        self.prefill_rows = max(base, config.prefill_rows or default)  # rows per iteration while sequences decode
        # with nothing decoding nobody waits between two decode launches: a full launch, unless the config says
        self.idle_rows = max(base, config.prefill_rows or max(default, self.launch))
        self.ratio, self.max_waiting = config.waiting_served_ratio, config.max_waiting_tokens
        c = pool.runner.config
        self.vocab = c.vocab_size
        shapes = (c.conv_state_shape, c.ssm_state_shape, (self.vocab,))
        self.cache = StateCache(config.cache_bytes, shapes, pool.cache_rows)
        self.running: list[Sequence] = []  # sequence i decodes in slot i
        self.staging: list[Sequence] = []  # sequence i is prefilled in staging row i
        self.waiting: collections.deque[Sequence] = collections.deque()  # not staged yet
        self.cancelled: set[int] = set()
        self.draws = np.random.default_rng()  # the device sampler's draws of requests without a seed
        self.held = 0  # decode iterations that new prompts were held back in, since the last prefill round
        self.ended = 0  # running sequences that ended while a launch held their slots (compact frees them)
        self.unfed = False  # a running sequence was cancelled: the next iteration frees its slot (no feeding)
        self.released: list[int] = []  # staging rows admitted in this iteration, freed by release()
        self.boundaries: list[Sequence] = []  # staged prompts at a chunk boundary to cache, by release()
        self.totals = {"prefill_launches": 0, "prefill_rows": 0, "pool_first_tokens": 0}

    # -- staging ------------------------------------------------------------------------------------------------
    def stage(self) -> None:
        """Stage waiting prompts (FIFO) in free staging rows; those that start from zeros are zeroed together (one
        call per state for a round of new prompts, not one per prompt: on CUDA each is a call of the driver's)."""
        pool = self.pool
        zeros: list[int] = []  # new rows to start from zeros
        while self.waiting and len(self.staging) < pool.staging_rows:
            if pool.shared_staging and (self.running or self.staging):
                break  # staging would overwrite the running (or staged) sequence's state
            seq = self.waiting.popleft()
            if not self._start(seq, len(self.staging)):
                zeros.append(len(self.staging))
            self.staging.append(seq)
        while zeros:  # each run of consecutive rows in one call
            k = leading_run(zeros, len(zeros))
            pool.stage(zeros[0], k=k)
            zeros = zeros[k:]

    def _start(self, seq: Sequence, row: int) -> bool:
        """Stage a prompt in ``row`` from the caller's states or the longest cached prefix (the whole prompt too:
        then its cached logits give the first token without a launch); False: from zeros, which the caller sets."""
        if seq.request.state is not None:  # the caller's states (a saved conversation): no cache lookup
            self.pool.stage(row, *seq.request.state)
            return True
        # a prompt to score: its rows before the first scored one may come from the cache
        limit = seq.request.score_from - 1 if seq.score_rows else seq.split
        n, entry = self.cache.longest_prefix(seq.prompt[:limit]) if limit else (0, None)
        if entry is not None:  # the cache's rows: staging copies the states
            conv, ssm, logits = entry
            self.pool.stage(row, conv, ssm)
            if n == seq.split:  # the whole prompt: its first token comes from these logits (a longer one's
                seq.logits = logits.copy()  # from its last launch)
            seq.at = seq.fed = seq.cached_tokens = n
            return True
        return False

    def unstage(self, row: int) -> None:
        """Free staging row ``row``: the last staged prompt moves into it, so the staged rows stay 0..m-1."""
        last = len(self.staging) - 1
        if row != last:
            self.pool.move_staged(last, row)
            self.staging[row] = self.staging[last]
        self.staging.pop()

    # -- prefill launches -------------------------------------------------------------------------------------
    def plan_prefill(self) -> list[Launch]:
        """This iteration's prefill launches: chunks within the row budget, oldest prompt first, one launch per run
        of neighbouring staged prompts whose next chunks are equally long. (Feeding from row 0 up starved prompts in
        the middle rows while new ones kept arriving: the newest staged prompt fills each freed row.) The staged
        sequences change only when the launches are done (:meth:`complete_prefill`)."""
        plan: list[Launch] = []
        if self._hold():
            return plan
        budget = self.prefill_rows if self.running else self.idle_rows
        fed: set[int] = set()  # staging rows given a chunk in this iteration
        for start in sorted((r for r, s in enumerate(self.staging) if s.left), key=lambda r: self.staging[r].order):
            if budget <= 0:
                break
            if start not in fed:
                launch = self._launch_from(start, budget, fed)
                if launch is None:  # its chunk does not fit the rows left in this iteration
                    continue
                plan.append(launch)
                k, rows = launch.ids.shape
                budget -= rows * k
                fed.update(range(launch.lo, launch.lo + k))
                self.totals["prefill_launches"] += 1
                self.totals["prefill_rows"] += rows * k
        return plan

    def _launch_from(self, start: int, budget: int, fed: set[int]) -> Launch | None:
        """The launch of the oldest staged prompt not fed yet (row ``start``) with its neighbours whose next chunks
        are as long: a newer prompt never keeps an older one waiting (rows are not in arrival order: ``unstage``
        fills holes). A chunk longer than the rows left is cut to whole portable chunks (64 rows), or waits for the
        next iteration (None): cut to the rows a longer launch left, a prompt went in slivers (48 rows after a
        2000-row launch) and out of step with its neighbours, whose next chunks then no longer matched."""
        limit = min(budget, self.launch)  # rows of this launch, its prompts' together
        rows, scored = self.staging[start].next_chunk(self.chunk, self.score_chunk)
        if rows > limit:
            rows = limit - limit % self.base
            if rows == 0:
                return None
        if scored:  # alone, on the scoring graph
            return self._score_launch(start, rows)

        def joins(row: int) -> bool:
            if not 0 <= row < len(self.staging) or row in fed:
                return False
            return self.staging[row].next_chunk(self.chunk, self.score_chunk) == (rows, False)

        lo, hi = start, start + 1  # the launch feeds staging rows lo..hi-1
        while (hi - lo + 1) * rows <= limit and joins(hi):
            hi += 1
        while (hi - lo + 1) * rows <= limit and joins(lo - 1):
            lo -= 1
        group = self.staging[lo:hi]
        # a chunk boundary: a prompt that goes on after this launch; the logits wanted: a prompt's end, or such a
        # boundary that is cached
        boundaries = [i for i, s in enumerate(group) if s.left > rows]
        want = [i for i, s in enumerate(group) if s.left == rows or (i in boundaries and self.caching(s))]
        ids = np.asarray([s.next_rows(rows) for s in group], dtype=np.int64)
        return Launch(lo, ids, boundaries, want, *self.first_draws(group, rows))

    def _score_launch(self, row: int, rows: int) -> Launch:
        """The launch of the next ``rows`` of the prompt staged in ``row``, on the scoring graph."""
        seq = self.staging[row]
        boundary = seq.left > rows
        want = [0] if seq.left == rows or (boundary and self.caching(seq)) else []
        ids = np.asarray([seq.next_rows(rows)], dtype=np.int64)
        return Launch(row, ids, [0] if boundary else [], want, score=True)

    def first_draws(self, group: list[Sequence], rows: int) -> tuple[list[int], np.ndarray | None]:
        """Where the pool samples on the device: the positions in a launch of ``group``'s next ``rows`` tokens whose
        prompts end in it and whose requests sample greedily or by temperature alone, and the sampler's rows
        (temperature, uniform draw) [k, 2] for the launch. Their first tokens are then picked where the launch's
        logits are, in the launch's thread: a host pick costs a pass of numpy over the vocabulary per prompt
        (~0.1 ms at 50k ids), on the engine's thread. A seeded request's draw is its RNG's first, as the host's pick
        would take (:func:`sampler_rows`); the other rows are greedy rows whose picks go unused, and draw nothing.
        ([], None): the host picks them all."""
        if not self.pool.device_sample:
            return [], None
        first = [i for i, seq in enumerate(group) if seq.left == rows and seq.first_by_pool]
        if not first:
            return [], None
        draws = np.zeros((len(group), 2), np.float64)
        draws[first] = sampler_rows([group[i] for i in first], self.draws)
        return first, draws

    def _hold(self) -> bool:
        """Whether this iteration leaves new prompts waiting, so that they gather into fewer, larger prefill rounds
        (text-generation-inference's ``waiting_served_ratio`` and ``max_waiting_tokens``). Every prefill round
        slows the decode iterations it shares the GPU with (or stops them, not overlapped); a prompt arriving at
        each iteration then slows every iteration, where gathering leaves most of them as fast as decode alone. A
        prompt already part-way through its chunks, or nothing decoding, never waits."""
        hold = False
        if self.ratio > 0 and self.running and self.held < self.max_waiting:
            new = [s for s in self.staging if s.left]
            # at most one launch's prompts gather (more would hold the prompts after them as well)
            gather = min(self.ratio * len(self.running), self.pool.staging_rows)
            hold = bool(new) and not any(s.launches for s in new) and len(new) + len(self.waiting) < gather
        self.held = self.held + 1 if hold else 0
        return hold

    def complete_prefill(self, plan: list[Launch]) -> None:
        """The launches are done: the staged sequences advance by their chunks; the states at chunk boundaries of
        long prompts are to go into the cache (:meth:`release`, which runs beside the decode launch where the engine
        is pipelined: with 16 prompts of two chunks the caching of their first chunks' states and logits was host
        work the GPU's decode waited for)."""
        for launch in plan:
            k, rows = launch.ids.shape
            self.totals["pool_first_tokens"] += len(launch.picks)
            for i, seq in enumerate(self.staging[launch.lo : launch.lo + k]):
                if launch.score:
                    self._take_scores(seq, launch.rows)
                seq.launches += 1
                seq.at += rows
                seq.fed += rows
                seq.logits = launch.logits.get(i)
                seq.first = launch.picks.get(i)
                if i in launch.boundaries:
                    self.boundaries.append(seq)

    @staticmethod
    def _take_scores(seq: Sequence, rows: np.ndarray) -> None:
        """A scored chunk's rows (logits [rows, V], the chunk starting at prompt position ``seq.at``): row j scores
        the prompt's token at position at + j + 1, from ``score_from`` on."""
        score_from, n = seq.request.score_from, seq.request.logprobs or 0
        for j in range(rows.shape[0]):
            pos = seq.at + j + 1
            if score_from <= pos < len(seq.prompt):
                seq.scores.append(token_logprob(rows[j], int(seq.prompt[pos]), n))

    # -- slots --------------------------------------------------------------------------------------------------
    def admit(self, first_token: Callable[[int], None]) -> None:
        """Prefilled prompts take free slots, oldest first, and get their first tokens (``first_token(slot)``);
        their staging rows stay theirs until :meth:`release` (the slots' copies are all a decode launch needs)."""
        ready = sorted((r for r, s in enumerate(self.staging) if not s.left), key=lambda r: self.staging[r].order)
        while ready and len(self.running) < self.max_batch:
            # the oldest ready prompts whose rows follow each other (a launch's) take the next slots in one copy,
            # then each gets its first token, the last first: one that ends there frees its slot at once (for the
            # next run), taken by the last running sequence, whose token is out already
            base = len(self.running)
            k = leading_run(ready, self.max_batch - base)
            rows, ready = ready[:k], ready[k:]
            self.pool.admit(base, rows[0], k)
            self.released += rows
            self.running += [self.staging[row] for row in rows]
            for i in range(base + k - 1, base - 1, -1):
                first_token(i)

    def release(self) -> None:
        """Cache the states of staged prompts at a chunk boundary (:meth:`complete_prefill`; those cancelled since
        are gone), then free the staging rows of the prompts :meth:`admit` admitted, each prompt's state cached
        first (from its row: the highest row first, so that moving the last staged prompt into a freed row never
        moves one still to be cached). The next prefill launch, which writes the staging rows, comes after."""
        for seq in self.boundaries:
            if seq in self.staging:  # its row now (a cancellation may have moved it)
                row = self.staging.index(seq)
                self.remember(seq, lambda out, row=row: self.pool.staged(row, out))
        self.boundaries.clear()
        for row in sorted(self.released, reverse=True):
            seq = self.staging[row]
            if seq.cached_tokens < seq.fed:
                self.remember(seq, lambda out, row=row: self.pool.staged(row, out))
            self.unstage(row)
        self.released.clear()

    def retire(self, i: int, prev: bool) -> None:
        """Free slot ``i`` of a sequence that ended: the last running sequence takes it, so the occupied slots stay
        0..n-1. ``prev`` (a launch begun after its last token runs): it keeps the slot, marked ended, until that
        launch is finished (:meth:`compact`)."""
        if prev:
            self.running[i].ended = True
            self.ended += 1
            return
        last = len(self.running) - 1
        if i != last:
            self.pool.move(last, i)
            self.running[i] = self.running[last]
        self.running.pop()

    def compact(self) -> None:
        """Free the slots of the sequences that ended while a launch held them (:meth:`retire`): the last running
        sequence takes each freed slot, so the occupied slots stay 0..n-1. Only with no launch in flight."""
        self.unfed = False
        if not self.ended:
            return
        running = self.running
        for i in range(len(running) - 1, -1, -1):  # the last one is never ended: those after i are handled
            if running[i].ended:
                last = len(running) - 1
                if i != last:
                    self.pool.move(last, i)
                    running[i] = running[last]
                running.pop()
        self.ended = 0

    def slots_stay(self, n: int) -> bool:
        """Whether the n slots of the last decode launch can stay as they are for the next one (which then feeds
        on the last one's picks): no request cancelled (a vanished client's slot is freed at once), and few
        sequences ended since the slots were last compacted (an ended sequence keeps its slot, computed and
        ignored, until :meth:`compact` frees it: at most an eighth of the launch's rows, or one)."""
        return not self.unfed and n == len(self.running) and self.ended < n and self.ended <= max(1, n // 8)

    # -- the prefix cache ----------------------------------------------------------------------------------------
    def caching(self, seq: Sequence) -> bool:
        """Whether ``seq``'s states go into the prefix cache (a sequence from the caller's states does not: its
        tokens are not the whole prefix)."""
        return self.cache.capacity > 0 and seq.request.state is None

    def remember(self, seq: Sequence, state: Callable[[tuple], object], row: int = 0, prev: bool = False) -> None:
        """Cache the state after ``seq.fed``; ``state(out)`` copies it into the cache's rows ``out`` (only when a
        cache exists), and the logits come from row ``row`` of the pool's last launch (``prev``: of the launch
        before) when the pool picked the token itself."""
        if not self.caching(seq):
            return

        def fill(entry: tuple) -> None:  # called for a prefix not cached yet only
            state(entry[:2])
            if seq.logits is not None:
                entry[2][...] = seq.logits
            elif prev:
                self.pool.prev_logits(row, entry[2])
            else:
                self.pool.last_logits(row, entry[2])

        self.cache.put(seq.key(), fill)

    # -- cancellations ---------------------------------------------------------------------------------------
    def cancel_waiting(self) -> list[Sequence]:
        """The waiting sequences that were cancelled, taken out of the queue (their callers end them)."""
        gone = [s for s in self.waiting if s.request.id in self.cancelled]
        for seq in gone:
            self.waiting.remove(seq)
        return gone

    def cancel_staged(self, launches_running: bool) -> None:
        """End the cancelled staged prompts and free their rows; while prefill launches are in flight (they write
        the staging rows) the cancellations of staged prompts wait for them."""
        if launches_running:
            self.cancelled = {s.request.id for s in self.staging if s.request.id in self.cancelled}
            return
        for row in reversed([i for i, s in enumerate(self.staging) if s.request.id in self.cancelled]):
            self.staging[row].request.emit(self.staging[row].event(None, "abort"))
            self.unstage(row)
        self.cancelled.clear()
