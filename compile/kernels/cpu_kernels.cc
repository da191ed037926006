// The CPU kernels of MambaConv (and MambaConv16), MambaAddNorm16 and MambaLinear (shapes in mamba_ops.h; the scan's
// is in cpu_scan.cc), and the choice of the instruction-set build that runs (cpu_level, cpu_math.h).
#include <atomic>
#include <cstring>

#include "cpu_math.h"

namespace mambatrt {

// The CPU conv's tasks: a block of kConvChannels channels of one sequence (channels never meet in the conv, so the
// bits do not depend on the threads)
constexpr int64_t kConvChannels = 256;

// The conv of one row per sequence (a decode step), K known at compile time: each channel's K-1 past columns are
// consecutive (past [E, K-1]), so the taps' sums run channel by channel in registers, in the order of the rows'
// loop below (bias, then the taps in order: the same bits), and present is past shifted by one float (one memmove
// per block of channels: present may be past itself) with the new column written into every (K-1)-th place. The
// rows' loop below (K passes over E with strided past reads, then a copy per channel) took 19-20 us per layer at
// batch 16 of the default model (E 384) in the AVX-512 build, this one 11 (docs/benchmarks.md).
template <typename X, int64_t K>
static inline void conv_step_t(const ConvArgs& a, int64_t b, int64_t e0, int64_t e1) {
  const int64_t E = a.inner;
  const float* past = a.past + b * E * (K - 1);  // [E, K-1]
  const int64_t in = b * a.xz_width;
  float* y = a.y + b * E;
  for (int64_t e = e0; e < e1; ++e) {
    float acc = a.bias[e];
    for (int64_t k = 0; k < K - 1; ++k) acc += a.weight_t[k * E + e] * past[e * (K - 1) + k];
    acc += a.weight_t[(K - 1) * E + e] * X::load(a.xz, in + e);
    y[e] = silu_fast(acc);
  }
  float* present = a.present + b * E * (K - 1);
  if (K > 2) {  // the block's columns one to the left (the last filled below)
    std::memmove(present + e0 * (K - 1), past + e0 * (K - 1) + 1, sizeof(float) * size_t((e1 - e0) * (K - 1) - 1));
  }
  for (int64_t e = e0; e < e1; ++e) present[e * (K - 1) + K - 2] = X::load(a.xz, in + e);
}

// A chunk's rows of channels [e0, e1) of sequence b: rows outer, channels inner, so each tap is a contiguous run of
// channels (from the past columns for the first K-1 rows) and the inner loop vectorizes, exp_fast included
template <typename X>
static inline void conv_chunk_t(const ConvArgs& a, int64_t b, int64_t e0, int64_t e1) {
  const int64_t K = a.kernel, E = a.inner;
  alignas(64) float sums[kConvChannels];
  float* acc = sums - e0;  // acc[e] for e in [e0, e1)
  const float* past = a.past + b * E * (K - 1);  // [E, K-1]
  for (int64_t t = 0; t < a.rows; ++t) {
    for (int64_t e = e0; e < e1; ++e) acc[e] = a.bias[e];
    for (int64_t k = 0; k < K; ++k) {
      const float* w = a.weight_t + k * E;  // tap k of every channel
      const int64_t s = t - (K - 1) + k;  // the input row of tap k (negative: a past column)
      if (s < 0) {
        for (int64_t e = e0; e < e1; ++e) acc[e] += w[e] * past[e * (K - 1) + (K - 1 + s)];
      } else {
        const int64_t in = (b * a.rows + s) * a.xz_width;
        for (int64_t e = e0; e < e1; ++e) acc[e] += w[e] * X::load(a.xz, in + e);
      }
    }
    float* y = a.y + (b * a.rows + t) * E;
    for (int64_t e = e0; e < e1; ++e) y[e] = silu_fast(acc[e]);
  }
  float* present = a.present + b * E * (K - 1);  // the last K-1 inputs, past columns first
  for (int64_t e = e0; e < e1; ++e) {
    for (int64_t j = 0; j < K - 1; ++j) {
      const int64_t s = a.rows - (K - 1) + j;
      present[e * (K - 1) + j] =
          s < 0 ? past[e * (K - 1) + (K - 1 + s)] : X::load(a.xz, (b * a.rows + s) * a.xz_width + e);
    }
  }
}

template <typename X>
static inline void conv_task_t(void* data, size_t task) {
  const ConvArgs& a = *static_cast<const ConvArgs*>(data);
  const int64_t blocks = (a.inner + kConvChannels - 1) / kConvChannels, b = int64_t(task) / blocks;
  const int64_t e0 = int64_t(task) % blocks * kConvChannels, e1 = std::min(a.inner, e0 + kConvChannels);
  if (a.rows > 1) return conv_chunk_t<X>(a, b, e0, e1);
  static_assert(kMaxConvWidth == 8, "the cases below");
  switch (a.kernel) {
    case 2:
      return conv_step_t<X, 2>(a, b, e0, e1);
    case 3:
      return conv_step_t<X, 3>(a, b, e0, e1);
    case 4:
      return conv_step_t<X, 4>(a, b, e0, e1);
    case 5:
      return conv_step_t<X, 5>(a, b, e0, e1);
    case 6:
      return conv_step_t<X, 6>(a, b, e0, e1);
    case 7:
      return conv_step_t<X, 7>(a, b, e0, e1);
    default:
      return conv_step_t<X, 8>(a, b, e0, e1);
  }
}

// A launch's tasks, spread over the threads where the launch has kParallelWork
static void conv_run(const ConvArgs& a, void (*task)(void*, size_t)) {
  const size_t n = size_t(a.batch * ((a.inner + kConvChannels - 1) / kConvChannels));
  run_tasks(a.threads, task, n, const_cast<ConvArgs*>(&a), a.batch * a.rows * a.inner * a.kernel >= kParallelWork);
}

void add_norm_cpu(const NormArgs& a) {
  const int64_t D = a.width;
  for (int64_t r = 0; r < a.rows; ++r) {
    float* s = a.sum + r * D;
    double squares = 0.0;
    for (int64_t i = 0; i < D; ++i) {
      s[i] = F16::load(a.x, r * D + i) + a.residual[r * D + i];
      squares += double(s[i]) * s[i];
    }
    const float scale = 1.0f / std::sqrt(float(squares / double(D)) + *a.eps);
    for (int64_t i = 0; i < D; ++i) F16::store(a.normed, r * D + i, s[i] * scale * a.weight[i]);
  }
}

// Eight partial sums per dot product (vectorized without -ffast-math): MambaLinear on a CPU without AVX-512 (or
// with a test capping the build below it), where the runtime takes the Gemms (MLAS) instead; this loop lets the
// tests run the kernels graphs' copies on any machine.
static void linear_cpu_loop(const LinearArgs& a) {
  const int64_t K = a.in;
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = a.x + r * K;
    for (int64_t n = 0; n < a.out; ++n) {
      const float* w = a.weight + n * K;
      float part[8] = {};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int i = 0; i < 8; ++i) part[i] += x[k + i] * w[k + i];
      float s = sum8(part);
      for (; k < K; ++k) s += x[k] * w[k];
      a.y[r * a.out + n] = s;
    }
  }
}

