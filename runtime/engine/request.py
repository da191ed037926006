"""What goes into the engine (a :class:`Request`), what comes out (its :class:`Event` s), and a request's life inside
it (:class:`Sequence`)."""

from __future__ import annotations

import array
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .sampling import Sampling, TokenLogprob
from .state_cache import Prefix, PrefixHasher


class QueueFull(Exception):
    """More requests are waiting than the engine's ``max_queue``; the server answers 429."""


class EngineStopped(Exception):
    """The engine is stopping or has stopped (shutdown, or a bug ended its loop); the server answers 503."""


@dataclass
class Event:
    """What a request receives, in order: one event per new token, the last one with ``finish_reason``."""

    token: int | None  # None only on a final event without a new token (cancelled, a stop string hit, or scored)
    text: str  # the text this token completes ("" without a tokenizer or while a stop string may be starting)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_launches: int = 0  # launches that fed this request's prompt
    state: tuple[np.ndarray, np.ndarray] | None = None  # final event of a ``keep_state`` request: the states after
    # every fed token (the last generated token is not fed yet)
    logprob: TokenLogprob | None = None  # this event's token's, where the request asks for ``logprobs``
    scores: list[TokenLogprob] | None = None  # of a ``score_from`` request, on the first event once its prompt is
    # scored (its first token's, or its final one): each scored prompt token's given the tokens before it


@dataclass
class Request:
    """One generation: prompt ids, sampling options, stop strings, and where its events go (any thread)."""

    prompt: list[int] | np.ndarray  # token ids (an integer array keeps a long prompt small: 4 bytes a token)
    sampling: Sampling
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    id: int = field(default_factory=itertools.count().__next__)
    state: tuple[np.ndarray, np.ndarray] | None = None  # start from these states ([L, E, K-1], [L, E, N]), not zeros
    keep_state: bool = False  # the final event carries the states (``run --save-state``)
    detokenize: bool = True  # the events carry text; False: the caller decodes the tokens (stop strings need True)
    # score prompt[score_from:] (``eval``, ``echo`` with ``logprobs``): each of those tokens' log-probability goes
    # into an event's ``scores`` (from the scoring graph's rows where the runner has one, else fed one per decode
    # launch, teacher-forced); generation follows
    # (``sampling.max_new_tokens``)
    score_from: int | None = None
    logprobs: int | None = None  # each token's log-probability and the ``logprobs`` most likely tokens' (0..20)


