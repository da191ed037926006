// What the CPU kernels (cpu_kernels.cc, cpu_scan.cc) share: the vectorizable exponential and its kin, IEEE float16
// conversions for the ...16 ops, the loads and stores of xz and y as float or float16 (F32, F16, F16C), the
// dispatch of a launch's tasks to the session's threads, and the instruction-set builds.
//
// Builds: the kernels' hot loops vectorize (exp_fast, softplus_fast, the scan's channel lanes); on x86-64 with GCC
// each kernel's task is compiled three times, for the SSE2 baseline, for AVX2 + FMA + F16C (8 lanes instead of
// SSE2's 4, float16 rows converted by F16C) and for AVX-512 (F, VL, BW, DQ and F16C: the same loops with masked
// tails and wider registers where the loops are long enough, 16 channels per vector in the chunk scan; faster than
// the AVX2 build in every kernel on a Zen 4 core), and cpu_level() says which runs: the best the CPU has. The AVX2
// and AVX-512 builds sum in the same order (the vector lanes are channels of their own), so they give the same bits,
// except where the AVX-512 scan takes its passes for N = 16 (scan_step16 sums a channel's y across its vector in
// another order); the SSE2 build has no FMA, so it rounds its products apart from their sums.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mamba_ops.h"

// Comparisons may not trap (they never do here): GCC then turns exp_fast's clamp into selects, which vectorize.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MAMBATRT_AVX2 1
#include <immintrin.h>
#endif

namespace mambatrt {

// exp(x) in plain arithmetic that compilers vectorize (SSE2 and up, no -ffast-math): x = k ln2 + r with k rounded
// to nearest by the 1.5 * 2^23 trick, |r| <= ln2 / 2 in two parts (Cody-Waite), Cephes' degree-6 polynomial for
// e^r, 2^k from the exponent bits: within 1 ulp of the exact e^x over the range below (checked against double exp
// on a dense sample: docs/benchmarks.md). Why: the CPU scan takes one exponential per state element and row, and a
// libm call per element (not vectorized) was most of its time.
// Its constants, shared with its 16-lane form (exp_fast16), which takes the same steps
struct ExpFast {
  static constexpr float lo = -87.0f, hi = 88.0f;  // 2^k stays a normal float; e^-87 ~ 1.6e-38
  static constexpr float magic = 12582912.0f;      // 1.5 * 2^23: adding it rounds to an integer
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;  // ln 2 in two parts
  static constexpr float p[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

static inline float exp_fast(float x) {
  using C = ExpFast;
  x = x < C::lo ? C::lo : (x > C::hi ? C::hi : x);
  const float k = (x * C::log2e + C::magic) - C::magic;
  const float r = (x - k * C::ln2_hi) - k * C::ln2_lo;
  float p = C::p[0];  // the steps written out: as a loop, GCC's AVX2 chunk scan took 4-6 % longer
  p = p * r + C::p[1];
  p = p * r + C::p[2];
  p = p * r + C::p[3];
  p = p * r + C::p[4];
  p = p * r + C::p[5];
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return e * scale;
}

// softplus(x) = max(x, 0) + log1p(e^-|x|) with log1p(q) = 2 atanh(q / (2 + q)) as its odd series (q in (0, 1], so
// s = q / (2 + q) <= 1/3 and the terms past s^17 are below 1e-9 of the sum): accurate in relative terms for small
// q too (within 3e-7 relative of the exact value, sampled as exp_fast), and vectorizable, where libm's log1p per
// channel and row cost as much as the rest of the scan's dt path. torch's threshold: x > 20 gives x.
static inline float softplus_fast(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float q = exp_fast(-ax);
  const float s = q / (2.0f + q), s2 = s * s;
  float p = 1.0f / 17.0f;
  p = p * s2 + 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  const float log1p_q = 2.0f * s * p;
  return x > 20.0f ? x : (x > 0.0f ? x : 0.0f) + log1p_q;
}

static inline float silu_fast(float x) { return x / (1.0f + exp_fast(-x)); }

// The sum of 8 partial sums, in a fixed order (the results do not depend on how a loop was vectorized)
static inline float sum8(const float* part) {
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// IEEE float16 <-> float32 (round to nearest even), for the ...16 ops on the CPU
static float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalize
    exp = 127 - 15 + 1;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

static uint16_t float_to_half(float value) {
  uint32_t f;
  std::memcpy(&f, &value, 4);
  const uint32_t sign = (f >> 16) & 0x8000, man = f & 0x7fffff;
  const int32_t biased = int32_t((f >> 23) & 0xff);
  if (biased == 0xff) return uint16_t(sign | 0x7c00 | (man ? 0x200 : 0));  // inf, nan
  const int32_t exp = biased - 127 + 15;
  if (exp >= 31) return uint16_t(sign | 0x7c00);  // overflow: inf
  if (exp <= 0) {                                  // a float16 subnormal, or zero
    if (exp < -10) return uint16_t(sign);
    const uint32_t full = man | 0x800000;
    const int shift = 14 - exp;
    uint32_t half = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | uint32_t(exp << 10) | (man >> 13);
  const uint32_t rest = man & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry rounds up into the exponent
  return uint16_t(half);
}

// Besides one element (load, store): row(p, i, n, buffer), elements [i, i + n) as floats (p itself where it holds
// floats, else converted into buffer), and store_row, n floats stored from i, so that the kernels' loops over a row
// of channels run on floats and vectorize.
struct F32 {
  static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static void store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
  static const float* row(const void* p, int64_t i, int64_t, float*) { return static_cast<const float*>(p) + i; }
  static void store_row(void* p, int64_t i, int64_t n, const float* v) {
    std::memcpy(static_cast<float*>(p) + i, v, sizeof(float) * size_t(n));
  }
};
// float16 by the software conversions: the SSE2 build's
struct F16 {
  static float load(const void* p, int64_t i) { return half_to_float(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, int64_t i, float v) { static_cast<uint16_t*>(p)[i] = float_to_half(v); }
  static const float* row(const void* p, int64_t i, int64_t n, float* buffer) {
    for (int64_t k = 0; k < n; ++k) buffer[k] = load(p, i + k);
    return buffer;
  }
  static void store_row(void* p, int64_t i, int64_t n, const float* v) {
    for (int64_t k = 0; k < n; ++k) store(p, i + k, v[k]);
  }
};

#ifdef MAMBATRT_AVX2
// float16 by F16C, 8 elements per instruction: the AVX2 and AVX-512 builds' (their targets include f16c). The same
// bits as F16: both conversions are exact one way and round to nearest even the other (except for NaNs' payloads).
// The software conversions per element took more of the float16 ops' time than their arithmetic.
#define MAMBATRT_F16C __attribute__((target("f16c")))
struct F16C {
  MAMBATRT_F16C static float load(const void* p, int64_t i) { return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]); }
  MAMBATRT_F16C static void store(void* p, int64_t i, float v) {
    static_cast<uint16_t*>(p)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
  }
  MAMBATRT_F16C static const float* row(const void* p, int64_t i, int64_t n, float* buffer) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
      _mm256_storeu_ps(buffer + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k))));
    for (; k < n; ++k) buffer[k] = _cvtsh_ss(h[k]);
    return buffer;
  }
  MAMBATRT_F16C static void store_row(void* p, int64_t i, int64_t n, const float* v) {
    uint16_t* h = static_cast<uint16_t*>(p) + i;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
      const __m128i out = _mm256_cvtps_ph(_mm256_loadu_ps(v + k), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + k), out);
    }
    for (; k < n; ++k) h[k] = _cvtss_sh(v[k], _MM_FROUND_TO_NEAREST_INT);
  }
};
#endif

