"""The cloze of ``mambatrt eval`` through a running server (``eval --url``): no bundle on this side.

The server gives what the client needs: the token ids of each passage (POST /tokenize, the tokenizer the server
encodes with) and the answers. Each passage is one task call, the seed's qualification shape: the context's ids as
the prompt, greedy, ``max_tokens`` the target word's length; correct when the returned ids are the target's. Greedy
decoding reproduces the target exactly when each of its tokens is the argmax after the ones before, so the accuracy
equals ``mambatrt eval``'s on the bundle (teacher-forced), and the task calls' latency (p50/p99, ms) is what a user
of the endpoint waits per passage at the chosen concurrency: a prefill and a few decode steps. (lm-eval scores
each passage with ``echo`` and ``logprobs`` instead; perplexity comes from ``mambatrt eval BUNDLE`` or lm-eval.)
Needs httpx and numpy.
"""

from __future__ import annotations

import concurrent.futures
import time

from .evaluate import ClozeItem
from .loadgen import latency_stats, refusal


class ServerTokenizer:
    """``encode`` through the server's POST /tokenize: the ids the served model reads."""

    def __init__(self, client, url: str) -> None:
        self.client, self.url = client, url

    def encode(self, text: str) -> list[int]:
        response = self.client.post(f"{self.url}/tokenize", json={"prompt": text})
        if response.status_code != 200:
            raise refusal(self.url, response)
        return response.json()["tokens"]


def _score(client, url: str, model: str, item: ClozeItem) -> tuple[bool, float]:
    """(greedy reproduces the target, seconds) of one task call."""
    body = {"model": model, "prompt": item.context, "max_tokens": len(item.target), "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise refusal(url, response)
    return response.json()["choices"][0]["token_ids"] == item.target, seconds


def evaluate_served(client, url: str, model: str, items: list[ClozeItem], concurrency: int, progress: bool) -> dict:
    """Accuracy (%), count and task-call latency (ms: p50, p99, avg) of ``items`` through the server,
    ``concurrency`` task calls in flight."""
    from tqdm import tqdm

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        calls = [pool.submit(_score, client, url, model, item) for item in items]
        done = tqdm(concurrent.futures.as_completed(calls), total=len(calls), desc="eval", unit="passage",
                    disable=not progress, leave=False)  # fmt: skip
        try:
            for call in done:
                call.result()  # the first refusal ends the run, with its message
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    results = [call.result() for call in calls]
    accuracy = round(100 * sum(ok for ok, _ in results) / len(items), 3)
    task_call = {k: round(v, 3) for k, v in latency_stats([s for _, s in results]).items()}
    return {"accuracy": accuracy, "count": len(items), "task_call_ms": task_call}
