"""transformers' ``MambaForCausalLM`` timed on the same device and precision as a bundle (``bench --reference hf``)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def hf_timings(checkpoint: Path, prompt_len: int, new_tokens: int, repeat: int, device: str, precision: str) -> dict:
    """Median prefill ms (one forward over the prompt, synchronized) and decode ms/token of HF's generate.

    Decode is timed as generate(n+1) - generate(1) from a one-token prompt: a Mamba step costs the same whatever the
    context, and a long prompt's prefill would add its own run-to-run noise to the difference.
    """
    import torch
    from transformers import MambaForCausalLM

    from mambatrt.export.model import precision_dtype

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = MambaForCausalLM.from_pretrained(str(checkpoint), torch_dtype=precision_dtype(precision)).to(device).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len)).to(device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t) * 1e3

    def gen(n: int):
        return model.generate(ids[:, :1], max_new_tokens=n, min_new_tokens=n, do_sample=False)

    prefill, ones, manys = [], [], []
    with torch.no_grad():
        timed(lambda: model(ids, use_cache=True))  # warm-up
        timed(lambda: gen(new_tokens + 1))
        for _ in range(repeat):
            prefill.append(timed(lambda: model(ids, use_cache=True)))
            ones.append(timed(lambda: gen(1)))
            manys.append(timed(lambda: gen(new_tokens + 1)))
    decode = (statistics.median(manys) - statistics.median(ones)) / new_tokens
    return {"prefill_ms": statistics.median(prefill), "decode_ms_per_token": decode}


def hf_cloze(checkpoint: Path, items: list, progress: bool = True):
    """``mambatrt eval``'s accuracy and perplexity (:class:`EvalResult`) of transformers' ``MambaForCausalLM`` on
    ``items`` (:class:`ClozeItem`), fp32 on the CPU with TF32 off: one forward over context + target per passage,
    the target's tokens scored from the rows before them, greedy as their argmax."""
    import math

    import torch
    from tqdm import tqdm
    from transformers import MambaForCausalLM
    from transformers.utils import logging as hf_logging

    from mambatrt.runtime.evaluate import EvalResult

    hf_logging.set_verbosity_error()  # its notes on the slow reference path: the reference is meant to be plain
    if not progress:
        hf_logging.disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = MambaForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32).eval()
    hits, loglik = 0, 0.0
    with torch.no_grad():
        for item in tqdm(items, desc="reference", unit="passage", disable=not progress, leave=False):
            ids = torch.tensor([item.context + item.target])
            rows = model(ids).logits[0, len(item.context) - 1 : -1].double()
            target = torch.tensor(item.target)
            logp = torch.log_softmax(rows, dim=-1)
            hits += bool((rows.argmax(dim=-1) == target).all())
            loglik += float(logp[torch.arange(len(target)), target].sum())
    return EvalResult(hits / len(items), math.exp(-loglik / len(items)), len(items))
