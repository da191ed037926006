"""The engine thread's host work per decode iteration on the CPU: B sequences decode together (greedy, EOS ignored),
and the engine's trace gives each iteration's decode time less its launch (sampling, events, text, finishing).
Iterations with all B running and no prefill launch count; their median is printed.

Usage: python scripts/engine_host_work.py BUNDLE [B=64] [text|bare] [--profile]
  text: the engine decodes each token's text (as for a request with stop strings); bare: the caller does (serve's
  front ends, for requests without stop strings). --profile: cProfile of the decode iterations, by own time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import threading

import numpy as np

from mambatrt.runtime.backends import open_backend
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, Request
from mambatrt.runtime.generate import Sampling
from mambatrt.runtime.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("batch", nargs="?", type=int, default=64)
    parser.add_argument("text", nargs="?", choices=["text", "bare"], default="text")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    bundle = load_bundle(args.bundle)
    tokenizer = Tokenizer(bundle) if bundle.tokenizer_path else None
    engine = Engine(
        open_backend(bundle, "ort", "cpu", graphs="kernels"),
        max_batch=args.batch,
        decode_text=tokenizer.stream if tokenizer else None,
    )
    engine.trace = collections.deque()
    done, left = threading.Event(), [args.batch]

    def emit(event) -> None:
        if event.finish_reason is not None:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    rng = np.random.default_rng(0)
    for _ in range(args.batch):
        sampling = Sampling(max_new_tokens=400, stop_on_eos=False)
        engine.submit(Request(rng.integers(0, 200, 8).tolist(), sampling, emit, detokenize=args.text == "text"))
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        decode = engine._finish_decode

        def profiled(begun) -> None:
            profile.enable()
            decode(begun)
            profile.disable()

        engine._finish_decode = profiled
    engine.start()
    done.wait(600)
    engine.stop()
    records = [json.loads(line) for line in engine.trace_lines().splitlines()]
    full = [r for r in records if r["running"] == args.batch and not r["launches"]]
    host = statistics.median(r["decode_ms"] - r["launch_ms"] for r in full)
    launch = statistics.median(r["launch_ms"] for r in full)
    print(f"batch {args.batch}, {args.text}: {len(full)} iterations, host work median {host * 1e3:.1f} us, "
          f"launch median {launch * 1e3:.1f} us")  # fmt: skip
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
