"""The parallel conv/scan pieces equal their sequential references."""

import pytest
import torch

from mambatrt.export.scan_rows import (
    block_carries,
    block_carries_log,
    block_rows,
    blocked_log_scan,
    blocked_log_scan_aligned,
    blocked_scan,
    blocked_scan_aligned,
    cat_limited,
    causal_conv_rows,
    causal_conv_rows_reference,
    causal_conv_step,
    hillis_steele_scan,
    pad_rows,
    scan_rounds,
    selective_scan_reference,
    selective_scan_step,
    sequential_scan,
    stack_limited,
)
from mambatrt.export.scans import SCANS
from mambatrt.testing import assert_close


def _factors(rows: int, e: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """dt [rows, E] >= 0, A [E, N] < 0, their decays a = exp(dt A), inputs b and a non-zero incoming state h0."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.rand(rows, e, generator=g) * 0.3
    a_mat = -torch.rand(e, n, generator=g) * 8 - 0.05  # A = -exp(A_log)
    b = torch.randn(rows, e, n, generator=g)
    h0 = torch.randn(e, n, generator=g) * 3
    return dt, a_mat, torch.exp(dt.unsqueeze(-1) * a_mat), b, h0


def _scan(name: str, dt, a_mat, a, b, h0, max_rows: int) -> torch.Tensor:
    """Run one parallel scan; blocked-log takes the decays in factored form (dt, A), the others a = exp(dt A)."""
    if name == "blocked-log":
        return blocked_log_scan(dt, a_mat, b, h0, max_rows)
    return {"hillis-steele": hillis_steele_scan, "blocked": blocked_scan}[name](a, b, h0, max_rows)


@pytest.mark.parametrize("scan", ["hillis-steele", "blocked", "blocked-log"])
@pytest.mark.parametrize("rows", [1, 2, 3, 63, 64])
def test_parallel_scans_equal_sequential(rows, scan):
    dt, a_mat, a, b, h0 = _factors(rows, 24, 16, rows)
    got = _scan(scan, dt, a_mat, a, b, h0, 64)
    want = sequential_scan(a, b, h0, max_rows=64)
    assert got.shape == want.shape == (rows, 24, 16)
    assert_close(f"{scan} rows={rows}", got, want, 1e-5)


@pytest.mark.parametrize("scan", ["blocked", "blocked-log"])
@pytest.mark.parametrize("max_rows", [1, 2, 5, 32, 128])
def test_blocked_scans_other_limits(max_rows, scan):
    dt, a_mat, a, b, h0 = _factors(max_rows, 3, 4, max_rows)
    for rows in sorted({1, max(1, max_rows // 2 + 1), max_rows}):
        got = _scan(scan, dt[:rows], a_mat, a[:rows], b[:rows], h0, max_rows)
        want = sequential_scan(a[:rows], b[:rows], h0)
        assert_close(f"{scan} max_rows={max_rows} rows={rows}", got, want, 1e-5)


@pytest.mark.parametrize("blocks", [1, 2, 5, 8])
def test_block_carries_log_equals_chain(blocks):
    """All carries at once from exp(A * sums of block dt) equal the block-by-block chain of decay products."""
    g = torch.Generator().manual_seed(blocks)
    e, n = 12, 16
    blk_dt = torch.rand(blocks, e, generator=g) * 2.0  # a block's sum of dt
    a_mat = -torch.rand(e, n, generator=g) * 4 - 0.05
    blk_b, h0 = torch.randn(blocks, e, n, generator=g), torch.randn(e, n, generator=g)
    got = block_carries_log(blk_dt, a_mat, blk_b, h0, 8)
    want = block_carries(torch.exp(blk_dt.unsqueeze(-1) * a_mat), blk_b, h0, 8)
    assert got.shape == (blocks, e, n)
    assert_close(f"carries blocks={blocks}", got, want, 1e-5)


def test_scan_rounds():
    assert [scan_rounds(m) for m in (1, 2, 3, 64, 65)] == [0, 1, 2, 6, 7]


def test_too_few_rounds_is_wrong():
    """The round count matters: a scan built for 32 rows misses the long-range terms of a 64-row chunk."""
    g = torch.Generator().manual_seed(1)
    a = torch.rand(64, 4, 2, generator=g) * 0.1 + 0.9
    b = torch.randn(64, 4, 2, generator=g)
    h0 = torch.randn(4, 2, generator=g)
    full = sequential_scan(a, b, h0)
    assert (hillis_steele_scan(a, b, h0, max_rows=32) - full).abs().max() > 1e-3


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


@pytest.mark.parametrize("scan", ["blocked", "blocked-log"])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 64])
def test_blocked_scan_aligned_on_padded_rows(rows, scan):
    """The model's path: factors padded with dt = 0 rows (a = 1, b = 0) to whole blocks; padding repeats the state."""
    dt, a_mat, a, b, h0 = _factors(rows, 5, 3, 100 + rows)
    c = block_rows(64)
    if scan == "blocked":
        got = blocked_scan_aligned(pad_rows(a, c, 1.0), pad_rows(b, c), h0, 64)
    else:
        got = blocked_log_scan_aligned(pad_rows(dt, c), a_mat, pad_rows(b, c), h0, 64)
    want = sequential_scan(a, b, h0)
    assert got.shape[0] == -(-rows // c) * c
    assert_close(f"{scan} aligned rows={rows}", got[:rows], want, 1e-5)
    assert torch.equal(got[-1], got[rows - 1])


@pytest.mark.parametrize("count", [1, 32, 33, 64, 1100])
def test_cat_limited_equals_cat(count):
    parts = [torch.full((2, 3), float(i)) for i in range(count)]
    assert torch.equal(cat_limited(parts, 1), torch.cat(parts, 1))
    assert torch.equal(stack_limited(parts), torch.stack(parts))


def _selective_factors(rows: int, e: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The prefill scans' inputs: dt [rows, E] >= 0, dt * x, A [E, N] < 0, B and C [rows, N], h0 [E, N]."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.rand(rows, e, generator=g) * 0.3
    dtx = dt * torch.randn(rows, e, generator=g)
    a_mat = -torch.rand(e, n, generator=g) * 8  # A = -exp(A_log)
    b_in, c_out = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    return dt, dtx, a_mat, b_in, c_out, torch.randn(e, n, generator=g) * 3


def _run_registered(name: str, factors: tuple[torch.Tensor, ...], max_rows: int):
    """A registered scan on S rows; an aligned scan gets its rows padded with dt = 0 rows as the model pads them."""
    spec, (dt, dtx, a_mat, b_in, c_out, h0) = SCANS[name], factors
    rows = dt.shape[0]
    if not spec.aligned:
        return spec(dt, dtx, a_mat, b_in, c_out, h0, max_rows)
    c = block_rows(max_rows)
    padded = [pad_rows(t, c) for t in (dt, dtx)] + [a_mat] + [pad_rows(t, c) for t in (b_in, c_out)]
    y, h = spec(*padded, h0, max_rows)  # padding rows have dt = 0: the identity step
    assert y.shape[0] == -(-rows // c) * c
    return y[:rows], h


@pytest.mark.parametrize("scan", list(SCANS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 63, 64])
def test_registered_scans_equal_reference(scan, rows):
    """Every prefill scan of the registry equals the sequential reference (y and the last state)."""
    factors = _selective_factors(rows, 24, 16, rows)
    want_y, want_h = selective_scan_reference(*factors)
    got_y, got_h = _run_registered(scan, factors, 64)
    assert got_y.shape == want_y.shape == (rows, 24) and got_h.shape == want_h.shape == (24, 16)
    assert_close(f"{scan} y rows={rows}", got_y, want_y, 1e-5)
    assert_close(f"{scan} h rows={rows}", got_h, want_h, 1e-5)


@pytest.mark.parametrize("scan", list(SCANS))
@pytest.mark.parametrize("max_rows", [1, 2, 5, 20, 128])
def test_registered_scans_other_limits(scan, max_rows):
    for rows in sorted({1, max(1, max_rows // 2 + 1), max_rows}):
        factors = _selective_factors(rows, 3, 4, max_rows + rows)
        want_y, want_h = selective_scan_reference(*factors)
        got_y, got_h = _run_registered(scan, factors, max_rows)
        assert_close(f"{scan} max_rows={max_rows} rows={rows} y", got_y, want_y, 1e-5)
        assert_close(f"{scan} max_rows={max_rows} rows={rows} h", got_h, want_h, 1e-5)


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
