"""Multi-row pieces of the Mamba mixer: the causal depthwise conv over rows and the selective scan over rows.

Each parallel function sits beside a sequential reference with the same signature; tests hold them equal.
Written to export: no in-place writes, no branches on tensor values, loop bounds fixed by ``max_rows``.

Shapes (letters as in :mod:`mambatrt.config`): S rows, E inner width, N state size, K conv kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_conv_rows(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over the previous K-1 inputs plus the S new rows, as K shifted multiply-adds.

    Each tap is a static slice of the window (no Conv op: onnxruntime's CUDA provider runs a depthwise 1-D Conv
    through cuDNN at ~1 ms per layer, slower than the rest of the layer together).

    Args:
        x: [S, E] the chunk's conv inputs.
        conv_state: [E, K-1] the K-1 inputs before the chunk (zeros at the start of a sequence).
        weight: [E, 1, K] depthwise kernel (the checkpoint's ``conv1d.weight``).
        bias: [E] or None.
    Returns:
        y: [S, E] conv outputs (before the activation); new_state: [E, K-1] the last K-1 inputs.
    Mirrors transformers' ``MambaMixer.slow_forward`` step 2 (``self.conv1d(hidden_states)[..., :seq_len]``).
    """
    k = weight.shape[-1]
    window = torch.cat([conv_state.transpose(0, 1), x], dim=0)  # [K-1+S, E]
    w = weight[:, 0, :].transpose(0, 1)  # [K, E]
    y = window[k - 1 :] * w[k - 1]  # [S, E]  tap K-1 multiplies the current row
    for j in range(k - 1):
        y = y + window[j : j - (k - 1)] * w[j]  # [S, E]  tap j looks K-1-j rows back
    if bias is not None:
        y = y + bias  # [S, E]
    return y, window[1 - k :].transpose(0, 1)  # [S, E], [E, K-1]


def causal_conv_rows_reference(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential reference of :func:`causal_conv_rows`: shift the state one input at a time."""
    state = conv_state  # [E, K-1]
    outs = []
    for t in range(x.shape[0]):
        window = torch.cat([state, x[t].unsqueeze(1)], dim=1)  # [E, K]
        y = (window * weight[:, 0, :]).sum(dim=1)  # [E]
        outs.append(y if bias is None else y + bias)
        state = window[:, 1:]  # [E, K-1]
    return torch.stack(outs), state  # [S, E], [E, K-1]


def scan_rounds(max_rows: int) -> int:
    """Number of Hillis-Steele doubling rounds that cover ``max_rows`` rows (6 for 64)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return math.ceil(math.log2(max_rows)) if max_rows > 1 else 0


def _shift_rows(t: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    """Rows moved down by k (static pad on top, static slice off the bottom): out[i] = t[i-k], or ``fill``."""
    padded = F.pad(t, (0, 0, 0, 0, k, 0), value=fill)  # [S+k, E, N]
    return padded[:-k]  # [S, E, N]


def hillis_steele_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """All states of h_t = a_t * h_{t-1} + b_t over the rows, as a Hillis-Steele doubling scan.

    Round k (k = 1, 2, 4, ... < max_rows) combines each row with the row k above it:
    (a_t, b_t) <- (a_t * a_{t-k}, a_t * b_{t-k} + b_t), with identity padding a=1, b=0 above the first row.
    After the rounds, (a_t, b_t) maps h_{-1} = h0 to h_t. Runs in float32.

    Args:
        a: [S, E, N] decays in (0, 1].  b: [S, E, N] inputs.  h0: [E, N] state before the chunk.
        max_rows: the largest S the graph accepts; fixes the number of rounds.
    Returns:
        h: [S, E, N] the state after every row (h[-1] is the new state).
    """
    for r in range(scan_rounds(max_rows)):
        k = 1 << r
        a_prev = _shift_rows(a, k, 1.0)  # [S, E, N]
        b_prev = _shift_rows(b, k, 0.0)  # [S, E, N]
        b = a * b_prev + b  # [S, E, N]
        a = a * a_prev  # [S, E, N]
    return a * h0.unsqueeze(0) + b  # [S, E, N]


def sequential_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """Sequential reference of :func:`hillis_steele_scan` (same signature): one row at a time.

    Mirrors transformers' ``MambaMixer.slow_forward`` step 3.c (``ssm_state = discrete_A[:, :, i] * ssm_state + ...``).
    With S = 1 this is the single decode step h = a h0 + b.
    """
    h = h0  # [E, N]
    states = []
    for t in range(a.shape[0]):
        h = a[t] * h + b[t]  # [E, N]
        states.append(h)
    return torch.stack(states)  # [S, E, N]


def blocked_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """Two-level blocked scan (same signature and result as :func:`sequential_scan`), fewer passes over [S, E, N].

    The chunk is padded with identity rows (a=1, b=0) to M = 2^rounds rows (64) and cut into blocks of c rows
    (c = 2^(rounds//2), 8 for 64). Within each block the recurrence runs row by row on all blocks at once
    (c steps over [M/c, E, N]), keeping the running decay products; then the state entering each block is
    carried across the M/c blocks ([E, N] steps); finally h = decay_within * carry_in + h_within.
    About 7 passes over [M, E, N] instead of the Hillis-Steele scan's ~7 per round (42 for 64 rows).
    """
    rows_in = a.shape[0]
    rounds = scan_rounds(max_rows)
    m = 1 << rounds  # padded rows
    c = 1 << (rounds // 2)  # rows per block
    nb = m // c  # blocks
    e, n = a.shape[1], a.shape[2]
    if a.shape[0] != m:  # shape check, static under export; the model pads cheaper inputs (scan_rows_padded)
        # identity padding to m rows: pad m rows below (static amount), keep the first m (no constant tensors)
        a = F.pad(a, (0, 0, 0, 0, 0, m), value=1.0)[:m]  # [m, E, N]
        b = F.pad(b, (0, 0, 0, 0, 0, m), value=0.0)[:m]  # [m, E, N]
    a_p = a.reshape(nb, c, e, n)  # [nb, c, E, N]
    b_p = b.reshape(nb, c, e, n)  # [nb, c, E, N]
    decay, state = [a_p[:, 0]], [b_p[:, 0]]  # per row: [nb, E, N]
    for j in range(1, c):
        decay.append(a_p[:, j] * decay[-1])  # [nb, E, N]
        state.append(a_p[:, j] * state[-1] + b_p[:, j])  # [nb, E, N]
    carry, carries = h0, []
    for k in range(nb):
        carries.append(carry)  # [E, N] state entering block k
        carry = decay[-1][k] * carry + state[-1][k]  # [E, N]
    carry_in = torch.stack(carries).unsqueeze(1)  # [nb, 1, E, N]
    h = torch.stack(decay, 1) * carry_in + torch.stack(state, 1)  # [nb, c, E, N]
    return h.reshape(m, e, n)[:rows_in]  # [S, E, N]


def scan_rows_padded(scan, max_rows: int) -> int | None:
    """Rows the scan works on when it pads its input (the blocked scan: 2^rounds), else None."""
    return 1 << scan_rounds(max_rows) if scan is blocked_scan else None


SCANS = {"hillis-steele": hillis_steele_scan, "blocked": blocked_scan, "sequential": sequential_scan}
PREFILL_SCANS = ("blocked", "hillis-steele")
