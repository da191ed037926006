// CUDA kernels of MambaConv, MambaScan, MambaAddNorm16 and MambaLinear (shapes in mamba_ops.h; MambaLinear's kernel in
// mamba_linear.cuh), launched on onnxruntime's stream so that they
// are ordered with its other kernels and captured into its CUDA graphs.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mamba_linear.cuh"
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

// The scan for one row per sequence (a decode step). LANES lanes per channel, each owning NS / LANES consecutive
// state elements (NS: N rounded up to a power of two; loaded and stored as float4 when they come in fours), SEQS
// sequences per thread; the dt projection is split over the lanes and both dot products are summed with shuffles
// inside the LANES-lane group; no shared memory and no barrier. Every load of all SEQS sequences is issued before
// any computing, so each thread waits on memory once. A step is bound by memory latency, not bandwidth (a batch of
// 64 moves ~13 MB per layer, a few microseconds of bandwidth): one lane per state element (LANES 16) took 18 us
// per layer at batch 64 (1.5M threads in several waves), four lanes of four elements 9.9 us and with two sequences
// per thread 8.6 us; up to batch 8 the mappings take 4-5 us alike (scripts/scan_step_bench.cu, BENCHMARKS.md,
// session 11). The dt sum is split the same way at every batch, so a sequence gets the same bits alone or batched.
constexpr int kStepLanes = 4;
constexpr int64_t kStepPairBatch = 32;  // from this batch on, two sequences per thread

template <int NS, int LANES, int SEQS, bool Half>
__global__ void scan_step_lanes_kernel(ScanArgs a) {
  constexpr int EPL = NS / LANES;  // state elements per lane
  static_assert(EPL >= 1 && EPL * LANES == NS, "LANES must divide NS");
  const int64_t b0 = int64_t(blockIdx.y) * SEQS;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t e = tid / LANES;
  const int lane = int(tid % LANES);
  const int64_t E = a.inner, N = a.state, R = a.rank, X = a.xdbl_width, Z = a.xz_width;
  const bool channel = e < E;
  const int64_t left = a.batch - b0;
  const float* __restrict__ xdbl = a.xdbl;
  const bool vec = EPL % 4 == 0 && N == NS &&  // whole, aligned float4s of the thread's elements
                   (reinterpret_cast<uintptr_t>(a.past) | reinterpret_cast<uintptr_t>(a.present)) % 16 == 0;
  float s[SEQS] = {}, u[SEQS] = {}, z[SEQS] = {}, h[SEQS][EPL] = {}, bn[SEQS][EPL] = {}, cn[SEQS][EPL] = {};
  float A[EPL] = {};
  const int64_t n0 = int64_t(lane) * EPL;
  if (channel) {
    const float* __restrict__ w = a.dt_weight + e * R;
    for (int64_t r = lane; r < R; r += LANES) {
      const float wr = w[r];
#pragma unroll
      for (int i = 0; i < SEQS; ++i) {
        if (i < left) s[i] += xdbl[(b0 + i) * X + r] * wr;
      }
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j) A[j] = n0 + j < N ? a.a[e * N + n0 + j] : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < SEQS; ++i) {
    const int64_t b = b0 + i;
    if (i < left && channel) {
      u[i] = a.u[b * E + e];
      if (lane == 0) z[i] = load<Half>(a.xz, b * Z + Z - E + e);
      const float* past = a.past + (b * E + e) * N + n0;
      if (vec) {
#pragma unroll
        for (int j = 0; j < EPL; j += 4) {
          const float4 v = *reinterpret_cast<const float4*>(past + j);
          h[i][j] = v.x, h[i][j + 1] = v.y, h[i][j + 2] = v.z, h[i][j + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < EPL; ++j) h[i][j] = n0 + j < N ? past[j] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        bn[i][j] = n0 + j < N ? xdbl[b * X + R + n0 + j] : 0.0f;
        cn[i][j] = n0 + j < N ? xdbl[b * X + R + N + n0 + j] : 0.0f;
      }
    }
  }
  const float bias = channel ? a.dt_bias[e] : 0.0f, dskip = channel ? a.d[e] : 0.0f;
  float p[SEQS];
#pragma unroll
  for (int i = 0; i < SEQS; ++i) {
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) s[i] += __shfl_xor_sync(0xffffffffu, s[i], off, LANES);
    const float dt = channel ? softplus(s[i] + bias) : 0.0f, du = dt * u[i];
    p[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      h[i][j] = expf(dt * A[j]) * h[i][j] + du * bn[i][j];
      p[i] += h[i][j] * cn[i][j];
    }
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) p[i] += __shfl_xor_sync(0xffffffffu, p[i], off, LANES);
  }
