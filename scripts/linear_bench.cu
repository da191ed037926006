// MambaLinear's CUDA kernel (compile/kernels/mamba_linear.cuh, fp32 products as 3xTF32 on the tensor cores) against
// cuBLAS's fp32 SGEMM (TF32 off; "tn" as onnxruntime's Gemm calls it) at the projections of mamba-130m and of the
// default model, M = 1 .. 1024 (decode batches and prefill chunks). Every config the header can launch is timed;
// the table gives cuBLAS, the best config, and the best for each WK (the K split, which must follow the weight's
// shape alone: see the header). Max |y - reference| against a double-precision product, relative to max |reference|,
// for cuBLAS and the kernel; "same" when the batch's last row equals that row computed alone (M = 1), bit for bit.
// `linear_bench cluster` times the header's cluster kernel (linear_cluster, sm_90) instead: every (WN, WK, S, NT) at
// M = 2 .. 128 against cuBLAS and what MambaLinear launches, with the best config's error and "same"; `linear_bench
// staged` likewise the staged kernel (linear_staged, sm_90) at M = 32 .. 128.
// cuBLAS is opened at run time (CUBLAS_LIB, else the usual sonames), so this builds where only nvcc is:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/linear_bench scripts/linear_bench.cu -ldl && /tmp/linear_bench
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../compile/kernels/mamba_linear.cuh"
#include "../compile/kernels/mamba_linear_blas.cuh"
#include "bench_common.cuh"  // CHECK, graph_us, Blas, Operands, blas_tn(_us), reference_product, rel_error

using mambatrt_linear::Config;

cudaStream_t g_stream;

using Launch = std::function<cudaError_t(const float*, const float*, float*, int, int, int)>;
struct Entry {
  Config c;
  Launch run;
};

template <int NT, int R, int WN, int WK>
void add(std::vector<Entry>& out) {
  constexpr Config c{NT, R, WN, WK};
  if (mambatrt_linear::shared_bytes(c) > 48 * 1024) return;
  out.push_back({c, [](const float* X, const float* W, float* Y, int M, int N, int K) {
                   return mambatrt_linear::launch_config<NT, R, WN, WK>(X, W, nullptr, Y, M, N, K, g_stream);
                 }});
}

template <int NT, int R>
void add_warps(std::vector<Entry>& out) {
  add<NT, R, 1, 1>(out), add<NT, R, 1, 2>(out), add<NT, R, 1, 4>(out), add<NT, R, 1, 8>(out);
  add<NT, R, 1, 16>(out), add<NT, R, 2, 1>(out), add<NT, R, 2, 2>(out), add<NT, R, 2, 4>(out);
  add<NT, R, 2, 8>(out), add<NT, R, 4, 1>(out), add<NT, R, 4, 2>(out), add<NT, R, 4, 4>(out);
}

std::string name(const Config& c) {
  return "NT" + std::to_string(c.nt) + " R" + std::to_string(c.r) + " WN" + std::to_string(c.wn) + " WK" +
         std::to_string(c.wk);
}

// The cluster kernel's configs (WN, WK, S, NT: 8 rows of X per NT)
struct ClusterEntry {
  int wn, wk, s, nt;
  std::function<cudaError_t(const float*, const float*, float*, int, int, int)> run;
};

template <int NT, int WN, int WK, int S>
void add_cluster(std::vector<ClusterEntry>& out) {
  if (mambatrt_linear::cluster_shared_bytes<NT, WN, WK>() > 48 * 1024) return;
  out.push_back({WN, WK, S, NT, [](const float* X, const float* W, float* Y, int M, int N, int K) {
                   return mambatrt_linear::launch_cluster<NT, WN, WK, S>(X, W, nullptr, Y, M, N, K, g_stream);
                 }});
}

template <int WN, int WK>
void add_cluster_s(std::vector<ClusterEntry>& out) {
  add_cluster<1, WN, WK, 2>(out), add_cluster<1, WN, WK, 4>(out), add_cluster<1, WN, WK, 8>(out);
  add_cluster<2, WN, WK, 2>(out), add_cluster<2, WN, WK, 4>(out), add_cluster<2, WN, WK, 8>(out);
  add_cluster<4, WN, WK, 2>(out), add_cluster<4, WN, WK, 4>(out), add_cluster<4, WN, WK, 8>(out);
  add_cluster<8, WN, WK, 2>(out), add_cluster<8, WN, WK, 4>(out), add_cluster<8, WN, WK, 8>(out);
}

