"""``mambatrt run``: generate text or tokens from a bundle. Imports numpy and a backend only -- never torch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mambatrt.cli import add_quiet_arg

MAX_BENCH_TOKENS = 1_000_000  # a longer random prompt is a typo, not a benchmark (and may not fit in memory)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """--backend / --device / --no-verify, shared by run, eval and bench."""
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "ort", "trt"),
        help="auto: TensorRT when a runtime and the bundle's plans are present, else onnxruntime (default: auto)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="onnxruntime device (default: cpu)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle's files")
    p.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="onnxruntime on CUDA: run the graphs node by node instead of replaying captured CUDA graphs",
    )
    add_graphs_arg(p)


def _open(bundle, args: argparse.Namespace):
    """The backend that --backend/--device/--graphs/--no-cuda-graph ask for."""
    from mambatrt.runtime.backends import open_backend

    return open_backend(bundle, args.backend, args.device, not args.no_cuda_graph, args.graphs)


def add_graphs_arg(p: argparse.ArgumentParser) -> None:
    """--graphs: which graph flavour onnxruntime runs."""
    p.add_argument(
        "--graphs",
        choices=("auto", "portable", "fused", "kernels"),
        default="auto",
        help="graph flavour for onnxruntime: 'kernels' uses mambatrt's op library carried in the bundle (fewest "
        "kernels), 'fused' onnxruntime's built-in Mamba ops, 'portable' standard ONNX only (what TensorRT plans are "
        "built from); auto: kernels where the bundle's library has kernels for the device (always on the CPU), "
        "else fused on CUDA, else portable (default: auto)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``run``, ``bench`` and ``eval`` subcommands."""
    p = sub.add_parser(
        "run",
        help="generate from a bundle",
        description="Prefill a prompt (in chunks on the prefill engine for 'split' bundles, token by token for "
        "'single' ones) and decode new tokens. Greedy by default; --temperature > 0 samples.",
    )
    p.add_argument("bundle", metavar="BUNDLE_DIR", help="a bundle built by `mambatrt bundle`")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the bundle's tokenizer.json)")
    src.add_argument("--prompt-ids", type=_ids, metavar="1,2,3", help="prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract from the logit of each token generated so far "
        "(OpenAI's presence_penalty, in [-2, 2]; default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtract this much per time a token was generated "
        "(OpenAI's frequency_penalty, in [-2, 2]; default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--logit-bias", type=_bias, nargs="+", default=[], metavar="ID=VALUE",
        help="add VALUE (in [-100, 100]) to token ID's logit; 100 all but forces it, -100 all but bans it",
    )  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    out.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and timings")
    p.add_argument("--load-state", metavar="FILE", help="continue a conversation from a state saved earlier")
    p.add_argument("--save-state", metavar="FILE", help="save the state afterwards, to continue later")
    add_backend_args(p)
    p.set_defaults(func=run)
    register_bench(sub)
    register_eval(sub)
    register_serve(sub)
    register_bench_serve(sub)


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    p = sub.add_parser(
        "bench",
        help="time prefill (chunked vs token by token) and decode",
        description="For each prompt length: prefill on the split path and token by token on the same bundle, "
        "decode ms/token and time to first token; warm-up excluded, median and spread over repeats. Prefill time "
        "ends when the last chunk's logits are on the host (the final state update is complete).",
    )
    p.add_argument("bundle", metavar="BUNDLE_DIR")
    p.add_argument(
        "--prompt-lengths",
        type=_ids,
        default=[5, 71, 84, 128, 512],
        metavar="5,71,...",
        help="prompt lengths (default: 5,71,84,128,512)",
    )
    p.add_argument("--new-tokens", type=int, default=8, help="tokens decoded per run (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per path (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default: %(default)s)")
    p.add_argument(
        "--reference",
        choices=("hf",),
        default=None,
        help="also time transformers' MambaForCausalLM on the same device and precision (needs torch)",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint for --reference (default: the manifest's)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (timings per path and prompt length, and the split path's speedups); "
        "each row's line goes to stderr as it is measured",
    )
    add_quiet_arg(p, "with --json: no progress lines on stderr")
    add_backend_args(p)
    p.set_defaults(func=bench)


