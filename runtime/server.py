"""``mambatrt serve``: an OpenAI-compatible HTTP server over the continuous-batching :class:`Engine`.

FastAPI + uvicorn for HTTP, prometheus-client for ``/metrics``; the protocol is typed (pydantic models) and every
error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. The server only translates: requests
become :class:`~mambatrt.runtime.engine.Request` objects, the engine's events become responses or server-sent
events. Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client) besides numpy and onnxruntime.

Endpoints: POST /v1/completions (stream or not), GET /v1/models, GET /health, GET /metrics; POST
/v1/chat/completions answers 404 (bundles carry no chat template).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from mambatrt.errors import InputError
from mambatrt.runtime.engine import Engine, EngineStopped, Event, QueueFull
from mambatrt.runtime.engine import Request as EngineRequest
from mambatrt.runtime.generate import MIN_TEMPERATURE, Sampling
from mambatrt.runtime.tokenizer import Tokenizer

MAX_PROMPT_TOKENS = 1_000_000  # a Mamba prompt has no context limit; this only bounds a typo


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions: OpenAI's fields, plus vLLM's ``top_k``, ``ignore_eos`` and ``return_token_ids``."""

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
    n: int = Field(1, ge=1, le=1)
    echo: Literal[False] = False
    logprobs: None = None
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


class Metrics:
    """The Prometheus metrics of one server (a registry of its own, so tests can start several)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("mambatrt_num_requests_running", "Sequences in decode slots", registry=r)
        self.waiting = Gauge("mambatrt_num_requests_waiting", "Requests queued or prefilling", registry=r)
        self.prompt_tokens = Counter("mambatrt_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            "mambatrt_cached_prompt_tokens", "Prompt tokens served from the state cache", registry=r
        )
        self.generation_tokens = Counter("mambatrt_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("mambatrt_requests", "Finished requests", ["finish_reason"], registry=r)
        buckets = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
        self.ttft = Histogram(
            "mambatrt_time_to_first_token_seconds", "Time to first token", buckets=buckets, registry=r
        )
        self.itl = Histogram("mambatrt_inter_token_latency_seconds", "Time between tokens", buckets=buckets, registry=r)
        self.engine = engine
        r.register(_EngineTotals(engine))

    def render(self) -> bytes:
        stats = self.engine.stats()
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        return generate_latest(self.registry)


class _EngineTotals:
    """The engine's counters since its start, read at each scrape: where its time goes (prefill against decode: the
    GPU's share of each, with their host work) and how many prompt rows each prefill launch carried."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        t = self.engine.stats()
        busy = CounterMetricFamily(
            "mambatrt_engine_busy_seconds", "Engine time in prefill and decode (launches, host work)", labels=["phase"]
        )
        busy.add_metric(["prefill"], t["prefill_seconds"])
        busy.add_metric(["decode"], t["decode_seconds"])
        yield busy
        yield CounterMetricFamily("mambatrt_engine_iterations", "Engine iterations", value=t["iterations"])
        yield CounterMetricFamily("mambatrt_prefill_launches", "Prefill launches", value=t["prefill_launches"])
        yield CounterMetricFamily("mambatrt_prefill_rows", "Prompt rows prefilled", value=t["prefill_rows"])


def _sampling(req: CompletionRequest) -> Sampling:
    if 0 < req.temperature < MIN_TEMPERATURE:
        raise _bad_request(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}", "temperature")
    return Sampling(
        max_new_tokens=req.max_tokens,
        temperature=req.temperature,
        top_k=max(req.top_k, 0),
        top_p=req.top_p,
        seed=req.seed,
        stop_on_eos=not req.ignore_eos,
    )


