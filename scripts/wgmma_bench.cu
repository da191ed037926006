// A 3xTF32 product on sm_90's warpgroup MMAs (wgmma) against MambaLinear and cuBLAS, at the decode step's shapes:
// Y [M, N] = X [M, K] W [N, K]^T in fp32 for M <= 64. Session 19's `linear_bench tf32` bounded what such a kernel
// could gain (one TF32 product on Hopper's own path: in_proj 6.7 against MambaLinear's 10.1 us at 64 rows); this is
// its first version.
//
// Mapping ("swap AB", as for skinny products): wgmma's M is 64 rows of W, its N the batch (M rows of X, zero-padded to
// 64), so D = W X^T. A (W) comes from registers: each thread loads its fragment's rows as float4s and splits them
// into TF32 hi and lo parts in registers (the fragment is mma.sync m16n8k8's A, per warp of the warpgroup), with
// MambaLinear's permutation of K within each 32-column block (lane quad t loads columns 8t..8t+7; step s uses
// physical columns 8t+2s, 8t+2s+1), so that every load is a float4. B (X) is staged in shared memory as two tiles
// (hi, lo parts) in the canonical K-major layout without swizzle (core matrices of 8 rows x 16 bytes; in 16-byte
// units ((8, n), 2) : ((1, SBO), LBO)), its columns permuted as W's. Per 8-column step three wgmmas: big += Wh Xh,
// small += Wh Xl + Wl Xh (two accumulators, as MambaLinear's). K is split over KS blocks whose parts a second kernel
// adds in a fixed order (KS = 1: one kernel). No pipelining yet: each 32-column block is staged, fenced, multiplied
// and waited for in turn. A second version (wgmma_3xtf32_piped) keeps two stages of tiles: while a block's wgmmas
// run, the next block's W fragment and X (as float4s) are loaded and X is split into the other stage.
//
// Session 19's first run (BENCHMARKS.md, benchmarks/2026-12-02_h200_s19e_wgmma_bench.txt): the results are right
// (error against double 2e-6 at KS 1, 4e-7 to 7e-7 with K split; a batch's last row equals that row alone), and slow:
// in_proj at 64 rows 83.2 us at KS 1, 19.6 at KS 6, against MambaLinear's 10.1. What it lacks: staging and loads
// overlapped with the MMAs (double-buffered tiles, the next block's W fragment loaded during this one's wgmmas), X
// staged by float4s instead of one float per thread and step, and more blocks than N / 64 without a second kernel
// (a cluster's blocks summing their parts through distributed shared memory, as MambaLinear's cluster kernel).
// The pipelined version, written after that run for the first two, compiles (168 registers, no spills; ptxas adds
// warpgroup arrives where registers the wgmmas use are touched between them) and has not run yet.
//
// Build and run on an H200 (wgmma needs the sm_90a target):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -DMAMBATRT_WITH_CUTLASS \
//     -I CUTLASS -o .bin/wgmma_bench scripts/wgmma_bench.cu -ldl && .bin/wgmma_bench
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../compile/kernels/mamba_linear.cuh"
#include "bench_common.cuh"  // CHECK, graph_us, add_parts, Blas, Operands, blas_tn_us, rel_error, ...

namespace {

constexpr int kRowsW = 64;   // rows of W per block (wgmma's M)
constexpr int kRowsX = 64;   // rows of X per block, zero-padded (wgmma's N)
constexpr int kBlockK = 32;  // columns of K staged at a time (four wgmma steps of 8)
constexpr int kThreads = 128;

// byte offset of X's (row r, logical column c) in a staged tile: core matrix (r / 8, c / 4), 128 bytes each, row-group
// major (SBO = kBlockK / 4 core matrices = 1024 bytes, LBO = 128 bytes)
__device__ __forceinline__ int tile_offset(int r, int c) {
  return ((r / 8) * (kBlockK / 4) + c / 4) * 128 + (r % 8) * 16 + (c % 4) * 4;
}

// the logical column (wgmma step s, quad position t, half h: column 8s + t + 4h) of physical column p = 8t + 2s + h
__device__ __forceinline__ int logical_column(int p) {
  const int t = p / 8, s = (p % 8) / 2, h = p % 2;
  return 8 * s + t + 4 * h;
}

// the shared-memory descriptor of a K-major tile without swizzle at shared address `address` (bytes)
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
  const uint64_t start = (address >> 4) & 0x3fff, lbo = 128 >> 4, sbo = (kBlockK / 4 * 128) >> 4;
  return start | (lbo << 16) | (sbo << 32);  // base offset 0, layout type 0 (interleave: no swizzle)
}

