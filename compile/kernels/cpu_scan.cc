// MambaScan's CPU kernel (shapes in mamba_ops.h), for float32 and float16 xz and y (MambaScan16), in the SSE2, AVX2
// and AVX-512 builds (cpu_math.h).
//
// The scan runs in two passes per sequence. 1: dt = softplus(xdbl's dt part . dt_weight[e] + dt_bias[e]) and the
// gate silu(z) for every row and channel, channels innermost (vectorized). 2: the recurrence, rows in order, kLanes
// channels at a time: for each state element n the lanes share B[n] and C[n] and each decays by its own
// exp(dt A[e, n]), so every step is one vector operation over the lanes; y sums C[n] h[n] over n in order, as the
// sequential definition does. (One channel at a time spent its time in per-row scalar work: libm's exp per state
// element, softplus's log1p, the dt dot product.) Below kLanes rows (decode) pass 2 goes by channel instead
// (scan_rows_by_channel). The AVX-512 build with N = 16 (every Mamba-1 checkpoint's d_state) takes passes of its own
// in intrinsics (dt_rows_avx512, scan_chunk16, scan_step16): GCC kept the loops' sums and states in memory there.
// Channels never meet in the scan, so a launch is split into tasks of channels (scan_task_t) for the session's
// threads: on one thread the scan kept a server's many sequences from gaining what the products gained from more
// cores (docs/benchmarks.md). Each channel's arithmetic is the same in any task, so the bits do not depend on the
// threads.
#include "cpu_math.h"

