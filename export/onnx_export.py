"""Export :class:`MambaLM` to ``decode.onnx`` and ``prefill.onnx`` sharing one external weights file.

What is written into the output directory:

    decode.onnx    token_ids [batch] -> logits [batch, Vp], conv_state_out, ssm_state_out; batch in 1..max_batch
    prefill.onnx   token_ids [rows]  -> logits [1, Vp], the states of one sequence; rows in 1..max_rows
    *.fused.onnx, *.kernels.onnx   the same graphs through fused ops; their prefill takes B sequences of T rows
                   each (token_ids [B x T], states and logits [B, ..]), B in 1..max_prefill_batch
    weights.bin    every initializer of both graphs above 1 KiB, each stored once (content-deduplicated)

The I/O names, dtypes and dynamic axes come from :mod:`mambatrt.contract`. The exporter is torch's dynamo
ONNX exporter with its optimizer (constant folding, dead code removal); then onnx-graphsurgeon cleans the graph,
the result is checked with ``onnx.checker`` and against a list of operators TensorRT handles poorly.
The write is atomic: files appear in the output directory only when both graphs and the weights are complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx.external_data_helper import ExternalDataInfo

import mambatrt
from mambatrt.contract import (
    BATCH_AXIS,
    DECODE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_PREFILL_BATCH,
    FLAVOURS,
    FUSED,
    GRAPHS,
    GREEDY,
    GREEDY_FILE,
    KERNELS,
    PORTABLE,
    PREFILL,
    ROWS_AXIS,
    GraphContract,
    cpu_graph_file,
    cuda_graph_file,
    graph_contract,
    graph_file,
    greedy_contract,
    kernels_unsupported,
)
from mambatrt.errors import InputError, raise_if_signalled
from mambatrt.export.checkpoint import load_model
from mambatrt.export.model import DecodeGraph, MambaLM, PrefillGraph, precision_dtype
from mambatrt.export.scans import DEFAULT_SCAN, SCANS
from mambatrt.paths import EXPORT_STAGE_PREFIX, check_output_folder, remove_dead_stages

WEIGHTS_FILE = "weights.bin"
OPSET = 20
EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay inside the graph
ALIGN = 64  # byte alignment of every tensor in the weights file
FORBIDDEN_OPS = ("ScatterND", "ScatterElements", "Loop", "If", "CumSum", "Scan")


@dataclass
class ExportResult:
    """What :func:`export_onnx` wrote and how long it took."""

    out_dir: Path
    graphs: dict[str, Path]
    weights_file: Path
    weights_bytes: int  # size of weights.bin
    param_bytes: int  # bytes of the model's parameters at the export precision
    node_counts: dict[str, int]
    seconds: float
    op_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    flavoured: dict[str, dict[str, Path]] = field(default_factory=dict)  # flavour -> graph -> file, beside portable
    cuda_graphs: dict[str, Path] = field(default_factory=dict)  # graph -> the kernels graph's CUDA copy
    cpu_graphs: dict[str, Path] = field(default_factory=dict)  # graph -> the kernels graph's CPU copy

    @property
    def onnx_bytes(self) -> int:
        """Bytes of everything written: the graphs of every flavour plus the weights file."""
        files = list(self.graphs.values()) + [p for paths in self.flavoured.values() for p in paths.values()]
        files += list(self.cuda_graphs.values()) + list(self.cpu_graphs.values())
        return self.weights_bytes + sum(p.stat().st_size for p in files)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the dynamo exporter's chatter (progress lines, torchvision notices, deprecation warnings)."""
    loggers = [
        logging.getLogger(n) for n in ("torch.onnx", "torch.onnx._internal.exporter._registration", "onnxscript")
    ]
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


def _flavour_contract(
    model: MambaLM, graph: str, max_batch: int, flavour: str, prefill_batch: int, layered: bool
) -> GraphContract:
    """The contract a graph of ``flavour`` is exported to: the portable graphs' prefill takes one sequence, and only
    the kernels graphs take layered states (when ``layered``)."""
    prefill_batch = prefill_batch if flavour != PORTABLE else 1
    return graph_contract(model.config, graph, model.max_rows, max_batch, prefill_batch, layered and flavour == KERNELS)


