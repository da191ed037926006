"""Where a one-shot run's time to first token goes on the CUDA provider: the first request through the engine
(as `mambatrt run` runs it), profiled, then the same backend's launches one by one, timed from the host.

Usage: python scripts/cold_probe.py BUNDLE_DIR [GRAPHS]   (a 128-token prompt, 8 new tokens)
"""

import cProfile
import os
import pstats
import sys
import time

import numpy as np

from mambatrt.runtime.backends import open_backend
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, Request
from mambatrt.runtime.generate import Sampling


def main() -> None:
    bundle = load_bundle(sys.argv[1], verify=False)
    t = time.perf_counter()
    graphs = sys.argv[2] if len(sys.argv) > 2 else "auto"
    backend = open_backend(bundle, device=os.environ.get("DEVICE", "cuda"), graphs=graphs)
    load_ms = 1e3 * (time.perf_counter() - t)
    print(f"load {load_ms:.1f} ms, {backend.flavour} graphs, captured {getattr(backend, 'captured', None)}")
    prompt = [i * 37 % bundle.config.vocab_size for i in range(128)]
    for attempt in range(3):
        engine = Engine(backend, max_batch=1, max_queue=1)
        times: list[float] = []
        request = Request(prompt[:], Sampling(max_new_tokens=8), lambda _, out=times: out.append(time.perf_counter()))
        prof = cProfile.Profile() if attempt == 0 else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        engine.run_inline(request)
        if prof:
            prof.disable()
        per_token = 1e3 * (times[-2] - times[0]) / 6
        print(f"request {attempt}: ttft {1e3 * (times[0] - start):.2f} ms, then {per_token:.3f} ms/token")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    for rows in (64, 64, 1, 1):
        graph = "prefill" if rows > 1 else "decode"
        t = time.perf_counter()
        backend.run(graph, np.zeros(rows, np.int64))
        print(f"{graph} {rows} rows: {1e3 * (time.perf_counter() - t):.3f} ms")


if __name__ == "__main__":
    main()
