"""onnxruntime's MLAS on a decode launch's chain of products: 24 x (in_proj 3072 x 768, the x half into out_proj
768 x 1536) as Gemm(transB=1) with distinct weights, then the LM head 50280 x 768, one intra-op thread (or THREADS),
ms per chain per batch (median of REPS). With a kernels library (LIBRARY, built by `mambatrt bundle` or g++ from
compile/kernels/mamba_ops.cc) the same chain with mambatrt's MambaLinear in place of the Gemms too, run in turn with
the Gemms' at each batch, and the worst difference between the two chains' outputs. ROWS=1,16,... picks the batches.

    taskset -c 0 .venv/bin/python scripts/cpu_linear_bench.py [REPS] [LIBRARY]
"""

import os
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

L, D, E, V = 24, 768, 1536, 50280
ROWS = tuple(int(r) for r in os.environ.get("ROWS", "1,2,4,8,12,16,24,32,64").split(","))


def graph(head: bool, op: str = "Gemm") -> bytes:
    rng = np.random.default_rng(1)
    inits, nodes = [], []
    cur = "x"
    layers = 0 if head else L
    for i in range(layers):
        w_in = (0.1 * (rng.random((2 * E, D), dtype=np.float32) - 0.5)).astype(np.float32)
        w_out = (0.1 * (rng.random((D, E), dtype=np.float32) - 0.5)).astype(np.float32)
        inits += [numpy_helper.from_array(w_in, f"in{i}"), numpy_helper.from_array(w_out, f"out{i}")]
        nodes.append(linear(op, [cur, f"in{i}"], f"xz{i}"))
        nodes.append(helper.make_node("Slice", [f"xz{i}", "s0", "s1", "ax"], [f"xs{i}"]))
        nodes.append(linear(op, [f"xs{i}", f"out{i}"], f"h{i}"))
        cur = f"h{i}"
    if head:
        w = (0.1 * (rng.random((V, D), dtype=np.float32) - 0.5)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, "head"))
        nodes.append(linear(op, [cur, "head"], "y"))
    else:
        nodes.append(helper.make_node("Identity", [cur], ["y"]))
    inits += [
        numpy_helper.from_array(np.array([0], np.int64), "s0"),
        numpy_helper.from_array(np.array([E], np.int64), "s1"),
        numpy_helper.from_array(np.array([1], np.int64), "ax"),
    ]
    g = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("mambatrt", 1)]
    return helper.make_model(g, opset_imports=opsets).SerializeToString()


def linear(op: str, inputs: list[str], out: str):
    if op == "Gemm":
        return helper.make_node("Gemm", inputs, [out], transB=1)
    return helper.make_node("MambaLinear", inputs, [out], domain="mambatrt")


def sessions(op: str, library: str | None):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(os.environ.get("THREADS", "1"))
    opts.inter_op_num_threads = 1
    if library:
        opts.register_custom_ops_library(library)
    cpu = ["CPUExecutionProvider"]
    return tuple(ort.InferenceSession(graph(head, op), opts, providers=cpu) for head in (False, True))


def timed(chain, head, x, reps: int) -> tuple[float, float, np.ndarray]:
    t, th = [], []
    for _ in range(reps):
        a = time.perf_counter()
        h = chain.run(None, {"x": x})[0]
        b = time.perf_counter()
        y = head.run(None, {"x": h})[0]
        c = time.perf_counter()
        t.append((b - a) * 1e3)
        th.append((c - b) * 1e3)
    return float(np.median(t)), float(np.median(th)), y


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    library = sys.argv[2] if len(sys.argv) > 2 else None
    kinds = {"Gemm": sessions("Gemm", None)}
    if library:
        kinds["MambaLinear"] = sessions("MambaLinear", library)
    print("rows  " + "  ".join(f"{k} chain / head / sum ms" for k in kinds) + ("  worst rel diff" if library else ""))
    for m in ROWS:
        x = np.random.default_rng(m).random((m, D), dtype=np.float32) - 0.5
        cells, outs = [], []
        for chain, head in kinds.values():
            t, th, y = timed(chain, head, x, reps)
            cells.append(f"{t:8.2f} / {th:6.2f} / {t + th:8.2f}")
            outs.append(y)
        diff = ""
        if library:
            worst = float(np.max(np.abs(outs[0] - outs[1])) / np.max(np.abs(outs[0])))
            diff = f"  {worst:.2e}"
        print(f"{m:4d}  " + "  ".join(cells) + diff, flush=True)


if __name__ == "__main__":
    main()