// A table of one kernel's configs: for each product of `shapes` and each M of `rows`, cuBLAS, what MambaLinear
// launches and every config (one not timed where skip(config, M)), the best config's error against double and
// whether a batch's last row alone through it gives the same bits; name(c) names a config, tail(times) prints the
// row's last column
template <class Entry, class Skip, class Name, class Tail>
int config_table(const std::vector<Entry>& configs, const std::vector<Projection>& shapes, std::vector<int> rows,
                 Skip skip, Name name, Tail tail) {
  Blas blas;
  const bool have_blas = blas.open(g_stream);
  std::mt19937 rng(0);
  for (const Projection& s : shapes) {
    const int N = s.n, K = s.k, Mmax = 128;
    const Operands ops(rng, Mmax, N, K);
    float* const X = ops.x;
    float *Y, *Y1;
    CHECK(cudaMalloc(&Y, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Y1, size_t(N) * 4));
    for (int M : rows) {
      const std::vector<double> ref = reference_product(ops.hx, ops.hw, M, N, K);
      int next = 0;
      const float t_blas = have_blas ? blas_tn_us(blas, g_stream, ops, Y, M, N, K, next, 20) : 0.0f;
      const float t_lib = graph_us(
          g_stream, [&] { CHECK(mambatrt_linear::launch(X, ops.weight(next++), nullptr, Y, M, N, K, g_stream)); }, 20);
      CHECK(mambatrt_linear::launch(X, ops.w, nullptr, Y, M, N, K, g_stream));
      const double e_lib = rel_error(ref, Y);
      std::vector<float> times;
      int best = 0;
      for (size_t i = 0; i < configs.size(); ++i) {
        auto run = [&] { CHECK(configs[i].run(X, ops.weight(next++), Y, M, N, K)); };
        times.push_back(skip(configs[i], M) ? 1e30f : graph_us(g_stream, run, 20));
        if (times[i] < times[best]) best = int(i);
      }
      const Entry& b = configs[best];
      CHECK(cudaMemset(Y, 0, size_t(M) * N * 4));
      CHECK(b.run(X, ops.w, Y, M, N, K));
      const double e_best = rel_error(ref, Y);
      CHECK(b.run(X + size_t(M - 1) * K, ops.w, Y1, 1, N, K));
      std::printf("%-10s M %4d N %5d K %4d | cuBLAS %7.2f | library %7.2f | best %7.2f (%s) | err %.1e / %.1e | %s |",
                  s.name, M, N, K, t_blas, t_lib, times[best], name(b).c_str(), e_lib, e_best,
                  same_last_row(Y, Y1, M, N) ? "same" : "DIFFERENT");
      tail(times);
      std::printf("\n");
      std::fflush(stdout);
    }
    cudaFree(Y), cudaFree(Y1);
  }
  CHECK(cudaGetLastError());
  return 0;
}

int cluster_table() {
  std::vector<ClusterEntry> configs;
  add_cluster_s<1, 2>(configs), add_cluster_s<1, 4>(configs), add_cluster_s<2, 1>(configs);
  add_cluster_s<2, 2>(configs), add_cluster_s<2, 4>(configs), add_cluster_s<4, 1>(configs);
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  std::printf("GPU us per call (as above): cuBLAS | what MambaLinear launches | the best cluster config (WN WK S) | "
              "error vs double (library / best) | best: last row batched == alone | every config at NT 1 (WN WK S), "
              "the best at NT 2-8\n");
  std::vector<Projection> shapes;
  for (const Projection& s : kProjections)
    if (s.n <= 10000) shapes.push_back(s);
  shapes.push_back({"370m.out", 1024, 2048}), shapes.push_back({"790m.out", 1536, 3072});  // larger models' out_proj
  auto past = [](const ClusterEntry& c, int M) { return c.nt > 1 && c.nt * 8 > M; };  // tiles mostly past M
  auto name = [](const ClusterEntry& c) {
    return std::to_string(c.wn) + " " + std::to_string(c.wk) + " " + std::to_string(c.s) + " NT" + std::to_string(c.nt);
  };
  auto tail = [&](const std::vector<float>& times) {
    for (size_t i = 0; i < configs.size(); ++i)  // every config at NT 1
      if (configs[i].nt == 1) std::printf(" %d%d%d %.2f", configs[i].wn, configs[i].wk, configs[i].s, times[i]);
    for (int nt : {2, 4, 8}) {  // the best of each larger NT
      int bi = -1;
      for (size_t i = 0; i < configs.size(); ++i)
        if (configs[i].nt == nt && times[i] < 1e29f && (bi < 0 || times[i] < times[bi])) bi = int(i);
      if (bi >= 0) std::printf(" NT%d %.2f (%d %d %d)", nt, times[bi], configs[bi].wn, configs[bi].wk, configs[bi].s);
    }
  };
  return config_table(configs, shapes, {2, 8, 32, 64, 128}, past, name, tail);
}