// d (64 x 64, this thread's 32) += A (64 x 8, from registers a0..a3) . B (8 x 64 from shared memory, descriptor)
__device__ __forceinline__ void wgmma(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"  // scale-d: D += A B
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// The accumulators as the compiler sees them change here (CUTLASS's warpgroup_fence_operand): no read of them moves
// above the wait for the wgmmas, no write below the fence before them
__device__ __forceinline__ void fence_operands(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// likewise for the A fragments: their registers stay theirs until the wgmmas that read them are done
__device__ __forceinline__ void fence_operands(uint32_t (&a)[4][4]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(a[i / 4][i % 4])::"memory");
}

// W's fragment for one 32-column block from column k0: columns 8t .. 8t+7 of rows row_a and row_b (zeros past N)
__device__ __forceinline__ void load_w(const float* __restrict__ W, int row_a, int row_b, int N, int K, int k0, int t,
                                       float (&wa)[8], float (&wb)[8]) {
#pragma unroll
  for (int j = 0; j < 8; j += 4) {
    const float4 va = row_a < N ? *reinterpret_cast<const float4*>(W + size_t(row_a) * K + k0 + 8 * t + j)
                                : make_float4(0, 0, 0, 0);
    const float4 vb = row_b < N ? *reinterpret_cast<const float4*>(W + size_t(row_b) * K + k0 + 8 * t + j)
                                : make_float4(0, 0, 0, 0);
    wa[j] = va.x, wa[j + 1] = va.y, wa[j + 2] = va.z, wa[j + 3] = va.w;
    wb[j] = vb.x, wb[j + 1] = vb.y, wb[j + 2] = vb.z, wb[j + 3] = vb.w;
  }
}

// the fragment's hi and lo parts per wgmma step s: a0 (row g, col t), a1 (row g+8, col t), a2 (g, t+4), a3 (g+8, t+4)
__device__ __forceinline__ void split_w(const float (&wa)[8], const float (&wb)[8], uint32_t (&ah)[4][4],
                                        uint32_t (&al)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    mambatrt_linear::split(wa[2 * s], ah[s][0], al[s][0]);
    mambatrt_linear::split(wb[2 * s], ah[s][1], al[s][1]);
    mambatrt_linear::split(wa[2 * s + 1], ah[s][2], al[s][2]);
    mambatrt_linear::split(wb[2 * s + 1], ah[s][3], al[s][3]);
  }
}

// the twelve wgmmas of one 32-column block on the tiles at shared addresses xh, xl (committed, not waited for)
__device__ __forceinline__ void multiply(float (&big)[32], float (&small)[32], const uint32_t (&ah)[4][4],
                                        const uint32_t (&al)[4][4], uint32_t xh, uint32_t xl) {
  fence_operands(big), fence_operands(small);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t step = s * 2 * 128;  // logical columns 8s .. 8s+7: core matrices 2s, 2s+1
    wgmma(small, ah[s], descriptor(xl + step));
    wgmma(small, al[s], descriptor(xh + step));
    wgmma(big, ah[s], descriptor(xh + step));
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wait_all(float (&big)[32], float (&small)[32], uint32_t (&ah)[4][4],
                                         uint32_t (&al)[4][4]) {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_operands(big), fence_operands(small), fence_operands(ah), fence_operands(al);
}

// the tiles' stores (generic proxy) seen by the wgmmas (async proxy), then every thread's
__device__ __forceinline__ void publish_tiles() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

// D = big + small to Y (or part ks of P): D[i][j], i = 16 warp + g + 8 v1 (a row of W), j = 2t + v0 + 8 v2 (a row of
// X), register v0 + 2 v1 + 4 v2
__device__ __forceinline__ void store_d(const float (&big)[32], const float (&small)[32], float* out, int n0, int M,
                                        int N) {
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int v = 0; v < 32; ++v) {
    const int v0 = v % 2, v1 = (v / 2) % 2, v2 = v / 4;
    const int n = n0 + 16 * warp + g + 8 * v1, m = 2 * t + v0 + 8 * v2;
    if (n < N && m < M) out[size_t(m) * N + n] = big[v] + small[v];
  }
}

