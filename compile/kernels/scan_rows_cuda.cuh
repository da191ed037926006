// The CUDA scan of a chunk of rows (a prefill launch's): the chunk kernel, its split in time for long prompts of
// few sequences (spans) and its launch, included by scan_cuda.cu, which picks between it and the step kernels.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_common.cuh"
#include "mamba_ops.h"
#ifdef MAMBATRT_WITH_CUTLASS
#include "mamba_linear_cutlass.cuh"
#endif

namespace mambatrt {
namespace {

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
// Where a GEMM makes the launch's dt products beforehand (dt_products_fit), phase 1 loads them in place of the dt
// inputs and phase 2 is skipped.
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

// Phase 1 with the dt products made beforehand (RowsArgs::dt): softplus(dt + bias) of the thread's channel cc, rows
// r0, r0 + kRowStep, ..., into s_dt; dt: the stage's first row's product of the block's first channel
template <typename S>
__device__ __forceinline__ void stage_dt_products(float (&s_dt)[S::kStage][S::CH], const float* dt, int rows, int E,
                                                  int cc, int r0, bool in, float bias) {
  float v[S::kMine];
#pragma unroll
  for (int m = 0; m < S::kMine; ++m) {
    const int r = r0 + m * S::kRowStep;
    v[m] = in && r < rows ? dt[r * E + cc] : 0.0f;
  }
#pragma unroll
  for (int m = 0; m < S::kMine; ++m) {
    const int r = r0 + m * S::kRowStep;
    if (r < rows) s_dt[r][cc] = in ? softplus(v[m] + bias) : 0.0f;
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
// h C into s_y; Local (a span's end state alone, RowsArgs): no sums of h C, the rows' dt added to dt_sum instead
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
// dt: the dt products x_dt . dt_weight [B T, E] made by a GEMM before the kernel (dt_products), which phase 1 then
// loads in place of phase 2's sums (a kernel with Pre).
struct RowsArgs {
  int rows;   // rows of a span (a multiple of the kernel's kStage), or the launch's rows
  int spans;  // spans per sequence
  float* h = nullptr;
  float* dt_sum = nullptr;
  const float* dt = nullptr;
};

// (6 blocks per SM: the shared memory's bound at mamba-130m's ranks)
template <int NS, int LANES, bool Half, bool Local = false, bool Pre = false>
__global__ void __launch_bounds__(kThreads, 6) scan_rows_kernel(ScanArgs a, RowsArgs span) {
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
  if constexpr (!Pre) stage_dt_weights<CH>(s_w, a.dt_weight + int64_t(e0) * R, R, RP, width, wl, wi);
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
    if constexpr (Pre) {  // phase 1
      stage_dt_products<S>(s_dt, span.dt + row0 * E + e0, rows, E, cc, r0, in, bias);
    } else {
      stage_dt_inputs<kStage>(s_x, xdbl, rows, R, RP, X, wl, wi);
    }
    stage_b_c<NS, kStage>(s_b, s_c, xdbl, rows, R, N, X);
    stage_u_z<S, Half>(s_u, s_z, u, a.xz, row0 * Z + Z - E + e0 + cc, rows, E, Z, cc, r0, in);
    __syncthreads();
    if constexpr (!Pre) {  // phase 2
      stage_dt<S>(s_dt, s_x, s_w, rows, RP, cc, r0, in, bias);
      __syncthreads();
    }
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

// The spans' start states from the Local pass's end states and dt sums (RowsArgs), one thread per state element of
// a sequence, written over span.h (span 0 starts from the past state; its slot is not read again)
__global__ void combine_spans(ScanArgs a, RowsArgs span) {
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

// Spans per sequence (RowsArgs). A launch of few sequences fills few of the SMs' block slots with the chunk kernel's
// blocks (mamba-130m's 1536 channels at batch 1: 96 blocks of 16 channels for 132 SMs), each walking all of its
// sequence's rows; split in time they fill the slots, at the cost of a second pass over all but the last span. The
// spans are whole stages, as many as fill the slots three times, and a launch is split only where its blocks fill at
// most a kMinSpans-th of the slots. On an H100 a 512-row scan at mamba-130m's shapes took 52.5 us in 8 spans against
// 95.2 in one, 2000 rows 162.4 in 16 spans (183.1 in 4) against 400.6, but mamba-2.8b's 512 rows 217.8 in 4 spans
// against 166.0 in one (320 blocks of ~75 KiB of shared memory each, which already fill the slots: the split added a
// pass without running more blocks at once; docs/benchmarks.md).
constexpr int kMinSpans = 3;
template <class S>
inline RowsArgs row_spans(const ScanArgs& a, int slots) {
  const int64_t blocks = a.batch * ((a.inner + S::CH - 1) / S::CH), stages = (a.rows + S::kStage - 1) / S::kStage;
  const int64_t want = std::min<int64_t>((3 * int64_t(slots) + blocks - 1) / blocks, stages);
  if (blocks * kMinSpans > slots || want < kMinSpans) return RowsArgs{int(a.rows), 1};
  const int rows = int((stages + want - 1) / want * S::kStage);
  return RowsArgs{rows, int((a.rows + rows - 1) / rows)};
}

// The chunk kernel's block slots on the device for blocks of `bytes` of shared memory: at most the 6 blocks per SM
// its registers allow (__launch_bounds__), as many as the SM's shared memory holds (1 KiB of each block's is the
// system's)
inline int rows_slots(size_t bytes) {
  static const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  static const int shared = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  return sms * int(std::min<size_t>(6, size_t(shared) / (bytes + 1024)));
}

// The dt products' GEMM runs for launches of kProductRows rows or more, or of any rows from a rank of kProductRank.
// Phase 2's sums cost the chunk kernel R multiply-adds per row and channel from shared memory, and their staged
// weights and inputs (R x (CH + kStage + 1) floats) hold it to 2 blocks per SM from a rank of ~110; the GEMM makes them
// on the tensor cores (3xTF32) and the kernel's blocks need 24-32 KiB. Scan alone on an H100 (docs/benchmarks.md):
// mamba-2.8b's shapes, one sequence, 128 / 512 / 2000 rows 31.6 / 118.4 / 456.3 us against 43.8 / 155.9 / 626.7;
// mamba-130m's 512 / 2000 rows 36.7 / 117.7 against 55.2 / 160.1, 16 sequences of 64 32.0 against 33.2, but one
// sequence of 64 rows 16.2 against 14.6 (the GEMM's launch and the products' round trip through memory).
constexpr int64_t kProductRows = 128, kProductRank = 96;

// Whether the launch's dt products run as a GEMM before the chunk kernel (dt_products): built with CUTLASS (its
// 3xTF32 GEMMs, fp32's accuracy), sm_80 or newer, operands as CUTLASS's vector accesses want them, and
// kProductRows or kProductRank says so.
inline bool dt_products_fit(const ScanArgs& a) {
#ifdef MAMBATRT_WITH_CUTLASS
  static const int major = device_attribute(cudaDevAttrComputeCapabilityMajor);
  const bool wanted = a.batch * a.rows >= kProductRows || a.rank >= kProductRank;
  // the products' own alignment is the stream buffer's (cudaMalloc's 256 bytes): xdbl stands in for it
  return wanted && major >= 8 &&
         mambatrt_cutlass::aligned(a.xdbl, a.dt_weight, a.xdbl, int(a.inner), int(a.rank), int(a.xdbl_width));
#else
  return false;
#endif
}

// dt [B T, E] = xdbl[:, :R] dt_weight^T, the dt products of all the launch's rows, on CUTLASS's 3xTF32 GEMMs
inline cudaError_t dt_products(const ScanArgs& a, float* dt, cudaStream_t stream) {
#ifdef MAMBATRT_WITH_CUTLASS
  return mambatrt_cutlass::launch(a.xdbl, a.dt_weight, dt, int(a.batch * a.rows), int(a.inner), int(a.rank), stream,
                                  int(a.xdbl_width));
#else
  return cudaErrorNotSupported;
#endif
}

// The chunk kernel with its dt products made beforehand (Pre) or summed in phase 2, split in spans where row_spans
// says; the products and the spans' states and sums in the stream's scan buffer. false: Pre without its buffer (a
// capture that would need a larger one): nothing was queued. *err: a failed launch of the products' GEMM.
template <int NS, int LANES, bool Half, bool Pre>
bool launch_rows_as(const ScanArgs& a, cudaStream_t stream, cudaError_t* err) {
  using S = RowsShape<NS, LANES>;
  const size_t padded = size_t(a.rank + 3) / 4 * 4;
  const size_t dynamic = Pre ? 0 : sizeof(float) * padded * (S::CH + 1 + S::kStage);
  const size_t fixed = sizeof(float) * S::kStage * (4 * S::CH + 2 * NS);
  if (fixed + dynamic > 48 * 1024) {  // a failure shows in the launch's error
    rows_shared_limit<NS, LANES, Half, false>();
    rows_shared_limit<NS, LANES, Half, true>();
  }
  RowsArgs span = row_spans<S>(a, rows_slots(fixed + dynamic));
  const size_t products = Pre ? size_t(a.batch * a.rows * a.inner) : 0;
  const size_t states = span.spans > 1 ? size_t(a.batch) * span.spans * a.inner * a.state : 0;
  const size_t sums = span.spans > 1 ? size_t(a.batch) * span.spans * a.inner : 0;
  float* buffer = nullptr;
  if (products + states > 0) {
    const size_t bytes = (products + states + sums) * sizeof(float);
    buffer = static_cast<float*>(stream_buffer(stream, StreamBuffer::kScan, bytes));
    if (buffer == nullptr && Pre) return false;
    if (buffer == nullptr) span = RowsArgs{int(a.rows), 1};  // one span
  }
  if constexpr (Pre) {
    if ((*err = dt_products(a, buffer, stream)) != cudaSuccess) return true;
    span.dt = buffer;
  }
  const unsigned blocks = unsigned((a.inner + S::CH - 1) / S::CH), sequences = unsigned(a.batch);
  if (span.spans > 1) {
    span.h = buffer + products, span.dt_sum = span.h + states;
    const dim3 grid(blocks, sequences, unsigned(span.spans - 1));
    scan_rows_kernel<NS, LANES, Half, true, Pre><<<grid, kThreads, dynamic, stream>>>(a, span);
    const int64_t n = a.batch * a.inner * a.state;
    combine_spans<<<unsigned((n + 255) / 256), 256, 0, stream>>>(a, span);
  }
  const dim3 grid(blocks, sequences, unsigned(span.spans));
  scan_rows_kernel<NS, LANES, Half, false, Pre><<<grid, kThreads, dynamic, stream>>>(a, span);
  return true;
}

// (an error of the launches is the caller's: cudaGetLastError, or *err for the products' GEMM, whose own check
// has already cleared it)
template <int NS, int LANES, bool Half>
cudaError_t launch_rows(const ScanArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (dt_products_fit(a) && launch_rows_as<NS, LANES, Half, true>(a, stream, &err)) return err;
  launch_rows_as<NS, LANES, Half, false>(a, stream, &err);
  return err;
}

}  // namespace
}  // namespace mambatrt
