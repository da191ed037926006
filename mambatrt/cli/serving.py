"""``mambatrt serve`` (an OpenAI-compatible server over a bundle) and ``mambatrt bench-serve`` (its load client)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import add_bundle_arg, add_device_arg

SERVE_DESCRIPTION = (
    "An OpenAI-compatible server (POST /v1/completions and /v1/chat/completions, GET /v1/models, POST /tokenize, "
    "GET /health and /metrics) over one bundle. Requests share the model through continuous batching: every decode "
    "launch advances all running sequences; prompts are prefilled in chunks between decode launches. States after "
    "prompts and completions are cached by token prefix (--state-cache-mib), so a prompt that extends an earlier "
    "one prefills only the new tokens. On Ctrl-C or SIGTERM it drains: new requests get 503, those in flight "
    'finish, and those still running 8 s later end there (a stream with finish reason "abort" and [DONE], a plain '
    "request with a 503). docs/serving.md says more."
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` and ``bench-serve`` subcommands."""
    from mambatrt.runtime.engine.config import DEFAULT_MAX_QUEUE

    p = sub.add_parser("serve", help="serve a bundle over HTTP (OpenAI-compatible, continuous batching)",
                       description=SERVE_DESCRIPTION)  # fmt: skip
    add_bundle_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    add_device_arg(p)
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoding at once: the state slots (default: the bundle's max batch)")  # fmt: skip
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests waiting for a slot (each choice of a request counts) beyond which new ones get 429 with "
        "Retry-After (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-rows",
        type=int,
        default=None,
        help="prompt rows prefilled between two decode launches (default: one prefill chunk per prompt of a "
        "prefill launch on a GPU, four chunks on the CPU). More rows admit queued prompts sooner (throughput when "
        "many prompts wait) at the cost of the inter-token latency of the sequences already decoding",
    )
    p.add_argument(
        "--state-cache-mib",
        type=float,
        default=256,
        help="memory for cached states, MiB: host memory on the CPU, GPU memory on a GPU (0: no cache; default: "
        "%(default)s)",
    )
    p.add_argument("--served-model-name", help="the model name clients use (default: the bundle's folder)")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (default: one per core)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key as a bearer token (header 'Authorization: Bearer KEY') on /v1/*, /tokenize and "
        "/detokenize; /health and /metrics stay open (default: $MAMBATRT_API_KEY, else no key)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template (as transformers and vLLM take) for /v1/chat/completions (default: the "
        "template in the bundle's tokenizer_config.json; without one chat answers 404)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="HTTP front-end processes, sharing the port; each streams its requests' tokens on a core of its own, "
        "the engine keeps this process (default: 2 on a GPU, 1 on the CPU)",
    )
    p.set_defaults(func=serve)
    _register_bench_serve(sub)


def serve(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt serve``: the configuration, then the server until Ctrl-C or SIGTERM."""
    from mambatrt import envs
    from mambatrt.errors import InputError
    from mambatrt.runtime.serve.server import ServeConfig
    from mambatrt.runtime.serve.server import serve as run_server

    if not args.state_cache_mib >= 0:  # NaN too
        raise InputError(f"--state-cache-mib must be >= 0, got {args.state_cache_mib}")
    engine = dict(max_batch=args.max_batch, max_queue=args.max_queue, prefill_rows=args.prefill_rows)
    engine["cache_bytes"] = int(args.state_cache_mib * 2**20)
    config = ServeConfig(
        bundle=args.bundle,
        host=args.host,
        port=args.port,
        device=args.device,
        threads=args.threads,
        api_server_count=args.api_server_count,
        served_model_name=args.served_model_name,
        api_key=args.api_key or envs.MAMBATRT_API_KEY,
        chat_template=args.chat_template,
        engine=engine,
    )
    return run_server(config)


def _register_bench_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-serve",
        help="load a running server (OpenAI /v1/completions) and report AIPerf's figures",
        description="Streams synthetic requests (random token ids, --input-tokens long, --output-tokens generated "
        "with ignore_eos) at each concurrency and prints output tokens/s, requests/s, time to first token and "
        "inter-token latency (p50/p99) as AIPerf defines them, as a Markdown table. For machines where AIPerf "
        "cannot be installed; several --url are used round robin (replicas).",
    )
    p.add_argument("--url", action="append", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name (GET /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1], help="concurrency levels (default: 1)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(16, 4 x concurrency))")
    p.add_argument("--input-tokens", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
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
    p.set_defaults(func=bench_serve)


def bench_serve(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt bench-serve``: one table row per concurrency on stdout."""
    from dataclasses import asdict

    from mambatrt.errors import InputError
    from mambatrt.runtime.engine import Sampling
    from mambatrt.runtime.loadgen import TABLE_HEAD, run_level, served_models

    try:
        import aiohttp  # noqa: F401  (the load's client: checked here, before any request)
    except ImportError as exc:
        raise InputError(f"bench-serve needs httpx and aiohttp ({exc}); pip install 'mambatrt[serve]'") from None
    if min(args.concurrency) < 1 or args.requests < 0 or args.input_tokens < 1 or args.output_tokens < 1:
        raise InputError("--concurrency, --input-tokens and --output-tokens must be >= 1, --requests >= 0")
    if args.seed < 0:
        raise InputError(f"--seed must be >= 0, got {args.seed}")
    Sampling(temperature=args.temperature)  # the server's own checks (InputError): finite, >= 0, not below 1e-3
    urls = [u.rstrip("/") for u in args.url]
    for url in urls:  # before any load: a wrong URL or model is one line, not a table of errors
        names = served_models(url)
        if args.model not in names:
            raise InputError(f"{url} serves {names}, not '{args.model}'; pass --model with one of them")
    results = []
    print(TABLE_HEAD, flush=True)
    for c in args.concurrency:
        n = args.requests or max(16, 4 * c)
        shape = dict(isl=args.input_tokens, osl=args.output_tokens, seed=args.seed + c, temperature=args.temperature)
        result, errors = run_level(urls, args.model, c, n, **shape)
        results.append(result)
        print(result.row(), flush=True)
        for e in errors[:3]:
            print(f"  error: {e}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0