namespace mambatrt {

constexpr int64_t kLanes = 8;  // channels the CPU scan advances together (one AVX2 vector, two SSE2 ones; AVX-512: 16)

// Pass 2 of the CPU scan for a few rows of sequence b (a decode step): one channel at a time, its N state elements
// (contiguous in past, A and present: no transposes, which cost more than one row's update in the lane layout) padded
// with zeros to NP, a multiple of 8 known at compile time (short loops of a run-time length cost more in their
// set-up than in their arithmetic), as the vector; y sums C . h in 8 partial sums.
template <typename X, int64_t NP>
static inline void scan_rows_by_channel(const ScanArgs& a, int64_t b, const float* dt, const float* gate, int64_t e0,
                                        int64_t e1) {
  const int64_t E = a.inner, N = a.state, R = a.rank, T = a.rows;
  alignas(32) float h[kMaxState] = {}, A[kMaxState] = {}, Bt[kLanes][kMaxState], Ct[kLanes][kMaxState], part[8];
  for (int64_t t = 0; t < T; ++t) {
    const float* x = a.xdbl + (b * T + t) * a.xdbl_width;
    for (int64_t n = 0; n < NP; ++n) {
      Bt[t][n] = n < N ? x[R + n] : 0.0f;
      Ct[t][n] = n < N ? x[R + N + n] : 0.0f;
    }
  }
  if (T == 1 && N == NP) {  // a decode step: straight from past to present (the copies in and out cost as much)
    const float *__restrict__ Bv = Bt[0], *__restrict__ Cv = Ct[0];
    for (int64_t e = e0; e < e1; ++e) {
      const float *__restrict__ past = a.past + (b * E + e) * NP, *__restrict__ Ae = a.a + e * NP;
      float* __restrict__ present = a.present + (b * E + e) * NP;
      const float d = dt[e], u = a.u[b * E + e], v = d * u;
      for (int64_t j = 0; j < 8; ++j) part[j] = 0.0f;
      for (int64_t n = 0; n < NP; n += 8) {
        for (int64_t j = 0; j < 8; ++j) {
          const float hn = exp_fast(d * Ae[n + j]) * past[n + j] + v * Bv[n + j];
          present[n + j] = hn;
          part[j] += hn * Cv[n + j];
        }
      }
      X::store(a.y, b * E + e, (sum8(part) + a.d[e] * u) * gate[e]);
    }
    return;
  }
  for (int64_t e = e0; e < e1; ++e) {
    const float *past = a.past + (b * E + e) * N, *Ae = a.a + e * N;
    if (N == NP) {  // copies of a length known at compile time: a few vector moves
      for (int64_t n = 0; n < NP; ++n) h[n] = past[n], A[n] = Ae[n];
    } else {  // the padding past N stays zero
      for (int64_t n = 0; n < N; ++n) h[n] = past[n], A[n] = Ae[n];
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float d = dt[t * E + e], u = a.u[row * E + e], v = d * u;
      for (int64_t n = 0; n < NP; ++n) h[n] = exp_fast(d * A[n]) * h[n] + v * Bt[t][n];
      for (int64_t j = 0; j < 8; ++j) part[j] = 0.0f;
      for (int64_t n = 0; n < NP; n += 8)
        for (int64_t j = 0; j < 8; ++j) part[j] += h[n + j] * Ct[t][n + j];
      X::store(a.y, row * E + e, (sum8(part) + a.d[e] * u) * gate[t * E + e]);
    }
    float* present = a.present + (b * E + e) * N;
    if (N == NP) {
      for (int64_t n = 0; n < NP; ++n) present[n] = h[n];
    } else {
      for (int64_t n = 0; n < N; ++n) present[n] = h[n];
    }
  }
}

#ifdef MAMBATRT_AVX2
// Pass 1's dt sums (before softplus) of M rows from row0, 32 channels from e0, into out[M, E]: a small matrix product
// [M, R] x [R, 32] whose 2M sums stay in registers over the R products and whose weights are loaded once for the M
// rows, where the portable loop stores and reloads all of a row's d per r (a fifth of a 64-row chunk's scan). The
// same order of sums (the bias, then r in order), so the same bits whatever M is.
template <int M>
MAMBATRT_AVX512 static inline void dt_block(const ScanArgs& a, int64_t row0, int64_t e0, float* out) {
  const int64_t E = a.inner;
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 2; ++q) acc[m][q] = _mm512_loadu_ps(a.dt_bias + e0 + 16 * q);
  const float* x = a.xdbl + row0 * a.xdbl_width;
  for (int64_t r = 0; r < a.rank; ++r) {
    const float* w = a.dt_weight_t + r * E + e0;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    for (int m = 0; m < M; ++m) {
      const __m512 xr = _mm512_set1_ps(x[m * a.xdbl_width + r]);
      acc[m][0] = _mm512_fmadd_ps(xr, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xr, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(out + m * E + e0 + 16 * q, acc[m][q]);
}

// The dt sums of rows [row0, row0 + rows), channels [e_begin, e_end), into out[rows, E] (E a multiple of 32): eight
// rows at a time, then pairs
MAMBATRT_AVX512 static inline void dt_rows_avx512(const ScanArgs& a, int64_t row0, int64_t rows, int64_t e_begin,
                                                  int64_t e_end, float* out) {
  for (int64_t e0 = e_begin; e0 < e_end; e0 += 32) {
    int64_t t = 0;
    for (; t + 8 <= rows; t += 8) dt_block<8>(a, row0 + t, e0, out + t * a.inner);
    for (; t + 2 <= rows; t += 2) dt_block<2>(a, row0 + t, e0, out + t * a.inner);
    for (; t < rows; ++t) dt_block<1>(a, row0 + t, e0, out + t * a.inner);
  }
}

// y = (sum + D u) * gate for 16 channels from e, stored as X
template <typename X>
MAMBATRT_AVX512 static inline void store_y16(const ScanArgs& a, int64_t at, int64_t e, __m512 sum, __m512 u,
                                             __m512 g) {
  const __m512 y = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_loadu_ps(a.d + e), u, sum), g);
  if constexpr (std::is_same_v<X, F32>) {
    _mm512_storeu_ps(static_cast<float*>(a.y) + at, y);
  } else {  // float16, rounded to nearest even as F16's stores
    const __m256i half = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.y) + at), half);
  }
}

