"""Batched prefill through the serving engine's slot pool: k prompts' 64-row chunks per launch.

Usage: python scripts/gpu_batch_prefill.py BUNDLE_DIR [K,K,...] [auto|fused|kernels] [cuda|cpu]
(default 1,2,4,8,16, auto, cuda). Each launch is what `mambatrt serve` runs for k staged prompts
(``SlotPool.prefill``: the launch, the copy of the written rows back, the synchronization); a launch of full chunks
from staging row 0 is captured on CUDA when it repeats, as in the server. Prints ms per launch and prompt rows/s
per k, after checking the launch against k launches of one prompt (the same states and chunks).
"""

import sys
import time

import numpy as np

from mambatrt.contract import PREFILL
from mambatrt.runtime.backends import open_backend
from mambatrt.runtime.bundle import load_bundle


def main() -> None:
    bundle = load_bundle(sys.argv[1], verify=False)
    sizes = [int(k) for k in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16").split(",")]
    graphs = sys.argv[3] if len(sys.argv) > 3 else "auto"
    device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
    backend = open_backend(bundle, "ort", device, graphs=graphs)
    pool = backend.open_pool(max(2, max(sizes)))
    c, rows = bundle.config, bundle.max_prefill_rows
    print(f"{bundle.path} prefill graph, {backend.flavour} flavour, {device}: {pool.staging_rows} prompts per launch")
    for k in sizes:
        if k > pool.staging_rows:
            print(f"k {k:3d}: more than the graph's batch ({pool.staging_rows})")
            continue
        rng = np.random.default_rng(k)
        ids = rng.integers(0, c.vocab_size, (k, rows)).astype(np.int64)
        states = [
            ((rng.standard_normal(c.conv_state_shape) * 0.1), (rng.standard_normal(c.ssm_state_shape) * 0.1))
            for _ in range(k)
        ]
        for i, (conv, ssm) in enumerate(states):
            pool.stage(i, conv, ssm)
        pool.prefill(PREFILL, 0, ids)
        got = [pool.prefill_logits(i) for i in range(k)]
        worst = 0.0
        for i in range(min(k, 4)):
            pool.stage(0, *states[i])
            pool.prefill(PREFILL, 0, ids[i : i + 1])
            one = pool.prefill_logits(0)
            worst = max(worst, float(np.abs(one - got[i]).max()) / max(float(np.abs(one).max()), 1e-30))
        for _ in range(3):  # run once plainly, then captured (CUDA), then replayed
            pool.prefill(PREFILL, 0, ids)
        n = 20
        t = time.perf_counter()
        for _ in range(n):
            pool.prefill(PREFILL, 0, ids)
        ms = (time.perf_counter() - t) / n * 1e3
        print(
            f"k {k:3d} x {rows} rows: {ms:.3f} ms/launch, {k * rows / ms * 1e3:9.0f} prompt rows/s "
            f"(batch vs single rel {worst:.1e})"
        )


if __name__ == "__main__":
    main()
