"""``/v1/chat/completions``: the messages rendered into a prompt by a Jinja chat template (as transformers and vLLM
render one), then completed as ``/v1/completions`` completes a prompt, answered in the chat shape.

The template is ``serve --chat-template FILE``, else the one the bundle's ``tokenizer_config.json`` carries (copied
from the checkpoint); without either the endpoint answers 404. It is rendered in Jinja's sandbox with what
transformers gives a template: ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception`` and ``strftime_now``; its text is tokenized without special tokens added (the template writes
them).
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mambatrt.errors import InputError
from mambatrt.manifest import TOKENIZER_CONFIG

from ..bundle import Bundle
from ..engine.sampling import Sampling
from .completions import ClientGone, Completion, Piece, completion_usage, shutting_down, sse
from .protocol import MAX_CHOICES, MAX_NEW_TOKENS, CompletionRequest, bad_request, prompts_of, sampling_of


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as they are

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    """POST /v1/chat/completions: OpenAI's chat fields that apply to a text model, vLLM's ``top_k``, ``ignore_eos``
    and ``add_generation_prompt``; ``logprobs`` and tools are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    logprobs: bool = False
    user: str | None = None
    ignore_eos: bool = False
    add_generation_prompt: bool = True


DEFAULT_CHAT_MAX_TOKENS = 256  # a reply's length when the request names none


class ChatTemplate:
    """A Jinja chat template, compiled once in Jinja's sandbox."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InputError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
        self.bos_token, self.eos_token = bos_token, eos_token
        self.source = source  # served by /tokenizer_info

    @classmethod
    def load(cls, path: str | None, bundle: Bundle) -> ChatTemplate | None:
        """The template of ``path`` (a Jinja file), else the bundle's tokenizer's, else None."""
        config = _tokenizer_config(bundle)
        tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        if path is not None:
            try:
                source = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"{path}: cannot read the chat template ({exc})") from None
            return cls(source, **tokens)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        return cls(source, **tokens) if isinstance(source, str) else None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The prompt text of ``messages``; a template's own error (raise_exception) is the request's 400."""
        import jinja2

        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None


def _tokenizer_config(bundle: Bundle) -> dict:
    path = bundle.path / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an object with its "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _message(m: ChatMessage) -> dict:
    """A message as the template sees it: its content as text (the text parts of a list of parts, joined)."""
    out = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        if any(part.get("type") != "text" for part in m.content):
            raise bad_request("only text content parts are supported", "messages")
        out["content"] = "".join(str(part.get("text", "")) for part in m.content)
    return out


def completion_request(body: ChatRequest, prompt: str) -> CompletionRequest:
    """The completion of the rendered prompt that answers chat request ``body``."""
    if body.logprobs:
        raise bad_request("logprobs on chat completions are not implemented; use /v1/completions", "logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    fields = body.model_dump(
        include={"temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty"}
        | {"logit_bias", "n", "ignore_eos"}
    )
    return CompletionRequest(prompt=prompt, max_tokens=max_tokens, **fields)


async def chat_completion(front, body: ChatRequest, http):
    """Answer a chat request (``front``: the front end, :class:`~.http.FrontEnd`)."""
    from fastapi.responses import Response, StreamingResponse

    from .completions import choices_of

    if front.tokenizer is None:
        raise bad_request("chat needs the bundle's tokenizer; this bundle has none")
    prompt = front.chat_template.render([_message(m) for m in body.messages], body.add_generation_prompt)
    request = completion_request(body, prompt)
    prompts = prompts_of(prompt, front.tokenizer, front.vocab)
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(s for s in request.stop or () if s)
    samplings: list[Sampling] = [sampling_of(request, j) for j in range(request.n)]
    completion = Completion(front.client, choices_of(request, prompts, front.tokenizer, keep=not body.stream))
    await completion.submit(samplings.__getitem__, stop)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": front.model_name}
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(completion, head, usage), media_type="text/event-stream")
    try:
        async for _ in completion.pieces(http.is_disconnected):
            pass
    except ClientGone:
        return Response(status_code=499)
    if completion.aborted():
        raise shutting_down()
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": None,
            "finish_reason": c.end.finish_reason,
        }
        for c in completion.choices
    ]
    return {**head, "object": "chat.completion", "choices": choices, "usage": completion_usage(completion)}


async def _stream(completion: Completion, head: dict, include_usage: bool):
    """chat.completion.chunk events: each choice's role first, then its content as it comes, its finish reason,
    the usage when asked, then [DONE]."""
    head = {**head, "object": "chat.completion.chunk"}
    done = False
    try:
        for choice in completion.choices:
            delta = {"role": "assistant", "content": ""}
            yield sse({**head, "choices": [{"index": choice.index, "delta": delta, "finish_reason": None}]})
        async for piece in completion.pieces():
            chunk = _chunk(piece)
            if chunk is not None:
                yield sse({**head, "choices": [chunk]})
        done = True
        if include_usage:
            yield sse({**head, "choices": [], "usage": completion_usage(completion)})
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            completion.cancel()


def _chunk(piece: Piece) -> dict | None:
    if not piece.text and piece.finish_reason is None:
        return None
    delta = {"content": piece.text} if piece.text else {}
    return {"index": piece.index, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}