// Pass 2 of a decode step (one row) of sequence b for N = 16 on AVX-512: a channel's 16 state elements as one vector
// (as scan_rows_by_channel's, which GCC ran as two 8-float halves with its partial sums stored and reloaded per
// channel), y its C . h summed across the vector in registers
template <typename X>
MAMBATRT_AVX512 static void scan_step16(const ScanArgs& a, int64_t b, const float* dt, const float* gate, int64_t e0,
                                        int64_t e1) {
  constexpr int64_t N = 16;
  const int64_t E = a.inner;
  const float* x = a.xdbl + b * a.xdbl_width + a.rank;
  const __m512 B = _mm512_loadu_ps(x), C = _mm512_loadu_ps(x + N);
  for (int64_t e = e0; e < e1; ++e) {
    const float d = dt[e], u = a.u[b * E + e];
    const __m512 past = _mm512_loadu_ps(a.past + (b * E + e) * N), A = _mm512_loadu_ps(a.a + e * N);
    const __m512 h = _mm512_fmadd_ps(exp_fast16(_mm512_mul_ps(_mm512_set1_ps(d), A)), past,
                                     _mm512_mul_ps(_mm512_set1_ps(d * u), B));
    _mm512_storeu_ps(a.present + (b * E + e) * N, h);
    const float y = _mm512_reduce_add_ps(_mm512_mul_ps(h, C));
    X::store(a.y, b * E + e, (y + a.d[e] * u) * gate[e]);
  }
}

// Pass 2 of a chunk (8 rows or more) for N = 16 on AVX-512: 16 channels per vector as the lane pass below, but the
// 16 state vectors held in registers over the rows (gathered from past once, scattered to present once), where the
// lane pass with N known only at run time loaded and stored them at every row. y sums C[n] h[n] in the order of n.
template <typename X>
MAMBATRT_AVX512 static void scan_chunk16(const ScanArgs& a, int64_t b, const float* dt, const float* gate,
                                         int64_t e_begin, int64_t e_end) {
  constexpr int64_t N = 16;
  const int64_t E = a.inner, R = a.rank, T = a.rows;
  const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(N));  // lane l -> channel l's state row
  for (int64_t e0 = e_begin; e0 < e_end; e0 += 16) {
    __m512 h[N], A[N];
    const float* past = a.past + (b * E + e0) * N;
    for (int64_t n = 0; n < N; ++n) {
      h[n] = _mm512_i32gather_ps(across, past + n, 4);
      A[n] = _mm512_i32gather_ps(across, a.a + e0 * N + n, 4);
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float *B = a.xdbl + row * a.xdbl_width + R, *C = B + N;
      const __m512 d = _mm512_loadu_ps(dt + t * E + e0), u = _mm512_loadu_ps(a.u + row * E + e0);
      const __m512 v = _mm512_mul_ps(d, u);
      __m512 y = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int64_t n = 0; n < N; ++n) {
        h[n] = _mm512_fmadd_ps(exp_fast16(_mm512_mul_ps(d, A[n])), h[n], _mm512_mul_ps(v, _mm512_set1_ps(B[n])));
        y = _mm512_fmadd_ps(h[n], _mm512_set1_ps(C[n]), y);
      }
      store_y16<X>(a, row * E + e0, e0, y, u, _mm512_loadu_ps(gate + t * E + e0));
    }
    float* present = a.present + (b * E + e0) * N;
    for (int64_t n = 0; n < N; ++n) _mm512_i32scatter_ps(present + n, across, h[n], 4);
  }
}
#endif

// A scan task's channels: a multiple of every build's lanes and of dt_block's 32 channels (64: as fast as the one
// thread's pass over all channels, where 32 took longer: docs/benchmarks.md)
constexpr int64_t kScanChannels = 64;

