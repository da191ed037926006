"""``mambatrt serve``'s HTTP front end: an OpenAI-compatible API over the engine process.

FastAPI + uvicorn for HTTP; the protocol is typed (pydantic models) and every error has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. A front end runs in a process of its own (``serve`` starts
``--api-server-count`` of them on one listening socket) and only translates: requests go to the engine process
(:mod:`.host`) over a pipe, the engine's events come back once per iteration and become responses or server-sent
events (:mod:`.wire`). It needs the ``serve`` extra (fastapi, uvicorn,
prometheus-client) and the bundle's tokenizer, never onnxruntime.

Endpoints: POST /v1/completions (stream or not), GET /v1/models, GET /health, GET /metrics (rendered by the engine
process, with the latencies each front end measured); POST /v1/chat/completions answers 404 (bundles carry no chat
template).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.sampling import MIN_TEMPERATURE, Sampling, token_id_key
from ..tokenizer import Tokenizer
from . import wire
from .wire import WireEvent

MAX_PROMPT_TOKENS = 1_000_000  # a Mamba prompt has no context limit; this only bounds a typo


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions: OpenAI's fields, plus vLLM's ``top_k``, ``ignore_eos`` and ``return_token_ids``. Fields
    that would change the answer and are not implemented (``n`` > 1, ``best_of`` > 1, ``echo``, ``logprobs``,
    ``suffix``) are refused, not ignored; other unknown fields (``user``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int = Field(16, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: no top-k cut
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit, in [-100, 100]
    n: int = Field(1, ge=1, le=1)
    best_of: int | None = Field(None, ge=1, le=1)
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class OpenAIError(Exception):
    """An error answered with OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def _sampling(req: CompletionRequest) -> Sampling:
    if 0 < req.temperature < MIN_TEMPERATURE:
        raise _bad_request(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}", "temperature")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        token = token_id_key(key)
        if token is None:
            raise _bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
        if not -100 <= value <= 100:  # False for NaN too
            raise _bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        bias.append((token, float(value)))
    if len({t for t, _ in bias}) != len(bias):
        raise _bad_request("logit_bias names a token id twice", "logit_bias")
    return Sampling(
        max_new_tokens=req.max_tokens,
        temperature=req.temperature,
        top_k=max(req.top_k, 0),
        top_p=req.top_p,
        seed=req.seed,
        stop_on_eos=not req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=tuple(sorted(bias)),
    )


# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals httpx's pool expiry, so a client
# can send on a connection in the moment the server closes it (httpx: ReadError, seen once in 512 requests at
# concurrency 128). Longer than clients' and load balancers' own idle timeouts (60 s is common), they close first.
SERVE_KEEP_ALIVE_S = 75
# On SIGTERM a front end stops accepting and lets its requests finish for up to SHUTDOWN_GRACE_S (uvicorn's
# graceful shutdown), but cancels those still running after SHUTDOWN_ABORT_S: the engine ends each with an "abort"
# event, so a stream ends with that finish reason and [DONE] (a plain request gets a 503), where uvicorn's deadline
# would cut the connection mid-stream and log the cancelled task's traceback
SHUTDOWN_GRACE_S = 10
SHUTDOWN_ABORT_S = 8
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

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading events on ``loop`` and tell the engine process this front end serves."""
        self.loop = loop
        loop.add_reader(self.events.fileno(), self._readable)
        self.ticker = loop.create_task(self._send_observed())
        self._send((wire.READY,))

    def detach(self) -> None:
        if self.loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.events.fileno())
        if self.ticker is not None:
            self.ticker.cancel()

    async def submit(self, prompt: list[int], sampling: Sampling, stop: tuple[str, ...]):
        """(request id, its event queue) once the engine accepted it; OpenAIError (429, 400, 503) if it did not."""
        if self.stopped is not None:
            raise EngineGone(self.stopped)
        rid = next(self.ids)
        events = self.queues[rid] = asyncio.Queue()  # events can arrive before the answer (which the router
        # thread sends after the engine thread may have run an iteration): a short request may even have ended
        answer = self.answers[rid] = self.loop.create_future()
        here = self.tokenizer is not None and not stop
        if here:
            self.decoders[rid] = self.tokenizer.stream()
        self._send((wire.SUBMIT, rid, prompt, sampling, stop, not here))
        try:
            await answer
        except OpenAIError:
            self.queues.pop(rid, None)
            self.decoders.pop(rid, None)
            raise
        except asyncio.CancelledError:  # the client left before the engine answered
            self.cancel(rid)
            raise
        return rid, events

    def abort_all(self) -> None:
        """Cancel every request in flight in the engine, keeping their queues: each ends with the engine's "abort"
        event (shutdown's deadline, SHUTDOWN_ABORT_S)."""
        if self.stopped is None:
            for rid in list(self.queues):
                self._send((wire.CANCEL, rid))

    async def abort_at_exit(self, exiting: Callable[[], bool]) -> None:
        """Once ``exiting()`` (uvicorn asked to stop), wait SHUTDOWN_ABORT_S, then :meth:`abort_all`."""
        while not exiting():
            await asyncio.sleep(0.1)
        await asyncio.sleep(SHUTDOWN_ABORT_S)
        self.abort_all()

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
        while True:
            await asyncio.sleep(OBSERVED_EVERY_S)
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
                event = WireEvent._make(fields)
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
                answer.set_exception(OpenAIError(status, text, type_, param))
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


def create_app(
    client: EngineClient, tokenizer: Tokenizer | None, model_name: str, exiting: Callable[[], bool] | None = None
) -> FastAPI:
    """The FastAPI application of one front end; ``client`` attaches to the event loop when the app starts;
    ``exiting``: whether the server was asked to stop (then the requests still running after SHUTDOWN_ABORT_S are
    aborted: :meth:`EngineClient.abort_at_exit`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        client.attach(asyncio.get_running_loop())
        watcher = asyncio.create_task(client.abort_at_exit(exiting)) if exiting is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        client.detach()

    app = FastAPI(title="mambatrt", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            return _bad_request("the request body is not valid JSON").response()
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
        return _bad_request(message, where).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception):  # never a stack trace to the client; the log has it
        return OpenAIError(500, f"internal error ({type(exc).__name__})", "server_error").response()

    @app.get("/health")
    async def health():
        if client.stopped is not None:
            raise EngineGone(client.stopped)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "mambatrt"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(await client.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat():
        raise OpenAIError(404, "this bundle has no chat template: use /v1/completions", "invalid_request_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        if body.model is not None and body.model != model_name:
            raise OpenAIError(
                404,
                f"model '{body.model}' does not exist; this server has '{model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        prompt = _prompt_ids(body.prompt, tokenizer)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if stop and tokenizer is None:
            raise _bad_request("stop strings need a tokenizer; this bundle has none", "stop")
        start = time.perf_counter()
        rid, events = await client.submit(prompt, _sampling(body), tuple(s for s in stop if s))
        ident = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                _stream(client, rid, events, body, ident, model_name, prompt, start), media_type="text/event-stream"
            )
        return await _complete(client, rid, events, body, ident, model_name, prompt, start, http)

    return app


def _prompt_ids(prompt: Any, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one text prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise _bad_request("this bundle has no tokenizer: send the prompt as a list of token ids", "prompt")
        ids = tokenizer.encode(prompt)
    elif prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise _bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise _bad_request("the prompt is empty", "prompt")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise _bad_request(f"the prompt has {len(ids)} tokens, more than {MAX_PROMPT_TOKENS}", "prompt")
    return ids


def _usage(event: WireEvent) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


class _Timing:
    """TTFT and inter-token latency of one request as its client sees them, for the server's metrics."""

    def __init__(self, client: EngineClient, start: float) -> None:
        self.client, self.last, self.first = client, start, True

    def token(self) -> None:
        now = time.perf_counter()
        self.client.token(now - self.last, self.first)
        self.first, self.last = False, now


async def _complete(client, rid, events, body, ident, model_name, prompt, start, http):
    """A whole completion: wait for the final event, freeing the slot if the client goes away."""
    text, tokens, timing = [], [], _Timing(client, start)
    while True:
        try:
            event = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                client.cancel(rid)
                return Response(status_code=499)
            continue
        if event.token is not None:
            tokens.append(event.token)
            timing.token()
        text.append(event.text)
        if event.finish_reason is not None:
            break
    if event.finish_reason == "abort":
        raise OpenAIError(503, "the server is shutting down; the request was not finished", "server_error")
    choice = {"index": 0, "text": "".join(text), "finish_reason": event.finish_reason, "logprobs": None}
    out = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model_name}
    if body.return_token_ids:
        choice["token_ids"] = tokens
        out["prompt_token_ids"] = prompt
    return {**out, "choices": [choice], "usage": _usage(event)}


async def _stream(client, rid, events, body, ident, model_name, prompt, start):
    """Server-sent events: one chunk per new text, the finish reason, usage when asked, then [DONE].

    A client that disconnects cancels the generator (Starlette raises into it): the request is cancelled and its
    slot freed within one engine iteration.
    """
    head = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model_name}
    timing, done = _Timing(client, start), False
    try:
        if body.return_token_ids:
            yield _sse({**head, "choices": [], "prompt_token_ids": prompt})
        while True:
            event = await events.get()
            if event.token is not None:
                timing.token()
            choice = {"index": 0, "text": event.text, "finish_reason": event.finish_reason, "logprobs": None}
            if body.return_token_ids:
                choice["token_ids"] = [] if event.token is None else [event.token]
            if event.text or event.finish_reason is not None or body.return_token_ids:
                yield _sse({**head, "choices": [choice]})
            if event.finish_reason is not None:
                break
        done = True
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(event)})
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            client.cancel(rid)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def frontend_main(
    index: int,
    count: int,
    sock,
    commands,
    events,
    bundle_dir: str,
    model_name: str,
) -> None:
    """A front-end process (``multiprocessing`` spawn target): uvicorn on the engine process's listening socket
    until SIGTERM/SIGINT (finishing its requests; those still running after SHUTDOWN_ABORT_S end aborted) or until
    the engine process goes away."""
    import signal

    import uvicorn

    from ..bundle import load_bundle

    bundle = load_bundle(bundle_dir, verify=False)  # the engine process verified it
    tokenizer = Tokenizer(bundle) if bundle.tokenizer_path else None
    client = EngineClient(index, count, commands, events, tokenizer)
    server: uvicorn.Server | None = None
    config = uvicorn.Config(
        create_app(client, tokenizer, model_name, lambda: server is not None and server.should_exit),
        log_level="warning",
        timeout_keep_alive=SERVE_KEEP_ALIVE_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    client.on_lost = lambda: setattr(server, "should_exit", True)
    # A stop asked before uvicorn takes the signals (while it starts) ends it as soon as it runs; uvicorn raises the
    # signals it caught again once it has stopped, which lands here too, so that a requested stop exits 0. (SIGINT
    # was ignored from this process's start, as the engine process spawned it: Ctrl-C during the imports above
    # prints no traceback; the engine process answers it by sending SIGTERM.)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