class Sequence:
    """A request inside the engine: what is fed, what is left to feed, what was generated."""

    def __init__(
        self,
        request: Request,
        decode_text: Callable[[], Callable[[int], str]] | None,
        order: int = 0,
        score_rows: bool = False,
    ) -> None:
        """``score_rows``: a prompt to score is prefilled whole on the scoring graph, every row's logits scoring
        the next token (:class:`~mambatrt.runtime.runners.scorer.Scorer`), not fed one token per decode launch."""
        self.request = request
        self.order = order  # arrival: the engine prefills and admits the oldest first
        self._rng: np.random.Generator | None = None
        self.prompt = np.asarray(request.prompt, dtype=np.int32)  # checked by the engine to lie in the vocabulary
        self.score_rows = score_rows and request.score_from is not None
        self.split = len(self.prompt) if request.score_from is None or self.score_rows else request.score_from
        # prompt tokens taken: those before ``split`` are prefilled in chunks (a prompt scored on the scoring graph:
        # all of them), the rest scored and fed one per decode launch
        self.at = 0
        self.scores: list[TokenLogprob] = []
        self.scores_out = request.score_from is None  # the scores went out in an event
        self.logprob: TokenLogprob | None = None  # the next event's token's
        self.fed = 0  # tokens whose effect is in the state: the prompt's, then the generated ones
        self.hasher = PrefixHasher()  # the keys of the fed tokens' prefixes (the prefix cache's)
        self.pending: int | None = None  # the token the next decode launch feeds (the last generated or forced)
        self.logits: np.ndarray | None = None  # of the last fed token
        self.first: int | None = None  # the first token, where the pool picked it from the prompt's last launch
        self.generated = array.array("i")  # int32: 4 bytes a token, however long the completion
        self.cached_tokens = 0
        self.launches = 0
        self.step_text = decode_text() if decode_text is not None and (request.detokenize or request.stop) else None
        # the engine's text stays empty: each event's text is "" (the common case of a served request, whose front
        # end decodes the tokens; the decode iteration's per-sequence path, run for every running sequence)
        self.bare = self.step_text is None and not request.stop and request.logprobs is None
        sampling = request.sampling
        # what picks its tokens: 0 greedy and 1 by temperature alone (where the pool can, on the device), 2 the host
        # (which also scores forced tokens and gives log-probabilities)
        host = not sampling.plain or self.to_force or request.logprobs is not None
        self.picker = 2 if host else 1 if sampling.temperature else 0
        self.temperature = sampling.temperature
        self.own_draws = sampling.seed is not None and sampling.temperature > 0  # see sampler_rows
        self.ended = False  # its last event is out; its slot is freed once no launch holds it (Engine.compact)
        self.next_id: int | None = None  # its pick from a finished launch not handled yet (fed to the next launch)
        self.logits_row = 0  # its row in the launch whose logits it has (of the last launch, or the one before)
        self.text = ""  # generated text not sent yet, after the sent text's last ``window`` characters
        self.sent = 0  # characters of ``text`` already emitted
        # a stop string that ends in new text starts at most this many characters before it: the sent text before
        # goes (the search for stop strings, and memory, stay bounded however long the completion)
        self.window = max((len(s) for s in request.stop), default=1) - 1
        self.started = time.perf_counter()

    @property
    def rng(self) -> np.random.Generator:
        """The sequence's sampling RNG, made when first needed: greedy requests never pay for one."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.request.sampling.seed)
        return self._rng

    @property
    def to_force(self) -> int:
        """Prompt tokens still to score and feed one per decode launch."""
        return len(self.prompt) - max(self.at, self.split)

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return self.split - self.at

    def next_chunk(self, chunk: int, score_chunk: int) -> tuple[int, bool]:
        """(rows of the next prefill launch, whether on the scoring graph): the prompt's rows before the first one
        whose logits score a token go on the prefill graph, up to ``chunk`` per launch, those from it on the scoring
        graph, up to ``score_chunk``."""
        rows = min(chunk, self.left)
        if not self.score_rows:
            return rows, False
        unscored = self.request.score_from - 1 - self.at  # rows before the one that scores position score_from
        return (min(score_chunk, self.left), True) if unscored <= 0 else (min(rows, unscored), False)

    def next_rows(self, rows: int) -> np.ndarray:
        """The next ``rows`` prompt tokens to prefill."""
        return self.prompt[self.at : self.at + rows]

    def fed_tokens(self, a: int, b: int) -> np.ndarray:
        """Fed tokens a..b-1: the prompt's, then the generated ones."""
        p = len(self.prompt)
        if b <= p:
            return self.prompt[a:b]
        return np.concatenate([self.prompt[a:], np.frombuffer(self.generated[max(a - p, 0) : b - p], np.int32)])

    def key(self) -> Prefix:
        """The prefix cache's key of the fed tokens."""
        return self.hasher.key(self.fed_tokens, self.fed)

    @property
    def first_by_pool(self) -> bool:
        """Whether the pool may pick this sequence's first token from its prompt's last launch."""
        return self.picker < 2 and self.request.sampling.max_new_tokens > 0

    def event(self, token: int | None, finish_reason: str | None) -> Event:
        """The next event: the text that became safe to send (a stop string never leaks out)."""
        stops = self.request.stop
        if finish_reason is None and stops:
            # hold back the longest tail that could be the start of a stop string
            hold = max((k for s in stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - hold
        else:
            end = len(self.text)
        chunk, self.sent = self.text[self.sent : end], max(self.sent, end)
        if self.sent > 2 * self.window + 64:  # dropped now and then, not on every token
            cut = self.sent - self.window
            self.text, self.sent = self.text[cut:], self.window
        r = self.request
        event = Event(token, chunk, finish_reason, len(r.prompt), len(self.generated), self.cached_tokens)
        event.prefill_launches = self.launches
        event.logprob, self.logprob = self.logprob, None
        if not self.scores_out and (not self.to_force or finish_reason is not None):
            event.scores, self.scores_out = self.scores, True
        return event
