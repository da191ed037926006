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