#pragma unroll
  for (int i = 0; i < SEQS; ++i) {
    const int64_t b = b0 + i;
    if (!(i < left && channel)) continue;
    float* present = a.present + (b * E + e) * N + n0;
    if (vec) {
#pragma unroll
      for (int j = 0; j < EPL; j += 4)
        *reinterpret_cast<float4*>(present + j) = make_float4(h[i][j], h[i][j + 1], h[i][j + 2], h[i][j + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        if (n0 + j < N) present[j] = h[i][j];
      }
    }
    if (lane == 0) store<Half>(a.y, b * E + e, (p[i] + dskip * u[i]) * silu(z[i]));
  }
}

template <int NS, int LANES, int SEQS, bool Half>
void launch_step_lanes(const ScanArgs& a, cudaStream_t stream) {
  dim3 grid(unsigned((a.inner * LANES + kThreads - 1) / kThreads), unsigned((a.batch + SEQS - 1) / SEQS));
  scan_step_lanes_kernel<NS, LANES, SEQS, Half><<<grid, kThreads, 0, stream>>>(a);
}

// The scan of a chunk of rows, staged kRows rows at a time through shared memory, in three phases per stage:
//   1. the stage's xdbl rows (dt inputs, B, C), u and z copied to shared memory, all loads in flight at once;
//      then dt = softplus(x_dt . dt_weight[e] + dt_bias[e]) for every (row, channel) from the staged rows;
//   2. the recurrence: lane n of channel e walks the rows, h = exp(dt A[e,n]) h + dt u B[n], and stores h C[n];
//   3. y = (sum over n of h C[n] + D u) * silu(z) for every (row, channel).
// Only phase 2 is sequential, and in it only the update of h depends on the previous row, so the rows pipeline.
// With u, z and the xdbl rows read from global memory inside the phases' loops and s_p unpadded (16-way bank
// conflicts in phase 3) this took 23.8 us per layer for one sequence of 64 rows and 124 us for 16; staged and
// padded, 16.7 and 105 us (scripts/scan_step_bench.cu; staging the dt weights too, or padding the xdbl rows,
// measured slower). What bounds it at 16 sequences is still open: neither the loads nor the bank conflicts were
// most of it.
constexpr int kChunk = 32;

template <int L>
struct ChunkShape {
  static constexpr int C = kThreads / L;                      // channels per block
  static constexpr int kRows = C >= 128 ? kChunk / 2 : kChunk;  // rows per stage
  static constexpr int P = C * (L + 1);  // s_p's row: a channel's L lanes and one pad (no bank conflicts)
  static constexpr size_t kStatic = sizeof(float) * kRows * (3 * C + P);  // s_dt, s_u, s_z, s_p
};