def _export_graph(model: MambaLM, contract: GraphContract, flavour: str, scan: str, path: Path) -> None:
    """torch.onnx.export (dynamo) of one graph of one flavour to ``path`` (+ its own external data file, merged
    later), to ``contract`` (:func:`_flavour_contract`: its batch axes, and whether the states are layered). The
    "fused" flavour's custom ops become onnxruntime's com.microsoft nodes, the "kernels" flavour's mambatrt's own
    (:mod:`fused_ops`)."""
    graph, max_batch, prefill_batch = contract.graph, contract.max_batch, contract.prefill_batch
    layered = contract.layered
    # examples of 2 rows or sequences (torch.export specializes a dimension of size 1), with the batch axis
    # dynamic where the contract has it: decode B, batched prefill B sequences x T rows (2 x 2), else 1 x rows
    if graph == DECODE:
        module = DecodeGraph(model, flavour, layered).eval()
        batch, rows = min(2, max_batch), min(2, max_batch)
        batch_dim = torch.export.Dim(BATCH_AXIS, min=1, max=max_batch) if max_batch > 1 else None
        rows_dim = batch_dim
    else:
        module = PrefillGraph(model, scan, flavour, layered).eval()
        if prefill_batch > 1:
            batch, rows = 2, 4
            rows_dim = torch.export.Dim(ROWS_AXIS, min=1, max=model.max_rows * prefill_batch)
            batch_dim = torch.export.Dim(BATCH_AXIS, min=1, max=prefill_batch)
        else:
            batch, rows = 1, min(2, model.max_rows)
            rows_dim = torch.export.Dim(ROWS_AXIS, min=1, max=model.max_rows) if model.max_rows > 1 else None
            batch_dim = None
    example, dynamic = [torch.zeros(rows, dtype=torch.int64)], [{0: rows_dim} if rows_dim is not None else None]
    for spec in contract.inputs[1:]:  # the states: zeros of the contract's shape
        example.append(torch.zeros(spec.concrete_shape(batch=batch)))
        dynamic.append({0: batch_dim} if batch_dim is not None else None)
    # the graphs' forward(token_ids, states): the states one list argument (the graph's inputs are its items)
    example = (example[0], example[1:])
    # (a static input's entry {} rather than None: the exporter names the dynamic axes by walking this structure)
    dynamic = (dynamic[0], [d or {} for d in dynamic[1:]]) if dynamic[0] is not None else None
    translations = {}
    if flavour == FUSED:
        from mambatrt.export.fused_ops import FUSED_TRANSLATIONS as translations
    elif flavour == KERNELS:
        from mambatrt.export.fused_ops import KERNELS_TRANSLATIONS as translations
    with _quiet_exporter():
        program = torch.onnx.export(
            module,
            example,
            dynamo=True,
            input_names=[t.name for t in contract.inputs],
            output_names=[t.name for t in contract.outputs],
            dynamic_shapes=dynamic,
            custom_translation_table={torch.ops.aten.softplus.default: _softplus, **translations},
            opset_version=OPSET,
            optimize=False,
            verbose=False,
        )
        _optimize(program.model)
        program.save(str(path), external_data=True)


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


def _optimize(model) -> None:
    """Constant folding, dead-node removal, deduplication and CSE on the exported ``onnx_ir`` model, in place.

    The passes of ``onnxscript.optimizer.optimize_ir`` (what ``torch.onnx.export(optimize=True)`` runs) without its
    pattern rewriter, whose matching grows with the square of the graph size (minutes for 64 layers) and finds
    nothing to rewrite in these graphs.
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import _constant_folding

    passes = ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                ),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )
    passes(model)


def _initializer_bytes(tensor: onnx.TensorProto, base_dir: Path) -> bytes:
    """The raw little-endian bytes of an initializer, wherever they are stored."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = ExternalDataInfo(tensor)
        with open(base_dir / info.location, "rb") as f:
            f.seek(info.offset or 0)
            return f.read(info.length) if info.length else f.read()
    return onnx.numpy_helper.to_array(tensor).tobytes() if not tensor.raw_data else tensor.raw_data


def _softplus(x, beta: float = 1.0, threshold: float = 20.0):
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