// The staged kernel's configs (WN, S, KC)
struct StagedEntry {
  int wn, s, kc;
  std::function<cudaError_t(const float*, const float*, float*, int, int, int)> run;
};

template <int WN, int S, int KC>
void add_staged(std::vector<StagedEntry>& out) {
  CHECK((mambatrt_linear::staged_prepare<WN, S, KC>()));  // outside the captures
  out.push_back({WN, S, KC, [](const float* X, const float* W, float* Y, int M, int N, int K) {
                   return mambatrt_linear::launch_staged<WN, S, KC>(X, W, Y, M, N, K, g_stream);
                 }});
}

template <int WN, int KC>
void add_staged_s(std::vector<StagedEntry>& out) {
  add_staged<WN, 1, KC>(out), add_staged<WN, 2, KC>(out), add_staged<WN, 4, KC>(out), add_staged<WN, 8, KC>(out);
}

// `linear_bench staged`: the staged kernel (linear_staged, sm_90: X's 64 rows staged split in shared memory, K split
// over a cluster) at every (WN, S, KC) against cuBLAS and what MambaLinear launches, M 32 .. 128, mamba-130m's
// products; the best config's error and whether a batch's last row alone through it gives the same bits
int staged_table() {
  std::vector<StagedEntry> configs;
  add_staged_s<2, 64>(configs), add_staged_s<4, 64>(configs), add_staged_s<8, 64>(configs);
  add_staged_s<4, 128>(configs), add_staged_s<8, 128>(configs);
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  std::printf("GPU us per call (20 calls in a CUDA graph, each on another copy of W): cuBLAS | what MambaLinear "
              "launches | the best staged config (WN S KC) | error vs double (library / best) | best: last row "
              "batched == alone | every config (WN S KC)\n");
  std::vector<Projection> shapes;
  for (const Projection& s : kProjections)
    if (s.name[0] != 'd') shapes.push_back(s);
  auto none = [](const StagedEntry&, int) { return false; };
  auto name = [](const StagedEntry& c) {
    return std::to_string(c.wn) + " " + std::to_string(c.s) + " " + std::to_string(c.kc);
  };
  auto tail = [&](const std::vector<float>& times) {
    for (size_t i = 0; i < configs.size(); ++i)
      std::printf(" %d,%d,%d %.2f", configs[i].wn, configs[i].s, configs[i].kc, times[i]);
  };
  return config_table(configs, shapes, {32, 33, 48, 64, 96, 128}, none, name, tail);
}

