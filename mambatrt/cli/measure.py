"""``mambatrt bench`` and ``mambatrt eval``: a bundle's speed and accuracy, through the engine or a server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import add_bundle_arg, add_device_arg, add_quiet_arg, token_ids_arg

MAX_BENCH_TOKENS = 1_000_000  # a longer random prompt is a typo, not a benchmark (and may not fit in memory)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` and ``eval`` subcommands."""
    p = sub.add_parser(
        "bench",
        help="time prefill (chunked and token by token) and decode",
        description="For each prompt length: prefill through the engine with one slot, chunked on the prefill graph "
        "and token by token on the decode graph of the same bundle, and decode ms/token; a warm-up run first, "
        "medians over repeats. Prefill time ends when the first token is picked (the final state update is "
        "complete). Prints a Markdown table.",
    )
    add_bundle_arg(p)
    p.add_argument(
        "--prompt-lengths",
        type=token_ids_arg,
        default=[5, 71, 84, 128, 512],
        metavar="5,71,...",
        help="prompt lengths (default: 5,71,84,128,512)",
    )
    p.add_argument("--new-tokens", type=int, default=8, help="tokens decoded per run (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per path (default: %(default)s)")
    p.add_argument(
        "--reference",
        choices=("hf",),
        default=None,
        help="also time transformers' MambaForCausalLM on the same device and precision (needs torch)",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint for --reference (default: the manifest's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_device_arg(p)
    p.set_defaults(func=bench)

    p = sub.add_parser(
        "eval",
        help="LAMBADA-style last-word accuracy and perplexity",
        description='Last-word cloze on lambada_openai-format JSONL ({"text": ...} per line): accuracy (the greedy '
        "continuation reproduces the whole last word) and the last word's perplexity, through the engine on any "
        "device; with --url, the accuracy and task-call latency through a running `mambatrt serve` instead.",
    )
    add_bundle_arg(p)
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="passages, one JSON object per line")
    p.add_argument("--limit", type=int, default=None, help="only the first N passages")
    p.add_argument(
        "--unigram",
        metavar="FILE.json",
        default=None,
        help="token counts (a JSON list) for a unigram baseline on the same passages",
    )
    p.add_argument(
        "--url",
        default=None,
        help="a server serving this bundle (e.g. http://127.0.0.1:8000): send each passage there, one request at a "
        "time, greedy, and report the same accuracy and the task-call latency (p50/p99)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_quiet_arg(p, "no progress bar")
    add_device_arg(p)
    p.set_defaults(func=evaluate)


def bench(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt bench``: the table on stdout (rows as they are measured), or one JSON object."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.bench import TABLE_HEAD, run_bench, table_row
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.runners import open_runner

    if args.repeat < 1 or args.new_tokens < 1 or not args.prompt_lengths or min(args.prompt_lengths) < 1:
        raise InputError("--repeat, --new-tokens and every prompt length must be >= 1")
    if max(args.prompt_lengths) > MAX_BENCH_TOKENS:
        raise InputError(f"prompt lengths go up to {MAX_BENCH_TOKENS} tokens, got {max(args.prompt_lengths)}")
    bundle = load_bundle(args.bundle)
    checkpoint = Path(args.checkpoint or bundle.manifest.checkpoint or "")
    if args.reference == "hf" and not (checkpoint / "config.json").is_file():
        raise InputError(f"{checkpoint}: no checkpoint for --reference hf; pass --checkpoint DIR")
    later = args.json or args.reference  # rows printed once complete (with HF's columns)

    def show(row: dict) -> None:
        if not later:
            print(table_row(row), flush=True)

    with open_runner(bundle, args.device) as runner:
        print(f"{bundle.path}: {bundle.layout}, {bundle.precision}, {runner.name} on {runner.device}, "
              f"{runner.flavour} graphs", file=sys.stderr)  # fmt: skip
        if not later:
            print(TABLE_HEAD, flush=True)
        result = run_bench(runner, args.prompt_lengths, args.new_tokens, args.repeat, on_row=show)
    if args.reference == "hf":
        # after every mambatrt timing: torch's thread pool, once started, competes with onnxruntime's on small CPUs
        from mambatrt.reference.hf import hf_timings

        for row in result.rows:
            row["hf"] = hf_timings(checkpoint, row["prompt_len"], args.new_tokens, args.repeat, result.device,
                                   bundle.precision)  # fmt: skip
    if args.json:
        print(json.dumps(result.to_dict()))
    elif later:
        print("\n".join([TABLE_HEAD, *(table_row(row) for row in result.rows)]), flush=True)
    for note in result.notes:
        print(f"mambatrt bench: {note}", file=sys.stderr)
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt eval``: every input is read and checked before the evaluation starts."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.evaluate import read_cloze, read_unigram, unigram_baseline
    from mambatrt.runtime.tokenizer import Tokenizer

    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be >= 1, got {args.limit}")
    bundle = load_bundle(args.bundle, verify=args.url is None)
    items = read_cloze(args.data, Tokenizer(bundle), args.limit)
    counts = read_unigram(args.unigram, bundle.config.vocab_size) if args.unigram else None
    out = {"bundle": str(bundle.path), "layout": bundle.layout, "precision": bundle.precision}
    if args.url:
        out.update(_through_server(args.url.rstrip("/"), items))
    else:
        out.update(_on_device(bundle, items, args))
    if counts is not None:
        out["unigram"] = unigram_baseline(items, counts).to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    line = f"{out['count']} passages: accuracy {out['accuracy']:.2f} %"
    if "perplexity" in out:
        line += f", last-word perplexity {out['perplexity']:.2f}"
    if "task_call_ms" in out:
        line += f", task call p50 {out['task_call_ms']['p50']:.2f} ms, p99 {out['task_call_ms']['p99']:.2f} ms"
    if "unigram" in out:
        u = out["unigram"]
        line += f" (unigram baseline: {u['accuracy']:.2f} %, perplexity {u['perplexity']:.2f})"
    print(f"{line} [{out['where']}]")
    return 0


def _on_device(bundle, items: list, args: argparse.Namespace) -> dict:
    """The cloze through the engine with one slot on ``args.device``."""
    from mambatrt.runtime.engine import Engine, EngineConfig
    from mambatrt.runtime.evaluate import evaluate as evaluate_items
    from mambatrt.runtime.runners import open_runner

    with open_runner(bundle, args.device) as runner:
        result = evaluate_items(Engine(runner, EngineConfig(max_batch=1)), items, progress=not args.quiet)
        where = f"{runner.name}/{runner.device}, {bundle.layout}, {bundle.precision}"
    return {"where": where, **result.to_dict()}


def _through_server(url: str, items: list) -> dict:
    """The cloze through the server at ``url`` (the model it serves), one request at a time."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.loadgen import run_cloze, served_models

    models = served_models(url)
    if len(models) != 1:
        raise InputError(f"{url} serves {models}; eval --url needs a server of one model")
    return {"where": f"{models[0]} at {url}", **run_cloze(url, models[0], items)}
