"""Print a `mambatrt bench --json` file as a Markdown table (the form BENCHMARKS.md uses).

Usage: python scripts/bench_table.py BENCH.json [...]
"""

import json
import sys

from mambatrt.runtime.bench import speedups


def ms(stat: dict | None) -> str:
    if not stat:
        return "-"
    return f"{stat['median']:.2f} ({stat['min']:.2f}-{stat['max']:.2f})"


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
    d = json.load(open(path))
    head = (
        f"{path}: {d['backend']}/{d['device']} {d['layout']} {d['precision']} scan={d.get('prefill_scan')}, "
        f"cuda_graph={d.get('cuda_graph')}, "
        f"{d['repeat']} repeats, {d['new_tokens']} new tokens, machine {machine(d['machine'])} {d.get('notes') or ''}\n"
    )
    rows = [
        "| prompt | split prefill ms | launches | token by token prefill ms | split decode ms/token "
        "| HF prefill ms | HF decode ms/token | speedup: vs token by token / vs HF prefill / vs HF decode |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in d["results"]:
        split, tbt, hf = r.get("split", {}), r.get("token_by_token", {}), r.get("hf", {})
        rows.append(
            f"| {r['prompt_len']} | {ms(split.get('prefill_ms'))} | {split.get('launches', '-')} "
            f"| {ms(tbt.get('prefill_ms'))} | {ms(split.get('decode_ms_per_token') or tbt.get('decode_ms_per_token'))} "
            f"| {num(hf.get('prefill_ms'))} | {num(hf.get('decode_ms_per_token'))} | {ratios(r)} |"
        )
    return head + "\n".join(rows)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
