"""The output processor: each decoding sequence's next token (picked by the pool where the logits are, or sampled
here), its text and stop strings, its events, and its end (the final event, the state cached, the slot freed)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .request import Event, Sequence
from .sampling import sample_token, token_logprob
from .scheduler import Scheduler


class OutputProcessor:
    """Turns a decode launch's picks or logits into events (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, eos_id: int | None, launch_in_flight: Callable[[], bool]) -> None:
        """``launch_in_flight()``: whether a decode launch begun after the tokens being handled runs (pipelined):
        an ending sequence's states are then the launch before's, and its slot stays held until that launch ends."""
        self.scheduler, self.pool = scheduler, scheduler.pool
        self.eos_id, self.vocab = eos_id, scheduler.vocab
        self.in_flight = launch_in_flight
        self.next_tokens = 0  # tokens the pool picked for a whole decode launch at once (/metrics)

    def handle(self, launch, out: np.ndarray) -> None:
        """Each sequence of ``launch`` (a :class:`~.executor.DecodeLaunch`) takes its token (picked by the pool,
        ``out`` [n], or sampled here from the logits ``out`` [n, Vp]): emitted, and the sequence finished where it
        ends. Pipelined, the next launch is already running: a sequence's index may have changed since (slots
        freed), and an ended sequence's slot is freed after that launch (:meth:`finish`)."""
        on_device = launch.how != "logits"
        picked = out.tolist() if on_device else None
        if on_device:
            self.next_tokens += launch.n
        running = self.scheduler.running
        moved = running[: launch.n] != launch.seqs  # only pipelined: slots freed and taken since the launch began
        index = {id(s): i for i, s in enumerate(running)} if moved else None
        for row in range(launch.n - 1, -1, -1):  # from the end: a finished sequence's slot takes one already handled
            seq = launch.seqs[row]
            if seq.ended:  # cancelled while its launch ran
                continue
            i = index[id(seq)] if moved else row
            seq.fed += 1
            seq.next_id, seq.logits_row = None, row
            if on_device:
                seq.logits = None  # row ``row`` of the launch's logits
                self.emit_next(i, picked[row])
            else:
                seq.logits = out[row, : self.vocab]
                self.emit_next(i)

    def first_token(self, i: int) -> None:
        """A sequence just admitted to slot ``i``: its first token (picked by the pool with its prompt's last
        launch, or sampled here), or its end where it generates nothing."""
        seq = self.scheduler.running[i]
        if seq.request.sampling.max_new_tokens == 0 and not seq.to_force:  # prefill only (run --save-state)
            self.finish(i, None, "length")
        else:
            self.emit_next(i, seq.first)

    def emit_next(self, i: int, token: int | None = None) -> None:
        """Sample sequence i's next token from its logits (unless the pool picked it: ``token``), emit it, and
        finish the sequence when it is done. A sequence with prompt tokens still to score takes the next of those
        instead (teacher forcing)."""
        seq = self.scheduler.running[i]
        if seq.to_force:
            self._force(i, seq)
            return
        sampling = seq.request.sampling
        if token is None:
            token = sample_token(seq.logits, sampling, seq.rng if sampling.temperature else None, seq.generated)
        if seq.request.logprobs is not None:
            seq.logprob = token_logprob(seq.logits, token, seq.request.logprobs)
        generated = seq.generated
        generated.append(token)
        seq.pending = token
        eos = token == self.eos_id and sampling.stop_on_eos  # never when the bundle has no EOS (None)
        if seq.bare:  # no text, no stop strings
            if eos:
                self.finish(i, token, "stop")
            elif len(generated) >= sampling.max_new_tokens:
                self.finish(i, token, "length")
            else:
                r = seq.request
                r.emit(Event(token, "", None, len(r.prompt), len(generated), seq.cached_tokens, seq.launches))
            return
        if seq.step_text is not None and not eos:
            seq.text += seq.step_text(token)
        hit = next((s for s in seq.request.stop if s in seq.text), None) if seq.request.stop else None
        if hit is not None:
            seq.text = seq.text[: seq.text.index(hit)]
            self.finish(i, token, "stop")
        elif eos:
            self.finish(i, token, "stop")
        elif len(generated) >= sampling.max_new_tokens:
            self.finish(i, token, "length")
        else:
            seq.request.emit(seq.event(token, None))

    def _force(self, i: int, seq: Sequence) -> None:
        """Score the next prompt token of ``seq`` from its logits (its log-probability, whether it is the greedy
        pick, the request's top ``logprobs``), and feed it next; the sequence ends after the last one where it
        generates nothing."""
        token = int(seq.prompt[seq.at])
        seq.at += 1
        seq.scores.append(token_logprob(seq.logits, token, seq.request.logprobs or 0))
        seq.pending = token
        if not seq.to_force and seq.request.sampling.max_new_tokens == 0:
            self.finish(i, None, "length")

    def finish(self, i: int, token: int | None, reason: str) -> None:
        """End sequence i: emit its last event, cache its state, give its slot back (:meth:`Scheduler.retire`).
        While a launch begun after its last token runs, its states and logits are the launch before's
        (:meth:`~mambatrt.runtime.runners.base.SlotPool.prev_slot_state`)."""
        scheduler = self.scheduler
        seq = scheduler.running[i]
        event = seq.event(token, reason)
        prev = self.in_flight()
        state = self.pool.prev_slot_state if prev else self.pool.slot_state
        if seq.request.keep_state and reason != "abort":
            event.state = tuple(np.array(a, copy=True) for a in state(i))
        seq.request.emit(event)
        if reason != "abort":
            scheduler.remember(seq, lambda out: state(i, out), seq.logits_row, prev)
        scheduler.retire(i, prev)
