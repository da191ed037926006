"""Generation over any backend: chunked prefill (split) or token-by-token prefill (single), then decoding.

Timing boundaries, the same for both layouts:

    prefill_ms            first prompt chunk submitted -> last chunk's logits on the host (so the final state
                          update has completed)
    ttft_ms               prefill_ms + choosing the first new token
    decode_ms_per_token   decode steps only (feed one token -> its logits on the host), averaged over the steps
    tokens_per_s          new tokens / (ttft + decode time)

A conversation continues from a saved state (:func:`save_state` / :func:`load_state`) without re-reading its
history: the state holds the recurrent states plus the last generated token, which is not fed yet.
"""

from __future__ import annotations

import functools
import math
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from mambatrt.contract import DECODE, PREFILL
from mambatrt.errors import InputError
from mambatrt.paths import write_atomic
from mambatrt.runtime.backends import Backend

STATE_FORMAT = "mambatrt-state"
# Below this, logits / T overflows float64 for logits of ordinary size; 0 (greedy) is the way to ask for the argmax.
MIN_TEMPERATURE = 1e-3
STATE_VERSION = 1


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


@dataclass
class Generation:
    """What :meth:`Generator.generate` produced, with its timings."""

    prompt_ids: list[int]
    tokens: list[int]
    prefill_ms: float
    ttft_ms: float
    decode_ms_per_token: float | None
    decode_steps: int
    prefill_launches: int
    stopped: str  # "eos" | "max_new_tokens"
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        """New tokens per second from the first prompt chunk to the last new token."""
        total_ms = self.ttft_ms + (self.decode_ms_per_token or 0.0) * self.decode_steps
        return len(self.tokens) / (total_ms / 1e3) if self.tokens and total_ms > 0 else None

    def to_dict(self, text: str | None = None) -> dict:
        """JSON form (what ``mambatrt run --json`` prints before the backend fields); times rounded to 1 us."""

        def rounded(value: float | None, digits: int) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "text": text,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms_per_token": rounded(self.decode_ms_per_token, 3),
            "ttft_ms": round(self.ttft_ms, 3),
            "tokens_per_s": rounded(self.tokens_per_s, 2),
            "prefill_launches": self.prefill_launches,
            "stopped": self.stopped,
        }


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
    # arithmetic (BENCHMARKS.md, session 21), and the same operations in place give the same bits
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
    (runtime/backends.py) can.
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


def token_ids(ids, vocab: int) -> list[int]:
    """``ids`` (any sequence or array of integers) as Python ints, each checked to lie in [0, vocab).

    Python ints, not int64: an id too large for int64 is reported as outside the vocabulary, not as an overflow.
    """
    out = [int(t) for t in np.asarray(ids, dtype=object).reshape(-1)]
    bad = next((t for t in out if not 0 <= t < vocab), None)
    if bad is not None:
        raise InputError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return out


def token_id_key(text: str) -> int | None:
    """A token id written as text (a ``logit_bias`` key, ``--logit-bias ID=``), or None: ASCII digits only (int()
    also takes other scripts' digits, and str.isdigit superscripts that int() refuses), at most 18 of them."""
    digits = text.strip()
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else None


