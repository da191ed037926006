"""Host time per call of the CUDA runtime's copies as the CUDA pool issues them (ctypes), on an idle GPU and on a
busy one (session 30: where a cohort's cache fills spent their ~70 us an entry at concurrency 64):

- a device-to-device 2-D copy of one sequence's layered state (24 pieces of one layer each, pitch apart),
  synchronous and asynchronous entry points, on the legacy default stream and on a non-blocking stream;
- one cache entry's fill as the pool made it until session 30: the two states' 2-D copies and the logits row's
  synchronous copy to pinned host memory, all on the legacy stream; and as asynchronous copies on a non-blocking
  stream (the logits row device to device);
- a 0.2 MB host copy into pinned memory (a logits row).

Busy: a low-priority non-blocking stream runs long GEMMs (a prefill launch's) and a high-priority one short ones
(a decode launch's), queued far ahead, while the calls are timed.

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
    for name in ("cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpy2D", "cudaMemcpy2DAsync", "cudaStreamSynchronize"):
        getattr(cudart, name).restype = ctypes.c_int
    layers, rows, piece = 24, 128, 1536 * 16 * 4  # mamba-130m's ssm state: a layer's piece of one sequence, 96 KiB
    conv_piece, vp = 1536 * 3 * 4, 50304  # a layer's conv state piece; the padded vocabulary
    src = torch.empty(layers * rows * piece // 4, device="cuda")
    dst = torch.empty_like(src)
    csrc = torch.empty(layers * rows * conv_piece // 4, device="cuda")
    cdst = torch.empty_like(csrc)
    logits = torch.empty(rows, vp, device="cuda")
    dlogits = torch.empty(rows, vp, device="cuda")
    pinned = torch.empty(rows, vp, pin_memory=True)
    mine = torch.cuda.Stream()  # non-blocking, as the pool's decode stream
    stream = ctypes.c_void_p(mine.cuda_stream)
    legacy = ctypes.c_void_p(0)
    size = ctypes.c_size_t
    ssm = (ctypes.c_void_p(dst.data_ptr()), size(rows * piece), ctypes.c_void_p(src.data_ptr()), size(rows * piece))
    ssm += (size(piece), size(layers), ctypes.c_int(3))
    conv = (ctypes.c_void_p(cdst.data_ptr()), size(rows * conv_piece), ctypes.c_void_p(csrc.data_ptr()))
    conv += (size(rows * conv_piece), size(conv_piece), size(layers), ctypes.c_int(3))
    row = (ctypes.c_void_p(pinned.data_ptr()), ctypes.c_void_p(logits.data_ptr()), size(4 * vp), ctypes.c_int(2))
    drow = (ctypes.c_void_p(dlogits.data_ptr()), ctypes.c_void_p(logits.data_ptr()), size(4 * vp), ctypes.c_int(3))

    def fill_legacy() -> int:  # the pool's cache fill until session 30
        return cudart.cudaMemcpy2D(*conv) or cudart.cudaMemcpy2D(*ssm) or cudart.cudaMemcpy(*row)

    def fill_async() -> int:  # the same entry by asynchronous copies on the decode stream, its logits on the device
        a = cudart.cudaMemcpy2DAsync(*conv, stream) or cudart.cudaMemcpy2DAsync(*ssm, stream)
        return a or cudart.cudaMemcpyAsync(*drow, stream)

    calls = {
        "cudaMemcpy2D (legacy stream)": lambda: cudart.cudaMemcpy2D(*ssm),
        "cudaMemcpy2DAsync, legacy stream": lambda: cudart.cudaMemcpy2DAsync(*ssm, legacy),
        "cudaMemcpy2DAsync, non-blocking stream": lambda: cudart.cudaMemcpy2DAsync(*ssm, stream),
        "cudaMemcpy 0.2 MB to pinned (legacy)": lambda: cudart.cudaMemcpy(*row),
        "a cache fill, legacy, synchronous": fill_legacy,
        "a cache fill, asynchronous, own stream": fill_async,
    }
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    big = torch.randn(1024, 3072, device="cuda"), torch.randn(3072, 3072, device="cuda")
    small = torch.randn(64, 768, device="cuda"), torch.randn(768, 3072, device="cuda")

    def load(seconds: float) -> None:
        """Queue about ``seconds`` of GEMMs on both streams (prefill-like long ones, decode-like short ones)."""
        with torch.cuda.stream(low):
            for _ in range(int(seconds * 4000)):
                torch.mm(*big)
        with torch.cuda.stream(high):
            for _ in range(int(seconds * 40000)):
                torch.mm(*small)

    for busy in (False, True):
        print(f"== GPU {'busy (GEMMs queued on two other streams)' if busy else 'idle'}")
        for label, call in calls.items():
            for n in (1, 16):
                times = []
                for _ in range(10):
                    torch.cuda.synchronize()
                    if busy:
                        load(0.05)
                    t = time.perf_counter()
                    for _ in range(n):
                        assert call() == 0
                    times.append((time.perf_counter() - t) / n)
                torch.cuda.synchronize()
                print(
                    f"{label:42s} {n:3d} in a row: median {np.median(times) * 1e6:8.2f} us per call, "
                    f"best {min(times) * 1e6:8.2f} (host)"
                )
    host = pinned.numpy()
    values = np.random.rand(vp).astype(np.float32)
    best = min(_timed(lambda i=i: host.__setitem__(i % rows, values)) for i in range(200))
    print(f"0.2 MB host copy into pinned memory: {best * 1e6:.2f} us")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
