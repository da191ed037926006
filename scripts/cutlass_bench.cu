// CUTLASS 3xTF32 GEMMs (compile/kernels/mamba_linear_cutlass.cuh) against cuBLAS's fp32 SGEMM (TF32 off) and
// MambaLinear's own kernel (mamba_linear.cuh) at mamba-130m's and the default model's projections, M = 16 .. 2048 (a
// prefill launch feeds up to 16 prompts x 64 rows, a decode launch up to 128 rows): which tile config wins where, and
// from which M on CUTLASS beats both. GPU time of calls captured in a CUDA graph, each call on another copy of W (the
// weights come from memory, as in a model's step); max |y - reference| / max |reference| against a double product;
// "same": the batch's last row equals that row alone through the same config, bit for bit; "library": what
// MambaLinear launches (mambatrt_linear::launch: its own kernel or one of these, mamba_linear_cutlass.cuh). Built where only nvcc is
// (cuBLAS opened at run time; CUTLASS's headers from the nvidia-cutlass wheel):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DMAMBATRT_WITH_CUTLASS -I CUTLASS_INCLUDE \
//     -o .bin/cutlass_bench scripts/cutlass_bench.cu -ldl
// (CUTLASS_INCLUDE: python -c 'import mambatrt.compile.kernels as k; print(k.cutlass_include())')
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../compile/kernels/mamba_linear.cuh"  // with MAMBATRT_WITH_CUTLASS: mamba_linear_cutlass.cuh too
#include "bench_common.cuh"  // CHECK, graph_us, Blas, reference_product, rel_error

cudaStream_t g_stream;
using mambatrt_linear::Config;
using Run = std::function<cudaError_t(const float*, const float*, float*, int, int, int)>;
struct Tiles {
  std::string name;
  Run run;
};

int* g_semaphores;  // serial split-K's, zeroed once (each launch leaves them zero)

template <int TM, int TN, int TK, int WM, int WN, int WK, int S, int SPLIT = 1>
void add(std::vector<Tiles>& out) {
  const std::string name = std::to_string(TM) + "x" + std::to_string(TN) + "x" + std::to_string(TK) + " w" +
                           std::to_string(WM) + "x" + std::to_string(WN) + "x" + std::to_string(WK) + " s" +
                           std::to_string(S) + (SPLIT > 1 ? " k" + std::to_string(SPLIT) : "");
  out.push_back({name, [](const float* X, const float* W, float* Y, int M, int N, int K) {
                   using G = mambatrt_cutlass::Gemm3xTF32<TM, TN, TK, WM, WN, WK, S, (SPLIT > 1)>;
                   return mambatrt_cutlass::run<G>(X, W, Y, M, N, K, g_stream, SPLIT, g_semaphores);
                 }});
}

