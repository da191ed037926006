"""Multi-row pieces of the Mamba mixer: the causal depthwise conv over rows and the selective scan over rows.

Each parallel function sits beside a sequential reference with the same signature, and the tests hold them equal:
:func:`causal_conv_rows` beside :func:`causal_conv_rows_reference`, and the prefill scan
:func:`blocked_selective_scan` beside :func:`selective_scan_reference`:

    scan(dt [S, E], dtx [S, E], a_mat [E, N], b_in [S, N], c_out [S, N], h0 [E, N], max_rows)
        -> y [S, E] (C_t . h_t, without the D skip term), h [E, N] (the state after the last row)

with h_t = exp(dt_t A) h_{t-1} + dtx_t B_t. Written to export: no in-place writes, no branches on tensor values,
loop bounds fixed by ``max_rows``.

Shapes (letters as in :mod:`mambatrt.config`): S rows, E inner width, N state size, K conv kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

T = torch.Tensor  # in the scans' one signature (see the module docstring)
BLOCKED = "blocked"  # the prefill graphs' scan (:func:`blocked_selective_scan`), as a bundle's manifest names it
SEQUENTIAL = "sequential"  # the reference (:func:`selective_scan_reference`): tests and the PyTorch reference
# onnxruntime's CUDA Concat takes at most 32 inputs while a CUDA graph is captured: wider joins are split in groups.
MAX_CONCAT_INPUTS = 32


def cat_limited(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` as Concat nodes of at most :data:`MAX_CONCAT_INPUTS` inputs each (same result)."""
    tensors = list(tensors)
    while len(tensors) > MAX_CONCAT_INPUTS:
        step = MAX_CONCAT_INPUTS
        tensors = [torch.cat(tensors[i : i + step], dim) for i in range(0, len(tensors), step)]
    return torch.cat(tensors, dim)