// Y (KS = 1) or part ks of it (P [KS, M, N]) for rows n0..n0+63 of W, columns ks K / KS .. of K: each 32-column block
// staged (one float per thread and step), fenced, multiplied and waited for in turn (the first version)
__global__ void __launch_bounds__(kThreads) wgmma_3xtf32(const float* __restrict__ X, const float* __restrict__ W,
                                                          float* __restrict__ Y, int M, int N, int K, int KS) {
  __shared__ __align__(128) float xh[kRowsX * kBlockK];
  __shared__ __align__(128) float xl[kRowsX * kBlockK];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * kRowsW, ks = blockIdx.y, span = K / KS, k_begin = ks * span;
  const int row_a = n0 + 16 * warp + g, row_b = row_a + 8;  // this thread's rows of W (fragment rows g, g + 8)
  float big[32] = {}, small[32] = {};
  const uint32_t xh_address = static_cast<uint32_t>(__cvta_generic_to_shared(xh));
  const uint32_t xl_address = static_cast<uint32_t>(__cvta_generic_to_shared(xl));
  for (int k0 = k_begin; k0 < k_begin + span; k0 += kBlockK) {
    // X's block: 64 rows x 32 columns, 16 per thread, split and stored at their logical columns
    for (int i = threadIdx.x; i < kRowsX * kBlockK; i += kThreads) {
      const int r = i / kBlockK, p = i % kBlockK;
      const float x = r < M ? X[size_t(r) * K + k0 + p] : 0.0f;
      uint32_t hi, lo;
      mambatrt_linear::split(x, hi, lo);
      const int at = tile_offset(r, logical_column(p)) / 4;
      xh[at] = __uint_as_float(hi), xl[at] = __uint_as_float(lo);
    }
    float wa[8], wb[8];
    load_w(W, row_a, row_b, N, K, k0, t, wa, wb);
    uint32_t ah[4][4], al[4][4];
    split_w(wa, wb, ah, al);
    publish_tiles();
    multiply(big, small, ah, al, xh_address, xl_address);
    wait_all(big, small, ah, al);
    __syncthreads();  // the tiles are read: the next block may overwrite them
  }
  store_d(big, small, KS == 1 ? Y : Y + size_t(ks) * M * N, n0, M, N);
}

// X's 32-column block from column k0 as float4s: 512 of them, four per thread (float4 f = thread + 128 j: row f / 8,
// physical columns 4 (f % 8) ..), zeros past M
__device__ __forceinline__ void load_x(const float* __restrict__ X, int M, int K, int k0, float4 (&xv)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int f = threadIdx.x + kThreads * j, r = f / 8;
    xv[j] = r < M ? *reinterpret_cast<const float4*>(X + size_t(r) * K + k0 + 4 * (f % 8)) : make_float4(0, 0, 0, 0);
  }
}

// load_x's values split and stored at their logical columns in the tiles xh, xl
__device__ __forceinline__ void store_x(const float4 (&xv)[4], float* xh, float* xl) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int f = threadIdx.x + kThreads * j, r = f / 8, p0 = 4 * (f % 8);
    const float v[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t hi, lo;
      mambatrt_linear::split(v[q], hi, lo);
      const int at = tile_offset(r, logical_column(p0 + q)) / 4;
      xh[at] = __uint_as_float(hi), xl[at] = __uint_as_float(lo);
    }
  }
}

// As wgmma_3xtf32, pipelined: two stages of tiles; while a block's wgmmas run, the next block's W fragment and X
// (float4s) are loaded and X is split into the other stage (not yet run: see the top)
__global__ void __launch_bounds__(kThreads) wgmma_3xtf32_piped(const float* __restrict__ X,
                                                                const float* __restrict__ W, float* __restrict__ Y,
                                                                int M, int N, int K, int KS) {
  __shared__ __align__(128) float tiles[2][2][kRowsX * kBlockK];  // [stage][hi, lo]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * kRowsW, ks = blockIdx.y, span = K / KS, k_begin = ks * span, blocks = span / kBlockK;
  const int row_a = n0 + 16 * warp + g, row_b = row_a + 8;
  float big[32] = {}, small[32] = {}, wa[8], wb[8];
  float4 xv[4];
  load_w(W, row_a, row_b, N, K, k_begin, t, wa, wb);
  load_x(X, M, K, k_begin, xv);
  store_x(xv, tiles[0][0], tiles[0][1]);
  publish_tiles();
  for (int i = 0; i < blocks; ++i) {
    const int stage = i % 2;
    uint32_t ah[4][4], al[4][4];
    split_w(wa, wb, ah, al);
    const bool more = i + 1 < blocks;
    if (more) {  // the next block's loads in flight during this block's wgmmas
      load_w(W, row_a, row_b, N, K, k_begin + (i + 1) * kBlockK, t, wa, wb);
      load_x(X, M, K, k_begin + (i + 1) * kBlockK, xv);
    }
    multiply(big, small, ah, al, static_cast<uint32_t>(__cvta_generic_to_shared(tiles[stage][0])),
             static_cast<uint32_t>(__cvta_generic_to_shared(tiles[stage][1])));
    if (more) store_x(xv, tiles[stage ^ 1][0], tiles[stage ^ 1][1]);  // read by the last block's wgmmas, done
    wait_all(big, small, ah, al);
    publish_tiles();
  }
  store_d(big, small, KS == 1 ? Y : Y + size_t(ks) * M * N, n0, M, N);
}

