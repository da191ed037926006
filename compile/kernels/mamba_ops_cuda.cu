// CUDA kernels of MambaConv, MambaScan, MambaAddNorm16 and MambaLinear (shapes in mamba_ops.h; MambaLinear's kernel in
// mamba_linear.cuh), launched on onnxruntime's stream so that they
// are ordered with its other kernels and captured into its CUDA graphs.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mamba_linear.cuh"
#include "mamba_linear_blas.cuh"
#include "mamba_ops.h"

namespace mambatrt {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = 2^(x log2(e))

// 2^x in one MUFU.EX2 (relative error ~2^-22; expf's accurate reduction is 9 instructions, and the scan of a chunk
// is bound by issuing instructions: ncu, session 17)
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// silu with ex2 and a fast division: the chunk kernel's (its y differs from silu's by a few ulp)
__device__ __forceinline__ float silu_ex2(float x) { return __fdividef(x, 1.0f + ex2(-x * kLog2e)); }
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

// One thread per (sequence, channel, kConvRows rows): each output row is independent (K taps over the K-1 past
// columns and the chunk's inputs), so a long chunk is as parallel as a batch of sequences. A thread keeps its rows'
// window of kConvRows + K - 1 columns in registers, each loaded once: one row per thread read every column K times
// and made a 64-row chunk of 16 prompts 12288 blocks of short threads (15 us per layer on an H200, its time mostly
// the blocks' load latency). Each row's sum is the same expression as before, so the same bits.
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

// The scan for one row per sequence (a decode step). LANES lanes per channel, each owning NS / LANES consecutive
// state elements (NS: N rounded up to a power of two; loaded and stored as float4 when they come in fours), SEQS
// sequences per thread; the dt projection is split over the lanes and both dot products are summed with shuffles
// inside the LANES-lane group; no shared memory and no barrier. Every load of all SEQS sequences is issued before
// any computing, so each thread waits on memory once. A step is bound by memory latency, not bandwidth (a batch of
// 64 moves ~13 MB per layer, a few microseconds of bandwidth): one lane per state element (LANES 16) took 18 us
// per layer at batch 64 (1.5M threads in several waves), four lanes of four elements 9.9 us and with two sequences
// per thread 8.6 us; up to batch 8 the mappings take 4-5 us alike (scripts/scan_step_bench.cu, BENCHMARKS.md,
// session 11). The dt sum is split the same way at every batch, so a sequence gets the same bits alone or batched.
// Ex2: each exponential (and silu's) one MUFU.EX2, as in the chunk kernel, so that a decode step and a prefill row
// round alike; false: expf's accurate reduction (scripts/scan_step_bench.cu times both).
constexpr int kStepLanes = 4;
constexpr int64_t kStepPairBatch = 32;  // from this batch on, two sequences per thread

template <int NS, int LANES, int SEQS, bool Half, bool Ex2 = true>
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
  float A[EPL] = {};  // A, or A log2(e) for ex2: exp(dt A) = 2^(dt A log2(e))
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
    for (int j = 0; j < EPL; ++j) {
      A[j] = n0 + j < N ? a.a[e * N + n0 + j] : 0.0f;
      if constexpr (Ex2) A[j] *= kLog2e;
    }
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
      h[i][j] = (Ex2 ? ex2(dt * A[j]) : expf(dt * A[j])) * h[i][j] + du * bn[i][j];
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
    if (lane == 0) store<Half>(a.y, b * E + e, (p[i] + dskip * u[i]) * (Ex2 ? silu_ex2(z[i]) : silu(z[i])));
  }
}

template <int NS, int LANES, int SEQS, bool Half, bool Ex2 = true>
void launch_step_lanes(const ScanArgs& a, cudaStream_t stream) {
  dim3 grid(unsigned((a.inner * LANES + kThreads - 1) / kThreads), unsigned((a.batch + SEQS - 1) / SEQS));
  scan_step_lanes_kernel<NS, LANES, SEQS, Half, Ex2><<<grid, kThreads, 0, stream>>>(a);
}

// The step with float4 loads throughout (session 27), for state sizes whose lanes hold whole float4s (N == NS, NS
// / LANES a multiple of 4: mamba's N 16 at four lanes). As the kernel above, but each lane sums a contiguous run of
// rank / LANES dt inputs (the kernel above strides them by LANES), so that the dt weights and inputs come as float4s
// (when rank is a multiple of 4 x LANES; else contiguous scalars) as A, B, C and the state do; the state, B, C, u
// and z of all SEQS sequences are loaded before the dt sums. The kernel above issues ~60 loads per thread at
// mamba-130m's shapes and two sequences per thread, ~20 here. The dt sum's order is fixed by the rank alone, so a
// sequence gets the same bits alone or batched; it differs from the kernel above's within fp32 rounding. At
// mamba-130m's shapes on an H200: 6.3 against 8.5 us per layer at batch 64, 3.2 against 3.2-3.5 at batch 1
// (scripts/scan_step_bench.cu, BENCHMARKS.md session 27). The kernel above remains for the other state sizes.
constexpr int kDtRound = 3;  // float4s of dt inputs per lane and sequence in flight at once (mamba-130m's 12)

