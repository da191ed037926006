"""Print `mambatrt bench --json` files as Markdown tables (the form BENCHMARKS.md uses).

Usage: python scripts/bench_table.py BENCH.json [...]
"""

import json
import sys

from mambatrt.runtime.bench import BenchResult, PathTiming, Stat, speedups


def ms(stat: Stat | None) -> str:
    return "-" if stat is None else f"{stat.median:.2f} ({stat.low:.2f}-{stat.high:.2f})"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ratios(row: dict) -> str:
    """The split path's speedups (`mambatrt bench`'s own formula, so older files without them get them too)."""
    found = speedups(row)
    keys = ("prefill_vs_token_by_token", "prefill_vs_hf", "decode_vs_hf")
    return " / ".join(f"{found[k]:.1f}x" if k in found else "-" for k in keys)


def machine(m) -> str:
    if not isinstance(m, dict):  # older files: the host name only
        return str(m)
    return f"{', '.join(m.get('gpus') or []) or m.get('cpu')} ({m.get('cpu_count')} CPUs, host {m.get('host')})"


def table(path: str) -> str:
    r = BenchResult.from_dict(json.load(open(path)))
    head = (
        f"{path}: {r.backend}/{r.device} {r.layout} {r.precision} scan={r.prefill_scan} graphs={r.graphs}, "
        f"cuda_graph={r.cuda_graph}, "
        f"{r.repeat} repeats, {r.new_tokens} new tokens, machine {machine(r.machine)} {r.notes or ''}\n"
    )
    lines = [
        "| prompt | split prefill ms | launches | token by token prefill ms | split decode ms/token "
        "| HF prefill ms | HF decode ms/token | speedup: vs token by token / vs HF prefill / vs HF decode |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r.rows:
        split: PathTiming | None = row.get("split")
        tbt: PathTiming = row["token_by_token"]
        hf = row.get("hf") or {}
        decode = (split or tbt).decode_ms_per_token
        lines.append(
            f"| {row['prompt_len']} | {ms(split and split.prefill_ms)} | {split.launches if split else '-'} "
            f"| {ms(tbt.prefill_ms)} | {ms(decode)} "
            f"| {num(hf.get('prefill_ms'))} | {num(hf.get('decode_ms_per_token'))} | {ratios(row)} |"
        )
    return head + "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
