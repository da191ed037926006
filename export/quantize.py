"""int8 weights: the large matrices of an "int8" model (embedding, in/out projections, lm_head) as int8 rows with a
float32 scale per row, symmetric (scale = max |w| / 127 per output channel, the row's largest weight exact).

A quantized module keeps ``weight_q`` [N, K] int8 and ``weight_scale`` [N, 1] float32 in place of ``weight``;
:func:`weight` gives the float32 matrix the model multiplies by, ``weight_q * weight_scale``, which the exported
graphs compute from the int8 initializer (Cast, Mul): the bundle stores the int8 bytes alone. onnxruntime folds that
product into a float32 initializer when it opens the portable and kernels graphs (a reference that runs anywhere);
the kernels graphs' CPU copies take the int8 rows as they are (MambaLinear8, :mod:`.linear_copies`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX = 127
# Rows quantized at a time: each block's float32 temporaries are a few MiB at mamba-2.8b's widths, where a whole
# LM head's (50280 x 2560) would be several float32 copies of 0.5 GB beside the weights being built
BLOCK_ROWS = 256


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scale [N, 1] float32) with q * scale ~ w, from w in any float type, BLOCK_ROWS rows at a
    time; an all-zero row gets scale 1."""
    w = w.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty((w.shape[0], 1), dtype=torch.float32, device=w.device)
    for start in range(0, w.shape[0], BLOCK_ROWS):
        rows = w[start : start + BLOCK_ROWS].to(torch.float32)
        peak = rows.abs().amax(dim=1, keepdim=True)
        block_scale = torch.where(peak > 0, peak / INT8_MAX, torch.ones_like(peak))
        q[start : start + BLOCK_ROWS] = torch.clamp(torch.round(rows / block_scale), -INT8_MAX, INT8_MAX)
        scale[start : start + BLOCK_ROWS] = block_scale
    return q, scale


def quantize_module(module: nn.Module) -> torch.Tensor:
    """Replace ``module.weight`` [N, K] by ``weight_q`` and ``weight_scale`` buffers, in place; returns the weight
    it replaced (a caller that read it from a mapped checkpoint hands its pages back)."""
    source = module.weight
    q, scale = quantize_rows(source)
    del module.weight
    module.register_buffer("weight_q", q)
    module.register_buffer("weight_scale", scale)
    return source


def is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "weight_q")


def weight(module: nn.Module) -> torch.Tensor:
    """The matrix a module multiplies by: its weight, or its int8 rows times their scales (float32)."""
    if is_quantized(module):
        return module.weight_q.to(torch.float32) * module.weight_scale
    return module.weight


def embed(token_ids: torch.Tensor, module: nn.Embedding) -> torch.Tensor:
    """The embedding rows of ``token_ids``, float32: for int8, only the gathered rows are scaled."""
    if is_quantized(module):
        rows = F.embedding(token_ids, module.weight_q).to(torch.float32)
        return rows * F.embedding(token_ids, module.weight_scale)
    return F.embedding(token_ids, module.weight).to(torch.float32)
