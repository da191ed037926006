// CUDA kernels of MambaConv and MambaScan (shapes in mamba_ops.h), launched on onnxruntime's stream so that they
// are ordered with its other kernels and captured into its CUDA graphs.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mamba_ops.h"

namespace mambatrt {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// xz and MambaScan's y: float, or float16 for the ...16 ops
template <bool Half>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  if constexpr (Half) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
template <bool Half>
__device__ __forceinline__ void store(void* p, int64_t i, float v) {
  if constexpr (Half) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// One thread per (sequence, channel, row): each output row is independent (K taps over the K-1 past columns and
// the chunk's inputs), so a long chunk is as parallel as a batch of sequences.
template <bool Half>
__global__ void conv_kernel(ConvArgs a) {
  const int64_t b = blockIdx.z, t = blockIdx.y, e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= a.inner) return;
  const int64_t K = a.kernel, E = a.inner, T = a.rows;
  // column j of [past | x]: j < K-1 from the conv state, else row j-(K-1) of the chunk
  auto column = [&](int64_t j) {
    return j < K - 1 ? a.past[(b * E + e) * (K - 1) + j] : load<Half>(a.xz, (b * T + j - (K - 1)) * a.xz_width + e);
  };
  float acc = a.bias[e];
#pragma unroll
  for (int k = 0; k < kMaxConvWidth; ++k) {
    if (k < K) acc += a.weight[e * K + k] * column(t + k);
  }
  a.y[(b * T + t) * E + e] = silu(acc);
  for (int64_t j = t; j < K - 1; j += T) a.present[(b * E + e) * (K - 1) + j] = column(T + j);  // the last K-1
}

// The scan for one row per sequence (a decode step): L lanes per channel (L a power of two >= N), lane n owns
// state element n of kStepSeqs sequences; the dt projection is split over the lanes and both dot products are
// summed with shuffles inside the L-lane group. No shared memory and no barrier: at one row this beats the staged
// kernel below. A decode step is bound by memory latency, not bandwidth (a batch of 64 moves ~13 MB per layer, a
// few microseconds of bandwidth, and took ~19 us with one sequence per thread: several waves of threads, each
// waiting on memory two or three times in turn). So each thread takes kStepSeqs sequences and issues every load
// of all of them first, computes, then stores: one wait on memory per thread, and a quarter of the threads. (Four
// sequences with loads and stores interleaved measured slower than one: a store may alias the next sequence's
// inputs, so the compiler kept them in order; BENCHMARKS.md, session 8.)
constexpr int kStepSeqs = 4;

template <int L, bool Half>
__global__ void scan_step_kernel(ScanArgs a) {
  const int64_t b0 = int64_t(blockIdx.y) * kStepSeqs;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t e = tid / L;
  const int n = int(tid % L);
  const int64_t E = a.inner, N = a.state, R = a.rank, X = a.xdbl_width, Z = a.xz_width;
  const bool channel = e < E, owner = channel && n < N;
  const int64_t left = a.batch - b0;  // sequences of this block, the same for all its threads
  const float* __restrict__ xdbl = a.xdbl;
  // 1. every load: the dt weights and the sequences' dt inputs, then per sequence u, the past state, B, C and z
  float s[kStepSeqs] = {}, u[kStepSeqs] = {}, past[kStepSeqs] = {}, bn[kStepSeqs] = {}, cn[kStepSeqs] = {};
  float z[kStepSeqs] = {};
  if (channel) {
    const float* __restrict__ w = a.dt_weight + e * R;
    for (int64_t r = n; r < R; r += L) {
      const float wr = w[r];
#pragma unroll
      for (int i = 0; i < kStepSeqs; ++i) {
        if (i < left) s[i] += xdbl[(b0 + i) * X + r] * wr;  // dt [R] | B [N] | C [N]
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kStepSeqs; ++i) {
    const int64_t b = b0 + i;
    if (i < left && channel) {
      u[i] = a.u[b * E + e];
      if (n == 0) z[i] = load<Half>(a.xz, b * Z + Z - E + e);
    }
    if (i < left && owner) {
      past[i] = a.past[(b * E + e) * N + n];
      bn[i] = xdbl[b * X + R + n];
      cn[i] = xdbl[b * X + R + N + n];
    }
  }
  const float A = owner ? a.a[e * N + n] : 0.0f;
  const float bias = channel ? a.dt_bias[e] : 0.0f, dskip = channel ? a.d[e] : 0.0f;
  // 2. compute: dt, the new state, its dot with C (shuffles inside the L-lane group)
  float h[kStepSeqs], p[kStepSeqs];
#pragma unroll
  for (int i = 0; i < kStepSeqs; ++i) {
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) s[i] += __shfl_xor_sync(0xffffffffu, s[i], off, L);
    const float dt = channel ? softplus(s[i] + bias) : 0.0f;
    h[i] = expf(dt * A) * past[i] + (dt * u[i]) * bn[i];
    p[i] = owner ? h[i] * cn[i] : 0.0f;
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) p[i] += __shfl_xor_sync(0xffffffffu, p[i], off, L);
  }
  // 3. stores
#pragma unroll
  for (int i = 0; i < kStepSeqs; ++i) {
    const int64_t b = b0 + i;
    if (i < left && owner) a.present[(b * E + e) * N + n] = h[i];
    if (i < left && channel && n == 0) store<Half>(a.y, b * E + e, (p[i] + dskip * u[i]) * silu(z[i]));
  }
}

// The scan of a chunk of rows, staged in chunks of kChunk through shared memory, in three phases per chunk:
//   1. dt = softplus(x_dt . dt_weight[e] + dt_bias[e]) for every (row, channel), and the rows' B and C;
//   2. the recurrence: lane n of channel e walks the rows, h = exp(dt A[e,n]) h + dt u B[n], and stores h C[n];
//   3. y = (sum over n of h C[n] + D u) * silu(z) for every (row, channel).
// Only phase 2 is sequential, and in it only the update of h depends on the previous row, so the rows pipeline.
constexpr int kChunk = 32;

template <int L, bool Half>  // L lanes per channel: a power of two >= N
__global__ void scan_chunk_kernel(ScanArgs a) {
  constexpr int C = kThreads / L;  // channels per block
  __shared__ float s_dt[kChunk][C];
  __shared__ float s_bc[kChunk][2 * kMaxState];
  __shared__ float s_p[kChunk][kThreads];
  const int64_t b = blockIdx.y, E = a.inner, N = a.state, R = a.rank, T = a.rows, X = a.xdbl_width;
  const int c = threadIdx.x / L, n = threadIdx.x % L;
  const int64_t e0 = int64_t(blockIdx.x) * C, e = e0 + c;
  const bool owner = e < E && n < N;
  float h = owner ? a.past[(b * E + e) * N + n] : 0.0f;
  const float A = owner ? a.a[e * N + n] : 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int rows = int(T - t0 < kChunk ? T - t0 : kChunk);
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {  // phase 1
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      float dt = 0.0f;
      if (ee < E) {
        const float* x = a.xdbl + (b * T + t0 + r) * X;
        const float* w = a.dt_weight + ee * R;
        float s = 0.0f;
        for (int64_t k = 0; k < R; ++k) s += x[k] * w[k];
        dt = softplus(s + a.dt_bias[ee]);
      }
      s_dt[r][cc] = dt;
    }
    for (int i = threadIdx.x; i < rows * 2 * N; i += kThreads) {
      const int r = int(i / (2 * N)), j = int(i % (2 * N));
      s_bc[r][j] = a.xdbl[(b * T + t0 + r) * X + R + j];
    }
    __syncthreads();
    if (owner) {  // phase 2
      const float* u = a.u + (b * T + t0) * E + e;
      for (int r = 0; r < rows; ++r) {
        const float dt = s_dt[r][c];
        h = expf(dt * A) * h + (dt * u[r * E]) * s_bc[r][n];
        s_p[r][threadIdx.x] = h * s_bc[r][N + n];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {  // phase 3
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      if (ee >= E) continue;
      float y = 0.0f;
      for (int k = 0; k < N; ++k) y += s_p[r][cc * L + k];
      const int64_t row = b * T + t0 + r;
      const float u = a.u[row * E + ee];
      const float z = load<Half>(a.xz, row * a.xz_width + a.xz_width - E + ee);
      store<Half>(a.y, row * E + ee, (y + a.d[ee] * u) * silu(z));
    }
    __syncthreads();  // the next chunk reuses the shared arrays
  }
  if (owner) a.present[(b * E + e) * N + n] = h;
}

template <int L, bool Half>
void launch_scan(const ScanArgs& a, cudaStream_t stream) {
  constexpr int C = kThreads / L;  // channels per block
  dim3 grid(unsigned((a.inner + C - 1) / C), unsigned(a.batch));
  if (a.rows == 1) {
    grid.y = unsigned((a.batch + kStepSeqs - 1) / kStepSeqs);
    scan_step_kernel<L, Half><<<grid, kThreads, 0, stream>>>(a);
  } else {
    scan_chunk_kernel<L, Half><<<grid, kThreads, 0, stream>>>(a);
  }
}

template <bool Half>
void launch_scan(const ScanArgs& a, cudaStream_t s) {
  if (a.state <= 1) {
    launch_scan<1, Half>(a, s);
  } else if (a.state <= 2) {
    launch_scan<2, Half>(a, s);
  } else if (a.state <= 4) {
    launch_scan<4, Half>(a, s);
  } else if (a.state <= 8) {
    launch_scan<8, Half>(a, s);
  } else if (a.state <= 16) {
    launch_scan<16, Half>(a, s);
  } else {
    launch_scan<32, Half>(a, s);
  }
}

// MambaAddNorm16: one block per row; the sum of squares is reduced over the block (warp shuffles, then the warps'
// partial sums through shared memory), the row's sum kept in registers between the two passes. Every load (x,
// residual, weight, eps) is issued before the reduction, so the kernel waits on memory once: loading the weight
// and eps after it made three dependent trips (2.55 us per 768-wide row on an H200 against 1.64 us for
// onnxruntime's SkipSimplifiedLayerNormalization; BENCHMARKS.md, session 8).
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
  dim3 grid(unsigned((a.inner + kThreads - 1) / kThreads), unsigned(a.rows), unsigned(a.batch));
  if (a.half) {
    conv_kernel<true><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  } else {
    conv_kernel<false><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* scan_cuda(const ScanArgs& a, void* stream) {
  if (a.batch == 0 || a.rows == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.half) {
    launch_scan<true>(a, s);
  } else {
    launch_scan<false>(a, s);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* cuda_check() {
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(conv_kernel<false>));
  if (err == cudaSuccess) return nullptr;
  cudaGetLastError();  // clear it: the check must not fail a later launch
  return cudaGetErrorString(err);
}

void* create_stream() {
  cudaStream_t stream = nullptr;
  return cudaStreamCreate(&stream) == cudaSuccess ? stream : nullptr;
}

}  // namespace mambatrt
