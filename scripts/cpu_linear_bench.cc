// A decode launch's projections on one CPU core: the packed-strip AVX-512 product (each output a single FMA chain
// over K in order, W packed once as 16-column strips [S][K][16] and streamed from memory once per launch, the rows'
// X packed per call as [K][R] so that a step's broadcasts share one cache line) over a chain of 24 x (in_proj,
// out_proj) with distinct weights and the LM head, as a decode graph runs them. Prints ms per chain per batch and a
// checksum; scripts/cpu_linear_bench.py times onnxruntime's MLAS on the same chain.
//   g++ -O3 -std=c++17 -march=native scripts/cpu_linear_bench.cc -o /tmp/clb && taskset -c 0 /tmp/clb
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef PFA
#define PFA 32
#define PFB 16
#define PFC 4
#endif
// prefetch distance in K steps (cache lines of a strip): about a memory latency ahead, longer with more rows (more
// cycles per step)
template <int R>
constexpr int64_t prefetch_steps() {
  return R >= 12 ? PFA : R >= 6 ? PFB : PFC;
}

static float* alloc(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, n * sizeof(float) + 64)) std::abort();
  return static_cast<float*>(p);
}

struct Packed {  // W [N, K] as S = ceil(N / 16) strips [S][K][16], zero padded
  float* w;
  int64_t n, k, s;
};

static Packed pack(const float* w, int64_t n, int64_t k) {
  Packed p{alloc((n + 15) / 16 * 16 * k), n, k, (n + 15) / 16};
  for (int64_t s = 0; s < p.s; ++s)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int j = 0; j < 16; ++j) {
        const int64_t col = s * 16 + j;
        p.w[(s * k + kk) * 16 + j] = col < n ? w[col * k + kk] : 0.f;
      }
  return p;
}

// T strips x R rows: acc[t][r] += X[r][k] * W_strip_t[k][:] for k in order.
template <int R, int T>
__attribute__((always_inline)) static inline void tile(const float* xp, const Packed& p, int64_t s0, float* y,
                                                       int64_t ldy) {
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const float* w[T];
  for (int t = 0; t < T; ++t) w[t] = p.w + (s0 + t) * p.k * 16;
  for (int64_t k = 0; k < p.k; ++k) {
    __m512 wv[T];
    for (int t = 0; t < T; ++t) {
      wv[t] = _mm512_load_ps(w[t] + k * 16);
      _mm_prefetch(reinterpret_cast<const char*>(w[t] + (k + prefetch_steps<R>()) * 16), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xp[k * R + r]);
      for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(xv, wv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = (s0 + t) * 16;
    const int64_t left = p.n - col;
    const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + col, m, acc[t][r]);
  }
}

template <int R, int T>
static void rows_block(const float* xp, const Packed& p, float* y, int64_t ldy) {
  int64_t s = 0;
  for (; s + T <= p.s; s += T) tile<R, T>(xp, p, s, y, ldy);
  for (; s < p.s; ++s) tile<R, 1>(xp, p, s, y, ldy);
}

// y [M, N] = x [M, K] (row stride ldx) W^T
static void linear(const float* x, int64_t ldx, int64_t m, const Packed& p, float* y, float* xp) {
#ifndef BLOCK
#define BLOCK 16
#endif
  for (int64_t r0 = 0; r0 < m; r0 += BLOCK) {
    const int rows = int(std::min<int64_t>(BLOCK, m - r0));
    for (int64_t k = 0; k < p.k; ++k)
      for (int r = 0; r < rows; ++r) xp[k * rows + r] = x[(r0 + r) * ldx + k];
    float* yb = y + r0 * p.n;
    switch (rows) {
#define CASE(R, T) \
  case R:          \
    rows_block<R, T>(xp, p, yb, p.n); \
    break;
      CASE(1, 8) CASE(2, 6) CASE(3, 4) CASE(4, 4) CASE(5, 3) CASE(6, 3) CASE(7, 2) CASE(8, 2) CASE(9, 2)
      CASE(10, 2) CASE(11, 2) CASE(12, 2) CASE(13, 1) CASE(14, 1) CASE(15, 1) CASE(16, 1)
#undef CASE
    }
  }
}

int main(int argc, char** argv) {
  const int64_t L = 24, D = 768, E = 1536, V = 50280;
  const int reps = argc > 1 ? std::atoi(argv[1]) : 7;
  srand(1);
  auto rnd = [](float* p, size_t n, float s) {
    for (size_t i = 0; i < n; ++i) p[i] = s * (float(rand()) / RAND_MAX - 0.5f);
  };
  std::vector<Packed> in(L), out(L);
  {
    float* t = alloc(2 * E * D);
    for (int64_t l = 0; l < L; ++l) {
      rnd(t, 2 * E * D, 0.1f);
      in[l] = pack(t, 2 * E, D);
      rnd(t, D * E, 0.1f);
      out[l] = pack(t, D, E);
    }
    free(t);
  }
  Packed head;
  {
    float* t = alloc(V * D);
    rnd(t, V * D, 0.1f);
    head = pack(t, V, D);
    free(t);
  }
  const int64_t maxm = 64;
  float* x = alloc(maxm * D);
  float* xz = alloc(maxm * 2 * E);
  float* h = alloc(maxm * D);
  float* logits = alloc(maxm * V);
  float* xp = alloc(16 * E);
  rnd(x, maxm * D, 1.f);
  std::printf("rows  chain_ms(best)  median  head_ms  checksum\n");
  for (int64_t m : {1, 2, 4, 8, 12, 16, 24, 32}) {
    std::vector<double> t(reps), th(reps);
    double sum = 0;
    for (int rep = 0; rep < reps; ++rep) {
      auto a = std::chrono::steady_clock::now();
      const float* cur = x;
      for (int64_t l = 0; l < L; ++l) {
        linear(cur, D, m, in[l], xz, xp);
        linear(xz, 2 * E, m, out[l], h, xp);  // the x half as out_proj's input (any E columns do)
        cur = h;
      }
      auto b = std::chrono::steady_clock::now();
      linear(cur, D, m, head, logits, xp);
      auto c = std::chrono::steady_clock::now();
      t[rep] = std::chrono::duration<double, std::milli>(b - a).count();
      th[rep] = std::chrono::duration<double, std::milli>(c - b).count();
      sum = 0;
      for (int64_t i = 0; i < m * V; i += 7) sum += logits[i];
    }
    std::vector<double> s = t;
    std::sort(s.begin(), s.end());
    std::sort(th.begin(), th.end());
    std::printf("%4lld  %8.2f  %8.2f  %8.2f  %.6e\n", (long long)m, s[0], s[reps / 2], th[reps / 2], sum);
  }
}
