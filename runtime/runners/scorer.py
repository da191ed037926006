"""The scoring graph (``score.onnx``, :data:`mambatrt.contract.SCORE`) on onnxruntime: a chunk of a prompt's rows
from a sequence's states to every row's logits and the states after it, for requests that score their prompt
(``echo`` with ``logprobs``, ``eval``). One launch per chunk (up to the portable prefill graph's rows) where the
decode graph would take one launch per token; the prefill graphs keep computing the last row's logits only, so
prompts that are not scored pay nothing for it."""

from __future__ import annotations

import numpy as np

from mambatrt.contract import CONV_STATE, PORTABLE, SSM_STATE, TOKEN_IDS

from .base import Runner


class Scorer:
    """One onnxruntime session of ``score.onnx``, on the runner's device (inputs and outputs on the host)."""

    def __init__(self, session, runner: Runner) -> None:
        self.session, self.runner = session, runner
        # rows per launch: the portable prefill graph's (its scan's loop bounds), whatever the runner's flavour takes
        self.max_rows = runner.bundle.manifest.prefill_rows(PORTABLE)

    def warm(self) -> None:
        """One launch of the most rows from zero states (onnxruntime's arena takes its memory now, not mid-request)."""
        self.run(np.zeros(self.max_rows, np.int64), *self.runner.zero_states())

    def run(self, ids: np.ndarray, conv: np.ndarray, ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids [T] int64 after states [L, E, K-1], [L, E, N] -> every row's logits [T, Vp] and the states after."""
        feeds = {TOKEN_IDS: np.ascontiguousarray(ids, dtype=np.int64), CONV_STATE: conv[None], SSM_STATE: ssm[None]}
        logits, conv, ssm = self.session.run(None, feeds)
        return logits, conv[0], ssm[0]


def open_scorer(runner: Runner, options, providers: list) -> Scorer | None:
    """The scorer of ``runner``'s bundle on ``providers`` (onnxruntime's), or None where the bundle has no scoring
    graph (a single bundle, or one built before it)."""
    path = runner.bundle.score_path
    if path is None:
        return None
    import onnxruntime as ort

    return Scorer(ort.InferenceSession(str(path), options, providers=providers), runner)
