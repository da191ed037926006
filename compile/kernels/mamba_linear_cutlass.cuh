// MambaLinear's products with many rows (a prefill launch's hundreds of prompt rows, large decode batches) as CUTLASS
// 3xTF32 GEMMs: Y [M, N] = X [M, K] W [N, K]^T in fp32 on the tensor cores, tiled through shared memory with
// multi-stage cp.async pipelines.
//
// Why: mamba_linear.cuh reads its operands straight from global memory into registers, which wins where the weight's
// bytes are the cost (a few rows) and loses to cuBLAS's fp32 SIMT kernels from a few hundred rows on (out_proj at
// 1024 rows: 136 against 63 us on an H200). CUTLASS's "fast fp32" GEMMs (OpMultiplyAddFastF32: the same hi/lo TF32
// split and three MMAs as mamba_linear.cuh, fp32 accuracy) stage tiles of both operands in shared memory, so each
// element read from memory feeds a whole tile's MMAs. Only compiled when CUTLASS's headers are found at build time
// (compile/kernels.py: the nvidia-cutlass package); without them MambaLinear runs mamba_linear.cuh alone.
//
// Orientation: CUTLASS's GEMM M is X's rows, its N the weight's rows: A = X row-major [M, K], B = W^T column-major
// [K, N] (W as torch stores it), C = Y row-major [M, N]. A row's K sum follows the tile config and K's split
// (split_k: serial, its parts added in order) alone, so a row's bits depend on M only through which config and split
// run (launch).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_common.cuh"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace mambatrt_cutlass {
// Internal to each file that includes this header: each compiles its own copy of each CUTLASS kernel (they have
// internal linkage) whose shared-memory limit is its own, so the functions that raise and launch them, and their
// statics, must be the file's own too (shared, the first file's raise would answer for another's kernels, which
// would then launch with the default limit and fail).
namespace {

// threadblock tile (TM x TN x TK), warp tile (WM x WN x WK: WK < TK splits a tile's K over TK / WK warps, "sliced
// K"), pipeline stages; SPLIT: the kernel can also split K over blocks ("serial split-K": the blocks of a tile add
// their parts to the output in order, one after another, through a semaphore per tile, so the sums' order is fixed)
template <int TM, int TN, int TK, int WM, int WN, int WK, int S, bool SPLIT = false>
using Gemm3xTF32 = cutlass::gemm::device::Gemm<
    float, cutlass::layout::RowMajor,     // A = X [M, K]
    float, cutlass::layout::ColumnMajor,  // B = W^T [K, N]
    float, cutlass::layout::RowMajor,     // C = Y [M, N]
    float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<TM, TN, TK>,
    cutlass::gemm::GemmShape<WM, WN, WK>, cutlass::gemm::GemmShape<16, 8, 8>,
    cutlass::epilogue::thread::LinearCombination<float, 4, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, S, 4, 4, SPLIT,
    cutlass::arch::OpMultiplyAddFastF32>;

// whether CUTLASS's 4-float vector accesses apply: K, N and X's row stride (lda, 0: K) multiples of 4, 16-byte
// aligned operands
inline bool aligned(const float* X, const float* W, const float* Y, int N, int K, int lda = 0) {
  const auto bits = reinterpret_cast<uintptr_t>(X) | reinterpret_cast<uintptr_t>(W) | reinterpret_cast<uintptr_t>(Y);
  return K % 4 == 0 && N % 4 == 0 && (lda == 0 ? K : lda) % 4 == 0 && bits % 16 == 0;
}

// Raise G's kernel's shared-memory limit (once per config and translation unit; later calls return the first call's
// result). device::Gemm::run raises it on every call: an API call inside onnxruntime's CUDA graph captures, which
// prepare() keeps out of them.
template <class G>
cudaError_t raise_shared_memory() {
  using Kernel = typename G::GemmKernel;
  static const cudaError_t raised = [] {
    constexpr int smem = int(sizeof(typename Kernel::SharedStorage));
    return smem < (48 << 10) ? cudaSuccess
                             : cudaFuncSetAttribute(cutlass::Kernel<Kernel>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }();
  return raised;
}

// G's kernel on `stream`, its parameters built as device::Gemm::initialize builds them; X's rows `lda` floats apart
// (0: K); `split` > 1 (a SPLIT config): K split over that many blocks per tile, `semaphores` one zeroed int per
// output tile (each tile's last block sets its semaphore back to 0, so the buffer is ready for the next launch on
// the same stream)
template <class G>
cudaError_t run(const float* X, const float* W, float* Y, int M, int N, int K, cudaStream_t stream, int lda = 0,
                int split = 1, int* semaphores = nullptr) {
  using Kernel = typename G::GemmKernel;
  using Shape = typename G::ThreadblockShape;
  if (const cudaError_t err = raise_shared_memory<G>(); err != cudaSuccess) return err;
  const cutlass::gemm::GemmCoord problem(M, N, K);
  typename G::ThreadblockSwizzle swizzle;
  const cutlass::gemm::GemmCoord tiles = swizzle.get_tiled_shape(problem, {Shape::kM, Shape::kN, Shape::kK}, split);
  const typename Kernel::Params params{problem, tiles,  {const_cast<float*>(X), lda == 0 ? K : lda},
                                       {const_cast<float*>(W), K},
                                       {Y, N},  {Y, N},  {1.0f, 0.0f},
                                       semaphores};
  cutlass::Kernel<Kernel><<<swizzle.get_grid_shape(tiles), Kernel::kThreadCount,
                             int(sizeof(typename Kernel::SharedStorage)), stream>>>(params);
  return cudaGetLastError();
}

// The configs MambaLinear runs through CUTLASS (timed on an H200 at mamba-130m's and the default model's
// projections, M 16..2048; docs/benchmarks.md): 32 x 64 tiles with each tile's K split over two warps (sliced K: the
// shortest serial K loop, the fastest where the grid is small), 64 x 64 tiles once they make 256 blocks or more,
// 128 x 64 tiles for 128 rows and more once 64 x 64 tiles would make 768 blocks or more (in_proj at 1024 rows, the
// LM head at 128).
using Sliced = Gemm3xTF32<32, 64, 32, 32, 32, 16, 4>;
using Medium = Gemm3xTF32<64, 64, 32, 32, 32, 32, 4>;
using Large = Gemm3xTF32<128, 64, 32, 64, 32, 32, 3>;
using SlicedSplit = Gemm3xTF32<32, 64, 32, 32, 32, 16, 4, true>;

// Whether CUTLASS beats MambaLinear's own kernel (mamba_linear.cuh) at this shape: from 16 rows on, once the output
// has 2^17 elements or the product 2^27 multiply-adds (below that the own kernel, which reads W straight into
// registers, finishes before a CUTLASS kernel's serial K loop, ~0.011 us per column of K on an H200, does)
inline bool wins(int M, int N, int K) {
  const size_t outputs = size_t(M) * size_t(N);
  return M >= 16 && (outputs >= (size_t(1) << 17) || outputs * size_t(K) >= (size_t(1) << 27));
}

// The configs' shared-memory limits raised where no capture runs (the op's kernel creation: a session's load)
inline cudaError_t prepare() {
  cudaError_t err = raise_shared_memory<Sliced>();
  if (err == cudaSuccess) err = raise_shared_memory<Medium>();
  if (err == cudaSuccess) err = raise_shared_memory<SlicedSplit>();
  return err == cudaSuccess ? raise_shared_memory<Large>() : err;
}

// K's split over blocks for a prefill launch's product (128 rows or more) of `tiles` 32 x 64 tiles: a grid of at most
// half as many tiles as SMs with a K of 4096 or more runs its K in parts on as many blocks as fill the SMs twice,
// each part at least 256 long; 1: no split. On an H100, mamba-2.8b's x_proj (192 outputs, K 5120) at 512 rows, 48
// tiles: 35.9 against 50.7 us in 6 parts; slower where the tiles are more or K shorter: 96 tiles of K 4096
// (mamba-1.4b's x_proj at 1024 rows) 43.6 against 41.4 in 3 parts, mamba-130m's x_proj (K 1536) at 512 to 2000 rows
// 18.4-21.9 against 17.6-18.0 (docs/benchmarks.md). Decode batches are not split: untimed.
inline int split_k(int M, int tiles, int K) {
  static const int sms = mambatrt::device_attribute(cudaDevAttrMultiProcessorCount);
  if (M < 128 || 2 * tiles > sms || K < 4096) return 1;
  return std::min((2 * sms + tiles - 1) / tiles, K / 256);
}

// X's rows `lda` floats apart (0: K)
inline cudaError_t launch(const float* X, const float* W, float* Y, int M, int N, int K, cudaStream_t stream,
                          int lda = 0) {
  const size_t blocks = size_t((M + 63) / 64) * size_t((N + 63) / 64);  // of 64 x 64 tiles
  if (M <= 32 || blocks < 256) {
    const int tiles = ((M + 31) / 32) * ((N + 63) / 64), split = split_k(M, tiles, K);
    if (split > 1) {
      void* semaphores = mambatrt::stream_buffer(stream, mambatrt::StreamBuffer::kSplitK, size_t(tiles) * sizeof(int));
      if (semaphores != nullptr)
        return run<SlicedSplit>(X, W, Y, M, N, K, stream, lda, split, static_cast<int*>(semaphores));
    }
    return run<Sliced>(X, W, Y, M, N, K, stream, lda);
  }
  if (M >= 128 && blocks >= 768) return run<Large>(X, W, Y, M, N, K, stream, lda);
  return run<Medium>(X, W, Y, M, N, K, stream, lda);
}

}  // namespace
}  // namespace mambatrt_cutlass
