// MambaLinear's CPU kernels (shapes in mamba_ops.h): y [M, N] = x [M, K] W^T with the weight as the bundle stores it,
// float32, float16, bfloat16 or int8 with a scale per output (LinearArgs::weight_type), x and y float32 or float16.
//
// Three kernels, picked per launch (linear_cpu):
// - the packed AVX-512 kernel for float32 weights (the weight kept as 16-column strips: linear_cpu_avx512),
// - the strip kernel of the AVX2 build for every weight type (linear_strips_avx2): the weight kept as 16-column
//   strips of its own type (2 bytes an element for 16-bit weights, 1 for int8), converted to float32 in registers
//   (F16C for float16, a shift for bfloat16, a widening for int8), never into a float32 copy, and multiplied in tiles
//   of up to 6 rows x 4 strips. A decode step reads every weight byte once, so its speed is the memory bandwidth
//   over the weight bytes: 16-bit weights halve the bytes of float32, int8 quarter them; a prefill launch's tiles of
//   6 rows take 12 FMAs a step beside 2 conversions, as many FMAs a cycle as the core has,
// - the plain loop elsewhere (and for the SSE2 build a test caps the library to), of every weight type.
// The packed kernels sum each output as one FMA chain over K in order, the plain loop as 8 partial sums then sum8,
// whatever the rows a launch has, so a row's bits do not depend on the batch it runs in nor on the threads.
#include <cstring>

#include "cpu_math.h"

namespace mambatrt {

// A weight element as float, for the plain loop
static inline float weight_at(const LinearArgs& a, int64_t i) {
  switch (a.weight_type) {
    case WeightType::kF16:
      return half_to_float(static_cast<const uint16_t*>(a.weight)[i]);
    case WeightType::kBF16: {
      const uint32_t bits = uint32_t(static_cast<const uint16_t*>(a.weight)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case WeightType::kI8:
      return float(static_cast<const int8_t*>(a.weight)[i]);
    default:
      return static_cast<const float*>(a.weight)[i];
  }
}

// x's rows as float32: x itself, or x converted into `buffer` where it is float16 (X: F16, or F16C in the AVX2 build)
template <typename X>
static const float* x_as_float(const LinearArgs& a, std::vector<float>& buffer) {
  if (!a.half) return static_cast<const float*>(a.x);
  buffer.resize(size_t(a.rows * a.in));
  return X::row(a.x, 0, a.rows * a.in, buffer.data());
}

// Output (r, n) of a finished sum: the int8 weight's scale applied, stored as float or float16
static inline void store_out(const LinearArgs& a, int64_t r, int64_t n, float sum) {
  if (a.weight_type == WeightType::kI8) sum *= a.scale[n];
  if (a.half) return F16::store(a.y, r * a.out + n, sum);
  static_cast<float*>(a.y)[r * a.out + n] = sum;
}

// Eight partial sums per dot product (vectorized without -ffast-math)
static void linear_cpu_loop(const LinearArgs& a) {
  const int64_t K = a.in;
  std::vector<float> converted;
  const float* xs = x_as_float<F16>(a, converted);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = xs + r * K;
    for (int64_t n = 0; n < a.out; ++n) {
      float part[8] = {};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int i = 0; i < 8; ++i) part[i] += x[k + i] * weight_at(a, n * K + k + i);
      float s = sum8(part);
      for (; k < K; ++k) s += x[k] * weight_at(a, n * K + k);
      store_out(a, r, n, s);
    }
  }
}

#ifdef MAMBATRT_AVX2
#define MAMBATRT_AVX2_F16C __attribute__((target(MAMBATRT_AVX2_TARGET)))

// Eight weights from `w` (elements [i, i + 8)) as float32 lanes
template <WeightType W>
MAMBATRT_AVX2_F16C static inline __m256 load8(const void* w, int64_t i) {
  if constexpr (W == WeightType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i)));
  } else if constexpr (W == WeightType::kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (W == WeightType::kI8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  }
}

