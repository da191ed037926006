"""The parallel conv/scan pieces equal their sequential references."""

import pytest
import torch

from mambatrt.export.scan_rows import (
    block_rows,
    blocked_scan_aligned,
    blocked_selective_scan,
    blocked_selective_scan_aligned,
    cat_limited,
    causal_conv_rows,
    causal_conv_rows_reference,
    causal_conv_step,
    pad_rows,
    selective_scan_reference,
    selective_scan_step,
    sequential_scan,
    stack_limited,
)
from mambatrt.testing import assert_close


def _factors(rows: int, e: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Decays a = exp(dt A) for dt [rows, E] >= 0 and A [E, N] < 0, inputs b and a non-zero incoming state h0."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.rand(rows, e, generator=g) * 0.3
    a_mat = -torch.rand(e, n, generator=g) * 8 - 0.05  # A = -exp(A_log)
    b = torch.randn(rows, e, n, generator=g)
    h0 = torch.randn(e, n, generator=g) * 3
    return torch.exp(dt.unsqueeze(-1) * a_mat), b, h0


def _selective_factors(rows: int, e: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The prefill scans' inputs: dt [rows, E] >= 0, dt * x, A [E, N] < 0, B and C [rows, N], h0 [E, N]."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.rand(rows, e, generator=g) * 0.3
    dtx = dt * torch.randn(rows, e, generator=g)
    a_mat = -torch.rand(e, n, generator=g) * 8  # A = -exp(A_log)
    b_in, c_out = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    return dt, dtx, a_mat, b_in, c_out, torch.randn(e, n, generator=g) * 3


@pytest.mark.parametrize("rows", [1, 2, 3, 63, 64])
def test_blocked_scan_equals_reference(rows):
    """The prefill scan and its sequential reference (one signature) give the same y and last state."""
    factors = _selective_factors(rows, 24, 16, rows)
    want_y, want_h = selective_scan_reference(*factors, max_rows=64)
    got_y, got_h = blocked_selective_scan(*factors, max_rows=64)
    assert got_y.shape == want_y.shape == (rows, 24) and got_h.shape == want_h.shape == (24, 16)
    assert_close(f"blocked y rows={rows}", got_y, want_y, 1e-5)
    assert_close(f"blocked h rows={rows}", got_h, want_h, 1e-5)


@pytest.mark.parametrize("rows", [5, 8, 9])
def test_blocked_scan_equals_reference_at_block_edges(rows):
    """Chunks just under, at and over one block of 8 rows (64 rows' blocks)."""
    factors = _selective_factors(rows, 24, 16, rows)
    for got, want, what in zip(blocked_selective_scan(*factors), selective_scan_reference(*factors), "yh", strict=True):
        assert_close(f"blocked {what} rows={rows}", got, want, 1e-5)


@pytest.mark.parametrize("max_rows", [1, 2, 5, 20, 32, 128])
def test_blocked_scan_other_limits(max_rows):
    """Other chunk limits (other block sizes and counts) at their shortest, middle and longest chunks."""
    for rows in sorted({1, max(1, max_rows // 2 + 1), max_rows}):
        factors = _selective_factors(rows, 3, 4, max_rows + rows)
        want_y, want_h = selective_scan_reference(*factors)
        got_y, got_h = blocked_selective_scan(*factors, max_rows=max_rows)
        assert_close(f"max_rows={max_rows} rows={rows} y", got_y, want_y, 1e-5)
        assert_close(f"max_rows={max_rows} rows={rows} h", got_h, want_h, 1e-5)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 64])
def test_blocked_scan_aligned_on_padded_rows(rows):
    """The model's path: decays and inputs padded with identity rows (a = 1, b = 0) to whole blocks; padding repeats
    the last real state."""
    a, b, h0 = _factors(rows, 5, 3, 100 + rows)
    c = block_rows(64)
    got = blocked_scan_aligned(pad_rows(a, c, 1.0), pad_rows(b, c), h0, 64)
    want = sequential_scan(a, b, h0)
    assert got.shape[0] == -(-rows // c) * c
    assert_close(f"aligned rows={rows}", got[:rows], want, 1e-5)
    assert torch.equal(got[-1], got[rows - 1])


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_aligned_selective_scan_on_dt_zero_padding(rows):
    """The prefill graphs' scan on factors padded with dt = 0 rows, as the model pads them: y of the real rows and
    the last real state."""
    dt, dtx, a_mat, b_in, c_out, h0 = _selective_factors(rows, 6, 4, rows)
    c = block_rows(64)
    padded = [pad_rows(t, c) for t in (dt, dtx)] + [a_mat] + [pad_rows(t, c) for t in (b_in, c_out)]
    got_y, got_h = blocked_selective_scan_aligned(*padded, h0, 64)
    want_y, want_h = selective_scan_reference(dt, dtx, a_mat, b_in, c_out, h0)
    assert got_y.shape[0] == -(-rows // c) * c
    assert_close(f"aligned y rows={rows}", got_y[:rows], want_y, 1e-5)
    assert_close(f"aligned h rows={rows}", got_h, want_h, 1e-5)


def test_block_rows():
    assert [block_rows(m) for m in (1, 2, 3, 5, 20, 64, 65, 128)] == [1, 1, 2, 2, 4, 8, 8, 8]
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        block_rows(0)


@pytest.mark.parametrize("rows", [1, 2, 3, 63, 64])
@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_conv_rows_equals_reference(rows, kernel):
    g = torch.Generator().manual_seed(rows * 10 + kernel)
    e = 12
    x = torch.randn(rows, e, generator=g)
    state = torch.randn(e, kernel - 1, generator=g)
    weight = torch.randn(e, 1, kernel, generator=g)
    bias = torch.randn(e, generator=g)
    y, new_state = causal_conv_rows(x, state, weight, bias)
    y_ref, state_ref = causal_conv_rows_reference(x, state, weight, bias)
    assert y.shape == (rows, e) and new_state.shape == (e, kernel - 1)
    assert_close("conv rows", y, y_ref, 1e-6)
    assert torch.equal(new_state, state_ref)


@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_conv_step_equals_reference(kernel):
    """One new input of each of B = 3 sequences equals the reference on each sequence."""
    g = torch.Generator().manual_seed(kernel)
    e, b = 12, 3
    x = torch.randn(b, e, generator=g)
    state = torch.randn(b, e, kernel - 1, generator=g)
    weight = torch.randn(e, 1, kernel, generator=g)
    for bias in (torch.randn(e, generator=g), None):
        y, new_state = causal_conv_step(x, state, weight, bias)
        assert y.shape == (b, e) and new_state.shape == (b, e, kernel - 1)
        for i in range(b):
            y_ref, state_ref = causal_conv_rows_reference(x[i : i + 1], state[i], weight, bias)
            assert_close("conv step", y[i : i + 1], y_ref, 1e-6)
            assert torch.equal(new_state[i], state_ref)


@pytest.mark.parametrize("count", [1, 32, 33, 64, 1100])
def test_cat_limited_equals_cat(count):
    parts = [torch.full((2, 3), float(i)) for i in range(count)]
    assert torch.equal(cat_limited(parts, 1), torch.cat(parts, 1))
    assert torch.equal(stack_limited(parts), torch.stack(parts))


@pytest.mark.parametrize("batch", [1, 3])
def test_step_equals_reference(batch):
    """The decode step's direct update on B sequences equals the reference on each sequence's one row."""
    rows = [_selective_factors(1, 24, 16, 7 + i) for i in range(batch)]
    a_mat = rows[0][2]
    dt, dtx, b_in, c_out = (torch.cat([r[k] for r in rows]) for k in (0, 1, 3, 4))  # [B, E] / [B, N]
    h0 = torch.stack([r[5] for r in rows])  # [B, E, N]
    got_y, got_h = selective_scan_step(dt, dtx, a_mat, b_in, c_out, h0)
    assert got_y.shape == (batch, 24) and got_h.shape == (batch, 24, 16)
    for i, (r_dt, r_dtx, _, r_b, r_c, r_h0) in enumerate(rows):
        want_y, want_h = selective_scan_reference(r_dt, r_dtx, a_mat, r_b, r_c, r_h0)
        assert_close(f"step y[{i}]", got_y[i : i + 1], want_y, 1e-6)
        assert_close(f"step h[{i}]", got_h[i], want_h, 1e-6)