class Generator:
    """Prefill and decode a bundle through one backend; the loop is the same for every backend and layout."""

    def __init__(self, backend: Backend, eos_id: int | None = None, token_by_token: bool = False) -> None:
        self.backend = backend
        self.token_by_token = token_by_token  # prefill on the decode graph even when a prefill graph exists
        self.vocab = backend.config.vocab_size
        self.eos_id = eos_id
        self.pending: int | None = None  # last generated token, not yet fed to the model

    @property
    def chunk_rows(self) -> int:
        """Rows per prefill launch: the bundle's max for "split", 1 (decode engine) for "single"."""
        return self.backend.max_rows[PREFILL] if self.prefill_graph == PREFILL else 1

    @property
    def prefill_graph(self) -> str:
        """The graph prompts go through: prefill for split bundles, decode for single ones (or token_by_token)."""
        return PREFILL if PREFILL in self.backend.graphs and not self.token_by_token else DECODE

    def reset(self) -> None:
        """Start a new sequence: zero states, nothing pending."""
        self.backend.reset()
        self.pending = None

    def prefill(self, token_ids) -> tuple[np.ndarray, int]:
        """Feed a prompt (after any pending token); returns (last logits [V], number of launches)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if self.pending is not None:
            ids = np.concatenate([[self.pending], ids])
            self.pending = None
        if ids.size == 0:
            raise InputError("empty prompt: pass at least one token (--prompt or --prompt-ids)")
        graph = self.prefill_graph
        rows = self.chunk_rows
        logits, launches = None, 0
        for start in range(0, ids.size, rows):
            logits = self.backend.run(graph, ids[start : start + rows])
            launches += 1
        return logits[: self.vocab], launches

    def generate(
        self,
        prompt_ids,
        sampling: Sampling = Sampling(),
        on_token: Callable[[int], None] | None = None,
        reset: bool = True,
    ) -> Generation:
        """Prefill ``prompt_ids`` and produce up to ``sampling.max_new_tokens`` tokens.

        ``reset=False`` continues from the current state (and the pending token of the last call).
        ``on_token`` is called with each new token as soon as it is chosen (streaming).
        """
        prompt = token_ids(prompt_ids, self.vocab)  # checked here, before any launch
        if not prompt:
            raise InputError("empty prompt: pass at least one token (--prompt or --prompt-ids)")
        rng = np.random.default_rng(sampling.seed)
        if reset:
            self.reset()
        t0 = time.perf_counter()
        logits, launches = self.prefill(prompt)
        t1 = time.perf_counter()
        tokens: list[int] = []
        decode_s, steps, stopped = 0.0, 0, "max_new_tokens"
        if sampling.max_new_tokens > 0:
            token = sample_token(logits, sampling, rng, tokens)
            ttft = time.perf_counter() - t0
            while True:
                tokens.append(token)
                if on_token is not None:
                    on_token(token)
                if sampling.stop_on_eos and self.eos_id is not None and token == self.eos_id:
                    stopped = "eos"
                    break
                if len(tokens) >= sampling.max_new_tokens:
                    break
                s0 = time.perf_counter()
                logits = self.backend.run(DECODE, [token])[: self.vocab]
                decode_s += time.perf_counter() - s0
                steps += 1
                token = sample_token(logits, sampling, rng, tokens)
            self.pending = tokens[-1]
        else:
            ttft = t1 - t0
        return Generation(
            prompt_ids=prompt,
            tokens=tokens,
            prefill_ms=(t1 - t0) * 1e3,
            ttft_ms=ttft * 1e3,
            decode_ms_per_token=decode_s * 1e3 / steps if steps else None,
            decode_steps=steps,
            prefill_launches=launches,
            stopped=stopped,
        )

    # -- saved state -----------------------------------------------------------------------------------------
    def save_state(self, path: str | Path) -> None:
        """Write states + pending token + the bundle's identity to ``path`` (.npz), atomically."""
        write_state(path, self.backend.bundle.identity, *self.backend.get_state(), self.pending)

    def load_state(self, path: str | Path) -> None:
        """Restore a state saved by :meth:`save_state` for this same bundle."""
        conv, ssm, self.pending = read_state(path, self.backend.bundle.identity, self.vocab)
        self.backend.set_state(conv, ssm)


def write_state(path: str | Path, identity: str, conv: np.ndarray, ssm: np.ndarray, pending: int | None) -> None:
    """A conversation's states, its pending token (generated, not fed yet) and the bundle's identity to ``path``
    (.npz), atomically."""

    def save(f: IO[bytes]) -> None:
        np.savez(
            f,
            format=np.array(STATE_FORMAT),
            version=np.array(STATE_VERSION),
            bundle=np.array(identity),
            conv_state=conv,
            ssm_state=ssm,
            pending=np.array(-1 if pending is None else pending, dtype=np.int64),
        )

    try:
        write_atomic(path, save)
    except OSError as exc:  # permissions, a full disk: the user's to fix
        raise InputError(f"{path}: cannot write the state ({exc.strerror or exc})") from None


def read_state(path: str | Path, identity: str, vocab: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """(conv, ssm, pending token or None) from a file :func:`write_state` wrote for the bundle ``identity``."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: state file not found")
    wrong = f"{path}: not a {STATE_FORMAT} v{STATE_VERSION} file (one written by `mambatrt run --save-state`)"
    try:
        with np.load(path, allow_pickle=False) as data:
            fields = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # not an .npz, truncated, or pickled objects
        raise InputError(wrong) from None
    needed = {"format", "version", "bundle", "conv_state", "ssm_state", "pending"}
    if not needed <= set(fields) or any(fields[k].shape != () for k in ("format", "version", "bundle", "pending")):
        raise InputError(wrong)
    if str(fields["format"]) != STATE_FORMAT or fields["version"].dtype.kind not in "iu":
        raise InputError(wrong)
    if int(fields["version"]) != STATE_VERSION:
        raise InputError(f"{path}: state format version {int(fields['version'])}, this mambatrt reads {STATE_VERSION}")
    if str(fields["bundle"]) != identity:
        raise InputError(f"{path}: this state was saved with another bundle (different model); start afresh")
    conv, ssm, pending = fields["conv_state"], fields["ssm_state"], fields["pending"]
    if conv.dtype.kind != "f" or ssm.dtype.kind != "f" or not (np.isfinite(conv).all() and np.isfinite(ssm).all()):
        raise InputError(f"{path}: the saved states are not finite floating-point arrays; start afresh")
    if pending.dtype.kind not in "iu" or not -1 <= int(pending) < vocab:
        raise InputError(f"{path}: the saved pending token is not a token id of this model; start afresh")
    return conv, ssm, (None if int(pending) < 0 else int(pending))
