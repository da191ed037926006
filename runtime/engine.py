"""Continuous batching: many sequences share one model, one batched decode launch per iteration.

The engine owns ``max_batch`` preallocated state slots on the backend's device (a :class:`SlotPool`: conv
[max_batch, L, E, K-1] and ssm [max_batch, L, E, N]); the sequences that are decoding occupy slots 0..n-1, so one
decode launch takes the pool's first n rows as its batch. Each iteration of the engine's thread:

1. takes new requests and cancellations;
2. stages waiting prompts (FIFO) in the pool's staging rows, starting each from the longest prefix the state
   cache holds, and prefills them chunk by chunk, at most ``prefill_rows`` prompt rows per iteration (so the
   decoding sequences keep a steady inter-token latency), the oldest prompt first; one launch feeds a chunk of the
   same length to each of several neighbouring staged prompts where the prefill graph takes a batch (the fused and
   kernels graphs);
3. moves prefilled sequences into free slots, the oldest first, and samples their first tokens;
4. runs one decode launch for every sequence in a slot, samples each next token, and finishes sequences at EOS,
   a stop string, ``max_tokens`` or cancellation; a finished sequence's slot is filled at once by the last one
   (one copy of a state), so the occupied slots stay 0..n-1.

Where the pool can run a prefill launch beside a decode launch (on CUDA, the kernels graphs, each on a stream of
its own: :attr:`SlotPool.concurrent`), steps 2-3 overlap step 4: the iteration's prefill launches go to a worker
thread while decode iterations go on; when they are done, the next iteration admits their prompts and stages and
launches the next ones. The decoding sequences then no longer wait for whole prefill launches between two tokens
(a decode launch beside a prefill launch still runs slower: the two share the GPU's SMs; BENCHMARKS.md, session
12). Where the pool's decode launch also runs without the host waiting for it (:attr:`SlotPool.async_decode`), the
host work that needs neither the launch's results nor the slots runs while the launch does: sending the last
iteration's events to the front ends, the device sampler's draws, caching the admitted prompts' states and freeing
their staging rows, staging and planning the next prefill launches (the GPU stood idle through them before:
most of an iteration that admits a round of prompts; BENCHMARKS.md, session 23). Looking ahead, each decode launch
is begun from the last one's picks before they are handled; feeding, while the slots stay the same, it is queued
behind the last one before its picks even reach the host, fed them on the device, so that the GPU runs the decode
launches back to back (:meth:`Engine._feed`; the device had waited ~0.1 ms per launch for the host: session 26).

`mambatrt run` is this engine with one slot (:meth:`Engine.run_inline`, the slot being the backend's own state), so
a single prompt and a served request go through the same generation code.

A Mamba state is small and fixed-size, so it is cached whole (:class:`StateCache`): the state after a prompt, at
its chunk boundaries, and after a finished completion, keyed by the exact token prefix. Needs numpy and a backend
with a slot pool (onnxruntime on the CPU or CUDA).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.random  # noqa: F401  (imported at load: ~8 ms inside a sampled request's first token otherwise)

from mambatrt.contract import DECODE, PREFILL
from mambatrt.errors import InputError
from mambatrt.runtime.backends import Backend, SlotPool
from mambatrt.runtime.generate import Sampling, sample_token, token_ids


class QueueFull(Exception):
    """More requests are waiting than the engine's ``max_queue``; the server answers 429."""


class EngineStopped(Exception):
    """The engine is stopping or has stopped (shutdown, or a bug ended its loop); the server answers 503."""


@dataclass
class Event:
    """What a request receives, in order: one event per new token, the last one with ``finish_reason``."""

    token: int | None  # None only on a final event without a new token (cancelled, or a stop string hit)
    text: str  # the text this token completes ("" without a tokenizer or while a stop string may be starting)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_launches: int = 0  # launches that fed this request's prompt
    state: tuple[np.ndarray, np.ndarray] | None = None  # final event of a ``keep_state`` request: the states after
    # every fed token (the last generated token is not fed yet)


@dataclass
class Request:
    """One generation: prompt ids, sampling options, stop strings, and where its events go (any thread)."""

    prompt: list[int]
    sampling: Sampling
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    id: int = field(default_factory=itertools.count().__next__)
    state: tuple[np.ndarray, np.ndarray] | None = None  # start from these states ([L, E, K-1], [L, E, N]), not zeros
    keep_state: bool = False  # the final event carries the states (``run --save-state``)
    detokenize: bool = True  # the events carry text; False: the caller decodes the tokens (stop strings need True)


class StateCache:
    """LRU of states keyed by the exact token prefix they follow, bounded in bytes.

    An entry holds what continuing needs: the states after the prefix and the logits of its last token. Entries live
    in storage made once (``make_rows``: the pool's :meth:`~SlotPool.cache_rows`, where the states copy fastest:
    device memory on CUDA, so that caching a state never crosses PCIe; a served request caches up to three), one
    row per entry. Memory is taken at the start, the whole budget. Logits the engine already holds on the host as
    an array of their own (a prompt's, taken from its prefill launch) are kept by reference instead of copied into
    the row (:meth:`put`): an iteration that admits 16 prompts of two chunks caches 32 entries, and their 32 host
    copies of 0.2 MB were most of the state cache's cost in it (BENCHMARKS.md, session 25); such arrays are never
    written again, by the engine or the cache, and take host memory beyond the budget (one logits array an entry
    at most).
    """

    def __init__(
        self,
        max_bytes: int,
        shapes: tuple[tuple[int, ...], ...] = (),
        make_rows: Callable[[int, tuple[tuple[int, ...], ...]], list] | None = None,
    ) -> None:
        """``shapes``: of an entry's arrays (float32): conv [L, E, K-1], ssm [L, E, N], logits [V];
        ``make_rows(capacity, shapes)``: their storage, each indexable by entry (default: host arrays)."""
        self.max_bytes = max_bytes
        entry_bytes = 4 * sum(int(np.prod(shape)) for shape in shapes)
        self.capacity = max_bytes // entry_bytes if entry_bytes else 0  # entries
        make_rows = make_rows or (lambda n, shapes: [np.empty((n, *shape), np.float32) for shape in shapes])
        self.rows = make_rows(self.capacity, shapes) if self.capacity else []
        self.entry_bytes = entry_bytes
        self.free = list(range(self.capacity))  # rows without an entry
        self.held: dict[int, np.ndarray] = {}  # row -> the logits its entry keeps by reference (not in the row)
        self.entries: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()  # key -> row
        self.lengths: collections.Counter[int] = collections.Counter()  # entries per key length: a lookup tries
        # each length once (a set of every key's length per lookup was a tenth of a busy engine thread)
        self.hits = 0

    @property
    def bytes(self) -> int:
        """Bytes the entries take."""
        return len(self.entries) * self.entry_bytes

    def put(self, tokens: list[int], fill: Callable[[tuple], np.ndarray | None]) -> None:
        """Remember the state after ``tokens``: ``fill(rows)`` writes the entry (its row of each array: conv, ssm,
        logits) and returns None, or writes the states only and returns the logits to keep by reference (an array
        nobody writes again); the least recently used entry is evicted when every row is taken."""
        key = tuple(tokens)
        if not self.capacity or not key:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if not self.free:
            old, row = self.entries.popitem(last=False)
            self._forget(old)
            self.held.pop(row, None)
            self.free.append(row)
        row = self.free.pop()
        try:
            kept = fill(tuple(a[row] for a in self.rows))
        except BaseException:
            self.free.append(row)
            raise
        if kept is not None:
            self.held[row] = kept
        self.entries[key] = row
        self.lengths[len(key)] += 1

    def _forget(self, key: tuple[int, ...]) -> None:
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]

    def longest_prefix(self, tokens: list[int]) -> tuple[int, tuple | None]:
        """(n, entry) for the longest cached prefix tokens[:n] (the whole prompt included); (0, None) if none. The
        entry is its rows (views), valid until the next ``put``: the caller copies them."""
        if not self.entries:
            return 0, None
        lengths = sorted((n for n in self.lengths if n <= len(tokens)), reverse=True)
        for n in lengths:
            row = self.entries.get(tuple(tokens[:n]))
            if row is not None:
                self.entries.move_to_end(tuple(tokens[:n]))
                self.hits += 1
                return n, self._entry(row)
        return 0, None

    def _entry(self, row: int) -> tuple:
        """Entry ``row``'s arrays (views of its rows; its logits where they are kept by reference)."""
        *states, logits = (a[row] for a in self.rows)
        return (*states, self.held.get(row, logits))