// `linear_bench tf32`: what Hopper's own TF32 path (cuBLAS with TF32 tensor ops: one TF32 product, up to 3.4e-4
// relative error in run s19a, not fp32's) takes at the decode step's shapes, and at K x 3: a 3xTF32 product written
// as one TF32 GEMM over [X_hi | X_lo | X_hi] and [W_hi; W_hi; W_lo] (operands split beforehand), against what
// MambaLinear launches. An upper bound for what a 3xTF32 kernel on sm_90's warpgroup MMAs could gain (BENCHMARKS.md);
// up to the 1024 rows of a 16-prompt prefill launch (MambaLinear's CUTLASS path there, when built with it).
int tf32_table() {
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  Blas fp32, tf32;
  if (!fp32.open(g_stream) || !tf32.open(g_stream, 3)) return 1;
  std::mt19937 rng(0);
  std::printf("GPU us per call (20 calls in a CUDA graph, each on another copy of W): cuBLAS fp32 | MambaLinear | "
              "cuBLAS TF32 | cuBLAS TF32 at K x 3 | MambaLinear's split path (two TF32 GEMMs) | error vs double "
              "(MambaLinear / TF32 / split)\n");
  for (const Projection& s : kProjections) {
    if (s.name[0] == 'd') continue;
    const int N = s.n, K = s.k, Mmax = 1024;
    const Operands ops(rng, Mmax, N, K), ops3(rng, Mmax, N, 3 * K);
    float* Y;
    CHECK(cudaMalloc(&Y, size_t(Mmax) * N * 4));
    std::vector<std::unique_ptr<mambatrt_blas::Weights>> weights;  // 4 copies: together past the L2 for in_proj
    for (int c = 0; c < std::min(4, ops.copies); ++c) weights.emplace_back(new mambatrt_blas::Weights);
    for (int M : {1, 8, 16, 32, 64, 128, 256, 512, 1024}) {
      if (M > 256 && s.n > 4 * s.k) continue;  // the head: decode batches only (a prefill launch's head is k rows)
      const std::vector<double> ref = reference_product(ops.hx, ops.hw, M, N, K);
      int next = 0;
      const float t32 = blas_tn_us(fp32, g_stream, ops, Y, M, N, K, next, 20);
      auto lib = [&] { CHECK(mambatrt_linear::launch(ops.x, ops.weight(next++), nullptr, Y, M, N, K, g_stream)); };
      const float t_lib = graph_us(g_stream, lib, 20);
      CHECK(mambatrt_linear::launch(ops.x, ops.w, nullptr, Y, M, N, K, g_stream));
      const double e_lib = rel_error(ref, Y);
      const float t_tf = blas_tn_us(tf32, g_stream, ops, Y, M, N, K, next, 20);
      blas_tn(tf32, ops, ops.w, Y, M, N, K);
      const double e_tf = rel_error(ref, Y);
      const float t_tf3 = blas_tn_us(tf32, g_stream, ops3, Y, M, N, 3 * K, next, 20);
      // mamba_linear_blas.cuh's two GEMMs on split operands, each call on the next of `weights` (made beforehand,
      // outside the capture, as MambaLinear's first run outside a capture makes them)
      float t_split = 0.0f;
      double e_split = 0.0;
      if (mambatrt_blas::api().ok && K % 4 == 0) {
        auto split_on = [&](size_t c) {  // the product on copy c of W: an error where it is not queued
          cudaError_t err = cudaSuccess;
          const bool queued = mambatrt_blas::launch(*weights[c], ops.x, ops.weight(int(c)), Y, M, N, K, g_stream, &err);
          CHECK(queued ? err : cudaErrorUnknown);
        };
        for (size_t c = 0; c < weights.size(); ++c) split_on(c);
        size_t call = 0;
        t_split = graph_us(g_stream, [&] { split_on(call++ % weights.size()); }, 20);
        split_on(0);
        e_split = rel_error(ref, Y);
      }
      std::printf("%-9s M %4d N %5d K %4d | fp32 %7.2f | MambaLinear %7.2f | TF32 %7.2f | TF32 K x 3 %7.2f | "
                  "split, 2 GEMMs %7.2f | err %.1e / %.1e / split %.1e\n", s.name, M, N, K, t32, t_lib, t_tf, t_tf3,
                  t_split, e_lib, e_tf, e_split);
      std::fflush(stdout);
    }
    cudaFree(Y);
  }
  CHECK(cudaGetLastError());
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "cluster") return cluster_table();
  if (argc > 1 && std::string(argv[1]) == "tf32") return tf32_table();
  if (argc > 1 && std::string(argv[1]) == "staged") return staged_table();
  std::vector<Entry> configs;
  add_warps<1, 1>(configs), add_warps<1, 2>(configs), add_warps<2, 1>(configs), add_warps<2, 2>(configs);
  add_warps<4, 1>(configs), add_warps<4, 2>(configs), add_warps<8, 1>(configs), add_warps<8, 2>(configs);
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  Blas blas;
  const bool have_blas = blas.open(g_stream);
  const int batches[] = {1, 4, 16, 64, 128, 1024};
  const int wks[] = {1, 2, 4, 8, 16};
  std::mt19937 rng(0);
  std::printf("GPU us per call (20 calls in a CUDA graph, 5 replays; 5 for lm_head; each call on another copy of W, 160 MiB "
              "of copies, so weights come from memory): cuBLAS | the config MambaLinear "
              "launches | the best config | error vs double (cuBLAS / chosen / best) | chosen: last row batched == "
              "alone | best per WK\n");
  for (const Projection& s : kProjections) {
    const int N = s.n, K = s.k, Mmax = 1024;
    const Operands ops(rng, Mmax, N, K);
    const std::vector<float>&hx = ops.hx, &hw = ops.hw;
    float* const X = ops.x;
    const float* const W = ops.w;
    float *Y, *Yb, *Y1;
    CHECK(cudaMalloc(&Y, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Yb, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Y1, size_t(N) * 4));
    for (int M : batches) {
      if (N > 10000 && M > 128) continue;
      const std::vector<double> ref = reference_product(hx, hw, M, N, K);
      auto error = [&](const float* dev) { return rel_error(ref, dev); };
      const int reps = N > 10000 ? 50 : 200;
      float t_blas = 0;
      double e_blas = 0;
      if (have_blas) {
        int next = 0;
        t_blas = blas_tn_us(blas, g_stream, ops, Yb, M, N, K, next, reps / 10);
        CHECK(cudaDeviceSynchronize());
        e_blas = error(Yb);
      }
      float best = 1e30f, best_wk[17];
      int best_i = -1, best_wk_i[17];
      for (int w : wks) best_wk[w] = 1e30f, best_wk_i[w] = -1;
      for (size_t i = 0; i < configs.size(); ++i) {
        const Config& c = configs[i].c;
        if (c.nt * 8 >= 2 * ((M + 7) / 8 * 8) && c.nt > 1) continue;  // tiles mostly past M
        int next = 0;
        const float t =
            graph_us(g_stream, [&] { CHECK(configs[i].run(X, ops.weight(next++), Y, M, N, K)); }, reps / 10);
        if (t < best) best = t, best_i = int(i);
        if (t < best_wk[c.wk]) best_wk[c.wk] = t, best_wk_i[c.wk] = int(i);
      }
      CHECK(configs[best_i].run(X, W, Y, M, N, K));
      CHECK(cudaStreamSynchronize(g_stream));
      const double e_own = error(Y);
      // the config MambaLinear launches (mambatrt_linear::choose), and the batch's last row alone through it
      auto chosen = [&](const float* x, float* y, int m) { return mambatrt_linear::launch(x, W, nullptr, y, m, N, K, g_stream); };
      int next = 0;
      const float t_chosen = graph_us(g_stream, 
          [&] {
            const float* w = ops.weight(next++);
            CHECK(mambatrt_linear::launch(X, w, nullptr, Y, M, N, K, g_stream));
          },
          reps / 10);
      CHECK(chosen(X, Y, M));
      const double e_chosen = error(Y);
      CHECK(chosen(X + size_t(M - 1) * K, Y1, 1));
      const bool same = same_last_row(Y, Y1, M, N);
      const Config cc = mambatrt_linear::choose(M, N, K);
      std::printf("%-10s M %4d N %5d K %4d | cuBLAS %7.2f | chosen %7.2f (%-15s) | best %7.2f (%-15s) | err %.1e / %.1e / %.1e | %s |",
                  s.name, M, N, K, t_blas, t_chosen, name(cc).c_str(), best, name(configs[best_i].c).c_str(), e_blas,
                  e_chosen, e_own, same ? "same" : "DIFFERENT");
      for (int w : wks)
        if (best_wk_i[w] >= 0) std::printf(" WK%d %.2f (%s)", w, best_wk[w], name(configs[best_wk_i[w]].c).c_str());
      std::printf("\n");
      std::fflush(stdout);
    }
    cudaFree(Y), cudaFree(Yb), cudaFree(Y1);
  }
  CHECK(cudaGetLastError());
  return 0;
}
