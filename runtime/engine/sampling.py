"""How a token is picked from logits: the sampling options of a request and the host's sampler.

Greedy (temperature 0) takes the argmax; otherwise the softmax of logits / temperature is sampled, after OpenAI's
logit adjustments (bias, presence and frequency penalties) and top-k / top-p cuts, with one uniform draw per token
from the request's RNG: a seed gives the same tokens in ``run`` and through the server, on the host and on the GPU
(where the slot pool picks tokens of requests that need nothing but a temperature: :func:`sampler_rows`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mambatrt.errors import InputError

# Below this, logits / T overflows float64 for logits of ordinary size; 0 (greedy) is the way to ask for the argmax.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class Sampling:
    """Decoding options. temperature 0 means greedy; otherwise sample with top-k / top-p from a seeded RNG.

    OpenAI's logit adjustments come before either: ``logit_bias`` adds its value to a token's logit;
    ``presence_penalty`` subtracts from the logit of every token generated so far, ``frequency_penalty`` that much
    per time it was generated (the completion's tokens only, not the prompt's, as vLLM counts them).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_on_eos: bool = True
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100]), ids distinct

    @functools.cached_property  # asked per running sequence in every decode iteration
    def adjusts_logits(self) -> bool:
        """Whether a token depends on more than the logits' argmax or distribution (the penalties, a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @functools.cached_property
    def plain(self) -> bool:
        """Whether a token is picked from the logits by the temperature alone (greedy, or the whole softmax: no
        top-k or top-p cut, no penalty or bias), as the GPU sampler can pick it."""
        return not self.adjusts_logits and (self.temperature == 0 or (not self.top_k and self.top_p >= 1))

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InputError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InputError(
                f"--temperature {self.temperature} is too small to sample with (logits / T overflow); "
                f"use 0 for greedy decoding or a value >= {MIN_TEMPERATURE}"
            )
        if self.top_k < 0:
            raise InputError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # False for NaN too
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"--seed must be in 0..2^63-1, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:  # False for NaN too
                raise InputError(f"--{name.replace('_', '-')} must be in [-2, 2], got {value}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise InputError("--logit-bias must name distinct token ids >= 0")
        bad = next((b for _, b in self.logit_bias if not -100 <= b <= 100), None)
        if bad is not None:
            raise InputError(f"--logit-bias values must be in [-100, 100], got {bad}")


def sample_token(
    logits: np.ndarray, sampling: Sampling, rng: np.random.Generator | None, generated: Sequence[int] = ()
) -> int:
    """One token from logits [V] (already cut to the real vocabulary), ``generated`` the tokens generated so far
    (what the penalties count).

    No full sort of the vocabulary (a 50k-entry argsort per token was most of a CPU server's time): temperature
    alone samples the softmax in index order; top-k takes the k best with argpartition; top-p grows a partial
    sort until the nucleus is covered. Candidates are ordered by probability, ties by token id, so top-k and top-p
    keep exactly the tokens a full sort keeps. One ``rng.random()`` per token: a seed gives the same tokens in
    ``run`` and through the server. Greedy (temperature 0) needs no ``rng``.
    """
    if sampling.adjusts_logits:
        logits = adjusted_logits(logits, sampling, generated)
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    # in place on one copy: a fresh array per step (400 KB at a 50k vocabulary) costs page faults, more than the
    # arithmetic, and the same operations in place give the same bits
    scaled = logits.astype(np.float64)
    scaled /= sampling.temperature
    if sampling.top_k or sampling.top_p < 1:
        order = _best(scaled, sampling.top_k or scaled.size, sampling.top_p)
    else:
        order = None  # the whole vocabulary, in index order
    chosen = scaled if order is None else scaled[order]
    chosen -= chosen.max()
    np.exp(chosen, out=chosen)  # the probabilities, unnormalized
    pick = inverse_cdf(chosen, rng.random())
    return pick if order is None else int(order[pick])


CDF_BLOCK = 64  # entries summed together before the running sum (inverse_cdf)


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The first index whose running sum of ``weights`` [V] (float64, >= 0, not all 0) exceeds u x their total,
    for a draw u in [0, 1); the last index where rounding leaves none.

    The running sum in blocks: each block of :data:`CDF_BLOCK` entries summed at once (vectorized), a running sum
    over the blocks' sums finds the block, and one over that block's entries the index. A running sum over every
    entry (``np.cumsum``, one dependent add per entry) was most of a sampled token's time at a 50k vocabulary. The
    sums group differently from one entry at a time, so the pick can differ from that definition (the test's
    reference) only where u x total falls within rounding (~1e-16 relative) of a boundary, as the GPU sampler's
    (the kernels library's) can.
    """
    v = weights.size
    full = v - v % CDF_BLOCK
    ends = np.cumsum(weights[:full].reshape(-1, CDF_BLOCK).sum(axis=1))  # the running sum at each block's end
    total = (ends[-1] if ends.size else 0.0) + weights[full:].sum()
    target = u * total
    block = int(np.searchsorted(ends, target, side="right"))  # the first block whose end exceeds the target
    lo = block * CDF_BLOCK
    inner = np.cumsum(weights[lo : lo + CDF_BLOCK])
    inner += ends[block - 1] if block else 0.0
    pick = lo + int(np.searchsorted(inner, target, side="right"))
    return min(pick, v - 1)  # past the block (rounding between its sum and its entries') or past the end


def adjusted_logits(logits: np.ndarray, sampling: Sampling, generated: Sequence[int]) -> np.ndarray:
    """A copy of ``logits`` [V] with ``sampling``'s logit bias and penalties applied (ids past V are ignored)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if sampling.logit_bias:
        ids = np.array([t for t, _ in sampling.logit_bias], dtype=np.int64)
        bias = np.array([b for _, b in sampling.logit_bias], dtype=np.float32)
        keep = ids < out.size
        out[ids[keep]] += bias[keep]
    if len(generated) and (sampling.presence_penalty or sampling.frequency_penalty):
        tokens, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        keep = tokens < out.size
        out[tokens[keep]] -= (sampling.frequency_penalty * counts[keep] + sampling.presence_penalty).astype(np.float32)
    return out


def _best(scaled: np.ndarray, k: int, top_p: float) -> np.ndarray:
    """Token ids of the top-k (then the top-p nucleus) of ``scaled``, best first, ties by id; partial sorts only."""
    k = min(k, scaled.size)

    def sorted_best(n: int) -> np.ndarray:  # the n best ids, best first, ties by id
        part = np.argpartition(-scaled, n - 1)[:n] if n < scaled.size else np.arange(scaled.size)
        return part[np.lexsort((part, -scaled[part]))]

    if top_p >= 1:
        return sorted_best(k)
    weights = np.exp(scaled - scaled.max())
    within = weights if k == scaled.size else weights[np.argpartition(-scaled, k - 1)[:k]]
    mass = top_p * within.sum()  # the nucleus is taken among the k best, renormalized
    n = min(k, 64)
    while True:  # the n best, sorted; grow n until they hold top_p of the mass (or are all k)
        part = sorted_best(n)
        cum = np.cumsum(weights[part])
        if n >= k or cum[-1] >= mass:
            break
        n = min(k, 4 * n)
    return part[: min(int(np.searchsorted(cum, mass)) + 1, n)]


MAX_LOGPROBS = 20  # most likely tokens a request may ask the log-probabilities of (OpenAI's and vLLM's bound)


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model (the log-softmax of the raw logits: before temperature, penalties,
    bias or cuts), whether it is the greedy pick, and the ``n`` most likely tokens' (id, log-probability), best
    first, ties by id."""

    logprob: float
    greedy: bool
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """``token``'s :class:`TokenLogprob` from the logits [V] it was picked or scored from. The greedy token's
    log-probability and its entry in ``top`` are the same number (one subtraction from one log-sum-exp)."""
    z = logits.astype(np.float64)
    best = int(np.argmax(z))
    lse = z[best] + math.log(np.exp(z - z[best]).sum())
    top: tuple[tuple[int, float], ...] = ()
    if n:
        n = min(n, z.size)
        ids = np.argpartition(-z, n - 1)[:n] if n < z.size else np.arange(z.size)
        ids = ids[np.lexsort((ids, -z[ids]))]
        top = tuple((int(i), float(z[i] - lse)) for i in ids)
    return TokenLogprob(float(z[token] - lse), token == best, top)


def token_ids(ids, vocab: int) -> list[int]:
    """``ids`` (any sequence or array of integers) as Python ints, each checked to lie in [0, vocab).

    Python ints, not int64: an id too large for int64 is reported as outside the vocabulary, not as an overflow.
    """
    out = [int(t) for t in np.asarray(ids, dtype=object).reshape(-1)]
    bad = next((t for t in out if not 0 <= t < vocab), None)
    if bad is not None:
        raise InputError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return out


def check_token_ids(ids, vocab: int) -> None:
    """InputError unless every id of ``ids`` lies in [0, vocab): an integer array's bounds, without a Python int per
    id (a million-token prompt)."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.size == 0:
        token_ids(ids, vocab)  # Python ints beyond int64, or not integers: said one by one
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab:
        raise InputError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab})")


def token_id_key(text: str) -> int | None:
    """A token id written as text (a ``logit_bias`` key, ``--logit-bias ID=``), or None: ASCII digits only (int()
    also takes other scripts' digits, and str.isdigit superscripts that int() refuses), at most 18 of them."""
    digits = text.strip()
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else None


def sampler_rows(seqs: list, shared: np.random.Generator) -> np.ndarray:
    """The device sampler's rows for the next tokens of ``seqs``: (temperature, uniform draw) float64 [n, 2], the
    draw 0 where greedy. A seeded request draws from its own RNG, one draw per sampled token as
    :func:`sample_token` takes it, so a seed gives the same tokens on the device as on the host; the others draw
    from ``shared``, all in one call, on the engine's thread in every sampled decode iteration: not a call each,
    nor an RNG each seeded from the OS's entropy."""
    n = len(seqs)
    rows = np.empty((n, 2), np.float64)
    rows[:, 0] = [s.temperature for s in seqs]
    rows[:, 1] = shared.random(n)
    for i in [i for i, s in enumerate(seqs) if s.own_draws]:
        rows[i, 1] = seqs[i].rng.random()
    rows[rows[:, 0] == 0, 1] = 0.0
    return rows
