"""GPU time per kernel of a bundle's graphs on the onnxruntime CUDA EP, traced with torch.profiler (CUPTI).

onnxruntime's own profiler times nodes from the host; this one reads the kernels' durations on the GPU, which is
what a captured CUDA graph replays (the launch gaps between kernels are what capture removes).

Usage: [GRAPHS=fused|kernels] [ORDER=n] [BESIDE=RxK] python scripts/gpu_kernels.py BUNDLE_DIR ROWS[,ROWS...]
(rows 1 = the decode graph, 1xB = a decode launch of B sequences, RxK = a prefill launch of K prompts of R rows;
needs torch with CUDA; ORDER=n also prints the first n kernels of one run in launch order, which ties a kernel name
to its node). BESIDE=RxK (session 30): each decode launch's kernels timed alone and while prefill launches of K
prompts of R rows run on a lower-priority stream of their own, back to back, as a server runs them at concurrency 64:
which of the decode kernels a prefill launch stretches, and by how much.
"""

import collections
import os
import sys
import threading

import onnxruntime as ort
import torch
from ort_profile import cuda_session  # this folder (python puts a script's folder first on sys.path)
from torch.profiler import ProfilerActivity, profile

from mambatrt.runtime.bundle import load_bundle


def quiet() -> ort.SessionOptions:
    """Session options that keep onnxruntime's warnings out of the tables."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return opts


def kernels(bundle, graph: str, rows: int, runs: int = 5, batch: int = 1) -> None:
    """Print GPU time per run, kernel count per run and the kernels that take the most GPU time."""
    sess, feed = cuda_session(bundle, graph, rows, quiet(), batch)
    for _ in range(3):
        sess.run(None, feed)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            sess.run(None, feed)
        torch.cuda.synchronize()
    by_name, count = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:90]] += e.device_time
            count[e.name[:90]] += 1
    total = sum(by_name.values()) / runs / 1e3
    n = sum(count.values()) // runs
    each = total / max(n, 1) * 1e3
    print(f"{graph} rows={rows} batch={batch}: GPU time {total:.3f} ms/run in {n} kernels ({each:.2f} us each)")
    for name, us in by_name.most_common(18):
        print(f"   {us / runs:8.1f} us  {count[name] // runs:4d}x  {name}")
    first = int(os.environ.get("ORDER", "0"))
    if first:
        ordered = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start,
        )
        print(f"   the first {first} kernels of a run, in launch order:")
        for e in ordered[:first]:
            print(f"   {e.device_time:8.1f} us  {e.name[:100]}")


def beside(bundle, batch: int, rows: int, prompts: int, runs: int = 20) -> None:
    """Print the decode launch's kernels (``batch`` sequences, on a high-priority stream) by GPU time, alone and
    while prefill launches of ``prompts`` x ``rows`` run back to back on a low-priority stream (CUPTI's kernel
    durations: a kernel waiting for SMs held by the other stream's blocks lasts longer)."""
    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)  # as serve's decode and prefill streams
    dec, dfeed = cuda_session(bundle, "decode", 1, quiet(), batch, stream=high.cuda_stream)
    pre, pfeed = cuda_session(bundle, "prefill", rows, quiet(), prompts, stream=low.cuda_stream)
    for _ in range(3):
        dec.run(None, dfeed), pre.run(None, pfeed)
    torch.cuda.synchronize()
    stop = threading.Event()

    def prefill_loop() -> None:  # onnxruntime releases the GIL while it runs
        while not stop.is_set():
            pre.run(None, pfeed)

    def timed(with_prefill: bool) -> tuple[collections.Counter, collections.Counter]:
        """GPU us per kernel name over ``runs`` decode launches (and their count), after one launch alone that
        tells the decode stream's id in the trace (CUPTI's, the events' device_resource_id)."""
        thread = threading.Thread(target=prefill_loop) if with_prefill else None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.run(None, dfeed)
            torch.cuda.synchronize()
            if thread is not None:
                thread.start()
            for _ in range(runs):
                dec.run(None, dfeed)
            stop.set()
            if thread is not None:
                thread.join()
            torch.cuda.synchronize()
        stop.clear()
        events = sorted(
            (
                e
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
            ),
            key=lambda e: e.time_range.start,
        )
        stream = getattr(events[0], "device_resource_id", None)  # the first launch ran alone: all decode
        mine = [e for e in events if getattr(e, "device_resource_id", None) == stream]
        first = len(mine) // (runs + 1)  # the first launch's kernels, not counted
        by_name, count = collections.Counter(), collections.Counter()
        for e in mine[first:]:
            by_name[e.name[:90]] += e.device_time
            count[e.name[:90]] += 1
        # each run's span on the device, its first kernel's start to its last one's end: the kernels' time plus
        # the gaps in which the stream waited (for SMs held by the other stream's blocks, or for the host)
        chunks = [mine[i : i + first] for i in range(first, len(mine) - first + 1, first)]
        spans = sorted((c[-1].time_range.end - c[0].time_range.start) / 1e3 for c in chunks)
        return by_name, count, spans[len(spans) // 2]

    alone, n_alone, span_alone = timed(False)
    near, n_near, span_near = timed(True)
    if sum(n_near.values()) != sum(n_alone.values()):
        kinds = f"{sum(n_near.values())} kernels against {sum(n_alone.values())} alone"
        print(f"   (beside: {kinds}: the trace did not tell the two streams apart)")
    t_alone, t_near = sum(alone.values()) / runs / 1e3, sum(near.values()) / runs / 1e3
    print(
        f"decode batch={batch}: GPU time of its kernels {t_alone:.3f} ms/run alone, {t_near:.3f} beside prefill "
        f"{prompts}x{rows} (us per run, alone -> beside, the most stretched first)"
    )
    print(
        f"   a run's span on the device (first kernel's start to last one's end), median: {span_alone:.3f} ms alone, "
        f"{span_near:.3f} beside"
    )
    for name, us in sorted(alone.items(), key=lambda kv: near[kv[0]] - kv[1], reverse=True)[:18]:
        print(f"   {us / runs:8.1f} -> {near[name] / runs:8.1f} us  {n_alone[name] // runs:4d}x  {name}")


if __name__ == "__main__":
    b = load_bundle(sys.argv[1], verify=False)
    if os.environ.get("BESIDE"):
        r, _, k = os.environ["BESIDE"].partition("x")
        for item in sys.argv[2].split(","):
            beside(b, int(item.partition("x")[2] or 1), int(r), int(k or 1))
        sys.exit(0)
    for item in sys.argv[2].split(","):
        r, _, batch = item.partition("x")
        kernels(b, "prefill" if int(r) > 1 else "decode", int(r), batch=int(batch or 1))
