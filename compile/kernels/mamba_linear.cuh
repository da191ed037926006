// MambaLinear's CUDA kernel: Y [M, N] = X [M, K] W [N, K]^T (+ bias [N]) in fp32, for the skinny products of a
// decode step and a prefill chunk (M = the batch or the chunk's rows, N x K a projection's weight as torch stores it).
//
// Why: cuBLAS runs these fp32 products (TF32 off) as SIMT kernels with small tiles at M <= 64, ~15 TFLOP/s on an
// H200, and they are most of a batched decode step's time. This kernel runs them on the tensor cores with fp32
// accuracy: each operand is split into two TF32 parts, a = hi + lo (hi = a rounded to TF32's 10-bit mantissa, lo =
// the remainder), and a.b = hi.hi + (hi.lo + lo.hi) (the lo.lo term is below fp32's rounding), the large and the
// small terms in two fp32 accumulators ("3xTF32", as CUTLASS's fast fp32 GEMMs do; two chains of dependent MMAs,
// each half as long). Error against double: the order of fp32 SIMT's.
//
// Mapping: the product is computed as D = W X^T with mma.sync m16n8k8 (A = 16 rows of W, B = 8 rows of X, K major in
// both). A warp holds R 16-row tiles of W and NT 8-row tiles of X. Within each 32-column block of K, lane (g, t)
// (g = lane / 4, t = lane % 4) loads columns 8t .. 8t+7 of its rows as two float4s and feeds them to the 4 MMA k-steps
// as columns (t, t+4) of step s = physical columns 8t+2s, 8t+2s+1: a permutation of K that A and B share, so the sums
// are the same and every load is a coalesced float4. Warps split K WK ways in a block and add their parts through
// shared memory in a fixed order; nothing splits K across blocks (no workspace, one launch).
//
// A row's result depends on W, that row of X and (K, WK) only: not on M, NT, R or WN. So a sequence's projection
// gives the same bits alone and in any batch, and configs may differ with M (choose) while WK follows the
// weight's shape alone. (Products that launch() hands to CUTLASS or to the cluster kernel, from 16 and 32 rows on,
// sum K in another order: there a row's bits differ from the same row alone by fp32 rounding.)
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common.cuh"
#ifdef MAMBATRT_WITH_CUTLASS
#include "mamba_linear_cutlass.cuh"
#endif

namespace mambatrt_linear {

// how one launch covers the product: NT x 8 rows of X and R x 16 rows of W per warp, WN x WK warps per block
struct Config {
  int nt, r, wn, wk;
};

// x = hi + lo: hi = x rounded to TF32 (the bits: add half a TF32 ulp, clear the 13 low bits; two integer ops where
// cvt.rna.tf32 runs on the slow conversion pipe, which made it the kernel's bottleneck), lo = x - hi exactly, left
// for the tensor core to truncate to TF32 (it reads the 19 high bits of a .tf32 operand): |error| <= 2^-21 |x|
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// d += A (16 x 8, a0..a3 as the PTX fragment) . B (8 x 8, b0, b1)
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A's fragments (16 rows of W) of a lane's 32-column block, split: rows g (lo8) and g + 8 (hi8) as the lane loaded
// them (columns 8t .. 8t+7); k-step s takes columns 2s and 2s + 1 as the MMA's columns t and t + 4 (see Mapping)
__device__ __forceinline__ void split_a(const float (&lo8)[8], const float (&hi8)[8], uint32_t (&ah)[4][4],
                                        uint32_t (&al)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    split(lo8[2 * s], ah[s][0], al[s][0]);
    split(hi8[2 * s], ah[s][1], al[s][1]);
    split(lo8[2 * s + 1], ah[s][2], al[s][2]);
    split(hi8[2 * s + 1], ah[s][3], al[s][3]);
  }
}

// One k-step of the 3xTF32 product: small += hi.lo + lo.hi, acc += hi.hi (B's columns t, t + 4: bh0, bh1 / bl0, bl1)
__device__ __forceinline__ void mma3(float (&acc)[4], float (&small)[4], const uint32_t (&ah)[4],
                                     const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma(small, al, bh0, bh1);
  mma(small, ah, bl0, bl1);
  mma(acc, ah, bh0, bh1);
}