template <int L, bool Half>  // L lanes per channel: a power of two >= N
__global__ void scan_chunk_kernel(ScanArgs a) {
  constexpr int C = ChunkShape<L>::C, kRows = ChunkShape<L>::kRows, P = ChunkShape<L>::P;
  __shared__ float s_dt[kRows][C];
  __shared__ float s_u[kRows][C];
  __shared__ float s_z[kRows][C];
  __shared__ float s_p[kRows][P];  // h C[n] of lane n of channel c at c * (L + 1) + n
  extern __shared__ float s_x[];  // [kRows][X]: the stage's xdbl rows
  const int64_t b = blockIdx.y, E = a.inner, N = a.state, R = a.rank, T = a.rows, X = a.xdbl_width;
  const int64_t Z = a.xz_width;
  const int c = threadIdx.x / L, n = threadIdx.x % L;
  const int64_t e0 = int64_t(blockIdx.x) * C, e = e0 + c;
  const bool owner = e < E && n < N;
  float h = owner ? a.past[(b * E + e) * N + n] : 0.0f;
  const float A = owner ? a.a[e * N + n] : 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kRows) {
    const int rows = int(T - t0 < kRows ? T - t0 : kRows);
    const int64_t row0 = b * T + t0;
    for (int64_t i = threadIdx.x; i < rows * X; i += kThreads) s_x[i] = a.xdbl[row0 * X + i];  // phase 1
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {
      const int r = i / C, cc = i % C;
      const bool in = e0 + cc < E;
      s_u[r][cc] = in ? a.u[(row0 + r) * E + e0 + cc] : 0.0f;
      s_z[r][cc] = in ? load<Half>(a.xz, (row0 + r) * Z + Z - E + e0 + cc) : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      float dt = 0.0f;
      if (ee < E) {
        const float* x = s_x + r * X;
        const float* w = a.dt_weight + ee * R;
        float s = 0.0f;
#pragma unroll 8
        for (int64_t k = 0; k < R; ++k) s += x[k] * w[k];
        dt = softplus(s + a.dt_bias[ee]);
      }
      s_dt[r][cc] = dt;
    }
    __syncthreads();
    if (owner) {  // phase 2
      for (int r = 0; r < rows; ++r) {
        const float dt = s_dt[r][c];
        const float* x = s_x + r * X + R;  // B [N] | C [N]
        h = expf(dt * A) * h + (dt * s_u[r][c]) * x[n];
        s_p[r][c * (L + 1) + n] = h * x[N + n];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {  // phase 3
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      if (ee >= E) continue;
      float y = 0.0f;
      for (int k = 0; k < N; ++k) y += s_p[r][cc * (L + 1) + k];
      store<Half>(a.y, (row0 + r) * E + ee, (y + a.d[ee] * s_u[r][cc]) * silu(s_z[r][cc]));
    }
    __syncthreads();  // the next stage reuses the shared arrays
  }
  if (owner) a.present[(b * E + e) * N + n] = h;
}

template <int L, bool Half>
void launch_chunk(const ScanArgs& a, cudaStream_t stream) {
  using S = ChunkShape<L>;
  const size_t dynamic = sizeof(float) * S::kRows * size_t(a.xdbl_width);
  if (S::kStatic + dynamic > 48 * 1024) {  // a wide xdbl row (a large dt rank): opt in to more shared memory
    cudaFuncSetAttribute(scan_chunk_kernel<L, Half>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dynamic));
  }
  dim3 grid(unsigned((a.inner + S::C - 1) / S::C), unsigned(a.batch));
  scan_chunk_kernel<L, Half><<<grid, kThreads, dynamic, stream>>>(a);
}

template <int L, bool Half>
void launch_scan(const ScanArgs& a, cudaStream_t stream) {
  constexpr int lanes = L < kStepLanes ? L : kStepLanes;
  if (a.rows == 1 && a.batch >= kStepPairBatch) {
    launch_step_lanes<L, lanes, 2, Half>(a, stream);
  } else if (a.rows == 1) {
    launch_step_lanes<L, lanes, 1, Half>(a, stream);
  } else {
    launch_chunk<L, Half>(a, stream);
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

const char* linear_cuda(const LinearArgs& a, void* stream) {
  const cudaError_t err = mambatrt_linear::launch(a.x, a.weight, nullptr, a.y, int(a.rows), int(a.out), int(a.in),
                                                  static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* linear_prepare() {
  const cudaError_t err = mambatrt_linear::prepare();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* cuda_check() {
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(conv_kernel<false>));
  if (err == cudaSuccess) return nullptr;
  cudaGetLastError();  // clear it: the check must not fail a later launch
  return cudaGetErrorString(err);
}

void* create_stream(bool blocking, bool urgent) {
  cudaStream_t stream = nullptr;
  const unsigned flags = blocking ? cudaStreamDefault : cudaStreamNonBlocking;
  int least = 0, greatest = 0;
  if (urgent && cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess) greatest = 0;
  const int priority = urgent ? greatest : 0;
  return cudaStreamCreateWithPriority(&stream, flags, priority) == cudaSuccess ? stream : nullptr;
}

}  // namespace mambatrt
