// Would a GEMM kernel of mambatrt's own beat cuBLAS on a decode step's fp32 projections? Y [M, N] = X [M, K] W^T with
// W [N, K] row-major (torch's [out, in], as the graphs store it), M = the decode batch (1..128), at mamba-130m's
// in_proj / x_proj / out_proj / lm_head shapes. cuBLAS (cublasSgemm "tn", as onnxruntime's Gemm calls it, and "nn"
// on a transposed copy of W) against a plain FFMA kernel: each thread keeps 8 rows x TN columns of Y in registers and
// streams its K range as float4 loads of X and W; the block's KG groups split K and add their partial sums in shared
// memory in a fixed order; with `splits` > 1 the blocks split K too and a second kernel adds their partial sums,
// again in a fixed order. So a row's result does not depend on M (the same bits alone or batched). Every config
// that fits a shape is timed; the table gives the best. Max |difference| against a double-precision reference,
// relative to max |Y|. Build and run on a GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/skinny scripts/skinny_gemm_bench.cu -lcublas && /tmp/skinny
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"

constexpr int kThreads = 256, kRowsPerThread = 8, kTileRows = 64;

// Block (column tile x, K split y, row tile z). Threads: KG groups of 8 x (BN / TN); thread (mi, ni) of group g
// holds rows mi*8.. and columns ni*TN.. of the tile over group g's share of block y's K range.
template <int BN, int TN, int KG>
__global__ void __launch_bounds__(kThreads) skinny_gemm(const float* __restrict__ X, const float* __restrict__ W,
                                                        float* __restrict__ out, int M, int N, int K, int splits) {
  constexpr int GN = BN / TN, G = kRowsPerThread * GN;
  static_assert(G * KG == kThreads, "KG groups of G threads make the block");
  __shared__ float red[KG][kTileRows][BN + 1];
  const int tid = threadIdx.x, g = tid / G, lt = tid % G, mi = lt / GN, ni = lt % GN;
  const int m0 = blockIdx.z * kTileRows + mi * kRowsPerThread, n0 = blockIdx.x * BN + ni * TN;
  const int span = K / splits / KG, k0 = blockIdx.y * (K / splits) + g * span;
  float acc[kRowsPerThread][TN] = {};
  const float4* __restrict__ x4 = reinterpret_cast<const float4*>(X);
  const float4* __restrict__ w4 = reinterpret_cast<const float4*>(W);
  const int K4 = K / 4;
#pragma unroll 2
  for (int k = k0 / 4; k < (k0 + span) / 4; ++k) {
    float4 w[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) w[j] = n0 + j < N ? __ldg(w4 + (n0 + j) * K4 + k) : make_float4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const float4 x = m0 + i < M ? __ldg(x4 + (m0 + i) * K4 + k) : make_float4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        float s = acc[i][j];
        s = fmaf(x.x, w[j].x, s);
        s = fmaf(x.y, w[j].y, s);
        s = fmaf(x.z, w[j].z, s);
        acc[i][j] = fmaf(x.w, w[j].w, s);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) red[g][mi * kRowsPerThread + i][ni * TN + j] = acc[i][j];
  __syncthreads();
  float* dst = splits == 1 ? out : out + size_t(blockIdx.y) * M * N;
  for (int idx = tid; idx < kTileRows * BN; idx += kThreads) {
    const int r = idx / BN, c = idx % BN, row = blockIdx.z * kTileRows + r, col = blockIdx.x * BN + c;
    if (row >= M || col >= N) continue;
    float s = red[0][r][c];
#pragma unroll
    for (int q = 1; q < KG; ++q) s += red[q][r][c];
    dst[size_t(row) * N + col] = s;
  }
}


