"""The cloze of ``mambatrt eval`` through a running server (``eval --url``): no bundle on this side.

The server gives what the client needs: the token ids of each passage (POST /tokenize, the tokenizer the server
encodes with) and the scores. Each passage is one task call, as lm-eval's ``local-completions`` makes it for a
loglikelihood task: the context and the target word's tokens as the prompt, ``echo`` with ``logprobs: 1`` and
``max_tokens: 0``. The target's tokens are then scored exactly as ``mambatrt eval`` scores them on a bundle:

    greedy       the token's entry is the only one in its ``top_logprobs`` and is the most likely token
    loglik       the sum of the target tokens' ``token_logprobs``

so the accuracy and perplexity equal the bundle's, and the task calls' latency (p50/p99, ms) is what a user of the
endpoint waits per passage at the chosen concurrency. Needs httpx and numpy.
"""

from __future__ import annotations

import concurrent.futures
import math
import time

import numpy as np

from mambatrt import envs
from mambatrt.errors import InputError

from .evaluate import ClozeItem, EvalResult


def api_headers() -> dict[str, str]:
    """The bearer key a server started with ``--api-key`` wants ($MAMBATRT_API_KEY), or none."""
    key = envs.MAMBATRT_API_KEY
    return {"Authorization": f"Bearer {key}"} if key else {}


def refusal(url: str, response) -> InputError:
    """A server's refusal as one line: its OpenAI-shaped message where it sent one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    hint = "; set MAMBATRT_API_KEY to the server's key" if response.status_code == 401 else ""
    return InputError(f"{url}: HTTP {response.status_code}: {message}{hint}")


class ServerTokenizer:
    """``encode`` through the server's POST /tokenize: the ids the served model reads."""

    def __init__(self, client, url: str) -> None:
        self.client, self.url = client, url

    def encode(self, text: str) -> list[int]:
        response = self.client.post(f"{self.url}/tokenize", json={"prompt": text})
        if response.status_code != 200:
            raise refusal(self.url, response)
        return response.json()["tokens"]


def _score(client, url: str, model: str, item: ClozeItem) -> tuple[bool, float, float]:
    """(greedy reproduces the target, its log-likelihood, seconds) of one task call."""
    body = {"model": model, "prompt": item.context + item.target, "max_tokens": 0, "echo": True, "logprobs": 1}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise refusal(url, response)
    logprobs = response.json()["choices"][0]["logprobs"]
    n = len(item.target)
    scored = zip(logprobs["token_logprobs"][-n:], logprobs["top_logprobs"][-n:], strict=True)
    greedy = all(len(top) == 1 and next(iter(top.values())) == lp for lp, top in scored)
    return greedy, sum(logprobs["token_logprobs"][-n:]), seconds


def evaluate_served(client, url: str, model: str, items: list[ClozeItem], concurrency: int, progress: bool) -> dict:
    """Accuracy (%), perplexity, count and task-call latency (ms: p50, p99, avg) of ``items`` through the server,
    ``concurrency`` task calls in flight."""
    from tqdm import tqdm

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        calls = [pool.submit(_score, client, url, model, item) for item in items]
        done = tqdm(concurrent.futures.as_completed(calls), total=len(calls), desc="eval", unit="passage",
                    disable=not progress, leave=False)  # fmt: skip
        for call in done:
            call.result()  # the first refusal ends the run, with its message
    results = [call.result() for call in calls]
    hits = sum(greedy for greedy, _, _ in results)
    loglik = sum(ll for _, ll, _ in results)
    times = np.asarray([s for _, _, s in results]) * 1e3
    result = EvalResult(hits / len(items), math.exp(-loglik / len(items)), len(items)).to_dict()
    latency = {"p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99)), "avg": times.mean()}
    return {**result, "task_call_ms": {k: round(float(v), 3) for k, v in latency.items()}}
