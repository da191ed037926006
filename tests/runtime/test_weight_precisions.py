"""16-bit and int8 weights on the CPU: MambaLinear16, MambaLinearBF16 and MambaLinear8 alone (against float64 on
the weights as stored, under each CPU build), and the fp16 and int8 bundles' CPU copies against their portable
graphs (logits, states, greedy tokens)."""

import ctypes
import platform
import subprocess
import sys

import numpy as np
import onnx
import pytest

from mambatrt.contract import DECODE, KERNELS, PORTABLE, PREFILL
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import LINEAR_SHAPES, assert_close

RTOL_FP32_OUT = 1e-5  # float32 sums of products of float32 x and exact weights
RTOL_FP16_OUT = 2e-3  # MambaLinear16 rounds its y to float16


def _typed_weights(w: np.ndarray) -> dict:
    """op -> (weight as stored, its exact float64 value, extra initializers, x and y element type)"""
    import ml_dtypes

    from mambatrt.export.quantize import quantize_rows

    half, bf16 = w.astype(np.float16), w.astype(ml_dtypes.bfloat16)
    import torch

    q, scale = (t.numpy() for t in quantize_rows(torch.from_numpy(w)))
    f, h = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    return {
        "MambaLinear16": (half, half.astype(np.float64), [], h),
        "MambaLinearBF16": (bf16, bf16.astype(np.float64), [], f),
        "MambaLinear8": (q, q.astype(np.float64) * scale.astype(np.float64), [scale], f),
    }


def _session(library: str, op: str, w, extra: list, n: int, k: int, elem: int):
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    names = ["x", "w"] + [f"s{i}" for i in range(len(extra))]
    node = helper.make_node(op, names, ["y"], domain="mambatrt")
    io = [helper.make_tensor_value_info(name, elem, ["rows", d]) for name, d in (("x", k), ("y", n))]
    inits = [numpy_helper.from_array(np.asarray(w), "w")]
    inits += [numpy_helper.from_array(e, f"s{i}") for i, e in enumerate(extra)]
    graph = helper.make_graph([node], "linear", io[:1], io[1:], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("mambatrt", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10  # what onnxruntime 1.31 reads
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def check_typed_linear(library: str, isa: str) -> None:
    """In a process of its own: the library capped at ``isa``, each typed MambaLinear within its tolerance of float64
    at LINEAR_SHAPES and 1, 5, 17 and 64 rows, and a batch's last row equal bit for bit to that row alone."""
    lib = ctypes.CDLL(library)
    lib.mambatrt_ops_cpu_isa.restype = ctypes.c_char_p
    assert lib.mambatrt_ops_cap_cpu_isa(isa.encode()) == 0
    print(f"capped at {isa}: the {lib.mambatrt_ops_cpu_isa().decode()} build runs")
    rng = np.random.default_rng(5)
    for n, k in LINEAR_SHAPES:
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        for op, (stored, exact, extra, elem) in _typed_weights(w).items():
            session = _session(library, op, stored, extra, n, k, elem)
            for m in (1, 5, 17, 64):
                x = rng.standard_normal((m, k)).astype(np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32)
                (y,) = session.run(None, {"x": x})
                rtol = RTOL_FP16_OUT if op == "MambaLinear16" else RTOL_FP32_OUT
                assert_close(f"{op} {isa} {m} x {n} x {k}", y, x.astype(np.float64) @ exact.T, rtol)
                (alone,) = session.run(None, {"x": x[-1:]})
                assert np.array_equal(alone[0], y[-1]), f"{op} {m} x {n} x {k}: the last row differs alone"


@pytest.mark.parametrize("isa", ["sse2", "avx2", "avx512"])
def test_typed_mamba_linear(bundle_factory, isa):
    """MambaLinear16, MambaLinearBF16 and MambaLinear8 under each CPU build (the plain loop of the SSE2 build, the
    AVX2 and AVX-512 strip kernels of the others), each in a process of its own (the cap is the process's)."""
    if platform.machine() not in ("x86_64", "AMD64") and isa != "avx512":
        pytest.skip("one CPU kernels build off x86-64")
    library = str(load_bundle(bundle_factory("tiny-odd", "split", plans="none")).kernels_library)
    script = "import sys; from tests.runtime.test_weight_precisions import check_typed_linear as f; f(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", script, library, isa], capture_output=True, text=True)
    print(done.stdout[-3000:], done.stderr[-2000:])
    assert done.returncode == 0 and "worst relative difference" in done.stdout