// Whether X's and W's rows can be read as float4s (K % 4 == 0, 16-byte aligned bases): the kernels' VEC
inline bool float4_rows(const float* X, const float* W, int K) {
  return K % 4 == 0 && (reinterpret_cast<uintptr_t>(X) | reinterpret_cast<uintptr_t>(W)) % 16 == 0;
}

// v = row[k .. k+7], zeros past K; VEC: row and k 16-byte aligned (K % 4 == 0, aligned base)
template <bool VEC>
__device__ __forceinline__ void load8(const float* __restrict__ row, int k, int K, float (&v)[8]) {
  if (VEC && k + 8 <= K) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(row + k));
    const float4 b = __ldg(reinterpret_cast<const float4*>(row + k + 4));
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = k + i < K ? __ldg(row + k + i) : 0.0f;
  }
}

// acc[r][j] += the product of W's rows wrow[r] (two 8-row halves of a 16-row tile) and X's rows xrow[j] (an 8-row
// tile) over K columns [k_begin, k_end): the warp's part of D (fragment layout), the small terms summed at the end
template <int NT, int R, bool VEC>
__device__ __forceinline__ void accumulate(const float* const (&wrow)[R][2], const float* const (&xrow)[NT],
                                           int k_begin, int k_end, int K, int t, float (&acc)[R][NT][4]) {
  float small[R][NT][4] = {};  // hi.lo + lo.hi (acc: hi.hi)
  // one tile each way (decode at small batches: W's bytes from memory are the cost) keeps four blocks' loads in
  // flight; larger tiles two (registers)
  constexpr int kUnroll = NT * R == 1 ? 4 : 2;
#pragma unroll kUnroll
  for (int kb = k_begin; kb < k_end; kb += 32) {  // the same trip count in every lane (mma.sync wants them all)
    const int k = kb + 8 * t;
    uint32_t ah[R][4][4], al[R][4][4];  // [tile][k-step][fragment register]
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float lo_rows[8], hi_rows[8];  // rows g and g + 8 of the tile
      load8<VEC>(wrow[r][0], k, K, lo_rows);
      load8<VEC>(wrow[r][1], k, K, hi_rows);
      split_a(lo_rows, hi_rows, ah[r], al[r]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      float xv[8];
      load8<VEC>(xrow[j], k, K, xv);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t bh0, bl0, bh1, bl1;
        split(xv[2 * s], bh0, bl0);
        split(xv[2 * s + 1], bh1, bl1);
#pragma unroll
        for (int r = 0; r < R; ++r) mma3(acc[r][j], small[r][j], ah[r][s], al[r][s], bh0, bh1, bl0, bl1);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] += small[r][j][q];
}

// grid (ceil(N / (16 R WN)), ceil(M / (8 NT))), block 32 WN WK; kw = K columns per warp (a multiple of 32);
// dynamic shared memory: (WK - 1) WN R NT 4 32 floats
template <int NT, int R, int WN, int WK, bool VEC>
__global__ void __launch_bounds__(32 * WN * WK)
    linear_tf32x3(const float* __restrict__ X, const float* __restrict__ W, const float* __restrict__ bias,
                  float* __restrict__ Y, int M, int N, int K, int kw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // TF32 MMAs need sm_80; launch() runs linear_fp32 there
#else
  extern __shared__ float red[];  // [WK - 1][WN][R][NT][4][32]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wn = warp % WN, wk = warp / WN;
  const int g = lane >> 2, t = lane & 3;
  const int nbase = (blockIdx.x * WN + wn) * 16 * R, mbase = blockIdx.y * 8 * NT;
  // rows past N or M read a valid row (the last) and are never written
  const float* wrow[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) wrow[r][h] = W + size_t(min(nbase + 16 * r + 8 * h + g, N - 1)) * K;
  const float* xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xrow[j] = X + size_t(min(mbase + 8 * j + g, M - 1)) * K;
  float acc[R][NT][4] = {};
  accumulate<NT, R, VEC>(wrow, xrow, wk * kw, min(K, (wk + 1) * kw), K, t, acc);
  if constexpr (WK > 1) {
    constexpr int kTile = R * NT * 4 * 32;
    if (wk > 0) {
      float* mine = red + ((wk - 1) * WN + wn) * kTile;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) mine[((r * NT + j) * 4 + q) * 32 + lane] = acc[r][j][q];
    }
    __syncthreads();
    if (wk > 0) return;
    for (int p = 1; p < WK; ++p) {  // in order: a sum's bits do not depend on timing
      const float* part = red + ((p - 1) * WN + wn) * kTile;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[r][j][q] += part[((r * NT + j) * 4 + q) * 32 + lane];
    }
  }
  // fragment D: (row g, cols 2t, 2t+1) and (row g + 8, the same cols); D's rows are W's, its cols X's
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n_lo = nbase + 16 * r + g, n_hi = n_lo + 8;
    const float b_lo = bias != nullptr && n_lo < N ? bias[n_lo] : 0.0f;
    const float b_hi = bias != nullptr && n_hi < N ? bias[n_hi] : 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = mbase + 8 * j + 2 * t + c;
        if (m >= M) continue;
        if (n_lo < N) Y[size_t(m) * N + n_lo] = acc[r][j][c] + b_lo;
        if (n_hi < N) Y[size_t(m) * N + n_hi] = acc[r][j][2 + c] + b_hi;
      }
    }
  }
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The cluster's sum of its S blocks' parts of one output tile, each in its block's shared memory `part` ([WN][NT][4]
// [32], fragment D's layout) once the cluster syncs: block `rank` sums the rank-th slice over the ranks in rank
// order (a sum's bits do not depend on timing) and writes it (+ bias) to Y; no block leaves while another reads it
template <int NT, int WN, int S>
__device__ __forceinline__ void cluster_sum(float* part, int rank, int ntile, int mbase, const float* __restrict__ bias,
                                            float* __restrict__ Y, int M, int N) {
  constexpr int kTile = WN * NT * 4 * 32, kSlice = kTile / S;
  static_assert(kTile % S == 0, "S must divide the tile");
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every block's part is in its shared memory
  for (int i = rank * kSlice + int(threadIdx.x); i < (rank + 1) * kSlice; i += blockDim.x) {
    float parts[S];
#pragma unroll
    for (int r = 0; r < S; ++r) parts[r] = cluster.map_shared_rank(part, r)[i];
    float v = parts[0];
#pragma unroll
    for (int r = 1; r < S; ++r) v += parts[r];  // in rank order
    // i = ((w * NT + j) * 4 + q) * 32 + l, fragment D's layout: W's row g (+8 for q >= 2), X's row 2t + (q & 1)
    const int l = i & 31, q = (i >> 5) & 3, j = (i >> 7) % NT, w = (i >> 7) / NT;
    const int n = (ntile * WN + w) * 16 + (l >> 2) + 8 * (q >> 1), m = mbase + 8 * j + 2 * (l & 3) + (q & 1);
    if (n < N && m < M) Y[size_t(m) * N + n] = v + (bias != nullptr ? bias[n] : 0.0f);
  }
  cluster.sync();  // no block leaves while another reads its shared memory
}
#endif

