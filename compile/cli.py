"""``mambatrt bundle`` and ``mambatrt compare``. Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import sys

from mambatrt.cli.args import add_quiet_arg
from mambatrt.export.cli import add_export_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bundle`` and ``compare`` subcommands."""
    p = sub.add_parser(
        "bundle",
        help="export + compile a checkpoint into a bundle",
        description="Export a checkpoint to ONNX, build the kernels flavour's op library and TensorRT plans, and "
        "write a bundle with a manifest. The bundle is built beside BUNDLE_DIR and renamed into place at the end: on "
        "failure nothing is left.",
    )
    add_export_args(p)
    p.add_argument("--out", required=True, metavar="BUNDLE_DIR", help="where the bundle goes")
    p.add_argument(
        "--layout",
        default="split",
        choices=("split", "single"),
        help="split: decode + prefill engines; single: decode engine only, prompts go token by token "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--engines",
        default="auto",
        choices=("auto", "none", "polygraphy", "trtexec"),
        help="plan builder. auto: trtexec if on PATH, else Polygraphy if tensorrt or tensorrt_rtx imports, "
        "else an ONNX-only bundle (default: %(default)s)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "cuda", "cpu", "none"),
        help="mambatrt's op library for the 'kernels' graph flavour, carried in the bundle. auto: with the CUDA "
        "kernels when nvcc runs, else the CPU kernels with g++, else none; cuda/cpu insist; none: no kernels flavour "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--opt-rows",
        type=int,
        default=None,
        help="prefill profile's optimum rows, 1..--max-rows (default: 32, or --max-rows when smaller)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing bundle at BUNDLE_DIR")
    p.add_argument("--label", default=None, help="free text stored in the manifest (e.g. where the weights came from)")
    add_quiet_arg(p, "no progress output")
    p.set_defaults(func=run_bundle)

    c = sub.add_parser(
        "compare",
        help="accuracy comparisons of a bundle (Polygraphy)",
        description="Compare onnxruntime with the PyTorch model, chunked prefill with token-by-token decoding, "
        "and each TensorRT plan with onnxruntime when a TensorRT runtime is present. Exit code 1 on any FAIL.",
    )
    c.add_argument("bundle", metavar="BUNDLE_DIR")
    c.add_argument("--checkpoint", default=None, help="checkpoint for the PyTorch reference (default: the manifest's)")
    c.add_argument("--prompt-len", type=int, default=75, help="random prompt length (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    c.set_defaults(func=run_compare)


def run_bundle(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt bundle``."""
    from mambatrt.compile.bundle import build_bundle
    from mambatrt.runtime.bundle import load_bundle

    out = build_bundle(
        args.checkpoint,
        args.out,
        precision=args.precision,
        layout=args.layout,
        engines=args.engines,
        max_rows=args.max_rows,
        opt_rows=args.opt_rows,
        max_batch=args.max_batch,
        max_prefill_batch=args.max_prefill_batch,
        force=args.force,
        label=args.label,
        quiet=args.quiet,
        scan=args.scan,
        kernels=args.kernels,
    )
    bundle = load_bundle(out)
    size = sum(f.bytes for f in bundle.manifest.files.values())
    plans = ", ".join(f"{r.file} ({r.build_seconds:.1f} s)" for r in bundle.manifest.plans.values())
    flavours = ", ".join(bundle.flavours)
    if bundle.cuda_graphs:
        copies = " and ".join(bundle.cuda_graphs)
        with_cutlass = ", CUTLASS" if bundle.manifest.kernels_library.get("cutlass") else ""
        flavours += f" (+ CUDA copies of {copies}: MambaLinear{with_cutlass})"
    if bundle.cpu_graphs:
        flavours += f" (+ CPU copies of {' and '.join(bundle.cpu_graphs)}: MambaLinear)"
    print(
        f"bundle {out}: {bundle.layout}, {bundle.precision}, {size / 2**20:.1f} MiB; graphs: {flavours}; "
        f"plans: {plans or 'none'}"
    )
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt compare``."""
    from pathlib import Path

    from mambatrt.config import load_config
    from mambatrt.errors import InputError
    from mambatrt.reference.compare import compare_bundle, format_table
    from mambatrt.runtime.bundle import load_bundle

    if args.prompt_len < 1:
        raise InputError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if not 0 <= args.seed < 2**63:
        raise InputError(f"--seed must be in 0..2^63-1, got {args.seed}")
    bundle = load_bundle(args.bundle)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None and load_config(checkpoint) != bundle.config:  # a missing config.json is an error too
        raise InputError(
            f"{checkpoint}: a different model from the bundle's (its config differs); pass the checkpoint the bundle "
            f"was built from ({bundle.manifest.checkpoint})"
        )
    rows = compare_bundle(bundle, checkpoint, prompt_len=args.prompt_len, seed=args.seed)
    print(f"{bundle.path}: {bundle.layout}, {bundle.precision}, prompt {args.prompt_len} tokens")
    print(format_table(rows))
    failed = [r for r in rows if r.status == "FAIL"]
    if failed:
        print(f"{len(failed)} comparison(s) failed", file=sys.stderr)
        return 1
    return 0