int main() {
  std::vector<Tiles> tiles;
  add<32, 64, 32, 32, 32, 32, 4>(tiles);
  add<64, 32, 32, 32, 32, 32, 4>(tiles);
  add<64, 64, 32, 32, 32, 32, 4>(tiles);
  add<128, 64, 32, 64, 32, 32, 3>(tiles);
  add<64, 128, 16, 32, 64, 16, 4>(tiles);
  // sliced K: a tile's K split over warps (a tile's K is at most 32 floats), a shorter serial K loop at few rows
  add<32, 32, 32, 32, 32, 16, 4>(tiles);
  add<32, 64, 32, 32, 32, 16, 4>(tiles);
  add<64, 32, 32, 32, 32, 16, 4>(tiles);
  add<64, 64, 32, 32, 32, 16, 4>(tiles);
  // serial split-K over 2-8 blocks per tile (sliced-K tiles): more blocks where a few rows make a small grid
  add<32, 64, 32, 32, 32, 16, 4, 2>(tiles);
  add<32, 64, 32, 32, 32, 16, 4, 4>(tiles);
  add<32, 64, 32, 32, 32, 16, 4, 8>(tiles);
  add<32, 32, 32, 32, 32, 16, 4, 4>(tiles);
  add<64, 64, 32, 32, 32, 16, 4, 2>(tiles);
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  CHECK(cudaMalloc(&g_semaphores, sizeof(int) << 16));
  CHECK(cudaMemset(g_semaphores, 0, sizeof(int) << 16));
  Blas blas;
  const bool have_blas = blas.open(g_stream);
  const int batches[] = {16, 32, 64, 128, 256, 512, 1024, 2048};
  std::mt19937 rng(0);
  std::printf("GPU us per call (calls in a CUDA graph, each on another copy of W): cuBLAS | MambaLinear's own kernel "
              "(choose) | the library (launch) | best CUTLASS config | error vs double (cuBLAS / own / CUTLASS) | last row batched == alone "
              "| every CUTLASS config\n");
  for (const Projection& s : kProjections) {
    const int N = s.n, K = s.k, Mmax = 2048;
    const Operands ops(rng, Mmax, N, K);
    const std::vector<float>&hx = ops.hx, &hw = ops.hw;
    float* const X = ops.x;
    const float* const Wall = ops.w;
    float *Y, *Y1;
    CHECK(cudaMalloc(&Y, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Y1, size_t(N) * 4));
    for (int M : batches) {
      if (N > 10000 && M > 256) continue;
      const std::vector<double> ref = reference_product(hx, hw, M, N, K);
      const int calls = N > 10000 ? 5 : 20;
      auto timed = [&](const Run& run) {
        int next = 0;
        return graph_us(
            g_stream, [&] { CHECK(run(X, ops.weight(next++), Y, M, N, K)); }, calls);
      };
      float t_blas = 0;
      double e_blas = 0;
      if (have_blas) {
        const Run sgemm = [&](const float* x, const float* w, float* y, int m, int n, int k) {
          const float one = 1.0f, zero = 0.0f;
          return cudaError_t(blas.sgemm(blas.handle, 1, 0, n, m, k, &one, w, k, x, k, &zero, y, n));
        };
        CHECK(sgemm(X, Wall, Y, M, N, K));  // cuBLAS's first call of a shape may allocate: not while capturing
        CHECK(cudaStreamSynchronize(g_stream));
        t_blas = timed(sgemm);
        CHECK(sgemm(X, Wall, Y, M, N, K));
        e_blas = rel_error(ref, Y);
      }
      const Run own = [](const float* x, const float* w, float* y, int m, int n, int k) {
        const Config c = mambatrt_linear::choose(m, n, k);
        return c.nt == 1 ? mambatrt_linear::launch_wk<1, 1>(c.wk, x, w, nullptr, y, m, n, k, g_stream)
                         : mambatrt_linear::launch_wk<2, 2>(c.wk, x, w, nullptr, y, m, n, k, g_stream);
      };
      const float t_own = timed(own);
      CHECK(own(X, Wall, Y, M, N, K));
      const double e_own = rel_error(ref, Y);
      const Run library = [](const float* x, const float* w, float* y, int m, int n, int k) {
        return mambatrt_linear::launch(x, w, nullptr, y, m, n, k, g_stream);
      };
      CHECK(library(X, Wall, Y, M, N, K));
      CHECK(cudaStreamSynchronize(g_stream));
      const float t_lib = timed(library);
      std::vector<float> times;
      int best = 0;
      for (size_t i = 0; i < tiles.size(); ++i) {
        CHECK(tiles[i].run(X, Wall, Y, M, N, K));  // the first call sets the kernel's shared-memory size
        CHECK(cudaStreamSynchronize(g_stream));
        times.push_back(timed(tiles[i].run));
        if (times[i] < times[best]) best = int(i);
      }
      CHECK(tiles[best].run(X, Wall, Y, M, N, K));
      const double e_cut = rel_error(ref, Y);
      CHECK(tiles[best].run(X + size_t(M - 1) * K, Wall, Y1, 1, N, K));
      std::printf("%-10s M %4d N %5d K %4d | cuBLAS %7.2f | own %7.2f | library %7.2f | CUTLASS %7.2f (%s) | err "
                  "%.1e / %.1e / %.1e | %s |",
                  s.name, M, N, K, t_blas, t_own, t_lib, times[best], tiles[best].name.c_str(), e_blas, e_own, e_cut,
                  same_last_row(Y, Y1, M, N) ? "same" : "DIFFERENT");
      for (size_t i = 0; i < tiles.size(); ++i) std::printf(" %.2f", times[i]);
      std::printf("\n");
      std::fflush(stdout);
    }
    cudaFree(Y), cudaFree(Y1);
  }
  std::printf("configs:");
  for (const Tiles& t : tiles) std::printf(" [%s]", t.name.c_str());
  std::printf("\n");
  CHECK(cudaGetLastError());
  return 0;
}
