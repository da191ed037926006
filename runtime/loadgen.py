"""A load client for OpenAI-compatible completion servers, reporting what AIPerf reports (as ``vllm bench serve``
is vLLM's): for where AIPerf, with its many dependencies, cannot be installed (a GPU machine without a registry).

Each of ``concurrency`` workers sends streaming requests back to back (synthetic prompts of random token ids,
``ignore_eos`` so every request produces ``output_tokens``), until ``requests`` have been sent; several URLs are
used round robin (replicas behind no balancer). The figures follow AIPerf's definitions:

- time to first token: from sending the request to the first streamed chunk that carries a token;
- inter-token latency of a request: (last token's time - first token's time) / (output tokens - 1);
- output token throughput: all output tokens / (last response's end - first request's start); requests/s alike;
- percentiles over requests, linear interpolation (numpy's default, as AIPerf).

The streaming requests go through aiohttp (AIPerf's HTTP client too): httpx's connection pool, which this client
used first, held requests back for seconds at concurrency 64 and more (at 128, p99 6.3 s from sending to the
response's headers, against 0.15 s with aiohttp and a hand-written HTTP/1.1 client, to the same server), which
had capped every measured throughput there. Needs aiohttp and httpx (in ``mambatrt[serve]``) and numpy; nothing of
the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from mambatrt import envs
from mambatrt.errors import InputError

PROMPT_VOCAB = 1000  # prompt ids are drawn from [0, PROMPT_VOCAB): every model's vocabulary holds them


@dataclass
class RequestRecord:
    """One request's timings (seconds, perf_counter) and tokens."""

    start: float
    first: float | None = None
    last: float | None = None
    end: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class LoadResult:
    """Figures of one concurrency level, AIPerf's names where AIPerf has one (ms for latencies)."""

    concurrency: int
    requests: int
    errors: int
    duration_s: float
    output_token_throughput: float
    request_throughput: float
    time_to_first_token: dict[str, float] = field(default_factory=dict)  # p50, p99, avg (ms)
    inter_token_latency: dict[str, float] = field(default_factory=dict)
    output_sequence_length: float = 0.0

    def row(self) -> str:
        t, i = self.time_to_first_token, self.inter_token_latency
        return (
            f"| {self.concurrency} | {self.requests} | {self.output_token_throughput:.2f} | "
            f"{self.request_throughput:.2f} | {t['p50']:.2f} | {t['p99']:.2f} | {i['p50']:.2f} | {i['p99']:.2f} | "
            f"{self.output_sequence_length:.2f} | {self.errors} |"
        )


TABLE_HEAD = (
    "| concurrency | requests | output tokens/s | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
    "| output tokens/request | errors |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


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


def latency_stats(values: list[float]) -> dict[str, float]:
    """p50, p99 and mean of latencies in seconds, in ms (NaN where there are none)."""
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "avg": float("nan")}
    a = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "avg": float(a.mean())}


async def _one(session, url: str, body: dict) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    try:
        await _read_stream(session, url, body, record)
    except Exception as exc:  # aiohttp's and the transport's own types: recorded, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return record


async def _read_stream(session, url: str, body: dict, record: RequestRecord) -> None:
    """One streamed request's tokens into ``record`` (its error where the server refused it)."""
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            record.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return
        pending = b""
        async for data in response.content.iter_any():  # server-sent events, split into lines here
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                tokens = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if tokens:
                    now = time.perf_counter()
                    record.first = record.first or now
                    record.last = now
                    record.output_tokens += tokens


async def _level(
    urls: list[str], model: str, concurrency: int, requests: int, isl: int, osl: int, vocab: int, seed, temperature
):
    import aiohttp

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, isl).tolist() for _ in range(requests)]
    todo = iter(range(requests))
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=concurrency * len(urls) + 4)
    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=api_headers()) as session:

        async def worker():
            for i in todo:
                body = {
                    "model": model,
                    "prompt": prompts[i],
                    "max_tokens": osl,
                    "stream": True,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "temperature": temperature,
                }
                records.append(await _one(session, urls[i % len(urls)], body))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def run_level(
    urls, model, concurrency, requests, isl, osl, vocab=PROMPT_VOCAB, seed=0, temperature=0.0
) -> tuple[LoadResult, list[str]]:
    """One concurrency level against the server(s), blocking until every request ended; (figures, errors). Prompt
    ids are drawn from [0, vocab). ``temperature``: 0 greedy; above, sampled without a seed (as AIPerf, which sends
    none: the OpenAI default 1)."""
    records = asyncio.run(_level(urls, model, concurrency, requests, isl, osl, vocab, seed, temperature))
    ok = [r for r in records if r.error is None and r.first is not None]
    start = min(r.start for r in records)
    end = max(r.end for r in records)
    duration = end - start
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [(r.last - r.first) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return LoadResult(
        concurrency=concurrency,
        requests=len(ok),
        errors=len(records) - len(ok),
        duration_s=duration,
        output_token_throughput=out_tokens / duration,
        request_throughput=len(ok) / duration,
        time_to_first_token=latency_stats([r.first - r.start for r in ok]),
        inter_token_latency=latency_stats(itl),
        output_sequence_length=out_tokens / max(len(ok), 1),
    ), [r.error for r in records if r.error is not None]


def served_models(url: str) -> list[str]:
    """The model names a server at ``url`` serves (GET /v1/models); InputError when no OpenAI-compatible server
    answers there."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", headers=api_headers(), timeout=10)
        if response.status_code != 200:
            raise refusal(url, response)
        return [m.get("id") for m in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError) as exc:
        raise InputError(f"{url}: no OpenAI-compatible server answers ({exc}); start `mambatrt serve`") from None