// The same split of the work, with the operands staged in shared memory: each group loads BK-wide chunks of X
// (64 rows) and W (BN rows) with coalesced float4 loads, stores them K-major ([k][row]), and each thread reads its 8
// x values and TN = 4 w values per k as float4s (broadcast within the group). Chunk c of the block's K range goes
// to group c % KG; a group waits only for its own threads (a named barrier).
constexpr int kBK = 16;
template <int BN, int KG>
__global__ void __launch_bounds__(kThreads) tiled_gemm(const float* __restrict__ X, const float* __restrict__ W,
                                                       float* __restrict__ out, int M, int N, int K, int splits) {
  constexpr int TN = 4, GN = BN / TN, G = kRowsPerThread * GN, XP = kTileRows + 4, WP = BN + 4;
  static_assert(G * KG == kThreads && G % 32 == 0, "KG groups of whole warps make the block");
  constexpr int kTileFloats = kBK * (XP + WP), kRedFloats = kTileRows * (BN + 1);
  constexpr int kSmem = KG * (kTileFloats > kRedFloats ? kTileFloats : kRedFloats);
  __shared__ __align__(16) float smem[kSmem];
  const int tid = threadIdx.x, g = tid / G, lt = tid % G, mi = lt / GN, ni = lt % GN;
  float* xs = smem + g * kTileFloats;  // [kBK][XP]
  float* ws = xs + kBK * XP;           // [kBK][WP]
  const int row0 = blockIdx.z * kTileRows, col0 = blockIdx.x * BN;
  const int range = K / splits, kb = blockIdx.y * range, chunks = range / kBK;
  float acc[kRowsPerThread][TN] = {};
  for (int c = g; c < chunks; c += KG) {
    const int k0 = kb + c * kBK;
    for (int i = lt; i < kTileRows * kBK / 4; i += G) {  // X: 64 rows x 4 float4
      const int r = i / (kBK / 4), q = i % (kBK / 4);
      const float4 v = row0 + r < M ? __ldg(reinterpret_cast<const float4*>(X + size_t(row0 + r) * K + k0) + q)
                                    : make_float4(0, 0, 0, 0);
      xs[(4 * q + 0) * XP + r] = v.x, xs[(4 * q + 1) * XP + r] = v.y;
      xs[(4 * q + 2) * XP + r] = v.z, xs[(4 * q + 3) * XP + r] = v.w;
    }
    for (int i = lt; i < BN * kBK / 4; i += G) {  // W: BN rows x 4 float4
      const int r = i / (kBK / 4), q = i % (kBK / 4);
      const float4 v = col0 + r < N ? __ldg(reinterpret_cast<const float4*>(W + size_t(col0 + r) * K + k0) + q)
                                    : make_float4(0, 0, 0, 0);
      ws[(4 * q + 0) * WP + r] = v.x, ws[(4 * q + 1) * WP + r] = v.y;
      ws[(4 * q + 2) * WP + r] = v.z, ws[(4 * q + 3) * WP + r] = v.w;
    }
    asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "r"(G));
#pragma unroll
    for (int k = 0; k < kBK; ++k) {
      const float4 xa = *reinterpret_cast<const float4*>(xs + k * XP + mi * kRowsPerThread);
      const float4 xb = *reinterpret_cast<const float4*>(xs + k * XP + mi * kRowsPerThread + 4);
      const float4 w = *reinterpret_cast<const float4*>(ws + k * WP + ni * TN);
      const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w}, wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(xv[i], wv[j], acc[i][j]);
    }
    asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "r"(G));
  }
  __syncthreads();
  float* red = smem;  // [KG][64][BN + 1], over the tiles
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) red[(g * kTileRows + mi * kRowsPerThread + i) * (BN + 1) + ni * TN + j] = acc[i][j];
  __syncthreads();
  float* dst = splits == 1 ? out : out + size_t(blockIdx.y) * M * N;
  for (int idx = tid; idx < kTileRows * BN; idx += kThreads) {
    const int r = idx / BN, cc = idx % BN, row = row0 + r, col = col0 + cc;
    if (row >= M || col >= N) continue;
    float s = red[r * (BN + 1) + cc];
#pragma unroll
    for (int q = 1; q < KG; ++q) s += red[(q * kTileRows + r) * (BN + 1) + cc];
    dst[size_t(row) * N + col] = s;
  }
}

struct Config {
  int bn, tn, kg, splits;
  bool tiled = false;
  std::string name() const {
    return std::string(tiled ? "tiled " : "") + "BN" + std::to_string(bn) + " TN" + std::to_string(tn) + " KG" + std::to_string(kg) + " S" +
           std::to_string(splits);
  }
};

template <int BN, int KG>
void launch_tiled(const float* X, const float* W, float* Y, float* part, int M, int N, int K, int splits) {
  dim3 grid((N + BN - 1) / BN, splits, (M + kTileRows - 1) / kTileRows);
  tiled_gemm<BN, KG><<<grid, kThreads>>>(X, W, splits == 1 ? Y : part, M, N, K, splits);
  if (splits > 1) add_parts<<<(M * N + 255) / 256, 256>>>(part, Y, M * N, splits);
}

template <int BN, int TN, int KG>
void launch(const float* X, const float* W, float* Y, float* part, int M, int N, int K, int splits) {
  dim3 grid((N + BN - 1) / BN, splits, (M + kTileRows - 1) / kTileRows);
  skinny_gemm<BN, TN, KG><<<grid, kThreads>>>(X, W, splits == 1 ? Y : part, M, N, K, splits);
  if (splits > 1) add_parts<<<(M * N + 255) / 256, 256>>>(part, Y, M * N, splits);
}

bool run_config(const Config& c, const float* X, const float* W, float* Y, float* part, int M, int N, int K) {
  if (c.tiled) {
    if (K % (kBK * c.splits) != 0) return false;
    if (c.bn == 32) return launch_tiled<32, 4>(X, W, Y, part, M, N, K, c.splits), true;
    if (c.bn == 16) return launch_tiled<16, 8>(X, W, Y, part, M, N, K, c.splits), true;
    if (c.bn == 64) return launch_tiled<64, 2>(X, W, Y, part, M, N, K, c.splits), true;
    return false;
  }
  if (K % (4 * c.kg * c.splits) != 0) return false;
#define CASE(BN_, TN_, KG_)                                  \
  if (c.bn == BN_ && c.tn == TN_ && c.kg == KG_) {             \
    launch<BN_, TN_, KG_>(X, W, Y, part, M, N, K, c.splits);   \
    return true;                                               \
  }
  CASE(32, 4, 4)
  CASE(16, 4, 8)
  CASE(16, 2, 4)
  CASE(8, 2, 8)
  CASE(8, 1, 4)
#undef CASE
  return false;
}


