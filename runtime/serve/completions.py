"""A completion request in flight in a front end: its choices (prompts x ``n``), each a request of the engine's, their
events turned into pieces of text, token ids and OpenAI's completions ``logprobs``, whole or streamed.

Log-probabilities are the model's (the log-softmax of the raw logits), as vLLM gives them by default. ``echo`` with
``logprobs`` scores the prompt: its tokens are teacher-forced after the first (:attr:`Request.score_from`), and their
log-probabilities come with the choice's first event after them; the first prompt token's is null.
"""

from __future__ import annotations

import array
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np
from fastapi.responses import Response

from ..engine.sampling import TokenLogprob
from .client import EngineClient
from .protocol import OpenAIError, usage
from .wire import WireEvent

TEXT_PIECES = 1024
LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")  # OpenAI's completions logprobs


@dataclass
class Piece:
    """What one event of a choice adds: text, token ids, the completions ``logprobs`` of its tokens (or None), and
    the finish reason once it has ended."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: dict | None
    finish_reason: str | None = None


def _top(top: tuple, token: int, logprob: float, token_text: Callable[[int], str]) -> dict[str, float]:
    """OpenAI's ``top_logprobs`` entry: the most likely tokens' text -> log-probability, the chosen token's
    included. Two ids of the same text keep the likelier one's figure (OpenAI's shape is keyed by text)."""
    entry: dict[str, float] = {}
    for i, lp in top:
        entry.setdefault(token_text(i), lp)
    entry.setdefault(token_text(token), logprob)
    return entry


@dataclass
class Choice:
    """One choice of a completion: one engine request (one prompt, one of ``n`` samples)."""

    index: int
    prompt: np.ndarray
    prompt_text: str
    echo: bool
    logprobs: int | None
    token_text: Callable[[int], str]
    sample: int = 0  # which of the prompt's n samples
    keep: bool = True  # whether the choice keeps its tokens, text and logprobs for a whole response (a streamed
    # one sends each piece and keeps nothing per token: a long generation's memory stays flat)
    rid: int = -1
    tokens: array.array = field(default_factory=lambda: array.array("i"))  # int32
    text: list[str] = field(default_factory=list)  # pieces, joined every TEXT_PIECES (a str per token is ~60 B)
    joined: int = 0  # the pieces of ``text`` before this one are joined strings
    lists: dict = field(default_factory=lambda: {k: [] for k in LOGPROB_LISTS})
    offset: int = 0  # characters of token text so far (text_offset)
    end: WireEvent | None = None
    echoed: bool = False
    last: float | None = None  # when its last token came (None: none yet), for the metrics' TTFT and ITL

    @property
    def scoring(self) -> bool:
        """Whether the engine scores this choice's prompt (echo with logprobs, two tokens or more)."""
        return self.echo and self.logprobs is not None and len(self.prompt) > 1

    def start(self) -> list[Piece]:
        """What can go out before any event: the echoed prompt, where no scores are to wait for."""
        return [self._echo(None)] if self.echo and not self.scoring else []

    def take(self, event: WireEvent) -> list[Piece]:
        """The pieces ``event`` adds (the echoed prompt first, when its scores came with it)."""
        pieces = []
        if self.echo and not self.echoed and (event.scores is not None or event.finish_reason is not None):
            pieces.append(self._echo(event.scores))
        ids = [] if event.token is None else [event.token]
        if self.keep:
            self.tokens.extend(ids)
            self.text.append(event.text)
            if len(self.text) - self.joined > TEXT_PIECES:  # the last pieces as one string
                self.text[self.joined :] = ["".join(self.text[self.joined :])]
                self.joined += 1
        logprobs = None
        if self.logprobs is not None and event.logprob is not None:
            logprobs = self._add([(event.token, TokenLogprob(*event.logprob))])
        if event.finish_reason is not None:
            self.end = event
        pieces.append(Piece(self.index, event.text, ids, logprobs, event.finish_reason))
        return pieces

    def _echo(self, scores: list | None) -> Piece:
        self.echoed = True
        if self.keep:
            self.text.insert(0, self.prompt_text)
            self.joined += 1
        logprobs = None
        if self.logprobs is not None:
            ids = self.prompt.tolist()
            scored = [None] + [TokenLogprob(*s) for s in scores] if scores is not None else [None] * len(ids)
            logprobs = self._add(list(zip(ids, scored, strict=False)))
        return Piece(self.index, self.prompt_text, [], logprobs)

    def _add(self, entries: list[tuple[int, TokenLogprob | None]]) -> dict:
        """Tokens' log-probabilities: their part of the completions ``logprobs`` (kept for the whole response)."""
        part: dict[str, list] = {k: [] for k in LOGPROB_LISTS}
        for token, scored in entries:
            text = self.token_text(token)
            part["tokens"].append(text)
            part["token_logprobs"].append(None if scored is None else scored.logprob)
            part["top_logprobs"].append(None if scored is None else _top(scored.top, token, scored.logprob,
                                                                          self.token_text))  # fmt: skip
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        if self.keep:
            for k, v in part.items():
                self.lists[k] += v
        return part

    def whole(self, token_ids: bool) -> dict:
        """The choice of a whole (not streamed) response."""
        logprobs = self.lists if self.logprobs is not None else None
        out = {"index": self.index, "text": "".join(self.text), "finish_reason": self.end.finish_reason}
        out["logprobs"] = logprobs
        if token_ids:
            out["token_ids"] = self.tokens.tolist()
            out["prompt_token_ids"] = self.prompt.tolist()
        return out


