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
import json
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..tokenizer import Tokenizer
from .client import SERVE_KEEP_ALIVE_S, SHUTDOWN_GRACE_S, EngineClient, EngineGone
from .protocol import CompletionRequest, OpenAIError, bad_request, prompt_ids, sampling_of, usage


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
    _answer_errors(app)
    _add_routes(app, client, tokenizer, model_name)
    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, the request's validation, HTTP's own (404, 405), and bugs."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            return bad_request("the request body is not valid JSON").response()
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
        return bad_request(message, where).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception):  # never a stack trace to the client; the log has it
        return OpenAIError(500, f"internal error ({type(exc).__name__})", "server_error").response()


def _add_routes(app: FastAPI, client: EngineClient, tokenizer: Tokenizer | None, model_name: str) -> None:
    created = int(time.time())

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
        prompt = prompt_ids(body.prompt, tokenizer)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if stop and tokenizer is None:
            raise bad_request("stop strings need a tokenizer; this bundle has none", "stop")
        start = time.perf_counter()
        rid, events = await client.submit(prompt, sampling_of(body), tuple(s for s in stop if s))
        ident = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                _stream(client, rid, events, body, ident, model_name, prompt, start), media_type="text/event-stream"
            )
        return await _complete(client, rid, events, body, ident, model_name, prompt, start, http)


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
    return {**out, "choices": [choice], "usage": usage(event)}


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
            yield _sse({**head, "choices": [], "usage": usage(event)})
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