__device__ __forceinline__ float4 load4(const float* p, int n) {  // p[0..n), zero past n
  return make_float4(n > 0 ? p[0] : 0.0f, n > 1 ? p[1] : 0.0f, n > 2 ? p[2] : 0.0f, n > 3 ? p[3] : 0.0f);
}

// s[i] += x_i[0..n) . w[0..n) for the SEQS sequences' rows x_0 + i X (those from `left` on count as zero), RV float4s
// of each at a time, all loaded before the sums. Exact: n == 4 RV and aligned, whole float4s without predicates
// (the loads of a fixed count issue as one batch: counted at run time, the step took 7.8 us per layer at batch 64
// against 6.3 on an H200, scripts/scan_step_bench.cu); else float4s when vec, contiguous scalars otherwise, zero
// past n.
template <int SEQS, int RV, bool Exact>
__device__ __forceinline__ void dt_sums(float (&s)[SEQS], const float* w, const float* x0, int64_t X, int left, int n,
                                        bool vec) {
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float4 wv[RV], xv[SEQS][RV];
#pragma unroll
  for (int k = 0; k < RV; ++k) {
    const int r = 4 * k;
    if constexpr (Exact) {
      wv[k] = n > 0 ? *reinterpret_cast<const float4*>(w + r) : zero;
    } else {
      wv[k] = vec ? (r < n ? *reinterpret_cast<const float4*>(w + r) : zero) : load4(w + r, n - r);
    }
#pragma unroll
    for (int i = 0; i < SEQS; ++i) {
      const float* x = x0 + i * X + r;
      if constexpr (Exact) {
        xv[i][k] = n > 0 && i < left ? *reinterpret_cast<const float4*>(x) : zero;
      } else {
        xv[i][k] = i >= left ? zero : vec ? (r < n ? *reinterpret_cast<const float4*>(x) : zero) : load4(x, n - r);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < SEQS; ++i) {
#pragma unroll
    for (int k = 0; k < RV; ++k) {  // zeros past n add nothing: the order is the rank's alone
      s[i] += xv[i][k].x * wv[k].x;
      s[i] += xv[i][k].y * wv[k].y;
      s[i] += xv[i][k].z * wv[k].z;
      s[i] += xv[i][k].w * wv[k].w;
    }
  }
}

// Whether each lane's dt inputs (rank / LANES of them, consecutive) are whole, aligned float4s
template <int LANES>
__host__ __device__ __forceinline__ bool dt_float4s(const ScanArgs& a) {
  return a.rank % (4 * LANES) == 0 && reinterpret_cast<uintptr_t>(a.dt_weight) % 16 == 0;
}

// RV: the lane's dt inputs as exactly RV float4s (rank == 4 RV LANES), or 0: any rank, in rounds of kDtRound.
// (Bounding the registers with __launch_bounds__ for 64 or 80 made it slower: BENCHMARKS.md, session 27.)
// Stream: the states loaded and stored with the streaming cache hints (ld.global.cs, st.global.cs: evict first),
// as each is touched once a step (scripts/scan_step_bench.cu times both; the same arithmetic).
template <int NS, int LANES, int SEQS, bool Half, int RV, bool Stream = false>
__global__ void scan_step_vec_kernel(ScanArgs a) {
  constexpr int EPL = NS / LANES, V = EPL / 4;  // state elements per lane, as float4s
  static_assert(EPL % 4 == 0 && EPL * LANES == NS, "whole float4s of state elements per lane");
  const int b0 = blockIdx.y * SEQS;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int e = tid / LANES, lane = tid % LANES;
  const int E = int(a.inner), R = int(a.rank), X = int(a.xdbl_width), Z = int(a.xz_width);
  const bool channel = e < E;
  const int left = int(a.batch) - b0;
  const int n0 = lane * EPL;
  float4 av[V], hv[SEQS][V], bv[SEQS][V], cv[SEQS][V];
  float u[SEQS] = {}, z[SEQS] = {}, s[SEQS] = {};
  if (channel) {
#pragma unroll
    for (int k = 0; k < V; ++k) av[k] = reinterpret_cast<const float4*>(a.a + int64_t(e) * NS + n0)[k];
  }
#pragma unroll
  for (int i = 0; i < SEQS; ++i) {
    if (!(channel && i < left)) continue;
    const int64_t b = b0 + i;
    const float* row = a.xdbl + b * X;
    const float4* hp = reinterpret_cast<const float4*>(a.past + (b * E + e) * NS + n0);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      hv[i][k] = Stream ? __ldcs(hp + k) : hp[k];
      bv[i][k] = reinterpret_cast<const float4*>(row + R + n0)[k];
      cv[i][k] = reinterpret_cast<const float4*>(row + R + NS + n0)[k];
    }
    u[i] = a.u[b * E + e];
    z[i] = load<Half>(a.xz, b * Z + Z - E + e);
  }
  // this lane's dt inputs: [r0, r0 + rn)
  const int rpl = (R + LANES - 1) / LANES, r0 = lane * rpl, rn = channel ? max(0, min(R - r0, rpl)) : 0;
  const float* w = a.dt_weight + int64_t(e) * R + r0;
  const float* x0 = a.xdbl + int64_t(b0) * X + r0;
  if constexpr (RV > 0) {
    dt_sums<SEQS, RV, true>(s, w, x0, X, left, rn, true);
  } else {
    const bool vec = dt_float4s<LANES>(a);
    for (int c = 0; c < rn; c += 4 * kDtRound) dt_sums<SEQS, kDtRound, false>(s, w + c, x0 + c, X, left, rn - c, vec);
  }
  const float bias = channel ? a.dt_bias[e] : 0.0f, dskip = channel ? a.d[e] : 0.0f;
#pragma unroll
  for (int i = 0; i < SEQS; ++i) {
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) s[i] += __shfl_xor_sync(0xffffffffu, s[i], off, LANES);
    const bool mine = channel && i < left;
    const float dt = mine ? softplus(s[i] + bias) : 0.0f, du = dt * u[i];
    float p = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float4& h = hv[i][k];
      const float4 A = av[k], B = bv[i][k], C = cv[i][k];
      h.x = ex2(dt * (A.x * kLog2e)) * h.x + du * B.x;
      h.y = ex2(dt * (A.y * kLog2e)) * h.y + du * B.y;
      h.z = ex2(dt * (A.z * kLog2e)) * h.z + du * B.z;
      h.w = ex2(dt * (A.w * kLog2e)) * h.w + du * B.w;
      p += h.x * C.x;
      p += h.y * C.y;
      p += h.z * C.z;
      p += h.w * C.w;
    }
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off, LANES);
    if (!mine) continue;
    const int64_t b = b0 + i;
    float4* out = reinterpret_cast<float4*>(a.present + (b * E + e) * NS + n0);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if constexpr (Stream) {
        __stcs(out + k, hv[i][k]);
      } else {
        out[k] = hv[i][k];
      }
    }
    if (lane == 0) store<Half>(a.y, b * E + e, (p + dskip * u[i]) * silu_ex2(z[i]));
  }
}

