// CUDA kernels of MambaScan and MambaScan16 (shapes in mamba_ops.h): a step kernel for one row per sequence (decode)
// and a chunk kernel for a prefill's rows, launched on the stream onnxruntime gives the session, so that they are
// ordered with its other kernels and captured into its CUDA graphs.
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "mamba_ops.h"
#include "scan_rows_cuda.cuh"

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

// The chunk kernel's blocks for a launch of few sequences (48 of four lanes per sequence at mamba-130m's 1536 channels)
// leave most SMs idle and each block walks its rows alone: there eight lanes per channel (twice the blocks, each lane
// half the elements) run faster (1 x 64 rows: 13.4 against 18.1 us on an H200; 4 x 64: 16.4 against 19.9; 16 x 64: 47.4
// against 31.2; docs/benchmarks.md). The lanes split h C's sums differently, so a prompt's bits depend on how many
// share its launch (by fp32 rounding, as the prefill's projections already do from 16 rows on, where CUTLASS's tile
// configs change with the rows). Up to kFewRows rows per sequence: longer launches walk more rows per block, where
// four lanes' fewer shuffles per row win (the dt products from a GEMM, one sequence on an H100: mamba-2.8b's 512 and
// 2000 rows 96.8 and 327.6 us against 118.4 and 456.3, mamba-130m's 2000 rows 106.2 against 117.7; at 128 rows 32.3
// against 31.6, at 64 rows of mamba-130m 19.7 against 16.2; docs/benchmarks.md). Lanes of one or two per channel
// measured slower at every shape (2.8b's 512 rows 114.5 and 97.8 us).
constexpr int64_t kFewRows = 256;
inline bool few_chunks(const ScanArgs& a) {
  static const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  constexpr int64_t kChannels8 = kThreads / 8;  // a block's channels at eight lanes
  return a.rows <= kFewRows && a.batch * ((a.inner + kChannels8 - 1) / kChannels8) <= 4 * int64_t(sms);
}

// The chunk kernel's lanes per channel for state size L (rounded up to a power of two): those of the step kernel,
// or more for launches of few sequences (few_chunks)
template <int L>
struct RowsLanes {
  static constexpr int lanes = L < kStepLanes ? L : kStepLanes, few = L < 8 ? L : 8;
};

// (an error of its launches: returned, or left for cudaGetLastError)
template <int L, bool Half>
cudaError_t launch_scan(const ScanArgs& a, cudaStream_t stream) {
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
      return cudaSuccess;
    }
  }
  if (a.rows == 1 && a.batch >= kStepPairBatch) {
    launch_step_lanes<L, lanes, 2, Half>(a, stream);
  } else if (a.rows == 1) {
    launch_step_lanes<L, lanes, 1, Half>(a, stream);
  } else if (few > lanes && few_chunks(a)) {
    return launch_rows<L, few, Half>(a, stream);
  } else {
    return launch_rows<L, lanes, Half>(a, stream);
  }
  return cudaSuccess;
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
cudaError_t launch_scan(const ScanArgs& a, cudaStream_t s) {
  if (a.state <= 1) return launch_scan<1, Half>(a, s);
  if (a.state <= 2) return launch_scan<2, Half>(a, s);
  if (a.state <= 4) return launch_scan<4, Half>(a, s);
  if (a.state <= 8) return launch_scan<8, Half>(a, s);
  if (a.state <= 16) return launch_scan<16, Half>(a, s);
  return launch_scan<32, Half>(a, s);
}

}  // namespace

const char* scan_cuda(const ScanArgs& a, void* stream) {
  if (a.batch == 0 || a.rows == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = a.half ? launch_scan<true>(a, s) : launch_scan<false>(a, s);
  if (err == cudaSuccess) err = cudaGetLastError();
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
#ifdef MAMBATRT_WITH_CUTLASS
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8) {  // the dt products' GEMMs (dt_products)
    if (const cudaError_t err = mambatrt_cutlass::prepare(); err != cudaSuccess) return cudaGetErrorString(err);
  }
#endif
  return nullptr;
}

}  // namespace mambatrt
