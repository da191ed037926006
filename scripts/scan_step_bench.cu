// Times the CUDA scan kernels of compile/kernels/mamba_ops_cuda.cu at mamba-130m's shapes (E 1536, N 16, R 48):
// the step (one row per sequence) as shipped and in other lane / sequence mappings for batches 1..128, and the
// chunk kernel (64 rows per sequence) as shipped and as in session 10; each against the session-10 kernel's
// results (max |diff| of the new state and y). Build and run on a GPU machine:
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
// session 10's chunk kernel: u read from global memory in the sequential walk
template <int L, bool Half>  // L lanes per channel: a power of two >= N
__global__ void session10_chunk_kernel(ScanArgs a) {
  constexpr int C = kThreads / L;  // channels per block
  __shared__ float s_dt[kChunk][C];
  __shared__ float s_bc[kChunk][2 * kMaxState];
  __shared__ float s_p[kChunk][kThreads];
  const int64_t b = blockIdx.y, E = a.inner, N = a.state, R = a.rank, T = a.rows, X = a.xdbl_width;
  const int c = threadIdx.x / L, n = threadIdx.x % L;
  const int64_t e0 = int64_t(blockIdx.x) * C, e = e0 + c;
  const bool owner = e < E && n < N;
  float h = owner ? a.past[(b * E + e) * N + n] : 0.0f;
  const float A = owner ? a.a[e * N + n] : 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int rows = int(T - t0 < kChunk ? T - t0 : kChunk);
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {  // phase 1
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      float dt = 0.0f;
      if (ee < E) {
        const float* x = a.xdbl + (b * T + t0 + r) * X;
        const float* w = a.dt_weight + ee * R;
        float s = 0.0f;
        for (int64_t k = 0; k < R; ++k) s += x[k] * w[k];
        dt = softplus(s + a.dt_bias[ee]);
      }
      s_dt[r][cc] = dt;
    }
    for (int i = threadIdx.x; i < rows * 2 * N; i += kThreads) {
      const int r = int(i / (2 * N)), j = int(i % (2 * N));
      s_bc[r][j] = a.xdbl[(b * T + t0 + r) * X + R + j];
    }
    __syncthreads();
    if (owner) {  // phase 2
      const float* u = a.u + (b * T + t0) * E + e;
      for (int r = 0; r < rows; ++r) {
        const float dt = s_dt[r][c];
        h = expf(dt * A) * h + (dt * u[r * E]) * s_bc[r][n];
        s_p[r][threadIdx.x] = h * s_bc[r][N + n];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {  // phase 3
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      if (ee >= E) continue;
      float y = 0.0f;
      for (int k = 0; k < N; ++k) y += s_p[r][cc * L + k];
      const int64_t row = b * T + t0 + r;
      const float u = a.u[row * E + ee];
      const float z = load<Half>(a.xz, row * a.xz_width + a.xz_width - E + ee);
      store<Half>(a.y, row * E + ee, (y + a.d[ee] * u) * silu(z));
    }
    __syncthreads();  // the next chunk reuses the shared arrays
  }
  if (owner) a.present[(b * E + e) * N + n] = h;
}

// Chunk-kernel variants for tuning: LANES lanes per channel, each owning NS / LANES state elements (so a thread's
// shared loads of dt and u serve several elements), the exponential accurate or __expf (FAST).
template <int NS, int LANES, bool FAST>
__global__ void chunk_lanes_kernel(ScanArgs a) {
  constexpr int EPL = NS / LANES, C = kThreads / LANES, kRows = kChunk, P = C * (LANES + 1);
  __shared__ float s_dt[kRows][C];
  __shared__ float s_u[kRows][C];
  __shared__ float s_z[kRows][C];
  __shared__ float s_p[kRows][P];
  extern __shared__ float s_x[];
  const int64_t b = blockIdx.y, E = a.inner, N = a.state, R = a.rank, T = a.rows, X = a.xdbl_width;
  const int64_t Z = a.xz_width;
  const int c = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  const int64_t e0 = int64_t(blockIdx.x) * C, e = e0 + c;
  const int n0 = lane * EPL;
  float h[EPL], A[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const bool own = e < E && n0 + j < N;
    h[j] = own ? a.past[(b * E + e) * N + n0 + j] : 0.0f;
    A[j] = own ? a.a[e * N + n0 + j] : 0.0f;
  }
  for (int64_t t0 = 0; t0 < T; t0 += kRows) {
    const int rows = int(T - t0 < kRows ? T - t0 : kRows);
    const int64_t row0 = b * T + t0;
    for (int i = threadIdx.x; i < rows * int(X); i += kThreads) s_x[i] = a.xdbl[row0 * X + i];
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {
      const int r = i / C, cc = i % C;
      const bool in = e0 + cc < E;
      s_u[r][cc] = in ? a.u[(row0 + r) * E + e0 + cc] : 0.0f;
      s_z[r][cc] = in ? load<false>(a.xz, (row0 + r) * Z + Z - E + e0 + cc) : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      float dt = 0.0f;
      if (ee < E) {
        const float* x = s_x + r * X;
        const float* w = a.dt_weight + ee * R;
        float s = 0.0f;
#pragma unroll 8
        for (int64_t k = 0; k < R; ++k) s += x[k] * w[k];
        dt = softplus(s + a.dt_bias[ee]);
      }
      s_dt[r][cc] = dt;
    }
    __syncthreads();
    if (e < E) {
      for (int r = 0; r < rows; ++r) {
        const float dt = s_dt[r][c], du = dt * s_u[r][c];
        const float* x = s_x + r * X + R + n0;  // B [N] | C [N], from this lane's first element
        float p = 0.0f;
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
          if (n0 + j < N) {
            const float g = FAST ? __expf(dt * A[j]) : expf(dt * A[j]);
            h[j] = g * h[j] + du * x[j];
            p += h[j] * x[N + j];
          }
        }
        s_p[r][c * (LANES + 1) + lane] = p;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      if (ee >= E) continue;
      float y = 0.0f;
#pragma unroll
      for (int k = 0; k < LANES; ++k) y += s_p[r][cc * (LANES + 1) + k];
      static_cast<float*>(a.y)[(row0 + r) * E + ee] = (y + a.d[ee] * s_u[r][cc]) * silu(s_z[r][cc]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    if (e < E && n0 + j < N) a.present[(b * E + e) * N + n0 + j] = h[j];
  }
}

template <int NS, int LANES, bool FAST>
void launch_chunk_lanes(const ScanArgs& a) {
  constexpr int C = kThreads / LANES;
  dim3 grid(unsigned((a.inner + C - 1) / C), unsigned(a.batch));
  chunk_lanes_kernel<NS, LANES, FAST><<<grid, kThreads, sizeof(float) * kChunk * a.xdbl_width>>>(a);
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
      {"session 10", [&](const ScanArgs& a) {
         session10_chunk_kernel<16, false><<<dim3(unsigned(E / (kThreads / 16)), unsigned(a.batch)), kThreads>>>(a);
       }},
      {"shipped", [](const ScanArgs& a) { launch_scan<false>(a, nullptr); }},
      {"lanes16", [](const ScanArgs& a) { launch_chunk_lanes<16, 16, false>(a); }},
      {"lanes8", [](const ScanArgs& a) { launch_chunk_lanes<16, 8, false>(a); }},
      {"lanes4", [](const ScanArgs& a) { launch_chunk_lanes<16, 4, false>(a); }},
      {"lanes16 fast", [](const ScanArgs& a) { launch_chunk_lanes<16, 16, true>(a); }},
      {"lanes8 fast", [](const ScanArgs& a) { launch_chunk_lanes<16, 8, true>(a); }},
  };
  std::printf("scan chunk, 64 rows per sequence: us per launch; max |diff| of state and y against session 10's\n");
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
