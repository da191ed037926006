// Times the CUDA scan kernels of compile/kernels/mamba_ops_cuda.cu at mamba-130m's shapes (E 1536, N 16, R 48):
// the step (one row per sequence) as shipped and in other lane / sequence mappings for batches 1..128 (against
// session 10's mapping), and the chunk kernel (64 rows per sequence) as shipped and as a parallel scan over the
// rows (against the shipped one); max |diff| of the new state and y. Variants measured and dropped are in
// BENCHMARKS.md (session 11). Build and run on a GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/scan_step_bench scripts/scan_step_bench.cu && /tmp/scan_step_bench
#include <cmath>
#include <functional>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../compile/kernels/mamba_ops_cuda.cu"

namespace mambatrt {
namespace {
// A parallel scan over the rows: a warp per channel, lane i holding row t0 + i of a 32-row stage. For each state
// element n the lanes' (exp(dt A), dt u B) pairs are combined by an inclusive warp scan (five shuffle steps of
// (a1, b1) then (a2, b2) -> (a1 a2, a2 b1 + b2)), so h_t = a h_carry + b, and the last lane's h carries into the
// next stage. Each lane sums its own row's y over n (no reduction across lanes). Latency: 5 steps per n instead of
// one step per row.
template <int NS, bool FAST>
__global__ void chunk_warp_kernel(ScanArgs a) {
  constexpr int kWarps = kThreads / 32, kStage = 32;
  extern __shared__ float s_x[];  // [kStage][XP]: the stage's xdbl rows, XP odd (lanes hit distinct banks)
  __shared__ float s_u[kStage][kWarps];
  __shared__ float s_z[kStage][kWarps];
  const int64_t b = blockIdx.y, E = a.inner, N = a.state, R = a.rank, T = a.rows, X = a.xdbl_width;
  const int64_t Z = a.xz_width;
  const int XP = int(X) | 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t e0 = int64_t(blockIdx.x) * kWarps, e = e0 + warp;
  const bool channel = e < E;
  float carry[NS], A[NS];
#pragma unroll
  for (int n = 0; n < NS; ++n) {
    carry[n] = channel && n < N ? a.past[(b * E + e) * N + n] : 0.0f;
    A[n] = channel && n < N ? a.a[e * N + n] : 0.0f;
  }
  const float bias = channel ? a.dt_bias[e] : 0.0f, dskip = channel ? a.d[e] : 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kStage) {
    const int rows = int(T - t0 < kStage ? T - t0 : kStage);
    const int64_t row0 = b * T + t0;
    for (int i = threadIdx.x; i < rows * int(X); i += kThreads) s_x[i / int(X) * XP + i % int(X)] = a.xdbl[row0 * X + i];
    for (int i = threadIdx.x; i < rows * kWarps; i += kThreads) {
      const int r = i / kWarps, w = i % kWarps;
      const bool in = e0 + w < E;
      s_u[r][w] = in ? a.u[(row0 + r) * E + e0 + w] : 0.0f;
      s_z[r][w] = in ? load<false>(a.xz, (row0 + r) * Z + Z - E + e0 + w) : 0.0f;
    }
    __syncthreads();
    const bool valid = channel && lane < rows;
    const float* x = s_x + lane * XP;
    float s = bias;
    if (valid) {
      const float* w = a.dt_weight + e * R;
#pragma unroll 8
      for (int64_t k = 0; k < R; ++k) s += x[k] * w[k];
    }
    const float dt = valid ? softplus(s) : 0.0f, u = s_u[lane][warp], du = dt * u;
    float y = 0.0f;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      if (n < N) {
        float ga = valid ? (FAST ? __expf(dt * A[n]) : expf(dt * A[n])) : 1.0f;
        float gb = valid ? du * x[R + n] : 0.0f;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float pa = __shfl_up_sync(0xffffffffu, ga, off), pb = __shfl_up_sync(0xffffffffu, gb, off);
          if (lane >= off) {
            gb = ga * pb + gb;
            ga = ga * pa;
          }
        }
        const float h = ga * carry[n] + gb;
        if (valid) y += h * x[R + N + n];
        carry[n] = __shfl_sync(0xffffffffu, h, 31);
      }
    }
    if (valid) static_cast<float*>(a.y)[(row0 + lane) * E + e] = (y + dskip * u) * silu(s_z[lane][warp]);
    __syncthreads();  // the next stage reuses the shared arrays
  }
  if (channel) {
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      if (n < N && lane == n) a.present[(b * E + e) * N + n] = carry[n];
    }
  }
}

