"""``mambatrt bench``: prefill and decode timings of a bundle through the engine, chunked and token by token.

For each prompt length, after a warm-up run, ``repeat`` runs of each path report the median and the spread
(min..max) of the prefill ms (the request submitted -> its first token picked: the final state update is complete)
and of the decode ms/token (:mod:`mambatrt.runtime.generation`). The text output is a Markdown table.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mambatrt.contract import PREFILL

from .engine import Engine, EngineConfig, Sampling
from .generation import generate
from .runners import Runner

WARMUP_RUNS = 1


@dataclass
class Stat:
    """Median and spread of repeated measurements (ms)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        """Summarize ``values``."""
        return cls(statistics.median(values), min(values), max(values))

    def to_dict(self) -> dict:
        """JSON form."""
        return {"median": round(self.median, 4), "min": round(self.low, 4), "max": round(self.high, 4)}


@dataclass
class PathTiming:
    """One path (chunked or token by token) at one prompt length."""

    prefill_ms: Stat
    launches: int
    decode_ms_per_token: Stat | None = None

    def to_dict(self) -> dict:
        """JSON form (``decode_ms_per_token`` only when measured)."""
        d = {"prefill_ms": self.prefill_ms.to_dict(), "launches": self.launches}
        if self.decode_ms_per_token is not None:
            d["decode_ms_per_token"] = self.decode_ms_per_token.to_dict()
        return d


def bench_path(runner: Runner, prompt: list[int], new_tokens: int, repeat: int, token_by_token: bool) -> PathTiming:
    """Time one path (chunked, or token by token on the decode graph) on ``runner``."""
    engine = Engine(runner, EngineConfig(max_batch=1, token_by_token=token_by_token))
    sampling = Sampling(max_new_tokens=new_tokens, stop_on_eos=False)
    for _ in range(WARMUP_RUNS):
        generate(engine, prompt, sampling)
    runs = [generate(engine, prompt, sampling) for _ in range(repeat)]
    return PathTiming(
        prefill_ms=Stat.of([r.prefill_ms for r in runs]),
        launches=runs[0].prefill_launches,
        decode_ms_per_token=Stat.of([r.decode_ms_per_token for r in runs]) if new_tokens > 1 else None,
    )


def speedups(row: dict) -> dict:
    """How many times faster the split path is, from one row of :class:`PathTiming` s (only the ratios the row has
    sides for): ``prefill_vs_token_by_token`` on the same bundle; ``prefill_vs_hf`` and ``decode_vs_hf``, HF's time
    over the split path's (``--reference hf``)."""
    split, tbt, hf = row.get("split"), row.get("token_by_token"), row.get("hf")
    out = {}
    if split and tbt:
        out["prefill_vs_token_by_token"] = tbt.prefill_ms.median / split.prefill_ms.median
    if split and hf:
        out["prefill_vs_hf"] = hf["prefill_ms"] / split.prefill_ms.median
        if split.decode_ms_per_token and hf.get("decode_ms_per_token"):
            out["decode_vs_hf"] = hf["decode_ms_per_token"] / split.decode_ms_per_token.median
    return out


TABLE_HEAD = (
    "| prompt | prefill ms (launches) | token by token ms | decode ms/token | HF prefill ms | HF decode ms/token "
    "| speedups |\n| ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)


def table_row(row: dict) -> str:
    """One prompt length as a row of :data:`TABLE_HEAD`: medians, and the split path's speedups."""
    split, tbt, hf = row.get("split"), row.get("token_by_token"), row.get("hf") or {}
    main = split or tbt
    decode = main.decode_ms_per_token if main else None
    cells = [
        str(row["prompt_len"]),
        f"{split.prefill_ms.median:.2f} ({split.launches})" if split else "",
        f"{tbt.prefill_ms.median:.2f}" if tbt else "",
        f"{decode.median:.3f}" if decode else "",
        f"{hf['prefill_ms']:.2f}" if hf else "",
        f"{hf['decode_ms_per_token']:.3f}" if hf.get("decode_ms_per_token") else "",
        ", ".join(f"{k.replace('_vs_', ' vs ').replace('_', ' ')} {v:.1f}x" for k, v in speedups(row).items()),
    ]
    return "| " + " | ".join(cells) + " |"


@dataclass
class BenchResult:
    """What ``mambatrt bench`` measured, with what it ran on; :meth:`to_dict` is the ``--json`` object.

    ``rows``: one dict per prompt length with "prompt_len", "split" (split bundles), "token_by_token" (both
    :class:`PathTiming`) and "hf" (with ``--reference hf``).
    """

    bundle: str
    layout: str
    precision: str
    runner: str
    device: str
    graphs: str
    cuda_graph: dict
    notes: list
    machine: dict
    repeat: int
    new_tokens: int
    rows: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The JSON object; speedups rounded to 3 decimals."""

        def row_dict(row: dict) -> dict:
            out = {k: (v.to_dict() if isinstance(v, PathTiming) else v) for k, v in row.items() if v is not None}
            return {**out, "speedup": {k: round(v, 3) for k, v in speedups(row).items()}}

        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        return {**d, "results": [row_dict(r) for r in self.rows]}


def run_bench(
    runner: Runner, prompt_lengths: list[int], new_tokens: int, repeat: int, on_row: Callable[[dict], None] | None
) -> BenchResult:
    """Time every prompt length on ``runner``: the split path (split bundles) and token by token. Prompts are random
    ids seeded by their length, so every run (and the HF reference) sees the same prompts; ``on_row`` is called with
    each row as soon as it is measured (progress)."""
    bundle = runner.bundle
    result = BenchResult(
        bundle=str(bundle.path),
        layout=bundle.layout,
        precision=bundle.precision,
        runner=runner.name,
        device=runner.device,
        graphs=runner.flavour,
        cuda_graph={},
        notes=[],
        machine=machine_facts(runner.device),
        repeat=repeat,
        new_tokens=new_tokens,
    )
    for n in prompt_lengths:
        prompt = bench_prompt(bundle.config.vocab_size, n)
        row: dict = {"prompt_len": n}
        if PREFILL in bundle.graphs:
            row["split"] = bench_path(runner, prompt, new_tokens, repeat, False)
        row["token_by_token"] = bench_path(runner, prompt, new_tokens, repeat, True)
        result.rows.append(row)
        if on_row is not None:
            on_row(row)
    result.cuda_graph = dict(getattr(runner, "captured", {}))  # after the runs: a failed capture falls back
    result.notes = list(runner.notes)
    return result


def bench_prompt(vocab: int, length: int) -> list[int]:
    """The benchmark's prompt of ``length`` random ids, seeded by the length."""
    return np.random.default_rng(length).integers(0, vocab, length).tolist()


def machine_facts(device: str) -> dict:
    """What the figures were measured on: host name, CPU model and count, and the GPU names for CUDA runs."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    facts = {"host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count()}
    if device == "cuda" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            facts["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return facts
