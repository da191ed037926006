"""The OpenAI completions protocol as the HTTP front ends speak it: the typed request, the errors in OpenAI's shape,
and their translation into the engine's terms (sampling options, prompt ids, usage)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import MIN_TEMPERATURE, Sampling, token_id_key
from ..tokenizer import Tokenizer
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


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def sampling_of(req: CompletionRequest) -> Sampling:
    if 0 < req.temperature < MIN_TEMPERATURE:
        raise bad_request(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}", "temperature")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        token = token_id_key(key)
        if token is None:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
        if not -100 <= value <= 100:  # False for NaN too
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        bias.append((token, float(value)))
    if len({t for t, _ in bias}) != len(bias):
        raise bad_request("logit_bias names a token id twice", "logit_bias")
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


def prompt_ids(prompt: Any, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one text prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad_request("this bundle has no tokenizer: send the prompt as a list of token ids", "prompt")
        ids = tokenizer.encode(prompt)
    elif prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise bad_request(f"the prompt has {len(ids)} tokens, more than {MAX_PROMPT_TOKENS}", "prompt")
    return ids


def usage(event: WireEvent) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }
