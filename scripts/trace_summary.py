"""Summary of a `mambatrt serve --trace FILE` run: where the engine's iterations spent their time.

Usage: python scripts/trace_summary.py TRACE.jsonl[.gz] [SLOWEST]
Prints the iterations' prefill and decode milliseconds (percentiles; the prefill iterations also by how many
prompts they admitted to slots; the decode iterations split into the launch and the host work after it, in traces
since session 11), the time between iterations (the engine thread outside its launches: waiting for work, for
the GIL, emitting), how many sequences ran per iteration (weighted by time), the mean period and its parts by how
many sequences ran and whether the iteration admitted prompts (since session 23), the iterations with 17 sequences
or more beside a prefill launch in flight, alone and admitting (session 25), the decode launches' time on the device
and the decode stream's idle time before each (CUDA, session 26), the prefill launches by shape
(prompts x rows, from staging row 0 or not), and the SLOWEST (default 8) iterations with their launches.
"""

import collections
import gzip
import json
import sys

import numpy as np

# levels of sequences running (inclusive ranges) by which the periods and device times are split
LEVELS = ((1, 1), (2, 16), (17, 39), (40, 72), (73, 10**9))


def span_label(lo: int, hi: int) -> str:
    """A range's label: "3", "1-4" or, open-ended, "5+"."""
    return f"{lo}" if lo == hi else f"{lo}+" if hi > 10**6 else f"{lo}-{hi}"


def main() -> None:
    opener = gzip.open if sys.argv[1].endswith(".gz") else open  # the traces kept in benchmarks/ are gzipped
    with opener(sys.argv[1], "rt") as f:
        records = [json.loads(line) for line in f]
    slowest = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    if len(records) < 2:
        print("fewer than two iterations recorded")
        return
    t = np.array([r["t_ms"] for r in records])
    pre = np.array([r["prefill_ms"] for r in records])
    dec = np.array([r["decode_ms"] for r in records])
    busy = pre + dec
    gap = t[1:] - (t[:-1] + busy[:-1])
    span = t[-1] + busy[-1] - t[0]
    running = np.array([r["running"] for r in records])

    def pct(x: np.ndarray) -> str:
        p50, p90, p99 = np.percentile(x, [50, 90, 99])
        return f"p50 {p50:7.3f}  p90 {p90:7.3f}  p99 {p99:7.3f}  max {x.max():8.3f}"

    with_prefill = pre > 0.05
    print(f"{len(records)} iterations over {span / 1e3:.2f} s; {with_prefill.mean() * 100:.0f} % with a prefill launch")
    print(
        f"busy (prefill + decode) {busy.sum() / span * 100:.0f} % of the span; "
        f"between iterations {gap.sum() / span * 100:.0f} %"
    )
    print(f"prefill ms (iterations with one): {pct(pre[with_prefill]) if with_prefill.any() else '-'}")
    print(f"decode ms:                        {pct(dec)}")
    if "launch_ms" in records[0]:
        launch = np.array([r["launch_ms"] for r in records])
        decoding = dec > 0
        print(f"  its launch ms:                  {pct(launch[decoding])}")
        print(f"  its host work ms:               {pct((dec - launch)[decoding])}")
    print(f"between iterations ms:            {pct(gap)}")
    handoff = np.array([r.get("handoff_ms", 0.0) for r in records])
    if (handoff > 0).any():  # traces since session 19: overlapped prefill launches done, not yet taken
        print(f"prefill done -> taken ms ({(handoff > 0).sum():5d}): {pct(handoff[handoff > 0])}")
    held = np.array([r.get("held", 0) for r in records])
    if (held > 0).any():  # traces since session 20: prompts held back to gather (serve --waiting-served-ratio)
        print(
            f"iterations holding prompts back: {(held > 0).sum()} ({(held > 0).mean() * 100:.0f} %), "
            f"prompts held p50 {np.median(held[held > 0]):.0f} max {held.max()}"
        )
    weights = busy / busy.sum()
    print(
        f"sequences running: mean {running.mean():.1f}, "
        f"time-weighted {float((running * weights).sum()):.1f}, max {running.max()}"
    )
    admitted = np.array([r.get("admitted", 0) for r in records])  # traces since session 10
    if "admitted" in records[0]:  # the prefill iterations by prompts admitted to slots
        for lo, hi in ((0, 0), (1, 4), (5, 10**9)):
            pick = with_prefill & (admitted >= lo) & (admitted <= hi)
            if pick.any():
                print(f"prefill ms, {span_label(lo, hi):>3} admitted ({pick.sum():4d}):  {pct(pre[pick])}")
    if "admitted" in records[0] and "launch_ms" in records[0]:  # session 23: a level's iterations, apart
        period = np.r_[np.diff(t), np.nan]  # from an iteration's start to the next one's
        period[:-1][gap > 50] = np.nan  # not where the engine then idled (between a client's levels)
        launch = np.array([r["launch_ms"] for r in records])
        beside = np.array([r.get("beside_ms", np.nan) for r in records])  # traces since session 24
        cache = np.array([r.get("cache_ms", np.nan) for r in records])  # traces since session 25
        print("by sequences running, mean ms: period (prefill / launch / host work / between), none or some admitted")
        if not np.isnan(beside).all():
            print("  [prefill: before the decode launch began + after it, beside it where pipelined]")
        if not np.isnan(cache).all():
            print("  {the prefix cache's fills, part of prefill and host work}")
        for lo, hi in LEVELS:
            level = (running >= lo) & (running <= hi)
            parts = []
            for label, pick in (("none", level & (admitted == 0)), ("some", level & (admitted > 0))):
                if pick.any():
                    prefill = f"{pre[pick].mean():.3f}"
                    if not np.isnan(beside[pick]).all():
                        after = np.nanmean(beside[pick])
                        prefill = f"{pre[pick].mean() - after:.3f} + {after:.3f}"
                    rest = (launch[pick].mean(), (dec - launch)[pick].mean(), np.nanmean(gap[pick[:-1]]))
                    text = " / ".join([prefill, *(f"{m:.3f}" for m in rest)])
                    if not np.isnan(cache[pick]).all():
                        text += f" {{{np.nanmean(cache[pick]):.3f}}}"
                    parts.append(f"{label} {pick.sum():5d}: {np.nanmean(period[pick]):6.3f} ({text})")
            if parts:
                print(f"  {span_label(lo, hi):>5} running: " + "; ".join(parts))
        # a prefill launch in flight: from the iteration that planned it (its launches) to the one that took its
        # results (handoff_ms > 0; traces since session 19); an approximation where launches follow each other
        flight, in_flight = False, np.zeros(len(records), bool)
        for i, r in enumerate(records):
            if r.get("handoff_ms", 0.0) > 0:
                flight = False
            in_flight[i] = flight
            if r["launches"]:
                flight = True
        print("by sequences running, iterations beside a prefill launch, alone, admitting: n, mean period ms (share)")
        for lo, hi in LEVELS[2:]:  # 17 sequences and more
            level = (running >= lo) & (running <= hi) & ~np.isnan(period)
            total = period[level].sum()
            parts = []
            for label, pick in (
                ("beside", level & in_flight & (admitted == 0)),
                ("alone", level & ~in_flight & (admitted == 0)),
                ("admitting", level & (admitted > 0)),
            ):
                if pick.any():
                    share = period[pick].sum() / total * 100
                    parts.append(f"{label} {pick.sum()}, {period[pick].mean():.3f} ({share:.0f} %)")
            if parts:
                print(f"  {span_label(lo, hi):>5} running: " + "; ".join(parts))
    if any("gpu_ms" in r for r in records):  # traces since session 26: the decode launches timed on the device
        gpu = np.array([r.get("gpu_ms", np.nan) for r in records])
        idle = np.array([r.get("idle_ms", np.nan) for r in records])
        print("by sequences running, the decode launch ended in the iteration, on the device: n, mean ms on the")
        print("  device, mean ms its stream stood idle before it (p50 / p90), none or some admitted")
        for lo, hi in LEVELS:
            level = (running >= lo) & (running <= hi) & ~np.isnan(gpu) & ~np.isnan(idle)
            parts = []
            for label, pick in (("none", level & (admitted == 0)), ("some", level & (admitted > 0))):
                if pick.any():
                    p50, p90 = np.percentile(idle[pick], [50, 90])
                    parts.append(
                        f"{label} {pick.sum():5d}: {gpu[pick].mean():.3f}, idle {idle[pick].mean():.3f}"
                        f" ({p50:.3f} / {p90:.3f})"
                    )
            if parts:
                print(f"  {span_label(lo, hi):>5} running: " + "; ".join(parts))
    shapes = collections.Counter()
    for r in records:
        for start, k, rows in r["launches"]:
            shapes[(k, rows, start == 0)] += 1
    print("prefill launches (prompts x rows, from row 0): count")
    for (k, rows, zero), n in sorted(shapes.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {k:3d} x {rows:3d} {'row 0' if zero else 'other'}: {n}")
    print(f"slowest {slowest} iterations:")
    for i in np.argsort(busy)[::-1][:slowest]:
        r = records[i]
        print(
            f"  t {r['t_ms']:9.1f} ms: prefill {r['prefill_ms']:8.3f} decode {r['decode_ms']:7.3f} "
            f"running {r['running']:3d} staged {r['staged']:2d} waiting {r['waiting']:3d} launches {r['launches']}"
        )


if __name__ == "__main__":
    main()
