"""Profile a bundle's graphs on the onnxruntime CUDA EP: time per op type, and nodes that fell back to the CPU.

Usage: python scripts/ort_profile.py BUNDLE_DIR ROWS[,ROWS...]  (prints a summary; writes nothing else)
"""

import collections
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

from mambatrt.runtime.bundle import load_bundle


def profile(bundle, graph, rows, algo):
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    opts.log_severity_level = 3
    prov = [("CUDAExecutionProvider", {"use_tf32": "0", "cudnn_conv_algo_search": algo}), "CPUExecutionProvider"]
    sess = ort.InferenceSession(str(bundle.graph_path(graph)), opts, providers=prov)
    c = bundle.config
    feed = {
        "token_ids": np.arange(rows, dtype=np.int64) % c.vocab_size,
        "conv_state": np.zeros(c.conv_state_shape, np.float32),
        "ssm_state": np.zeros(c.ssm_state_shape, np.float32),
    }
    for _ in range(3):
        sess.run(None, feed)
    t = time.perf_counter()
    n = 5
    for _ in range(n):
        sess.run(None, feed)
    wall = (time.perf_counter() - t) / n * 1e3
    path = sess.end_profiling()
    events = json.load(open(path))
    by_op, cpu_nodes = collections.Counter(), set()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            args = e.get("args", {})
            by_op[args.get("op_name", "?")] += e["dur"]
            if args.get("provider") == "CPUExecutionProvider":
                cpu_nodes.add(f"{args.get('op_name')}:{e['name'][:-12]}")
    runs = 8
    top = ", ".join(f"{k} {v / runs / 1e3:.2f}" for k, v in by_op.most_common(8))
    print(f"{graph} rows={rows} algo={algo}: wall {wall:.2f} ms/run; top ops (ms/run) {top}")
    print(f"   CPU fallback nodes ({len(cpu_nodes)}): {sorted(cpu_nodes)[:12]}")


if __name__ == "__main__":
    b = load_bundle(sys.argv[1], verify=False)
    for rows in [int(r) for r in sys.argv[2].split(",")]:
        for algo in ("DEFAULT", "EXHAUSTIVE"):
            profile(b, "prefill" if rows > 1 else "decode", rows, algo)
