"""Time to first token of the serving engine alone (no HTTP), one request at a time, with and without the state
cache: separates the engine's share of a served request's TTFT from the server's.

Usage: python scripts/engine_c1.py BUNDLE [DEVICE] [REQUESTS]
Prints, per cache size, the median and p90 of submit -> first event and submit -> last event (ms) over REQUESTS
(default 24) random 128-token prompts with 64 new tokens each, and the engine's own prefill/decode seconds.
"""

import sys
import threading
import time

import numpy as np

from mambatrt.runtime.backends import open_backend
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, Request
from mambatrt.runtime.generate import Sampling


def main() -> None:
    bundle = load_bundle(sys.argv[1], verify=False)
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    backend = open_backend(bundle, "ort", device)
    vocab = min(bundle.config.vocab_size, 50000)
    for mib in (256, 0, 256):
        engine = Engine(backend, max_batch=8, cache_bytes=mib << 20)
        engine.warm()
        engine.start()
        rng = np.random.default_rng(mib)
        ttft, total = [], []
        for i in range(n + 4):
            first, done = [], threading.Event()

            def emit(event, first=first, done=done):
                if not first:
                    first.append(time.perf_counter())
                if event.finish_reason is not None:
                    done.set()

            prompt = rng.integers(0, vocab, 128).tolist()
            t = time.perf_counter()
            engine.submit(Request(prompt, Sampling(max_new_tokens=64, stop_on_eos=False), emit))
            done.wait(60)
            if i >= 4:
                ttft.append((first[0] - t) * 1e3)
                total.append((time.perf_counter() - t) * 1e3)
        engine.stop()
        s = engine.stats()
        print(
            f"cache {mib} MiB: TTFT p50 {np.median(ttft):.2f} p90 {np.percentile(ttft, 90):.2f} ms, request p50 "
            f"{np.median(total):.2f} ms; prefill {s['prefill_seconds']:.3f} s, decode {s['decode_seconds']:.3f} s, "
            f"{s['iterations']} iterations, cached {len(engine.cache.entries)} entries",
            flush=True,
        )
        engine.pool = None


if __name__ == "__main__":
    main()
