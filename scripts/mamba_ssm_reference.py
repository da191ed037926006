"""mamba_ssm's fused kernels timed on this GPU, the side-by-side column of docs/benchmarks.md's `mambatrt bench` table.

Builds the forward kernels of mamba-ssm 2.3.2 (selective_scan_cuda) and causal-conv1d 1.7.0 from their sources for
this GPU (about 80 s; the backward kernels are never built or bound), then times random-weight models, batch 1, TF32
off: mamba-130m's shapes in fp32 (prompts of 5, 128 and 512 tokens) and fp16 (128), and with --shapes 130m,2.8b also
mamba-2.8b's shapes in fp16 (128 and 512). Per prompt: prefill as a plain forward, the same forward replayed from a
CUDA graph (what the table quotes), and decode ms/token from generate(cg=True) (64 new tokens, less the plain
prefill).

Usage, from the checkout's root, with the sources unpacked in .anchor/ (bash scripts/serve_wheels.sh reference):
  python3 scripts/mamba_ssm_reference.py [--anchor .anchor] [--shapes 130m,2.8b] [--json FILE]
"""

import argparse
import glob
import json
import os
import sys
import time

sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)  # the extensions' backward symbols stay unresolved, never called

import torch  # noqa: E402
from torch.utils.cpp_extension import load  # noqa: E402

NVCC_FLAGS = [
    "-O3", "-std=c++17", "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
]  # fmt: skip
NEW_TOKENS = 64


def build(anchor: str) -> tuple[str, str]:
    """Compile the forward kernels into extensions that mamba_ssm imports; returns the two source folders."""
    found = [glob.glob(f"{anchor}/mamba_ssm-*"), glob.glob(f"{anchor}/causal_conv1d-*")]
    if not all(found):
        sys.exit(f"no mamba_ssm-* and causal_conv1d-* sources in {anchor}: bash scripts/serve_wheels.sh reference")
    ms, cc = found[0][0], found[1][0]
    major, minor = torch.cuda.get_device_capability()
    nvcc = NVCC_FLAGS + ["-gencode", f"arch=compute_{major}{minor},code=sm_{major}{minor}"]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))
    t0 = time.time()
    scan = f"{ms}/csrc/selective_scan"
    ss = load(
        "selective_scan_cuda",
        [f"{scan}/selective_scan.cpp"] + [f"{scan}/selective_scan_fwd_{t}.cu" for t in ("fp32", "fp16", "bf16")],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=nvcc,
    )
    conv = [f"{cc}/csrc/{f}" for f in ("causal_conv1d.cpp", "causal_conv1d_fwd.cu", "causal_conv1d_update.cu")]
    cv = load("causal_conv1d_cuda", conv, extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=nvcc)
    print(f"built the forward kernels in {time.time() - t0:.0f} s", flush=True)
    sys.modules["selective_scan_cuda"], sys.modules["causal_conv1d_cuda"] = ss, cv
    sys.path[:0] = [ms, cc]
    return ms, cc


def median_ms(fn, n: int) -> float:
    """Median wall time of n calls of fn, each synchronized."""
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[n // 2]


def bench(cfg, dtype, lengths, shapes: str) -> list[dict]:
    """One row per prompt length: plain and captured prefill, decode ms/token."""
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(0)
    model = MambaLMHeadModel(cfg, device="cuda", dtype=dtype).eval()
    rows = []
    for length in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, length), device="cuda")
        with torch.no_grad():
            for _ in range(3):
                model(ids)
            plain = median_ms(lambda ids=ids: model(ids), 11)
            side = torch.cuda.Stream()  # warm-up on a side stream before capture, as torch.cuda.graphs asks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(ids)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(ids)
            captured = median_ms(graph.replay, 21)
            del graph
            model.generate(ids, max_length=length + NEW_TOKENS, cg=True, top_k=1)  # captures the decode graph
            end = length + NEW_TOKENS
            total = median_ms(lambda ids=ids, end=end: model.generate(ids, max_length=end, cg=True, top_k=1), 3)
        row = {
            "shapes": shapes,
            "dtype": str(dtype).replace("torch.", ""),
            "prompt_len": length,
            "prefill_ms": round(plain, 3),
            "prefill_captured_ms": round(captured, 3),
            "decode_ms_per_token": round((total - plain) / NEW_TOKENS, 4),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchor", default=".anchor", help="folder holding the unpacked sources (default: .anchor)")
    p.add_argument("--shapes", default="130m", help="comma-separated: 130m (fp32 and fp16), 2.8b (fp16)")
    p.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ms, _ = build(os.path.abspath(args.anchor))
    from mamba_ssm.models.config_mamba import MambaConfig

    def config(d_model: int, n_layer: int) -> MambaConfig:
        return MambaConfig(
            d_model=d_model, n_layer=n_layer, vocab_size=50277, ssm_cfg={}, rms_norm=True, residual_in_fp32=True,
            fused_add_norm=True, pad_vocab_size_multiple=8,
        )  # fmt: skip

    shapes = args.shapes.split(",")
    rows = []
    if "130m" in shapes:
        rows += bench(config(768, 24), torch.float32, (5, 128, 512), "130m")
        rows += bench(config(768, 24), torch.float16, (128,), "130m")
    if "2.8b" in shapes:
        rows += bench(config(2560, 64), torch.float16, (128, 512), "2.8b")
    if args.json:
        out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "reference": os.path.basename(ms)}
        with open(args.json, "w") as f:
            json.dump({**out, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
