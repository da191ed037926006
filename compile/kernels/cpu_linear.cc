// MambaLinear's CPU kernels (shapes in mamba_ops.h): y [M, N] = x [M, K] W^T with the weight as the bundle stores it,
// float32, float16, bfloat16 or int8 with a scale per output (LinearArgs::weight_type), x and y float32 or float16.
//
// Three kernels, picked per launch (linear_cpu), each on the weight kept as 16-column strips of its own type (2 bytes
// an element for 16-bit weights, 1 for int8), converted to float32 in registers (F16C for float16, a shift for
// bfloat16, a widening for int8), never into a float32 copy:
// - the packed AVX-512 kernel where the CPU has AVX-512 (linear_cpu_avx512), for every weight type: a strip step's 16
//   weights in one register, tiles of up to 16 rows, the strips prefetched ahead,
// - the strip kernel of the AVX2 build elsewhere (linear_strips_avx2): a strip step's 16 weights in two registers,
//   tiles of up to 6 rows x 4 strips,
// - the plain loop where neither runs (and for the SSE2 build a test caps the library to), of every weight type.
// A decode step reads every weight byte once, so its speed is the memory bandwidth over the weight bytes: 16-bit
// weights halve the bytes of float32, int8 quarter them; a prefill launch's tiles keep the core's FMAs busy beside
// the conversions. The packed kernels sum each output as one FMA chain over K in order (the AVX-512 kernel's and the
// AVX2 strips' are the same chains, so they give the same bits), the plain loop as 8 partial sums then sum8,
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

// Sixteen weights from `w` (elements [i, i + 16)) as float32 lanes: the 16 lanes of load8's two 8-lane halves
template <WeightType W>
MAMBATRT_AVX512 static inline __m512 load16(const void* w, int64_t i) {
  if constexpr (W == WeightType::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i)));
  } else if constexpr (W == WeightType::kBF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (W == WeightType::kI8) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  } else {
    return _mm512_load_ps(static_cast<const float*>(w) + i);
  }
}

// Outputs [col, col + 16) of row r from their sums, as store16 writes them (the int8 weight's scale, float16 rounded
// to nearest even), the last strip's columns past N masked off
template <WeightType W>
MAMBATRT_AVX512 static inline void store_strip(const LinearArgs& a, int64_t r, int64_t col, __m512 sum) {
  const int64_t left = a.out - col;
  const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
  if constexpr (W == WeightType::kI8) sum = _mm512_mul_ps(sum, _mm512_maskz_loadu_ps(m, a.scale + col));
  if (a.half) {
    const __m256i h = _mm512_cvtps_ph(sum, _MM_FROUND_TO_NEAREST_INT);
    return _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + r * a.out + col, m, h);
  }
  _mm512_mask_storeu_ps(static_cast<float*>(a.y) + r * a.out + col, m, sum);
}

// Step k of a tile: T x 16 weights converted, R elements of x broadcast, R x T FMAs
template <WeightType W, int R, int T>
MAMBATRT_AVX512 __attribute__((always_inline)) static inline void tile_step(const char* w, int64_t K, const float* xp,
                                                                           int64_t k, __m512 (&acc)[T][R]) {
  __m512 wv[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) wv[t] = load16<W>(w + t * K * 16 * kWeightBytes<W>, k * 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 xv = _mm512_set1_ps(xp[k * R + r]);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(xv, wv[t], acc[t][r]);
  }
}

// MambaLinear with AVX-512 on every weight type: y [M, N] = x [M, K] W^T, W packed as 16-column strips [S][K][16] of
// its own type (packed_strips), rows in blocks of up to 16. A tile is T strips x R rows of accumulators, one register
// each; a step k loads (and converts: one vcvtph2ps for float16, a widening and a vcvtdq2ps for int8) 16 elements of
// each strip and broadcasts x[r][k] (the block's rows packed as [K][R], so a step's broadcasts share a line) into R x
// T FMAs. Each output is one FMA chain over K in order, whatever the tile, so a row's bits do not depend on the
// batch it runs in, and they equal the AVX2 strips' (whose two 8-lane halves are the same chains). Why not MLAS's
// Gemm: at a decode launch's few rows MLAS streams the weights and multiplies in turn more than at once
// (docs/benchmarks.md); here the strips are prefetched about a memory latency ahead, one prefetch per cache line of
// each strip (2 KiB ahead, where a decode row's strips streamed faster than from 256 bytes; 1 KiB for blocks of 6-11
// rows), and with more than 16 rows the row blocks take a few strips each in turn while those are in L2, so the
// weights come from memory once per launch. The strips are split
// into tasks for the session's threads (linear_task), each output computed by one thread whole: the same bits on any
// number of threads.
template <WeightType W, int R, int T>
MAMBATRT_AVX512 static inline void linear_tile(const LinearArgs& a, const float* xp, int64_t r0, int64_t s) {
  constexpr int64_t step = 16 * kWeightBytes<W>;                      // bytes of a strip per k
  constexpr int64_t line = 64 / step;                                 // steps per cache line
  constexpr int64_t ahead = (R >= 6 && R < 12 ? 1024 : 2048) / step;  // steps
  const int64_t K = a.in;
  const char* w = static_cast<const char*>(a.weight_packed) + s * K * step;
  __m512 acc[T][R];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + line <= K; k += line) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) _mm_prefetch(w + (t * K + k + ahead) * step, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t j = 0; j < line; ++j) tile_step<W, R, T>(w, K, xp, k + j, acc);
  }
  for (; k < K; ++k) tile_step<W, R, T>(w, K, xp, k, acc);
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) store_strip<W>(a, r0 + r, (s + t) * 16, acc[t][r]);
}

