// The CPU kernels of MambaConv (and MambaConv16) and MambaAddNorm16 (shapes in mamba_ops.h; the scan's is in
// cpu_scan.cc, MambaLinear's in cpu_linear.cc), and the choice of the instruction-set build that runs (cpu_level,
// cpu_math.h).
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
  alignas(64) float buffer[kConvChannels];
  const float* x = X::row(a.xz, in + e0, e1 - e0, buffer) - e0;  // the new column, x[e] for e in [e0, e1)
  for (int64_t e = e0; e < e1; ++e) {
    float acc = a.bias[e];
    for (int64_t k = 0; k < K - 1; ++k) acc += a.weight_t[k * E + e] * past[e * (K - 1) + k];
    acc += a.weight_t[(K - 1) * E + e] * x[e];
    y[e] = silu_fast(acc);
  }
  float* present = a.present + b * E * (K - 1);
  if (K > 2) {  // the block's columns one to the left (the last filled below)
    std::memmove(present + e0 * (K - 1), past + e0 * (K - 1) + 1, sizeof(float) * size_t((e1 - e0) * (K - 1) - 1));
  }
  for (int64_t e = e0; e < e1; ++e) present[e * (K - 1) + K - 2] = x[e];
}

// A chunk's rows of channels [e0, e1) of sequence b: rows outer, channels inner, so each tap is a contiguous run of
// channels (from the past columns for the first K-1 rows) and the inner loop vectorizes, exp_fast included. The
// last K input rows are at hand as floats (in[s % K]: xz itself, or float16 rows converted once into `ring`, where
// each is read by K taps).
template <typename X>
static inline void conv_chunk_t(const ConvArgs& a, int64_t b, int64_t e0, int64_t e1) {
  const int64_t K = a.kernel, E = a.inner;
  alignas(64) float sums[kConvChannels], ring[kMaxConvWidth][kConvChannels];
  const float* in[kMaxConvWidth];  // input row s in in[s % K], in[s % K][e] for e in [e0, e1)
  float* acc = sums - e0;  // acc[e] for e in [e0, e1)
  const float* past = a.past + b * E * (K - 1);  // [E, K-1]
  for (int64_t t = 0; t < a.rows; ++t) {
    const int64_t slot = t % K;
    in[slot] = X::row(a.xz, (b * a.rows + t) * a.xz_width + e0, e1 - e0, ring[slot]) - e0;
    for (int64_t e = e0; e < e1; ++e) acc[e] = a.bias[e];
    for (int64_t k = 0; k < K; ++k) {
      const float* w = a.weight_t + k * E;  // tap k of every channel
      const int64_t s = t - (K - 1) + k;  // the input row of tap k (negative: a past column)
      if (s < 0) {
        for (int64_t e = e0; e < e1; ++e) acc[e] += w[e] * past[e * (K - 1) + (K - 1 + s)];
      } else {
        const float* x = in[s % K];
        for (int64_t e = e0; e < e1; ++e) acc[e] += w[e] * x[e];
      }
    }
    float* y = a.y + (b * a.rows + t) * E;
    for (int64_t e = e0; e < e1; ++e) y[e] = silu_fast(acc[e]);
  }
  float* present = a.present + b * E * (K - 1);  // the last K-1 inputs, past columns first
  for (int64_t e = e0; e < e1; ++e) {
    for (int64_t j = 0; j < K - 1; ++j) {
      const int64_t s = a.rows - (K - 1) + j;
      present[e * (K - 1) + j] = s < 0 ? past[e * (K - 1) + (K - 1 + s)] : in[s % K][e];
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

// The rows whose sums of squares MambaAddNorm16's CPU kernel takes side by side
constexpr int64_t kNormRows = 8;

// M rows of MambaAddNorm16 from r0: sum = x + residual, normed = sum / rms(sum) * weight. Each row's squares sum in
// double in the order of i; the M rows' chains of dependent adds run side by side (one row's chain took longer than
// the rest of the row's work).
template <typename X, int64_t M>
static inline void add_norm_rows(const NormArgs& a, int64_t r0) {
  const int64_t D = a.width;
  float* s = a.sum + r0 * D;  // [M, D]
  const float* residual = a.residual + r0 * D;
  for (int64_t j = 0; j < M; ++j) X::row(a.x, (r0 + j) * D, D, s + j * D);  // x as floats, into sum
  for (int64_t i = 0; i < M * D; ++i) s[i] += residual[i];
  double squares[M] = {};
  for (int64_t i = 0; i < D; ++i)
    for (int64_t j = 0; j < M; ++j) squares[j] += double(s[j * D + i]) * s[j * D + i];
  for (int64_t j = 0; j < M; ++j) {
    const float scale = 1.0f / std::sqrt(float(squares[j] / double(D)) + *a.eps);
    for (int64_t i0 = 0; i0 < D; i0 += 64) {  // normed in runs of 64 floats, each stored as X
      alignas(64) float out[64];
      const int64_t n = std::min<int64_t>(64, D - i0);
      for (int64_t i = 0; i < n; ++i) out[i] = s[j * D + i0 + i] * scale * a.weight[i0 + i];
      X::store_row(a.normed, (r0 + j) * D + i0, n, out);
    }
  }
}

template <typename X>
static inline void add_norm_t(const NormArgs& a) {
  int64_t r = 0;
  for (; r + kNormRows <= a.rows; r += kNormRows) add_norm_rows<X, kNormRows>(a, r);
  for (; r < a.rows; ++r) add_norm_rows<X, 1>(a, r);
}

namespace {
// The best build a test lets the library run (cap_cpu_isa): 2 AVX-512 (no cap), 1 AVX2 + FMA + F16C, 0 SSE2
std::atomic<int> g_most_level{2};
}  // namespace

#ifdef MAMBATRT_AVX2
// The AVX2 and AVX-512 builds of the conv's task and of the add+norm (cpu_math.h). flatten: everything they call is
// inlined, so compiled for the target too.
template <typename X>
__attribute__((target(MAMBATRT_AVX2_TARGET), flatten)) static void conv_task_avx2(void* args, size_t i) {
  conv_task_t<X>(args, i);
}
template <typename X>
__attribute__((target(MAMBATRT_AVX512_TARGET), flatten)) static void conv_task_avx512(void* args, size_t i) {
  conv_task_t<X>(args, i);
}
__attribute__((target(MAMBATRT_AVX2_TARGET), flatten)) static void add_norm_avx2(const NormArgs& a) {
  add_norm_t<F16C>(a);
}
__attribute__((target(MAMBATRT_AVX512_TARGET), flatten)) static void add_norm_avx512(const NormArgs& a) {
  add_norm_t<F16C>(a);
}

// The build to run: the best the CPU (and the OS: libgcc checks the saved register state) has, at most the one a test
// capped the library to (cap_cpu_isa)
int cpu_level() {
  static const int has = [] {
    const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 ? 2 : (avx2 ? 1 : 0);
  }();
  const int most = g_most_level.load(std::memory_order_relaxed);
  return has < most ? has : most;
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

void conv_cpu(const ConvArgs& a) {
#ifdef MAMBATRT_AVX2
  if (cpu_level() == 2) return conv_run(a, a.half ? conv_task_avx512<F16C> : conv_task_avx512<F32>);
  if (cpu_level() == 1) return conv_run(a, a.half ? conv_task_avx2<F16C> : conv_task_avx2<F32>);
#endif
  conv_run(a, a.half ? conv_task_t<F16> : conv_task_t<F32>);
}

void add_norm_cpu(const NormArgs& a) {
#ifdef MAMBATRT_AVX2
  if (cpu_level() == 2) return add_norm_avx512(a);
  if (cpu_level() == 1) return add_norm_avx2(a);
#endif
  add_norm_t<F16>(a);
}

}  // namespace mambatrt
