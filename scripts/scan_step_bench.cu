// Times the CUDA scan kernels of compile/kernels/mamba_ops_cuda.cu at mamba-130m's shapes (E 1536, N 16, R 48):
// the step (one row per sequence) as shipped and in other lane / sequence mappings for batches 1..128 (against
// session 10's mapping), and the chunk kernel (sequences x rows from 1 x 64 to 64 x 64) as shipped, with other
// lane counts and as a parallel scan over the rows (against session 11's chunk kernel, kept below as the
// sequential reference); max |diff| of the new state and y. Variants measured and dropped are in BENCHMARKS.md
// (sessions 11, 17, 27). Build and run on a GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/scan_step_bench scripts/scan_step_bench.cu && /tmp/scan_step_bench
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../compile/kernels/mamba_ops_cuda.cu"

namespace mambatrt {
namespace {
// Session 11's chunk kernel (shipped until session 17), the reference of the shipped one's states: the scan of
// a chunk of rows, staged kRows rows at a time through shared memory, in three phases per stage:
//   1. the stage's xdbl rows (dt inputs, B, C), u and z copied to shared memory, all loads in flight at once;
//      then dt = softplus(x_dt . dt_weight[e] + dt_bias[e]) for every (row, channel) from the staged rows;
//   2. the recurrence: lane n of channel e walks the rows, h = exp(dt A[e,n]) h + dt u B[n], and stores h C[n];
//   3. y = (sum over n of h C[n] + D u) * silu(z) for every (row, channel).
// Only phase 2 is sequential, and in it only the update of h depends on the previous row, so the rows pipeline.
// With u, z and the xdbl rows read from global memory inside the phases' loops and s_p unpadded (16-way bank
// conflicts in phase 3) this took 23.8 us per layer for one sequence of 64 rows and 124 us for 16; staged and
// padded, 16.7 and 105 us (scripts/scan_step_bench.cu; staging the dt weights too, or padding the xdbl rows,
// measured slower). What bounds it at 16 sequences is still open: neither the loads nor the bank conflicts were
// most of it.
constexpr int kChunk = 32;  // rows per stage

template <int L>
struct ChunkShape {
  static constexpr int C = kThreads / L;                      // channels per block
  static constexpr int kRows = C >= 128 ? kChunk / 2 : kChunk;  // rows per stage
  static constexpr int P = C * (L + 1);  // s_p's row: a channel's L lanes and one pad (no bank conflicts)
  static constexpr size_t kStatic = sizeof(float) * kRows * (3 * C + P);  // s_dt, s_u, s_z, s_p
};

template <int L, bool Half>  // L lanes per channel: a power of two >= N
__global__ void chunk_staged_kernel(ScanArgs a) {
  constexpr int C = ChunkShape<L>::C, kRows = ChunkShape<L>::kRows, P = ChunkShape<L>::P;
  __shared__ float s_dt[kRows][C];
  __shared__ float s_u[kRows][C];
  __shared__ float s_z[kRows][C];
  __shared__ float s_p[kRows][P];  // h C[n] of lane n of channel c at c * (L + 1) + n
  extern __shared__ float s_x[];  // [kRows][X]: the stage's xdbl rows
  const int64_t b = blockIdx.y, E = a.inner, N = a.state, R = a.rank, T = a.rows, X = a.xdbl_width;
  const int64_t Z = a.xz_width;
  const int c = threadIdx.x / L, n = threadIdx.x % L;
  const int64_t e0 = int64_t(blockIdx.x) * C, e = e0 + c;
  const bool owner = e < E && n < N;
  float h = owner ? a.past[(b * E + e) * N + n] : 0.0f;
  const float A = owner ? a.a[e * N + n] : 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kRows) {
    const int rows = int(T - t0 < kRows ? T - t0 : kRows);
    const int64_t row0 = b * T + t0;
    for (int64_t i = threadIdx.x; i < rows * X; i += kThreads) s_x[i] = a.xdbl[row0 * X + i];  // phase 1
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {
      const int r = i / C, cc = i % C;
      const bool in = e0 + cc < E;
      s_u[r][cc] = in ? a.u[(row0 + r) * E + e0 + cc] : 0.0f;
      s_z[r][cc] = in ? load<Half>(a.xz, (row0 + r) * Z + Z - E + e0 + cc) : 0.0f;
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
    if (owner) {  // phase 2
      for (int r = 0; r < rows; ++r) {
        const float dt = s_dt[r][c];
        const float* x = s_x + r * X + R;  // B [N] | C [N]
        h = expf(dt * A) * h + (dt * s_u[r][c]) * x[n];
        s_p[r][c * (L + 1) + n] = h * x[N + n];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * C; i += kThreads) {  // phase 3
      const int r = i / C, cc = i % C;
      const int64_t ee = e0 + cc;
      if (ee >= E) continue;
      float y = 0.0f;
      for (int k = 0; k < N; ++k) y += s_p[r][cc * (L + 1) + k];
      store<Half>(a.y, (row0 + r) * E + ee, (y + a.d[ee] * s_u[r][cc]) * silu(s_z[r][cc]));
    }
    __syncthreads();  // the next stage reuses the shared arrays
  }
  if (owner) a.present[(b * E + e) * N + n] = h;
}

template <int L, bool Half>
void launch_staged(const ScanArgs& a, cudaStream_t stream) {
  using S = ChunkShape<L>;
  const size_t dynamic = sizeof(float) * S::kRows * size_t(a.xdbl_width);
  if (S::kStatic + dynamic > 48 * 1024) {  // a wide xdbl row (a large dt rank): opt in to more shared memory
    cudaFuncSetAttribute(chunk_staged_kernel<L, Half>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dynamic));
  }
  dim3 grid(unsigned((a.inner + S::C - 1) / S::C), unsigned(a.batch));
  chunk_staged_kernel<L, Half><<<grid, kThreads, dynamic, stream>>>(a);
}

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
      {"l4 s2 expf", [](const ScanArgs& a) { launch_step_lanes<16, 4, 2, false, false>(a, nullptr); }},  // session 17
      {"lanes4 seqs4", [](const ScanArgs& a) { launch_step_lanes<16, 4, 4, false>(a, nullptr); }},
      {"lanes4 seqs8", [](const ScanArgs& a) { launch_step_lanes<16, 4, 8, false>(a, nullptr); }},
      {"lanes2 seqs2", [](const ScanArgs& a) { launch_step_lanes<16, 2, 2, false>(a, nullptr); }},
      {"lanes2 seqs4", [](const ScanArgs& a) { launch_step_lanes<16, 2, 4, false>(a, nullptr); }},
      {"lanes1 seqs1", [](const ScanArgs& a) { launch_step_lanes<16, 1, 1, false>(a, nullptr); }},
      {"lanes1 seqs2", [](const ScanArgs& a) { launch_step_lanes<16, 1, 2, false>(a, nullptr); }},
      // session 27's float4 step (a first version written for R 48 alone timed as this one: BENCHMARKS.md)
      {"vec l4 s1", [](const ScanArgs& a) { launch_step_vec<16, 4, 1, false, 3>(a, nullptr); }},  // shipped below 32
      {"vec l4 s2", [](const ScanArgs& a) { launch_step_vec<16, 4, 2, false, 3>(a, nullptr); }},  // shipped from 32
      {"vec l4 s4", [](const ScanArgs& a) { launch_step_vec<16, 4, 4, false, 3>(a, nullptr); }},
      {"vec any s1", [](const ScanArgs& a) { launch_step_vec<16, 4, 1, false, 0>(a, nullptr); }},  // rank counted
      {"vec any s2", [](const ScanArgs& a) { launch_step_vec<16, 4, 2, false, 0>(a, nullptr); }},  // at run time
      // session 30: the states with the streaming cache hints (ld/st.global.cs)
      {"vec cs s1", [](const ScanArgs& a) { launch_step_vec<16, 4, 1, false, 3, true>(a, nullptr); }},
      {"vec cs s2", [](const ScanArgs& a) { launch_step_vec<16, 4, 2, false, 3, true>(a, nullptr); }},
      {"vec cs s4", [](const ScanArgs& a) { launch_step_vec<16, 4, 4, false, 3, true>(a, nullptr); }},
      // two lanes of eight state elements (dt sums over 24 inputs a lane: other bits than four lanes')
      {"vec l2 s1", [](const ScanArgs& a) { launch_step_vec<16, 2, 1, false, 6>(a, nullptr); }},
      {"vec l2 s2", [](const ScanArgs& a) { launch_step_vec<16, 2, 2, false, 6>(a, nullptr); }},
  };
  // cold: each launch on another of kSets copies of the states (24 layers' worth, past L2), as in a decode graph
  // where each layer's states come from memory; the kernels above time hot (the same states every launch, in L2)
  constexpr int kSets = 24;
  std::vector<float*> pasts(kSets), presents(kSets);
  for (int i = 0; i < kSets; ++i) {
    pasts[i] = upload(randn(maxB * E * N, 1.0f));
    CHECK(cudaMalloc(&presents[i], maxB * E * N * 4));
  }
  std::printf("scan step, E %ld N %ld R %ld: us per launch; max |diff| of state and y against the shipped kernel\n",
              long(E), long(N), long(R));
  std::printf("%-14s", "kernel");
  const std::vector<int64_t> batches = {1, 2, 4, 8, 16, 32, 64, 128};
  for (int64_t B : batches) std::printf(" %8s", ("B" + std::to_string(B)).c_str());
  std::printf("   diff (B128)\n");
  std::vector<float> yref, pref;
  auto timed = [&](const Launch& launch, int64_t B, bool cold) {  // us per launch
    ScanArgs a{u, xdbl, dtw, dtb, A, D, xz, past, y1, p1, B, 1, E, N, R, X, Z, false};
    const int reps = cold ? 10 * kSets : 500;
    for (int i = 0; i < (cold ? kSets : 20); ++i) {
      if (cold) a.past = pasts[i % kSets], a.present = presents[i % kSets];
      launch(a);
    }
    cudaEventRecord(t0);
    for (int i = 0; i < reps; ++i) {
      if (cold) a.past = pasts[i % kSets], a.present = presents[i % kSets];
      launch(a);
    }
    cudaEventRecord(t1);
    CHECK(cudaEventSynchronize(t1));
    CHECK(cudaGetLastError());
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    return ms * 1000.0f / reps;
  };
  for (const auto& [name, launch] : kernels) {
    std::printf("%-14s", name);
    double dp = 0, dy = 0;
    for (int64_t B : batches) {
      std::printf(" %8.2f", timed(launch, B, false));
      if (B == batches.back()) {
        auto y = download(y1, B * E), pr = download(p1, B * E * N);
        if (yref.empty()) yref = y, pref = pr;
        for (size_t i = 0; i < pr.size(); ++i) dp = std::fmax(dp, std::fabs(pr[i] - pref[i]));
        for (size_t i = 0; i < y.size(); ++i) dy = std::fmax(dy, std::fabs(y[i] - yref[i]));
      }
    }
    std::printf("   %.3g %.3g\n", dp, dy);
  }
  std::printf("scan step, cold (the states from memory: %d sets in turn): us per launch\n", kSets);
  for (const auto& [name, launch] : kernels) {
    if (std::strncmp(name, "vec", 3) != 0 && std::strcmp(name, "shipped") != 0) continue;
    std::printf("%-14s", name);
    for (int64_t B : batches) std::printf(" %8.2f", timed(launch, B, true));
    std::printf("\n");
  }
  // chunk shapes (sequences x rows), up to 4096 rows in all; 16 x 40 ends on a partial stage
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 64}, {4, 64}, {16, 64}, {64, 64}, {16, 40}, {64, 2}};
  const int64_t maxRows = 4096;
  float* uT = upload(randn(maxRows * E, 1.0f));
  float* xdblT = upload(randn(maxRows * X, 1.0f));
  float* xzT = upload(randn(maxRows * Z, 1.0f));
  float *yT1, *p2;
  CHECK(cudaMalloc(&yT1, maxRows * E * 4));
  CHECK(cudaMalloc(&p2, maxB * E * N * 4));
  using Run = std::function<void(const ScanArgs&)>;
  const std::vector<std::pair<const char*, Run>> chunks = {
      {"session 11", [](const ScanArgs& a) { launch_staged<16, false>(a, nullptr); }},
      {"shipped", [](const ScanArgs& a) { launch_scan<false>(a, nullptr); }},
      {"rows lanes1", [](const ScanArgs& a) { launch_rows<16, 1, false>(a, nullptr); }},
      {"rows lanes2", [](const ScanArgs& a) { launch_rows<16, 2, false>(a, nullptr); }},
      {"rows lanes8", [](const ScanArgs& a) { launch_rows<16, 8, false>(a, nullptr); }},
      {"rows lanes16", [](const ScanArgs& a) { launch_rows<16, 16, false>(a, nullptr); }},
      {"warp scan", [](const ScanArgs& a) { launch_chunk_warp<16, false>(a); }},
  };
  std::printf("scan chunk: us per launch (sequences x rows); max |diff| of state and y against session 11's kernel\n");
  std::printf("%-14s", "kernel");
  for (const auto& [B, T] : shapes) std::printf(" %8s", (std::to_string(B) + "x" + std::to_string(T)).c_str());
  std::printf("   diff (all shapes)\n");
  std::vector<std::vector<float>> yrefs, prefs;
  for (const auto& [name, run] : chunks) {
    std::printf("%-14s", name);
    double dp = 0, dy = 0;
    for (size_t s = 0; s < shapes.size(); ++s) {
      const auto [B, T] = shapes[s];
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
      auto y = download(yT1, B * T * E), pr = download(p2, B * E * N);
      if (yrefs.size() <= s) yrefs.push_back(y), prefs.push_back(pr);
      for (size_t i = 0; i < pr.size(); ++i) dp = std::fmax(dp, std::fabs(pr[i] - prefs[s][i]));
      for (size_t i = 0; i < y.size(); ++i) dy = std::fmax(dy, std::fabs(y[i] - yrefs[s][i]));
    }
    std::printf("   %.3g %.3g\n", dp, dy);
  }
  return 0;
}
