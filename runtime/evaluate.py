"""LAMBADA-style last-word cloze evaluation of a bundle (``mambatrt eval``), on any runner.

Data: JSONL in lambada_openai format, one ``{"text": ...}`` per line. The target is the text's last
whitespace-separated word; the context is everything before it (without the separating space).

    accuracy     greedy continuation of the context reproduces every token of " " + word
    perplexity   exp(mean over passages of -log p(word tokens | context)), teacher-forced

Both come from one teacher-forced pass per passage through the engine (:attr:`Request.score_from`): the context is
prefilled, the word's tokens scored from the scoring graph's rows (split bundles on onnxruntime), else fed one per
decode launch. Needs numpy, a runner and the bundle's tokenizer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mambatrt.errors import InputError

from .engine import Engine, Event, Request, Sampling
from .tokenizer import Tokenizer


@dataclass
class ClozeItem:
    """One passage: context token ids and the target word's token ids."""

    context: list[int]
    target: list[int]


@dataclass
class EvalResult:
    """Accuracy (0..1) and last-word perplexity over ``count`` passages."""

    accuracy: float
    perplexity: float
    count: int

    def to_dict(self) -> dict:
        """JSON form (accuracy in percent)."""
        return {"accuracy": round(100 * self.accuracy, 3), "perplexity": round(self.perplexity, 4), "count": self.count}


def read_cloze(path: str | Path, tokenizer: Tokenizer, limit: int | None = None) -> list[ClozeItem]:
    """Parse a lambada-format JSONL file into context/target token ids."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: data file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f'{path}: not UTF-8 text; eval data is JSONL, one {{"text": ...}} object per line') from None
    items = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"{path}:{line_no}: expected a JSON object with a 'text' field") from None
        if not isinstance(text, str):
            raise InputError(f"{path}:{line_no}: 'text' should be a string, got {type(text).__name__}")
        text = text.rstrip()
        if " " not in text:
            raise InputError(f"{path}:{line_no}: a passage needs a context and a last word")
        context, word = text.rsplit(" ", 1)
        ctx_ids = tokenizer.encode(context)
        full = tokenizer.encode(context + " " + word)
        target = full[len(ctx_ids) :] if full[: len(ctx_ids)] == ctx_ids else tokenizer.encode(" " + word)
        if not ctx_ids or not target:
            raise InputError(f"{path}:{line_no}: empty context or target after tokenization")
        items.append(ClozeItem(ctx_ids, target))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise InputError(f"{path}: no passages found")
    return items


def score_item(engine: Engine, item: ClozeItem) -> tuple[bool, float]:
    """(greedy reproduces the word, log-likelihood of the word) for one passage."""
    ended: list[Event] = []
    prompt = item.context + item.target
    request = Request(prompt, Sampling(max_new_tokens=0), ended.append, score_from=len(item.context))
    engine.generate(request)
    scores = ended[-1].scores
    return all(s.greedy for s in scores), sum(s.logprob for s in scores)


def evaluate(engine: Engine, items: list[ClozeItem], progress: bool = True) -> EvalResult:
    """Accuracy and perplexity over ``items`` on ``engine`` (one slot), with a progress bar."""
    from tqdm import tqdm

    hits, total = 0, 0.0
    bar: Iterator[ClozeItem] = tqdm(items, desc="eval", unit="passage", disable=not progress, leave=False)
    for item in bar:
        ok, loglik = score_item(engine, item)
        hits += ok
        total += loglik
    return EvalResult(hits / len(items), math.exp(-total / len(items)), len(items))


def read_unigram(path: str | Path, vocab_size: int | None) -> np.ndarray:
    """Token counts for :func:`unigram_baseline`: a JSON list of ``vocab_size`` non-negative numbers (of any length
    where the vocabulary's size is not known here)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: unigram counts file not found")
    try:
        counts = np.asarray(json.loads(path.read_text(encoding="utf-8")), dtype=np.float64)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError):
        raise InputError(f"{path}: expected a JSON list of token counts") from None
    size = counts.shape[0] if vocab_size is None and counts.ndim == 1 and counts.size else vocab_size
    if counts.shape != (size,) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise InputError(
            f"{path}: expected {size or 'some'} non-negative counts (one per token of the vocabulary), "
            f"got an array of shape {counts.shape}"
        )
    return counts


def unigram_baseline(items: list[ClozeItem], counts: np.ndarray) -> EvalResult:
    """The same metrics for a unigram model (token frequencies ``counts``, add-one smoothed)."""
    top = max(max(item.target) for item in items)
    if top >= counts.size:
        raise InputError(f"the unigram counts cover {counts.size} tokens, but the passages hold token id {top}")
    logp = np.log((counts + 1.0) / (counts + 1.0).sum())
    best = int(np.argmax(counts))
    hits = sum(all(t == best for t in item.target) for item in items)
    total = sum(float(logp[item.target].sum()) for item in items)
    return EvalResult(hits / len(items), math.exp(-total / len(items)), len(items))