// Whether the float4 step applies: whole float4s of state elements per lane, the state's rows and xdbl's B and C
// 16-byte aligned. Shapes and base addresses only, never the batch: a sequence takes the same kernel alone or
// batched.
template <int NS>
bool step_vec_fits(const ScanArgs& a) {
  const uintptr_t bases = reinterpret_cast<uintptr_t>(a.past) | reinterpret_cast<uintptr_t>(a.present) |
                          reinterpret_cast<uintptr_t>(a.xdbl) | reinterpret_cast<uintptr_t>(a.a);
  return a.state == NS && a.xdbl_width % 4 == 0 && a.rank % 4 == 0 && bases % 16 == 0;
}

template <int NS, int LANES, int SEQS, bool Half, int RV, bool Stream = false>
void launch_step_vec(const ScanArgs& a, cudaStream_t stream) {
  dim3 grid(unsigned((a.inner * LANES + kThreads - 1) / kThreads), unsigned((a.batch + SEQS - 1) / SEQS));
  scan_step_vec_kernel<NS, LANES, SEQS, Half, RV, Stream><<<grid, kThreads, 0, stream>>>(a);
}

// The float4 step with its dt inputs' count fixed where mamba's ranks give whole float4s per lane (48, 64, 96 at
// four lanes: mamba-130m, 370m, 790m), else counted at run time. The rank alone decides, never the batch.
template <int NS, int LANES, int SEQS, bool Half, bool Stream = false>
void launch_step_vec_rank(const ScanArgs& a, cudaStream_t stream) {
  switch (dt_float4s<LANES>(a) ? a.rank / (4 * LANES) : 0) {
    case 3:
      return launch_step_vec<NS, LANES, SEQS, Half, 3, Stream>(a, stream);
    case 4:
      return launch_step_vec<NS, LANES, SEQS, Half, 4, Stream>(a, stream);
    case 6:
      return launch_step_vec<NS, LANES, SEQS, Half, 6, Stream>(a, stream);
    default:
      return launch_step_vec<NS, LANES, SEQS, Half, 0, Stream>(a, stream);
  }
}

// The scan of a chunk of rows (prefill). A block takes CH channels of one sequence, LANES lanes per channel (each
// lane EPL state elements in registers, as in the step kernel), and walks the rows kStage at a time in four phases:
//   1. the stage's dt inputs, B, C (zero past N), u and z copied to shared memory, every load of a thread issued
//      before its stores;
//   2. dt = softplus(x_dt . dt_weight[e] + dt_bias[e]) for every (row, channel): the block's dt weights are staged
//      once, transposed ([R][CH + 1], a warp's channels on distinct banks), and each thread takes one channel and
//      several rows, four weights in registers against float4 loads of the rows (broadcast to the warp);
//   3. the recurrence: each lane walks the rows, h = exp(dt A) h + (dt u) B for its elements, and the lanes'
//      sums of h C meet by shuffles; only the update of h depends on the previous row, so the unrolled rows'
//      loads and exponentials are in flight together;
//   4. y = (sum + D u) * silu(z) for every (row, channel), stored coalesced.
// dt is summed in the order of the sequential reference kernel (scripts/scan_step_bench.cu: one lane per state
// element, 8 channels per block), the exponentials are one MUFU.EX2 each (the states differ from the reference's
// by ~2e-6 at mamba-130m's shapes). The reference took 105 us per layer for 16 sequences of 64 rows on an H200,
// this kernel 31 us: the chunk scan is bound by issuing instructions, and ncu's per-instruction counts showed where
// they went (BENCHMARKS.md, session 17).
template <int NS, int LANES>
struct RowsShape {
  static_assert(LANES >= 1 && NS % LANES == 0, "LANES must divide NS");
  static constexpr int EPL = NS / LANES;                    // state elements per lane
  static constexpr int CH = kThreads / LANES;               // channels per block
  static constexpr int kStage = CH >= 16 ? 32 * 32 / CH : 64;  // rows per stage: <= 16 KiB of [kStage][CH] arrays
};

