"""The PyTorch references beside the pipeline: mambatrt's own model behind the runtime's Backend face, and the timings
of transformers' MambaForCausalLM. Used by ``compare``, ``bench --reference hf`` and the tests, never by a runtime path.

It sits in the top-level package so that neither pipeline stage imports the other's internals: ``export`` never
imports ``runtime`` and ``runtime`` never imports ``export``; this module imports both (and torch), lazily.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from mambatrt.contract import PREFILL
from mambatrt.runtime.backends import Backend
from mambatrt.runtime.bundle import Bundle


class TorchBackend(Backend):
    """MambaLM on the CPU at the bundle's precision; states as float32 tensors."""

    name = "torch"

    def __init__(self, bundle: Bundle, checkpoint: str | Path, scan: str = "sequential") -> None:
        """``scan``: the prefill scan for the prefill graph (default: the sequential reference)."""
        import torch

        from mambatrt.export.checkpoint import load_model

        super().__init__(bundle, "cpu")
        self.torch = torch
        self.model = load_model(checkpoint, precision=bundle.precision, max_rows=max(bundle.max_prefill_rows, 1))
        self.scan = scan
        self.state = tuple(torch.from_numpy(s) for s in self.zero_states())

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        torch = self.torch
        with torch.no_grad():
            if graph == PREFILL:
                logits, conv, ssm = self.model.forward_rows(torch.from_numpy(ids), *self.state, self.scan)
            else:  # the batched decode body on a batch of one
                logits, conv, ssm = self.model.forward_step(torch.from_numpy(ids), *(s[None] for s in self.state))
                conv, ssm = conv[0], ssm[0]
        self.state = (conv, ssm)
        return logits[0].numpy()

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.state[0].numpy().copy(), self.state[1].numpy().copy()

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self.sequence_state(*self.graph_state(conv, ssm))
        self.state = (self.torch.from_numpy(conv.copy()), self.torch.from_numpy(ssm.copy()))


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
