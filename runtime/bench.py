"""``mambatrt bench``: prefill and decode timings of a bundle, chunked vs token by token, with the same boundaries.

For each prompt length, after ``warmup`` untimed runs, ``repeat`` runs of each path report the median and the
spread (min..max) of: prefill ms (first chunk submitted -> last chunk's logits on the host, so the final state
update is complete), time to first token, and decode ms/token over decode steps only.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
from dataclasses import dataclass

import numpy as np

from mambatrt.runtime.backends import Backend
from mambatrt.runtime.generate import Generator, Sampling


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


def bench_path(backend: Backend, prompt: np.ndarray, new_tokens: int, repeat: int, warmup: int, token_by_token: bool):
    """Time one path (chunked or token by token) on ``backend``; returns a dict of Stats and launch count."""
    gen = Generator(backend, eos_id=None, token_by_token=token_by_token)
    sampling = Sampling(max_new_tokens=new_tokens, stop_on_eos=False)
    for _ in range(warmup):
        gen.generate(prompt, sampling)
    runs = [gen.generate(prompt, sampling) for _ in range(repeat)]
    out = {
        "prefill_ms": Stat.of([r.prefill_ms for r in runs]),
        "ttft_ms": Stat.of([r.ttft_ms for r in runs]),
        "launches": runs[0].prefill_launches,
    }
    if new_tokens > 1:
        out["decode_ms_per_token"] = Stat.of([r.decode_ms_per_token for r in runs])
    return out


def _median(stat: Stat | dict) -> float:
    """The median of a :class:`Stat` or of its JSON form."""
    return stat.median if isinstance(stat, Stat) else stat["median"]


def speedups(row: dict) -> dict:
    """How many times faster the split path is, from one row of medians (only the ratios the row has sides for).

    ``prefill_vs_token_by_token``: token-by-token prefill / split prefill (the same bundle); ``prefill_vs_hf`` and
    ``decode_vs_hf``: HF's prefill and decode time over the split path's. ``row`` holds :class:`Stat` objects (while
    benchmarking) or their JSON form (a ``bench --json`` file, also older ones without a recorded "speedup").
    """
    split, tbt, hf = row.get("split"), row.get("token_by_token"), row.get("hf")
    out = {}
    if split and tbt:
        out["prefill_vs_token_by_token"] = _median(tbt["prefill_ms"]) / _median(split["prefill_ms"])
    if split and hf:
        out["prefill_vs_hf"] = hf["prefill_ms"] / _median(split["prefill_ms"])
        if "decode_ms_per_token" in split and hf.get("decode_ms_per_token"):
            out["decode_vs_hf"] = hf["decode_ms_per_token"] / _median(split["decode_ms_per_token"])
    return out


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
