"""The registry of prefill scans: one entry per scan, the only place a scan is named.

Every scan has one signature, that of :func:`mambatrt.export.scan_rows.selective_scan_reference`:

    scan(dt [M, E], dtx [M, E], a_mat [E, N], b_in [M, N], c_out [M, N], h0 [E, N], max_rows)
        -> y [M, E] (C_t . h_t, without the D skip term), h [E, N] (the state after the last row)

with h_t = exp(dt_t A) h_{t-1} + dtx_t B_t. Adding a scan is one function in ``scan_rows.py`` and one
:class:`ScanSpec` below; the model, the exporter, the CLI's ``--scan`` choices and the tests read this table.

Pure Python (no torch): the command line builds its choices from it without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScanSpec:
    """One prefill scan.

    ``aligned``: the scan works on whole blocks of rows, so the model pads the chunk once (for every layer) to a
    multiple of the block size with identity rows (dt = 0) instead of each scan padding its own inputs.
    ``softplus``: how the graph computes dt = softplus(.): "plain" (one Softplus node: fewest GPU kernels) or
    "exp-log" (Exp + Add + Log: onnxruntime's CPU Softplus kernel runs element by element).
    """

    name: str
    function: str  # the function's name in mambatrt.export.scan_rows
    aligned: bool
    softplus: str
    summary: str  # one line for --help

    def __call__(self, *args, **kwargs):
        """Run the scan (imports torch)."""
        from mambatrt.export import scan_rows

        return getattr(scan_rows, self.function)(*args, **kwargs)


_REGISTRY = (
    ScanSpec(
        "blocked",
        "blocked_selective_scan",
        aligned=True,
        softplus="plain",
        summary="two-level over 8-row blocks; for GPUs with CUDA graphs",
    ),
    ScanSpec(
        "blocked-log",
        "blocked_log_selective_scan",
        aligned=True,
        softplus="plain",
        summary="the same blocks with decays from sums of dt; fewest kernels, for GPUs without CUDA graphs and "
        "short prompts",
    ),
    ScanSpec(
        "blocked-pieces",
        "blocked_ssm_pieces",
        aligned=True,
        softplus="exp-log",
        summary="the same blocks one row at a time from the small factors; least memory traffic, for CPUs",
    ),
    ScanSpec(
        "hillis-steele",
        "hillis_steele_selective_scan",
        aligned=False,
        softplus="plain",
        summary="log2(max-rows) doubling rounds, the baseline",
    ),
)
# The prefill scans a graph can be exported with, by name.
SCANS: dict[str, ScanSpec] = {s.name: s for s in _REGISTRY}
DEFAULT_SCAN = "blocked"
# The sequential reference (a Python loop over the rows): for tests and the PyTorch reference, never exported.
REFERENCE = ScanSpec(
    "sequential", "selective_scan_reference", aligned=False, softplus="plain", summary="one row at a time"
)


def scan_spec(name: str) -> ScanSpec:
    """The scan called ``name`` (a registered scan or "sequential"); unknown names raise InputError."""
    from mambatrt.errors import InputError

    if name == REFERENCE.name:
        return REFERENCE
    try:
        return SCANS[name]
    except KeyError:
        raise InputError(f"unknown prefill scan '{name}'; choose from {', '.join(SCANS)}") from None


def scan_help() -> str:
    """--scan's help text, from the registry."""
    parts = [f"{s.name} ({s.summary})" for s in _REGISTRY]
    return "prefill scan: " + ", ".join(parts) + " (default: %(default)s)"