template <int NS, int LANES, bool Half>
__global__ void __launch_bounds__(kThreads, 6) scan_rows_kernel(ScanArgs a) {  // 6 blocks: the shared memory's bound
  using S = RowsShape<NS, LANES>;
  constexpr int EPL = S::EPL, CH = S::CH, WP = CH + 1, kStage = S::kStage;
  constexpr int kRowStep = kThreads / CH, kMine = kStage / kRowStep;  // phases 2 and 4: rows per thread
  __shared__ float s_u[kStage][CH];
  __shared__ float s_z[kStage][CH];
  __shared__ float s_dt[kStage][CH];
  __shared__ float s_y[kStage][CH];  // the lanes' sum of h C
  __shared__ __align__(16) float s_b[kStage][NS];  // B and C of the stage's rows, zero past N: phase 3's
  __shared__ __align__(16) float s_c[kStage][NS];  // loads need no bounds checks (a branch per element)
  extern __shared__ __align__(16) float s_dyn[];
  // sizes as int (64-bit index arithmetic is several instructions per index)
  const int b = blockIdx.y, E = int(a.inner), N = int(a.state), R = int(a.rank), T = int(a.rows);
  const int X = int(a.xdbl_width), Z = int(a.xz_width), RP = (R + 3) / 4 * 4;  // RP: R padded to float4s
  float* s_w = s_dyn;            // [RP][WP]: dt_weight of the block's channels, transposed, zero past R
  float* s_x = s_dyn + RP * WP;  // [kStage][RP]: the stage's dt inputs, zero past R
  const int e0 = blockIdx.x * CH;
  const int width = E - e0 < CH ? E - e0 : CH;  // the block's channels
  // Staging loops map threads to elements without dividing by a runtime size (a division per element made phase 1
  // 40 % of the kernel's instructions) and issue all of a thread's loads before its stores (a load and its store
  // one at a time wait on memory for each: the compiler cannot move a load past a store it may alias).
  const int wl = threadIdx.x % 32, wi = threadIdx.x / 32;  // lane in the warp, warp
  constexpr int kWarps = kThreads / 32;
  const float* __restrict__ dt_weight = a.dt_weight + int64_t(e0) * R;
  for (int k0 = 0; k0 < RP; k0 += 32) {  // warp wi: channels wi, wi + kWarps, ...; its lanes: k0 + wl
    const int k = k0 + wl;
    float v[CH / kWarps];
#pragma unroll
    for (int m = 0; m < CH / kWarps; ++m) {
      const int ch = wi + m * kWarps;
      v[m] = ch < width && k < R ? dt_weight[ch * R + k] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < CH / kWarps; ++m) {
      if (k < RP) s_w[k * WP + wi + m * kWarps] = v[m];
    }
  }
  // phase 3's thread: channel c, lane `lane`, state elements n0..n0+EPL-1
  const int c = threadIdx.x / LANES, lane = threadIdx.x % LANES, n0 = lane * EPL;
  const int64_t e = e0 + c;
  const bool channel = c < width;
  float h[EPL], A2[EPL];  // A2: A log2(e), so that exp(dt A) is one ex2 of dt A2
  // whole, aligned float4s of the thread's elements (scalar loads of 4 consecutive floats per thread: 4x the sectors)
  const bool vec = EPL % 4 == 0 && N == NS &&
                   (reinterpret_cast<uintptr_t>(a.past) | reinterpret_cast<uintptr_t>(a.present) |
                    reinterpret_cast<uintptr_t>(a.a)) % 16 == 0;
  const float* past = a.past + (int64_t(b) * E + e) * N + n0;
  const float* A = a.a + e * N + n0;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    if (vec && j % 4 == 0) {
      const float4 hv = channel ? *reinterpret_cast<const float4*>(past + j) : make_float4(0, 0, 0, 0);
      const float4 av = channel ? *reinterpret_cast<const float4*>(A + j) : make_float4(0, 0, 0, 0);
      h[j] = hv.x, h[j + 1] = hv.y, h[j + 2] = hv.z, h[j + 3] = hv.w;
      A2[j] = av.x, A2[j + 1] = av.y, A2[j + 2] = av.z, A2[j + 3] = av.w;
    } else if (!vec) {
      const bool own = channel && n0 + j < N;
      h[j] = own ? past[j] : 0.0f;
      A2[j] = own ? A[j] : 0.0f;
    }
  }
