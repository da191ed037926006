"""The scoring graph (``score.onnx``, :data:`mambatrt.contract.SCORE`) on onnxruntime: a chunk of a prompt's rows
from a sequence's states to every row's logits and the states after it, for requests that score their prompt
(``echo`` with ``logprobs``, ``eval``). One launch per chunk (up to the bundle's prefill rows) where the decode graph
would take one launch per token; the prefill graphs keep computing the last row's logits only, so prompts that are
not scored pay nothing for it."""

from __future__ import annotations

import numpy as np

from mambatrt.contract import CONV_STATE, SSM_STATE, TOKEN_IDS

from ..bundle import Bundle


class Scorer:
    """One onnxruntime session of ``score.onnx``, on the runner's device (inputs and outputs on the host)."""

    def __init__(self, session, config, max_rows: int) -> None:
        self.session, self.config, self.max_rows = session, config, max_rows

    def warm(self) -> None:
        """One launch of the most rows from zero states (onnxruntime's arena takes its memory now, not mid-request)."""
        conv = np.zeros(self.config.conv_state_shape, np.float32)
        self.run(np.zeros(self.max_rows, np.int64), conv, np.zeros(self.config.ssm_state_shape, np.float32))

    def run(self, ids: np.ndarray, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids [T] int64 after states [L, E, K-1], [L, E, N] -> every row's logits [T, Vp] and the states after."""
        feeds = {TOKEN_IDS: np.ascontiguousarray(ids, dtype=np.int64), CONV_STATE: conv[None], SSM_STATE: ssm[None]}
        logits, conv, ssm = self.session.run(None, feeds)
        return logits, conv[0], ssm[0]


def open_scorer(bundle: Bundle, options, providers: list) -> Scorer | None:
    """The bundle's scorer on ``providers`` (onnxruntime's), or None where the bundle has no scoring graph (a
    single bundle, or one built before it)."""
    if bundle.score_path is None:
        return None
    import onnxruntime as ort

    session = ort.InferenceSession(str(bundle.score_path), options, providers=providers)
    return Scorer(session, bundle.config, bundle.max_prefill_rows)
