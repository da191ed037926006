"""``mambatrt bench``: prefill and decode timings of a bundle, chunked vs token by token, with the same boundaries.

For each prompt length, after ``warmup`` untimed runs, ``repeat`` runs of each path report the median and the
spread (min..max) of: prefill ms (first chunk submitted -> last chunk's logits on the host, so the final state
update is complete), time to first token, and decode ms/token over decode steps only.
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

    @classmethod
    def from_dict(cls, d: dict) -> Stat:
        """Inverse of :meth:`to_dict`."""
        return cls(d["median"], d["min"], d["max"])


@dataclass
class PathTiming:
    """One path (chunked or token by token) at one prompt length."""

    prefill_ms: Stat
    ttft_ms: Stat
    launches: int
    decode_ms_per_token: Stat | None = None

    @classmethod
    def from_dict(cls, d: dict) -> PathTiming:
        """Inverse of :meth:`to_dict`."""
        decode = d.get("decode_ms_per_token")
        return cls(
            Stat.from_dict(d["prefill_ms"]),
            Stat.from_dict(d["ttft_ms"]),
            d["launches"],
            decode and Stat.from_dict(decode),
        )

    def to_dict(self) -> dict:
        """JSON form (``decode_ms_per_token`` only when measured)."""
        d = {"prefill_ms": self.prefill_ms.to_dict(), "ttft_ms": self.ttft_ms.to_dict(), "launches": self.launches}
        if self.decode_ms_per_token is not None:
            d["decode_ms_per_token"] = self.decode_ms_per_token.to_dict()
        return d


def bench_path(
    backend: Backend, prompt: np.ndarray, new_tokens: int, repeat: int, warmup: int, token_by_token: bool
) -> PathTiming:
    """Time one path (chunked or token by token) on ``backend``."""
    gen = Generator(backend, eos_id=None, token_by_token=token_by_token)
    sampling = Sampling(max_new_tokens=new_tokens, stop_on_eos=False)
    for _ in range(warmup):
        gen.generate(prompt, sampling)
    runs = [gen.generate(prompt, sampling) for _ in range(repeat)]
    return PathTiming(
        prefill_ms=Stat.of([r.prefill_ms for r in runs]),
        ttft_ms=Stat.of([r.ttft_ms for r in runs]),
        launches=runs[0].prefill_launches,
        decode_ms_per_token=Stat.of([r.decode_ms_per_token for r in runs]) if new_tokens > 1 else None,
    )


def _median(stat: Stat | dict) -> float:
    """The median of a :class:`Stat` or of its JSON form."""
    return stat.median if isinstance(stat, Stat) else stat["median"]


def _get(timing, key: str):
    return getattr(timing, key) if isinstance(timing, PathTiming) else timing.get(key)


def speedups(row: dict) -> dict:
    """How many times faster the split path is, from one row of medians (only the ratios the row has sides for).

    ``prefill_vs_token_by_token``: token-by-token prefill / split prefill (the same bundle); ``prefill_vs_hf`` and
    ``decode_vs_hf``: HF's prefill and decode time over the split path's. ``row`` holds :class:`PathTiming` objects
    (while benchmarking) or their JSON form (a ``bench --json`` file, also older ones without a recorded "speedup").
    """
    split, tbt, hf = row.get("split"), row.get("token_by_token"), row.get("hf")
    out = {}
    if split and tbt:
        out["prefill_vs_token_by_token"] = _median(_get(tbt, "prefill_ms")) / _median(_get(split, "prefill_ms"))
    if split and hf:
        out["prefill_vs_hf"] = hf["prefill_ms"] / _median(_get(split, "prefill_ms"))
        decode = _get(split, "decode_ms_per_token")
        if decode and hf.get("decode_ms_per_token"):
            out["decode_vs_hf"] = hf["decode_ms_per_token"] / _median(decode)
    return out


def row_line(row: dict, ratios: dict | None = None) -> str:
    """One prompt length as the text output's line: each path's medians and the split path's speedups
    (``ratios``, by default all those of :func:`speedups`)."""
    parts = [f"prompt {row['prompt_len']:4d}:"]
    for key in ("split", "token_by_token"):
        if row.get(key):
            r = row[key]
            d = r.decode_ms_per_token
            parts.append(
                f"{key} prefill {r.prefill_ms.median:8.2f} ms ({r.launches} launches)"
                + (f", decode {d.median:.3f} ms/tok" if d else "")
            )
    if row.get("hf"):
        parts.append(f"hf prefill {row['hf']['prefill_ms']:.2f} ms, decode {row['hf']['decode_ms_per_token']:.3f}")
    ratios = speedups(row) if ratios is None else ratios
    if ratios:
        parts.append(
            "split speedup: "
            + ", ".join(f"{k.replace('_vs_', ' vs ').replace('_', ' ')} {v:.1f}x" for k, v in ratios.items())
        )
    return "  ".join(parts)


@dataclass
class BenchResult:
    """What ``mambatrt bench`` measured, with what it ran on; :meth:`to_dict` is the ``--json`` object.

    ``rows``: one dict per prompt length with "prompt_len", "split" (split bundles), "token_by_token" (both
    :class:`PathTiming`) and "hf" (with ``--reference hf``).
    """

    bundle: str
    layout: str
    precision: str
    prefill_scan: str | None
    backend: str
    device: str
    cuda_graph: dict
    notes: list
    machine: dict
    repeat: int
    new_tokens: int
    rows: list[dict] = field(default_factory=list)
    graphs: str | None = None  # the graph flavour onnxruntime ran (None: files from before flavours, or TensorRT)

    def to_dict(self) -> dict:
        """The JSON object (``scripts/bench_table.py`` reads it back); speedups rounded to 3 decimals."""

        def row_dict(row: dict) -> dict:
            out = {k: (v.to_dict() if isinstance(v, PathTiming) else v) for k, v in row.items() if v is not None}
            return {**out, "speedup": {k: round(v, 3) for k, v in speedups(row).items()}}

        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        return {**d, "results": [row_dict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: dict) -> BenchResult:
        """Read a ``bench --json`` object back (older files: missing fields are None or empty)."""
        rows = []
        for r in d["results"]:
            row = {"prompt_len": r["prompt_len"]}
            for key in ("split", "token_by_token"):
                if r.get(key):
                    row[key] = PathTiming.from_dict(r[key])
            if r.get("hf"):
                row["hf"] = r["hf"]
            rows.append(row)
        fields = {f.name for f in dataclasses.fields(cls)} - {"rows"}
        return cls(**{k: d.get(k) for k in fields}, rows=rows)


def run_bench(
    backend: Backend,
    prompt_lengths: list[int],
    new_tokens: int,
    repeat: int,
    warmup: int,
    on_row: Callable[[dict], None] | None = None,
) -> BenchResult:
    """Time every prompt length on ``backend``: the split path (split bundles) and token by token.

    Prompts are random ids seeded by their length, so every run (and the HF reference) sees the same prompts.
    ``on_row`` is called with each row as soon as it is measured (progress).
    """
    bundle = backend.bundle
    result = BenchResult(
        bundle=str(bundle.path),
        layout=bundle.layout,
        precision=bundle.precision,
        prefill_scan=bundle.manifest.prefill_scan,
        backend=backend.name,
        device=backend.device,
        graphs=backend.flavour if backend.name == "ort" else None,
        cuda_graph=dict(getattr(backend, "captured", {})),
        notes=list(getattr(backend, "notes", [])),
        machine=machine_facts(backend.device),
        repeat=repeat,
        new_tokens=new_tokens,
    )
    for n in prompt_lengths:
        prompt = bench_prompt(bundle.config.vocab_size, n)
        row: dict = {"prompt_len": n}
        if PREFILL in bundle.graphs:
            row["split"] = bench_path(backend, prompt, new_tokens, repeat, warmup, False)
        row["token_by_token"] = bench_path(backend, prompt, new_tokens, repeat, warmup, True)
        result.rows.append(row)
        if on_row is not None:
            on_row(row)
    result.cuda_graph = dict(getattr(backend, "captured", {}))  # after the runs: a failed capture falls back
    result.notes = list(getattr(backend, "notes", []))
    return result


def bench_prompt(vocab: int, length: int) -> np.ndarray:
    """The benchmark's prompt of ``length`` random ids, seeded by the length."""
    return np.random.default_rng(length).integers(0, vocab, length)


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