#pragma unroll
  for (int j = 0; j < EPL; ++j) A2[j] *= kLog2e;
  // phases 2 and 4's thread: channel cc, rows r0, r0 + kRowStep, ...
  const int cc = threadIdx.x % CH, r0 = threadIdx.x / CH;
  const bool in = cc < width;
  const float bias = in ? a.dt_bias[e0 + cc] : 0.0f, dskip = in ? a.d[e0 + cc] : 0.0f;
  for (int t0 = 0; t0 < T; t0 += kStage) {
    const int rows = T - t0 < kStage ? T - t0 : kStage;
    const int64_t row0 = int64_t(b) * T + t0;
    const float* __restrict__ xdbl = a.xdbl + row0 * X;
    const float* __restrict__ u = a.u + row0 * E + e0;
    for (int k0 = 0; k0 < RP; k0 += 32) {  // phase 1: the dt inputs, warp wi rows wi, wi + kWarps, ...
      constexpr int M = (kStage + kWarps - 1) / kWarps;
      const int k = k0 + wl;
      float v[M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int r = wi + m * kWarps;
        v[m] = r < rows && k < R ? xdbl[r * X + k] : 0.0f;
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int r = wi + m * kWarps;
        if (r < rows && k < RP) s_x[r * RP + k] = v[m];
      }
    }
    {  // B and C: thread n = tid % NS of rows tid / NS, + kThreads / NS, ...
      constexpr int kStep = kThreads / NS, M = (kStage + kStep - 1) / kStep;
      const int n = threadIdx.x % NS, rb = threadIdx.x / NS;
      float vb[M], vc[M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int r = rb + m * kStep;
        vb[m] = r < rows && n < N ? xdbl[r * X + R + n] : 0.0f;
        vc[m] = r < rows && n < N ? xdbl[r * X + R + N + n] : 0.0f;
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int r = rb + m * kStep;
        if (r < rows) s_b[r][n] = vb[m], s_c[r][n] = vc[m];
      }
    }
    {  // u and z: the thread's channel cc, rows r0, r0 + kRowStep, ...
      const int64_t z0 = row0 * Z + Z - E + e0 + cc;
      float vu[kMine], vz[kMine];
#pragma unroll
      for (int m = 0; m < kMine; ++m) {
        const int r = r0 + m * kRowStep;
        vu[m] = in && r < rows ? u[r * E + cc] : 0.0f;
        vz[m] = in && r < rows ? load<Half>(a.xz, z0 + r * Z) : 0.0f;
      }
#pragma unroll
      for (int m = 0; m < kMine; ++m) {
        const int r = r0 + m * kRowStep;
        if (r < rows) s_u[r][cc] = vu[m], s_z[r][cc] = vz[m];
      }
    }
    __syncthreads();
    {  // phase 2: four dt weights at a time in registers against the thread's rows (float4 loads, broadcast)
      float sum[kMine] = {};
      for (int k = 0; k < RP; k += 4) {
        const float w0 = s_w[k * WP + cc], w1 = s_w[(k + 1) * WP + cc], w2 = s_w[(k + 2) * WP + cc],
                    w3 = s_w[(k + 3) * WP + cc];
#pragma unroll
        for (int j = 0; j < kMine; ++j) {  // rows past `rows` read stale inputs; never stored
          const float4 x = *reinterpret_cast<const float4*>(s_x + (r0 + j * kRowStep) * RP + k);
          sum[j] += x.x * w0;  // in k's order, as the sequential reference
          sum[j] += x.y * w1;
          sum[j] += x.z * w2;
          sum[j] += x.w * w3;
        }
      }
#pragma unroll
      for (int j = 0; j < kMine; ++j) {
        if (r0 + j * kRowStep < rows) s_dt[r0 + j * kRowStep][cc] = in ? softplus(sum[j] + bias) : 0.0f;
      }
    }
    __syncthreads();
    auto step = [&](int r) {  // phase 3, one row
      const float dt = s_dt[r][c], du = dt * s_u[r][c];
      float p = 0.0f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {  // past N: A, B, C and so h are 0
        h[j] = ex2(dt * A2[j]) * h[j] + du * s_b[r][n0 + j];
        p += h[j] * s_c[r][n0 + j];
      }
#pragma unroll
      for (int off = LANES / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off, LANES);
      if (lane == 0) s_y[r][c] = p;
    };
    if (rows == kStage) {
#pragma unroll
      for (int r = 0; r < kStage; ++r) step(r);
    } else {
      for (int r = 0; r < rows; ++r) step(r);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kMine; ++j) {  // phase 4
      const int r = r0 + j * kRowStep;
      if (in && r < rows) {
        store<Half>(a.y, (row0 + r) * E + e0 + cc, (s_y[r][cc] + dskip * s_u[r][cc]) * silu_ex2(s_z[r][cc]));
      }
    }
    __syncthreads();  // the next stage reuses the shared arrays
  }
  float* present = a.present + (int64_t(b) * E + e) * N + n0;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    if (vec && j % 4 == 0 && channel) {
      *reinterpret_cast<float4*>(present + j) = make_float4(h[j], h[j + 1], h[j + 2], h[j + 3]);
    } else if (!vec && channel && n0 + j < N) {
      present[j] = h[j];
    }
  }
}

