"""Profile a bundle's graphs on the onnxruntime CUDA EP: time per op type, kernel count, CPU-placed nodes.

Usage: [GRAPHS=fused|kernels] python scripts/ort_profile.py BUNDLE_DIR ROWS[,ROWS...]   (rows 1 = the decode graph)
"""

import collections
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

from mambatrt.runtime.backends import StateLayout, cuda_provider_options, session_options
from mambatrt.runtime.bundle import load_bundle


def cuda_session(bundle, graph: str, rows: int, opts: ort.SessionOptions, batch: int = 1, stream: int | None = None):
    """A plain CUDA EP session (TF32 off) on one of the bundle's graphs, and a feed of ``rows`` tokens (decode:
    ``batch`` sequences of one token; prefill: ``batch`` prompts of ``rows``), zero states. ``stream``: the session's
    compute stream (a CUDA stream handle; the kernels graphs' default: the kernels library's one stream)."""
    flavour = os.environ.get("GRAPHS", "portable")  # or "fused", "kernels"
    options = cuda_provider_options(bundle, flavour, stream)
    if stream is not None:
        options["user_compute_stream"] = str(stream)
    prov = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    opts = session_options(ort, bundle, flavour, options=opts)
    sess = ort.InferenceSession(str(bundle.graph_path(graph, flavour, cuda=True)), opts, providers=prov)
    c = bundle.config
    lead = (batch,) if bundle.manifest.batched else ()
    conv, ssm = (np.zeros(lead + shape, np.float32) for shape in (c.conv_state_shape, c.ssm_state_shape))
    layout = StateLayout(bundle.contract(graph, flavour), c)  # each layer's states, where the graph takes them so
    feed = {"token_ids": np.arange(rows * batch, dtype=np.int64) % c.vocab_size, **layout.feed(conv, ssm)}
    return sess, feed


def profile(bundle, graph, rows):
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    opts.log_severity_level = 3
    sess, feed = cuda_session(bundle, graph, rows, opts)
    runs = 8
    for _ in range(3):
        sess.run(None, feed)
    t = time.perf_counter()
    for _ in range(runs - 3):
        sess.run(None, feed)
    wall = (time.perf_counter() - t) / (runs - 3) * 1e3
    events = json.load(open(sess.end_profiling()))
    by_op, count, cpu_nodes = collections.Counter(), collections.Counter(), set()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            args = e.get("args", {})
            op = args.get("op_name", "?")
            by_op[op] += e["dur"]
            count[op] += 1
            if args.get("provider") == "CPUExecutionProvider":
                cpu_nodes.add(f"{op}:{e['name'][:-12]}")
    total = sum(by_op.values()) / runs / 1e3
    top = ", ".join(f"{k} {v / runs / 1e3:.2f} ({count[k] // runs})" for k, v in by_op.most_common(40))
    print(f"{graph} rows={rows}: wall {wall:.2f} ms/run (plain run, host I/O), kernels {sum(count.values()) // runs}, ")
    print(f"   kernel time {total:.2f} ms/run; by op type, ms (nodes): {top}")
    print(f"   CPU-placed nodes ({len(cpu_nodes)}): {sorted(cpu_nodes)[:12]}")


if __name__ == "__main__":
    b = load_bundle(sys.argv[1], verify=False)
    for rows in [int(r) for r in sys.argv[2].split(",")]:
        profile(b, "prefill" if rows > 1 else "decode", rows)
