"""GPU time per kernel of a bundle's graphs on the onnxruntime CUDA EP, traced with torch.profiler (CUPTI).

onnxruntime's own profiler times nodes from the host; this one reads the kernels' durations on the GPU, which is
what a captured CUDA graph replays (the launch gaps between kernels are what capture removes).

Usage: [GRAPHS=fused|kernels] [ORDER=n] python scripts/gpu_kernels.py BUNDLE_DIR ROWS[,ROWS...]
(rows 1 = the decode graph, 1xB = a decode launch of B sequences, RxK = a prefill launch of K prompts of R rows;
needs torch with CUDA; ORDER=n also prints the first n kernels of one run in launch order, which ties a kernel name
to its node)
"""

import collections
import os
import sys

import onnxruntime as ort
import torch
from ort_profile import cuda_session  # this folder (python puts a script's folder first on sys.path)
from torch.profiler import ProfilerActivity, profile

from mambatrt.runtime.bundle import load_bundle


def kernels(bundle, graph: str, rows: int, runs: int = 5, batch: int = 1) -> None:
    """Print GPU time per run, kernel count per run and the kernels that take the most GPU time."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess, feed = cuda_session(bundle, graph, rows, opts, batch)
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


if __name__ == "__main__":
    b = load_bundle(sys.argv[1], verify=False)
    for item in sys.argv[2].split(","):
        r, _, batch = item.partition("x")
        kernels(b, "prefill" if int(r) > 1 else "decode", int(r), batch=int(batch or 1))