template <WeightType W>
constexpr int64_t kWeightBytes = W == WeightType::kF32 ? 4 : W == WeightType::kI8 ? 1 : 2;

// Outputs [col, col + 16) of row r from their sums (lo: the first 8), as store_out writes them: a full strip's 16
// with vector stores (_mm256_cvtps_ph rounds to nearest even, as float_to_half does), the last strip's one by one.
// Not inlined: inlined into strip_tile, it leaves GCC keeping some of the tile's accumulators in memory.
template <WeightType W>
MAMBATRT_AVX2_F16C __attribute__((noinline)) static void store16(const LinearArgs& a, int64_t r, int64_t col, __m256 lo,
                                                                 __m256 hi) {
  if (col + 16 > a.out) {
    alignas(32) float out[16];
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
    for (int64_t j = 0; j < a.out - col; ++j) store_out(a, r, col + j, out[j]);
    return;
  }
  if constexpr (W == WeightType::kI8) {
    lo = _mm256_mul_ps(lo, _mm256_loadu_ps(a.scale + col));
    hi = _mm256_mul_ps(hi, _mm256_loadu_ps(a.scale + col + 8));
  }
  if (a.half) {
    __m128i* y = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.y) + r * a.out + col);
    _mm_storeu_si128(y, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(y + 1, _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
  } else {
    float* y = static_cast<float*>(a.y) + r * a.out + col;
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
  }
}

