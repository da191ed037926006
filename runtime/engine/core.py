"""The engine: continuous batching over one runner's slot pool, one loop for `run`, `bench`, `eval` and `serve`.

Each :meth:`Engine.step` schedules (:class:`~.scheduler.Scheduler`: which prompts are staged and prefilled, which
sequences take slots and decode), executes (:class:`~.executor.Executor`: the launches on the pool) and updates
from the output (:class:`~.output.OutputProcessor`: tokens, text, stop strings, events, finished sequences):

1. take new requests and cancellations;
2. prefill staged prompts (within a row budget, oldest first), admit the prefilled ones to free slots and emit
   their first tokens;
3. run one decode launch for every sequence in a slot, pick each next token, and finish sequences at EOS, a stop
   string, ``max_tokens`` or cancellation.

Pipelined (where the pool runs its launches on streams of their own: CUDA with the kernels graphs), the steps
overlap: the prefill launches go to a worker thread while decode launches go on; the host work that needs neither
a decode launch's results nor the slots (sending events, caching and staging prompts, planning prefill) runs while
the launch runs; each decode launch is begun from the last one's picks before they are handled, and, while the
slots stay the same and all decode greedily, queued behind the last one before its picks reach the host, fed them
on the device, so the GPU runs the decode launches back to back. `mambatrt run` is this engine with one slot
(:meth:`Engine.generate`), so a single prompt and a served request go through the same code.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import numpy.random  # noqa: F401  (imported at load: ~8 ms inside a sampled request's first token otherwise)

from mambatrt.contract import DECODE, PREFILL
from mambatrt.errors import InputError

from ..memory import trim
from ..runners.base import Runner
from ..runners.scorer import Scorer
from .config import EngineConfig
from .executor import DecodeLaunch, Executor
from .output import OutputProcessor
from .request import EngineStopped, Event, QueueFull, Request, Sequence
from .sampling import MAX_LOGPROBS, check_token_ids
from .scheduler import Scheduler


class Engine:
    """The continuous-batching loop over one runner (see the module docstring). Thread-safe ``submit``/``cancel``."""

    def __init__(
        self,
        runner: Runner,
        config: EngineConfig | None = None,
        eos_id: int | None = None,
        decode_text: Callable[[], Callable[[int], str]] | None = None,
    ) -> None:
        """``decode_text``: makes a per-sequence incremental decoder (``Tokenizer.stream``), for text and stop
        strings."""
        config = config or EngineConfig()
        bundle = runner.bundle
        limit = bundle.manifest.max_batch if bundle.manifest.batched else 1
        self.max_batch = min(config.max_batch or limit, limit)
        self.runner, self.config, self.decode_text = runner, config, decode_text
        self.vocab = bundle.config.vocab_size
        on_prefill = PREFILL in bundle.graphs and not config.token_by_token
        self.prefill_graph = PREFILL if on_prefill else DECODE
        self.pool = runner.open_pool(self.max_batch, self.prefill_graph)
        self.scheduler = Scheduler(self.pool, config, self.max_batch, self.prefill_graph, runner.device == "cuda")
        self.on_prefill = on_prefill
        self.executor = Executor(self.pool, self.prefill_graph, self.vocab)
        self.output = OutputProcessor(self.scheduler, eos_id, lambda: self.executor.ahead is not None)
        pipelined = config.pipelined if config.pipelined is not None else runner.device == "cuda"
        self.pipelined = pipelined and self.pool.concurrent  # decided for good at start()
        self.feeding = False  # greedy launches begun before the last one's picks reach the host (at start())
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.arrivals = itertools.count()  # each sequence's ``order``
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._main, name="mambatrt-engine", daemon=True)
        self._go = threading.Event()  # start() was called (the thread may have started earlier, to warm)
        self._warmed = threading.Event()
        self._warm_result: int | BaseException = 0
        self.warmed = False
        self.error: BaseException | None = None
        self.flush: Callable[[], None] | None = None  # called by the engine thread after each pass of its loop:
        # the events emitted in it can go out together (`serve`'s front ends wake once per iteration)
        # since the start: iterations, seconds in prefill and in decode (launches and their host work), decode
        # launches and those of them fed the launch before's picks on the device
        self.totals = {"iterations": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        self.totals.update(decode_launches=0, fed_launches=0)

    # -- public, any thread ---------------------------------------------------------------------------------
    @property
    def cache(self):
        """The prefix cache (:class:`~.state_cache.StateCache`)."""
        return self.scheduler.cache

    def start(self) -> Engine:
        # launch shapes not captured yet are captured on first use, and a capture must not meet the other thread's
        # copies and launches: pipelined only once every shape is captured (warm) or where nothing is
        self.pipelined = self.pipelined and (self.warmed or not self.pool.captured)
        self.feeding = self.pipelined and self.pool.can_feed
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
        if self.inbox.qsize() + len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFull(f"{self.config.max_queue} requests are waiting; retry later")
        self.inbox.put(request)
        self.wake.set()

    def generate(self, request: Request) -> None:
        """Run one request to its end in the calling thread (the engine's thread not started): `mambatrt run`,
        `bench` and `eval` are this engine with one slot, so a single prompt and a served one go through the same
        code."""
        if self.thread.is_alive():
            raise RuntimeError("generate needs an engine whose thread is not started")
        self._check(request)
        ended = []

        def watch(event: Event) -> None:
            request.emit(event)
            if event.finish_reason is not None:
                ended.append(event)

        self.inbox.put(replace(request, emit=watch))  # the same request (id too); the caller's untouched
        s = self.scheduler
        while not ended:
            self._take_inbox()
            if s.waiting or s.staging:
                self._prefill()
            self._finish_decode(self._begin_decode())

    def _check(self, request: Request) -> None:
        if len(request.prompt) == 0:
            raise InputError("empty prompt: pass at least one token")
        check_token_ids(request.prompt, self.vocab)
        bad = next((t for t, _ in request.sampling.logit_bias if t >= self.vocab), None)
        if bad is not None:
            raise InputError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab})", param="logit_bias"
            )
        if request.score_from is not None and not 0 < request.score_from < len(request.prompt):
            raise InputError(f"score_from must be in 1..{len(request.prompt) - 1}, got {request.score_from}")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise InputError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {request.logprobs}", param="logprobs")

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
        if not self.thread.is_alive():
            self.pool.close()

    def stats(self) -> dict:
        """Running and waiting (queued or prefilling) sequences, and the totals since the start (/metrics)."""
        s = self.scheduler
        waiting = len(s.waiting) + len(s.staging) + self.inbox.qsize()
        # sequences that ended while a launch held their slots are freed later (compact): not running
        running = len(s.running) - s.ended
        totals = {**self.totals, **s.totals, "pool_next_tokens": self.output.next_tokens}
        return {"running": running, "waiting": waiting, **totals}

    # -- the loop ---------------------------------------------------------------------------------------------
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

    @property
    def scorer(self) -> Scorer | None:
        """The runner's scorer of prompts to score (every row of a chunk in one launch), or None where the bundle
        or the runner has none; made when first asked for (a request that scores, or the server's warm-up), so
        runs that score nothing never load it."""
        if self.executor.scorer is None and self.on_prefill:
            self.executor.scorer = self.runner.scorer()
        return self.executor.scorer

    def _main(self) -> None:
        """The engine thread: the warm-up captures (when :meth:`warm` asked for them), then, once started, the
        loop."""
        if self._warm_result is None:
            try:
                self._warm_result = self.executor.warm(self.pipelined, self.scorer)
            except BaseException as exc:  # reported by warm(); the thread ends (submit then refuses)
                self._warm_result = exc
                if self.executor.worker is not None:
                    self.executor.worker.shutdown(wait=False)
                return
            finally:
                self._warmed.set()
            self._go.wait()
        self._loop()

    def _loop(self) -> None:
        s = self.scheduler
        busy = False
        try:
            while not self.stopping:
                self._take_inbox()
                idle = not s.running and not s.waiting and not s.staging
                if idle and self.executor.inflight is None and self.executor.ahead is None:
                    self._flush()  # cancellations answered while idle
                    if busy:
                        trim()  # what the requests took goes back to the system
                    busy = False
                    self.wake.wait(0.05)
                    self.wake.clear()
                    continue
                busy = True
                self.step()
                if not (self.pipelined and s.running):
                    self._flush()  # else once the next step's decode launch is queued
        except BaseException as exc:  # a bug: end every request rather than hang its client
            self.error = exc
            raise
        finally:
            self._abort_all()

    def _abort_all(self) -> None:
        """The loop has ended: every request still queued or running ends with "abort"."""
        s = self.scheduler
        self.executor.stop()
        self._take_inbox()  # requests submitted but never taken end too
        for seq in list(s.running) + list(s.staging) + list(s.waiting):
            if not seq.ended:
                seq.request.emit(seq.event(None, "abort"))
        s.running.clear()
        s.ended = 0
        s.staging.clear()
        s.waiting.clear()
        self._flush()

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush()

    def step(self) -> None:
        """One iteration: prefill, then decode; their times add up in ``totals`` (``/metrics``). Pipelined, the
        decode launch begun in the last step is finished first, the slots of sequences that ended meanwhile are
        freed, and the next launch is begun from its picks before they are handled, so that their handling runs
        beside that launch; the prefill work that needs no slot (:meth:`_prefill_rest`) and the last step's events
        go while it runs. Feeding, where the slots may stay as they are, the next launch is queued first, fed the
        last one's picks on the device (:meth:`_feed`), and the step neither frees slots nor admits prompts (its
        prefill launches still go on)."""
        t0 = time.perf_counter()
        fed = self._feed() if self.feeding else None  # the next launch, queued behind the last one
        picked = self._finish_ahead()  # the last launch's picks, to be handled once the next one is begun
        if fed is None:
            self.scheduler.compact()
        t1 = time.perf_counter()
        if fed is not None:  # the slots stay as they are: nothing admitted
            rest = self._prefill_overlapped(admit=False)
        else:
            rest = self._prefill_overlapped() if self.pipelined else self._prefill()
        t2 = time.perf_counter()
        if fed is None:
            begun = self._begin_decode()
        else:  # fed the last launch's picks, its sequences
            launch, picks = picked
            begun = DecodeLaunch(fed, picks.tolist(), "greedy", None, launch.seqs)
            self.totals["fed_launches"] += 1
        self.totals["decode_launches"] += begun is not None
        t3 = time.perf_counter()
        if self.pipelined and begun is not None:
            self._flush()
        if rest:
            self._prefill_rest()
        t4 = time.perf_counter()
        if self.pipelined:
            self.executor.ahead = begun
            if picked is not None:
                self.output.handle(*picked)
        else:
            self._finish_decode(begun)
        t5 = time.perf_counter()
        self.totals["iterations"] += 1
        self.totals["prefill_seconds"] += (t2 - t1) + (t4 - t3)
        self.totals["decode_seconds"] += (t1 - t0) + (t3 - t2) + (t5 - t4)

    def _take_inbox(self) -> None:
        s = self.scheduler
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request):
                score_rows = item.score_from is not None and self.scorer is not None
                seq = Sequence(item, self.decode_text, next(self.arrivals), score_rows)
                s.waiting.append(seq)
            else:
                s.cancelled.add(item)
        if s.cancelled:
            for seq in s.cancel_waiting():
                seq.request.emit(seq.event(None, "abort"))
            gone = [i for i, seq in enumerate(s.running) if seq.request.id in s.cancelled and not seq.ended]
            for i in reversed(gone):
                self.output.finish(i, None, "abort")
            s.unfed = s.unfed or bool(gone)  # a cancelled sequence's slot is freed in this iteration
            s.cancel_staged(self.executor.inflight is not None)

    def _prefill(self) -> bool:
        """Stage, launch, admit: one step's prefill, in order (:meth:`_prefill_overlapped` splits it). False:
        nothing is left for :meth:`_prefill_rest`."""
        s = self.scheduler
        s.stage()
        plan = s.plan_prefill()
        self.executor.run_prefill(plan)
        s.complete_prefill(plan)
        s.admit(self.output.first_token)
        s.release()
        return False

    def _prefill_overlapped(self, admit: bool = True) -> bool:
        """The prefill launches of the last step still running: return False (the decode launch runs beside them)
        unless nothing decodes (then wait for them). Done: take their results and admit (the slots' part; not with
        ``admit`` False: a fed launch holds the slots, and the prompts wait for the next step); True:
        :meth:`_prefill_rest` then caches the admitted prompts' states, stages and plans the next launches and
        hands them to the worker thread. The staging rows belong to the launches until they are done: staging,
        admission and cancelled staged prompts wait for them."""
        s, executor = self.scheduler, self.executor
        if executor.inflight is not None:
            if s.running and executor.prefill_running():
                return False
            s.complete_prefill(executor.take_prefill())
            s.cancel_staged(False)
        if admit:
            s.admit(self.output.first_token)
        return True

    def _prefill_rest(self) -> None:
        """What the next prefill launches need and the slots do not: free the admitted prompts' staging rows (their
        states cached first), stage waiting prompts, plan the launches and hand them to the worker thread (touches
        staging rows, the prefix cache and the host only: pipelined, it runs while a decode launch does)."""
        s = self.scheduler
        s.release()
        s.stage()
        plan = s.plan_prefill()
        if plan:
            self.executor.start_prefill(plan)

    def _begin_decode(self) -> DecodeLaunch | None:
        """Begin one launch for every running sequence (:meth:`_finish_decode` ends it); None when nothing runs."""
        launch = self.executor.decode_launch(self.scheduler)
        if launch is not None:
            self.executor.begin(launch, self.scheduler)
        return launch

    def _feed(self) -> int | None:
        """Begin the next decode launch before the last one's picks reach the host, fed them on the device: n, the
        launch's sequences, or None where it cannot. Only while the slots stay as they are: the last launch greedy,
        no prompt to admit in this step, and :meth:`Scheduler.slots_stay`."""
        ahead = self.executor.ahead
        if ahead is None or ahead.how != "greedy" or not self.scheduler.slots_stay(ahead.n) or self._admissible():
            return None
        self.executor.feed(ahead.n)
        return ahead.n

    def _admissible(self) -> bool:
        """Whether this step's prefill work may admit prompts to slots: a staged prompt is prefilled, or the
        prefill launches in flight are done and end one's prompt."""
        staging = self.scheduler.staging
        if any(not seq.left for seq in staging):
            return True
        inflight = self.executor.inflight
        if inflight is None or not inflight[1].done():
            return False
        for launch in inflight[0]:
            k, rows = launch.ids.shape
            if any(seq.left <= rows for seq in staging[launch.lo : launch.lo + k]):
                return True
        return False

    def _finish_decode(self, launch: DecodeLaunch | None) -> None:
        """End the launch :meth:`_begin_decode` began: pick, emit and finish."""
        if launch is not None:
            self.output.handle(launch, self.executor.finish(launch))

    def _finish_ahead(self) -> tuple[DecodeLaunch, np.ndarray] | None:
        """Pipelined: end the decode launch begun in the last step. Its picks, (launch, picks), are handled once the
        next launch is begun (each sequence's pick noted as the token it feeds); the host's samples (a launch of
        logits) are handled now, being the next launch's tokens. None: nothing left to handle."""
        launch, self.executor.ahead = self.executor.ahead, None
        if launch is None:
            return None
        out = self.executor.finish(launch)
        if launch.how == "logits":
            self.output.handle(launch, out)
            return None
        for seq, token in zip(launch.seqs, out.tolist(), strict=True):
            seq.next_id = token
        return launch, out