@dataclass
class _Launch:
    """One planned prefill launch: staging rows lo..lo+k-1 fed ``ids`` [k, rows]; ``boundaries``: the positions in
    the launch whose chunk ends at a chunk boundary of a longer prompt (their states go into the cache); ``want``:
    those whose logits the engine needs, which the launch fills into ``logits``; ``first``: those whose first
    tokens the pool picks from the launch's logits with the sampler's rows ``draws`` (:meth:`Engine._first_draws`),
    into ``picks``."""

    lo: int
    ids: np.ndarray  # [k, rows] int64
    boundaries: list[int]
    want: list[int]
    first: list[int] = field(default_factory=list)
    draws: np.ndarray | None = None  # [k, 2] float64: (temperature, uniform draw) per row
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    picks: dict[int, int] = field(default_factory=dict)


class _Sequence:
    """A request inside the engine: what is fed, what is left to feed, what was generated."""

    def __init__(
        self, request: Request, decode_text: Callable[[], Callable[[int], str]] | None, order: int = 0
    ) -> None:
        self.request = request
        self.order = order  # arrival: the engine prefills and admits the oldest first
        self._rng: np.random.Generator | None = None
        self.todo = list(request.prompt)  # prompt tokens not fed yet
        self.fed: list[int] = []  # tokens whose effect is in the state
        self.logits: np.ndarray | None = None  # of the last fed token
        self.first: int | None = None  # the first token, where the pool picked it from the prompt's last launch
        self.generated: list[int] = []
        self.cached_tokens = 0
        self.launches = 0
        self.step_text = decode_text() if decode_text is not None and (request.detokenize or request.stop) else None
        # the engine's text stays empty: each event's text is "" (the common case of a served request, whose front
        # end decodes the tokens; the decode iteration's per-sequence path, run for every running sequence)
        self.bare = self.step_text is None and not request.stop
        sampling = request.sampling
        # what picks its tokens: 0 greedy and 1 by temperature alone (where the pool can, on the device), 2 the host
        self.picker = 2 if not sampling.plain else 1 if sampling.temperature else 0
        self.temperature = sampling.temperature
        self.own_draws = sampling.seed is not None and sampling.temperature > 0  # see sampler_rows
        self.ended = False  # its last event is out; its slot is freed once no launch holds it (Engine._compact)
        self.next_id: int | None = None  # its pick from a finished launch not handled yet (fed to the next launch)
        self.logits_row = 0  # its row in the launch whose logits it has (of the last launch, or the one before)
        self.text = ""  # generated text so far (for stop strings)
        self.sent = 0  # characters of ``text`` already emitted
        self.started = time.perf_counter()

    @property
    def rng(self) -> np.random.Generator:
        """The sequence's sampling RNG, made when first needed: greedy requests never pay for one."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.request.sampling.seed)
        return self._rng

    def event(self, token: int | None, finish_reason: str | None) -> Event:
        """The next event: the text that became safe to send (a stop string never leaks out)."""
        stops = self.request.stop
        if finish_reason is None and stops:
            # hold back the longest tail that could be the start of a stop string
            hold = max((k for s in stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - hold
        else:
            end = len(self.text)
        chunk, self.sent = self.text[self.sent : end], max(self.sent, end)
        r = self.request
        return Event(token, chunk, finish_reason, len(r.prompt), len(self.generated), self.cached_tokens, self.launches)


def sampler_rows(seqs: list[_Sequence], shared: np.random.Generator) -> np.ndarray:
    """The device sampler's rows for the next tokens of ``seqs``: (temperature, uniform draw) float64 [n, 2], the
    draw 0 where greedy. A seeded request draws from its own RNG, one draw per sampled token as
    :func:`~mambatrt.runtime.generate.sample_token` takes it, so a seed gives the same tokens on the device as on
    the host; the others draw from ``shared``, all in one call, on the engine's thread in every sampled decode
    iteration: not a call each, nor an RNG each seeded from the OS's entropy (BENCHMARKS.md, session 23)."""
    n = len(seqs)
    rows = np.empty((n, 2), np.float64)
    rows[:, 0] = [s.temperature for s in seqs]
    rows[:, 1] = shared.random(n)
    for i in [i for i, s in enumerate(seqs) if s.own_draws]:
        rows[i, 1] = seqs[i].rng.random()
    rows[rows[:, 0] == 0, 1] = 0.0
    return rows


def _leading_run(rows: list[int], limit: int) -> int:
    """How many of ``rows`` (at least one, at most ``limit``) follow the first one by one (r, r + 1, ...): staging
    rows that one call zeroes, or one copy moves into consecutive slots."""
    k = 1
    while k < min(len(rows), limit) and rows[k] == rows[0] + k:
        k += 1
    return k