def check_strips_equal(library: str) -> None:
    """In a process of its own: every MambaLinear form at LINEAR_SHAPES and 1, 3, 7, 17 and 64 rows gives the same
    bits on the AVX-512 build's strips as on the AVX2 build's (the cap moved between runs of one session: both take
    the node's one packed copy of the weight)."""
    lib = ctypes.CDLL(library)
    rng = np.random.default_rng(6)
    for n, k in LINEAR_SHAPES:
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        forms = {**_typed_weights(w), "MambaLinear": (w, None, [], onnx.TensorProto.FLOAT)}
        for op, (stored, _, extra, elem) in forms.items():
            session = _session(library, op, stored, extra, n, k, elem)
            for m in (1, 3, 7, 17, 64):
                x = rng.standard_normal((m, k)).astype(np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32)
                got = {}
                for isa in ("avx512", "avx2"):
                    assert lib.mambatrt_ops_cap_cpu_isa(isa.encode()) == 0
                    (got[isa],) = session.run(None, {"x": x})
                lib.mambatrt_ops_cap_cpu_isa(b"avx512")
                worst = np.abs(got["avx512"].astype(np.float64) - got["avx2"]).max()
                print(f"{op} {m} x {n} x {k}: worst difference AVX-512 against AVX2 strips {worst}")
                assert np.array_equal(got["avx512"], got["avx2"]), f"{op} {m} x {n} x {k}: AVX-512 strips differ"


def test_avx512_strips_equal_avx2_strips(bundle_factory):
    """The AVX-512 strip kernel sums each output in the AVX2 strips' FMA chain, so each weight type's products have
    the AVX2 build's bits (run where the CPU has AVX-512)."""
    library = str(load_bundle(bundle_factory("tiny-odd", "split", plans="none")).kernels_library)
    lib = ctypes.CDLL(library)
    lib.mambatrt_ops_cpu_isa.restype = ctypes.c_char_p
    if lib.mambatrt_ops_cpu_isa() != b"avx512":
        pytest.skip("no AVX-512 build on this CPU")
    script = "import sys; from tests.runtime.test_weight_precisions import check_strips_equal as f; f(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", script, library], capture_output=True, text=True)
    print(done.stdout[-3000:], done.stderr[-2000:])
    assert done.returncode == 0 and "worst difference AVX-512 against AVX2 strips 0.0" in done.stdout


