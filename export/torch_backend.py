"""The PyTorch model behind the runtime's Backend face, as the reference in accuracy comparisons (not a runtime path).

It runs :class:`MambaLM` (loaded from the bundle's source checkpoint) with the same chunking rules as the ONNX and
TensorRT backends, so ``Generator``, ``evaluate`` and ``compare`` treat it like any other backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mambatrt.contract import PREFILL
from mambatrt.export.checkpoint import load_model
from mambatrt.runtime.backends import Backend
from mambatrt.runtime.bundle import Bundle


class TorchBackend(Backend):
    """MambaLM on the CPU at the bundle's precision; states as float32 tensors."""

    name = "torch"

    def __init__(self, bundle: Bundle, checkpoint: str | Path, scan: str = "sequential") -> None:
        """``scan``: the prefill scan for the prefill graph (default: the sequential reference)."""
        super().__init__(bundle, "cpu")
        self.model = load_model(checkpoint, precision=bundle.precision, max_rows=max(bundle.max_prefill_rows, 1))
        self.scan = scan
        self.state = tuple(torch.from_numpy(s) for s in self.zero_states())

    def _execute(self, graph: str, ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            if graph == PREFILL:
                logits, conv, ssm = self.model.forward_rows(torch.from_numpy(ids), *self.state, self.scan)
            else:
                logits, conv, ssm = self.model.forward_step(torch.from_numpy(ids), *self.state)
        self.state = (conv, ssm)
        return logits[0].numpy()

    def get_state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.state[0].numpy().copy(), self.state[1].numpy().copy()

    def set_state(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        conv, ssm = self._check_state(conv, ssm)
        self.state = (torch.from_numpy(conv.copy()), torch.from_numpy(ssm.copy()))
