"""``mambatrt serve``'s HTTP front end: an OpenAI-compatible API over the engine process.

FastAPI + uvicorn for HTTP; the protocol is typed (pydantic models) and every error has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. A front end runs in a process of its own (``serve`` starts
``--api-server-count`` of them on one listening socket) and only translates: requests go to the engine process
(:mod:`.host`) over a pipe, the engine's events come back once per iteration and become responses or server-sent
events (:mod:`.completions`, :mod:`.chat`). It needs the ``serve`` extra (fastapi, uvicorn, prometheus-client,
jinja2) and the bundle's tokenizer, never onnxruntime.

Endpoints: POST /v1/completions and /v1/chat/completions (stream or not; chat where the server has a chat
template), GET /v1/models, POST /tokenize, /detokenize and GET /tokenizer_info (vLLM's, which lm-eval's remote
tokenizer reads), GET /health, GET /metrics (rendered by the engine process, with the latencies each front end
measured). With an API key, /v1/* and the tokenizer's endpoints need it as a bearer token; /health and /metrics stay
open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..tokenizer import Tokenizer
from .chat import ChatRequest, ChatTemplate, chat_completion
from .client import SHUTDOWN_ABORT_S, EngineClient, EngineGone
from .completions import Completion, choices_of, stream_completion, whole_completion
from .protocol import (
    IGNORED_FIELDS,
    MAX_CHOICES,
    MAX_PROMPT_TOKENS,
    CompletionRequest,
    OpenAIError,
    bad_request,
    check_logprobs,
    check_request,
    prompts_of,
    sampling_of,
)

DRAIN_POLL_S = 0.05
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # guarded by the API key as /v1/* is
Body = TypeVar("Body", bound=BaseModel)
NOT_AN_OBJECT = "the request body is not a JSON object: send one, with Content-Type: application/json"


@dataclass
class FrontEnd:
    """What a front end serves with: the engine client, the tokenizer, the model's name and vocabulary, the API key
    and chat template (or None), and whether it drains (SIGTERM: new requests get 503 while those in flight
    finish)."""

    client: EngineClient
    tokenizer: Tokenizer | None
    model_name: str
    vocab: int
    eos_id: int | None = None
    api_key: str | None = None
    chat_template: ChatTemplate | None = None
    draining: bool = False


def create_app(front: FrontEnd, on_drained=None) -> FastAPI:
    """The FastAPI application of one front end; its client attaches to the event loop when the app starts.
    ``on_drained()``: called once a drain has ended (the requests in flight finished, or were aborted
    SHUTDOWN_ABORT_S after it began): the server may close its listener and exit."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        front.client.attach(asyncio.get_running_loop())
        watcher = asyncio.create_task(_drain(front, on_drained)) if on_drained is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        front.client.detach()

    app = FastAPI(title="mambatrt", docs_url=None, redoc_url=None, lifespan=lifespan)
    _answer_errors(app)
    _add_routes(app, front)
    app.add_middleware(Gate, front=front)
    return app


async def _drain(front: FrontEnd, on_drained) -> None:
    """Once the front end drains: wait for its requests in flight, abort those still running after
    SHUTDOWN_ABORT_S (each ends with the engine's "abort" event: a stream ends with that finish reason and [DONE],
    a whole request gets a 503), then call ``on_drained``."""
    loop = asyncio.get_running_loop()
    while not front.draining:
        await asyncio.sleep(DRAIN_POLL_S)
    deadline = loop.time() + SHUTDOWN_ABORT_S
    while front.client.busy() and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if front.client.busy():
        front.client.abort_all()
        deadline = loop.time() + 1.0
        while front.client.busy() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
    on_drained()


class Gate:
    """ASGI middleware before every route: 503 while the front end drains, 401 without the API key (where one is
    set) on the routes it guards. Plain ASGI, not Starlette's BaseHTTPMiddleware, which would wrap every
    streamed response."""

    def __init__(self, app, front: FrontEnd) -> None:
        self.app, self.front = app, front
        self.expected = f"Bearer {front.api_key}".encode() if front.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> OpenAIError | None:
        if self.front.draining:
            return OpenAIError(503, "the server is shutting down", "server_error", headers={"Retry-After": "5"})
        path = scope["path"]
        if self.expected is None or not (path.startswith("/v1/") or path in TOKENIZER_PATHS):
            return None
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return None
        return OpenAIError(
            401,
            "a valid API key is required: send the header 'Authorization: Bearer KEY'",
            "invalid_request_error",
            code="invalid_api_key",
        )