namespace {
// The best build a test lets the library run (cap_cpu_isa): 2 AVX-512 (no cap), 1 AVX2 + FMA, 0 SSE2
std::atomic<int> g_most_level{2};
}  // namespace

#ifdef MAMBATRT_AVX2
// The AVX2 and AVX-512 builds of the conv's task (cpu_math.h). flatten: everything the task calls is inlined, so
// compiled for the target too.
template <typename X>
__attribute__((target("avx2,fma"), flatten)) static void conv_task_avx2(void* args, size_t i) {
  conv_task_t<X>(args, i);
}
template <typename X>
__attribute__((target(MAMBATRT_AVX512_TARGET), flatten)) static void conv_task_avx512(void* args, size_t i) {
  conv_task_t<X>(args, i);
}

// The build to run: the best the CPU (and the OS: libgcc checks the saved register state) has, at most the one a test
// capped the library to (cap_cpu_isa)
int cpu_level() {
  static const int has = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 ? 2 : (avx2 ? 1 : 0);
  }();
  const int most = g_most_level.load(std::memory_order_relaxed);
  return has < most ? has : most;
}

// MambaLinear with AVX-512 (the kernels graphs' CPU copies): y [M, N] = x [M, K] W^T, W packed as
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
constexpr int64_t kStripsPerTask = 4;
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
    float* y = a.y + r0 * N;
    switch (std::min<int64_t>(16, M - r0)) {
#define MAMBATRT_ROWS(R)                                          \
  case R:                                                         \
    linear_strips<R>(xp, a.weight_packed, K, N, first, end, y); \
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
  thread_local std::vector<float> packed_x;  // the calling thread's; the tasks only read it
  packed_x.resize(size_t(M * K));
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t R = std::min<int64_t>(16, M - r0);
    float* xp = packed_x.data() + r0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) xp[k * R + r] = a.x[(r0 + r) * K + k];
  }
  LinearTask task{&a, packed_x.data()};
  const size_t tasks = size_t((S + kStripsPerTask - 1) / kStripsPerTask);
  run_tasks(a.threads, linear_task, tasks, &task);
}
#endif

bool cap_cpu_isa(const char* isa) {
  if (isa == nullptr) return false;
  const int most = std::strcmp(isa, "sse2") == 0     ? 0
                   : std::strcmp(isa, "avx2") == 0   ? 1
                   : std::strcmp(isa, "avx512") == 0 ? 2
                                                     : -1;
  if (most < 0) return false;
  g_most_level.store(most, std::memory_order_relaxed);
  return true;
}

const char* cpu_isa() {
#ifdef MAMBATRT_AVX2
  static const char* const names[] = {"sse2", "avx2", "avx512"};
  return names[cpu_level()];
#else
  return "portable";
#endif
}

bool linear_cpu_packs() {
#ifdef MAMBATRT_AVX2
  return cpu_level() == 2;
#else
  return false;
#endif
}

void linear_cpu(const LinearArgs& a) {
#ifdef MAMBATRT_AVX2
  if (a.weight_packed != nullptr) return linear_cpu_avx512(a);
#endif
  linear_cpu_loop(a);
}

void conv_cpu(const ConvArgs& a) {
#ifdef MAMBATRT_AVX2
  if (cpu_level() == 2) return conv_run(a, a.half ? conv_task_avx512<F16> : conv_task_avx512<F32>);
  if (cpu_level() == 1) return conv_run(a, a.half ? conv_task_avx2<F16> : conv_task_avx2<F32>);
#endif
  conv_run(a, a.half ? conv_task_t<F16> : conv_task_t<F32>);
}

}  // namespace mambatrt
