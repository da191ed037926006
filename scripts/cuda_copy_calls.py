"""Host time per call of the CUDA runtime's device-to-device 2-D copies as the CUDA pool issues them (ctypes, one
sequence's layered state: 24 pieces of one layer each, pitch apart), synchronous and asynchronous entry points, on
the legacy default stream and on a non-blocking stream; and a 0.2 MB host copy into pinned memory (a logits row).

Usage (a machine with a GPU and torch): python scripts/cuda_copy_calls.py
"""

import ctypes
import glob
import os
import time

import numpy as np
import torch


def main() -> None:
    torch.zeros(1, device="cuda")  # the primary context
    lib = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")))
    cudart = ctypes.CDLL(lib[0] if lib else "libcudart.so")
    for name in ("cudaMemcpy2D", "cudaMemcpy2DAsync", "cudaStreamSynchronize", "cudaStreamCreateWithFlags"):
        getattr(cudart, name).restype = ctypes.c_int
    layers, rows, piece = 24, 128, 1536 * 16 * 4  # mamba-130m's ssm state: a layer's piece of one sequence, 96 KiB
    src = torch.empty(layers * rows * piece // 4, device="cuda")
    dst = torch.empty_like(src)
    stream = ctypes.c_void_p()
    cudart.cudaStreamCreateWithFlags(ctypes.byref(stream), 1)  # cudaStreamNonBlocking
    args = (ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(rows * piece), ctypes.c_void_p(src.data_ptr()))
    rest = (ctypes.c_size_t(rows * piece), ctypes.c_size_t(piece), ctypes.c_size_t(layers), ctypes.c_int(3))
    calls = {
        "cudaMemcpy2D (legacy stream)": lambda: cudart.cudaMemcpy2D(*args, *rest),
        "cudaMemcpy2DAsync, legacy stream": lambda: cudart.cudaMemcpy2DAsync(*args, *rest, ctypes.c_void_p(0)),
        "cudaMemcpy2DAsync, non-blocking stream": lambda: cudart.cudaMemcpy2DAsync(*args, *rest, stream),
    }
    for label, call in calls.items():
        for n in (1, 32):
            best = 1e9
            for _ in range(20):
                cudart.cudaStreamSynchronize(ctypes.c_void_p(0)), cudart.cudaStreamSynchronize(stream)
                t = time.perf_counter()
                for _ in range(n):
                    assert call() == 0
                best = min(best, (time.perf_counter() - t) / n)
            cudart.cudaStreamSynchronize(ctypes.c_void_p(0)), cudart.cudaStreamSynchronize(stream)
            print(f"{label:42s} {n:3d} calls in a row: {best * 1e6:7.2f} us per call (host)")
    pinned = torch.empty(128, 50280, pin_memory=True).numpy()
    row = np.random.rand(50280).astype(np.float32)
    best = min(_timed(lambda i=i: pinned.__setitem__(i % 128, row)) for i in range(200))
    print(f"0.2 MB host copy into pinned memory: {best * 1e6:.2f} us")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
