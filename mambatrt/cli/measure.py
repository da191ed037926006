"""``mambatrt bench`` and ``mambatrt eval``: a bundle's speed and accuracy, through the engine or a server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import add_bundle_arg, add_device_arg, add_quiet_arg, token_ids_arg

MAX_BENCH_TOKENS = 1_000_000  # a longer random prompt is a typo, not a benchmark (and may not fit in memory)
REFERENCE_POINTS = 1.0  # eval --reference passes when the accuracies differ by at most this many points


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
        help="LAMBADA-style last-word accuracy and perplexity, of a bundle or through a server",
        description='Last-word cloze on lambada_openai-format JSONL ({"text": ...} per line): accuracy (the greedy '
        "continuation reproduces the whole last word) and the last word's perplexity. Of a bundle, through the "
        "engine on any device; or, with --url and no bundle, the accuracy through a running server (`mambatrt "
        "serve`, or an OpenAI-compatible server with vLLM's /tokenize and return_token_ids), with the task calls' "
        "latency.",
    )
    p.add_argument("bundle", metavar="BUNDLE_DIR", nargs="?", help="a bundle built by `mambatrt bundle`")
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
        help="evaluate the model a server serves (e.g. http://127.0.0.1:8000) instead of a bundle: its /tokenize "
        "encodes the passages, each passage is one greedy request for the last word (the same accuracy), and the "
        "task calls' latency (p50/p99) is reported; no perplexity. Sends $MAMBATRT_API_KEY as the bearer key",
    )
    p.add_argument("--concurrency", type=int, default=1, help="task calls in flight with --url (default: 1)")
    p.add_argument(
        "--reference",
        metavar="CHECKPOINT_DIR",
        default=None,
        help="also score the same passages with transformers' MambaForCausalLM from this checkpoint (fp32, CPU; "
        "needs torch) and print a pass/fail line: pass when the accuracies are within "
        f"{REFERENCE_POINTS} points",
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
        products = ""
        if runner.device == "cpu" and runner.name == "onnxruntime":
            from mambatrt.runtime.runners.ort.loader import cpu_products

            products = f"; {cpu_products(bundle, runner.flavour)}"
        print(f"{bundle.path}: {bundle.layout}, {bundle.precision}, {runner.name} on {runner.device}, "
              f"{runner.flavour} graphs{products}", file=sys.stderr)  # fmt: skip
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

    if (args.bundle is None) == (args.url is None):
        raise InputError("eval takes a BUNDLE_DIR or --url URL of a running server (one of them, not both)")
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be >= 1, got {args.limit}")
    if args.concurrency < 1:
        raise InputError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.reference and not (Path(args.reference) / "config.json").is_file():
        raise InputError(f"{args.reference}: no checkpoint (config.json) for --reference")
    out = _through_server(args) if args.url else _on_device(args)
    items, counts = out.pop("items"), out.pop("counts")
    if counts is not None:
        from mambatrt.runtime.evaluate import unigram_baseline

        out["unigram"] = unigram_baseline(items, counts).to_dict()
    if args.reference:
        from mambatrt.reference.hf import hf_cloze

        out["reference"] = hf_cloze(Path(args.reference), items, progress=not args.quiet).to_dict()
        out["pass"] = abs(out["accuracy"] - out["reference"]["accuracy"]) <= REFERENCE_POINTS
    if args.json:
        print(json.dumps(out))
    else:
        print(_eval_summary(out))
    return 0


def _eval_summary(out: dict) -> str:
    """The human-readable lines of ``mambatrt eval``."""
    line = f"{out['count']} passages: accuracy {out['accuracy']:.2f} %"
    if "perplexity" in out:
        line += f", last-word perplexity {out['perplexity']:.2f}"
    if "task_call_ms" in out:
        t = out["task_call_ms"]
        line += f", task call p50 {t['p50']:.2f} ms, p99 {t['p99']:.2f} ms at concurrency {out['concurrency']}"
    if "unigram" in out:
        u = out["unigram"]
        line += f" (unigram baseline: {u['accuracy']:.2f} %, perplexity {u['perplexity']:.2f})"
    line += f" [{out['where']}]"
    if "reference" in out:
        r = out["reference"]
        verdict = "pass" if out["pass"] else f"FAIL (more than {REFERENCE_POINTS} points apart)"
        line += (f"\naccuracy {out['accuracy']:.2f} vs {r['accuracy']:.2f} for the PyTorch reference (transformers, "
                 f"perplexity {r['perplexity']:.2f}): {verdict}")  # fmt: skip
    return line


def _on_device(args: argparse.Namespace) -> dict:
    """The cloze of ``args.bundle`` through the engine with one slot on ``args.device``."""
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.engine import Engine, EngineConfig
    from mambatrt.runtime.evaluate import evaluate as evaluate_items
    from mambatrt.runtime.evaluate import read_cloze
    from mambatrt.runtime.runners import open_runner
    from mambatrt.runtime.tokenizer import Tokenizer

    bundle = load_bundle(args.bundle)
    items = read_cloze(args.data, Tokenizer(bundle), args.limit)
    counts = _unigram(args, bundle.config.vocab_size)
    with open_runner(bundle, args.device) as runner:
        result = evaluate_items(Engine(runner, EngineConfig(max_batch=1)), items, progress=not args.quiet)
        where = f"{runner.name}/{runner.device}, {bundle.layout}, {bundle.precision}"
    out = {"bundle": str(bundle.path), "layout": bundle.layout, "precision": bundle.precision}
    return {**out, "where": where, "items": items, "counts": counts, **result.to_dict()}


def _through_server(args: argparse.Namespace) -> dict:
    """The cloze through the server at ``args.url``: the passages encoded and scored there."""
    import httpx

    from mambatrt.errors import InputError
    from mambatrt.runtime.evaluate import read_cloze
    from mambatrt.runtime.loadgen import api_headers, served_models
    from mambatrt.runtime.served_eval import ServerTokenizer, evaluate_served

    url = args.url.rstrip("/")
    models = served_models(url)
    if len(models) != 1:
        raise InputError(f"{url} serves {models}; eval --url needs a server of one model")
    model = models[0]
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    with httpx.Client(headers=api_headers(), timeout=httpx.Timeout(600.0), limits=limits) as client:
        items = read_cloze(args.data, ServerTokenizer(client, url), args.limit)
        counts = _unigram(args, None)
        result = evaluate_served(client, url, model, items, args.concurrency, progress=not args.quiet)
    where = f"{model} at {url}"
    out = {"url": url, "model": model, "where": where, "concurrency": args.concurrency}
    return {**out, "items": items, "counts": counts, **result}


def _unigram(args: argparse.Namespace, vocab_size: int | None):
    """The --unigram counts (read, and their errors said, before the evaluation), or None."""
    from mambatrt.runtime.evaluate import read_unigram

    return read_unigram(args.unigram, vocab_size) if args.unigram else None
