// CUDA kernels of MambaConv and MambaAddNorm16 (shapes in mamba_ops.h), launched on the stream onnxruntime gives the
// session, so that they are ordered with its other kernels and captured into its CUDA graphs; and the check that the
// library's CUDA code runs on the device at hand.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "mamba_ops.h"

namespace mambatrt {
namespace {

// One thread per (sequence, channel, kConvRows rows): each output row is independent (K taps over the K-1 past
// columns and the chunk's inputs), so a long chunk is as parallel as a batch of sequences. A thread keeps its rows'
// window of kConvRows + K - 1 columns in registers, each loaded once (one row per thread reads every column K times
// and makes a 64-row chunk of 16 prompts 12288 blocks of short threads: 15 us per layer on an H200, its time mostly
// the blocks' load latency). Each row's sum is the same expression whatever kConvRows is, so the same bits.
constexpr int kConvRows = 8;

template <bool Half>
__global__ void conv_kernel(ConvArgs a) {
  const int64_t b = blockIdx.z, t0 = int64_t(blockIdx.y) * kConvRows;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= a.inner) return;
  const int64_t K = a.kernel, E = a.inner, T = a.rows;
  // column j of [past | x]: j < K-1 from the conv state, else row j-(K-1) of the chunk
  auto column = [&](int64_t j) {
    return j < K - 1 ? a.past[(b * E + e) * (K - 1) + j] : load<Half>(a.xz, (b * T + j - (K - 1)) * a.xz_width + e);
  };
  constexpr int kWindow = kConvRows + kMaxConvWidth - 1;
  float window[kWindow], w[kMaxConvWidth];
#pragma unroll
  for (int j = 0; j < kWindow; ++j) window[j] = j < kConvRows + K - 1 && t0 + j < T + K - 1 ? column(t0 + j) : 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxConvWidth; ++k) w[k] = k < K ? a.weight[e * K + k] : 0.0f;
  const float bias = a.bias[e];
#pragma unroll
  for (int r = 0; r < kConvRows; ++r) {
    if (t0 + r >= T) break;
    float acc = bias;
#pragma unroll
    for (int k = 0; k < kMaxConvWidth; ++k) {
      if (k < K) acc += w[k] * window[r + k];
    }
    a.y[(b * T + t0 + r) * E + e] = silu(acc);
  }
  if (blockIdx.y == 0) {
    for (int64_t j = 0; j < K - 1; ++j) a.present[(b * E + e) * (K - 1) + j] = column(T + j);  // the last K-1
  }
}

// MambaAddNorm16: one block per row; the sum of squares is reduced over the block (warp shuffles, then the warps'
// partial sums through shared memory), the row's sum kept in registers between the two passes. Every load (x,
// residual, weight, eps) is issued before the reduction, so the kernel waits on memory once: loading the weight
// and eps after it made three dependent trips (2.55 us per 768-wide row on an H200 against 1.64 us for
// onnxruntime's SkipSimplifiedLayerNormalization; docs/benchmarks.md).
constexpr int kNormThreads = 256, kNormPerThread = 8;  // rows up to 2048 wide in registers; wider rows loop

__global__ void add_norm_kernel(NormArgs a) {
  __shared__ float warp_sums[kNormThreads / 32];
  const int64_t row = blockIdx.x, D = a.width;
  const __half* __restrict__ x = static_cast<const __half*>(a.x) + row * D;
  const float* __restrict__ res = a.residual + row * D;
  const float* __restrict__ weight = a.weight;
  const float eps = *a.eps;
  float local[kNormPerThread], w[kNormPerThread];
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormPerThread; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * kNormThreads;
    local[j] = i < D ? __half2float(x[i]) + res[i] : 0.0f;
    w[j] = i < D ? weight[i] : 0.0f;
    squares += local[j] * local[j];
  }
  for (int64_t i = threadIdx.x + int64_t(kNormPerThread) * kNormThreads; i < D; i += kNormThreads) {
    const float v = __half2float(x[i]) + res[i];
    squares += v * v;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = squares;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormThreads / 32; ++k) total += warp_sums[k];
  const float scale = rsqrtf(total / float(D) + eps);
  float* __restrict__ sum = a.sum + row * D;
  __half* __restrict__ normed = static_cast<__half*>(a.normed) + row * D;
#pragma unroll
  for (int j = 0; j < kNormPerThread; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * kNormThreads;
    if (i < D) {
      sum[i] = local[j];
      normed[i] = __float2half_rn(local[j] * scale * w[j]);
    }
  }
  for (int64_t i = threadIdx.x + int64_t(kNormPerThread) * kNormThreads; i < D; i += kNormThreads) {
    const float v = __half2float(x[i]) + res[i];
    sum[i] = v;
    normed[i] = __float2half_rn(v * scale * weight[i]);
  }
}

}  // namespace

const char* add_norm_cuda(const NormArgs& a, void* stream) {
  if (a.rows == 0) return nullptr;
  add_norm_kernel<<<unsigned(a.rows), kNormThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* conv_cuda(const ConvArgs& a, void* stream) {
  if (a.batch == 0 || a.rows == 0) return nullptr;
  dim3 grid(unsigned((a.inner + kThreads - 1) / kThreads), unsigned((a.rows + kConvRows - 1) / kConvRows),
            unsigned(a.batch));
  if (a.half) {
    conv_kernel<true><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  } else {
    conv_kernel<false><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Every CUDA file is compiled for the same architectures (compile/kernels.py), so one kernel's code answers for all
const char* cuda_check() {
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(conv_kernel<false>));
  if (err == cudaSuccess) return nullptr;
  cudaGetLastError();  // clear it: the check must not fail a later launch
  return cudaGetErrorString(err);
}

}  // namespace mambatrt
