"""Print AIPerf result folders (profile_export_aiperf.json) as one Markdown table, a row per run.

Usage: python scripts/aiperf_table.py AIPERF_ARTIFACT_DIR [...]
"""

import json
import sys
from pathlib import Path


def concurrency(d: dict):
    phases = [p for p in d["input_config"].get("phases", []) if p.get("kind") == "profiling"]
    return phases[0].get("concurrency", "?") if phases else "?"


def row(d: dict) -> str:
    conc = concurrency(d)

    def stat(name: str, key: str) -> str:
        return f"{d[name][key]:.2f}" if name in d and key in d[name] else "-"

    errors = (d.get("error_request_count") or {}).get("avg", 0)
    return (
        f"| {conc} | {stat('request_count', 'avg')} | {stat('output_token_throughput', 'avg')} "
        f"| {stat('request_throughput', 'avg')} | {stat('time_to_first_token', 'p50')} "
        f"| {stat('time_to_first_token', 'p99')} | {stat('inter_token_latency', 'p50')} "
        f"| {stat('inter_token_latency', 'p99')} | {stat('output_sequence_length', 'avg')} | {errors:g} |"
    )


if __name__ == "__main__":
    print(
        "| concurrency | requests | output tokens/s | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | output tokens/request | errors |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    runs = [json.loads((Path(arg) / "profile_export_aiperf.json").read_text()) for arg in sys.argv[1:]]
    for d in sorted(runs, key=lambda d: (not isinstance(concurrency(d), int), concurrency(d))):  # c2 before c128
        print(row(d))
