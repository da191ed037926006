"""``mambatrt run``: generate text or tokens from a bundle. Imports numpy and a backend only -- never torch."""

from __future__ import annotations

import argparse
import json
import sys


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


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
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
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and timings")
    p.add_argument("--load-state", metavar="FILE", help="continue a conversation from a state saved earlier")
    p.add_argument("--save-state", metavar="FILE", help="save the state afterwards, to continue later")
    add_backend_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt run``."""
    from mambatrt.runtime.backends import open_backend
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.generate import Generator, Sampling
    from mambatrt.runtime.tokenizer import Tokenizer, eos_id

    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_on_eos=not args.ignore_eos,
    )
    bundle = load_bundle(args.bundle, verify=not args.no_verify)
    tokenizer = Tokenizer(bundle) if args.prompt is not None or bundle.tokenizer_path else None
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt is not None else args.prompt_ids
    backend = open_backend(bundle, args.backend, args.device)
    try:
        gen = Generator(backend, eos_id=eos_id(bundle))
        if args.load_state:
            gen.load_state(args.load_state)
        on_token = None
        if args.stream and not args.json:
            if tokenizer is not None:
                sys.stdout.write(args.prompt if args.prompt is not None else tokenizer.decode(prompt_ids))

            def on_token(token: int) -> None:
                sys.stdout.write(tokenizer.decode([token]) if tokenizer is not None else f" {token}")
                sys.stdout.flush()

        result = gen.generate(prompt_ids, sampling, on_token=on_token, reset=not args.load_state)
        if args.save_state:
            gen.save_state(args.save_state)
    finally:
        backend.close()
    text = tokenizer.decode(result.tokens) if tokenizer is not None else None
    if args.json:
        out = {
            "prompt_ids": result.prompt_ids,
            "tokens": result.tokens,
            "text": text,
            "prefill_ms": round(result.prefill_ms, 3),
            "decode_ms_per_token": None if result.decode_ms_per_token is None else round(result.decode_ms_per_token, 3),
            "ttft_ms": round(result.ttft_ms, 3),
            "tokens_per_s": None if result.tokens_per_s is None else round(result.tokens_per_s, 2),
            "prefill_launches": result.prefill_launches,
            "stopped": result.stopped,
            "backend": backend.name,
            "device": backend.device,
            "layout": bundle.layout,
            "precision": bundle.precision,
        }
        print(json.dumps(out))
        return 0
    if args.stream:
        print()
    elif text is not None:
        prompt_text = args.prompt if args.prompt is not None else tokenizer.decode(prompt_ids)
        print(prompt_text + text)
    else:
        print(",".join(str(t) for t in result.tokens))
    decode = "n/a" if result.decode_ms_per_token is None else f"{result.decode_ms_per_token:.2f} ms/token"
    print(
        f"[{backend.name}/{backend.device}, {bundle.layout}] prompt {len(result.prompt_ids)} tokens in "
        f"{result.prefill_launches} launches: prefill {result.prefill_ms:.1f} ms, ttft {result.ttft_ms:.1f} ms, "
        f"decode {decode}",
        file=sys.stderr,
    )
    return 0