// Outputs [16 s, 16 (s + T)) of rows [r, r + R) from the weight's strips (LinearArgs::weight_packed: [S][K][16] of
// the weight's type): R x T x 2 accumulators, each one FMA chain over K in order, so an output's bits do not depend
// on the tile it ran in. A step k converts T x 16 weights and broadcasts R elements of x (rows of K floats, from L1
// or L2) into R x T x 2 FMAs. The pragmas unroll the tile's loops before GCC places acc: unrolled later, acc stays
// an array in memory, stored at every step, and a step of 16-bit or int8 weights takes twice as long.
template <WeightType W, int R, int T>
MAMBATRT_AVX2_F16C static inline void strip_tile(const LinearArgs& a, const float* xs, int64_t r, int64_t s) {
  const int64_t K = a.in;
  const void* w = static_cast<const char*>(a.weight_packed) + s * K * 16 * kWeightBytes<W>;
  __m256 acc[R][T][2];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[T][2];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      wv[t][0] = load8<W>(w, (t * K + k) * 16);
      wv[t][1] = load8<W>(w, (t * K + k) * 16 + 8);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(xs + (r + i) * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        acc[i][t][0] = _mm256_fmadd_ps(xv, wv[t][0], acc[i][t][0]);
        acc[i][t][1] = _mm256_fmadd_ps(xv, wv[t][1], acc[i][t][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) store16<W>(a, r + i, (s + t) * 16, acc[i][t][0], acc[i][t][1]);
}

// Strips [s0, s1) for rows [r, r + R): T strips a tile, as many as the 16 registers hold beside R rows (the
// accumulators, a step's weights and x), with at least 8 FMA chains a tile to cover the FMA's latency
template <WeightType W, int R>
MAMBATRT_AVX2_F16C static void strip_rows(const LinearArgs& a, const float* xs, int64_t r, int64_t s0, int64_t s1) {
  constexpr int T = R == 1 ? 4 : R <= 3 ? 2 : 1;
  int64_t s = s0;
  for (; s + T <= s1; s += T) strip_tile<W, R, T>(a, xs, r, s);
  for (; s < s1; ++s) strip_tile<W, R, 1>(a, xs, r, s);
}

// One task: the task's strips (kStripsPerTask x K x 16 weights: 96-384 KiB at mamba-130m's widths, in L2 while
// every block of up to 6 rows passes over them, so a launch reads the weights from memory once)
constexpr int64_t kStripsPerTask = 4;
struct StripsTask {
  const LinearArgs* a;
  const float* x;  // x as float32
};

template <WeightType W>
MAMBATRT_AVX2_F16C static void linear_strips_task(void* data, size_t task) {
  const StripsTask& t = *static_cast<const StripsTask*>(data);
  const LinearArgs& a = *t.a;
  const int64_t strips = (a.out + 15) / 16;
  const int64_t s0 = int64_t(task) * kStripsPerTask, s1 = std::min(strips, s0 + kStripsPerTask);
  for (int64_t r = 0; r < a.rows; r += 6) {
    switch (std::min<int64_t>(6, a.rows - r)) {
#define MAMBATRT_ROWS(R)                 \
  case R:                                \
    strip_rows<W, R>(a, t.x, r, s0, s1); \
    break;
      MAMBATRT_ROWS(1) MAMBATRT_ROWS(2) MAMBATRT_ROWS(3) MAMBATRT_ROWS(4) MAMBATRT_ROWS(5) MAMBATRT_ROWS(6)
#undef MAMBATRT_ROWS
    }
  }
}

static void linear_strips_avx2(const LinearArgs& a) {
  thread_local std::vector<float> converted;  // the calling thread's; the tasks only read it
  StripsTask task{&a, x_as_float<F16C>(a, converted)};
  void (*fn)(void*, size_t) = linear_strips_task<WeightType::kF32>;
  if (a.weight_type == WeightType::kF16) fn = linear_strips_task<WeightType::kF16>;
  if (a.weight_type == WeightType::kBF16) fn = linear_strips_task<WeightType::kBF16>;
  if (a.weight_type == WeightType::kI8) fn = linear_strips_task<WeightType::kI8>;
  const int64_t strips = (a.out + 15) / 16;
  run_tasks(a.threads, fn, size_t((strips + kStripsPerTask - 1) / kStripsPerTask), &task);
}

// MambaLinear with AVX-512 on float32 weights: y [M, N] = x [M, K] W^T, W packed as
// 16-column strips [S][K][16] (packed_strips), rows in blocks of up to 16. A tile is T strips x R rows of
// accumulators, one register each; a step k loads one cache line of each strip and broadcasts x[r][k] (the block's
// rows packed as [K][R], so a step's broadcasts share a line) into R x T FMAs. Each output is one FMA chain over K in
// order, whatever the tile, so a row's bits do not depend on the batch it runs in. Why not MLAS's Gemm: at a decode
// launch's few rows MLAS streams the weights and multiplies in turn more than at once (docs/benchmarks.md);
// here the strips are prefetched about a memory latency ahead (more steps ahead the more rows a step multiplies),
// and with more than 16 rows the row blocks take a few strips each in turn while those are in L2, so the weights
// come from memory once per launch. The strips are split into tasks for the session's threads (linear_task), each
// output computed by one thread whole: the same bits on any number of threads.
template <int R, int T>
MAMBATRT_AVX512 static inline void linear_tile(const float* xp, const float* wp, int64_t K, int64_t N, int64_t s,
                                               float* y) {
  constexpr int64_t ahead = R >= 12 ? 32 : R >= 6 ? 16 : 4;  // steps
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const float* w = wp + s * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[T];
    for (int t = 0; t < T; ++t) {
      wv[t] = _mm512_load_ps(w + (t * K + k) * 16);
      _mm_prefetch(reinterpret_cast<const char*>(w + (t * K + k + ahead) * 16), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xp[k * R + r]);
      for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(xv, wv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = (s + t) * 16, left = N - col;
    const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + col, m, acc[t][r]);
  }
}

// Strips [s0, s1) for a block of R rows: T strips a tile, as many as the registers hold beside R rows (R x T <= 24)
// and a task's strips divide into (kStripsPerTask, 4).
template <int R>
MAMBATRT_AVX512 static void linear_strips(const float* xp, const float* wp, int64_t K, int64_t N, int64_t s0,
                                          int64_t s1, float* y) {
  constexpr int T = R <= 4 ? 4 : R <= 12 ? 2 : 1;
  int64_t s = s0;
  for (; s + T <= s1; s += T) linear_tile<R, T>(xp, wp, K, N, s, y);
  for (; s < s1; ++s) linear_tile<R, 1>(xp, wp, K, N, s, y);
}

// One task of a launch: strips [task x kStripsPerTask, ...) of every row block in turn (with more than 16 rows, the
// task's 4 strips stay in L2 for all the blocks: 192-384 KiB). Tasks write disjoint columns, so they run on any
// threads in any order with the same results; 4 strips a task leave a launch's smaller products (out_proj: 48
// strips at mamba-130m) enough tasks for several threads.
struct LinearTask {
  const LinearArgs* a;
  const float* packed_x;  // each block of rows as [K][R]
};

MAMBATRT_AVX512 static void linear_task(void* data, size_t task) {
  const LinearTask& t = *static_cast<const LinearTask*>(data);
  const LinearArgs& a = *t.a;
  const int64_t M = a.rows, K = a.in, N = a.out, S = (N + 15) / 16;
  const int64_t first = int64_t(task) * kStripsPerTask, end = std::min(S, first + kStripsPerTask);
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const float* xp = t.packed_x + r0 * K;
    float* y = static_cast<float*>(a.y) + r0 * N;
    switch (std::min<int64_t>(16, M - r0)) {
#define MAMBATRT_ROWS(R)                                          \
  case R:                                                         \
    linear_strips<R>(xp, static_cast<const float*>(a.weight_packed), K, N, first, end, y); \
    break;
      MAMBATRT_ROWS(1) MAMBATRT_ROWS(2) MAMBATRT_ROWS(3) MAMBATRT_ROWS(4) MAMBATRT_ROWS(5) MAMBATRT_ROWS(6)
      MAMBATRT_ROWS(7) MAMBATRT_ROWS(8) MAMBATRT_ROWS(9) MAMBATRT_ROWS(10) MAMBATRT_ROWS(11) MAMBATRT_ROWS(12)
      MAMBATRT_ROWS(13) MAMBATRT_ROWS(14) MAMBATRT_ROWS(15) MAMBATRT_ROWS(16)
#undef MAMBATRT_ROWS
    }
  }
}

MAMBATRT_AVX512 static void linear_cpu_avx512(const LinearArgs& a) {
  const int64_t M = a.rows, K = a.in, S = (a.out + 15) / 16;
  const float* x = static_cast<const float*>(a.x);
  thread_local std::vector<float> packed_x;  // the calling thread's; the tasks only read it
  packed_x.resize(size_t(M * K));
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t R = std::min<int64_t>(16, M - r0);
    float* xp = packed_x.data() + r0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) xp[k * R + r] = x[(r0 + r) * K + k];
  }
  LinearTask task{&a, packed_x.data()};
  const size_t tasks = size_t((S + kStripsPerTask - 1) / kStripsPerTask);
  run_tasks(a.threads, linear_task, tasks, &task);
}
#endif

bool linear_cpu_packs() {
#ifdef MAMBATRT_AVX2
  return cpu_level() == 2;
#else
  return false;
#endif
}

bool linear_cpu_rows() {
#ifdef MAMBATRT_AVX2
  return cpu_level() >= 1;
#else
  return false;
#endif
}

void linear_cpu(const LinearArgs& a) {
#ifdef MAMBATRT_AVX2
  if (a.weight_packed != nullptr && a.weight_type == WeightType::kF32 && !a.half && cpu_level() == 2) {
    return linear_cpu_avx512(a);
  }
  if (a.weight_packed != nullptr && cpu_level() >= 1) return linear_strips_avx2(a);
#endif
  linear_cpu_loop(a);
}

}  // namespace mambatrt