def _row_of_its_own(logits: np.ndarray) -> bool:
    """Whether a sequence's ``logits`` are an array of their own (or a slice of one row's copy): a prompt's, copied
    out of its prefill launch, which the prefix cache may keep by reference; not a row of a decode launch's [n, Vp]
    logits on the host, whose whole array a reference would keep alive."""
    return logits.base is None or logits.base.ndim == 1


class Engine:
    """The continuous-batching loop over one backend (see the module docstring). Thread-safe ``submit``/``cancel``."""

    def __init__(
        self,
        backend: Backend,
        max_batch: int | None = None,
        max_queue: int = 256,
        cache_bytes: int = 0,
        eos_id: int | None = None,
        decode_text: Callable[[], Callable[[int], str]] | None = None,
        prefill_rows: int | None = None,
        overlap: bool | None = None,
        waiting_served_ratio: float = 0.0,
        max_waiting_tokens: int = 20,
        pipeline: bool = True,
        ahead: bool | None = None,
        feed: bool | None = None,
    ) -> None:
        """``decode_text``: makes a per-sequence incremental decoder (``Tokenizer.stream``), for text and stop
        strings; ``prefill_rows``: prompt rows prefilled per iteration (default: one full chunk; where one launch
        prefills several prompts, a chunk for each staging row on a GPU, four chunks on a CPU); ``overlap``: prefill
        launches beside decode launches where the pool can (see the module docstring); None: on a GPU only (on a
        CPU the two share the cores, and a prefill beside decode measured fewer tokens/s, BENCHMARKS.md);
        ``waiting_served_ratio`` and ``max_waiting_tokens``: while sequences decode, new prompts gather until they
        number ``waiting_served_ratio`` x the running sequences or have waited ``max_waiting_tokens`` decode
        iterations (:meth:`_hold`; 0: prefill as soon as a prompt waits; `serve` gathers by default);
        ``pipeline``: with prefill beside decode, the host work that needs neither the decode launch's results nor
        the slots runs after the launch is begun, so while it runs where the pool allows
        (:attr:`SlotPool.async_decode`); ``ahead`` (pipelined only): each decode launch is begun as soon as the
        last one's picks are on the host, before they are handled (:meth:`_iteration`); None: where the pool's
        launches are queued without waiting (on the H200 it served more tokens/s at a lower inter-token latency,
        BENCHMARKS.md, session 24; where a launch runs inside ``finish_decode`` there is nothing to hide);
        ``feed`` (looking ahead only): while the slots' sequences stay the same, a greedy decode launch is begun
        before the last one's picks reach the host, fed them where they are (:meth:`_feed`); None: where the pool's
        launches are queued without waiting (the device then runs them back to back)."""
        bundle = backend.bundle
        limit = bundle.manifest.max_batch if bundle.manifest.batched else 1
        self.max_batch = min(max_batch or limit, limit)
        if self.max_batch < 1:
            raise InputError(f"--max-batch must be >= 1, got {max_batch}")
        self.backend, self.config = backend, bundle.config
        self.vocab = bundle.config.vocab_size
        self.max_queue, self.eos_id, self.decode_text = max_queue, eos_id, decode_text
        self.chunk = bundle.max_prefill_rows if PREFILL in bundle.graphs else 1
        self.prefill_graph = PREFILL if PREFILL in bundle.graphs else DECODE
        self.pool: SlotPool = backend.open_pool(self.max_batch, self.prefill_graph)
        # a k-prompt launch costs far less than k one-prompt launches on a GPU (16 x 64 rows: 8.7 ms against 16 x
        # 1.8 ms on the H200), k times one on a CPU core; on the H200 a chunk per staging row served more tokens/s
        # at concurrency 32-128 with lower TTFT and ITL than four chunks (BENCHMARKS.md, session 9)
        chunks = self.pool.staging_rows if backend.device == "cuda" else min(4, self.pool.staging_rows)
        default_rows = self.chunk * chunks
        self.prefill_rows = max(self.chunk, prefill_rows or default_rows)
        if waiting_served_ratio < 0 or max_waiting_tokens < 0:
            raise InputError("--waiting-served-ratio and --max-waiting-tokens must be >= 0")
        self.waiting_served_ratio, self.max_waiting_tokens = waiting_served_ratio, max_waiting_tokens
        self._held = 0  # decode iterations that new prompts were held back in, since the last prefill round
        self._holding = 0  # prompts held back in this iteration (the trace's)
        c = bundle.config
        shapes = (c.conv_state_shape, c.ssm_state_shape, (self.vocab,))
        self.cache = StateCache(cache_bytes, shapes, self.pool.cache_rows)
        self.running: list[_Sequence] = []  # sequence i decodes in slot i
        self.staging: list[_Sequence] = []  # sequence i is prefilled in staging row i
        self.waiting: collections.deque[_Sequence] = collections.deque()  # not staged yet
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.arrivals = itertools.count()  # each sequence's ``order``
        self.cancelled: set[int] = set()
        self.draws = np.random.default_rng()  # the device sampler's draws of requests without a seed
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._main, name="mambatrt-engine", daemon=True)
        self._go = threading.Event()  # start() was called (the thread may have started earlier, to warm)
        self._warmed = threading.Event()
        self._warm_result: int | BaseException = 0
        self.error: BaseException | None = None
        self.profile = None  # a cProfile.Profile for the engine thread (`serve --profile`), set before start()
        self.trace: collections.deque | None = None  # one record per iteration (`serve --trace`), set before start()
        self.flush: Callable[[], None] | None = None  # called by the engine thread after each pass of its loop:
        # the events emitted in it can go out together (`serve`'s front ends wake once per iteration)
        self._launches: list[tuple[int, int, int]] = []  # this iteration's prefill launches (start, k, rows)
        if overlap is None:
            overlap = backend.device == "cuda"
        self.overlap = overlap and self.pool.concurrent  # decided for good at start()
        self.pipeline, self.ahead, self.feed = pipeline, ahead, feed
        self.pipelined = False  # host work runs while the decode launch does (decided at start())
        self.looking_ahead = False  # decode launches begun before the last one's picks are handled (at start())
        self.feeding = False  # greedy launches begun before the last one's picks reach the host (at start())
        self._ahead: tuple | None = None  # such a launch, in flight from one iteration to the next (_begin_decode's)
        self._ended = 0  # running sequences that ended while a launch held their slots (_compact frees them)
        self._unfed = False  # a running sequence was cancelled: the next iteration frees its slot (no _feed)
        self._released: list[int] = []  # staging rows admitted in this iteration, freed by _release()
        self._boundaries: list[_Sequence] = []  # staged prompts at a chunk boundary to cache, by _release()
        self.warmed = False
        self.inflight: tuple[list[_Launch], concurrent.futures.Future] | None = None  # prefill launches running
        self.prefill_worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._launch_s = 0.0  # this iteration's decode launch alone (the pool's call): the rest is host work
        self._plan_done = 0.0  # when the worker finished the last overlapped prefill launches (perf_counter)
        self._handoff_s = 0.0  # in this iteration: from then until the engine thread took their results
        self._cache_s = 0.0  # in this iteration: in the prefix cache's fills (:meth:`_remember`)
        # since the start: iterations, seconds in prefill and in decode (launches and their host work), prefill
        # launches and the prompt rows they fed, tokens the pool picked for a whole launch (first ones, the rest),
        # decode launches and those of them fed the launch before's picks on the device (:meth:`_feed`)
        keys = ("iterations", "prefill_seconds", "decode_seconds", "prefill_launches", "prefill_rows")
        keys += ("pool_first_tokens", "pool_next_tokens", "decode_launches", "fed_launches")
        self.totals = dict.fromkeys(keys, 0)

    # -- public, any thread ---------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's state (one slot)."""
        return self.pool.slot_bytes

    def start(self) -> Engine:
        # launch shapes not captured yet are captured on first use, and a capture must not meet the other thread's
        # copies and launches: overlap only once every shape is captured (warm) or where nothing is
        self.overlap = self.overlap and (self.warmed or not getattr(self.pool, "captured", False))
        if self.overlap:
            self._worker()
        # with a pool whose launch runs inside finish_decode (the CPU's) the order is the same and changes nothing
        self.pipelined = self.overlap and self.pipeline
        ahead = self.pool.async_decode if self.ahead is None else self.ahead
        self.looking_ahead = self.pipelined and ahead
        feed = self.pool.async_decode if self.feed is None else self.feed
        self.feeding = self.looking_ahead and feed and self.pool.can_feed
        if self.trace is not None:
            self.pool.time_launches()  # the trace's gpu_ms and idle_ms, where the pool can time its launches
        if self.thread.ident is None:
            self.thread.start()
        self._go.set()
        return self

    def submit(self, request: Request) -> None:
        """Queue a request (also before ``start``: the first iteration then sees them all); raises QueueFull when
        ``max_queue`` requests already wait, InputError for bad ids."""
        if self.stopping or self.error is not None or (self.thread.ident is not None and not self.thread.is_alive()):
            raise EngineStopped("the engine is not running (shutting down, or it failed: see the server's log)")
        self._check(request)
        if self.inbox.qsize() + len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests are waiting; retry later")
        self.inbox.put(request)
        self.wake.set()

    def run_inline(self, request: Request) -> None:
        """Run one request to its end in the calling thread (the engine's thread not started): `mambatrt run` is
        this engine with one slot, so a single prompt and a served one go through the same code."""
        if self.thread.is_alive():
            raise RuntimeError("run_inline needs an engine whose thread is not started")
        self._check(request)
        ended = []

        def watch(event: Event) -> None:
            request.emit(event)
            if event.finish_reason is not None:
                ended.append(event)

        self.inbox.put(replace(request, emit=watch))  # the same request (id too); the caller's untouched
        while not ended:
            self._take_inbox()
            self._prefill()
            self._finish_decode(self._begin_decode())

    def _check(self, request: Request) -> None:
        if not request.prompt:
            raise InputError("empty prompt: pass at least one token")
        token_ids(request.prompt, self.vocab)
        bad = next((t for t, _ in request.sampling.logit_bias if t >= self.vocab), None)
        if bad is not None:
            raise InputError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab})", param="logit_bias"
            )

    def cancel(self, request_id: int) -> None:
        """Stop a request (its client went away); its slot is freed within one iteration."""
        self.inbox.put(request_id)
        self.wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish: every queued or running request ends with finish_reason "abort"; the thread exits."""
        self.stopping = True
        self.wake.set()
        self._go.set()  # a thread that warmed and waits for start() ends too
        if self.thread.is_alive():
            self.thread.join(timeout)

    def stats(self) -> dict:
        """Running and waiting (queued or prefilling) sequences, and the ``totals`` since the start (/metrics)."""
        waiting = len(self.waiting) + len(self.staging) + self.inbox.qsize()
        # sequences that ended while a launch held their slots are freed later (_compact): not running
        return {"running": len(self.running) - self._ended, "waiting": waiting, **self.totals}

    # -- the loop ---------------------------------------------------------------------------------------------
    def _main(self) -> None:
        """The engine thread: the warm-up captures (when :meth:`warm` asked for them), then, once started, the
        loop."""
        if self._warm_result is None:
            try:
                shapes = self.pool.warm_decode()
                if self.overlap:  # the prefill launches' thread captures them
                    shapes += self._worker().submit(self.pool.warm_prefill, self.prefill_graph).result()
                else:
                    shapes += self.pool.warm_prefill(self.prefill_graph)
                self._warm_result = shapes
            except BaseException as exc:  # reported by warm(); the thread ends (submit then refuses)
                self._warm_result = exc
                if self.prefill_worker is not None:
                    self.prefill_worker.shutdown(wait=False)
                return
            finally:
                self._warmed.set()
            self._go.wait()
        self._loop()

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that runs the prefill launches when they overlap decode (one thread: its onnxruntime context
        keeps the prefill launches' captured graphs)."""
        if self.prefill_worker is None:
            self.prefill_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mambatrt-prefill")
        return self.prefill_worker

    def _loop(self) -> None:
        if self.profile is not None:
            self.profile.enable()
        try:
            while not self.stopping:
                self._take_inbox()
                idle = not self.running and not self.waiting and not self.staging
                if idle and self.inflight is None and self._ahead is None:
                    self._flush()  # cancellations answered while idle
                    self.wake.wait(0.05)
                    self.wake.clear()
                    continue
                self._iteration()
                if not (self.pipelined and self.running):
                    self._flush()  # else once the next iteration's decode launch is queued
        except BaseException as exc:  # a bug: end every request rather than hang its client
            self.error = exc
            raise
        finally:
            if self.profile is not None:
                self.profile.disable()
            if self.inflight is not None:  # its launches write the staging rows: let them end first
                concurrent.futures.wait([self.inflight[1]])
                self.inflight = None
            if self.prefill_worker is not None:
                self.prefill_worker.shutdown(wait=True)
            self._ahead = None  # a decode launch in flight: its picks go unused
            self.pool.abandon()
            self._take_inbox()  # requests submitted but never taken end too
            for seq in list(self.running) + list(self.staging) + list(self.waiting):
                if not seq.ended:
                    seq.request.emit(seq.event(None, "abort"))
            self.running.clear()
            self._ended = 0
            self.staging.clear()
            self.waiting.clear()
            self._flush()

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush()

    def warm(self) -> tuple[int, float]:
        """Capture, before the first request, the launch shapes that are otherwise captured on first use (the
        decode buckets, the batched prefill launches): (shapes, seconds). onnxruntime keeps a captured graph in the
        context of the thread that captured it, so the engine's thread captures the decode launches and the thread
        that will run the prefill launches captures those: this starts the engine's thread, which then waits for
        :meth:`start`. Call before :meth:`start`."""
        if self.thread.ident is not None:
            raise RuntimeError("warm() comes before start(), once")
        t = time.perf_counter()
        self._warm_result = None  # asks the thread to warm
        self.thread.start()
        self._warmed.wait()
        if isinstance(self._warm_result, BaseException):
            raise self._warm_result
        self.warmed = True
        return self._warm_result, time.perf_counter() - t

    def _iteration(self) -> None:
        """Prefill, then decode; their times add up in ``totals`` (``/metrics``), and with ``trace`` set each
        iteration is recorded (where a server's time goes). Overlapped, the prefill time is the host's part (and
        the wait for the launches when nothing decodes beside them). Pipelined, the prefill work that needs no slot
        (:meth:`_prefill_rest`) and the last iteration's events go while the decode launch runs. Looking ahead, the
        decode launch begun in the last iteration is finished first, the slots of sequences that ended meanwhile are
        freed, and the next launch is begun from its picks before they are handled, so that their handling (each
        sequence's token, its end, its event) runs beside that launch too. Feeding, where the slots may stay as
        they are, the next launch is queued first, fed the last one's picks on the device (:meth:`_feed`), and
        the iteration neither frees slots nor admits prompts (its prefill launches still go on)."""
        t0 = time.perf_counter()
        queued, self._launches, before, self._launch_s = len(self.waiting), [], len(self.running), 0.0
        self._handoff_s, self._holding, self._cache_s = 0.0, 0, 0.0
        fed = self._feed() if self.feeding else None  # the next launch, queued behind the last one
        picked = self._finish_ahead()  # the last launch's picks, to be handled once the next one is begun
        if fed is None:
            self._compact()
        t0b = time.perf_counter()
        if fed is not None:  # the slots stay as they are: nothing admitted
            rest = self._prefill_overlapped(admit=False)
        else:
            rest = self._prefill_overlapped() if self.overlap else self._prefill()
        if rest and not self.pipelined:
            self._prefill_rest()
            rest = False
        t1 = time.perf_counter()
        admitted = len(self.running) - before
        if fed is None:
            begun = self._begin_decode()
        else:  # fed the last launch's picks, its sequences (a launch's tuple: see _begin_decode)
            begun = (fed, picked[1].tolist(), "greedy", None, picked[0][4])
            self.totals["fed_launches"] += 1
        self.totals["decode_launches"] += begun is not None
        t2 = time.perf_counter()
        if self.pipelined and begun is not None:
            self._flush()
        if rest:
            self._prefill_rest()
        t3 = time.perf_counter()
        if self.looking_ahead:
            self._ahead = begun
            if picked is not None:
                self._handle(*picked)
        else:
            self._finish_decode(begun)
        t4 = time.perf_counter()
        totals = self.totals
        totals["iterations"] += 1
        prefill_s, decode_s = (t1 - t0b) + (t3 - t2), (t0b - t0) + (t2 - t1) + (t4 - t3)
        totals["prefill_seconds"] += prefill_s
        totals["decode_seconds"] += decode_s
        if self.trace is not None:
            running, staged = len(self.running), len(self.staging)
            times, self.pool.launch_times = self.pool.launch_times, None
            record = (
                *(t0, prefill_s, decode_s, self._launch_s, self._handoff_s, t3 - t2, self._cache_s),
                *(running, staged, queued, admitted, self._holding, self._launches, times),
            )
            self.trace.append(record)

    def trace_lines(self) -> str:
        """The recorded iterations as JSON lines: start (ms from the first), prefill ms (pipelined, with the last
        iteration's events sent) and decode ms, the decode launch's own ms (the pool's calls that begin and finish
        it; decode_ms less this is host work: sampling, events, finishing), the ms that overlapped prefill
        launches, done, waited for this iteration to take them (the prefill stream idle meanwhile; 0 where none
        were taken), the ms of prefill work after the decode launch was begun (pipelined: beside it, the last
        iteration's events sent too; the rest of prefill_ms came before it), the ms spent filling the prefix
        cache's entries (part of prefill_ms and decode_ms), sequences running after it, staged, waiting before it,
        prompts admitted to slots in it, prompts it held back to gather (:meth:`_hold`), and its prefill launches
        as [start row, prompts, rows]; where the pool times its launches on the device (CUDA), the decode launch
        ended in it: ``gpu_ms``, its time on the device, and ``idle_ms``, how long the device's decode stream
        stood idle before it (since the launch before ended: the host's part of the period)."""
        import json

        records = list(self.trace)
        first = records[0][0] if records else 0.0
        timed = ("t_ms", "prefill_ms", "decode_ms", "launch_ms", "handoff_ms", "beside_ms", "cache_ms")
        keys = timed + ("running", "staged", "waiting", "admitted", "held", "launches")
        lines = []
        for t, *fields, times in records:  # the record's seconds (after its start), then its counts
            seconds, counts = fields[: len(timed) - 1], fields[len(timed) - 1 :]
            ms = [round(x * 1e3, 3) for x in (t - first, *seconds)]
            line = dict(zip(keys, (*ms, *counts), strict=True))
            if times is not None:
                line["gpu_ms"] = round(times[0] * 1e3, 3)
                if times[1] is not None:
                    line["idle_ms"] = round(times[1] * 1e3, 3)
            lines.append(json.dumps(line) + "\n")
        return "".join(lines)

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request):
                self.waiting.append(_Sequence(item, self.decode_text, next(self.arrivals)))
            else:
                self.cancelled.add(item)
        if self.cancelled:
            for seq in [s for s in self.waiting if s.request.id in self.cancelled]:
                self.waiting.remove(seq)
                seq.request.emit(seq.event(None, "abort"))
            gone = [i for i, s in enumerate(self.running) if s.request.id in self.cancelled and not s.ended]
            for i in reversed(gone):
                self._finish(i, None, "abort")
            self._unfed = self._unfed or bool(gone)  # a cancelled sequence's slot is freed in this iteration
            self._cancel_staged()

    def _cancel_staged(self) -> None:
        """End the cancelled staged prompts and free their rows; while prefill launches are in flight (they write
        the staging rows) the cancellations of staged prompts wait for them."""
        if self.inflight is not None:
            self.cancelled = {s.request.id for s in self.staging if s.request.id in self.cancelled}
            return
        for row in reversed([i for i, s in enumerate(self.staging) if s.request.id in self.cancelled]):
            self.staging[row].request.emit(self.staging[row].event(None, "abort"))
            self._unstage(row)
        self.cancelled.clear()

    def _prefill(self) -> bool:
        """Stage, launch, admit: one iteration's prefill, in order (:meth:`_prefill_overlapped` splits it). False:
        nothing is left for :meth:`_prefill_rest`."""
        self._stage()
        plan = self._plan_prefill()
        self._launch_prefill(plan)
        self._complete_prefill(plan)
        self._admit()
        self._release()
        return False

    def _prefill_overlapped(self, admit: bool = True) -> bool:
        """The prefill launches of the last call still running: return False (the decode launch runs beside them)
        unless nothing decodes (then wait for them). Done: take their results and admit (the slots' part; not
        with ``admit`` False: a fed launch holds the slots, and the prompts wait for the next iteration); True:
        :meth:`_prefill_rest` then caches the admitted prompts' states, stages and plans the next launches and
        hands them to the worker thread. The staging rows belong to the launches until they are done: staging,
        admission and cancelled staged prompts wait for them."""
        if self.inflight is not None:
            plan, done = self.inflight
            if self.running and not done.done():
                return False
            done.result()  # the worker's exception, if any, is the engine's (a bug)
            self._handoff_s = time.perf_counter() - self._plan_done
            self.inflight = None
            self._complete_prefill(plan)
            self._cancel_staged()
        if admit:
            self._admit()
        return True

    def _prefill_rest(self) -> None:
        """What the next prefill launches need and the slots do not: free the admitted prompts' staging rows (their
        states cached first), stage waiting prompts, plan the launches and hand them to the worker thread (touches
        staging rows, the prefix cache and the host only: pipelined, it runs while a decode launch does)."""
        self._release()
        self._stage()
        plan = self._plan_prefill()
        if plan:
            self.inflight = (plan, self.prefill_worker.submit(self._launch_prefill, plan))

    def _stage(self) -> None:
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
            k = _leading_run(zeros, len(zeros))
            pool.stage(zeros[0], k=k)
            zeros = zeros[k:]

    def _plan_prefill(self) -> list[_Launch]:
        """This iteration's prefill launches: chunks within the row budget, oldest prompt first, one launch per run
        of neighbouring staged prompts whose next chunks are equally long. (Feeding from row 0 up starved prompts in
        the middle rows while new ones kept arriving: the newest staged prompt fills each freed row.) The staged
        sequences change only when the launches are done (:meth:`_complete_prefill`)."""
        plan: list[_Launch] = []
        if self._hold():
            return plan
        budget, fed = self.prefill_rows, set()  # fed: staging rows given a chunk in this iteration
        for start in sorted((r for r, s in enumerate(self.staging) if s.todo), key=lambda r: self.staging[r].order):
            if budget <= 0:
                break
            if start in fed:
                continue
            # the oldest staged prompt not fed yet, with its neighbours whose next chunks are as long: a newer
            # prompt never keeps an older one waiting (rows are not in arrival order: ``_unstage`` fills holes)
            rows = min(self.chunk, len(self.staging[start].todo), budget)

            def joins(row: int, rows: int = rows) -> bool:
                return (
                    0 <= row < len(self.staging)
                    and row not in fed
                    and min(self.chunk, len(self.staging[row].todo)) == rows
                )

            lo, hi = start, start + 1  # the launch feeds staging rows lo..hi-1
            while (hi - lo + 1) * rows <= budget and joins(hi):
                hi += 1
            while (hi - lo + 1) * rows <= budget and joins(lo - 1):
                lo -= 1
            group = self.staging[lo:hi]
            # a chunk boundary of a long prompt; the logits wanted: a prompt's end, or such a boundary that is cached
            boundaries = [
                i for i, s in enumerate(group) if len(s.todo) > rows and (len(s.fed) + rows) % self.chunk == 0
            ]
            want = [i for i, s in enumerate(group) if len(s.todo) == rows or (i in boundaries and self._caching(s))]
            ids = np.asarray([s.todo[:rows] for s in group], dtype=np.int64)
            plan.append(_Launch(lo, ids, boundaries, want, *self._first_draws(group, rows)))
            if self.trace is not None:
                self._launches.append((lo, hi - lo, rows))
            budget -= rows * len(group)
            fed.update(range(lo, hi))
            self.totals["prefill_launches"] += 1
            self.totals["prefill_rows"] += rows * len(group)
        return plan

    def _first_draws(self, group: list[_Sequence], rows: int) -> tuple[list[int], np.ndarray | None]:
        """Where the pool samples on the device: the positions in a launch of ``group``'s next ``rows`` tokens whose
        prompts end in it and whose requests sample greedily or by temperature alone, and the sampler's rows
        (temperature, uniform draw) [k, 2] for the launch. Their first tokens are then picked where the launch's
        logits are, in the launch's thread: a host pick costs a pass of numpy over the vocabulary per prompt
        (~0.1 ms at 50k ids), on the engine's thread. A seeded request's draw is its RNG's first, as the host's pick
        would take (:func:`sampler_rows`); the other rows are greedy rows whose picks go unused, and draw nothing.
        ([], None): the host picks them all."""
        if not self.pool.device_sample:
            return [], None
        first = [
            i
            for i, seq in enumerate(group)
            if len(seq.todo) == rows and seq.request.sampling.plain and seq.request.sampling.max_new_tokens > 0
        ]
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
        if self.waiting_served_ratio > 0 and self.running and self._held < self.max_waiting_tokens:
            new = [s for s in self.staging if s.todo]
            # at most one launch's prompts gather (more would hold the prompts after them as well)
            gather = min(self.waiting_served_ratio * len(self.running), self.pool.staging_rows)
            hold = bool(new) and not any(s.launches for s in new) and len(new) + len(self.waiting) < gather
            self._holding = len(new) + len(self.waiting) if hold else 0
        self._held = self._held + 1 if hold else 0
        return hold

    def _launch_prefill(self, plan: list[_Launch]) -> None:
        """Run the planned launches and fetch the logits each wants before the next launch replaces them (the
        worker thread's part when overlapped: the pool's staging rows and prefill buffers only)."""
        for launch in plan:
            self.pool.prefill(self.prefill_graph, launch.lo, launch.ids)
            if launch.draws is not None:
                picks = self.pool.prefill_sample(launch.draws).tolist()  # [k]
                launch.picks = {i: picks[i] for i in launch.first}
            for i in launch.want:
                launch.logits[i] = self.pool.prefill_logits(i)[: self.vocab]
        self._plan_done = time.perf_counter()

    def _complete_prefill(self, plan: list[_Launch]) -> None:
        """The launches are done: the staged sequences advance by their chunks; the states at chunk boundaries of
        long prompts are to go into the cache (:meth:`_release`, which runs beside the decode launch where the
        engine is pipelined: this runs before it, and with 16 prompts of two chunks the caching of their first
        chunks' states and logits was host work the GPU's decode waited for)."""
        for launch in plan:
            k, rows = launch.ids.shape
            self.totals["pool_first_tokens"] += len(launch.picks)
            for i, seq in enumerate(self.staging[launch.lo : launch.lo + k]):
                seq.launches += 1
                seq.fed += seq.todo[:rows]
                del seq.todo[:rows]
                seq.logits = launch.logits.get(i)
                seq.first = launch.picks.get(i)
                if i in launch.boundaries:
                    self._boundaries.append(seq)

    def _admit(self) -> None:
        """Prefilled prompts take free slots, oldest first, and get their first tokens; their staging rows stay
        theirs until :meth:`_release` (the slots' copies are all a decode launch needs)."""
        ready = sorted((r for r, s in enumerate(self.staging) if not s.todo), key=lambda r: self.staging[r].order)
        while ready and len(self.running) < self.max_batch:
            # the oldest ready prompts whose rows follow each other (a launch's) take the next slots in one copy,
            # then each gets its first token, the last first: one that ends there frees its slot at once (for the
            # next run), taken by the last running sequence, whose token is out already
            base = len(self.running)
            k = _leading_run(ready, self.max_batch - base)
            rows, ready = ready[:k], ready[k:]
            self.pool.admit(base, rows[0], k)
            self._released += rows
            self.running += [self.staging[row] for row in rows]
            for i in range(base + k - 1, base - 1, -1):
                seq = self.running[i]
                if seq.request.sampling.max_new_tokens == 0:  # prefill only (run --max-new-tokens 0 --save-state)
                    self._finish(i, None, "length")
                else:
                    self._emit_next(i, seq.first)

    def _release(self) -> None:
        """Cache the states of staged prompts at a chunk boundary (:meth:`_complete_prefill`; those cancelled since
        are gone), then free the staging rows of the prompts :meth:`_admit` admitted, each prompt's state cached
        first (from its row: the highest row first, so that moving the last staged prompt into a freed row never
        moves one still to be cached). The next prefill launch, which writes the staging rows, comes after."""
        for seq in self._boundaries:
            if seq in self.staging:  # its row now (a cancellation may have moved it)
                row = self.staging.index(seq)
                self._remember(seq, lambda out, row=row: self.pool.staged(row, out))
        self._boundaries.clear()
        for row in sorted(self._released, reverse=True):
            seq = self.staging[row]
            if seq.cached_tokens < len(seq.fed):
                self._remember(seq, lambda out, row=row: self.pool.staged(row, out))
            self._unstage(row)
        self._released.clear()

    def _unstage(self, row: int) -> None:
        """Free staging row ``row``: the last staged prompt moves into it, so the staged rows stay 0..m-1."""
        last = len(self.staging) - 1
        if row != last:
            self.pool.move_staged(last, row)
            self.staging[row] = self.staging[last]
        self.staging.pop()

    def _start(self, seq: _Sequence, row: int) -> bool:
        """Stage a prompt in ``row`` from the caller's states or the longest cached prefix (the whole prompt too:
        then its cached logits give the first token without a launch); False: from zeros, which the caller sets."""
        if seq.request.state is not None:  # the caller's states (a saved conversation): no cache lookup
            self.pool.stage(row, *seq.request.state)
            return True
        n, entry = self.cache.longest_prefix(seq.todo)
        if entry is not None:  # the cache's rows: staging copies the states
            conv, ssm, logits = entry
            self.pool.stage(row, conv, ssm)
            if n == len(seq.todo):  # the whole prompt: its first token comes from these logits (a longer one's
                seq.logits = logits.copy()  # from its last launch)
            seq.fed, seq.todo, seq.cached_tokens = seq.todo[:n], seq.todo[n:], n
            return True
        return False

    def _caching(self, seq: _Sequence) -> bool:
        """Whether ``seq``'s states go into the prefix cache (a sequence from the caller's states does not: its
        tokens are not the whole prefix)."""
        return self.cache.capacity > 0 and seq.request.state is None

    def _compact(self) -> None:
        """Free the slots of the sequences that ended while a launch held them (:meth:`_finish`, looking ahead): the
        last running sequence takes each freed slot, so the occupied slots stay 0..n-1. Only with no launch in
        flight."""
        self._unfed = False
        if not self._ended:
            return
        running = self.running
        for i in range(len(running) - 1, -1, -1):  # the last one is never ended: those after i are handled
            if running[i].ended:
                last = len(running) - 1
                if i != last:
                    self.pool.move(last, i)
                    running[i] = running[last]
                running.pop()
        self._ended = 0

    def _remember(self, seq: _Sequence, state: Callable[[tuple], object], row: int = 0, prev: bool = False) -> None:
        """Cache the state after ``seq.fed``; ``state(out)`` copies it into the cache's rows ``out`` (only when a
        cache exists), and the logits come from row ``row`` of the pool's last launch (``prev``: of the launch
        before) when the pool picked the token itself. A sequence that started from the caller's states is not
        cached: its tokens are not the whole prefix."""
        if self._caching(seq):

            def fill(entry: tuple) -> np.ndarray | None:  # called for a prefix not cached yet only
                state(entry[:2])
                if seq.logits is not None:
                    if _row_of_its_own(seq.logits):
                        return seq.logits  # kept by reference (StateCache)
                    entry[2][...] = seq.logits
                elif prev:
                    self.pool.prev_logits(row, entry[2])
                else:
                    self.pool.last_logits(row, entry[2])
                return None

            t = time.perf_counter()
            self.cache.put(seq.fed, fill)
            self._cache_s += time.perf_counter() - t

    def _begin_decode(self) -> tuple | None:
        """Begin one launch for every running sequence (:meth:`_finish_decode` ends it): (n, tokens fed, how the
        pool picks, the sampler's rows, the sequences by row), None when nothing runs. A sequence's token is its
        last pick, handled or not (``next_id``)."""
        running = self.running
        n = len(running)
        if n == 0:
            return None
        last = [s.generated[-1] if s.next_id is None else s.next_id for s in running]
        # the pool picks the tokens where the logits are (a GPU copies n ids, not n x Vp logits): all greedy, or
        # each greedy or by temperature alone (a top-k or top-p cut, a penalty or a bias: the host samples)
        picker = max(s.picker for s in running)
        if self.pool.device_greedy and picker == 0:
            how = "greedy"
        else:
            how = "sample" if self.pool.device_sample and picker <= 1 else "logits"
        t = time.perf_counter()
        self.pool.begin_decode(np.asarray(last, dtype=np.int64), how)
        self._launch_s += time.perf_counter() - t
        params = sampler_rows(running, self.draws) if how == "sample" else None  # [n, 2], while the launch runs
        return n, last, how, params, list(running)

    def _feed(self) -> int | None:
        """Begin the next decode launch before the last one's picks reach the host, fed them on the device (the
        pool queues it behind that launch: the device runs the two back to back, where it would otherwise wait for
        the host to take the picks and begin the next launch from them): n, the launch's sequences, or None where
        it cannot. Only while the slots stay as they are: the last launch greedy, no prompt to admit in this
        iteration, no request cancelled (a vanished client's slot is freed at once), and few sequences ended since
        the slots were last compacted (an ended sequence keeps its slot, computed and ignored, until
        :meth:`_compact` frees it: at most an eighth of the launch's rows, or one)."""
        begun = self._ahead
        if begun is None or begun[2] != "greedy":
            return None
        n, ended = begun[0], self._ended
        if self._unfed or n != len(self.running) or ended >= n or ended > max(1, n // 8) or self._admissible():
            return None
        t = time.perf_counter()
        self.pool.feed(n)
        self._launch_s += time.perf_counter() - t
        return n

    def _admissible(self) -> bool:
        """Whether this iteration's prefill work may admit prompts to slots: a staged prompt is prefilled, or the
        prefill launches in flight are done and end one's prompt."""
        if any(not s.todo for s in self.staging):
            return True
        if self.inflight is None or not self.inflight[1].done():
            return False
        for launch in self.inflight[0]:
            k, rows = launch.ids.shape
            if any(len(seq.todo) <= rows for seq in self.staging[launch.lo : launch.lo + k]):
                return True
        return False

    def _finish_decode(self, begun: tuple | None) -> None:
        """End the launch :meth:`_begin_decode` began: sample, emit and finish."""
        if begun is None:
            return
        t = time.perf_counter()
        out = self.pool.finish_decode(begun[2], begun[3])  # picks [n], or logits [n, Vp]
        self._launch_s += time.perf_counter() - t
        self._handle(begun, out)

    def _finish_ahead(self) -> tuple | None:
        """Looking ahead: end the decode launch begun in the last iteration. Its picks, (launch, picks), are handled
        once the next launch is begun (each sequence's pick noted as the token it feeds); the host's samples (a
        launch of logits) are handled now, being the next launch's tokens. None: nothing left to handle."""
        if self._ahead is None:
            return None
        begun, self._ahead = self._ahead, None
        t = time.perf_counter()
        out = self.pool.finish_decode(begun[2], begun[3])
        self._launch_s += time.perf_counter() - t
        if begun[2] == "logits":
            self._handle(begun, out)
            return None
        for seq, token in zip(begun[4], out.tolist(), strict=True):
            seq.next_id = token
        return begun, out

    def _handle(self, begun: tuple, out: np.ndarray) -> None:
        """Each sequence of the launch ``begun`` takes its token (picked by the pool, ``out`` [n], or sampled here
        from the logits ``out`` [n, Vp]): emitted, and the sequence finished where it ends. Looking ahead, the next
        launch is already running: a sequence's index may have changed since (slots freed), and an ended
        sequence's slot is freed after that launch (:meth:`_finish`)."""
        n, last, how, _, launched = begun
        on_device = how != "logits"
        picked = out.tolist() if on_device else None
        if on_device:
            self.totals["pool_next_tokens"] += n
        running = self.running
        moved = running[:n] != launched  # only looking ahead: slots freed and taken since the launch began
        index = {id(s): i for i, s in enumerate(running)} if moved else None
        for row in range(n - 1, -1, -1):  # from the end: a finished sequence's slot takes one already handled
            seq = launched[row]
            if seq.ended:  # cancelled while its launch ran
                continue
            i = index[id(seq)] if moved else row
            seq.fed.append(last[row])
            seq.next_id, seq.logits_row = None, row
            if on_device:
                seq.logits = None  # row ``row`` of the launch's logits
                self._emit_next(i, picked[row])
            else:
                seq.logits = out[row, : self.vocab]
                self._emit_next(i)

    def _emit_next(self, i: int, token: int | None = None) -> None:
        """Sample sequence i's next token from its logits (unless the pool ``token`` picked it), emit it, and
        finish the sequence when it is done."""
        seq = self.running[i]
        sampling = seq.request.sampling
        if token is None:
            token = sample_token(seq.logits, sampling, seq.rng if sampling.temperature else None, seq.generated)
        generated = seq.generated
        generated.append(token)
        eos = token == self.eos_id and sampling.stop_on_eos  # never when the bundle has no EOS (None)
        if seq.bare:  # no text, no stop strings
            if eos:
                self._finish(i, token, "stop")
            elif len(generated) >= sampling.max_new_tokens:
                self._finish(i, token, "length")
            else:
                r = seq.request
                r.emit(Event(token, "", None, len(r.prompt), len(generated), seq.cached_tokens, seq.launches))
            return
        if seq.step_text is not None and not eos:
            seq.text += seq.step_text(token)
        hit = next((s for s in seq.request.stop if s in seq.text), None) if seq.request.stop else None
        if hit is not None:
            seq.text = seq.text[: seq.text.index(hit)]
            self._finish(i, token, "stop")
        elif eos:
            self._finish(i, token, "stop")
        elif len(generated) >= sampling.max_new_tokens:
            self._finish(i, token, "length")
        else:
            seq.request.emit(seq.event(token, None))

    def _finish(self, i: int, token: int | None, reason: str) -> None:
        """End sequence i: emit its last event, cache its state, give its slot to the last running sequence. While
        a launch begun after its last token runs (looking ahead), its states and logits are the launch before's
        (:meth:`SlotPool.prev_slot_state`), and its slot is freed once that launch ends (:meth:`_compact`)."""
        seq = self.running[i]
        event = seq.event(token, reason)
        prev = self._ahead is not None
        state = self.pool.prev_slot_state if prev else self.pool.slot_state
        if seq.request.keep_state and reason != "abort":
            event.state = tuple(np.array(a, copy=True) for a in state(i))
        seq.request.emit(event)
        if reason != "abort":
            self._remember(seq, lambda out: state(i, out), seq.logits_row, prev)
        if prev:
            seq.ended = True
            self._ended += 1
            return
        last = len(self.running) - 1
        if i != last:
            self.pool.move(last, i)
            self.running[i] = self.running[last]
        self.running.pop()