class Completion:
    """The engine requests of one HTTP request's choices, their events from one queue."""

    def __init__(self, client: EngineClient, choices: list[Choice]) -> None:
        self.client, self.choices = client, choices
        self.events: asyncio.Queue[WireEvent] = asyncio.Queue()
        self.by_rid: dict[int, Choice] = {}
        self.start = time.perf_counter()

    async def submit(self, sampling: Callable[[int], object], stop: tuple[str, ...]) -> None:
        """Submit every choice (``sampling(j)``: the options of the j-th sample of a prompt); if one is refused,
        those submitted are cancelled and the refusal raised."""
        try:
            for choice in self.choices:
                score_from = 1 if choice.scoring else None
                choice.rid = await self.client.submit(
                    choice.prompt, sampling(choice.sample), stop, score_from, choice.logprobs, self.events
                )
                self.by_rid[choice.rid] = choice
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancel the choices that have not ended (the client went away)."""
        for choice in self.choices:
            if choice.rid >= 0 and choice.end is None:
                self.client.cancel(choice.rid)

    async def pieces(self, disconnected: Callable[[], object] | None = None) -> AsyncIterator[Piece]:
        """Every choice's pieces as their events arrive, until all have ended. ``disconnected`` (a coroutine
        function): polled while no event comes; when it says so the choices are cancelled and a 499 raised."""
        for choice in self.choices:
            for piece in choice.start():
                yield piece
        open_ = len(self.choices)
        while open_:
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if disconnected is not None and await disconnected():
                    self.cancel()
                    raise ClientGone() from None
                continue
            choice = self.by_rid[event.id]
            if event.token is not None:
                self._timing(choice)
            for piece in choice.take(event):
                yield piece
            open_ -= event.finish_reason is not None

    def _timing(self, choice: Choice) -> None:
        now = time.perf_counter()
        first = choice.last is None
        self.client.token(now - (self.start if first else choice.last), first)
        choice.last = now

    def aborted(self) -> bool:
        return any(c.end is not None and c.end.finish_reason == "abort" for c in self.choices)


class ClientGone(Exception):
    """The client of a whole (not streamed) completion disconnected: answered 499 (nobody reads it)."""


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down; the request was not finished", "server_error")


def choices_of(body, prompts: list[tuple[np.ndarray, str | None]], tokenizer, keep: bool) -> list[Choice]:
    """The choices of completion request ``body`` (a CompletionRequest): each prompt's ``n`` samples, in that order
    (choice index = prompt x n + sample); ``keep``: for a whole response (not streamed)."""
    token_text = tokenizer.token_text if tokenizer is not None else (lambda i: f"token_id:{i}")
    choices = []
    for p, (ids, text) in enumerate(prompts):
        if body.echo and text is None:
            text = tokenizer.decode(ids.tolist()) if tokenizer is not None else ""
        for j in range(body.n):
            choice = Choice(p * body.n + j, ids, text or "", body.echo, body.logprobs, token_text, j, keep)
            choices.append(choice)
    return choices


def completion_usage(completion: Completion) -> dict:
    """Usage of a completion whose choices all ended: each prompt counted once (with its first sample's cached
    tokens), every sample's tokens."""
    firsts = [c for c in completion.choices if c.sample == 0]
    return usage(
        sum(len(c.prompt) for c in firsts),
        sum(c.end.completion_tokens for c in completion.choices),
        sum(c.end.cached_tokens for c in firsts),
    )


async def whole_completion(completion: Completion, body, head: dict, http) -> dict | Response:
    """The response of a completion not streamed (a 499 if its client went away meanwhile)."""
    try:
        async for _ in completion.pieces(http.is_disconnected):
            pass
    except ClientGone:
        return Response(status_code=499)
    if completion.aborted():
        raise shutting_down()
    out = {**head, "choices": [c.whole(body.return_token_ids) for c in completion.choices]}
    if body.return_token_ids and len(completion.choices) == body.n:  # one prompt: its ids at the top too
        out["prompt_token_ids"] = completion.choices[0].prompt.tolist()
    out["usage"] = completion_usage(completion)
    return out


async def stream_completion(completion: Completion, body, head: dict) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece with text, tokens or log-probabilities, the finish reasons, the usage
    when asked, then [DONE]. A client that disconnects cancels the generator (Starlette raises into it): the
    choices are cancelled and their slots freed within one engine iteration."""
    done = False
    try:
        if body.return_token_ids and len(completion.choices) == body.n:
            yield sse({**head, "choices": [], "prompt_token_ids": completion.choices[0].prompt.tolist()})
        async for piece in completion.pieces():
            choice = {"index": piece.index, "text": piece.text, "logprobs": piece.logprobs}
            choice["finish_reason"] = piece.finish_reason
            if body.return_token_ids:
                choice["token_ids"] = piece.token_ids
            if piece.text or piece.finish_reason is not None or piece.logprobs is not None or body.return_token_ids:
                yield sse({**head, "choices": [choice]})
        done = True
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": completion_usage(completion)})
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            completion.cancel()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
