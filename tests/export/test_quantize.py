"""int8 rows of the large matrices (export/quantize.py): the values of a whole-matrix reference, made in blocks."""

import numpy as np
import pytest
import torch

from mambatrt.export.quantize import BLOCK_ROWS, INT8_MAX, quantize_rows


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_rows_in_blocks_equal_the_whole_matrix(dtype):
    """Rows past several blocks (a partial last one), fp32 and fp16 sources, an all-zero row: the int8 rows and
    scales equal numpy's float32 formula over the whole matrix at once, and each row's largest weight is exact."""
    rows = 2 * BLOCK_ROWS + 37
    w = (np.random.default_rng(3).standard_normal((rows, 45)) * 0.05).astype(dtype)
    w[5] = 0
    q, scale = (t.numpy() for t in quantize_rows(torch.from_numpy(w)))
    w32 = w.astype(np.float32)
    peak = np.abs(w32).max(axis=1, keepdims=True)
    want_scale = np.where(peak > 0, peak / np.float32(INT8_MAX), np.float32(1)).astype(np.float32)
    want_q = np.clip(np.round(w32 / want_scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    worst = int(np.abs(q.astype(np.int32) - want_q).max())
    print(f"{dtype.__name__}: worst int8 difference {worst}, scales equal {np.array_equal(scale, want_scale)}")
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (rows, 1)
    assert worst == 0 and np.array_equal(scale, want_scale)
    assert scale[5, 0] == 1 and not q[5].any()
    largest = np.abs(w32).argmax(axis=1)
    nonzero = peak[:, 0] > 0
    assert (np.abs(q[np.arange(rows), largest])[nonzero] == INT8_MAX).all()
