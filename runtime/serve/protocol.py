"""The OpenAI completions protocol as the HTTP front ends speak it: the typed request, the errors in OpenAI's shape,
and their translation into the engine's terms (sampling options, prompt ids, usage)."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import MAX_LOGPROBS, MIN_TEMPERATURE, Sampling, token_id_key
from ..tokenizer import Tokenizer

# A Mamba prompt has no context limit, and the engine prefills it in chunks into a state of fixed size: a prompt
# costs 8 bytes a token while it waits and runs (its int32 ids in the engine and in the front end; docs/serving.md,
# "Memory"). These bound what one request can hold.
MAX_PROMPT_TOKENS = 1_000_000
MAX_NEW_TOKENS = 1_000_000
MAX_CHOICES = 64  # prompts x n of one request: each is a sequence of its own in the engine
# Log-probabilities a request holds until its answer goes out (a prompt's scores, or a whole response's tokens), each
# token counting 1 + its ``logprobs`` alternatives: ~0.65 KB apiece between the engine and the front end (measured:
# memory.LOGPROB_BYTES), so one request holds at most ~85 MB of them. 65,536 scored tokens with logprobs 1 (lm-eval's),
# 6,241 with 20.
MAX_LOGPROB_ENTRIES = 2**17
IGNORED_FIELDS = ("user",)  # OpenAI fields accepted and unused (the end user's id); any other unknown field is a 400


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions: OpenAI's fields, plus vLLM's ``top_k``, ``ignore_eos`` and ``return_token_ids``.
    ``best_of`` other than ``n`` and ``suffix`` are refused, not ignored; ``user`` is accepted and unused; any other
    field is refused with its name."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # 0 or -1: no top-k cut
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit, in [-100, 100]
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class OpenAIError(Exception):
    """An error answered with OpenAI's JSON shape (and its HTTP headers, e.g. Retry-After on a 429)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def check_request(req: CompletionRequest) -> None:
    """What pydantic's types cannot say: the combinations of fields."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 unless echo is true (which scores the prompt)", "max_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not implemented; ask for n completions", "best_of")


def check_logprobs(req: CompletionRequest, prompts: list[tuple[np.ndarray, str | None]]) -> None:
    """The log-probabilities a request holds until its answer goes out, within MAX_LOGPROB_ENTRIES: its prompts'
    scores (echo), and for a whole (not streamed) response its tokens' too."""
    if req.logprobs is None:
        return
    held = max(len(ids) for ids, _ in prompts) if req.echo else 0
    held += 0 if req.stream else req.max_tokens
    if held * (1 + req.logprobs) > MAX_LOGPROB_ENTRIES:
        raise bad_request(
            f"logprobs {req.logprobs} over {held} tokens (the echoed prompt, and max_tokens unless streamed) is "
            f"{held * (1 + req.logprobs)} log-probabilities, more than {MAX_LOGPROB_ENTRIES} a request: send fewer "
            "tokens or a smaller logprobs, or stream",
            "logprobs",
        )


def sampling_of(req: CompletionRequest, index: int = 0) -> Sampling:
    """The engine's sampling options of choice ``index`` of ``req`` (a seed s gives choice j the seed s + j: the
    ``n`` completions are independent, and the same on every call)."""
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
        seed=None if req.seed is None else (req.seed + index) % 2**63,
        stop_on_eos=not req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=tuple(sorted(bias)),
    )


def prompts_of(prompt: Any, tokenizer: Tokenizer | None, vocab: int) -> list[tuple[np.ndarray, str | None]]:
    """Each prompt of a request as (token ids int32, its text where it came as text): a string, a list of token
    ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    return [_prompt_ids(p, tokenizer, vocab) for p in prompt]


def _prompt_ids(prompt: str | list[int], tokenizer: Tokenizer | None, vocab: int) -> tuple[np.ndarray, str | None]:
    text = prompt if isinstance(prompt, str) else None
    if text is not None:
        if tokenizer is None:
            raise bad_request("this bundle has no tokenizer: send the prompt as a list of token ids", "prompt")
        if len(text) > 16 * MAX_PROMPT_TOKENS:  # no token is 16 characters on average: refused before encoding
            raise bad_request(f"the prompt has {len(text)} characters, more than {MAX_PROMPT_TOKENS} tokens", "prompt")
        ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
    else:
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except OverflowError:
            raise bad_request(f"a token id is outside the vocabulary [0, {vocab})", "prompt") from None
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        ids = ids.astype(np.int32)
    if not ids.size:
        raise bad_request("the prompt is empty", "prompt")
    if ids.size > MAX_PROMPT_TOKENS:
        raise bad_request(f"the prompt has {ids.size} tokens, more than {MAX_PROMPT_TOKENS}", "prompt")
    return ids, text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