int main() {
  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"in_proj", 3072, 768}, {"x_proj", 80, 1536}, {"out_proj", 768, 1536}, {"lm_head", 50280, 768}};
  const int batches[] = {1, 8, 32, 64, 128};
  std::vector<Config> configs;
  for (auto [bn, tn, kg] : std::vector<std::array<int, 3>>{{32, 4, 4}, {16, 4, 8}, {16, 2, 4}, {8, 2, 8}, {8, 1, 4}})
    for (int s : {1, 2, 3, 4, 6, 8, 12, 16, 24})
      configs.push_back({bn, tn, kg, s});
  for (int bn : {64, 32, 16})
    for (int s : {1, 2, 3, 4, 6, 8, 12, 16, 24}) configs.push_back({bn, 4, 256 / (8 * bn / 4), s, true});
  cublasHandle_t blas;
  CHECK(cublasCreate(&blas));
  CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));  // no TF32
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::printf("fp32, us per call (CUDA events, 200 calls after 10): cublasSgemm tn (onnxruntime's call) | nn (W^T stored) "
              "| best own kernel (config) | relative error of tn / own against double | own bits == own at M=1 rows\n");
  for (const Shape& s : shapes) {
    const int N = s.n, K = s.k, Mmax = 128;
    std::vector<float> hx(size_t(Mmax) * K), hw(size_t(N) * K), hwt(size_t(N) * K);
    for (auto& v : hx) v = normal(rng);
    for (auto& v : hw) v = normal(rng) / std::sqrt(float(K));
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) hwt[size_t(k) * N + n] = hw[size_t(n) * K + k];
    float *X, *W, *Wt, *Y, *Y2, *part, *Y1;
    CHECK(cudaMalloc(&X, hx.size() * 4));
    CHECK(cudaMalloc(&W, hw.size() * 4));
    CHECK(cudaMalloc(&Wt, hw.size() * 4));
    CHECK(cudaMalloc(&Y, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Y2, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Y1, size_t(N) * 4));
    CHECK(cudaMalloc(&part, size_t(24) * Mmax * N * 4));
    CHECK(cudaMemcpy(X, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(W, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(Wt, hwt.data(), hwt.size() * 4, cudaMemcpyHostToDevice));
    for (int M : batches) {
      const std::vector<double> ref = reference_product(hx, hw, M, N, K);
      const float one = 1.0f, zero = 0.0f;
      auto tn = [&] { cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, W, K, X, K, &zero, Y2, N); };
      auto nn = [&] { cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, Wt, N, X, K, &zero, Y2, N); };
      const int reps = N > 10000 ? 50 : 200;
      const float t_tn = time_us(tn, reps);
      tn();
      CHECK(cudaDeviceSynchronize());
      const double e_tn = rel_error(ref, Y2);
      const float t_nn = time_us(nn, reps);
      float best = 1e30f;
      Config best_c{};
      for (const Config& c : configs) {
        if ((M + kTileRows - 1) / kTileRows * ((N + c.bn - 1) / c.bn) * c.splits > 4 * 132 * 8) continue;
        if (!run_config(c, X, W, Y, part, M, N, K)) continue;
        const float t = time_us([&] { run_config(c, X, W, Y, part, M, N, K); }, reps);
        if (t < best) best = t, best_c = c;
      }
      run_config(best_c, X, W, Y, part, M, N, K);
      CHECK(cudaDeviceSynchronize());
      const double e_own = rel_error(ref, Y);
      // the last row alone (M = 1 from that row): the same bits as in the batch?
      run_config(best_c, X + size_t(M - 1) * K, W, Y1, part, 1, N, K);
      CHECK(cudaDeviceSynchronize());
      std::vector<float> a(N), b(N);
      cudaMemcpy(a.data(), Y + size_t(M - 1) * N, N * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), Y1, N * 4, cudaMemcpyDeviceToHost);
      const bool same = a == b;
      std::printf("%-8s M %3d N %5d K %4d | tn %8.2f | nn %8.2f | own %8.2f (%-20s) | err %.1e / %.1e | %s\n", s.name,
                  M, N, K, t_tn, t_nn, best, best_c.name().c_str(), e_tn, e_own, same ? "same" : "DIFFERENT");
    }
    cudaFree(X), cudaFree(W), cudaFree(Wt), cudaFree(Y), cudaFree(Y2), cudaFree(Y1), cudaFree(part);
  }
  CHECK(cudaGetLastError());
  return 0;
}