def bench(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt bench``: progress lines on stderr with --json, the table rows on stdout without."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.bench import row_line, run_bench, speedups
    from mambatrt.runtime.bundle import load_bundle

    if args.repeat < 1 or args.new_tokens < 1 or not args.prompt_lengths or min(args.prompt_lengths) < 1:
        raise InputError("--repeat, --new-tokens and every prompt length must be >= 1")
    if args.warmup < 0:
        raise InputError(f"--warmup must be >= 0, got {args.warmup}")
    if max(args.prompt_lengths) > MAX_BENCH_TOKENS:
        raise InputError(f"prompt lengths go up to {MAX_BENCH_TOKENS} tokens, got {max(args.prompt_lengths)}")
    bundle = load_bundle(args.bundle, verify=not args.no_verify)
    checkpoint = Path(args.checkpoint or bundle.manifest.checkpoint or "")
    if args.reference == "hf" and not (checkpoint / "config.json").is_file():
        raise InputError(f"{checkpoint}: no checkpoint for --reference hf; pass --checkpoint DIR")

    def show(row: dict, ratios: dict | None = None) -> None:  # the table on stdout, or progress on stderr
        if not (args.json and args.quiet):
            print(row_line(row, ratios), file=sys.stderr if args.json else sys.stdout, flush=True)

    with _open(bundle, args) as backend:
        result = run_bench(backend, args.prompt_lengths, args.new_tokens, args.repeat, args.warmup, on_row=show)
    if args.reference == "hf":
        # after every mambatrt timing: torch's thread pool, once started, competes with onnxruntime's on small CPUs
        from mambatrt.reference import hf_timings

        for row in result.rows:
            row["hf"] = hf_timings(
                checkpoint, row["prompt_len"], args.new_tokens, args.repeat, result.device, bundle.precision
            )
            hf_ratios = {k: v for k, v in speedups(row).items() if k.endswith("_hf")}
            show({"prompt_len": row["prompt_len"], "hf": row["hf"]}, hf_ratios)  # the mambatrt columns came first
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0


def register_eval(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    p = sub.add_parser(
        "eval",
        help="LAMBADA-style last-word accuracy and perplexity",
        description='Last-word cloze on lambada_openai-format JSONL ({"text": ...} per line): accuracy (greedy '
        "continuation reproduces the whole last word) and the last word's perplexity. Works on any bundle with a "
        "tokenizer and on any backend.",
    )
    p.add_argument("bundle", metavar="BUNDLE_DIR")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="passages, one JSON object per line")
    p.add_argument("--limit", type=int, default=None, help="only the first N passages")
    p.add_argument(
        "--unigram",
        metavar="FILE.json",
        default=None,
        help="token counts (a JSON list) for a unigram baseline on the same passages",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_quiet_arg(p, "no progress bar")
    add_backend_args(p)
    p.set_defaults(func=evaluate_cmd)


def evaluate_cmd(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt eval``: every input is read and checked before the evaluation starts."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.evaluate import evaluate, read_cloze, read_unigram, unigram_baseline
    from mambatrt.runtime.generate import Generator
    from mambatrt.runtime.tokenizer import Tokenizer

    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be >= 1, got {args.limit}")
    bundle = load_bundle(args.bundle, verify=not args.no_verify)
    items = read_cloze(args.data, Tokenizer(bundle), args.limit)
    counts = read_unigram(args.unigram, bundle.config.vocab_size) if args.unigram else None
    with _open(bundle, args) as backend:
        result = evaluate(Generator(backend), items, progress=not args.quiet)
    out = {
        "bundle": str(bundle.path),
        "backend": backend.name,
        "layout": bundle.layout,
        "precision": bundle.precision,
        **result.to_dict(),
    }
    if counts is not None:
        out["unigram"] = unigram_baseline(items, counts).to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    line = f"{out['count']} passages: accuracy {out['accuracy']:.2f} %, last-word perplexity {out['perplexity']:.2f}"
    if "unigram" in out:
        u = out["unigram"]
        line += f" (unigram baseline: {u['accuracy']:.2f} %, perplexity {u['perplexity']:.2f})"
    print(f"{line} [{backend.name}, {bundle.layout}, {bundle.precision}]")
    return 0


def _bias(text: str) -> tuple[int, float]:
    """``--logit-bias`` item ID=VALUE -> (id, value); a malformed one is argparse's usage error."""
    from mambatrt.runtime.generate import token_id_key

    token, sep, value = text.partition("=")
    token_id = token_id_key(token) if sep else None
    try:
        if token_id is not None:
            return token_id, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=VALUE (a token id and a number), got {text!r}")


def run(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt run``: what can be checked (bundle, prompt, state files) is checked before generating."""
    from mambatrt.paths import check_output_file
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.generate import Sampling, read_state, write_state
    from mambatrt.runtime.tokenizer import Tokenizer

    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_on_eos=not args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=tuple(sorted(args.logit_bias)),
    )
    if args.save_state:
        check_output_file(args.save_state, "--save-state", "state.npz")
    bundle = load_bundle(args.bundle, verify=not args.no_verify)
    tokenizer = None
    if args.prompt is not None or bundle.tokenizer_path:
        tokenizer = Tokenizer(bundle, instead="pass the prompt as --prompt-ids 1,2,3")
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt is not None else args.prompt_ids
    prompt_text = None
    if tokenizer is not None:
        prompt_text = args.prompt if args.prompt is not None else tokenizer.decode(prompt_ids)
    opened = time.perf_counter()
    with _open(bundle, args) as backend:
        load_ms = (time.perf_counter() - opened) * 1e3
        state, pending = None, None
        if args.load_state:
            conv, ssm, pending = read_state(args.load_state, bundle.identity, bundle.config.vocab_size)
            backend.graph_state(conv, ssm)  # shapes checked before any launch
            state = (conv, ssm)
        if args.stream:  # the prompt once the backend is open and the state loaded: an error comes before any text
            sys.stdout.write(prompt_text or "")
        result, final = _generate(args, backend, bundle, prompt_ids, sampling, tokenizer, state, pending)
        _print_generation(args, result, tokenizer, prompt_text, backend, load_ms)  # before saving: never lost
        if args.save_state:
            write_state(args.save_state, bundle.identity, *final.state, result.tokens[-1] if result.tokens else None)
    return 0


def _generate(args, backend, bundle, prompt_ids, sampling, tokenizer, state, pending):
    """One prompt through the serving engine with one slot (the same path as a served request); returns the
    :class:`Generation` (times from the caller's clock) and the final event (with the states for --save-state)."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.engine import Engine, Request
    from mambatrt.runtime.generate import Generation, token_ids
    from mambatrt.runtime.tokenizer import eos_id

    prompt = token_ids(prompt_ids, bundle.config.vocab_size)  # checked before any launch
    if not prompt:
        raise InputError("empty prompt: pass at least one token (--prompt or --prompt-ids)")
    stream = tokenizer.stream() if args.stream and tokenizer is not None else None
    engine = Engine(backend, max_batch=1, max_queue=1, eos_id=eos_id(bundle))
    tokens, times, ended = [], [], []

    def emit(event) -> None:
        if event.token is not None:
            times.append(time.perf_counter())
            tokens.append(event.token)
            if args.stream:
                sys.stdout.write(stream(event.token) if stream is not None else f" {event.token}")
                sys.stdout.flush()
        if event.finish_reason is not None:
            ended.append(event)

    fed = ([pending] if pending is not None else []) + prompt  # the token generated last time is not fed yet
    request = Request(fed, sampling, emit, state=state, keep_state=bool(args.save_state))
    start = time.perf_counter()
    engine.run_inline(request)
    end = time.perf_counter()
    final = ended[0]
    eos = final.finish_reason == "stop"
    first = times[0] if times else end
    steps = max(len(tokens) - 1, 0)
    result = Generation(
        prompt_ids=prompt,
        tokens=tokens,
        prefill_ms=(first - start) * 1e3,  # up to the first token (its sampling included)
        ttft_ms=(first - start) * 1e3,
        decode_ms_per_token=(times[-1] - first) * 1e3 / steps if steps else None,
        decode_steps=steps,
        prefill_launches=final.prefill_launches,
        stopped="eos" if eos else "max_new_tokens",
    )
    return result, final


def _print_generation(
    args: argparse.Namespace, result, tokenizer, prompt_text: str | None, backend, load_ms: float
) -> None:
    """``run``'s output: the JSON object, or the text (ids without a tokenizer) and a timing line on stderr."""
    text = tokenizer.decode(result.tokens) if tokenizer is not None else None
    bundle = backend.bundle
    if args.json:
        out = result.to_dict(text)
        out.update(
            backend=backend.name,
            device=backend.device,
            graphs=backend.flavour,
            cuda_graph=dict(getattr(backend, "captured", {})),
            load_ms=round(load_ms, 2),  # sessions opened (and, on CUDA, each graph's warm-up launch)
        )
        out.update(layout=bundle.layout, precision=bundle.precision)
        print(json.dumps(out), flush=True)
        return
    if args.stream:
        print(flush=True)
    elif text is not None:
        print(prompt_text + text, flush=True)
    else:
        print(",".join(str(t) for t in result.tokens), flush=True)
    decode = "n/a" if result.decode_ms_per_token is None else f"{result.decode_ms_per_token:.2f} ms/token"
    print(
        f"[{backend.name}/{backend.device}, {bundle.layout}, {backend.flavour}] "
        f"prompt {len(result.prompt_ids)} tokens in "
        f"{result.prefill_launches} launches: prefill {result.prefill_ms:.1f} ms, ttft {result.ttft_ms:.1f} ms, "
        f"decode {decode}",
        file=sys.stderr,
    )


API_SERVERS_CUDA = 2  # `serve --device cuda`'s default --api-server-count


# On a GPU new prompts gather to half the running sequences (at most one prefill launch's prompts) before a prefill
# round: lower ITL p50 at concurrency 64 on the H200 (fp16 and fp32), later first tokens. On the CPU the servers
# disagreed (pinned: more tokens/s at concurrency 16; beside AIPerf's processes: fewer), and first tokens came later
# in all: off there (BENCHMARKS.md, session 20).
SERVE_GATHER_RATIO_CUDA = 0.5


def register_serve(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = sub.add_parser(
        "serve",
        help="serve a bundle over HTTP (OpenAI-compatible /v1/completions, continuous batching)",
        description="An OpenAI-compatible server (POST /v1/completions, GET /v1/models, /health, /metrics) over one "
        "bundle. Requests share the model through continuous batching: every decode launch advances all running "
        "sequences; prompts are prefilled in chunks between decode launches. States after prompts and completions "
        "are cached by token prefix (--state-cache-mib), so a prompt that extends an earlier one prefills only the "
        "new tokens. Stops on Ctrl-C or SIGTERM after finishing the requests in flight; those still running 8 s "
        'later end there (a stream with finish reason "abort" and [DONE], a plain request with a 503).',
        epilog="With --device cuda and the kernels graphs, decode batches of 2 and more run the bundle's "
        "decode.kernels-cuda.onnx where it has one (the fp32 products on the tensor cores at fp32 accuracy; a "
        "second copy of the weights on the GPU), and prefill launches prefill.kernels-cuda.onnx where it has one "
        "(bundles built with CUTLASS's headers); MAMBATRT_CUDA_LINEAR=0 in the environment runs the Gemms instead.",
    )
    p.add_argument("bundle", metavar="BUNDLE_DIR")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model runs: onnxruntime on the CPU, or its CUDA provider with the state slots on the GPU "
        "(needs onnxruntime-gpu; default: cpu)",
    )
    p.add_argument(
        "--no-cuda-graph", action="store_true", help="with --device cuda: run launches node by node, not captured"
    )
    add_graphs_arg(p)
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="write cProfile statistics of the engine thread to DIR/engine.prof and of each HTTP front end to "
        "DIR/http.prof (the first), DIR/http-1.prof, ... when the server stops (where a server's CPU time goes; "
        "`python -m pstats FILE` reads them), and DIR/engine-samples.txt: the engine thread's stack sampled every "
        "2 ms, each function's share of the samples. From Python 3.12 on, cProfile sees every thread of its "
        "process (sys.monitoring): engine.prof then mixes the engine thread with the prefill launches' thread (its "
        "call counts and cumulative times go wrong); the samples are the engine thread's alone",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write one JSON line per engine iteration to FILE when the server stops (prefill and decode ms, "
        "sequences running, staged and waiting, the prefill launches; on cuda with the kernels graphs each decode "
        "launch's time on the GPU and how long the GPU's decode stream stood idle before it; the last million "
        "iterations): where serving time goes (scripts/trace_summary.py sums it up)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="with --device cuda: skip capturing the decode and batched prefill launch shapes at start (quicker "
        "start; the first requests that need each shape then wait for its capture)",
    )
    p.add_argument(
        "--max-batch", type=int, default=None, help="sequences decoding at once (default: the bundle's max_batch)"
    )
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond which 429 is answered")
    p.add_argument(
        "--prefill-rows",
        type=int,
        default=None,
        help="prompt rows prefilled between two decode launches (default: one prefill chunk, e.g. 64; with graphs "
        "whose prefill launch takes several prompts, the fused and kernels graphs of a schema-3 bundle: a chunk "
        "per prompt of that launch on cuda, four chunks on the cpu). More rows admit queued prompts faster "
        "(throughput when many prompts wait) at the cost of longer inter-token latency for the sequences already "
        "decoding",
    )
    p.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="prefill launches beside the decode launches (the decoding sequences then do not wait for whole "
        "prefill launches between two tokens) or before each decode launch. auto: beside on cuda where the graphs "
        "run on streams of their own (the kernels graphs of a bundle built by this version), before on the cpu, "
        "where the two would share the cores (default: auto)",
    )
    p.add_argument(
        "--pipeline",
        choices=("auto", "on", "off", "ahead", "fed"),
        default="auto",
        help="with prefill beside decode: the engine's host work that needs neither a decode launch's tokens nor "
        "the state slots (sending the last tokens to the HTTP front ends, caching and staging prompts, planning "
        "prefill) runs while the decode launch runs on the GPU (on), or between launches, the GPU waiting (off: "
        "for comparison); ahead: also each decode launch begins as soon as the last one's tokens are picked, and "
        "handling them (emitting, finishing sequences) runs beside it; fed: also, while no prompt joins and all "
        "decode greedily, each decode launch is queued behind the last one before its tokens reach the host, fed "
        "them on the device (the GPU runs the launches back to back; a sequence that ends keeps its slot, computed "
        "and ignored, for a few launches). auto: fed where decode launches are queued without waiting (cuda), on "
        "elsewhere (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-sms",
        default="auto",
        metavar="N|auto",
        help="with --device cuda and prefill beside decode: run the prefill launches on N of the GPU's SMs only (a "
        "CUDA green context; rounded up to the device's granularity, 8 on Hopper), so that decode launches always "
        "find free SMs beside a long prefill launch (lower inter-token latency, later first tokens). auto: half of "
        "the GPU's SMs where the driver and the bundle's kernels library can make the partition, else the whole "
        "GPU; 0: prefill may use the whole GPU (default: %(default)s)",
    )
    p.add_argument(
        "--waiting-served-ratio",
        type=float,
        default=None,
        metavar="R",
        help="while sequences decode, let new prompts gather until they number R x the running sequences (at most "
        "one prefill launch's prompts) before prefilling them, so that prefill comes in fewer, larger rounds and "
        "most decode iterations run without one (lower median inter-token latency, later first tokens); as in "
        "text-generation-inference. 0: prefill as soon as a prompt waits (default: "
        f"{SERVE_GATHER_RATIO_CUDA} with --device cuda, 0 on the cpu)",
    )
    p.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=20,
        metavar="N",
        help="with --waiting-served-ratio: a prompt waits at most N decode iterations (default: %(default)s)",
    )
    p.add_argument(
        "--state-cache-mib",
        type=float,
        default=256.0,
        help="memory for cached states, MiB: host memory on the cpu, GPU memory with --device cuda (0: no cache; "
        "default: 256)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: the bundle's folder)"
    )
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (default: one per core)")
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="HTTP front-end processes, sharing the port (each streams its requests' tokens on a core of its own; "
        f"the engine keeps this process). Default: {API_SERVERS_CUDA} with --device cuda, 1 on the cpu",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle's files")
    p.set_defaults(func=serve)


# The engine thread and the router thread share the engine process's GIL, which Python hands over every 5 ms by
# default: an engine thread back from a decode launch could wait that long (a whole inter-token gap at high
# concurrency). `serve` shortens it: 4-5 % more tokens/s at concurrency 1 and 64 on the H200 when the HTTP loop
# still shared the process (BENCHMARKS.md, session 9; one run each, within what runs vary by).
SERVE_SWITCH_INTERVAL_S = 0.0005


def serve(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt serve``: checks, the port, the engine, then the HTTP front ends until Ctrl-C or SIGTERM
    (exit 0)."""
    import signal
    import threading

    from mambatrt.errors import InputError
    from mambatrt.paths import check_output_file, check_output_folder, write_atomic
    from mambatrt.runtime.backends import open_backend
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.engine import Engine
    from mambatrt.runtime.tokenizer import Tokenizer, eos_id

    try:
        from mambatrt.runtime.host import FrontEndFailed, Metrics, ServingHost, listening_socket
        from mambatrt.runtime.server import frontend_main
    except ImportError as exc:
        raise InputError(
            f"serving needs fastapi, uvicorn and prometheus-client ({exc}); pip install 'mambatrt[serve]'"
        ) from None
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        raise InputError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.prefill_rows is not None and args.prefill_rows < 1:
        raise InputError(f"--prefill-rows must be >= 1, got {args.prefill_rows}")
    if args.prefill_sms == "auto":
        args.prefill_sms = None if args.device == "cuda" else 0
    else:
        try:
            args.prefill_sms = int(args.prefill_sms)
        except ValueError:
            raise InputError(f"--prefill-sms takes a number of SMs or 'auto', got {args.prefill_sms!r}") from None
        if args.prefill_sms < 0:
            raise InputError(f"--prefill-sms must be >= 0, got {args.prefill_sms}")
        if args.prefill_sms and args.device != "cuda":
            raise InputError("--prefill-sms applies to --device cuda")
    if args.waiting_served_ratio is None:
        args.waiting_served_ratio = SERVE_GATHER_RATIO_CUDA if args.device == "cuda" else 0.0
    if not args.waiting_served_ratio >= 0 or args.max_waiting_tokens < 0:
        raise InputError("--waiting-served-ratio and --max-waiting-tokens must be >= 0")
    if args.max_queue < 1 or not args.state_cache_mib >= 0 or args.threads < 0:
        raise InputError("--max-queue must be >= 1, --state-cache-mib >= 0 and --threads >= 0")
    api_servers = args.api_server_count
    if api_servers is None:
        api_servers = API_SERVERS_CUDA if args.device == "cuda" else 1
    if api_servers < 1:
        raise InputError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.trace is not None:
        check_output_file(args.trace, "--trace")
    if args.profile is not None:
        check_output_folder(args.profile, "--profile")
    sock = listening_socket(args.host, args.port)  # a taken port is said before the engine loads
    try:
        bundle = load_bundle(args.bundle, verify=not args.no_verify)
        tokenizer = Tokenizer(bundle) if bundle.tokenizer_path else None
        backend = open_backend(
            bundle, "ort", args.device, not args.no_cuda_graph, args.graphs, args.threads, args.prefill_sms
        )
        engine = Engine(
            backend,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            cache_bytes=int(args.state_cache_mib * 2**20),
            eos_id=eos_id(bundle),
            decode_text=tokenizer.stream if tokenizer is not None else None,
            prefill_rows=args.prefill_rows,
            overlap={"auto": None, "on": True, "off": False}[args.overlap],
            pipeline=args.pipeline != "off",
            ahead={"auto": None, "ahead": True, "fed": True}.get(args.pipeline, False),
            feed={"auto": None, "fed": True}.get(args.pipeline, False),
            waiting_served_ratio=args.waiting_served_ratio,
            max_waiting_tokens=args.max_waiting_tokens,
        )
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or bundle.path.resolve().name
    mib = 2**-20
    print(
        f"mambatrt serve: {name} ({bundle.layout}, {bundle.precision}, {backend.flavour} graphs) on {args.device}: "
        f"{engine.max_batch} slots of {engine.slot_bytes * mib:.2f} MiB"
        f"{f' x {engine.pool.state_buffers} buffers' if engine.pool.state_buffers > 1 else ''} = "
        f"{engine.pool.slots_bytes * mib:.1f} MiB of states, "
        f"{engine.pool.staging_rows} prompt(s) per prefill launch ({engine.pool.staging_bytes * mib:.1f} MiB of "
        f"staging), {engine.prefill_rows} prompt rows per iteration, state cache {args.state_cache_mib:g} MiB "
        f"({engine.cache.capacity} states), "
        f"{f'prompts gather to {engine.waiting_served_ratio:g} x running, ' if engine.waiting_served_ratio else ''}"
        f"{api_servers} HTTP front end(s); "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    # Ctrl-C or SIGTERM: the front ends stop accepting and finish their requests while the engine still runs them
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    host = ServingHost(engine, Metrics(engine))
    failed, sampler = None, None
    try:
        if not args.no_warmup:
            shapes, seconds = engine.warm()
            if shapes:
                print(f"mambatrt serve: captured {shapes} launch shapes in {seconds:.1f} s", file=sys.stderr)
        if args.profile is not None:
            import cProfile

            Path(args.profile).mkdir(parents=True, exist_ok=True)
            engine.profile = cProfile.Profile()
        if args.trace is not None:
            import collections

            engine.trace = collections.deque(maxlen=1_000_000)
        sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)
        engine.start()
        if args.profile is not None:  # the engine thread alone (engine.prof holds every thread from Python 3.12 on)
            from mambatrt.runtime.stack_sampler import StackSampler

            sampler = StackSampler(engine.thread.ident).start()
        for note in backend.notes:  # e.g. why prefill launches keep the whole GPU, a graph not captured
            print(f"mambatrt serve: {note}", file=sys.stderr)
        sms = getattr(backend, "prefill_sms", 0)  # the CUDA backend's
        if engine.overlap:
            where = f" on {sms} SMs" if sms else ""
            also = ", host work beside them too" if engine.pipelined and engine.pool.async_decode else ""
            also += ", decode launches begun ahead" if engine.looking_ahead else ""
            also += ", greedy ones before the last one's tokens reach the host" if engine.feeding else ""
            print(f"mambatrt serve: prefill launches run beside the decode launches{where}{also}", file=sys.stderr)
        elif sms:
            print(f"mambatrt serve: prefill launches run on {sms} SMs (not beside decode: --overlap)", file=sys.stderr)
        if backend.device == "cuda":  # the decode copy runs in the pool's batched session
            linear = [what for what, on in (
                ("decode batches of 2 and more", engine.pool.linear),
                ("prefill launches", backend.linear(engine.prefill_graph)),
            ) if on]  # fmt: skip
        else:
            linear = [f"{graph} launches" for graph in backend.graphs if backend.linear(graph)]
        if linear:
            kind = backend.device.upper()
            print(
                f"mambatrt serve: {' and '.join(linear)} run MambaLinear (the kernels graphs' {kind} copies; "
                f"MAMBATRT_{kind}_LINEAR=0 turns them off)",
                file=sys.stderr,
            )
        if not stop.is_set():
            sock.listen(2048)
            frontend = dict(bundle_dir=str(bundle.path), model_name=name, profile_dir=args.profile)
            host.start(sock, api_servers, frontend_main, frontend, stop)
            if not stop.is_set():
                print("mambatrt serve: ready", file=sys.stderr, flush=True)
            host.wait(stop)
    except FrontEndFailed as exc:
        failed = str(exc)
    finally:
        host.shutdown()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.stop()
        backend.close()
        if args.trace is not None:
            try:
                write_atomic(args.trace, lambda f: f.write(engine.trace_lines().encode()))
            except OSError as exc:  # a full disk at the end: say so, the server has stopped anyway
                raise InputError(f"{args.trace}: cannot write the trace ({exc.strerror or exc})") from None
        if engine.profile is not None:
            engine.profile.dump_stats(str(Path(args.profile) / "engine.prof"))
        if sampler is not None:
            sampler.stop()
            write_atomic(Path(args.profile) / "engine-samples.txt", lambda f: f.write(sampler.report().encode()))
    if failed is not None:
        print(f"mambatrt serve: {failed}", file=sys.stderr)
        return 1
    return 0


def register_bench_serve(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench-serve`` subcommand (the project's own load client)."""
    p = sub.add_parser(
        "bench-serve",
        help="load a running server (OpenAI /v1/completions) and report AIPerf's figures",
        description="Streams synthetic requests (random token ids, --input-tokens long, --output-tokens generated "
        "with ignore_eos) at each concurrency and prints output tokens/s, requests/s, time to first token and "
        "inter-token latency (p50/p99) as AIPerf defines them. For machines where AIPerf cannot be installed; "
        "several --url are used round robin (replicas).",
    )
    p.add_argument("--url", action="append", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name (GET /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1], help="concurrency levels (default: 1)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(16, 4 x concurrency))")
    p.add_argument("--input-tokens", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [0, VOCAB) (default: 1000)")
    p.add_argument("--warmup", type=int, default=0, help="requests sent (at the first concurrency) before measuring")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the prompts of level C are drawn with seed SEED + C (default: 0): runs against one server with other "
        "seeds send other prompts, which its state cache has not seen",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' temperature: 0 greedy (default), 1 what AIPerf's requests get (it sends none; the OpenAI "
        "default)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures of every level to FILE")
    p.add_argument(
        "--cloze",
        metavar="FILE.jsonl",
        help="instead of load: send each passage of a lambada-format file at concurrency 1 and report accuracy "
        "(as `mambatrt eval` counts it) and task-call latency; needs --bundle for the tokenizer",
    )
    p.add_argument("--bundle", metavar="BUNDLE_DIR", help="with --cloze: the served bundle (its tokenizer)")
    p.set_defaults(func=bench_serve)


def bench_serve(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt bench-serve``: one table row per concurrency on stdout."""
    from dataclasses import asdict

    from mambatrt.errors import InputError
    from mambatrt.runtime.loadgen import TABLE_HEAD, run_level

    try:
        import aiohttp  # noqa: F401  (the load's client: checked here, before any request)
        import httpx
    except ImportError as exc:
        raise InputError(f"bench-serve needs httpx and aiohttp ({exc}); pip install 'mambatrt[serve]'") from None
    if min(args.concurrency) < 1 or args.requests < 0 or args.input_tokens < 1 or args.output_tokens < 1:
        raise InputError("--concurrency, --input-tokens and --output-tokens must be >= 1, --requests >= 0")
    if args.seed < 0:
        raise InputError(f"--seed must be >= 0, got {args.seed}")
    from mambatrt.runtime.generate import Sampling

    Sampling(temperature=args.temperature)  # the server's own checks (InputError): finite, >= 0, not below 1e-3
    urls = [u.rstrip("/") for u in args.url]
    for url in urls:  # before any load: a wrong URL or model is one line, not a table of errors
        try:
            models = httpx.get(f"{url}/v1/models", timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise InputError(f"{url}: no OpenAI-compatible server answers ({exc}); start `mambatrt serve`") from None
        names = [m.get("id") for m in models.get("data", [])]
        if args.model not in names:
            raise InputError(f"{url} serves {names}, not '{args.model}'; pass --model with one of them")
    if args.cloze:
        return _bench_cloze(args, urls[0])
    shape = (args.input_tokens, args.output_tokens, args.vocab)
    if args.warmup:
        run_level(urls, args.model, args.concurrency[0], args.warmup, *shape, args.seed, args.temperature)
    results = []
    print(TABLE_HEAD, flush=True)
    for c in args.concurrency:
        n = args.requests or max(16, 4 * c)
        result, errors = run_level(urls, args.model, c, n, *shape, seed=args.seed + c, temperature=args.temperature)
        results.append(result)
        print(result.row(), flush=True)
        for e in errors[:3]:
            print(f"  error: {e}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


def _bench_cloze(args: argparse.Namespace, url: str) -> int:
    """``bench-serve --cloze``: accuracy and task-call latency through the server, one request at a time."""
    from mambatrt.errors import InputError
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.evaluate import read_cloze
    from mambatrt.runtime.loadgen import run_cloze
    from mambatrt.runtime.tokenizer import Tokenizer

    if not args.bundle:
        raise InputError("--cloze needs --bundle BUNDLE_DIR (its tokenizer turns the passages into token ids)")
    items = read_cloze(args.cloze, Tokenizer(load_bundle(args.bundle, verify=False)), args.requests or None)
    result = run_cloze(url, args.model, items)
    t = result["task_call_ms"]
    print(
        f"cloze through {url}: accuracy {result['accuracy']:.2f} % of {result['count']}, "
        f"task call p50 {t['p50']:.2f} ms, p99 {t['p99']:.2f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0
