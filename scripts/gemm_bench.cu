// The fp32 GEMMs of a mamba-130m-shaped decode step and prefill chunk through cuBLAS as onnxruntime's MatMul calls
// it (cublasSgemm, default math: no TF32) against every algorithm cuBLASLt's heuristic offers for the same shape,
// each also with split-K where the algorithm supports it: whether a MatMul op of mambatrt's own with a tuned
// cuBLASLt algorithm would pay. Weights [N, K] row-major (torch's [out, in]), inputs [M, K], outputs [M, N], as the
// decode graph's "tn" kernels show. Build and run on a GPU machine (h200_session.sh gemmbench):
//   nvcc -O3 -std=c++17 -arch=sm_90 -I CUBLAS_INCLUDE -o /tmp/gemm_bench scripts/gemm_bench.cu -L CUBLAS_LIB -lcublasLt -lcublas
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench_common.cuh"

struct Shape {
  const char* name;
  int m, n, k;
};

double max_diff(const float* a, const float* b, size_t n) {
  std::vector<float> x(n), y(n);
  cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost);
  double d = 0;
  for (size_t i = 0; i < n; ++i) d = std::fmax(d, std::fabs(double(x[i]) - y[i]));
  return d;
}

int main() {
  const std::vector<Shape> shapes = {
      {"in_proj", 1, 3072, 768},     {"x_proj", 1, 80, 1536},     {"out_proj", 1, 768, 1536},
      {"in_proj", 8, 3072, 768},     {"x_proj", 8, 80, 1536},     {"out_proj", 8, 768, 1536},
      {"in_proj", 64, 3072, 768},    {"x_proj", 64, 80, 1536},    {"out_proj", 64, 768, 1536},
      {"lm_head", 64, 50280, 768},   {"in_proj", 128, 3072, 768}, {"x_proj", 128, 80, 1536},
      {"out_proj", 128, 768, 1536},  {"in_proj", 1024, 3072, 768}, {"x_proj", 1024, 80, 1536},
      {"out_proj", 1024, 768, 1536},
  };
  cublasHandle_t blas;
  cublasLtHandle_t lt;
  CHECK(cublasCreate(&blas));
  CHECK(cublasLtCreate(&lt));
  const size_t workspace_bytes = size_t(32) << 20;
  void* workspace = nullptr;
  CHECK(cudaMalloc(&workspace, workspace_bytes));
  std::mt19937 gen(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::printf("fp32 GEMM, us per call: cublasSgemm (onnxruntime's call) | best cuBLASLt algorithm (of those tried)\n");
  for (const Shape& s : shapes) {
    const size_t na = size_t(s.n) * s.k, nb = size_t(s.m) * s.k, nc = size_t(s.m) * s.n;
    std::vector<float> host(na + nb);
    for (float& x : host) x = normal(gen) * 0.05f;
    float *A, *B, *C0, *C1;
    CHECK(cudaMalloc(&A, na * 4));
    CHECK(cudaMalloc(&B, nb * 4));
    CHECK(cudaMalloc(&C0, nc * 4));
    CHECK(cudaMalloc(&C1, nc * 4));
    CHECK(cudaMemcpy(A, host.data(), na * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(B, host.data() + na, nb * 4, cudaMemcpyHostToDevice));
    const float alpha = 1.0f, beta = 0.0f;
    // column-major view: C^T [N, M] = A^T [N, K] (A stored K x N, transposed) . B^T [K, M]
    auto sgemm = [&] {
      cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, s.n, s.m, s.k, &alpha, A, s.k, B, s.k, &beta, C0, s.n);
    };
    const int reps = s.n > 10000 ? 50 : 300;
    const float base = time_us(sgemm, reps, 5);
    cublasLtMatmulDesc_t op;
    CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    cublasLtMatrixLayout_t la, lb, lc;
    CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, s.k, s.n, s.k));
    CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, s.k, s.m, s.k));
    CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, s.n, s.m, s.n));
    cublasLtMatmulPreference_t pref;
    CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                               sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t found[32];
    int count = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 32, found, &count));
    float best = 1e30f;
    int best_i = -1, best_split = 1, tried = 0;
    double best_diff = 0;
    for (int i = 0; i < count; ++i) {
      for (int split : {1, 2, 4, 8, 16, 32}) {
        cublasLtMatmulAlgo_t algo = found[i].algo;
        if (split > 1) {
          int supported = 0;
          size_t written = 0;
          cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &supported, sizeof(supported),
                                            &written);
          if (!supported) break;
          const uint32_t k_split = uint32_t(split);
          if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k_split,
                                                   sizeof(k_split)) != CUBLAS_STATUS_SUCCESS)
            break;
        }
        cublasLtMatmulHeuristicResult_t check;
        if (cublasLtMatmulAlgoCheck(lt, op, la, lb, lc, lc, &algo, &check) != CUBLAS_STATUS_SUCCESS) continue;
        if (check.workspaceSize > workspace_bytes) continue;
        auto run = [&] {
          cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, C1, lc, C1, lc, &algo, workspace, workspace_bytes,
                         nullptr);
        };
        if (cudaGetLastError() != cudaSuccess) continue;
        const float us = time_us(run, reps, 5);
        ++tried;
        if (cudaGetLastError() != cudaSuccess) continue;
        if (us < best) {
          best = us, best_i = i, best_split = split;
          best_diff = max_diff(C0, C1, nc);
        }
      }
    }
    const double gflop = 2.0 * s.m * s.n * s.k / 1e9;
    std::printf("%-8s M %4d N %5d K %4d: %8.2f | %8.2f us (%5.1f | %5.1f TFLOP/s), heuristic #%d split-K %d of %d "
                "tried, max |diff| %.2g\n",
                s.name, s.m, s.n, s.k, base, best, gflop / base * 1e3, gflop / best * 1e3, best_i,
                best_split, tried, best_diff);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C0);
    cudaFree(C1);
  }
  return 0;
}
