"""Multi-row pieces of the Mamba mixer: the causal depthwise conv over rows and the selective scan over rows.

Each parallel function sits beside a sequential reference with the same signature; tests hold them equal.
Two levels: scans of h_t = a_t h_{t-1} + b_t over given a, b (:func:`sequential_scan` and its parallel forms), and
the prefill scans of :mod:`mambatrt.export.scans`, which all share the signature of
:func:`selective_scan_reference` (the small factors in, y and the last state out).
Written to export: no in-place writes, no branches on tensor values, loop bounds fixed by ``max_rows``.

Shapes (letters as in :mod:`mambatrt.config`): S rows, E inner width, N state size, K conv kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

T = torch.Tensor  # in the prefill scans' one signature (see selective_scan_reference)
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


def scan_rounds(max_rows: int) -> int:
    """Number of Hillis-Steele doubling rounds that cover ``max_rows`` rows (6 for 64)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return math.ceil(math.log2(max_rows)) if max_rows > 1 else 0


def _shift_rows(t: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    """Rows moved down by k (static pad on top, static slice off the bottom): out[i] = t[i-k], or ``fill``.

    (A single Pad with -k rows below would crop before padding and fail for chunks shorter than k.)
    """
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


def block_rows(max_rows: int) -> int:
    """Rows per block of :func:`blocked_scan`: 2^(rounds // 2), 8 for 64 rows."""
    return 1 << (scan_rounds(max_rows) // 2)


def pad_rows(t: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """t [S, ...] padded below with ``value`` rows to the next multiple of ``multiple`` rows: [ceil(S/m)*m, ...].

    One Pad node whose amount, (-S) mod m, the graph computes from the rows axis.
    """
    if multiple == 1:
        return t
    rows = t.shape[0]
    pad = [0, 0] * (t.dim() - 1) + [0, (rows + multiple - 1) // multiple * multiple - rows]  # (-S) mod m
    return F.pad(t, pad, value=value)  # [M, ...]


def blocked_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """Two-level blocked scan (same signature and result as :func:`sequential_scan`), fewer passes over [S, E, N].

    Pads the chunk with identity rows (a=1, b=0) to a multiple of the block size and calls
    :func:`blocked_scan_aligned`; the model pads its smaller factors instead (dt = 0 rows are the identity).
    """
    c = block_rows(max_rows)
    h = blocked_scan_aligned(pad_rows(a, c, 1.0), pad_rows(b, c, 0.0), h0, max_rows)  # [M, E, N]
    return h[: a.shape[0]]  # [S, E, N]


def blocked_scan_aligned(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64) -> torch.Tensor:
    """:func:`blocked_scan` on M rows, M a multiple of c = :func:`block_rows` (``max_rows``), M <= max_rows rounded up.

    The M rows form nb = M / c blocks of c rows (nb follows the chunk: short chunks do less work).
    1. Within each block the recurrence runs row by row on all blocks at once (c-1 steps over [nb, E, N]), and the
       decay products within the block come along ([nb, c, E, N]).
    2. The state entering each block: :func:`block_carries` over the nb block summaries.
    3. h = decay_within * carry_in + h_within.
    About 6 passes over [M, E, N] and ~45 nodes, instead of the Hillis-Steele scan's ~7 passes per round.

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


def blocked_log_scan(
    dt: torch.Tensor, a_mat: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64
) -> torch.Tensor:
    """:func:`blocked_scan` in log space: h_t = a_t h_{t-1} + b_t with a_t = exp(dt_t A), as :func:`sequential_scan`.

    Takes the decays in factored form (dt and A): the decay over several rows is exp(A * sum of dt), so the decays
    within a block and the carries across blocks come from sums of the small dt instead of chained products.
    Pads the chunk with identity rows (dt = 0, b = 0) to a multiple of the block size and calls
    :func:`blocked_log_scan_aligned`; the model pads its inputs once for all layers instead.

    Args: dt [S, E] (>= 0); a_mat [E, N] (A = -exp(A_log)); b [S, E, N]; h0 [E, N].  Returns: h [S, E, N].
    """
    c = block_rows(max_rows)
    h = blocked_log_scan_aligned(pad_rows(dt, c), a_mat, pad_rows(b, c), h0, max_rows)  # [M, E, N]
    return h[: dt.shape[0]]  # [S, E, N]


def _lower_ones(c: int) -> torch.Tensor:
    """[c, c] lower-triangular ones: row j sums rows 0..j (an inclusive prefix sum as one matrix product)."""
    return torch.tensor([[float(i <= j) for i in range(c)] for j in range(c)])  # a constant in the graph


def blocked_log_scan_aligned(
    dt: torch.Tensor, a_mat: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, max_rows: int = 64
) -> torch.Tensor:
    """:func:`blocked_log_scan` on M rows, M a multiple of c = :func:`block_rows` (``max_rows``).

    The blocks of :func:`blocked_scan_aligned`, with fewer kernels:
    1. Within each block the recurrence runs row by row on all blocks at once (c-1 multiply-adds over [nb, E, N]).
    2. The decay from a block's start to each of its rows, exp(A * prefix sum of dt): one batched matrix product
       with a constant triangular matrix over the small dt ([nb, c, E]) instead of c-1 products of [nb, E, N] decays.
    3. The state entering each block: :func:`block_carries_log` over the nb block summaries.
    4. h = decay_within * carry_in + h_within.
    Fewer kernels pay where launches dominate (a GPU without CUDA graphs, short chunks); with CUDA graphs its
    broadcast products over [M, E, N] and [B, B+1, E, N] can cost more GPU time than the chains' small kernels
    (BENCHMARKS.md compares the two).

    Args: dt [M, E]; a_mat [E, N]; b [M, E, N]; h0 [E, N].  Returns: h [M, E, N].
    """
    c = block_rows(max_rows)
    e, n = b.shape[1], b.shape[2]
    a = torch.exp(dt.unsqueeze(-1) * a_mat)  # [M, E, N]
    a_rows = a.reshape(-1, c, e, n).split(1, dim=1)  # c x [nb, 1, E, N]  (one Split node)
    b_rows = b.reshape(-1, c, e, n).split(1, dim=1)  # c x [nb, 1, E, N]
    state = [b_rows[0]]
    for j in range(1, c):
        state.append(a_rows[j] * state[-1] + b_rows[j])  # [nb, 1, E, N]
    dt_p = dt.reshape(-1, c, e)  # [nb, c, E]
    # the sum of dt from the block start: bmm, as torch.matmul's broadcast over nb would specialize nb on export
    cum = torch.bmm(_lower_ones(c).expand(dt_p.shape[0], c, c), dt_p)  # [nb, c, c] @ [nb, c, E] -> [nb, c, E]
    decay = torch.exp(cum.unsqueeze(-1) * a_mat)  # [nb, c, E, N]
    blk_dt, blk_b = cum[:, c - 1], state[-1].reshape(-1, e, n)  # [nb, E], [nb, E, N] block summaries
    carry_in = block_carries_log(blk_dt, a_mat, blk_b, h0, -(-max_rows // c)).unsqueeze(1)  # [nb, 1, E, N]
    h = decay * carry_in + cat_limited(state, 1)  # [nb, c, E, N]
    return h.reshape(-1, e, n)  # [M, E, N]


def _carry_masks(max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Constants of :func:`block_carries_log` for up to B = ``max_blocks`` blocks.

    Sources i = 0..B: i = 0 is h0, i >= 1 the summary of block i-1. Into block j, source i decays over blocks i..j-1.
    Returns: span [B, B+1, B] (span[j, i, k] = 1 for i <= k < j) and valid [B, B+1, 1, 1] (1 for i <= j).
    """
    blocks, sources = range(max_blocks), range(max_blocks + 1)
    # Python lists, so the graph holds constants rather than the ops that would build them
    span = torch.tensor([[[float(i <= k < j) for k in blocks] for i in sources] for j in blocks])  # [B, B+1, B]
    valid = torch.tensor([[[[float(i <= j)]] for i in sources] for j in blocks])  # [B, B+1, 1, 1]
    return span, valid


def block_carries_log(
    blk_dt: torch.Tensor, a_mat: torch.Tensor, blk_b: torch.Tensor, h0: torch.Tensor, max_blocks: int
) -> torch.Tensor:
    """The state entering each block, all blocks at once: what :func:`block_carries` computes one block at a time.

    carry_j = exp(A * sum_{k<j} S_k) h0 + sum_{i<j} exp(A * sum_{i<k<j} S_k) B_i, with S_k the sum of dt over block k
    and B_k its state from zero. The exponent sums are one matrix product of the [nb, E] block sums with a constant
    0/1 tensor; every pair (j, source) is formed at once ([B, B+1, E, N] for B = ``max_blocks``: padding blocks have
    dt = 0 and B = 0), and the sum over sources is a matrix product too. A fixed number of kernels whatever nb, against
    2 per block for the chain. The sums are taken in full fp32 only with TF32 off, which the runtime and the plan
    builders ask for.

    Args: blk_dt [nb, E] (S); a_mat [E, N]; blk_b [nb, E, N] (B); h0 [E, N].  Returns: carry_in [nb, E, N].
    """
    if max_blocks == 1:
        return h0.unsqueeze(0)  # [1, E, N]
    nb, e = blk_dt.shape[0], blk_dt.shape[1]
    span, valid = _carry_masks(max_blocks)  # static sizes: the nb blocks are padded to max_blocks, as in the chain
    sums = torch.matmul(span, F.pad(blk_dt, (0, 0, 0, max_blocks - nb)))  # [B, B+1, B] @ [B, E] -> [B, B+1, E]
    gain = torch.exp(sums.unsqueeze(-1) * a_mat) * valid  # [B, B+1, E, N] decay from each source into each block
    sources = F.pad(torch.cat([h0.unsqueeze(0), blk_b], 0), (0, 0, 0, 0, 0, max_blocks - nb))  # [B+1, E, N]
    terms = (gain * sources).reshape(max_blocks, max_blocks + 1, -1)  # [B, B+1, E*N]
    # the sum over sources as a product with a ones row: a GPU ReduceSum over a middle axis is slow (cuDNN)
    carry = torch.matmul(torch.ones(1, max_blocks + 1), terms)  # [1, B+1] @ [B, B+1, E*N] -> [B, 1, E*N]
    return carry.reshape(max_blocks, e, -1)[:nb]  # [nb, E, N]


def block_carries(blk_a: torch.Tensor, blk_b: torch.Tensor, h0: torch.Tensor, max_blocks: int) -> torch.Tensor:
    """The state entering each block: carry_0 = h0, carry_j = A_{j-1} carry_{j-1} + B_{j-1}, one block at a time.

    The nb <= ``max_blocks`` summaries are padded with identity blocks to ``max_blocks`` (a static count, so one
    Split and max_blocks-1 multiply-adds: small kernels on small tensors; :func:`block_carries_log` has fewer
    kernels but more work). The last block's summary is never needed.

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
    """The sequential reference of every prefill scan (the signature of :mod:`mambatrt.export.scans`).

    Discretize, :func:`sequential_scan` one row at a time, y_t = C_t . h_t. Mirrors transformers'
    ``MambaMixer.slow_forward`` steps 3.b-3.c.

    Args: dt, dtx [S, E] (dt * x); a_mat [E, N] (A = -exp(A_log)); b_in, c_out [S, N]; h0 [E, N]; max_rows unused.
    Returns: y [S, E] (without the D skip term); h [E, N] the state after the last row.
    """
    return _outputs(sequential_scan(*discretize(dt, dtx, a_mat, b_in), h0), c_out)  # [S, E], [E, N]


def selective_scan_step(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T) -> tuple[T, T]:
    """The decode step h = a h0 + b, y = C . h for one new row of each of B sequences (no row indexing).

    Args: dt, dtx [B, E]; a_mat [E, N]; b_in, c_out [B, N]; h0 [B, E, N].  Returns: y [B, E]; h [B, E, N].
    """
    a, b = discretize(dt, dtx, a_mat, b_in)  # [B, E, N] each
    h = a * h0 + b  # [B, E, N]
    return torch.matmul(h, c_out.unsqueeze(-1)).squeeze(-1), h  # [B, E, N] @ [B, N, 1] -> [B, E]; [B, E, N]


def hillis_steele_selective_scan(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64) -> tuple[T, T]:
    """Scan "hillis-steele": discretize, :func:`hillis_steele_scan`, y; any S rows (as the reference)."""
    return _outputs(hillis_steele_scan(*discretize(dt, dtx, a_mat, b_in), h0, max_rows), c_out)


def blocked_selective_scan(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64) -> tuple[T, T]:
    """Scan "blocked": discretize, :func:`blocked_scan_aligned`, y; M rows, a multiple of :func:`block_rows`."""
    return _outputs(blocked_scan_aligned(*discretize(dt, dtx, a_mat, b_in), h0, max_rows), c_out)


def blocked_log_selective_scan(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64) -> tuple[T, T]:
    """Scan "blocked-log": :func:`blocked_log_scan_aligned` on the factored decays, y; M rows as for "blocked"."""
    b = dtx.unsqueeze(-1) * b_in.unsqueeze(1)  # [M, E, N]
    return _outputs(blocked_log_scan_aligned(dt, a_mat, b, h0, max_rows), c_out)


def blocked_ssm_pieces(dt: T, dtx: T, a_mat: T, b_in: T, c_out: T, h0: T, max_rows: int = 64) -> tuple[T, T]:
    """The blocked scan and y = C . h, one row of every block at a time, from the small factors (CPU-oriented).

    Same blocks as :func:`blocked_scan_aligned`, but the [M, E, N] tensors are never formed whole: the [M, E] and
    [M, N] factors are split into the c rows of the blocks, and each row's a, b, h and y are computed for all nb
    blocks at once ([nb, E, N] pieces). Pass 1 runs each block from zero to get its summary (its decay product is
    exp(A * sum of dt), from the small factors); :func:`block_carries` gives the state entering each block; pass 2
    runs the blocks again from their carries and contracts each row with C. Fewer passes over memory than
    :func:`blocked_scan_aligned` (no Split or Concat of [M, E, N] tensors), for more kernels: the form for
    onnxruntime's CPU provider, where passes over memory dominate, not for GPUs, where kernel launches do
    (BENCHMARKS.md has both).

    Args: dt, dtx [M, E]; a_mat [E, N]; b_in, c_out [M, N]; h0 [E, N]; M a multiple of :func:`block_rows`.
    Returns: y [M, E]; h [E, N] the state after the last row.
    """
    c = block_rows(max_rows)
    e, n = a_mat.shape

    def rows_of_blocks(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, ...]:
        # [M, F] -> c x [nb, 1, F, 1] (axis -1) or [nb, 1, 1, F] (axis -2): one Split node of a small tensor, with
        # the broadcast axis added before the split (a view of a split piece would make torch.export assume nb > 1)
        return t.reshape(-1, c, t.shape[-1]).unsqueeze(axis).split(1, dim=1)

    dts, dtxs = rows_of_blocks(dt, -1), rows_of_blocks(dtx, -1)  # c x [nb, 1, E, 1]
    bs, cs = rows_of_blocks(b_in, -2), rows_of_blocks(c_out, -2)  # c x [nb, 1, 1, N]
    a = [torch.exp(d * a_mat) for d in dts]  # c x [nb, 1, E, N]
    b = [x * bb for x, bb in zip(dtxs, bs, strict=True)]  # c x [nb, 1, E, N]
    state = b[0]  # [nb, 1, E, N] pass 1: each block from zero
    for j in range(1, c):
        state = a[j] * state + b[j]
    blk_decay = torch.exp(dt.reshape(-1, c, e).sum(1).unsqueeze(-1) * a_mat)  # [nb, E, N] product of a in block
    h = block_carries(blk_decay, state.reshape(-1, e, n), h0, -(-max_rows // c)).unsqueeze(1)  # [nb, 1, E, N]
    ys = []
    for j in range(c):  # pass 2: from the carries
        h = a[j] * h + b[j]  # [nb, 1, E, N]
        ys.append((h * cs[j]).sum(-1))  # [nb, 1, E]
    y = cat_limited(ys, 1).reshape(-1, e)  # [nb, c, E] -> [M, E]
    return y, h[-1].reshape(e, n)  # [M, E], [E, N]
