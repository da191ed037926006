"""Batched decode throughput of a bundle on the onnxruntime CUDA EP: one captured CUDA graph per batch size.

Usage: python scripts/gpu_batch_decode.py BUNDLE_DIR [B,B,...] [portable|fused|kernels]   (default 1,8,32,64, portable;
TF32 off)
Prints ms per decode launch and tokens/s (B tokens per launch) per batch size, and checks the batch against B
launches of one (the same states and tokens) before timing.
"""

import sys
import time

import numpy as np
import onnxruntime as ort

from mambatrt.runtime.backends import StateLayout, cuda_provider_options, session_options
from mambatrt.runtime.bundle import load_bundle


def session(bundle, flavour: str, capture: bool):
    opts = session_options(ort, bundle, flavour)
    cuda = {**cuda_provider_options(bundle, flavour), **({"enable_cuda_graph": "1"} if capture else {})}
    path = bundle.graph_path("decode", flavour, cuda=True)
    return ort.InferenceSession(str(path), opts, providers=[("CUDAExecutionProvider", cuda)])


def main() -> None:
    ort.preload_dlls()
    bundle = load_bundle(sys.argv[1], verify=False)
    sizes = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8,32,64").split(",")]
    flavour = sys.argv[3] if len(sys.argv) > 3 else "portable"
    c = bundle.config
    print(f"{bundle.path} decode graph, {flavour} flavour")
    plain = session(bundle, flavour, capture=False)
    layout = StateLayout(bundle.contract("decode", flavour), c)
    for b in sizes:
        rng = np.random.default_rng(b)
        ids = rng.integers(0, c.vocab_size, b).astype(np.int64)
        conv = (rng.standard_normal((b, *c.conv_state_shape)) * 0.1).astype(np.float32)
        ssm = (rng.standard_normal((b, *c.ssm_state_shape)) * 0.1).astype(np.float32)

        def feed(lo: int, hi: int, ids=ids, conv=conv, ssm=ssm) -> dict:  # each layer's states where a (schema 4)
            return {"token_ids": ids[lo:hi], **layout.feed(conv[lo:hi], ssm[lo:hi])}  # kernels graph takes them so

        got = plain.run(None, feed(0, b))
        worst = 0.0
        for i in range(min(b, 4)):
            one = plain.run(None, feed(i, i + 1))
            scale = max(float(np.abs(one[0]).max()), 1e-30)
            worst = max(worst, float(np.abs(one[0][0] - got[0][i]).max()) / scale)
        sess = session(bundle, flavour, capture=True)
        binding, keep = sess.io_binding(), []
        for name, a in feed(0, b).items():
            keep.append(ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
            binding.bind_ortvalue_input(name, keep[-1])
        for out, a in zip(sess.get_outputs(), got, strict=True):  # outputs shaped as the plain run's
            keep.append(ort.OrtValue.ortvalue_from_shape_and_type(list(a.shape), np.float32, "cuda", 0))
            binding.bind_ortvalue_output(out.name, keep[-1])
        for _ in range(5):
            sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        n = 100
        t = time.perf_counter()
        for _ in range(n):
            sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        ms = (time.perf_counter() - t) / n * 1e3
        print(f"batch {b:3d}: {ms:.3f} ms/launch, {b / ms * 1e3:9.0f} tokens/s (batch vs single rel {worst:.1e})")


if __name__ == "__main__":
    main()