// The chunk kernel's opt-in to more than 48 KiB of shared memory (a dt rank above ~110 stages more dt weights and
// inputs than fit below that), up to the device's limit, once per kernel and process: from scan_prepare at a
// session's load (outside any CUDA graph capture, as linear_prepare), else at the first launch that needs it (the
// benches).
template <int NS, int LANES, bool Half>
cudaError_t rows_shared_limit() {
  static const cudaError_t err = [] {
    const auto kernel = scan_rows_kernel<NS, LANES, Half>;
    const int optin = mambatrt_linear::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
    cudaFuncAttributes attributes;
    cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e == cudaSuccess) {
      const int dynamic = optin - int(attributes.sharedSizeBytes);
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic);
    }
    if (e != cudaSuccess) cudaGetLastError();  // cleared: launches within 48 KiB must not report it; larger ones fail
    return e;
  }();
  return err;
}

template <int NS, int LANES, bool Half>
void launch_rows(const ScanArgs& a, cudaStream_t stream) {
  using S = RowsShape<NS, LANES>;
  const size_t padded = size_t(a.rank + 3) / 4 * 4;
  const size_t dynamic = sizeof(float) * padded * (S::CH + 1 + S::kStage);
  const size_t fixed = sizeof(float) * S::kStage * (4 * S::CH + 2 * NS);
  if (fixed + dynamic > 48 * 1024) rows_shared_limit<NS, LANES, Half>();  // a failure shows in the launch's error
  dim3 grid(unsigned((a.inner + S::CH - 1) / S::CH), unsigned(a.batch));
  scan_rows_kernel<NS, LANES, Half><<<grid, kThreads, dynamic, stream>>>(a);
}

// The chunk kernel's blocks for a launch of few sequences (48 of four lanes per sequence at mamba-130m's 1536
// channels) leave most SMs idle and each block walks its rows alone: there eight lanes per channel (twice the
// blocks, each lane half the elements) run faster (1 x 64 rows: 13.4 against 18.1 us on an H200; 4 x 64: 16.4
// against 19.9; 16 x 64: 47.4 against 31.2; scripts/scan_step_bench.cu, BENCHMARKS.md session 18). The lanes
// split h C's sums differently, so a prompt's bits depend on how many share its launch (by fp32 rounding, as the
// prefill's projections already do from 16 rows on, where CUTLASS's tile configs change with the rows).
inline bool few_chunks(const ScanArgs& a) {
  static const int sms = mambatrt_linear::device_attribute(cudaDevAttrMultiProcessorCount);
  constexpr int64_t kChannels8 = kThreads / 8;  // a block's channels at eight lanes
  return a.batch * ((a.inner + kChannels8 - 1) / kChannels8) <= 4 * int64_t(sms);
}

// The chunk kernel's lanes per channel for state size L (rounded up to a power of two): those of the step kernel,
// or more for launches of few sequences (few_chunks)
template <int L>
struct RowsLanes {
  static constexpr int lanes = L < kStepLanes ? L : kStepLanes, few = L < 8 ? L : 8;
};

template <int L, bool Half>
void launch_scan(const ScanArgs& a, cudaStream_t stream) {
  constexpr int lanes = RowsLanes<L>::lanes, few = RowsLanes<L>::few;
  if constexpr (L / lanes % 4 == 0) {  // whole float4s of state elements per lane
    if (a.rows == 1 && step_vec_fits<L>(a)) {
      if (a.batch >= kStepPairBatch) {  // streaming the states (ld/st.global.cs), the same arithmetic: at batch 64
        // with the states from memory 7.3 against 7.9 us per layer on an H200, at 128 11.4 against 12.0, at 32 the
        // same (scan_step_bench cold, BENCHMARKS.md session 30; served, within the machine's spread)
        launch_step_vec_rank<L, lanes, 2, Half, true>(a, stream);
      } else {
        launch_step_vec_rank<L, lanes, 1, Half>(a, stream);
      }
      return;
    }
  }
  if (a.rows == 1 && a.batch >= kStepPairBatch) {
    launch_step_lanes<L, lanes, 2, Half>(a, stream);
  } else if (a.rows == 1) {
    launch_step_lanes<L, lanes, 1, Half>(a, stream);
  } else if (few > lanes && few_chunks(a)) {
    launch_rows<L, few, Half>(a, stream);
  } else {
    launch_rows<L, lanes, Half>(a, stream);
  }
}

