"""``mambatrt export``: checkpoint -> decode.onnx + prefill.onnx + weights.bin. Heavy imports happen in the handler."""

from __future__ import annotations

import argparse

from mambatrt.cli.args import add_quiet_arg
from mambatrt.contract import DEFAULT_MAX_BATCH, DEFAULT_MAX_PREFILL_BATCH
from mambatrt.export.scans import DEFAULT_SCAN, SCANS, scan_help


def add_export_args(p: argparse.ArgumentParser) -> None:
    """CHECKPOINT_DIR, --precision, --max-rows and --scan: shared by ``export`` and ``bundle``."""
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="directory with config.json and the weights")
    p.add_argument(
        "--precision",
        default="fp32",
        help="fp32, fp16 or bf16: the dtype of weights and matrix products; states, scan and logits stay "
        "float32 (default: %(default)s)",
    )
    p.add_argument("--max-rows", type=int, default=64, help="largest prefill chunk (default: %(default)s)")
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
        help="largest number of prompts one prefill launch of the fused and kernels graphs takes (a server "
        "prefills that many waiting prompts together; default: %(default)s)",
    )
    p.add_argument(
        "--scan",
        default=DEFAULT_SCAN,
        choices=tuple(SCANS),
        help=scan_help(),
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand."""
    p = sub.add_parser(
        "export",
        help="export a checkpoint to decode.onnx and prefill.onnx",
        description="Export a Mamba-1 checkpoint (HF or original state-spaces layout) to two ONNX graphs, "
        "decode.onnx (one token) and prefill.onnx (1..max-rows rows), sharing one weights.bin.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created; graph files replaced)")
    add_export_args(p)
    p.add_argument(
        "--graphs",
        default="decode,prefill",
        help="comma-separated graphs to export: decode, prefill (default: %(default)s)",
    )
    add_quiet_arg(p, "no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt export``."""
    from mambatrt.export.onnx_export import export_onnx

    graphs = tuple(g.strip() for g in args.graphs.split(",") if g.strip())
    result = export_onnx(
        args.checkpoint,
        args.out,
        precision=args.precision,
        max_rows=args.max_rows,
        graphs=graphs,
        scan=args.scan,
        progress=not args.quiet,
        max_batch=args.max_batch,
        max_prefill_batch=args.max_prefill_batch,
    )
    mib = 1 / 2**20
    print(
        f"exported {', '.join(sorted(result.graphs))} to {result.out_dir} in {result.seconds:.1f} s: "
        f"{result.onnx_bytes * mib:.1f} MiB on disk for {result.param_bytes * mib:.1f} MiB of parameters; "
        f"nodes {result.node_counts}"
    )
    return 0