cudaError_t launch(bool piped, const float* X, const float* W, float* Y, float* P, int M, int N, int K, int KS,
                   cudaStream_t s) {
  dim3 grid((N + kRowsW - 1) / kRowsW, KS);
  float* out = KS == 1 ? Y : P;
  if (piped) {
    wgmma_3xtf32_piped<<<grid, kThreads, 0, s>>>(X, W, out, M, N, K, KS);
  } else {
    wgmma_3xtf32<<<grid, kThreads, 0, s>>>(X, W, out, M, N, K, KS);
  }
  if (KS > 1) add_parts<<<(M * N + 255) / 256, 256, 0, s>>>(P, Y, M * N, KS);
  return cudaGetLastError();
}

}  // namespace

int main() {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Blas blas;
  const bool have_blas = blas.open(stream);
  std::mt19937 rng(0);
  std::printf("GPU us per call (20 calls in a CUDA graph, each on another copy of W): cuBLAS fp32 | MambaLinear | "
              "wgmma 3xTF32, the first version and the pipelined one, each at KS = 1, 2, 3, 4, 6 (K split over "
              "blocks) | error vs double (MambaLinear / each version at KS 1 and at its best KS) | each version: last "
              "row batched == alone\n");
  const Projection shapes[] = {{"in_proj", 3072, 768}, {"x_proj", 80, 1536}, {"out_proj", 768, 1536},
                               {"lm_head", 50280, 768}};
  for (const Projection& sh : shapes) {
    const int N = sh.n, K = sh.k, Mmax = 64;
    const Operands ops(rng, Mmax, N, K);
    float *Y, *Y1, *P;
    CHECK(cudaMalloc(&Y, size_t(Mmax) * N * 4));
    CHECK(cudaMalloc(&Y1, size_t(N) * 4));
    CHECK(cudaMalloc(&P, size_t(6) * Mmax * N * 4));
    for (int M : {1, 8, 16, 32, 64}) {
      const std::vector<double> ref = reference_product(ops.hx, ops.hw, M, N, K);
      int next = 0;
      const float t_blas = have_blas ? blas_tn_us(blas, stream, ops, Y, M, N, K, next, 20) : 0.0f;
      const float t_lib = graph_us(
          stream, [&] { CHECK(mambatrt_linear::launch(ops.x, ops.weight(next++), nullptr, Y, M, N, K, stream)); }, 20);
      CHECK(mambatrt_linear::launch(ops.x, ops.w, nullptr, Y, M, N, K, stream));
      const double e_lib = rel_error(ref, Y);
      std::printf("%-9s M %3d N %5d K %4d | cuBLAS %7.2f | MambaLinear %7.2f |", sh.name, M, N, K, t_blas, t_lib);
      std::string errors = "err " + std::to_string(e_lib).substr(0, 8), same;
      for (bool piped : {false, true}) {
        double e_first = 0, e_best = 0;
        float best = 1e30f;
        std::printf(piped ? " | piped" : " first");
        for (int ks : {1, 2, 3, 4, 6}) {
          if (K % (ks * kBlockK) != 0) {
            std::printf("       -");
            continue;
          }
          auto run = [&] { CHECK(launch(piped, ops.x, ops.weight(next++), Y, P, M, N, K, ks, stream)); };
          const float t = graph_us(stream, run, 20);
          CHECK(launch(piped, ops.x, ops.w, Y, P, M, N, K, ks, stream));
          const double e = rel_error(ref, Y);
          if (ks == 1) e_first = e;
          if (t < best) best = t, e_best = e;
          std::printf(" %7.2f", t);
        }
        char text[64];
        std::snprintf(text, sizeof(text), " / %.1e %.1e", e_first, e_best);
        errors += text;
        CHECK(launch(piped, ops.x, ops.w, Y, P, M, N, K, 1, stream));
        CHECK(launch(piped, ops.x + size_t(M - 1) * K, ops.w, Y1, P, 1, N, K, 1, stream));
        same += same_last_row(Y, Y1, M, N) ? " same" : " DIFFERENT";
      }
      std::printf(" | %s |%s\n", errors.c_str(), same.c_str());
      std::fflush(stdout);
    }
    cudaFree(Y), cudaFree(Y1), cudaFree(P);
  }
  CHECK(cudaGetLastError());
  return 0;
}