// Pass 1 for channels [e_begin, e_end) (at most kScanChannels) of every row of the launch, into dt_all and gate_all
// [B * T, E]
template <typename X, bool Avx512>
static inline void scan_pass1(const ScanArgs& a, float* dt_all, float* gate_all, int64_t e_begin, int64_t e_end) {
  const int64_t E = a.inner, R = a.rank, T = a.rows;
  alignas(64) float buffer[kScanChannels];  // a row's z as floats, where xz is float16
  bool summed = false;  // whether the AVX-512 blocks made pass 1's dt sums
#ifdef MAMBATRT_AVX2
  // AVX-512: the dt sums as small matrix products (dt_rows_avx512) over all the launch's rows at once (its sequences
  // share the weights' loads)
  if constexpr (Avx512) {
    if (E % 32 == 0) {
      dt_rows_avx512(a, 0, a.batch * T, e_begin, e_end, dt_all);
      summed = true;
    }
  }
#endif
  for (int64_t row = 0; row < a.batch * T; ++row) {  // pass 1
    const float* x = a.xdbl + row * a.xdbl_width;
    float* d = dt_all + row * E;
    // dt_weight as [R, E] (dt_weight_t): every channel at once per r, the same order of sums at every batch and
    // row count (a sequence's dt has the same bits alone, batched or in a chunk)
    if (!summed) {
      for (int64_t e = e_begin; e < e_end; ++e) d[e] = a.dt_bias[e];
      for (int64_t r = 0; r < R; ++r) {
        const float xr = x[r];
        const float* w = a.dt_weight_t + r * E;
        for (int64_t e = e_begin; e < e_end; ++e) d[e] += xr * w[e];
      }
    }
    for (int64_t e = e_begin; e < e_end; ++e) d[e] = softplus_fast(d[e]);
    float* g = gate_all + row * E;
    const int64_t z0 = row * a.xz_width + a.xz_width - E;
    const float* z = X::row(a.xz, z0 + e_begin, e_end - e_begin, buffer) - e_begin;  // z[e], e in [e_begin, e_end)
    for (int64_t e = e_begin; e < e_end; ++e) g[e] = silu_fast(z[e]);
  }
}

// Pass 2 for channels [e_begin, e_end) of sequence b, from its dt and gate [T, E]
template <typename X, int64_t L, bool Avx512>
static inline void scan_pass2(const ScanArgs& a, const float* dts, const float* gate, int64_t b, int64_t e_begin,
                              int64_t e_end) {
  const int64_t E = a.inner, N = a.state, R = a.rank, T = a.rows;
  alignas(64) float h[kMaxState][L], A[kMaxState][L], dtl[L], ul[L], vl[L], yl[L];
#ifdef MAMBATRT_AVX2
  if constexpr (Avx512) {
    if (T >= kLanes && N == 16 && E % 16 == 0) return scan_chunk16<X>(a, b, dts, gate, e_begin, e_end);
    if (T == 1 && N == 16) return scan_step16<X>(a, b, dts, gate, e_begin, e_end);
  }
#endif
  if (T < kLanes) {  // pass 2 for a few rows (decode): a channel at a time, its state elements as the vector
    static_assert(kMaxState == 32, "the cases below");
    switch ((N + 7) / 8) {
      case 1:
        scan_rows_by_channel<X, 8>(a, b, dts, gate, e_begin, e_end);
        break;
      case 2:
        scan_rows_by_channel<X, 16>(a, b, dts, gate, e_begin, e_end);
        break;
      case 3:
        scan_rows_by_channel<X, 24>(a, b, dts, gate, e_begin, e_end);
        break;
      default:
        scan_rows_by_channel<X, 32>(a, b, dts, gate, e_begin, e_end);
    }
    return;
  }
  for (int64_t e0 = e_begin; e0 < e_end; e0 += L) {  // pass 2
    const int64_t lanes = e_end - e0 < L ? e_end - e0 : L;  // the lanes past the task's channels compute zeros
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t l = 0; l < L; ++l) {
        h[n][l] = l < lanes ? a.past[(b * E + e0 + l) * N + n] : 0.0f;
        A[n][l] = l < lanes ? a.a[(e0 + l) * N + n] : 0.0f;
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float* x = a.xdbl + row * a.xdbl_width;
      const float *B = x + R, *C = x + R + N;
      for (int64_t l = 0; l < L; ++l) {
        dtl[l] = l < lanes ? dts[t * E + e0 + l] : 0.0f;
        ul[l] = l < lanes ? a.u[row * E + e0 + l] : 0.0f;
        vl[l] = dtl[l] * ul[l];
        yl[l] = 0.0f;
      }
      for (int64_t n = 0; n < N; ++n) {
        const float bn = B[n], cn = C[n];
        for (int64_t l = 0; l < L; ++l) {
          h[n][l] = exp_fast(dtl[l] * A[n][l]) * h[n][l] + vl[l] * bn;
          yl[l] += h[n][l] * cn;
        }
      }
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t e = e0 + l;
        X::store(a.y, row * E + e, (yl[l] + a.d[e] * ul[l]) * gate[t * E + e]);
      }
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < lanes; ++l) a.present[(b * E + e0 + l) * N + n] = h[n][l];
  }
}

