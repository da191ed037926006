"""The executor: the scheduler's launches on the slot pool.

Prefill launches run in turn, or, pipelined, in a worker thread of their own beside the decode launches (on CUDA
each on a stream of its own: the decoding sequences then do not wait for whole prefill launches between two
tokens). Decode launches are begun, then finished as :class:`DecodeLaunch` says: the pool picks the tokens where
the logits are (all greedy, or each greedy or by temperature alone), or the logits come to the host.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import numpy as np

from ..runners.base import SlotPool
from .request import Sequence
from .sampling import sampler_rows
from .scheduler import Launch, Scheduler


@dataclass
class DecodeLaunch:
    """One decode launch over slots 0..n-1: the tokens it feeds, how its tokens are picked ("greedy" or "sample" by
    the pool, "logits" by the host), the device sampler's rows (temperature, draw) [n, 2] for "sample", and the
    sequences in its slots when it began."""

    n: int
    ids: list[int]
    how: str
    params: np.ndarray | None
    seqs: list[Sequence]


class Executor:
    """Runs prefill and decode launches on ``pool`` (see the module docstring)."""

    def __init__(self, pool: SlotPool, prefill_graph: str, vocab: int) -> None:
        self.pool, self.prefill_graph, self.vocab = pool, prefill_graph, vocab
        self.scorer = None  # the runner's Scorer of scored prompts, set by the engine when first needed
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None  # runs prefill launches beside decode
        self.inflight: tuple[list[Launch], concurrent.futures.Future] | None = None  # prefill launches running
        self.ahead: DecodeLaunch | None = None  # pipelined: a decode launch in flight from one step to the next

    # -- prefill ------------------------------------------------------------------------------------------------
    def run_prefill(self, plan: list[Launch]) -> None:
        """Run the planned launches and fetch the logits each wants before the next launch replaces them (the
        worker thread's part when pipelined: the pool's staging rows and prefill buffers only)."""
        for launch in plan:
            if launch.score:
                self._score(launch)
                continue
            self.pool.prefill(self.prefill_graph, launch.lo, launch.ids)
            if launch.draws is not None:
                picks = self.pool.prefill_sample(launch.draws).tolist()  # [k]
                launch.picks = {i: picks[i] for i in launch.first}
            for i in launch.want:
                launch.logits[i] = self.pool.prefill_logits(i)[: self.vocab]

    def _score(self, launch: Launch) -> None:
        """A scored prompt's chunk on the scoring graph, from and back into its staging row: every row's logits."""
        conv, ssm = self.pool.staged(launch.lo)
        rows, conv, ssm = self.scorer.run(launch.ids[0], conv, ssm)
        self.pool.stage(launch.lo, conv, ssm)
        launch.rows = rows[:, : self.vocab]
        for i in launch.want:
            launch.logits[i] = launch.rows[-1]

    def start_prefill(self, plan: list[Launch]) -> None:
        """Hand the launches to the worker thread (one thread: its onnxruntime context keeps the prefill launches'
        captured graphs)."""
        self.inflight = (plan, self.prefill_worker().submit(self.run_prefill, plan))

    def prefill_worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mambatrt-prefill")
        return self.worker

    def prefill_running(self) -> bool:
        """Whether prefill launches handed to the worker are still running."""
        return self.inflight is not None and not self.inflight[1].done()

    def take_prefill(self) -> list[Launch]:
        """The launches handed to the worker, once done (waits for them); [] where none were."""
        if self.inflight is None:
            return []
        plan, done = self.inflight
        done.result()  # the worker's exception, if any, is the engine's (a bug)
        self.inflight = None
        return plan

    # -- decode -------------------------------------------------------------------------------------------------
    def decode_launch(self, scheduler: Scheduler) -> DecodeLaunch | None:
        """The launch for every running sequence, None when nothing runs. A sequence's token is its last pick,
        handled or not (``next_id``); the pool picks the tokens where the logits are (a GPU copies n ids, not
        n x Vp logits) when all are greedy, or each greedy or by temperature alone (a top-k or top-p cut, a penalty
        or a bias, a scored token: the host)."""
        running = scheduler.running
        n = len(running)
        if n == 0:
            return None
        ids = [s.pending if s.next_id is None else s.next_id for s in running]
        picker = max(s.picker for s in running)
        if self.pool.device_greedy and picker == 0:
            how = "greedy"
        else:
            how = "sample" if self.pool.device_sample and picker <= 1 else "logits"
        return DecodeLaunch(n, ids, how, None, list(running))

    def begin(self, launch: DecodeLaunch, scheduler: Scheduler) -> None:
        """Begin ``launch``; the device sampler's rows are drawn while it runs."""
        self.pool.begin_decode(np.asarray(launch.ids, dtype=np.int64), launch.how)
        if launch.how == "sample":
            launch.params = sampler_rows(launch.seqs, scheduler.draws)  # [n, 2]

    def feed(self, n: int) -> None:
        """Begin the next greedy launch over the n slots of the one in flight before its picks reach the host, fed
        them where they are (the pool queues it behind that launch: the device runs the two back to back)."""
        self.pool.feed(n)

    def finish(self, launch: DecodeLaunch) -> np.ndarray:
        """End ``launch``: its picks [n], or its logits [n, Vp] on the host."""
        return self.pool.finish_decode(launch.how, launch.params)

    # -- start and stop -----------------------------------------------------------------------------------------
    def warm(self, pipelined: bool, scorer=None) -> int:
        """Capture the launch shapes that are otherwise captured on first use: the decode launches on this thread
        (the engine's), the prefill launches on the thread that will run them. Returns how many. ``scorer``: its
        largest launch once too, so that the memory it takes is the server's from the start."""
        shapes = self.pool.warm_decode()
        if scorer is not None:
            scorer.warm()
        if pipelined:
            return shapes + self.prefill_worker().submit(self.pool.warm_prefill, self.prefill_graph).result()
        return shapes + self.pool.warm_prefill(self.prefill_graph)

    def stop(self) -> None:
        """Let the prefill launches in flight end (they write the staging rows), then stop the worker; forget the
        decode launches in flight (their picks go unused)."""
        if self.inflight is not None:
            concurrent.futures.wait([self.inflight[1]])
            self.inflight = None
        if self.worker is not None:
            self.worker.shutdown(wait=True)
        self.ahead = None
        self.pool.abandon()
