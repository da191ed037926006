"""Time a bundle's kernels graphs on onnxruntime's CPU provider at several thread counts: one launch per spec
(decode:BATCH or prefill:BATCH:ROWS) from random states, min and median over --runs, as JSON lines and a table.

    python scripts/cpu_launches.py BUNDLE --threads 1 2 4 --specs decode:1 decode:16 prefill:1:64 prefill:4:64
        [--library OTHER.so --label old] [--runs 10] [--json FILE]

--library runs the bundle with another build of the op library (e.g. an earlier commit's, for a comparison on one
machine): a temporary copy of the bundle (links to its files) with that library and its size and digest in the
manifest. Session 33 measured the CPU conv and scan's tasks on the threads with it (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mambatrt.paths import sha256_file
from mambatrt.runtime.backends import OrtCpuBackend
from mambatrt.runtime.bundle import load_bundle


def with_library(bundle: Path, library: Path, into: Path) -> Path:
    """A copy of ``bundle`` in ``into`` (its files linked) whose op library is ``library``."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    name = manifest["kernels_library"]["file"]
    for f in bundle.iterdir():
        if f.name not in (name, "manifest.json"):
            (into / f.name).symlink_to(f.resolve())
    shutil.copy(library, into / name)
    manifest["files"][name] = {"bytes": (into / name).stat().st_size, "sha256": sha256_file(into / name)}
    manifest["kernels_library"].update(cuda=False, cutlass=False)
    manifest["kernels_library"].pop("cuda_graphs", None)
    (into / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--specs", nargs="+", default=["decode:1", "decode:16", "prefill:1:64", "prefill:4:64"])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--library", type=Path, help="another build of the op library to run instead of the bundle's")
    p.add_argument("--label", default="bundle")
    p.add_argument("--json", type=Path, help="append the rows as JSON lines")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = with_library(args.bundle, args.library, Path(tmp)) if args.library else args.bundle
        bundle = load_bundle(path)
        c = bundle.config
        rows = []
        for threads in args.threads:
            backend = OrtCpuBackend(bundle, threads, "kernels")
            for spec in args.specs:
                graph, batch, *rest = spec.split(":")
                batch, length = int(batch), int(rest[0]) if rest else 1
                rng = np.random.default_rng(0)
                ids = rng.integers(0, c.vocab_size, batch * length).astype(np.int64)
                conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
                ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
                backend.run_states(graph, ids, conv, ssm)  # the first launch: allocations, packed weights
                times = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    backend.run_states(graph, ids, conv, ssm)
                    times.append((time.perf_counter() - start) * 1e3)
                row = dict(label=args.label, threads=threads, spec=spec, min_ms=min(times), median_ms=np.median(times))
                rows.append(row)
                print(f"{args.label} threads {threads} {spec}: min {row['min_ms']:.2f} ms, median "
                      f"{row['median_ms']:.2f} ms", flush=True)  # fmt: skip
            backend.close()
    if args.json:
        with args.json.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