def _logits_and_tokens(bundle, flavour: str, prompt: np.ndarray, steps: int):
    """Prefill of ``prompt`` then ``steps`` greedy decode steps on one CPU runner: every launch's logits, the
    final states and the greedy tokens."""
    with OrtCpuRunner(bundle, flavour) as runner:
        logits = [runner.run(PREFILL, prompt).reshape(-1).copy()]
        tokens = []
        for _ in range(steps):
            tokens.append(int(np.argmax(logits[-1][: bundle.config.vocab_size])))
            logits.append(runner.run(DECODE, np.array([tokens[-1]])).reshape(-1).copy())
        conv, ssm = runner.get_state()
        return np.array(logits), conv.copy(), ssm.copy(), tokens, runner.cpu_linear


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_cpu_copies_of_16_bit_and_int8_bundles(bundle_factory, precision):
    """An fp16 bundle's CPU copies take its float16 products as MambaLinear16 and an int8 bundle's its int8 rows as
    MambaLinear8 (each layer's in and out projections and the LM head; x_proj stays fp32 MambaLinear), with no
    Gemm left; the int8 weights are stored once, as int8. Where a strip kernel of the library runs (AVX-512 or
    AVX2), a CPU runner of the kernels graphs runs the copies, and their logits and states equal the portable graphs'
    within the precision's tolerance, with the same greedy tokens."""
    from mambatrt.runtime.runners.ort.loader import _cpu_linear_library

    bundle = load_bundle(bundle_factory("tiny-wide", "split", precision=precision, plans="none"))
    c = bundle.config
    typed = "MambaLinear16" if precision == "fp16" else "MambaLinear8"
    for graph in (DECODE, PREFILL):
        proto = onnx.load(str(bundle.graph_path(graph, KERNELS, cpu=True)), load_external_data=False)
        ops = [n.op_type for n in proto.graph.node]
        print(graph, {op: ops.count(op) for op in set(ops)})
        assert ops.count(typed) == 2 * c.n_layer + 1 and ops.count("MambaLinear") == c.n_layer
        assert "Gemm" not in ops
        if precision == "int8":
            kinds = {t.name: t.data_type for t in proto.graph.initializer}
            assert all(kinds[n.input[1]] == onnx.TensorProto.INT8 for n in proto.graph.node if n.op_type == typed)
    rows = _cpu_linear_library(str(bundle.kernels_library), "mambatrt_ops_cpu_linear_rows")
    prompt = np.random.default_rng(2).integers(0, c.vocab_size, 37).astype(np.int64)
    want = _logits_and_tokens(bundle, PORTABLE, prompt, 8)
    got = _logits_and_tokens(bundle, KERNELS, prompt, 8)
    print("the CPU copies run:", got[4], "strip kernel:", rows)
    assert all(got[4].values()) == rows
    rtol = 2e-2 if precision == "fp16" else 1e-5
    for what, a, b in zip(("logits", "conv", "ssm"), got[:3], want[:3], strict=True):
        assert_close(f"{precision} kernels-cpu {what}", a, b, rtol)
    assert got[3] == want[3], f"greedy tokens {got[3]} != {want[3]}"


def test_bf16_bundle_runs_on_the_cpu_copies(bundle_factory):
    """onnxruntime's CPU provider has no bf16 product: a bf16 bundle's CPU copies take its products as
    MambaLinearBF16 on the float32 rows (no Cast to bfloat16 around them, no Gemm left), and where the strip kernel
    runs a CPU runner runs them: logits within 5e-2 of the fp32 bundle's portable graphs (bfloat16 keeps 8 bits of
    the weights), the first greedy token the same; elsewhere the runner refuses the bundle in one line."""
    from mambatrt.errors import BundleError
    from mambatrt.runtime.runners.ort.loader import _cpu_linear_library

    bundle = load_bundle(bundle_factory("tiny-wide", "split", precision="bf16", plans="none"))
    c = bundle.config
    for graph in (DECODE, PREFILL):
        proto = onnx.load(str(bundle.graph_path(graph, KERNELS, cpu=True)), load_external_data=False)
        ops = [n.op_type for n in proto.graph.node]
        print(graph, {op: ops.count(op) for op in set(ops)})
        assert ops.count("MambaLinearBF16") == 2 * c.n_layer + 1 and "Gemm" not in ops
    if not _cpu_linear_library(str(bundle.kernels_library), "mambatrt_ops_cpu_linear_rows"):
        with pytest.raises(BundleError, match="no bf16 matrix products"):
            OrtCpuRunner(bundle, KERNELS)
        pytest.skip("no AVX2 strip kernel here: the bf16 bundle is refused on the CPU")
    fp32 = load_bundle(bundle_factory("tiny-wide", "split", plans="none"))
    prompt = np.random.default_rng(2).integers(0, c.vocab_size, 37).astype(np.int64)
    want = _logits_and_tokens(fp32, PORTABLE, prompt, 4)
    got = _logits_and_tokens(bundle, KERNELS, prompt, 4)
    assert_close("bf16 kernels-cpu logits", got[0], want[0], 5e-2)
    assert got[3][0] == want[3][0], f"first greedy token {got[3][0]} != {want[3][0]}"