// The product with K split over the S blocks of a thread-block cluster (sm_90) besides the WK warps of a block, for
// products whose few output tiles leave most SMs idle (a decode batch's out_proj: 48 tiles of 16 rows at
// mamba-130m). A warp takes NT x 8 rows of X against 16 rows of W (accumulate), WN warps of a block share X's
// columns, the parts are summed in the block (shared memory, WK in order) and then across the cluster: block q
// reads the q-th slice of every block's tile through distributed shared memory, ranks in order. A row's sum follows
// (K, WK, S) alone.
// grid (S ceil(N / (16 WN)), ceil(M / (8 NT))), cluster (S, 1, 1), block 32 WN WK; kw = K columns per warp (a
// multiple of 32) of the S WK splits; dynamic shared memory: WK WN NT 4 32 floats
template <int NT, int WN, int WK, int S, bool VEC>
__global__ void __launch_bounds__(32 * WN * WK)
    linear_cluster(const float* __restrict__ X, const float* __restrict__ W, const float* __restrict__ bias,
                   float* __restrict__ Y, int M, int N, int K, int kw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float red[];  // [WK][WN][NT][4][32]: the warps' parts, then (in [0]) the block's
  constexpr int kWarpTile = NT * 4 * 32, kTile = WN * kWarpTile;
  const int rank = int(cooperative_groups::this_cluster().block_rank());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wn = warp % WN, wk = warp / WN;
  const int g = lane >> 2, t = lane & 3;
  const int ntile = blockIdx.x / S;  // the block's 16 WN rows of W
  const int nbase = (ntile * WN + wn) * 16, mbase = blockIdx.y * 8 * NT;
  const float* wrow[1][2] = {{W + size_t(min(nbase + g, N - 1)) * K, W + size_t(min(nbase + 8 + g, N - 1)) * K}};
  const float* xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xrow[j] = X + size_t(min(mbase + 8 * j + g, M - 1)) * K;
  float acc[1][NT][4] = {};
  const int split = rank * WK + wk;
  accumulate<NT, 1, VEC>(wrow, xrow, min(K, split * kw), min(K, (split + 1) * kw), K, t, acc);
  float* mine = red + (wk * WN + wn) * kWarpTile;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) mine[(j * 4 + q) * 32 + lane] = acc[0][j][q];
  __syncthreads();
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) {  // the block's part: its warps' in order
    float v = red[i];
#pragma unroll
    for (int p = 1; p < WK; ++p) v += red[p * kTile + i];
    red[i] = v;
  }
  cluster_sum<NT, WN, S>(red, rank, ntile, mbase, bias, Y, M, N);
