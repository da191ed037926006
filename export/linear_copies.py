"""The kernels graphs' copies with mambatrt's MambaLinear in place of their fp32 Gemms, one per provider.

MambaLinear's CUDA kernel runs these products on the tensor cores at fp32 accuracy, faster than cuBLAS's fp32
kernels (the CUDA copies), and its packed AVX-512 CPU kernel runs one thread's launches faster than MLAS (the CPU
copies, with the LM head); without AVX-512 its CPU kernel is a plain loop and MLAS's Gemms spread over several
threads, so the runtime picks a copy or the kernels graph per provider and machine. Without CUTLASS in the op
library only the decode graph's projections gain on CUDA (its own kernel loses to cuBLAS from a few hundred rows on,
and at the head's 50280 rows of W at a batch of 64); with it, the prefill graph's hundreds of rows and the head gain
too (docs/benchmarks.md).
"""

from __future__ import annotations

import onnx

from .kernel_ops import KERNELS_DOMAIN

# the kernels graphs' per-layer Gemms that MambaLinear takes (the LM head's only with ``head``)
LINEAR_WEIGHTS = ("mixer.in_proj.weight", "mixer.x_proj.weight", "mixer.out_proj.weight")


def _replaceable(node: onnx.NodeProto, weights: dict[str, onnx.TensorProto], head: bool) -> bool:
    """Whether ``node`` is ``Gemm(x, w, transB=1)`` without bias or scaling on an fp32 weight MambaLinear takes."""
    if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    weight = weights.get(node.input[1])
    return (
        attrs.get("transA", 0) == 0
        and attrs.get("transB", 0) == 1
        and attrs.get("alpha", 1.0) == 1.0
        and weight is not None
        and weight.data_type == onnx.TensorProto.FLOAT
        and (head or weight.name.endswith(LINEAR_WEIGHTS))
    )


def linear_copy(proto: onnx.ModelProto, head: bool = False) -> onnx.ModelProto | None:
    """A copy of a kernels graph whose fp32 projections (on a weight named in LINEAR_WEIGHTS; with ``head`` every
    such Gemm, the LM head's too) are MambaLinear nodes, or None when it has none (an fp16 model's, a model with
    projection biases). Same inputs, outputs, weights (weights.bin) and metadata, plus ``mambatrt.linear``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    weights = {t.name: t for t in copy.graph.initializer}
    replaced = 0
    for node in copy.graph.node:
        if _replaceable(node, weights, head):
            node.op_type, node.domain = "MambaLinear", KERNELS_DOMAIN
            del node.attribute[:]
            replaced += 1
    if not replaced:
        return None
    entry = copy.metadata_props.add()
    entry.key, entry.value = "mambatrt.linear", f"MambaLinear x {replaced}"
    return copy