def _clean(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx-graphsurgeon: drop dead nodes and unused initializers, topologically sort."""
    import onnx_graphsurgeon as gs

    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    graph = gs.import_onnx(model)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    cleaned = gs.export_onnx(graph, do_type_check=False)
    cleaned.ir_version = model.ir_version
    del cleaned.opset_import[:]
    cleaned.opset_import.extend(model.opset_import)
    return cleaned


class _WeightsWriter:
    """Appends initializer bytes to one file, once per distinct content, and points tensors at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")
        self.offsets: dict[tuple, tuple[int, int]] = {}

    def externalize(self, tensor: onnx.TensorProto, data: bytes) -> None:
        """Store ``data`` (deduplicated by content and dtype: graphs may view the same bytes in other shapes, as the
        flavours do the conv weights) and make ``tensor`` refer to it."""
        key = (hashlib.sha256(data).hexdigest(), tensor.data_type)
        if key not in self.offsets:
            pos = self.file.tell()
            pad = (-pos) % ALIGN
            self.file.write(b"\0" * pad)
            self.offsets[key] = (pos + pad, len(data))
            self.file.write(data)
        offset, length = self.offsets[key]
        tensor.ClearField("raw_data")
        for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(name)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = k, v

    def close(self) -> int:
        """Close the file; returns its size."""
        self.file.close()
        return self.path.stat().st_size


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


def export_model(
    model: MambaLM,
    out_dir: str | Path,
    graphs: tuple[str, ...] = GRAPHS,
    precision: str = "fp32",
    scan: str = DEFAULT_SCAN,
    progress: bool = True,
    max_batch: int = DEFAULT_MAX_BATCH,
    flavours: tuple[str, ...] = FLAVOURS[1:],
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    layered: bool = True,
    cuda_linear: str = "",
    cpu_linear: bool = False,
) -> ExportResult:
    """Export an already loaded model's graphs into ``out_dir`` (created; existing graph files are replaced).

    ``max_batch``: the decode graph's largest batch of sequences (its batch axis runs 1..max_batch).
    ``max_prefill_batch``: the same for the fused and kernels prefill graphs (the portable one takes one sequence).
    ``flavours``: the flavours exported beside the portable graphs ("fused": onnxruntime's Mamba ops, "kernels":
    mambatrt's, for models within the kernels' limits); all share weights.bin.
    ``layered``: the kernels graphs take each layer's states (bundle schema 4; False: stacked, schema 3).
    ``cuda_linear``: also write CUDA copies of the kernels graphs (:func:`cuda_linear_graph`; the op library must have
    its CUDA kernels) when the model has fp32 projections: "decode" the decode graph's, its layers' projections as
    MambaLinear; "all" (a library with CUTLASS's GEMMs) the decode and prefill graphs', the LM head too.
    ``cpu_linear``: also write the kernels graphs' CPU copies (every fp32 product, the LM head's too, as
    MambaLinear, whose packed AVX-512 kernel beats MLAS's Gemm on one thread at a decode launch's rows and matches
    or beats it at a prefill launch's: BENCHMARKS.md, session 31).
    """
    from tqdm import tqdm

    check_export_args(precision, model.max_rows, graphs, scan, max_batch, max_prefill_batch)
    if cuda_linear not in ("", "decode", "all"):
        raise ValueError(f"cuda_linear must be '', 'decode' or 'all', not {cuda_linear!r}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if KERNELS in flavours and kernels_unsupported(model.config):
        flavours = tuple(f for f in flavours if f != KERNELS)
    jobs = [(g, f) for f in (PORTABLE, *flavours) for g in graphs]
    contracts = {(g, f): _flavour_contract(model, g, max_batch, f, max_prefill_batch, layered) for g, f in jobs}
    steps = tqdm(total=2 * len(jobs) + 1, desc="export", unit="step", disable=not progress, leave=False)
    remove_dead_stages(out_dir.parent, EXPORT_STAGE_PREFIX)  # left by exports that were killed
    stage = Path(tempfile.mkdtemp(prefix=f"{EXPORT_STAGE_PREFIX}{os.getpid()}-", dir=out_dir.parent))
    try:
        raw_dir = stage / "raw"
        raw_dir.mkdir()
        protos = {}
        for g, flavour in jobs:
            name = graph_file(g, flavour)
            steps.set_postfix_str(f"torch.onnx.export {name}")
            _export_graph(model, contracts[g, flavour], flavour, scan, raw_dir / name)
            protos[g, flavour] = onnx.load(str(raw_dir / name), load_external_data=False)
            steps.update()
        steps.set_postfix_str(f"writing {WEIGHTS_FILE}")
        final = stage / "final"
        final.mkdir()
        writer = _WeightsWriter(final / WEIGHTS_FILE)
        try:
            for job in jobs:
                for tensor in protos[job].graph.initializer:
                    data = _initializer_bytes(tensor, raw_dir)
                    if len(data) >= EXTERNAL_MIN_BYTES:
                        writer.externalize(tensor, data)
                    elif tensor.data_location == onnx.TensorProto.EXTERNAL:
                        del tensor.external_data[:]
                        tensor.data_location = onnx.TensorProto.DEFAULT
                        tensor.raw_data = data
        finally:
            weights_bytes = writer.close()
        steps.update()
        paths, flavoured, cuda_graphs, cpu_graphs, node_counts, op_counts = {}, {}, {}, {}, {}, {}
        for g, flavour in jobs:
            name = graph_file(g, flavour)
            steps.set_postfix_str(f"checking {name}")
            model_proto = _clean(protos[g, flavour])
            if flavour != PORTABLE:
                _drop_unused_outputs(model_proto)
            _stamp(model_proto, model, contracts[g, flavour], flavour, precision, scan)
            path = final / name
            onnx.save(model_proto, str(path))
            key = g if flavour == PORTABLE else f"{g}.{flavour}"
            op_counts[key] = check_graph(path)
            node_counts[key] = sum(op_counts[key].values())
            (paths if flavour == PORTABLE else flavoured.setdefault(flavour, {}))[g] = out_dir / path.name
            copies = (  # the kernels graph's copies with MambaLinear: provider, wanted, with the head, file, written
                ("cuda", cuda_linear == "all" or (cuda_linear == "decode" and g == DECODE), cuda_linear == "all",
                 cuda_graph_file, cuda_graphs),
                ("cpu", cpu_linear, True, cpu_graph_file, cpu_graphs),
            ) if flavour == KERNELS else ()  # fmt: skip
            made = {}  # head -> the copy (the CUDA copy with the head is the CPU copy's twin: made once)
            for provider, wanted, head, file_of, written in copies:
                if wanted and head not in made:
                    made[head] = cuda_linear_graph(model_proto, head=head)
                if not wanted or made[head] is None:
                    continue
                path = final / file_of(g)
                onnx.save(made[head], str(path))
                op_counts[f"{g}.{KERNELS}-{provider}"] = check_graph(path)
                written[g] = out_dir / path.name
            steps.update()
        write_greedy_graph(model.config, final / GREEDY_FILE)
        raise_if_signalled()  # a signal whose KeyboardInterrupt torch's imports swallowed: nothing moves into out_dir
        out_dir.mkdir(exist_ok=True)
        for item in final.iterdir():
            os.replace(item, out_dir / item.name)
    finally:
        steps.close()
        shutil.rmtree(stage, ignore_errors=True)
    return ExportResult(
        out_dir=out_dir,
        graphs=paths,
        weights_file=out_dir / WEIGHTS_FILE,
        weights_bytes=weights_bytes,
        param_bytes=param_bytes,
        node_counts=node_counts,
        seconds=time.perf_counter() - start,
        op_counts=op_counts,
        flavoured=flavoured,
        cuda_graphs=cuda_graphs,
        cpu_graphs=cpu_graphs,
    )


# the kernels graphs' per-layer Gemms that MambaLinear takes in their CUDA copies (the LM head only with ``head``)
CUDA_LINEAR_WEIGHTS = ("mixer.in_proj.weight", "mixer.x_proj.weight", "mixer.out_proj.weight")


def cuda_linear_graph(proto: onnx.ModelProto, head: bool = False) -> onnx.ModelProto | None:
    """A copy of a kernels graph whose fp32 projections (``Gemm(x, w, transB=1)`` without bias on a weight named in
    CUDA_LINEAR_WEIGHTS; with ``head`` every such Gemm, the LM head's too) are mambatrt's MambaLinear, or None when it
    has none (an fp16 model's, a model with projection biases). Why copies: MambaLinear's CUDA kernel runs these
    products on the tensor cores at fp32 accuracy, faster than cuBLAS's fp32 kernels (the CUDA copies), and its
    packed AVX-512 CPU kernel one thread's launches faster than MLAS (the CPU copies, ``head``);
    without AVX-512 its CPU kernel is a plain loop and MLAS's Gemms spread over several threads, so the runtime picks
    a copy or the kernels graph per provider and machine. Without CUTLASS in the op library only the decode graph's
    projections gain on CUDA (its own kernel loses to cuBLAS from a few hundred rows on, and at the head's 50280
    rows of W at a batch of 64); with it, the prefill graph's hundreds of rows and the head gain too
    (BENCHMARKS.md). Same inputs, outputs, weights (weights.bin) and metadata (plus ``mambatrt.linear``)."""
    from mambatrt.export.fused_ops import KERNELS_DOMAIN

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    weights = {t.name: t for t in copy.graph.initializer}
    replaced = 0
    for node in copy.graph.node:
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        weight = weights.get(node.input[1])
        if (
            attrs.get("transA", 0) != 0
            or attrs.get("transB", 0) != 1
            or attrs.get("alpha", 1.0) != 1.0
            or weight is None
            or weight.data_type != onnx.TensorProto.FLOAT
            or not (head or weight.name.endswith(CUDA_LINEAR_WEIGHTS))
        ):
            continue
        node.op_type, node.domain = "MambaLinear", KERNELS_DOMAIN
        del node.attribute[:]
        replaced += 1
    if not replaced:
        return None
    entry = copy.metadata_props.add()
    entry.key, entry.value = "mambatrt.linear", f"MambaLinear x {replaced}"
    return copy


def _stamp(
    model_proto: onnx.ModelProto, model: MambaLM, contract: GraphContract, flavour: str, precision: str, scan: str
) -> None:
    """Record producer, opset, flavour and the contract in the graph's metadata."""
    model_proto.producer_name = "mambatrt"
    model_proto.producer_version = mambatrt.__version__
    graph = contract.graph
    meta = {
        "mambatrt.graph": graph,
        "mambatrt.precision": precision,
        "mambatrt.scan": flavour if flavour != PORTABLE else scan if graph == PREFILL else "direct",
        "mambatrt.flavour": flavour,
        "mambatrt.max_rows": str(contract.max_rows),
        "mambatrt.max_batch": str(contract.batch),
        "mambatrt.contract": json.dumps(contract.to_dict()),
        "mambatrt.config": json.dumps(model.config.to_dict()),
    }
    del model_proto.metadata_props[:]
    for k, v in meta.items():
        entry = model_proto.metadata_props.add()
        entry.key, entry.value = k, v


def check_export_args(
    precision: str,
    max_rows: int,
    graphs: tuple[str, ...] = GRAPHS,
    scan: str = DEFAULT_SCAN,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
) -> None:
    """Refuse an unknown precision, graph or scan, or row and batch limits outside 1..4096, before any work."""
    precision_dtype(precision)
    if not 1 <= max_rows <= 4096:
        raise InputError(f"--max-rows must be in 1..4096, got {max_rows}")
    if not 1 <= max_batch <= 4096:
        raise InputError(f"--max-batch must be in 1..4096, got {max_batch}")
    if not 1 <= max_prefill_batch <= 4096:
        raise InputError(f"--max-prefill-batch must be in 1..4096, got {max_prefill_batch}")
    for g in graphs:
        if g not in GRAPHS:
            raise InputError(f"unknown graph '{g}'; choose from {', '.join(GRAPHS)}")
    if not graphs:
        raise InputError(f"no graph to export; choose from {', '.join(GRAPHS)}")
    if scan not in SCANS:
        raise InputError(f"unknown prefill scan '{scan}'; choose from {', '.join(SCANS)}")


def export_onnx(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    precision: str = "fp32",
    max_rows: int = 64,
    graphs: tuple[str, ...] = GRAPHS,
    scan: str = DEFAULT_SCAN,
    progress: bool = True,
    max_batch: int = DEFAULT_MAX_BATCH,
    flavours: tuple[str, ...] = FLAVOURS[1:],
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    layered: bool = True,
    cuda_linear: str = "",
    cpu_linear: bool = False,
) -> ExportResult:
    """Load a checkpoint and export its graphs (see the module docstring) into ``out_dir``."""
    check_export_args(precision, max_rows, graphs, scan, max_batch, max_prefill_batch)
    check_output_folder(out_dir)
    model = load_model(checkpoint_dir, precision=precision, max_rows=max_rows)
    return export_model(
        model,
        out_dir,
        graphs,
        precision,
        scan,
        progress,
        max_batch,
        flavours,
        max_prefill_batch,
        layered,
        cuda_linear,
        cpu_linear,
    )
