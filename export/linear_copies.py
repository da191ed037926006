"""The kernels graphs' copies with mambatrt's MambaLinear in place of their Gemms, one per provider.

MambaLinear's CUDA kernel runs fp32 products on the tensor cores at fp32 accuracy, faster than cuBLAS's fp32
kernels (the CUDA copies), and its CPU kernels read the weights as the bundle stores them (the CPU copies, with the
LM head): packed strips of fp32 weights with AVX-512, and 16-bit and int8 weights as they are with AVX2
(MambaLinear16, MambaLinearBF16, MambaLinear8), where onnxruntime's CPU provider would multiply fp16 in a slow
fallback, bf16 not at all and int8 as a folded fp32 copy. Without AVX-512 its fp32 kernel loses to MLAS's Gemms
spread over several threads, so the runtime picks a copy or the kernels graph per provider, precision and machine.
Without CUTLASS in the op library only the decode graph's projections gain on CUDA (its own kernel loses to cuBLAS
from a few hundred rows on, and at the head's 50280 rows of W at a batch of 64); with it, the prefill graph's
hundreds of rows and the head gain too (docs/benchmarks.md).
"""

from __future__ import annotations

import onnx

from .kernel_ops import KERNELS_DOMAIN

# the kernels graphs' per-layer Gemms that MambaLinear takes (the LM head's only with ``head``)
LINEAR_WEIGHTS = ("mixer.in_proj.weight", "mixer.x_proj.weight", "mixer.out_proj.weight")
_T = onnx.TensorProto


def _plain_gemm(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is ``Gemm(x, w, transB=1)`` without bias or scaling."""
    if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return attrs.get("transA", 0) == 0 and attrs.get("transB", 0) == 1 and attrs.get("alpha", 1.0) == 1.0


def _int8_weight(name: str, producers: dict, weights: dict) -> tuple[onnx.TensorProto, onnx.TensorProto] | None:
    """(int8 rows, scales) where ``name`` is ``Mul(Cast(int8 rows), scales)`` (:mod:`.quantize`), else None."""
    mul = producers.get(name)
    if mul is None or mul.op_type != "Mul":
        return None
    cast = producers.get(mul.input[0])
    if cast is None or cast.op_type != "Cast" or mul.input[1] not in weights:
        return None
    rows = weights.get(cast.input[0])
    return (rows, weights[mul.input[1]]) if rows is not None and rows.data_type == _T.INT8 else None


def _replacement(node: onnx.NodeProto, producers: dict, weights: dict, head: bool, typed: bool):
    """(op, inputs) of the MambaLinear node that replaces ``node``, or None. ``typed``: fp16 and int8 weights too
    (the CPU's forms of the op)."""
    if not _plain_gemm(node):
        return None
    quantized = _int8_weight(node.input[1], producers, weights) if typed else None
    if quantized is not None:
        rows, scales = quantized
        named = rows.name.endswith(tuple(w + "_q" for w in LINEAR_WEIGHTS))
        return ("MambaLinear8", [node.input[0], rows.name, scales.name]) if head or named else None
    weight = weights.get(node.input[1])
    if weight is None or not (head or weight.name.endswith(LINEAR_WEIGHTS)):
        return None
    if weight.data_type == _T.FLOAT:
        return "MambaLinear", list(node.input)
    if weight.data_type == _T.FLOAT16 and typed:  # an fp16 bundle multiplies float16 rows
        return "MambaLinear16", list(node.input)
    cast = producers.get(node.input[0])
    if weight.data_type == _T.BFLOAT16 and typed and cast is not None and cast.op_type == "Cast":
        return "MambaLinearBF16", [cast.input[0], node.input[1]]  # the float32 rows before their Cast to bfloat16
    return None


def _bf16_output_cast(node: onnx.NodeProto, graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The Cast to float32 that alone reads a bfloat16 product's output (what MambaLinearBF16's float32 y
    replaces), or None."""
    readers = [n for n in graph.node if node.output[0] in n.input]
    if len(readers) != 1 or readers[0].op_type != "Cast":
        return None
    to = {a.name: onnx.helper.get_attribute_value(a) for a in readers[0].attribute}.get("to")
    return readers[0] if to == _T.FLOAT else None


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs is used (the Cast and Mul that dequantized a replaced int8 weight)."""
    while True:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            return
        for n in dead:
            graph.node.remove(n)


def linear_copy(proto: onnx.ModelProto, head: bool = False, cpu: bool = False) -> onnx.ModelProto | None:
    """A copy of a kernels graph whose projections (on a weight named in LINEAR_WEIGHTS; with ``head`` every such
    Gemm, the LM head's too) are MambaLinear nodes, or None when it has none (a model with projection biases).
    fp32 weights everywhere; with ``cpu`` (the CPU provider's copy) fp16 weights too (MambaLinear16), bf16 ones
    (MambaLinearBF16, the Casts around the product gone) and int8 rows with their scales (MambaLinear8). Same
    inputs, outputs, weights (weights.bin) and metadata, plus ``mambatrt.linear``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    weights = {t.name: t for t in copy.graph.initializer}
    producers = {o: n for n in copy.graph.node for o in n.output}
    replaced = 0
    for node in list(copy.graph.node):  # a bf16 product's Cast after it goes on the way
        found = _replacement(node, producers, weights, head, cpu)
        if found is None:
            continue
        if found[0] == "MambaLinearBF16":
            cast = _bf16_output_cast(node, copy.graph)
            if cast is None:
                continue
            node.output[0] = cast.output[0]  # y is float32: the Cast after it goes
            copy.graph.node.remove(cast)
        node.op_type, node.domain = found[0], KERNELS_DOMAIN
        del node.input[:]
        node.input.extend(found[1])
        del node.attribute[:]
        replaced += 1
    if not replaced:
        return None
    _drop_dead_nodes(copy.graph)
    used = {i for n in copy.graph.node for i in n.input}
    kept = [t for t in copy.graph.initializer if t.name in used]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    entry = copy.metadata_props.add()
    entry.key, entry.value = "mambatrt.linear", f"MambaLinear x {replaced}"
    return copy