// Strips [s0, s1) for a block of R rows: T strips a tile, as many as the registers hold beside R rows (R x T <= 24)
// and a task's strips divide into (kStripsPerTask, 4).
template <WeightType W, int R>
MAMBATRT_AVX512 static void linear_strips(const LinearArgs& a, const float* xp, int64_t r0, int64_t s0, int64_t s1) {
  constexpr int T = R <= 4 ? 4 : R <= 12 ? 2 : 1;
  int64_t s = s0;
  for (; s + T <= s1; s += T) linear_tile<W, R, T>(a, xp, r0, s);
  for (; s < s1; ++s) linear_tile<W, R, 1>(a, xp, r0, s);
}

// One task of a launch: strips [task x kStripsPerTask, ...) of every row block in turn (with more than 16 rows, the
// task's 4 strips stay in L2 for all the blocks: 48-384 KiB at mamba-130m's widths). Tasks write disjoint columns, so
// they run on any threads in any order with the same results; 4 strips a task leave a launch's smaller products
// (out_proj: 48 strips at mamba-130m) enough tasks for several threads.
struct LinearTask {
  const LinearArgs* a;
  const float* packed_x;  // each block of rows as [K][R]
  int64_t strips;         // a task's: kStripsPerTask, or fewer for a product of few strips (strips_per_task)
};

// A product of fewer than 8 tasks of kStripsPerTask strips (x_proj: 5 strips at mamba-130m) takes an eighth of its
// strips a task (at least one) instead, so that its tasks spread over all the threads
static inline int64_t strips_per_task(int64_t strips) {
  return strips >= 8 * kStripsPerTask ? kStripsPerTask : std::max<int64_t>(1, strips / 8);
}

template <WeightType W>
MAMBATRT_AVX512 static void linear_task(void* data, size_t task) {
  const LinearTask& t = *static_cast<const LinearTask*>(data);
  const LinearArgs& a = *t.a;
  const int64_t M = a.rows, K = a.in, S = (a.out + 15) / 16;
  const int64_t first = int64_t(task) * t.strips, end = std::min(S, first + t.strips);
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const float* xp = t.packed_x + r0 * K;
    switch (std::min<int64_t>(16, M - r0)) {
#define MAMBATRT_ROWS(R)                                \
  case R:                                               \
    linear_strips<W, R>(a, xp, r0, first, end);         \
    break;
      MAMBATRT_ROWS(1) MAMBATRT_ROWS(2) MAMBATRT_ROWS(3) MAMBATRT_ROWS(4) MAMBATRT_ROWS(5) MAMBATRT_ROWS(6)
      MAMBATRT_ROWS(7) MAMBATRT_ROWS(8) MAMBATRT_ROWS(9) MAMBATRT_ROWS(10) MAMBATRT_ROWS(11) MAMBATRT_ROWS(12)
      MAMBATRT_ROWS(13) MAMBATRT_ROWS(14) MAMBATRT_ROWS(15) MAMBATRT_ROWS(16)
#undef MAMBATRT_ROWS
    }
  }
}

// x's blocks of 16 rows packed as [K][R] (float16 x converted by F16C, as the AVX2 strips convert it)
MAMBATRT_AVX512 static void linear_cpu_avx512(const LinearArgs& a) {
  const int64_t M = a.rows, K = a.in, S = (a.out + 15) / 16;
  thread_local std::vector<float> converted, packed_x;  // the calling thread's; the tasks only read them
  const float* x = x_as_float<F16C>(a, converted);
  packed_x.resize(size_t(M * K));
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t R = std::min<int64_t>(16, M - r0);
    float* xp = packed_x.data() + r0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) xp[k * R + r] = x[(r0 + r) * K + k];
  }
  LinearTask task{&a, packed_x.data(), strips_per_task(S)};
  void (*fn)(void*, size_t) = linear_task<WeightType::kF32>;
  if (a.weight_type == WeightType::kF16) fn = linear_task<WeightType::kF16>;
  if (a.weight_type == WeightType::kBF16) fn = linear_task<WeightType::kBF16>;
  if (a.weight_type == WeightType::kI8) fn = linear_task<WeightType::kI8>;
  run_tasks(a.threads, fn, size_t((S + task.strips - 1) / task.strips), &task);
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
  if (a.weight_packed != nullptr && cpu_level() == 2) return linear_cpu_avx512(a);
  if (a.weight_packed != nullptr && cpu_level() >= 1) return linear_strips_avx2(a);
#endif
  linear_cpu_loop(a);
}

}  // namespace mambatrt