#else
  __trap();  // clusters need sm_90
#endif
}

// The product for a decode batch of up to 128 rows (64 a block) on sm_90: X's 64 rows of a block staged once in
// shared memory, already split into their TF32 parts, and K split over the S blocks of a cluster, summed through
// distributed shared memory. MambaLinear runs it for out_proj-like weights at 65-128 rows (staged_wins), where the
// cluster kernel's blocks of 8 rows of X read X again for every 32 rows of W.
//
// Why this shape: at 64 rows the other paths leave the tensor cores mostly idle. The own kernel's warps reload X
// from L2 for every 16 rows of W, its NT 8 configs run a warp's loads and MMAs in series (in_proj 21.5 us), and
// CUTLASS's 32 x 64 tiles make 96 blocks of 4 warps for in_proj (10.1 us). Here a block's WN warps each
// take 16 rows of W against all 64 rows of X: W is read from memory once (a warp's next 32 columns loaded while it
// multiplies the current ones), X's slice once per block from L2, split once per block (not once per warp). It did
// not beat CUTLASS on in_proj or the LM head at any config (12.1 us for in_proj at 64 rows: each block's stage, first
// loads, MMAs and cluster sum in series bound it; docs/benchmarks.md).
//
// A row's sum follows (K, S, KC) alone, not M: the same bits alone and in any batch through this kernel (a batch's
// rows differ from the same rows alone, which run another kernel, by fp32 rounding, as on CUTLASS).
// grid (S ceil(N / (16 WN)), ceil(M / 64)), cluster (S, 1, 1) when S > 1, block 32 WN; kb = K columns per rank (a
// multiple of 32; K a multiple of 32, X and W 16-byte aligned: staged_fits); dynamic shared memory:
// staged_shared_bytes<WN, KC>()
template <int WN, int S, int KC>
__global__ void __launch_bounds__(32 * WN)
    linear_staged(const float* __restrict__ X, const float* __restrict__ W, float* __restrict__ Y, int M, int N, int K,
                  int kb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int NT = 8, kRows = 8 * NT, kStride = KC + 4;  // a row's stride 16 bytes past 128: no bank conflicts
  constexpr int kQuads = KC / 4, kStage = (kRows * kQuads + 32 * WN - 1) / (32 * WN);  // float4s a thread stages
  static_assert(KC % 32 == 0 && kStage <= 16, "KC: whole 32-column blocks, at most 16 float4s staged per thread");
  extern __shared__ __align__(16) float staged[];
  uint32_t* const xhi = reinterpret_cast<uint32_t*>(staged);  // [kRows][kStride]: X's hi parts, then its lo parts
  uint32_t* const xlo = xhi + kRows * kStride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  int rank = 0;
  if constexpr (S > 1) rank = int(cooperative_groups::this_cluster().block_rank());
  const int ntile = blockIdx.x / S;
  const int nbase = (ntile * WN + warp) * 16, mbase = blockIdx.y * kRows;
  // rows past N read a valid row (the last) and are never written; rows past M are staged as zeros
  const float* const w0 = W + size_t(min(nbase + g, N - 1)) * K;
  const float* const w1 = W + size_t(min(nbase + 8 + g, N - 1)) * K;
  const int k_begin = min(K, rank * kb), k_end = min(K, k_begin + kb);
  float acc[NT][4] = {}, small[NT][4] = {};  // hi.hi; hi.lo + lo.hi
  float4 wv[4];                              // lane's columns of W's rows g and g + 8 in the next 32-column block
  auto load_w = [&](int k) {
    wv[0] = __ldg(reinterpret_cast<const float4*>(w0 + k)), wv[1] = __ldg(reinterpret_cast<const float4*>(w0 + k + 4));
    wv[2] = __ldg(reinterpret_cast<const float4*>(w1 + k)), wv[3] = __ldg(reinterpret_cast<const float4*>(w1 + k + 4));
  };
  if (k_begin < k_end) load_w(k_begin + 8 * t);
  for (int kc = k_begin; kc < k_end; kc += KC) {
    const int width = min(KC, k_end - kc);  // a multiple of 32
    float4 xv[kStage];
#pragma unroll
    for (int i = 0; i < kStage; ++i) {  // every load in flight before the first store
      const int e = threadIdx.x + i * 32 * WN, r = e / kQuads, c = 4 * (e - r * kQuads);
      xv[i] = r < kRows && c < width && mbase + r < M
                  ? __ldg(reinterpret_cast<const float4*>(X + size_t(mbase + r) * K + kc + c))
                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();  // the last chunk's MMAs have read their X
#pragma unroll
    for (int i = 0; i < kStage; ++i) {
      const int e = threadIdx.x + i * 32 * WN, r = e / kQuads, c = 4 * (e - r * kQuads);
      if (r >= kRows) continue;
      uint4 h, l;
      split(xv[i].x, h.x, l.x), split(xv[i].y, h.y, l.y), split(xv[i].z, h.z, l.z), split(xv[i].w, h.w, l.w);
      *reinterpret_cast<uint4*>(xhi + r * kStride + c) = h;
      *reinterpret_cast<uint4*>(xlo + r * kStride + c) = l;
    }
    __syncthreads();
    for (int kk = 0; kk < width; kk += 32) {
      // W's fragments as accumulate() makes them
      const float r0[8] = {wv[0].x, wv[0].y, wv[0].z, wv[0].w, wv[1].x, wv[1].y, wv[1].z, wv[1].w};
      const float r1[8] = {wv[2].x, wv[2].y, wv[2].z, wv[2].w, wv[3].x, wv[3].y, wv[3].z, wv[3].w};
      uint32_t ah[4][4], al[4][4];
      split_a(r0, r1, ah, al);
      if (kc + kk + 32 < k_end) load_w(kc + kk + 32 + 8 * t);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint32_t* const ph = xhi + (8 * j + g) * kStride + kk + 8 * t;
        const uint32_t* const pl = xlo + (8 * j + g) * kStride + kk + 8 * t;
        const uint4 h0 = *reinterpret_cast<const uint4*>(ph), h1 = *reinterpret_cast<const uint4*>(ph + 4);
        const uint4 l0 = *reinterpret_cast<const uint4*>(pl), l1 = *reinterpret_cast<const uint4*>(pl + 4);
        const uint32_t bh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        const uint32_t bl[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
#pragma unroll
        for (int s = 0; s < 4; ++s)
          mma3(acc[j], small[j], ah[s], al[s], bh[2 * s], bh[2 * s + 1], bl[2 * s], bl[2 * s + 1]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[j][q] += small[j][q];
  if constexpr (S == 1) {
    // fragment D: (W's row g, X's rows 2t, 2t + 1) and (W's row g + 8, the same rows of X)
    const int n_lo = nbase + g, n_hi = n_lo + 8;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = mbase + 8 * j + 2 * t + c;
        if (m >= M) continue;
        if (n_lo < N) Y[size_t(m) * N + n_lo] = acc[j][c];
        if (n_hi < N) Y[size_t(m) * N + n_hi] = acc[j][2 + c];
      }
  } else {
    constexpr int kWarpTile = NT * 4 * 32;
    __syncthreads();  // every warp is done with the staged X: the parts take its memory
    float* const mine = staged + warp * kWarpTile;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) mine[(j * 4 + q) * 32 + lane] = acc[j][q];
    cluster_sum<NT, WN, S>(staged, rank, ntile, mbase, nullptr, Y, M, N);
  }
#else
  __trap();  // clusters and the staged path need sm_90
#endif
}

// Before sm_80 (no TF32 MMA): one thread per output, a plain fp32 dot product in K order
__global__ void linear_fp32(const float* __restrict__ X, const float* __restrict__ W, const float* __restrict__ bias,
                            float* __restrict__ Y, int M, int N, int K) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  float s = 0.0f;
  for (int k = 0; k < K; ++k) s = fmaf(X[size_t(m) * K + k], W[size_t(n) * K + k], s);
  Y[size_t(m) * N + n] = s + (bias != nullptr ? bias[n] : 0.0f);
}

inline int columns_per_warp(int K, int wk) { return (((K + 31) / 32 + wk - 1) / wk) * 32; }

inline size_t shared_bytes(const Config& c) { return size_t(c.wk - 1) * c.wn * c.r * c.nt * 4 * 32 * sizeof(float); }

template <int NT, int R, int WN, int WK>
cudaError_t launch_config(const float* X, const float* W, const float* bias, float* Y, int M, int N, int K,
                          cudaStream_t stream) {
  const dim3 grid((N + 16 * R * WN - 1) / (16 * R * WN), (M + 8 * NT - 1) / (8 * NT));
  const size_t smem = shared_bytes({NT, R, WN, WK});
  const int kw = columns_per_warp(K, WK);
  const bool vec = float4_rows(X, W, K);
  if (vec)
    linear_tf32x3<NT, R, WN, WK, true><<<grid, 32 * WN * WK, smem, stream>>>(X, W, bias, Y, M, N, K, kw);
  else
    linear_tf32x3<NT, R, WN, WK, false><<<grid, 32 * WN * WK, smem, stream>>>(X, W, bias, Y, M, N, K, kw);
  return cudaGetLastError();
}

// A launch's configuration with blocks in clusters of S along x (none for S 1), for cudaLaunchKernelEx; it points
// into itself, so it is used where it was made
struct ClusterLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute cluster = {};
  ClusterLaunch(dim3 grid, int threads, size_t smem, cudaStream_t stream, int S) {
    config.gridDim = grid;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = S;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = S > 1 ? 1 : 0;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// the cluster kernel's dynamic shared memory: every warp's part of the block's tile
template <int NT, int WN, int WK>
constexpr size_t cluster_shared_bytes() {
  return size_t(WK) * WN * NT * 4 * 32 * sizeof(float);
}

template <int NT, int WN, int WK, int S>
cudaError_t launch_cluster(const float* X, const float* W, const float* bias, float* Y, int M, int N, int K,
                           cudaStream_t stream) {
  const ClusterLaunch launch(dim3(S * ((N + 16 * WN - 1) / (16 * WN)), (M + 8 * NT - 1) / (8 * NT)),
                             32 * WN * WK, cluster_shared_bytes<NT, WN, WK>(), stream, S);
  const int kw = columns_per_warp(K, WK * S);
  const bool vec = float4_rows(X, W, K);
  if (vec) return cudaLaunchKernelEx(&launch.config, linear_cluster<NT, WN, WK, S, true>, X, W, bias, Y, M, N, K, kw);
  return cudaLaunchKernelEx(&launch.config, linear_cluster<NT, WN, WK, S, false>, X, W, bias, Y, M, N, K, kw);
}

// linear_staged's dynamic shared memory: X's 64 rows of a chunk as hi and lo parts, later the block's parts
template <int WN, int KC>
constexpr size_t staged_shared_bytes() {
  const size_t x = size_t(2) * 64 * (KC + 4) * sizeof(uint32_t), parts = size_t(WN) * 8 * 4 * 32 * sizeof(float);
  return x > parts ? x : parts;
}

// Whether linear_staged can run the product: K in whole 32-column blocks, X and W 16-byte aligned
inline bool staged_fits(const float* X, const float* W, int K) { return K % 32 == 0 && float4_rows(X, W, K); }

// Raise linear_staged<WN, S, KC>'s shared-memory limit where it needs more than 48 KiB (once; outside captures)
template <int WN, int S, int KC>
cudaError_t staged_prepare() {
  static const cudaError_t raised = [] {
    constexpr int smem = int(staged_shared_bytes<WN, KC>());
    return smem <= (48 << 10) ? cudaSuccess
                              : cudaFuncSetAttribute(linear_staged<WN, S, KC>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }();
  return raised;
}

template <int WN, int S, int KC>
cudaError_t launch_staged(const float* X, const float* W, float* Y, int M, int N, int K, cudaStream_t stream) {
  if (const cudaError_t err = staged_prepare<WN, S, KC>(); err != cudaSuccess) return err;
  const ClusterLaunch launch(dim3(S * ((N + 16 * WN - 1) / (16 * WN)), (M + 63) / 64), 32 * WN,
                             staged_shared_bytes<WN, KC>(), stream, S);
  return cudaLaunchKernelEx(&launch.config, linear_staged<WN, S, KC>, X, W, Y, M, N, K, columns_per_warp(K, S));
}

// The config MambaLinear launches (every config timed on an H200 at mamba-130m's and the default model's
// projections, M 1..1024; docs/benchmarks.md): WK from the weight's shape alone (~768 warps over the
// N / 16 tiles, at least a 32-column block per warp), so that a row's bits do not depend on the batch. Only weights
// of 128 tiles or more (mamba-130m's in_proj) gain from more rows per warp above M 16 (NT 2, R 2: X is reloaded for
// every 16 rows of W); the narrower ones run fastest with one tile each way and more blocks along M.
inline Config choose(int M, int N, int K) {
  const int tiles = (N + 15) / 16;
  int cap = N <= 0 ? 1 : (768 * 16) / N;
  cap = cap < 16 ? cap : 16;
  cap = cap < (K + 31) / 32 ? cap : (K + 31) / 32;
  int wk = 1;
  while (wk * 2 <= cap) wk *= 2;
  const bool wide = tiles >= 128 && M > 16;
  return {wide ? 2 : 1, wide ? 2 : 1, 1, wk};
}

template <int NT, int R>
cudaError_t launch_wk(int wk, const float* X, const float* W, const float* bias, float* Y, int M, int N, int K,
                      cudaStream_t stream) {
  switch (wk) {
    case 1:
      return launch_config<NT, R, 1, 1>(X, W, bias, Y, M, N, K, stream);
    case 2:
      return launch_config<NT, R, 1, 2>(X, W, bias, Y, M, N, K, stream);
    case 4:
      return launch_config<NT, R, 1, 4>(X, W, bias, Y, M, N, K, stream);
    case 8:
      return launch_config<NT, R, 1, 8>(X, W, bias, Y, M, N, K, stream);
    default:
      return launch_config<NT, R, 1, 16>(X, W, bias, Y, M, N, K, stream);
  }
}

// Whether the cluster kernel (launch_cluster<1, 2, 4, 2>) runs this product: on sm_90 and newer, 32 to 128 rows of a
// weight of 32 to 48 tiles of 16 rows and K >= 1024, mamba-130m's out_proj: 8.55 against 10.83 us for the own
// kernel at 64 rows, 15.97 against CUTLASS's 17.04 at 128 (docs/benchmarks.md).
// Elsewhere it measured slower (in_proj, many tiles: 13.4 against CUTLASS's 10.2 at 64 rows; mamba-370m's out_proj,
// 64 tiles: 18.3 at 64 rows against cuBLAS's 16.4; short K; x_proj's 5 tiles at 128 rows) or the same
// (x_proj at 64). From 16 rows on a row's bits already depend on the batch (CUTLASS); below 32 the own kernel keeps
// them equal to the row alone.
inline bool cluster_wins(int M, int N, int K) { return M >= 32 && M <= 128 && N >= 512 && N <= 768 && K >= 1024; }

// Whether the staged kernel (launch_staged<8, 8, 128>) runs this product: on sm_90 and newer, 65 to 128 rows of the
// cluster kernel's shapes (mamba-130m's out_proj: 11.8 and 12.0 against 15.8 and 16.4 us at 96 and 128 rows; at 64
// rows the cluster kernel's 8.9 against 10.9; docs/benchmarks.md). It is
// slower than CUTLASS everywhere else it was timed: in_proj at 32-128 rows (12.1 against 10.1 at 64) and the LM head.
// Its sums follow K alone, as the cluster kernel's, in another order than a row alone.
inline bool staged_wins(int M, int N, int K) { return M > 64 && cluster_wins(M, N, K); }

// What launch() needs set up outside CUDA graph captures (CUTLASS's and the staged kernel's shared-memory limits),
// once per process; call where nothing is being captured (a kernel's creation)
inline cudaError_t prepare() {
  const int major = mambatrt::device_attribute(cudaDevAttrComputeCapabilityMajor);
#ifdef MAMBATRT_WITH_CUTLASS
  if (major >= 8) {
    if (const cudaError_t err = mambatrt_cutlass::prepare(); err != cudaSuccess) return err;
  }
#endif
  return major >= 9 ? staged_prepare<8, 8, 128>() : cudaSuccess;
}

// Y = X W^T (+ bias) on `stream`: with choose()'s config, or the staged or cluster kernel or a CUTLASS GEMM where
// those win (staged_wins, cluster_wins; many rows, without bias, built with CUTLASS: mamba_linear_cutlass.cuh);
// sm_80 and newer, linear_fp32 before
inline cudaError_t launch(const float* X, const float* W, const float* bias, float* Y, int M, int N, int K,
                          cudaStream_t stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  static const int major = mambatrt::device_attribute(cudaDevAttrComputeCapabilityMajor);
  if (major < 8) {
    linear_fp32<<<dim3((N + 127) / 128, M), 128, 0, stream>>>(X, W, bias, Y, M, N, K);
    return cudaGetLastError();
  }
  if (major >= 9 && bias == nullptr && staged_wins(M, N, K) && staged_fits(X, W, K))
    return launch_staged<8, 8, 128>(X, W, Y, M, N, K, stream);
  if (major >= 9 && cluster_wins(M, N, K)) return launch_cluster<1, 2, 4, 2>(X, W, bias, Y, M, N, K, stream);
#ifdef MAMBATRT_WITH_CUTLASS
  if (bias == nullptr && mambatrt_cutlass::wins(M, N, K) && mambatrt_cutlass::aligned(X, W, Y, N, K))
    return mambatrt_cutlass::launch(X, W, Y, M, N, K, stream);
#endif
  const Config c = choose(M, N, K);
  return c.nt == 1 ? launch_wk<1, 1>(c.wk, X, W, bias, Y, M, N, K, stream)
                   : launch_wk<2, 2>(c.wk, X, W, bias, Y, M, N, K, stream);
}

}  // namespace mambatrt_linear
