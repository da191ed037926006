"""mambatrt's own PyTorch model behind the runtime's runner face (``compare``'s reference and the tests')."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mambatrt.contract import PREFILL
from mambatrt.runtime.bundle import Bundle
from mambatrt.runtime.runners import Runner


class TorchRunner(Runner):
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