// fn(data, i) for i in [0, n): on t's threads where it has them and `spread` (the launch has work enough for them),
// else in turn on the calling thread
static void run_tasks(const CpuThreads& t, void (*fn)(void*, size_t), size_t n, void* data, bool spread = true) {
  if (t.parallel != nullptr && n > 1 && spread) return t.parallel(t.pool, fn, n, data);
  for (size_t i = 0; i < n; ++i) fn(data, i);
}

// The least work (a launch's products in the conv, state elements updated in the scan) that the CPU conv and scan
// hand to the session's threads: below it waking them took longer than the work (the default model's decode step)
constexpr int64_t kParallelWork = int64_t(1) << 16;

#ifdef MAMBATRT_AVX2
// The builds' targets (their tasks and the intrinsics passes written for them)
#define MAMBATRT_AVX2_TARGET "avx2,fma,f16c"
#define MAMBATRT_AVX512_TARGET "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"
#define MAMBATRT_AVX512 __attribute__((target(MAMBATRT_AVX512_TARGET)))

// exp_fast on 16 lanes: the same steps (the clamp as max/min, which keep a NaN, as the selects do)
MAMBATRT_AVX512 static inline __m512 exp_fast16(__m512 x) {
  using C = ExpFast;
  x = _mm512_min_ps(_mm512_set1_ps(C::hi), _mm512_max_ps(_mm512_set1_ps(C::lo), x));
  const __m512 magic = _mm512_set1_ps(C::magic);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(C::log2e), magic), magic);
  const __m512 hi = _mm512_fnmadd_ps(k, _mm512_set1_ps(C::ln2_hi), x);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(C::ln2_lo), hi);
  __m512 p = _mm512_set1_ps(C::p[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[5]));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

// The build that runs (cpu_kernels.cc): 2 AVX-512, 1 AVX2 + FMA + F16C, 0 the SSE2 baseline
int cpu_level();
#endif

}  // namespace mambatrt