def stack_limited(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.stack`` built from :func:`cat_limited` (e.g. the states of 64 layers)."""
    return cat_limited([t.unsqueeze(dim) for t in tensors], dim)


def causal_conv_rows(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    valid_rows: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over the previous K-1 inputs plus the S new rows, as one gather of the K-tap windows.

    The window [E, K-1+S] (state columns, then the chunk) is gathered into [E, S, K] (row t sees columns t..t+K-1),
    contracted with the kernel (a batched MatMul): a handful of nodes whatever K, and no Conv op
    (onnxruntime's CUDA provider runs a depthwise 1-D Conv through cuDNN, far slower than a batched MatMul).

    Args:
        x: [S, E] the chunk's conv inputs.
        conv_state: [E, K-1] the K-1 inputs before the chunk (zeros at the start of a sequence).
        weight: [E, 1, K] depthwise kernel (the checkpoint's ``conv1d.weight``).
        bias: [E] or None.
        valid_rows: when the chunk ends in padding rows, the number of real rows V (the new state holds the K-1
            inputs before row V); None: all S rows are real.
    Returns:
        y: [S, E] conv outputs (before the activation); new_state: [E, K-1] the last K-1 real inputs.
    Mirrors transformers' ``MambaMixer.slow_forward`` step 2 (``self.conv1d(hidden_states)[..., :seq_len]``).
    """
    k = weight.shape[-1]
    window = torch.cat([conv_state, x.transpose(0, 1)], dim=1)  # [E, K-1+S]
    taps = torch.arange(x.shape[0]).unsqueeze(1) + torch.arange(k)  # [S, K] column indices into the window
    # the taps' sum as a batched matrix product: a GPU ReduceSum over a small axis costs a few kernels (cuDNN)
    y = torch.matmul(window[:, taps], weight.transpose(1, 2)).squeeze(-1)  # [E, S, K] @ [E, K, 1] -> [E, S]
    if bias is not None:
        y = y + bias.unsqueeze(1)  # [E, S]
    new_state = window[:, 1 - k :] if valid_rows is None else window[:, valid_rows : valid_rows + k - 1]  # [E, K-1]
    return y.transpose(0, 1), new_state  # [S, E], [E, K-1]


def causal_conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv_rows` for one new input of each of B sequences (decode): one batched product per window.

    Args: x [B, E]; conv_state [B, E, K-1]; weight [E, 1, K]; bias [E] or None.
    Returns: y [B, E]; new_state [B, E, K-1].  No index tensor: each window is its whole state plus the new input.
    """
    e, k = x.shape[-1], weight.shape[-1]
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=2)  # [B, E, K]
    # the taps' sum as one product with a ones column: a single [B*E, K] @ [K, 1] GEMM (a batched [E, 1, K] @ [E, K, 1]
    # product broadcast over B runs B*E tiny products on onnxruntime's CPU), and no ReduceSum (cuDNN on a GPU)
    y = torch.matmul(window * weight[:, 0, :], torch.ones(k, 1)).reshape(-1, e)  # [B, E, K] @ [K, 1] -> [B, E]
    if bias is not None:
        y = y + bias  # [B, E]
    return y, window[:, :, 1:]  # [B, E], [B, E, K-1]


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


def sequential_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """All states of h_t = a_t * h_{t-1} + b_t over the rows, one row at a time.

    Args: a [S, E, N] decays in (0, 1]; b [S, E, N] inputs; h0 [E, N] the state before the chunk.
    Returns: h [S, E, N] the state after every row (h[-1] is the new state).

    Mirrors transformers' ``MambaMixer.slow_forward`` step 3.c (``ssm_state = discrete_A[:, :, i] * ssm_state + ...``).
    With S = 1 this is the single decode step h = a h0 + b.
    """
    h = h0  # [E, N]
    states = []
    for t in range(a.shape[0]):
        h = a[t] * h + b[t]  # [E, N]
        states.append(h)
    return torch.stack(states)  # [S, E, N]


def block_rows(max_rows: int) -> int:
    """Rows per block of :func:`blocked_scan_aligned`: about the square root of ``max_rows`` (a power of two: 8 for
    64 rows), so the c steps within the blocks and the max_rows / c steps across them balance."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return 1 << (math.ceil(math.log2(max_rows)) // 2)


def pad_rows(t: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """t [S, ...] padded below with ``value`` rows to the next multiple of ``multiple`` rows: [ceil(S/m)*m, ...].

    One Pad node whose amount, (-S) mod m, the graph computes from the rows axis.
    """
    if multiple == 1:
        return t
    rows = t.shape[0]
    pad = [0, 0] * (t.dim() - 1) + [0, (rows + multiple - 1) // multiple * multiple - rows]  # (-S) mod m
    return F.pad(t, pad, value=value)  # [M, ...]


def blocked_scan_aligned(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """The states of :func:`sequential_scan` on M rows, M a multiple of c = :func:`block_rows` (``max_rows``), M <=
    max_rows rounded up (callers pad the chunk with identity rows, a = 1 and b = 0, which repeat the last state).

    The M rows form nb = M / c blocks of c rows (nb follows the chunk: short chunks do less work).
    1. Within each block the recurrence runs row by row on all blocks at once (c-1 steps over [nb, E, N]), and the
       decay products within the block come along ([nb, c, E, N]).
    2. The state entering each block: :func:`block_carries` over the nb block summaries.
    3. h = decay_within * carry_in + h_within.
    About 6 passes over [M, E, N] and ~45 nodes, whatever M.

    Args: a, b [M, E, N]; h0 [E, N].  Returns: h [M, E, N].
    """
    c = block_rows(max_rows)
    e, n = a.shape[1], a.shape[2]
    a_p = a.reshape(-1, c, e, n)  # [nb, c, E, N]
    b_p = b.reshape(-1, c, e, n)  # [nb, c, E, N]
    a_rows = a_p.split(1, dim=1)  # c x [nb, 1, E, N]  (one Split node; unbind would export c Slices)
    b_rows = b_p.split(1, dim=1)  # c x [nb, 1, E, N]
    decay, state = [a_rows[0]], [b_rows[0]]
    for j in range(1, c):
        decay.append(a_rows[j] * decay[-1])  # [nb, 1, E, N]
        state.append(a_rows[j] * state[-1] + b_rows[j])  # [nb, 1, E, N]
    blk_a, blk_b = decay[-1].reshape(-1, e, n), state[-1].reshape(-1, e, n)  # [nb, E, N] block summaries
    carry_in = block_carries(blk_a, blk_b, h0, -(-max_rows // c)).unsqueeze(1)  # [nb, 1, E, N]
    h = cat_limited(decay, 1) * carry_in + cat_limited(state, 1)  # [nb, c, E, N]
    return h.reshape(-1, e, n)  # [M, E, N]


def block_carries(blk_a: torch.Tensor, blk_b: torch.Tensor, h0: torch.Tensor, max_blocks: int) -> torch.Tensor:
    """The state entering each block: carry_0 = h0, carry_j = A_{j-1} carry_{j-1} + B_{j-1}, one block at a time.

    The nb <= ``max_blocks`` summaries are padded with identity blocks to ``max_blocks`` (a static count, so one
    Split and max_blocks-1 multiply-adds: small kernels on small tensors). The last block's summary is never needed.

    Args: blk_a, blk_b [nb, E, N] each block's decay product and state from zero; h0 [E, N].
    Returns: carry_in [nb, E, N].
    """
    nb = blk_a.shape[0]
    if max_blocks == 1:
        return h0.unsqueeze(0)  # [1, E, N]
    pad = (0, 0, 0, 0, 0, max_blocks - nb)  # static padded size: nb + (max_blocks - nb)
    a_s = F.pad(blk_a, pad, value=1.0).split(1)  # max_blocks x [1, E, N]
    b_s = F.pad(blk_b, pad, value=0.0).split(1)  # max_blocks x [1, E, N]
    carries = [h0.unsqueeze(0)]  # [1, E, N] each
    for j in range(max_blocks - 1):
        carries.append(a_s[j] * carries[-1] + b_s[j])
    return cat_limited(carries)[:nb]  # [nb, E, N]


def discretize(
    dt: torch.Tensor, dtx: torch.Tensor, a_mat: torch.Tensor, b_in: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a_t = exp(dt_t A) and b_t = (dt_t x_t) B_t from the small factors.

    Args: dt, dtx [S, E]; a_mat [E, N]; b_in [S, N].  Returns: a, b [S, E, N].
    """
    return torch.exp(dt.unsqueeze(-1) * a_mat), dtx.unsqueeze(-1) * b_in.unsqueeze(1)  # [S, E, N] each


def _outputs(hs: torch.Tensor, c_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = C_t . h_t as a matrix product (no [S, E, N] product) and the last state.

    Args: hs [S, E, N]; c_out [S, N].  Returns: y [S, E]; h [E, N] (padding rows repeat the last real state).
    """
    return torch.matmul(hs, c_out.unsqueeze(-1)).squeeze(-1), hs[-1]  # [S, E], [E, N]


def selective_scan_reference(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64) -> tuple[T, T]:
    """The sequential reference of :func:`blocked_selective_scan` (same signature and result).

    Discretize, :func:`sequential_scan` one row at a time, y_t = C_t . h_t. Mirrors transformers'
    ``MambaMixer.slow_forward`` steps 3.b-3.c.

    Args: dt, dtx [S, E] (dt * x); a_mat [E, N] (A = -exp(A_log)); b_in, c_out [S, N]; h0 [E, N]; max_rows unused.
    Returns: y [S, E] (without the D skip term); h [E, N] the state after the last row.
    """
    return _outputs(sequential_scan(*discretize(dt, dtx, a_mat, b_in), h0), c_out)  # [S, E], [E, N]


def blocked_selective_scan(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64) -> tuple[T, T]:
    """The prefill scan on any S <= max_rows rows: the factors padded below with identity rows (dt = 0, so a = 1 and
    b = 0) to whole blocks, :func:`blocked_selective_scan_aligned`, y of the S real rows.

    The model pads its rows once for every layer and calls :func:`blocked_selective_scan_aligned` itself.
    Args and returns as :func:`selective_scan_reference`.
    """
    c = block_rows(max_rows)
    padded = [pad_rows(t, c) for t in (dt, dtx)] + [a_mat] + [pad_rows(t, c) for t in (b_in, c_out)]  # M rows
    y, h = blocked_selective_scan_aligned(*padded, h0, max_rows)  # [M, E], [E, N]
    return y[: dt.shape[0]], h  # [S, E], [E, N]


def blocked_selective_scan_aligned(
    dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64
) -> tuple[T, T]:
    """The prefill graphs' scan on M rows, a multiple of :func:`block_rows`: discretize,
    :func:`blocked_scan_aligned`, y. Padding rows (dt = 0) repeat the last real state, so h is that state."""
    return _outputs(blocked_scan_aligned(*discretize(dt, dtx, a_mat, b_in), h0, max_rows), c_out)  # [M, E], [E, N]


def selective_scan_step(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T) -> tuple[T, T]:
    """The decode step h = a h0 + b, y = C . h for one new row of each of B sequences (no row indexing).

    Args: dt, dtx [B, E]; a_mat [E, N]; b_in, c_out [B, N]; h0 [B, E, N].  Returns: y [B, E]; h [B, E, N].
    """
    a, b = discretize(dt, dtx, a_mat, b_in)  # [B, E, N] each
    h = a * h0 + b  # [B, E, N]
    return torch.matmul(h, c_out.unsqueeze(-1)).squeeze(-1), h  # [B, E, N] @ [B, N, 1] -> [B, E]; [B, E, N]
