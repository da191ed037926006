"""``mambatrt compare``: accuracy checks of a bundle, through Polygraphy's Comparator, printed as a table.

Checks (each on the same random prompt, from zero states):

1. onnxruntime vs the PyTorch model (needs the checkpoint: the manifest's source or ``--checkpoint``);
2. chunked prefill on the prefill graph vs token-by-token on the decode graph (split bundles);
3. each TensorRT plan vs onnxruntime, when a TensorRT runtime can execute plans here.

Outputs compared: logits, conv state and ssm state after the prompt, and logits after a few decode steps.
Pass: Polygraphy's ``CompareFunc.simple`` with atol = rtol * max|reference| per output, plus equal argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mambatrt.contract import DECODE, KERNELS, PORTABLE, PREFILL
from mambatrt.runtime.bundle import Bundle
from mambatrt.runtime.runners import Runner
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.runtime.runners.trt.loader import check_plans, tensorrt_runtime_available
from mambatrt.tensorrt_flavour import find_tensorrt, import_polygraphy

# Relative tolerance (against max |reference|) per bundle precision, for PyTorch-vs-ONNX and engine-vs-engine.
RTOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 1e-1, "int8": 1e-4}
DECODE_STEPS = 4


@dataclass
class Row:
    """One line of the comparison table."""

    check: str
    status: str  # PASS | FAIL | SKIP
    rtol: float | None = None
    worst: float | None = None
    argmax: str = ""
    note: str = ""


def prefill(runner: Runner, prompt: np.ndarray, graph: str) -> np.ndarray:
    """``prompt`` from zero states through ``graph``, in chunks of its largest row count (one row on the decode
    graph); the last logits, cut to the real vocabulary (the padded columns are not the model's)."""
    runner.reset()
    rows = runner.max_rows[graph]
    for start in range(0, prompt.size, rows):
        logits = runner.run(graph, prompt[start : start + rows])
    return logits[: runner.config.vocab_size]


def _outputs(runner: Runner, prompt: np.ndarray, graph: str) -> dict[str, np.ndarray]:
    """Prompt through ``graph`` (chunked for prefill, one row at a time for decode), then greedy decode steps."""
    logits = prefill(runner, prompt, graph)
    conv, ssm = runner.get_state()
    out = {"logits": logits.copy(), "conv_state_out": conv, "ssm_state_out": ssm}
    for i in range(DECODE_STEPS):
        logits = runner.run(DECODE, [int(np.argmax(logits))])[: runner.config.vocab_size]
        out[f"decode_logits_{i}"] = logits.copy()
    return out


def polygraphy_compare(name: str, ref_name: str, got: dict, ref: dict, rtol: float) -> Row:
    """Compare two output dicts with Polygraphy's Comparator; one table row."""
    comparator = import_polygraphy("polygraphy.comparator")
    Comparator, RunResults = comparator.Comparator, comparator.RunResults
    SimpleCompareFunc = comparator.SimpleCompareFunc
    IterationResult = import_polygraphy("polygraphy.comparator.struct").IterationResult
    G_LOGGER = import_polygraphy("polygraphy.logger").G_LOGGER

    results = RunResults()
    results.append((ref_name, [IterationResult(outputs=ref, runner_name=ref_name)]))
    results.append((name, [IterationResult(outputs=got, runner_name=name)]))
    atol = {k: rtol * float(np.abs(v).max()) for k, v in ref.items()}
    func = SimpleCompareFunc(rtol=rtol, atol=atol, check_error_stat="max")
    severity = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.ERROR
    try:
        accuracy = Comparator.compare_accuracy(results, compare_func=func)
    finally:
        G_LOGGER.module_severity = severity
    worst = max(float(np.abs(got[k] - ref[k]).max()) / max(float(np.abs(ref[k]).max()), 1e-30) for k in ref)
    logit_keys = [k for k in ref if "logits" in k]
    same = sum(int(np.argmax(got[k]) == np.argmax(ref[k])) for k in logit_keys)
    ok = bool(accuracy) and same == len(logit_keys)
    return Row(f"{name} vs {ref_name}", "PASS" if ok else "FAIL", rtol, worst, f"{same}/{len(logit_keys)}")


def compare_bundle(bundle: Bundle, checkpoint: Path | None = None, prompt_len: int = 75, seed: int = 0) -> list[Row]:
    """Run every applicable check; returns the table rows."""
    rtol = RTOL[bundle.precision]
    vocab = bundle.config.vocab_size
    prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).astype(np.int64)
    rows: list[Row] = []
    if bundle.precision == "bf16":
        ort_outputs = None
        rows.append(Row("onnxruntime (CPU)", "SKIP", note="onnxruntime's CPU provider has no bf16 kernels"))
    else:
        graphs = [g for g in (PREFILL, DECODE) if g in bundle.graphs]
        with OrtCpuRunner(bundle, PORTABLE) as ort:
            ort_outputs = {g: _outputs(ort, prompt, g) for g in graphs}
        main = graphs[0]
        label = f"onnxruntime {main}" + (" (chunked)" if main == PREFILL else " (token by token)")
        checkpoint = checkpoint or Path(bundle.manifest.checkpoint or "")
        if checkpoint and (checkpoint / "config.json").is_file():
            from .torch_runner import TorchRunner

            torch_out = _outputs(TorchRunner(bundle, checkpoint), prompt, main)
            rows.append(polygraphy_compare(label, "PyTorch", ort_outputs[main], torch_out, rtol))
        else:
            rows.append(Row(f"{label} vs PyTorch", "SKIP", note="checkpoint not found; pass --checkpoint DIR"))
        if PREFILL in ort_outputs:
            rows.append(
                polygraphy_compare(
                    "prefill chunked (ort)",
                    "token by token (ort)",
                    ort_outputs[PREFILL],
                    ort_outputs[DECODE],
                    rtol,
                )
            )
        else:
            rows.append(Row("prefill chunked vs token by token", "SKIP", note="single bundle: no prefill graph"))
        if KERNELS in bundle.flavours:  # mambatrt's own ops against the portable graphs
            with OrtCpuRunner(bundle, KERNELS) as runner:
                for graph in graphs:
                    got = _outputs(runner, prompt, graph)
                    rows.append(polygraphy_compare(f"kernels {graph} (ort)", f"portable {graph} (ort)", got,
                                                   ort_outputs[graph], rtol))  # fmt: skip
    reason = tensorrt_runtime_available()
    has_plans = all(bundle.plan(g) for g in bundle.graphs)
    if has_plans and find_tensorrt() is not None:
        check_plans(bundle)  # a plan from another TensorRT flavour or version is an error, not a skip
    if not has_plans:
        rows.append(Row("TensorRT plans vs onnxruntime", "SKIP", note="bundle has no plans (ONNX-only)"))
    elif reason:
        rows.append(Row("TensorRT plans vs onnxruntime", "SKIP", note=reason))
    else:
        from mambatrt.runtime.runners.trt.runner import TrtRunner

        with TrtRunner(bundle) as trt:
            for graph in [g for g in (PREFILL, DECODE) if g in bundle.graphs]:
                got = _outputs(trt, prompt, graph)
                name = f"TensorRT {bundle.plan(graph).file}"
                if ort_outputs is None:
                    rows.append(Row(name, "SKIP", note="no onnxruntime reference for bf16 on CPU"))
                else:
                    rows.append(polygraphy_compare(name, f"onnxruntime {graph}", got, ort_outputs[graph], rtol))
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table."""
    header = ("check", "rtol", "worst rel", "argmax", "result", "note")
    cells = [
        (
            r.check,
            "" if r.rtol is None else f"{r.rtol:.0e}",
            "" if r.worst is None else f"{r.worst:.2e}",
            r.argmax,
            r.status,
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(str(c[i]).ljust(widths[i]) for i in range(len(header))).rstrip() for c in [header, *cells]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
