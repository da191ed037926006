"""One prompt through the engine with one slot, timed: what `mambatrt run` prints and `mambatrt bench` measures.

Timing boundaries, the same for every layout and device:

    prefill_ms            the request submitted -> its first token picked (the prompt's last chunk's logits on
                          the host, or picked on the device: the final state update has completed)
    decode_ms_per_token   the first token -> the last, over the decode steps between them
    tokens_per_s          new tokens / (prefill + decode time)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .engine import Engine, Event, Request, Sampling


@dataclass
class Generation:
    """What :func:`generate` produced, with its timings and its final event."""

    prompt_ids: list[int]
    tokens: list[int]
    prefill_ms: float
    decode_ms_per_token: float | None
    decode_steps: int
    prefill_launches: int
    stopped: str  # "eos" | "max_new_tokens"
    final: Event

    @property
    def tokens_per_s(self) -> float | None:
        """New tokens per second from the request to the last new token."""
        total_ms = self.prefill_ms + (self.decode_ms_per_token or 0.0) * self.decode_steps
        return len(self.tokens) / (total_ms / 1e3) if self.tokens and total_ms > 0 else None

    def to_dict(self, text: str | None = None) -> dict:
        """JSON form (what ``mambatrt run --json`` prints before the runner's fields); times rounded to 1 us."""
        decode = self.decode_ms_per_token
        tokens_per_s = self.tokens_per_s
        return {
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "text": text,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms_per_token": None if decode is None else round(decode, 3),
            "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 2),
            "prefill_launches": self.prefill_launches,
            "stopped": self.stopped,
        }


def generate(
    engine: Engine,
    prompt: list[int],
    sampling: Sampling,
    on_token: Callable[[int], None] | None = None,
    state: tuple[np.ndarray, np.ndarray] | None = None,
    keep_state: bool = False,
) -> Generation:
    """Run ``prompt`` to its end on ``engine`` (one slot, in this thread), ``on_token`` called with each new token as
    it is picked; from ``state`` (a saved conversation) when given; ``keep_state``: the final event carries the
    states."""
    tokens, times, ended = [], [], []

    def emit(event: Event) -> None:
        if event.token is not None:
            times.append(time.perf_counter())
            tokens.append(event.token)
            if on_token is not None:
                on_token(event.token)
        if event.finish_reason is not None:
            ended.append(event)

    request = Request(prompt, sampling, emit, state=state, keep_state=keep_state)
    start = time.perf_counter()
    engine.generate(request)
    end = time.perf_counter()
    final = ended[0]
    first = times[0] if times else end
    steps = max(len(tokens) - 1, 0)
    return Generation(
        prompt_ids=prompt,
        tokens=tokens,
        prefill_ms=(first - start) * 1e3,
        decode_ms_per_token=(times[-1] - first) * 1e3 / steps if steps else None,
        decode_steps=steps,
        prefill_launches=final.prefill_launches,
        stopped="eos" if final.finish_reason == "stop" else "max_new_tokens",
        final=final,
    )