// A decode step's pass-2 task: this many channels of one sequence (6 tasks at mamba-130m's 1536), so that one
// sequence's step spreads over the threads too
constexpr int64_t kStepChannels = 256;
// The least state elements a launch updates for the scan to take the session's threads: a quarter of kParallelWork,
// so that one mamba-130m sequence's decode step (24576) takes them, and the default model's (6144) stays on the
// calling thread
constexpr int64_t kScanParallelWork = int64_t(1) << 14;

// A launch's tasks. A chunk's (rows >= kLanes): both passes over a block of kScanChannels channels of every
// sequence. A decode step's: pass 1 over a block of channels of every row, then (`by_sequence`) pass 2 over
// kStepChannels channels of one sequence, its past and present states runs of 16 KiB through memory (in blocks of
// kScanChannels the many short runs took longer than the step's arithmetic).
struct ScanWork {
  const ScanArgs* a;
  float *dt, *gate;  // [B * T, E]
  bool by_sequence;
};

template <typename X, int64_t L = kLanes, bool Avx512 = false>
static inline void scan_task_t(void* data, size_t task) {
  const ScanWork& w = *static_cast<const ScanWork*>(data);
  const ScanArgs& a = *w.a;
  const int64_t E = a.inner, T = a.rows;
  if (w.by_sequence) {
    const int64_t blocks = (E + kStepChannels - 1) / kStepChannels, b = int64_t(task) / blocks;
    const int64_t e0 = int64_t(task) % blocks * kStepChannels, e1 = std::min(E, e0 + kStepChannels);
    return scan_pass2<X, L, Avx512>(a, w.dt + b * T * E, w.gate + b * T * E, b, e0, e1);
  }
  const int64_t e0 = int64_t(task) * kScanChannels, e1 = std::min(E, e0 + kScanChannels);
  scan_pass1<X, Avx512>(a, w.dt, w.gate, e0, e1);
  if (T < kLanes) return;  // a decode step: pass 2 by sequence
  for (int64_t b = 0; b < a.batch; ++b) scan_pass2<X, L, Avx512>(a, w.dt + b * T * E, w.gate + b * T * E, b, e0, e1);
}

// A launch's scan, its tasks spread over the threads where it has kParallelWork; the scratch is the calling thread's
static void scan_run(const ScanArgs& a, void (*task)(void*, size_t)) {
  thread_local std::vector<float> dt, gate;
  dt.resize(size_t(a.batch * a.rows * a.inner));
  gate.resize(dt.size());
  ScanWork work{&a, dt.data(), gate.data(), false};
  const bool spread = a.batch * a.rows * a.inner * a.state >= kScanParallelWork;
  run_tasks(a.threads, task, size_t((a.inner + kScanChannels - 1) / kScanChannels), &work, spread);
  if (a.rows >= kLanes) return;
  work.by_sequence = true;
  run_tasks(a.threads, task, size_t(a.batch * ((a.inner + kStepChannels - 1) / kStepChannels)), &work, spread);
}

#ifdef MAMBATRT_AVX2
// The AVX2 and AVX-512 builds of a task (cpu_math.h). flatten: everything the task calls is inlined, so compiled for
// the target too. The AVX-512 one advances 16 channels per vector in the chunk's lane pass and takes the intrinsics
// passes for N = 16 (scan_pass2).
template <typename X>
__attribute__((target(MAMBATRT_AVX2_TARGET), flatten)) static void scan_task_avx2(void* work, size_t i) {
  scan_task_t<X, kLanes, false>(work, i);
}
template <typename X>
__attribute__((target(MAMBATRT_AVX512_TARGET), flatten)) static void scan_task_avx512(void* work, size_t i) {
  scan_task_t<X, 16, true>(work, i);
}
#endif

void scan_cpu(const ScanArgs& a) {
#ifdef MAMBATRT_AVX2
  if (cpu_level() == 2) return scan_run(a, a.half ? scan_task_avx512<F16C> : scan_task_avx512<F32>);
  if (cpu_level() == 1) return scan_run(a, a.half ? scan_task_avx2<F16C> : scan_task_avx2<F32>);
#endif
  scan_run(a, a.half ? scan_task_t<F16> : scan_task_t<F32>);
}

}  // namespace mambatrt
