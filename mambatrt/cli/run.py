"""``mambatrt run``: generate text or tokens from a bundle. Imports numpy and a runner only, never torch."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .args import add_bundle_arg, add_device_arg, token_ids_arg


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
    p = sub.add_parser(
        "run",
        help="generate from a bundle",
        description="Prefill a prompt (in chunks on the prefill graph of 'split' bundles, token by token on 'single' "
        "ones) and decode new tokens, through the same engine `serve` runs. Greedy by default; --temperature > 0 "
        "samples.",
    )
    add_bundle_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the bundle's tokenizer.json)")
    src.add_argument("--prompt-ids", type=token_ids_arg, metavar="1,2,3", help="prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (the server's seed gives the same)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    out.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and timings")
    p.add_argument("--load-state", metavar="FILE", help="continue a conversation from a state saved earlier")
    p.add_argument("--save-state", metavar="FILE", help="save the state afterwards, to continue later")
    add_device_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mambatrt run``: what can be checked (bundle, prompt, state files) is checked before generating."""
    from mambatrt.errors import InputError
    from mambatrt.paths import check_output_file
    from mambatrt.runtime.bundle import load_bundle
    from mambatrt.runtime.engine import Engine, EngineConfig, Sampling
    from mambatrt.runtime.engine.sampling import token_ids
    from mambatrt.runtime.engine.state_file import read_state, write_state
    from mambatrt.runtime.runners import open_runner
    from mambatrt.runtime.tokenizer import Tokenizer, eos_id

    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_on_eos=not args.ignore_eos,
    )
    if args.save_state:
        check_output_file(args.save_state, "--save-state", "state.npz")
    bundle = load_bundle(args.bundle)
    tokenizer = None
    if args.prompt is not None or bundle.tokenizer_path:
        tokenizer = Tokenizer(bundle, instead="pass the prompt as --prompt-ids 1,2,3")
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt is not None else args.prompt_ids
    prompt = token_ids(prompt_ids, bundle.config.vocab_size)  # checked before any launch
    prompt_text = None
    if tokenizer is not None:
        prompt_text = args.prompt if args.prompt is not None else tokenizer.decode(prompt)
    if not prompt:
        raise InputError("empty prompt: pass at least one token (--prompt or --prompt-ids)")
    state, pending = None, None
    if args.load_state:
        conv, ssm, pending = read_state(args.load_state, bundle.identity, bundle.config.vocab_size)
        state = (conv, ssm)
    opened = time.perf_counter()
    with open_runner(bundle, args.device) as runner:
        load_ms = (time.perf_counter() - opened) * 1e3
        if state is not None:
            runner.graph_state(*state)  # shapes checked before any launch
        engine = Engine(runner, EngineConfig(max_batch=1), eos_id=eos_id(bundle))
        result = _generate(args, engine, prompt, pending, sampling, tokenizer, prompt_text, state)
        _print_generation(args, result, tokenizer, prompt_text, runner, load_ms)  # before saving: never lost
        if args.save_state:
            last = result.tokens[-1] if result.tokens else None
            write_state(args.save_state, bundle.identity, *result.final.state, last)
    return 0


def _generate(args, engine, prompt: list[int], pending: int | None, sampling, tokenizer, prompt_text, state):
    """The prompt (after the token generated last time, which a saved state has not fed yet) through the engine;
    with --stream the prompt's text first, then each token as it comes."""
    from mambatrt.runtime.generation import generate

    on_token = None
    if args.stream:
        sys.stdout.write(prompt_text or "")
        step = tokenizer.stream() if tokenizer is not None else None

        def on_token(token: int) -> None:
            sys.stdout.write(step(token) if step is not None else f" {token}")
            sys.stdout.flush()

    fed = ([pending] if pending is not None else []) + prompt
    result = generate(engine, fed, sampling, on_token, state, keep_state=bool(args.save_state))
    result.prompt_ids = prompt
    return result


def _print_generation(args: argparse.Namespace, result, tokenizer, prompt_text, runner, load_ms: float) -> None:
    """``run``'s output: the JSON object, or the text (ids without a tokenizer) and a timing line on stderr."""
    text = tokenizer.decode(result.tokens) if tokenizer is not None else None
    bundle = runner.bundle
    if args.json:
        out = result.to_dict(text)
        out.update(runner=runner.name, device=runner.device, graphs=runner.flavour, notes=runner.notes)
        out.update(load_ms=round(load_ms, 2), layout=bundle.layout, precision=bundle.precision)
        print(json.dumps(out), flush=True)
        return
    if args.stream:
        print(flush=True)
    elif text is not None:
        print(prompt_text + text, flush=True)
    else:
        print(",".join(str(t) for t in result.tokens), flush=True)
    for note in runner.notes:
        print(f"mambatrt run: {note}", file=sys.stderr)
    decode = "n/a" if result.decode_ms_per_token is None else f"{result.decode_ms_per_token:.2f} ms/token"
    print(
        f"[{runner.name}/{runner.device}, {bundle.layout}, {runner.flavour}] prompt {len(result.prompt_ids)} tokens "
        f"in {result.prefill_launches} launches: prefill {result.prefill_ms:.1f} ms, decode {decode}",
        file=sys.stderr,
    )