template <int L, bool Half>
cudaError_t prepare_rows() {
  const cudaError_t err = rows_shared_limit<L, RowsLanes<L>::lanes, Half>();
  return err != cudaSuccess ? err : rows_shared_limit<L, RowsLanes<L>::few, Half>();
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

static std::atomic<int64_t> g_split_products{0};
int64_t linear_split_products() { return g_split_products.load(std::memory_order_relaxed); }

// Products of many rows through cuBLAS's TF32 GEMMs on split operands where that wins and its buffers are ready
// (mamba_linear_blas.cuh: the node's split weight kept in a.state), else MambaLinear's own kernels and CUTLASS's
const char* linear_cuda(const LinearArgs& a, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int M = int(a.rows), N = int(a.out), K = int(a.in);
  cudaError_t err = cudaSuccess;
  if (a.state != nullptr && mambatrt_blas::wins(a.x, a.weight, a.y, M, N, K) && mambatrt_blas::api().ok) {
    if (*a.state == nullptr) *a.state = new mambatrt_blas::Weights;
    auto& weights = *static_cast<mambatrt_blas::Weights*>(*a.state);
    if (mambatrt_blas::launch(weights, a.x, a.weight, a.y, M, N, K, s, &err)) {
      g_split_products.fetch_add(1, std::memory_order_relaxed);
      return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
    }
  }
  err = mambatrt_linear::launch(a.x, a.weight, nullptr, a.y, M, N, K, s);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

void linear_release(void* state) { delete static_cast<mambatrt_blas::Weights*>(state); }

const char* scan_prepare() {
  const cudaError_t errors[] = {prepare_rows<1, false>(),  prepare_rows<2, false>(),  prepare_rows<4, false>(),
                                prepare_rows<8, false>(),  prepare_rows<16, false>(), prepare_rows<32, false>(),
                                prepare_rows<1, true>(),   prepare_rows<2, true>(),   prepare_rows<4, true>(),
                                prepare_rows<8, true>(),   prepare_rows<16, true>(),  prepare_rows<32, true>()};
  for (const cudaError_t err : errors) {
    if (err != cudaSuccess) return cudaGetErrorString(err);
  }
  return nullptr;
}

const char* linear_prepare() {
  const cudaError_t err = mambatrt_linear::prepare();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// -- sampling ------------------------------------------------------------------------------------------------------
// One token per row of logits [rows, stride] (its first `vocab` columns), as the host's sample_token picks it for a
// row with temperature alone (runtime/generate.py): temperature 0, the first index of the largest logit; else, in
// float64, p = exp(x / T - max(x / T)), cdf = its running sum in index order, and the first index whose cdf exceeds
// u x cdf[vocab - 1] (the last index when rounding leaves none). A thread sums a contiguous run of indices, so the
// running sum adds in index order, grouped by runs (the host's inverse_cdf groups by blocks of 64): the pick can
// differ from the host's only where u x total falls within rounding (~1e-16 relative) of a boundary. Why on the
// device: a host pick needs the row's logits copied over and a pass of numpy over the vocabulary per row, which at
// 64 rows of a 50k vocabulary took ten times the decode launch (BENCHMARKS.md, session 21).
constexpr int kSampleThreads = 512;

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* logits, int64_t stride, int64_t vocab, const double* params, int64_t* out) {
  __shared__ double scratch[kSampleThreads / 32];
  __shared__ double prefix[kSampleThreads];
  __shared__ int64_t found[kSampleThreads / 32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * stride;
  const double t = params[2 * row], u = params[2 * row + 1];
  const int64_t per = (vocab + kSampleThreads - 1) / kSampleThreads;
  const int64_t begin = min(vocab, int64_t(threadIdx.x) * per), end = min(vocab, begin + per);
  int64_t pick = vocab;  // this thread's candidate; the smallest over the block wins
  if (t == 0.0) {
    float best = -INFINITY;
    for (int64_t i = begin; i < end; ++i) {
      if (pick == vocab || x[i] > best) best = x[i], pick = i;
    }
    // the largest value, the smallest index among equals: warp by warp, then across warps through shared memory
    for (int o = 16; o > 0; o >>= 1) {
      const float b = __shfl_xor_sync(0xffffffffu, best, o);
      const int64_t p = __shfl_xor_sync(0xffffffffu, pick, o);
      if (p != vocab && (pick == vocab || b > best || (b == best && p < pick))) best = b, pick = p;
    }
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = best, found[threadIdx.x >> 5] = pick;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kSampleThreads / 32; ++w) {
        const double b = scratch[w];
        const int64_t p = found[w];
        if (p != vocab && (pick == vocab || b > best || (b == best && p < pick))) best = b, pick = p;
      }
      out[row] = pick == vocab ? 0 : pick;
    }
    return;
  }
  double m = -INFINITY;
  for (int64_t i = begin; i < end; ++i) m = fmax(m, double(x[i]) / t);
  for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  for (int w = 0; w < kSampleThreads / 32; ++w) m = fmax(m, scratch[w]);
  double sum = 0.0;
  for (int64_t i = begin; i < end; ++i) sum += exp(double(x[i]) / t - m);
  prefix[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {  // the runs' sums in index order (512 adds: a few microseconds, once per row)
    double run = 0.0;
    for (int k = 0; k < kSampleThreads; ++k) {
      const double s = prefix[k];
      prefix[k] = run;
      run += s;
    }
    scratch[0] = run;
  }
  __syncthreads();
  const double target = u * scratch[0];
  double c = prefix[threadIdx.x];
  for (int64_t i = begin; i < end; ++i) {
    c += exp(double(x[i]) / t - m);
    if (c > target) {
      pick = i;
      break;
    }
  }
  for (int o = 16; o > 0; o >>= 1) pick = min(pick, __shfl_xor_sync(0xffffffffu, pick, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) found[threadIdx.x >> 5] = pick;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kSampleThreads / 32; ++w) pick = min(pick, found[w]);
    out[row] = min(pick, vocab - 1);
  }
}

// Device buffers for sample_cuda's draws and picks, one per stream, grown as needed: the engine's decode thread
// (first tokens onward) and its prefill thread (a prompt's first token) sample on streams of their own at once.
struct SampleScratch {
  void* stream;
  void* buffer;
  int64_t capacity;
};

const char* sample_cuda(const float* logits, int64_t rows, int64_t stride, int64_t vocab, const double* params,
                        int64_t* picks, void* stream) {
  static std::mutex lock;
  static std::vector<SampleScratch> scratches;
  void* scratch = nullptr;
  int64_t capacity = 0;
  {
    std::lock_guard<std::mutex> guard(lock);
    const auto same = [&](const SampleScratch& e) { return e.stream == stream; };
    auto it = std::find_if(scratches.begin(), scratches.end(), same);
    if (it == scratches.end()) it = scratches.insert(scratches.end(), SampleScratch{stream, nullptr, 0});
    if (rows > it->capacity) {
      if (it->buffer != nullptr) cudaFree(it->buffer);
      it->capacity = rows < 256 ? 256 : rows;
      if (cudaMalloc(&it->buffer, it->capacity * (2 * sizeof(double) + sizeof(int64_t))) != cudaSuccess) {
        it->buffer = nullptr, it->capacity = 0;
        return "cudaMalloc failed";
      }
    }
    scratch = it->buffer, capacity = it->capacity;
  }
  double* d_params = static_cast<double*>(scratch);
  int64_t* d_out = reinterpret_cast<int64_t*>(d_params + 2 * capacity);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemcpyAsync(d_params, params, rows * 2 * sizeof(double), cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) {
    sample_kernel<<<unsigned(rows), kSampleThreads, 0, s>>>(logits, stride, vocab, d_params, d_out);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpyAsync(picks, d_out, rows * sizeof(int64_t), cudaMemcpyDeviceToHost, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
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

// The driver's green-context calls are looked up at run time (cudaGetDriverEntryPointByVersion), not linked: the
// library then loads under any driver, and only this stream needs one of CUDA 12.4 or later. The green context
// lives as long as the process (its stream's sessions do too). Runtime-API launches and CUDA graph captures on its
// stream run in its partition; memory is the primary context's, shared with every other stream.
void* create_stream_on_sms(bool urgent, int sms, int* granted, const char** why) {
  *granted = 0;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetDevResource_v12040 get_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 split = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 describe = nullptr;
  PFN_cuGreenCtxCreate_v12040 create = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream_create = nullptr;
  const auto entry = [](const char* name, unsigned version, void** fn) {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const bool ok = cudaGetDriverEntryPointByVersion(name, fn, version, cudaEnableDefault, &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess && *fn != nullptr;
    if (!ok) cudaGetLastError();
    return ok;
  };
  if (!entry("cuDeviceGet", 2000, reinterpret_cast<void**>(&device_get)) ||
      !entry("cuDeviceGetDevResource", 12040, reinterpret_cast<void**>(&get_resource)) ||
      !entry("cuDevSmResourceSplitByCount", 12040, reinterpret_cast<void**>(&split)) ||
      !entry("cuDevResourceGenerateDesc", 12040, reinterpret_cast<void**>(&describe)) ||
      !entry("cuGreenCtxCreate", 12040, reinterpret_cast<void**>(&create)) ||
      !entry("cuGreenCtxStreamCreate", 12050, reinterpret_cast<void**>(&stream_create))) {
    *why = "the CUDA driver has no green contexts (needs CUDA 12.5 or later)";
    return nullptr;
  }
  int ordinal = 0;
  if (cudaGetDevice(&ordinal) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {  // the primary context, made
    *why = "no CUDA device";
    return nullptr;
  }
  CUdevice device;
  CUdevResource whole, part, rest;
  unsigned groups = 1;
  CUdevResourceDesc desc;
  CUgreenCtx green;
  CUstream stream = nullptr;
  if (device_get(&device, ordinal) != CUDA_SUCCESS ||
      get_resource(device, &whole, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS) {
    *why = "the device's SMs cannot be partitioned";
    return nullptr;
  }
  if (sms < 1 || unsigned(sms) >= whole.sm.smCount) {
    *why = "the SM count must be at least 1 and below the device's";
    return nullptr;
  }
  if (split(&part, &groups, &whole, &rest, 0, unsigned(sms)) != CUDA_SUCCESS || groups != 1 ||
      describe(&desc, &part, 1) != CUDA_SUCCESS ||
      create(&green, desc, device, CU_GREEN_CTX_DEFAULT_STREAM) != CUDA_SUCCESS) {
    *why = "the driver refused a partition of that many SMs";
    return nullptr;
  }
  int least = 0, greatest = 0;
  if (urgent && cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess) greatest = 0;
  if (stream_create(&stream, green, CU_STREAM_NON_BLOCKING, urgent ? greatest : 0) != CUDA_SUCCESS) {
    *why = "the driver could not create a stream in the partition";
    return nullptr;
  }
  *granted = int(part.sm.smCount);
  return stream;
}

}  // namespace mambatrt