template <int NS, bool FAST>
void launch_chunk_warp(const ScanArgs& a) {
  constexpr int kWarps = kThreads / 32;
  dim3 grid(unsigned((a.inner + kWarps - 1) / kWarps), unsigned(a.batch));
  chunk_warp_kernel<NS, FAST><<<grid, kThreads, sizeof(float) * 32 * (a.xdbl_width | 1)>>>(a);
}
}  // namespace
}  // namespace mambatrt

using namespace mambatrt;

#define CHECK(x)                                                             \
  do {                                                                       \
    cudaError_t err = (x);                                                   \
    if (err != cudaSuccess) {                                                \
      std::printf("%s: %s\n", #x, cudaGetErrorString(err));                  \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

float* upload(const std::vector<float>& v) {
  float* d = nullptr;
  CHECK(cudaMalloc(&d, v.size() * sizeof(float)));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> download(const float* d, size_t n) {
  std::vector<float> v(n);
  CHECK(cudaMemcpy(v.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return v;
}

int main() {
  const int64_t E = 1536, N = 16, R = 48, X = R + 2 * N, Z = 2 * E, maxB = 128;
  std::mt19937 gen(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto randn = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(gen) * scale;
    return v;
  };
  std::vector<float> a_host = randn(E * N, 1.0f);
  for (float& x : a_host) x = -std::exp(x * 0.5f);
  float* u = upload(randn(maxB * E, 1.0f));
  float* xdbl = upload(randn(maxB * X, 1.0f));
  float* dtw = upload(randn(E * R, 0.1f));
  float* dtb = upload(randn(E, 0.5f));
  float* A = upload(a_host);
  float* D = upload(randn(E, 1.0f));
  float* xz = upload(randn(maxB * Z, 1.0f));
  float* past = upload(randn(maxB * E * N, 1.0f));
  float *y1, *p1;
  CHECK(cudaMalloc(&y1, maxB * E * 4));
  CHECK(cudaMalloc(&p1, maxB * E * N * 4));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  using Launch = std::function<void(const ScanArgs&)>;
  // (name, launch): session 10's mapping first (the reference of the others' differences)
  const std::vector<std::pair<const char*, Launch>> kernels = {
      {"lanes16 seqs4", [](const ScanArgs& a) { launch_step_lanes<16, 16, 4, false>(a, nullptr); }},  // session 10
      {"shipped", [](const ScanArgs& a) { launch_scan<false>(a, nullptr); }},
      {"lanes16 seqs1", [](const ScanArgs& a) { launch_step_lanes<16, 16, 1, false>(a, nullptr); }},
      {"lanes8 seqs4", [](const ScanArgs& a) { launch_step_lanes<16, 8, 4, false>(a, nullptr); }},
      {"lanes4 seqs1", [](const ScanArgs& a) { launch_step_lanes<16, 4, 1, false>(a, nullptr); }},
      {"lanes4 seqs2", [](const ScanArgs& a) { launch_step_lanes<16, 4, 2, false>(a, nullptr); }},
      {"lanes4 seqs4", [](const ScanArgs& a) { launch_step_lanes<16, 4, 4, false>(a, nullptr); }},
      {"lanes4 seqs8", [](const ScanArgs& a) { launch_step_lanes<16, 4, 8, false>(a, nullptr); }},
      {"lanes2 seqs2", [](const ScanArgs& a) { launch_step_lanes<16, 2, 2, false>(a, nullptr); }},
      {"lanes2 seqs4", [](const ScanArgs& a) { launch_step_lanes<16, 2, 4, false>(a, nullptr); }},
      {"lanes1 seqs1", [](const ScanArgs& a) { launch_step_lanes<16, 1, 1, false>(a, nullptr); }},
      {"lanes1 seqs2", [](const ScanArgs& a) { launch_step_lanes<16, 1, 2, false>(a, nullptr); }},
  };
  std::printf("scan step, E %ld N %ld R %ld: us per launch; max |diff| of state and y against the shipped kernel\n",
              long(E), long(N), long(R));
  std::printf("%-14s", "kernel");
  const std::vector<int64_t> batches = {1, 2, 4, 8, 16, 32, 64, 128};
  for (int64_t B : batches) std::printf(" %8s", ("B" + std::to_string(B)).c_str());
  std::printf("   diff (B128)\n");
  std::vector<float> yref, pref;
  for (const auto& [name, launch] : kernels) {
    std::printf("%-14s", name);
    double dp = 0, dy = 0;
    for (int64_t B : batches) {
      ScanArgs a{u, xdbl, dtw, dtb, A, D, xz, past, y1, p1, B, 1, E, N, R, X, Z, false};
      for (int i = 0; i < 20; ++i) launch(a);
      cudaEventRecord(t0);
      const int reps = 500;
      for (int i = 0; i < reps; ++i) launch(a);
      cudaEventRecord(t1);
      CHECK(cudaEventSynchronize(t1));
      CHECK(cudaGetLastError());
      float ms = 0;
      cudaEventElapsedTime(&ms, t0, t1);
      std::printf(" %8.2f", ms * 1000.0f / reps);
      if (B == batches.back()) {
        auto y = download(y1, B * E), pr = download(p1, B * E * N);
        if (yref.empty()) yref = y, pref = pr;
        for (size_t i = 0; i < pr.size(); ++i) dp = std::fmax(dp, std::fabs(pr[i] - pref[i]));
        for (size_t i = 0; i < y.size(); ++i) dy = std::fmax(dy, std::fabs(y[i] - yref[i]));
      }
    }
    std::printf("   %.3g %.3g\n", dp, dy);
  }
  const int64_t T = 64;
  float* uT = upload(randn(16 * T * E, 1.0f));
  float* xdblT = upload(randn(16 * T * X, 1.0f));
  float* xzT = upload(randn(16 * T * Z, 1.0f));
  float *yT1, *p2;
  CHECK(cudaMalloc(&yT1, 16 * T * E * 4));
  CHECK(cudaMalloc(&p2, maxB * E * N * 4));
  using Run = std::function<void(const ScanArgs&)>;
  const std::vector<std::pair<const char*, Run>> chunks = {
      {"shipped", [](const ScanArgs& a) { launch_scan<false>(a, nullptr); }},
      {"warp scan", [](const ScanArgs& a) { launch_chunk_warp<16, false>(a); }},
      {"warp scan fast", [](const ScanArgs& a) { launch_chunk_warp<16, true>(a); }},
  };
  std::printf("scan chunk, 64 rows per sequence: us per launch; max |diff| of state and y against the shipped kernel\n");
  std::printf("%-14s %8s %8s %8s   diff (16 x 64)\n", "kernel", "1x64", "4x64", "16x64");
  std::vector<float> yref16, pref16;
  for (const auto& [name, run] : chunks) {
    std::printf("%-14s", name);
    double dp = 0, dy = 0;
    for (int64_t B : {1, 4, 16}) {
      ScanArgs a{uT, xdblT, dtw, dtb, A, D, xzT, past, yT1, p2, B, T, E, N, R, X, Z, false};
      for (int i = 0; i < 10; ++i) run(a);
      cudaEventRecord(t0);
      for (int i = 0; i < 100; ++i) run(a);
      cudaEventRecord(t1);
      CHECK(cudaEventSynchronize(t1));
      CHECK(cudaGetLastError());
      float ms = 0;
      cudaEventElapsedTime(&ms, t0, t1);
      std::printf(" %8.2f", ms * 10.0f);
      if (B == 16) {
        auto y = download(yT1, B * T * E), pr = download(p2, B * E * N);
        if (yref16.empty()) yref16 = y, pref16 = pr;
        for (size_t i = 0; i < pr.size(); ++i) dp = std::fmax(dp, std::fabs(pr[i] - pref16[i]));
        for (size_t i = 0; i < y.size(); ++i) dy = std::fmax(dy, std::fabs(y[i] - yref16[i]));
      }
    }
    std::printf("   %.3g %.3g\n", dp, dy);
  }
  return 0;
}
