"""A front end's side of the engine process: requests submitted and cancelled over its pipe, each iteration's events
dispatched to their requests' queues, the metrics scraped (:mod:`.wire`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable

import numpy as np

from ..engine import Sampling
from ..memory import trim
from ..tokenizer import Tokenizer
from . import wire
from .protocol import OpenAIError
from .wire import WireEvent

# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals httpx's pool expiry, so a client
# can send on a connection in the moment the server closes it (httpx: ReadError, seen once in 512 requests at
# concurrency 128). Longer than clients' and load balancers' own idle timeouts (60 s is common), they close first.
SERVE_KEEP_ALIVE_S = 75
# On SIGTERM a front end drains: new requests get 503, those in flight finish, but those still running after
# SHUTDOWN_ABORT_S are cancelled: the engine ends each with an "abort" event, so a stream ends with that finish
# reason and [DONE] (a plain request gets a 503), where uvicorn's deadline (SHUTDOWN_GRACE_S, once the listener is
# closed) would cut the connection mid-stream and log the cancelled task's traceback
SHUTDOWN_GRACE_S = 10
SHUTDOWN_ABORT_S = 8
RETRY_AFTER_S = 1  # what a 429 (the engine's queue full) asks a client to wait
OBSERVED_EVERY_S = 0.25  # how often a front end sends the latencies it measured to the engine process (/metrics)


class EngineGone(OpenAIError):
    def __init__(self, why: str) -> None:
        super().__init__(503, why, "server_error")


class EngineClient:
    """A front end's side of the engine process: submit and cancel requests, scrape the metrics; each iteration's
    events arrive in one message and go to their requests' queues. All methods run on the event loop's thread."""

    def __init__(self, index: int, count: int, commands, events, tokenizer: Tokenizer | None = None) -> None:
        """``commands``, ``events``: this front end's ends of its two pipes (multiprocessing Connections);
        ``tokenizer``: the bundle's, with which this front end decodes its requests' text (those without stop
        strings, which the engine must read): ~2-4 us of a tokenizer's step per token, which the engine's one thread
        would otherwise spend on every running sequence in every iteration, while the front ends are several."""
        self.ids = itertools.count(index, count)  # request ids, unique across the ``count`` front ends
        self.commands, self.events = commands, events
        self.tokenizer = tokenizer
        self.queues: dict[int, asyncio.Queue[WireEvent]] = {}  # requests in flight
        self.decoders: dict[int, Callable[[int], str]] = {}  # requests whose text this front end decodes
        self.answers: dict[int, asyncio.Future] = {}  # submits and scrapes waiting for the engine process
        self.ttft: list[float] = []  # latencies measured since they were last sent (seconds)
        self.itl: list[float] = []
        self.stopped: str | None = None  # why requests can no longer be served
        self.on_lost: Callable[[], None] | None = None  # the engine process went away: stop serving
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ticker: asyncio.Task | None = None
        self.trimmed = True  # no request was submitted since the heap was last trimmed

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading events on ``loop`` and tell the engine process this front end serves."""
        self.loop = loop
        loop.add_reader(self.events.fileno(), self._readable)
        # uvloop makes a reader's descriptor non-blocking; a message longer than the pipe's buffer (an iteration's
        # events with a long prompt's scores) then ends recv() with EAGAIN halfway. Once poll() has seen its head,
        # the rest is being written: recv() waits for it
        os.set_blocking(self.events.fileno(), True)
        self.ticker = loop.create_task(self._send_observed())
        self._send((wire.READY,))

    def detach(self) -> None:
        if self.loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.events.fileno())
        if self.ticker is not None:
            self.ticker.cancel()

    async def submit(
        self,
        prompt: np.ndarray,
        sampling: Sampling,
        stop: tuple[str, ...],
        score_from: int | None,
        logprobs: int | None,
        events: asyncio.Queue,
    ) -> int:
        """The request's id once the engine accepted it (its events go to ``events``); OpenAIError (429, 400, 503)
        if it did not."""
        if self.stopped is not None:
            raise EngineGone(self.stopped)
        rid = next(self.ids)
        self.trimmed = False
        self.queues[rid] = events  # events can arrive before the answer (which the router thread sends after the
        # engine thread may have run an iteration): a short request may even have ended
        answer = self.answers[rid] = self.loop.create_future()
        here = self.tokenizer is not None and not stop
        if here:
            self.decoders[rid] = self.tokenizer.stream()
        self._send((wire.SUBMIT, rid, prompt, sampling, stop, not here, score_from, logprobs))
        try:
            await answer
        except OpenAIError:
            self.queues.pop(rid, None)
            self.decoders.pop(rid, None)
            raise
        except asyncio.CancelledError:  # the client left before the engine answered
            self.cancel(rid)
            raise
        return rid

    def busy(self) -> bool:
        """Whether requests are in flight (submitted, or running)."""
        return bool(self.queues)

    def abort_all(self) -> None:
        """Cancel every request in flight in the engine, keeping their queues: each ends with the engine's "abort"
        event (shutdown's deadline, SHUTDOWN_ABORT_S)."""
        if self.stopped is None:
            for rid in list(self.queues):
                self._send((wire.CANCEL, rid))

    def cancel(self, rid: int) -> None:
        """The client went away: the engine frees the request's slot within one iteration."""
        self.queues.pop(rid, None)
        self.answers.pop(rid, None)
        self.decoders.pop(rid, None)
        if self.stopped is None:
            self._send((wire.CANCEL, rid))

    def token(self, seconds: float, first: bool) -> None:
        """A latency measured as the client sees it: time to first token, or between two tokens."""
        (self.ttft if first else self.itl).append(seconds)

    async def scrape(self) -> bytes:
        """The Prometheus text of the whole server (rendered by the engine process)."""
        if self.stopped is not None:
            raise EngineGone(self.stopped)
        token = next(self.ids)
        answer = self.answers[token] = self.loop.create_future()
        ttft, itl, self.ttft, self.itl = self.ttft, self.itl, [], []
        self._send((wire.SCRAPE, token, ttft, itl))
        return await answer

    async def _send_observed(self) -> None:
        """Every OBSERVED_EVERY_S: the latencies measured to the engine process; once idle after requests, the
        heap they took back to the system (their bodies, prompts and texts)."""
        while True:
            await asyncio.sleep(OBSERVED_EVERY_S)
            if not self.queues and not self.trimmed:
                trim()
                self.trimmed = True
            if (self.ttft or self.itl) and self.stopped is None:
                ttft, itl, self.ttft, self.itl = self.ttft, self.itl, [], []
                self._send((wire.OBSERVED, ttft, itl))

    def _send(self, message: tuple) -> None:
        try:
            self.commands.send(message)
        except OSError:
            self._lost()

    def _readable(self) -> None:
        try:
            while self.events.poll():
                self._dispatch(self.events.recv())
        except (EOFError, OSError):
            self._lost()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == wire.EVENTS:
            queues, decoders = self.queues, self.decoders
            for fields in message[1]:
                rid = fields[0]
                events = queues.get(rid)
                if events is None:  # cancelled here already
                    continue
                event = WireEvent(*fields)
                decode = decoders.get(rid)
                # the engine's rule: every token's text but that of EOS ending the request ("stop" without stop
                # strings)
                if decode is not None and event.token is not None and event.finish_reason != "stop":
                    event = event._replace(text=decode(event.token))
                events.put_nowait(event)
                if event.finish_reason is not None:  # the request's last event
                    del queues[rid]
                    decoders.pop(rid, None)
        elif kind in (wire.ACCEPTED, wire.SCRAPED, wire.REJECTED):
            answer = self.answers.pop(message[1], None)
            if answer is None or answer.done():
                return
            if kind == wire.ACCEPTED:
                answer.set_result(None)
            elif kind == wire.SCRAPED:
                answer.set_result(message[2])
            else:
                _, _, status, type_, text, param = message
                headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
                answer.set_exception(OpenAIError(status, text, type_, param, headers=headers))
        elif kind == wire.STOPPED:
            self.stopped = message[1]
        else:
            raise ValueError(f"unknown message from the engine process: {kind!r}")

    def _lost(self) -> None:
        """The engine process has gone (its pipe closed): end every request, then stop serving."""
        if self.stopped is not None and self.loop is None:
            return
        self.stopped = "the engine process has exited"
        if self.loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.events.fileno())
            self.loop = None
        for answer in self.answers.values():
            if not answer.done():
                answer.set_exception(EngineGone(self.stopped))
        self.answers.clear()
        for rid, events in self.queues.items():
            events.put_nowait(WireEvent(rid, None, "", "abort", 0, 0, 0))
        self.queues.clear()
        self.decoders.clear()
        if self.on_lost is not None:
            self.on_lost()