def _answer_errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, the request's validation, HTTP's own (404, 405), and bugs."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's, for bytes
            return bad_request("the request body is not JSON in UTF-8").response()  # that are not UTF-8
        return OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception):  # never a stack trace to the client; the log has it
        return OpenAIError(500, f"internal error ({type(exc).__name__})", "server_error").response()


def _validation_error(errors: list) -> OpenAIError:
    """The first of pydantic's errors as one line naming the field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its location is a character offset, not a field
        return bad_request("the request body is not valid JSON")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if where is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return bad_request(NOT_AN_OBJECT)
    if first.get("type") == "extra_forbidden":
        return bad_request(
            f"unknown field '{where}': this server takes OpenAI's fields (of which it ignores "
            f"{', '.join(IGNORED_FIELDS)}) and vLLM's top_k, ignore_eos and return_token_ids",
            where,
        )
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
    return bad_request(message, where)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def _add_routes(app: FastAPI, front: FrontEnd) -> None:
    created = int(time.time())
    client, tokenizer, name = front.client, front.tokenizer, front.model_name

    @app.get("/health")
    async def health():
        if client.stopped is not None:
            raise EngineGone(client.stopped)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "mambatrt"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(await client.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(front, body.model)
        tokens = _tokenizer(front).encode(body.prompt)
        return {"count": len(tokens), "tokens": tokens}

    @app.get("/tokenizer_info")
    async def tokenizer_info():  # vLLM's: lm-eval's remote tokenizer reads it (and then /tokenize, /detokenize)
        tok = _tokenizer(front)
        template = front.chat_template
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": None if front.eos_id is None else tok.token_text(front.eos_id),
            "bos_token": None,
            "pad_token": None,
            "chat_template": None if template is None else template.source,
            "model_max_length": MAX_PROMPT_TOKENS,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(front, body.model)
        if any(not 0 <= t < front.vocab for t in body.tokens):
            raise bad_request(f"token ids must lie in the vocabulary [0, {front.vocab})", "tokens")
        return {"prompt": _tokenizer(front).decode(body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        if front.chat_template is None:
            raise OpenAIError(
                404,
                "this server has no chat template (the bundle's tokenizer has none): start it with "
                "--chat-template FILE, or use /v1/completions",
                "invalid_request_error",
            )
        _check_model(front, body.model)
        return await chat_completion(front, body, http)

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await read_body(http, CompletionRequest)
        _check_model(front, body.model)
        check_request(body)
        prompts = prompts_of(body.prompt, tokenizer, front.vocab)
        body = body.model_copy(update={"prompt": ""})  # the prompts' ids (int32) are all that stays
        if len(prompts) * body.n > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n {body.n} is more than {MAX_CHOICES} choices", "n")
        check_logprobs(body, prompts)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if stop and tokenizer is None:
            raise bad_request("stop strings need a tokenizer; this bundle has none", "stop")
        samplings = [sampling_of(body, j) for j in range(body.n)]  # checked before any is submitted
        completion = Completion(client, choices_of(body, prompts, tokenizer, keep=not body.stream))
        await completion.submit(samplings.__getitem__, tuple(s for s in stop if s))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = name
        if body.stream:
            return StreamingResponse(stream_completion(completion, body, head), media_type="text/event-stream")
        return await whole_completion(completion, body, head, http)


async def read_body(http: Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``, read here rather than by FastAPI, whose handler keeps the body's bytes
    and its parsed JSON for the whole request: ~50 bytes a token of a prompt sent as token ids, while a
    non-streamed answer is generated. Here both go once the model is built, and the handler keeps the prompt's ids
    (4 bytes a token)."""
    raw = b"".join([chunk async for chunk in http.stream()])
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not JSON in UTF-8") from None
    except json.JSONDecodeError:
        if "json" not in http.headers.get("content-type", ""):  # curl -d sends a form
            raise bad_request(NOT_AN_OBJECT) from None
        raise bad_request("the request body is not valid JSON") from None
    del raw
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _check_model(front: FrontEnd, model: str | None) -> None:
    if model is not None and model != front.model_name:
        raise OpenAIError(
            404,
            f"model '{model}' does not exist; this server has '{front.model_name}'",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _tokenizer(front: FrontEnd) -> Tokenizer:
    if front.tokenizer is None:
        raise OpenAIError(404, "this bundle has no tokenizer", "invalid_request_error")
    return front.tokenizer
