// CUDA kernels of MambaScan and MambaScan16 (shapes in mamba_ops.h): a step kernel for one row per sequence (decode)
// and a chunk kernel for a prefill's rows, launched on the stream onnxruntime gives the session, so that they are
// ordered with its other kernels and captured into its CUDA graphs.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "cuda_common.cuh"
#include "mamba_ops.h"

namespace mambatrt {
namespace {

// The step kernel's store of a sequence's new state elements n0 .. n0+EPL-1 (h) at present (as float4s where vec)
template <int EPL>
__device__ __forceinline__ void store_step_state(float* present, const float (&h)[EPL], int64_t N, int64_t n0,
                                                 bool vec) {
  if (vec) {
#pragma unroll
    for (int j = 0; j < EPL; j += 4)
      *reinterpret_cast<float4*>(present + j) = make_float4(h[j], h[j + 1], h[j + 2], h[j + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      if (n0 + j < N) present[j] = h[j];
    }
  }
}

// The scan for one row per sequence (a decode step). LANES lanes per channel, each owning NS / LANES consecutive state
// elements (NS: N rounded up to a power of two; loaded and stored as float4 when they come in fours), SEQS sequences
// per thread; the dt projection is split over the lanes and both dot products are summed with shuffles inside the
// LANES-lane group; no shared memory and no barrier. Every load of all SEQS sequences is issued before any computing,
// so each thread waits on memory once. A step is bound by memory latency, not bandwidth (a batch of 64 moves ~13 MB per
// layer, a few microseconds of bandwidth): one lane per state element (LANES 16) took 18 us per layer at batch 64 (1.5M
// threads in several waves), four lanes of four elements 9.9 us and with two sequences per thread 8.6 us; up to batch 8
// the mappings take 4-5 us alike (docs/benchmarks.md). The dt sum is split the same way at every batch, so a sequence
// gets the same bits alone or batched. Ex2: each exponential (and silu's) one MUFU.EX2, as in the chunk kernel, so that
// a decode step and a prefill row round alike; false: expf's accurate reduction.
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
    store_step_state<EPL>(a.present + (b * E + e) * N + n0, h[i], N, n0, vec);
    if (lane == 0) store<Half>(a.y, b * E + e, (p[i] + dskip * u[i]) * (Ex2 ? silu_ex2(z[i]) : silu(z[i])));
  }
}

template <int NS, int LANES, int SEQS, bool Half, bool Ex2 = true>
void launch_step_lanes(const ScanArgs& a, cudaStream_t stream) {
  dim3 grid(unsigned((a.inner * LANES + kThreads - 1) / kThreads), unsigned((a.batch + SEQS - 1) / SEQS));
  scan_step_lanes_kernel<NS, LANES, SEQS, Half, Ex2><<<grid, kThreads, 0, stream>>>(a);
}

// The step with float4 loads throughout, for state sizes whose lanes hold whole float4s (N == NS, NS / LANES a multiple
// of 4: mamba's N 16 at four lanes). As the kernel above, but each lane sums a contiguous run of rank / LANES dt inputs
// (the kernel above strides them by LANES), so that the dt weights and inputs come as float4s (when rank is a multiple
// of 4 x LANES; else contiguous scalars) as A, B, C and the state do; the state, B, C, u and z of all SEQS sequences
// are loaded before the dt sums. The kernel above issues ~60 loads per thread at mamba-130m's shapes and two sequences
// per thread, ~20 here. The dt sum's order is fixed by the rank alone, so a sequence gets the same bits alone or
// batched; it differs from the kernel above's within fp32 rounding. At mamba-130m's shapes on an H200: 6.3 against 8.5
// us per layer at batch 64, 3.2 against 3.2-3.5 at batch 1 (docs/benchmarks.md). The kernel above runs the other state
// sizes.
constexpr int kDtRound = 3;  // float4s of dt inputs per lane and sequence in flight at once (mamba-130m's 12)

__device__ __forceinline__ float4 load4(const float* p, int n) {  // p[0..n), zero past n
  return make_float4(n > 0 ? p[0] : 0.0f, n > 1 ? p[1] : 0.0f, n > 2 ? p[2] : 0.0f, n > 3 ? p[3] : 0.0f);
}

// s[i] += x_i[0..n) . w[0..n) for the SEQS sequences' rows x_0 + i X (those from `left` on count as zero), RV float4s
// of each at a time, all loaded before the sums. Exact: n == 4 RV and aligned, whole float4s without predicates (the
// loads of a fixed count issue as one batch: counted at run time, the step took 7.8 us per layer at batch 64 against
// 6.3 on an H200); else float4s when vec, contiguous scalars otherwise, zero past n.
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
// (Bounding the registers with __launch_bounds__ for 64 or 80 makes it slower: docs/benchmarks.md.)
// Stream: the states loaded and stored with the streaming cache hints (ld.global.cs, st.global.cs: evict first),
// as each is touched once a step (the same arithmetic).
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
// dt is summed in the order of a sequential reference kernel (one lane per state element, 8 channels per block), the
// exponentials are one MUFU.EX2 each (the states differ from the reference's by ~2e-6 at mamba-130m's shapes). The
// reference took 105 us per layer for 16 sequences of 64 rows on an H200, this kernel 31 us: the chunk scan is bound by
// issuing instructions, and ncu's per-instruction counts showed where they went (docs/benchmarks.md).
template <int NS, int LANES>
struct RowsShape {
  static_assert(LANES >= 1 && NS % LANES == 0, "LANES must divide NS");
  static constexpr int EPL = NS / LANES;                    // state elements per lane
  static constexpr int CH = kThreads / LANES;               // channels per block
  static constexpr int kStage = CH >= 16 ? 32 * 32 / CH : 64;  // rows per stage: <= 16 KiB of [kStage][CH] arrays
  static constexpr int kRowStep = kThreads / CH, kMine = kStage / kRowStep;  // phases 2 and 4: rows per thread
};

// The chunk kernel's staging loops map threads to elements without dividing by a runtime size (a division per element
// made phase 1 40 % of the kernel's instructions) and issue all of a thread's loads before its stores (a load and its
// store one at a time wait on memory for each: the compiler cannot move a load past a store it may alias). Sizes are
// ints (64-bit index arithmetic is several instructions per index).
constexpr int kWarps = kThreads / 32;

// Once per block: dt_weight of the block's channels (`width` of them from dt_weight's row 0), transposed into s_w
// [RP][CH + 1], zero past R. Warp wi takes channels wi, wi + kWarps, ...; its lanes (wl) k0 + wl.
template <int CH>
__device__ __forceinline__ void stage_dt_weights(float* s_w, const float* dt_weight, int R, int RP, int width, int wl,
                                                 int wi) {
  constexpr int WP = CH + 1;
  for (int k0 = 0; k0 < RP; k0 += 32) {
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
}

// Phase 3's thread's state elements n0 .. n0+EPL-1 of channel e into h, and A log2(e) into A2 (zero past N and for
// a thread without a channel); vec: as whole, aligned float4s (scalar loads of 4 consecutive floats per thread: 4x
// the sectors)
template <int EPL>
__device__ __forceinline__ void load_state(float (&h)[EPL], float (&A2)[EPL], const float* past, const float* A, int N,
                                           int n0, bool channel, bool vec) {
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
}

// Phase 1: the stage's dt inputs (`rows` rows of xdbl) into s_x [kStage][RP], zero past R; warp wi takes rows wi,
// wi + kWarps, ...
template <int kStage>
__device__ __forceinline__ void stage_dt_inputs(float* s_x, const float* xdbl, int rows, int R, int RP, int X, int wl,
                                                int wi) {
  for (int k0 = 0; k0 < RP; k0 += 32) {
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
}

// Phase 1: the stage's B and C into s_b and s_c, zero past N; thread n = tid % NS of rows tid / NS, + kThreads / NS
template <int NS, int kStage>
__device__ __forceinline__ void stage_b_c(float (&s_b)[kStage][NS], float (&s_c)[kStage][NS], const float* xdbl,
                                          int rows, int R, int N, int X) {
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

// Phase 1: u and z of the thread's channel cc (in: the block has it), rows r0, r0 + kRowStep, ... into s_u and s_z;
// z0: z's index of the stage's first row
template <typename S, bool Half>
__device__ __forceinline__ void stage_u_z(float (&s_u)[S::kStage][S::CH], float (&s_z)[S::kStage][S::CH],
                                          const float* u, const void* xz, int64_t z0, int rows, int E, int Z, int cc,
                                          int r0, bool in) {
  float vu[S::kMine], vz[S::kMine];
#pragma unroll
  for (int m = 0; m < S::kMine; ++m) {
    const int r = r0 + m * S::kRowStep;
    vu[m] = in && r < rows ? u[r * E + cc] : 0.0f;
    vz[m] = in && r < rows ? load<Half>(xz, z0 + r * Z) : 0.0f;
  }
#pragma unroll
  for (int m = 0; m < S::kMine; ++m) {
    const int r = r0 + m * S::kRowStep;
    if (r < rows) s_u[r][cc] = vu[m], s_z[r][cc] = vz[m];
  }
}

// Phase 2: dt of the thread's channel cc, rows r0, r0 + kRowStep, ..., into s_dt: four dt weights at a time in
// registers against the thread's rows (float4 loads, broadcast), summed in k's order as the sequential reference
template <typename S>
__device__ __forceinline__ void stage_dt(float (&s_dt)[S::kStage][S::CH], const float* s_x, const float* s_w, int rows,
                                         int RP, int cc, int r0, bool in, float bias) {
  constexpr int WP = S::CH + 1;
  float sum[S::kMine] = {};
  for (int k = 0; k < RP; k += 4) {
    const float w0 = s_w[k * WP + cc], w1 = s_w[(k + 1) * WP + cc], w2 = s_w[(k + 2) * WP + cc],
                w3 = s_w[(k + 3) * WP + cc];
#pragma unroll
    for (int j = 0; j < S::kMine; ++j) {  // rows past `rows` read stale inputs; never stored
      const float4 x = *reinterpret_cast<const float4*>(s_x + (r0 + j * S::kRowStep) * RP + k);
      sum[j] += x.x * w0;
      sum[j] += x.y * w1;
      sum[j] += x.z * w2;
      sum[j] += x.w * w3;
    }
  }
#pragma unroll
  for (int j = 0; j < S::kMine; ++j) {
    if (r0 + j * S::kRowStep < rows) s_dt[r0 + j * S::kRowStep][cc] = in ? softplus(sum[j] + bias) : 0.0f;
  }
}

// Phase 3: the recurrence over the stage's rows for the thread's channel c and elements n0 .., the lanes' sums of
// h C into s_y; Local (a span's end state alone, SpanArgs): no sums of h C, the rows' dt added to dt_sum instead
template <typename S, int NS, int LANES, bool Local = false>
__device__ __forceinline__ void stage_recurrence(float (&h)[S::EPL], const float (&A2)[S::EPL],
                                                 const float (&s_dt)[S::kStage][S::CH],
                                                 const float (&s_u)[S::kStage][S::CH],
                                                 const float (&s_b)[S::kStage][NS], const float (&s_c)[S::kStage][NS],
                                                 float (&s_y)[S::kStage][S::CH], int rows, int c, int lane, int n0,
                                                 float& dt_sum) {
  auto step = [&](int r) {  // one row
    const float dt = s_dt[r][c], du = dt * s_u[r][c];
    float p = 0.0f;
#pragma unroll
    for (int j = 0; j < S::EPL; ++j) {  // past N: A, B, C and so h are 0
      h[j] = ex2(dt * A2[j]) * h[j] + du * s_b[r][n0 + j];
      if constexpr (!Local) p += h[j] * s_c[r][n0 + j];
    }
    if constexpr (Local) {
      dt_sum += dt;
    } else {
#pragma unroll
      for (int off = LANES / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off, LANES);
      if (lane == 0) s_y[r][c] = p;
    }
  };
  if (rows == S::kStage) {
#pragma unroll
    for (int r = 0; r < S::kStage; ++r) step(r);
  } else {
    for (int r = 0; r < rows; ++r) step(r);
  }
}

// Phase 4: y = (sum + D u) * silu(z) of the thread's channel cc, rows r0, r0 + kRowStep, ..., stored coalesced
template <typename S, bool Half>
__device__ __forceinline__ void store_stage_y(void* y, const float (&s_y)[S::kStage][S::CH],
                                              const float (&s_u)[S::kStage][S::CH],
                                              const float (&s_z)[S::kStage][S::CH], int64_t row0, int rows, int E,
                                              int e0, int cc, int r0, bool in, float dskip) {
#pragma unroll
  for (int j = 0; j < S::kMine; ++j) {
    const int r = r0 + j * S::kRowStep;
    if (in && r < rows) {
      store<Half>(y, (row0 + r) * E + e0 + cc, (s_y[r][cc] + dskip * s_u[r][cc]) * silu_ex2(s_z[r][cc]));
    }
  }
}

// A launch's rows split over blocks in time (a long prompt of few sequences: row_spans): span z of each sequence
// takes rows [z rows, (z + 1) rows). The Local pass runs spans 0 .. spans - 2 from zero states (span 0 from the past
// state) and keeps each one's end state and dt sum in `h` [B][spans][E][N] and `dt_sum` [B][spans][E];
// combine_spans turns those into each span's start state (the end state of span z is exp(A sum(dt)) times its start
// state plus its end state from zero), written over `h`; the outputs pass runs every span from its start state.
// spans == 1: one pass over the whole launch, from past to present.
struct SpanArgs {
  int rows;   // rows of a span (a multiple of the kernel's kStage), or the launch's rows
  int spans;  // spans per sequence
  float* h = nullptr;
  float* dt_sum = nullptr;
};

// (6 blocks per SM: the shared memory's bound at mamba-130m's ranks)
template <int NS, int LANES, bool Half, bool Local = false>
__global__ void __launch_bounds__(kThreads, 6) scan_rows_kernel(ScanArgs a, SpanArgs span) {
  using S = RowsShape<NS, LANES>;
  constexpr int EPL = S::EPL, CH = S::CH, WP = CH + 1, kStage = S::kStage;
  __shared__ float s_u[kStage][CH];
  __shared__ float s_z[kStage][CH];
  __shared__ float s_dt[kStage][CH];
  __shared__ float s_y[kStage][CH];  // the lanes' sum of h C
  __shared__ __align__(16) float s_b[kStage][NS];  // B and C of the stage's rows, zero past N: phase 3's
  __shared__ __align__(16) float s_c[kStage][NS];  // loads need no bounds checks (a branch per element)
  extern __shared__ __align__(16) float s_dyn[];
  const int b = blockIdx.y, E = int(a.inner), N = int(a.state), R = int(a.rank), T = int(a.rows);
  const int X = int(a.xdbl_width), Z = int(a.xz_width), RP = (R + 3) / 4 * 4;  // RP: R padded to float4s
  const int z = blockIdx.z, t_begin = z * span.rows, t_end = min(T, t_begin + span.rows);
  float* s_w = s_dyn;            // [RP][WP]: dt_weight of the block's channels, transposed, zero past R
  float* s_x = s_dyn + RP * WP;  // [kStage][RP]: the stage's dt inputs, zero past R
  const int e0 = blockIdx.x * CH;
  const int width = E - e0 < CH ? E - e0 : CH;  // the block's channels
  const int wl = threadIdx.x % 32, wi = threadIdx.x / 32;  // lane in the warp, warp
  stage_dt_weights<CH>(s_w, a.dt_weight + int64_t(e0) * R, R, RP, width, wl, wi);
  // phase 3's thread: channel c, lane `lane`, state elements n0..n0+EPL-1
  const int c = threadIdx.x / LANES, lane = threadIdx.x % LANES, n0 = lane * EPL;
  const int64_t e = e0 + c;
  const bool channel = c < width;
  float h[EPL], A2[EPL];  // A2: A log2(e), so that exp(dt A) is one ex2 of dt A2
  const int64_t kept = ((int64_t(b) * span.spans + z) * E + e) * N + n0;  // the span's state in span.h
  const float* start = z == 0 ? a.past + (int64_t(b) * E + e) * N + n0 : span.h + kept;
  const bool vec = EPL % 4 == 0 && N == NS &&
                   (reinterpret_cast<uintptr_t>(start) | reinterpret_cast<uintptr_t>(a.present) |
                    reinterpret_cast<uintptr_t>(a.a)) % 16 == 0;
  load_state<EPL>(h, A2, start, a.a + e * N + n0, N, n0, channel, vec);
  if (Local && z > 0) {
#pragma unroll
    for (int j = 0; j < EPL; ++j) h[j] = 0.0f;
  }
  // phases 2 and 4's thread: channel cc, rows r0, r0 + kRowStep, ...
  const int cc = threadIdx.x % CH, r0 = threadIdx.x / CH;
  const bool in = cc < width;
  const float bias = in ? a.dt_bias[e0 + cc] : 0.0f, dskip = in ? a.d[e0 + cc] : 0.0f;
  float dt_sum = 0.0f;
  for (int t0 = t_begin; t0 < t_end; t0 += kStage) {
    const int rows = t_end - t0 < kStage ? t_end - t0 : kStage;
    const int64_t row0 = int64_t(b) * T + t0;
    const float* xdbl = a.xdbl + row0 * X;
    const float* u = a.u + row0 * E + e0;
    stage_dt_inputs<kStage>(s_x, xdbl, rows, R, RP, X, wl, wi);  // phase 1
    stage_b_c<NS, kStage>(s_b, s_c, xdbl, rows, R, N, X);
    stage_u_z<S, Half>(s_u, s_z, u, a.xz, row0 * Z + Z - E + e0 + cc, rows, E, Z, cc, r0, in);
    __syncthreads();
    stage_dt<S>(s_dt, s_x, s_w, rows, RP, cc, r0, in, bias);  // phase 2
    __syncthreads();
    stage_recurrence<S, NS, LANES, Local>(h, A2, s_dt, s_u, s_b, s_c, s_y, rows, c, lane, n0, dt_sum);  // phase 3
    __syncthreads();
    if constexpr (!Local) {  // phase 4
      store_stage_y<S, Half>(a.y, s_y, s_u, s_z, row0, rows, E, e0, cc, r0, in, dskip);
    }
    __syncthreads();  // the next stage reuses the shared arrays
  }
  if (Local && channel && lane == 0) span.dt_sum[(int64_t(b) * span.spans + z) * E + e] = dt_sum;
  if (!Local && z != span.spans - 1) return;  // a span's end state: the next one's start state
  float* end = Local ? span.h + kept : a.present + (int64_t(b) * E + e) * N + n0;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    if (vec && j % 4 == 0 && channel) {
      *reinterpret_cast<float4*>(end + j) = make_float4(h[j], h[j + 1], h[j + 2], h[j + 3]);
    } else if (!vec && channel && n0 + j < N) {
      end[j] = h[j];
    }
  }
}

// The spans' start states from the Local pass's end states and dt sums (SpanArgs), one thread per state element of
// a sequence, written over span.h (span 0 starts from the past state; its slot is not read again)
__global__ void combine_spans(ScanArgs a, SpanArgs span) {
  const int64_t E = a.inner, N = a.state, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.batch * E * N) return;
  const int64_t b = i / (E * N), en = i % (E * N), e = en / N;
  const float A2 = a.a[en] * kLog2e;
  float* h = span.h + b * span.spans * E * N + en;
  const float* dt_sum = span.dt_sum + b * span.spans * E + e;
  float state = h[0];  // span 0's end state (it started from the past state)
  for (int z = 1; z < span.spans; ++z) {
    const float start = state;
    if (z < span.spans - 1) state = ex2(dt_sum[z * E] * A2) * state + h[z * E * N];
    h[z * E * N] = start;
  }
}

// The chunk kernel's opt-in to more than 48 KiB of shared memory (a dt rank above ~110 stages more dt weights and
// inputs than fit below that), up to the device's limit, once per kernel and process: from scan_prepare at a
// session's load (outside any CUDA graph capture, as linear_prepare), else at the first launch that needs it.
template <int NS, int LANES, bool Half, bool Local>
cudaError_t rows_shared_limit() {
  static const cudaError_t err = [] {
    const auto kernel = scan_rows_kernel<NS, LANES, Half, Local>;
    const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
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

// A stream's buffer for the spans' states and dt sums (SpanArgs) of `floats` or more, or nullptr inside a capture
// that would need a larger one (the launch then runs as one span). Grown outside captures; never freed, as a captured
// graph keeps its address. One per stream: a stream's scans run one after another.
inline float* span_buffer(cudaStream_t stream, size_t floats) {
  static std::mutex mutex;
  static std::map<cudaStream_t, std::pair<float*, size_t>> buffers;
  std::lock_guard<std::mutex> lock(mutex);
  auto& [buffer, size] = buffers[stream];
  if (size >= floats) return buffer;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone) return nullptr;
  floats = std::max(floats, 2 * size);
  void* p = nullptr;
  if (cudaMalloc(&p, floats * sizeof(float)) != cudaSuccess) {
    cudaGetLastError();  // cleared: the launch runs as one span
    return nullptr;
  }
  buffer = static_cast<float*>(p), size = floats;
  return buffer;
}

// Spans per sequence (SpanArgs). A launch of few sequences fills few of the SMs' block slots with the chunk kernel's
// blocks (mamba-130m's 1536 channels at batch 1: 96 blocks of 16 channels for 132 SMs), each walking all of its
// sequence's rows; split in time they fill the slots, at the cost of a second pass over all but the last span. The
// spans are whole stages, as many as fill the slots three times, and a launch is split only where its blocks fill at
// most a kMinSpans-th of the slots. On an H100 a 512-row scan at mamba-130m's shapes took 52.5 us in 8 spans against
// 95.2 in one, 2000 rows 162.4 in 16 spans (183.1 in 4) against 400.6, but mamba-2.8b's 512 rows 217.8 in 4 spans
// against 166.0 in one (320 blocks of ~75 KiB of shared memory each, which already fill the slots: the split added a
// pass without running more blocks at once; docs/benchmarks.md).
constexpr int kMinSpans = 3;
template <class S>
inline SpanArgs row_spans(const ScanArgs& a, int slots) {
  const int64_t blocks = a.batch * ((a.inner + S::CH - 1) / S::CH), stages = (a.rows + S::kStage - 1) / S::kStage;
  const int64_t want = std::min<int64_t>((3 * int64_t(slots) + blocks - 1) / blocks, stages);
  if (blocks * kMinSpans > slots || want < kMinSpans) return SpanArgs{int(a.rows), 1};
  const int rows = int((stages + want - 1) / want * S::kStage);
  return SpanArgs{rows, int((a.rows + rows - 1) / rows)};
}

// The chunk kernel's block slots on the device for blocks of `bytes` of shared memory: at most the 6 blocks per SM
// its registers allow (__launch_bounds__), as many as the SM's shared memory holds (1 KiB of each block's is the
// system's)
inline int rows_slots(size_t bytes) {
  static const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  static const int shared = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  return sms * int(std::min<size_t>(6, size_t(shared) / (bytes + 1024)));
}

template <int NS, int LANES, bool Half>
void launch_rows(const ScanArgs& a, cudaStream_t stream) {
  using S = RowsShape<NS, LANES>;
  const size_t padded = size_t(a.rank + 3) / 4 * 4;
  const size_t dynamic = sizeof(float) * padded * (S::CH + 1 + S::kStage);
  const size_t fixed = sizeof(float) * S::kStage * (4 * S::CH + 2 * NS);
  if (fixed + dynamic > 48 * 1024) {  // a failure shows in the launch's error
    rows_shared_limit<NS, LANES, Half, false>();
    rows_shared_limit<NS, LANES, Half, true>();
  }
  const unsigned blocks = unsigned((a.inner + S::CH - 1) / S::CH), sequences = unsigned(a.batch);
  SpanArgs span = row_spans<S>(a, rows_slots(fixed + dynamic));
  if (span.spans > 1) {
    const size_t states = size_t(a.batch) * span.spans * a.inner * a.state;
    float* buffer = span_buffer(stream, states + size_t(a.batch) * span.spans * a.inner);
    if (buffer == nullptr) {
      span = SpanArgs{int(a.rows), 1};
    } else {
      span.h = buffer, span.dt_sum = buffer + states;
      const dim3 grid(blocks, sequences, unsigned(span.spans - 1));
      scan_rows_kernel<NS, LANES, Half, true><<<grid, kThreads, dynamic, stream>>>(a, span);
      const int64_t n = a.batch * a.inner * a.state;
      combine_spans<<<unsigned((n + 255) / 256), 256, 0, stream>>>(a, span);
    }
  }
  const dim3 grid(blocks, sequences, unsigned(span.spans));
  scan_rows_kernel<NS, LANES, Half, false><<<grid, kThreads, dynamic, stream>>>(a, span);
}

// The chunk kernel's blocks for a launch of few sequences (48 of four lanes per sequence at mamba-130m's 1536 channels)
// leave most SMs idle and each block walks its rows alone: there eight lanes per channel (twice the blocks, each lane
// half the elements) run faster (1 x 64 rows: 13.4 against 18.1 us on an H200; 4 x 64: 16.4 against 19.9; 16 x 64: 47.4
// against 31.2; docs/benchmarks.md). The lanes split h C's sums differently, so a prompt's bits depend on how many
// share its launch (by fp32 rounding, as the prefill's projections already do from 16 rows on, where CUTLASS's tile
// configs change with the rows).
inline bool few_chunks(const ScanArgs& a) {
  static const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
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
        // same (docs/benchmarks.md; served, within the machine's spread)
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
  constexpr int lanes = RowsLanes<L>::lanes, few = RowsLanes<L>::few;
  for (const cudaError_t err : {rows_shared_limit<L, lanes, Half, false>(), rows_shared_limit<L, lanes, Half, true>(),
                                rows_shared_limit<L, few, Half, false>(), rows_shared_limit<L, few, Half, true>()}) {
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
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

}  // namespace

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

}  // namespace mambatrt
