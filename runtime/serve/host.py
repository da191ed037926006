"""The engine process's side of ``mambatrt serve``: the HTTP front ends it starts, and the routing between them and the
engine.

The front ends (:mod:`.http`, one process each, ``--api-server-count``) translate HTTP; this process schedules. A
router thread reads the front ends' commands (submit, cancel, scrape) and hands requests to the
:class:`~mambatrt.runtime.engine.Engine`; the engine thread collects each iteration's events per front end and
sends them as one message when the iteration ends (:meth:`ServingHost.flush`), so a front end wakes once per
iteration, not once per token. The wire format is :mod:`.wire`.

A front end that dies has its requests cancelled (their slots are freed) and ends the server: a crash of the HTTP
layer is a bug, and a server that silently lost a process would serve at a fraction of its capacity.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from mambatrt.errors import InputError

from ..engine import Engine, EngineStopped, Event, QueueFull
from ..engine import Request as EngineRequest
from . import wire
from .metrics import Metrics


class FrontEndFailed(Exception):
    """A front-end process exited on its own, or did not start."""


class _FrontEnd:
    """One front-end process as the engine process sees it: its pipes, its live requests, its outbox."""

    def __init__(self, index: int, process, commands, events) -> None:
        self.index, self.process = index, process
        self.commands = commands  # multiprocessing Connection, read by the router thread
        self.events = events  # multiprocessing Connection, written by the engine and router threads
        self.lock = threading.Lock()  # one writer at a time on ``events``
        self.outbox: list[tuple] = []  # this iteration's events (engine thread only)
        self.live: set[int] = set()  # accepted requests that have not ended
        self.ready = False
        self.gone = False  # its command pipe reached EOF (it exited)


class ServingHost:
    """The engine process's side of serving: starts ``count`` front ends on a listening socket, routes their
    requests to ``engine`` and its events back, answers their scrapes, and stops them all on :meth:`shutdown`."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.frontends: list[_FrontEnd] = []
        self.router = threading.Thread(target=self._route, name="mambatrt-router", daemon=True)
        self.closing = threading.Event()
        self.failed: str | None = None  # why serving must end (a front end died), set by the router thread
        self.changed = threading.Event()  # set when ``failed`` is set or a front end becomes ready
        self.stopped_sent = False
        engine.flush = self.flush  # called by the engine thread after each iteration

    def start(
        self,
        sock,
        count: int,
        target: Callable[..., None],
        kwargs: dict[str, Any],
        stop: threading.Event,
        timeout: float = 120.0,
    ) -> None:
        """Spawn ``count`` front ends, each ``target(index, count, sock, commands, events, **kwargs)``, and wait until
        all serve or ``stop`` is set (FrontEndFailed if one exits first, or ``timeout`` passes)."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA and onnxruntime threads
        # the front ends start with SIGINT ignored (an ignored signal stays ignored across exec): Ctrl-C reaches the
        # whole process group, and this process stops them (SIGTERM) once their imports are done or not
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._spawn(ctx, sock, count, target, kwargs)
        finally:
            signal.signal(signal.SIGINT, previous)
        self.router.start()
        deadline = time.monotonic() + timeout
        while not all(f.ready for f in self.frontends) and not stop.is_set():
            if self.failed is not None:
                raise FrontEndFailed(self.failed)
            if time.monotonic() > deadline:
                raise FrontEndFailed(f"the HTTP front ends did not start in {timeout:.0f} s")
            self.changed.wait(0.1)
            self.changed.clear()

    def _spawn(self, ctx, sock, count: int, target: Callable[..., None], kwargs: dict[str, Any]) -> None:
        for index in range(count):
            commands_r, commands_w = ctx.Pipe(duplex=False)
            events_r, events_w = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=target,
                args=(index, count, sock, commands_w, events_r),
                kwargs=kwargs,
                name=f"mambatrt-http-{index}",
                daemon=False,
            )
            process.start()
            commands_w.close()  # the child's ends: closed here, so that its exit reads as EOF
            events_r.close()
            self.frontends.append(_FrontEnd(index, process, commands_r, events_w))

    def wait(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (a signal) or a front end fails (FrontEndFailed)."""
        while not stop.is_set():
            if self.failed is not None:
                raise FrontEndFailed(self.failed)
            stop.wait(0.2)

    def shutdown(self, grace: float = 12.0) -> None:
        """Stop the front ends (SIGTERM: each stops accepting and finishes its requests, 10 s at most), while the
        engine still serves them; then stop the router. Kills a front end that has not exited after ``grace``."""
        self.closing.set()
        for f in self.frontends:
            if f.process.is_alive():
                os.kill(f.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for f in self.frontends:
            f.process.join(max(0.0, deadline - time.monotonic()))
            if f.process.is_alive():
                f.process.kill()
                f.process.join(5)
        if self.router.is_alive():
            self.router.join(2)
        for f in self.frontends:
            with f.lock:
                f.gone = True  # the engine's last events (aborts at its stop) have nobody to go to
                f.events.close()
            f.commands.close()

    # -- engine thread ----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send each front end the events of the iteration that just ended, in one message."""
        for f in self.frontends:
            if not f.outbox:
                continue
            batch = f.outbox.copy()
            f.outbox.clear()
            self._send(f, (wire.EVENTS, batch))

    def _emitter(self, f: _FrontEnd, rid: int) -> Callable[[Event], None]:
        out, live, metrics = f.outbox, f.live, self.metrics

        def emit(e: Event) -> None:  # the fields in the order of wire.EVENT_FIELDS
            fields = (rid, e.token, e.text, e.finish_reason, e.prompt_tokens, e.completion_tokens, e.cached_tokens)
            out.append(fields if e.logprob is None and e.scores is None else (*fields, e.logprob, e.scores))
            if e.finish_reason is not None:  # the request has ended
                live.discard(rid)
                metrics.finished(e)

        return emit

    def _send(self, f: _FrontEnd, message: tuple) -> None:
        if f.gone:
            return
        with f.lock:
            try:
                f.events.send(message)
            except OSError:  # it exited; the router thread sees its EOF and cleans up
                f.gone = True

    # -- router thread ------------------------------------------------------------------------------------------
    def _route(self) -> None:
        by_conn = {f.commands: f for f in self.frontends}
        while by_conn:
            for conn in multiprocessing.connection.wait(list(by_conn), timeout=0.2):
                f = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del by_conn[conn]
                    self._lost(f)
                    continue
                self._handle(f, message)
            if not self.stopped_sent and (self.engine.error is not None or not self.engine.thread.is_alive()):
                self.stopped_sent = True
                for f in self.frontends:
                    self._send(f, (wire.STOPPED, "the engine has stopped"))

    def _lost(self, f: _FrontEnd) -> None:
        """A front end's pipe closed: cancel what it had in flight; unless the server is stopping, serving fails."""
        f.gone = True
        for rid in list(f.live):
            self.engine.cancel(rid)
        if not self.closing.is_set() and self.failed is None:
            code = f.process.exitcode if f.process.exitcode is not None else "unknown"
            self.failed = f"HTTP front end {f.index} exited (code {code}); see the messages above"
            self.changed.set()

    def _handle(self, f: _FrontEnd, message: tuple) -> None:
        kind = message[0]
        if kind == wire.SUBMIT:
            _, rid, prompt, sampling, stop, detokenize, score_from, logprobs = message
            emit = self._emitter(f, rid)
            request = EngineRequest(
                prompt, sampling, emit, stop, id=rid, detokenize=detokenize, score_from=score_from, logprobs=logprobs
            )
            f.live.add(rid)
            try:
                self.engine.submit(request)
            except (QueueFull, EngineStopped, InputError) as exc:
                f.live.discard(rid)
                status, type_, param = _REJECTIONS[type(exc)]
                param = getattr(exc, "param", None) or param  # an InputError may name another field than the prompt
                self._send(f, (wire.REJECTED, rid, status, type_, str(exc), param))
                return
            self.metrics.prompt_tokens.inc(len(prompt))
            self._send(f, (wire.ACCEPTED, rid))
        elif kind == wire.CANCEL:
            self.engine.cancel(message[1])
        elif kind == wire.OBSERVED:
            self.metrics.observed(message[1], message[2])
        elif kind == wire.SCRAPE:
            self.metrics.observed(message[2], message[3])
            self._send(f, (wire.SCRAPED, message[1], self.metrics.render()))
        elif kind == wire.READY:
            f.ready = True
            self.changed.set()
        else:
            raise ValueError(f"unknown message from front end {f.index}: {kind!r}")


_REJECTIONS = {
    QueueFull: (429, "rate_limit_error", None),
    EngineStopped: (503, "server_error", None),
    InputError: (400, "invalid_request_error", "prompt"),  # ids outside the vocabulary
}


def listening_socket(host: str, port: int):
    """A TCP socket bound to host:port (InputError if that cannot be: in use, or not this machine's address), not
    listening yet: bound before the engine loads, so a taken port is reported at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses ("localhost": 127.0.0.1)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # socket.gaierror too: a name that is not an address
        sock.close()
        raise InputError(
            f"could not listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host"
        ) from None
    sock.set_inheritable(True)
    return sock
