"""``mambatrt bundle`` (a checkpoint to a bundle) and ``mambatrt compare`` (a bundle against its references)."""

from __future__ import annotations

import argparse
import sys

from mambatrt.compile.builders import PLAN_CHOICES
from mambatrt.compile.kernels import KERNEL_CHOICES
from mambatrt.contract import DEFAULT_MAX_BATCH, DEFAULT_MAX_PREFILL_BATCH, DEFAULT_MAX_ROWS, DEFAULT_OPT_ROWS

from .args import add_bundle_arg, add_quiet_arg


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bundle`` and ``compare`` subcommands."""
    _add_bundle(sub)
    p = sub.add_parser(
        "compare",
        help="accuracy comparisons of a bundle (Polygraphy)",
        description="Compare onnxruntime with the PyTorch model, chunked prefill with token-by-token decoding, the "
        "kernels graphs with the portable ones, and each TensorRT plan with onnxruntime when a TensorRT runtime is "
        "present. Exit code 1 on any FAIL.",
    )
    add_bundle_arg(p)
    p.add_argument("--checkpoint", default=None, help="checkpoint for the PyTorch reference (default: the manifest's)")
    p.add_argument("--prompt-len", type=int, default=75, help="random prompt length (default: %(default)s)")
    p.set_defaults(func=compare)


def _add_bundle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bundle",
        help="build a bundle from a checkpoint: ONNX graphs, kernels library, TensorRT plans, manifest",
        description="Export a Mamba-1 checkpoint (HF or original state-spaces layout) to ONNX graphs, build the "
        "kernels flavour's op library and the TensorRT plans, and write a bundle with its manifest "
        "(docs/bundle-format.md). The bundle is built beside BUNDLE_DIR and renamed into place at the end: on "
        "failure nothing is left.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="directory with config.json and the weights")
    p.add_argument("--out", required=True, metavar="BUNDLE_DIR", help="where the bundle goes")
    _add_shape_args(p)
    p.add_argument(
        "--plans",
        default="auto",
        choices=PLAN_CHOICES,
        help="TensorRT plans of the portable graphs, built with Polygraphy. auto: when tensorrt or tensorrt_rtx "
        "imports, else an ONNX-only bundle; none: never (default: %(default)s)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=KERNEL_CHOICES,
        help="mambatrt's op library for the 'kernels' graph flavour, carried in the bundle. auto: with the CUDA "
        "kernels when nvcc runs, else the CPU kernels with g++, else none; cuda/cpu insist; none: no kernels flavour "
        "(default: %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing bundle at BUNDLE_DIR")
    add_quiet_arg(p, "no progress output")
    p.set_defaults(func=bundle)


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    """The bundle's precision, layout and the largest launches its graphs take."""
    p.add_argument(
        "--precision",
        default="fp32",
        metavar="{fp32,fp16,bf16,int8}",
        help="fp32, fp16 or bf16: the dtype of the weights and matrix products; int8: the embedding and projection "
        "weights as int8 rows with a scale each, multiplied in fp32 (a quarter of fp32's bytes; CPU decode reads "
        "them as they are); states, scan and logits stay float32 (default: %(default)s)",
    )
    p.add_argument(
        "--layout",
        default="split",
        choices=("split", "single"),
        help="split: decode and prefill graphs (prompts in chunks); single: decode graph only, prompts go token by "
        "token (default: %(default)s)",
    )
    p.add_argument(
        "--max-rows",
        type=int,
        default=DEFAULT_MAX_ROWS,
        help=f"largest prefill chunk, in rows per sequence; the prefill plan's optimum is {DEFAULT_OPT_ROWS} rows, "
        "or this when smaller (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="largest number of sequences one decode launch takes (the server's batch; default: %(default)s)",
    )
    p.add_argument(
        "--max-prefill-batch",
        type=int,
        default=DEFAULT_MAX_PREFILL_BATCH,
        help="largest number of prompts one prefill launch of the kernels graphs takes (a server prefills that "
        "many waiting prompts together; default: %(default)s)",
    )


def bundle(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt bundle``: the build, then one line saying what the bundle holds, how long the build
    took and its peak memory (the largest resident set of this process)."""
    import time

    from mambatrt.compile.bundle import build_bundle
    from mambatrt.export.onnx_export import default_workers
    from mambatrt.runtime.bundle import load_bundle

    start = time.perf_counter()
    out = build_bundle(
        args.checkpoint,
        args.out,
        precision=args.precision,
        layout=args.layout,
        plans=args.plans,
        max_rows=args.max_rows,
        max_batch=args.max_batch,
        max_prefill_batch=args.max_prefill_batch,
        force=args.force,
        quiet=args.quiet,
        kernels=args.kernels,
        workers=default_workers(),  # this process has run nothing else: its forked children are safe
    )
    b = load_bundle(out, verify=False)  # just written and hashed
    size = sum(f.bytes for f in b.manifest.files.values())
    plans = ", ".join(f"{r.file} ({r.build_seconds:.1f} s)" for r in b.manifest.plans.values())
    flavours = ", ".join(b.flavours)
    if b.cuda_graphs:
        with_cutlass = ", CUTLASS" if b.manifest.kernels_library.get("cutlass") else ""
        flavours += f" (+ CUDA copies of {' and '.join(b.cuda_graphs)}: MambaLinear{with_cutlass})"
    if b.cpu_graphs:
        flavours += f" (+ CPU copies of {' and '.join(b.cpu_graphs)}: MambaLinear)"
    cost = f"built in {time.perf_counter() - start:.0f} s{_peak_memory()}"
    print(
        f"bundle {out}: {b.layout}, {b.precision}, {size / 2**20:.1f} MiB; graphs: {flavours}; plans: {plans or 'none'}"
        f"; {cost}"
    )
    return 0


def _peak_memory() -> str:
    """The peak memory of this process and of its largest child process (a tracing process or a compiler), as the
    last line of ``mambatrt bundle`` gives them; empty where /proc does not say."""
    import resource

    from mambatrt.runtime.memory import peak_resident_bytes

    peak = peak_resident_bytes()
    if not peak:
        return ""
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return f", peak memory {peak / 2**30:.2f} GiB" + (f" (a child process: {child / 2**30:.2f} GiB)" if child else "")


def compare(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt compare``: the table on stdout; exit 1 when a comparison fails."""
    from pathlib import Path

    from mambatrt.config import load_config
    from mambatrt.errors import InputError
    from mambatrt.reference.compare import compare_bundle, format_table
    from mambatrt.runtime.bundle import load_bundle

    if args.prompt_len < 1:
        raise InputError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    bundle = load_bundle(args.bundle)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None and load_config(checkpoint) != bundle.config:  # a missing config.json is an error too
        raise InputError(
            f"{checkpoint}: a different model from the bundle's (its config differs); pass the checkpoint the bundle "
            f"was built from ({bundle.manifest.checkpoint})"
        )
    rows = compare_bundle(bundle, checkpoint, prompt_len=args.prompt_len)
    print(f"{bundle.path}: {bundle.layout}, {bundle.precision}, prompt {args.prompt_len} tokens")
    print(format_table(rows))
    failed = [r for r in rows if r.status == "FAIL"]
    if failed:
        print(f"{len(failed)} comparison(s) failed", file=sys.stderr)
        return 1
    return 0
