"""One graph of one flavour from :class:`.model.MambaLM` to ONNX: torch's dynamo exporter, its optimizer passes,
onnx-graphsurgeon's cleanup, metadata, and the checks every written graph passes.

The graph's inputs, outputs and dynamic axes come from its contract (:mod:`mambatrt.contract`); the kernels
flavour's custom ops become mambatrt's nodes (:mod:`.kernel_ops`). Also the greedy picker, written by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import torch

import mambatrt
from mambatrt.contract import (
    BATCH_AXIS,
    DECODE,
    GREEDY,
    KERNELS,
    PORTABLE,
    ROWS_AXIS,
    SCORE,
    GraphContract,
    greedy_contract,
)

from .model import DecodeGraph, MambaLM, PrefillGraph, ScoreGraph
from .scan_rows import BLOCKED
from .weights import refer_to_tensors

OPSET = 20
FORBIDDEN_OPS = ("ScatterND", "ScatterElements", "Loop", "If", "CumSum", "Scan")


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the dynamo exporter's chatter (progress lines, torchvision notices, deprecation warnings)."""
    names = ("torch.onnx", "torch.onnx._internal.exporter._registration", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _examples(model: MambaLM, contract: GraphContract) -> tuple[tuple, tuple | None]:
    """Example inputs (token_ids, [states]) and their dynamic shapes for ``contract``'s graph.

    Examples of 2 rows or sequences (torch.export specializes a dimension of size 1), the batch axis dynamic where
    the contract has it: decode B, a batched prefill B sequences x T rows (2 x 2), else 1 x rows.
    """
    max_batch, max_rows = contract.max_batch, model.max_rows
    if contract.graph == DECODE:
        batch = rows = min(2, max_batch)
        batch_dim = torch.export.Dim(BATCH_AXIS, min=1, max=max_batch) if max_batch > 1 else None
        rows_dim = batch_dim
    elif contract.prefill_batch > 1:
        batch, rows = 2, 4
        rows_dim = torch.export.Dim(ROWS_AXIS, min=1, max=max_rows * contract.prefill_batch)
        batch_dim = torch.export.Dim(BATCH_AXIS, min=1, max=contract.prefill_batch)
    else:
        batch, rows = 1, min(2, max_rows)
        rows_dim = torch.export.Dim(ROWS_AXIS, min=1, max=max_rows) if max_rows > 1 else None
        batch_dim = None
    states = [torch.zeros(spec.concrete_shape(batch=batch)) for spec in contract.inputs[1:]]  # the contract's shapes
    if rows_dim is None:
        return (torch.zeros(rows, dtype=torch.int64), states), None
    # the graphs' forward(token_ids, states): the states one list argument (the graph's inputs are its items); a
    # static input's entry {} rather than None: the exporter names the dynamic axes by walking this structure
    dynamic = ({0: rows_dim}, [{0: batch_dim} if batch_dim is not None else {} for _ in states])
    return (torch.zeros(rows, dtype=torch.int64), states), dynamic


def export_graph(model: MambaLM, contract: GraphContract, flavour: str) -> onnx.ModelProto:
    """torch.onnx.export (dynamo) of ``contract``'s graph in ``flavour``; its initializers that are the model's
    tensors name them rather than hold their bytes (:func:`.weights.refer_to_tensors`; :class:`.weights.WeightsWriter`
    stores them). The kernels flavour's custom ops become mambatrt's nodes."""
    from onnx_ir import serde

    from .kernel_ops import KERNELS_TRANSLATIONS

    graph_module = {DECODE: DecodeGraph, SCORE: ScoreGraph}.get(contract.graph, PrefillGraph)
    example, dynamic = _examples(model, contract)
    translations = {torch.ops.aten.softplus.default: softplus, **(KERNELS_TRANSLATIONS if flavour == KERNELS else {})}
    with _quiet_exporter():
        program = torch.onnx.export(
            graph_module(model, flavour).eval(),
            example,
            dynamo=True,
            input_names=[t.name for t in contract.inputs],
            output_names=[t.name for t in contract.outputs],
            dynamic_shapes=dynamic,
            custom_translation_table=translations,
            opset_version=OPSET,
            optimize=False,
            verbose=False,
        )
        _optimize(program.model)
    refer_to_tensors(program.model, model.state_dict())
    return serde.serialize_model(program.model)


def _optimize(model) -> None:
    """Constant folding, dead-node removal, deduplication and CSE on the exported ``onnx_ir`` model, in place.

    The passes of ``onnxscript.optimizer.optimize_ir`` (what ``torch.onnx.export(optimize=True)`` runs) without its
    pattern rewriter, whose matching grows with the square of the graph size (minutes for 64 layers) and finds
    nothing to rewrite in these graphs.
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import _constant_folding

    fold = _constant_folding.FoldConstantsPass(
        shape_inference=True,
        input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    )
    prune = [common_passes.RemoveUnusedNodesPass(), common_passes.RemoveUnusedFunctionsPass()]
    passes = ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager([fold, *prune, common_passes.RemoveUnusedOpsetsPass()], steps=2, early_stop=True),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )
    passes(model)


def softplus(x, beta: float = 1.0, threshold: float = 20.0):
    """The exporter's translation of ``aten.softplus``: one plain ``Softplus`` node for beta = 1.

    torch's softplus is thresholded (x > threshold gives x); for beta = 1 and threshold 20, softplus(x) - x <
    exp(-20) = 2e-9 there, below float32 rounding of x, so a plain Softplus is equal in float32 and the graph loses
    four nodes per layer. Any other beta keeps torch's formula.
    """
    from onnxscript import opset20 as op

    if beta == 1.0:
        return op.Softplus(x)
    b = op.CastLike(beta, x)
    scaled = op.Mul(x, b)
    return op.Where(op.Greater(scaled, op.CastLike(threshold, x)), x, op.Div(op.Softplus(scaled), b))


def finish_graph(
    proto: onnx.ModelProto, model: MambaLM, contract: GraphContract, flavour: str, precision: str
) -> onnx.ModelProto:
    """The exported graph cleaned (onnx-graphsurgeon: dead nodes and unused initializers dropped, topologically
    sorted; unread optional outputs of onnxruntime's ops unnamed) and stamped with its metadata."""
    import onnx_graphsurgeon as gs

    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    graph = gs.import_onnx(proto)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    cleaned = gs.export_onnx(graph, do_type_check=False)
    cleaned.ir_version = proto.ir_version
    del cleaned.opset_import[:]
    cleaned.opset_import.extend(proto.opset_import)
    if flavour != PORTABLE:
        _drop_unused_outputs(cleaned)
    _stamp(cleaned, model, contract, flavour, precision)
    return cleaned


def _drop_unused_outputs(proto: onnx.ModelProto) -> None:
    """Name no tensor for the optional outputs of com.microsoft nodes that nobody reads (SkipSimplified-
    LayerNormalization's mean and inverse standard deviation), so onnxruntime's kernels need not compute them."""
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        if node.domain == "com.microsoft":
            for k, name in enumerate(node.output):
                if k > 0 and name not in used:
                    node.output[k] = ""
        while node.output and node.output[-1] == "":
            node.output.pop()


def _stamp(proto: onnx.ModelProto, model: MambaLM, contract: GraphContract, flavour: str, precision: str) -> None:
    """Record producer, graph, precision, scan, flavour and the contract in the graph's metadata."""
    proto.producer_name = "mambatrt"
    proto.producer_version = mambatrt.__version__
    scan = "direct" if contract.graph == DECODE else BLOCKED
    meta = {
        "mambatrt.graph": contract.graph,
        "mambatrt.precision": precision,
        "mambatrt.scan": scan if flavour == PORTABLE else flavour,
        "mambatrt.flavour": flavour,
        "mambatrt.max_rows": str(contract.max_rows),
        "mambatrt.max_batch": str(contract.batch),
        "mambatrt.contract": json.dumps(contract.to_dict()),
        "mambatrt.config": json.dumps(model.config.to_dict()),
    }
    del proto.metadata_props[:]
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v


def check_graph(path: Path) -> dict[str, int]:
    """onnx.checker on a written graph, and no operator from FORBIDDEN_OPS; returns op-type counts."""
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    bad = sorted(set(counts) & set(FORBIDDEN_OPS))
    if bad:
        raise RuntimeError(f"{path}: graph contains {bad}, which TensorRT handles poorly; the model code needs fixing")
    return counts


def write_greedy_graph(config, path: Path) -> None:
    """The greedy picker (:func:`mambatrt.contract.greedy_contract`): argmax over the real vocabulary's logits
    (padding columns excluded; ties go to the first index, as numpy's argmax)."""
    from onnx import TensorProto, helper, numpy_helper

    logits, token = greedy_contract(config)
    const = {"starts": [0], "ends": [config.vocab_size], "axes": [1]}
    inits = [numpy_helper.from_array(np.asarray(v, dtype=np.int64), k) for k, v in const.items()]
    nodes = [
        helper.make_node("Slice", [logits.name, "starts", "ends", "axes"], ["real"]),
        helper.make_node("ArgMax", ["real"], [token.name], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        GREEDY,
        [helper.make_tensor_value_info(logits.name, TensorProto.FLOAT, list(logits.shape))],
        [helper.make_tensor_value_info(token.name, TensorProto.INT64, list(token.shape))],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="mambatrt")
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