def create_app(engine: Engine, tokenizer: Tokenizer | None, model_name: str) -> FastAPI:
    """The FastAPI application over a started engine."""
    app = FastAPI(title="mambatrt", docs_url=None, redoc_url=None)
    metrics = Metrics(engine)
    created = int(time.time())
    mailboxes: list[_Mailbox] = []  # one, made on the first request (it needs the running loop)

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
        if engine.error is not None or not engine.thread.is_alive():
            raise OpenAIError(503, "the engine has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "mambatrt"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

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
        events: asyncio.Queue[Event] = asyncio.Queue()
        if not mailboxes:
            mailboxes.append(_Mailbox(asyncio.get_running_loop()))
        request = EngineRequest(prompt, _sampling(body), _deliver(mailboxes[0], events), tuple(s for s in stop if s))
        try:
            engine.submit(request)
        except QueueFull as exc:
            raise OpenAIError(429, str(exc), "rate_limit_error") from None
        except EngineStopped as exc:
            raise OpenAIError(503, str(exc), "server_error") from None
        except InputError as exc:
            raise _bad_request(str(exc), "prompt") from None
        start = time.perf_counter()
        metrics.prompt_tokens.inc(len(prompt))
        ident = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                _stream(engine, request, events, body, ident, model_name, prompt, metrics, start),
                media_type="text/event-stream",
            )
        return await _complete(engine, request, events, body, ident, model_name, prompt, metrics, start, http)

    return app


class _Mailbox:
    """Events from the engine thread to the requests' queues, with one wake-up of the event loop per batch.

    One engine iteration emits a token for every running sequence; waking the loop once per token (a write to its
    self-pipe each) costs more than the token's own work at high concurrency, so events are queued here and the
    first one of a batch schedules a single flush.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque[tuple[asyncio.Queue, Event]] = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def post(self, events: asyncio.Queue, event: Event) -> None:
        with self.lock:
            self.items.append((events, event))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening any more
            pass

    def _flush(self) -> None:
        with self.lock:
            items, self.items = self.items, collections.deque()
            self.scheduled = False
        for events, event in items:
            events.put_nowait(event)


def _deliver(mailbox: _Mailbox, events: asyncio.Queue) -> Callable[[Event], None]:
    """The engine thread's way to hand an event to this request's coroutine."""
    return lambda event: mailbox.post(events, event)


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


def _usage(event: Event) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


class _Timing:
    """TTFT and inter-token latency of one request, into the metrics."""

    def __init__(self, metrics: Metrics, start: float) -> None:
        self.metrics, self.last, self.first = metrics, start, True

    def token(self) -> None:
        now = time.perf_counter()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
        self.first, self.last = False, now

    def done(self, event: Event) -> None:
        self.metrics.generation_tokens.inc(event.completion_tokens)
        self.metrics.cached_tokens.inc(event.cached_tokens)
        self.metrics.requests.labels(event.finish_reason or "abort").inc()


async def _complete(engine, request, events, body, ident, model_name, prompt, metrics, start, http):
    """A whole completion: wait for the final event, freeing the slot if the client goes away."""
    text, tokens, timing = [], [], _Timing(metrics, start)
    while True:
        try:
            event = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                engine.cancel(request.id)
                return Response(status_code=499)
            continue
        if event.token is not None:
            tokens.append(event.token)
            timing.token()
        text.append(event.text)
        if event.finish_reason is not None:
            break
    timing.done(event)
    if event.finish_reason == "abort":
        raise OpenAIError(503, "the server is shutting down; the request was not finished", "server_error")
    choice = {"index": 0, "text": "".join(text), "finish_reason": event.finish_reason, "logprobs": None}
    out = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model_name}
    if body.return_token_ids:
        choice["token_ids"] = tokens
        out["prompt_token_ids"] = prompt
    return {**out, "choices": [choice], "usage": _usage(event)}


async def _stream(engine, request, events, body, ident, model_name, prompt, metrics, start):
    """Server-sent events: one chunk per new text, the finish reason, usage when asked, then [DONE].

    A client that disconnects cancels the generator (Starlette raises into it): the request is cancelled and its
    slot freed within one engine iteration.
    """
    head = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model_name}
    timing, done = _Timing(metrics, start), False
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
        timing.done(event)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(event)})
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            engine.cancel(request.id)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
