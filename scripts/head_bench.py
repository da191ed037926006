"""The language-model head's two ONNX forms on onnxruntime, timed: one Gemm (transB) on the [V, D] weight as stored,
against w @ h^T between two Transposes (what the graphs exported before session 14; onnxruntime fuses it into
FusedMatMul on the CPU). The same math; the question is which form the providers run faster at serving batch sizes.

Usage: python scripts/head_bench.py [cpu|cuda] [V D] (default cuda, mamba-130m's 50280 x 768; fp32, TF32 off,
CUDA graphs captured on cuda). Prints ms per launch (min over repeats) per form and batch.
"""

import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

BATCHES = (1, 8, 16, 32, 64, 128)


def session(form: str, vocab: int, d: int, device: str):
    weight = numpy_helper.from_array((np.random.default_rng(0).random((vocab, d), np.float32) - 0.5), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", vocab])
    if form == "gemm":
        nodes = [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)]
    else:
        nodes = [
            helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
            helper.make_node("MatMul", ["w", "xt"], ["m"]),
            helper.make_node("Transpose", ["m"], ["y"], perm=[1, 0]),
        ]
    model = helper.make_model(
        helper.make_graph(nodes, form, [x], [y], [weight]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 10  # what onnxruntime 1.31 reads (a newer onnx writes a newer IR)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if device == "cpu":
        opts.intra_op_num_threads = 1
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    cuda = {"use_tf32": "0", "enable_cuda_graph": "1"}
    return ort.InferenceSession(model.SerializeToString(), opts, providers=[("CUDAExecutionProvider", cuda)])


def time_form(form: str, vocab: int, d: int, device: str, batch: int) -> float:
    sess = session(form, vocab, d, device)  # one session per batch: a captured graph has one shape
    x = np.random.default_rng(batch).random((batch, d), np.float32)
    if device == "cpu":
        run = lambda: sess.run(None, {"x": x})  # noqa: E731
    else:
        binding = sess.io_binding()
        binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
        binding.bind_ortvalue_output(
            "y", ort.OrtValue.ortvalue_from_shape_and_type([batch, vocab], np.float32, "cuda", 0)
        )

        def run():
            sess.run_with_iobinding(binding)
            binding.synchronize_outputs()

    for _ in range(5):
        run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            run()
        best = min(best, (time.perf_counter() - start) / 20)
    return best * 1e3


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    vocab, d = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (50280, 768)
    print(f"head [{vocab}, {d}] fp32 on {device}: ms per launch (min of 5 x 20)")
    print("batch | gemm (transB) | w @ h^T")
    for batch in BATCHES:
        gemm, wht = (time_form(form, vocab, d, device, batch) for form in ("gemm", "wht"))
        print(f"{batch:5d} | {gemm:13.4f} | {wht:7.4f}")


if __name__ == "__main__":
    main()
