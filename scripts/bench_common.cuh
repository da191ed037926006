// What the standalone CUDA benches in scripts/ share: a status check that exits with the failing call, the time of
// one call by CUDA events or in a CUDA graph, the split-K benches' sum of parts, cuBLAS opened at run time, and the
// GEMM benches' products, operands, cuBLAS's product of them and its time, double-precision reference and relative
// error.
#pragma once
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    auto status_ = (x);                                                           \
    if (int(status_) != 0) {                                                      \
      std::printf("%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, int(status_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// us per call of run(): `warmup` calls first, then the mean over `reps` calls between two events
template <typename F>
float time_us(F&& run, int reps, int warmup = 10) {
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (int i = 0; i < warmup; ++i) run();
  cudaEventRecord(t0);
  for (int i = 0; i < reps; ++i) run();
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return ms * 1000.0f / reps;
}

// X [M, K] W [N, K]^T in double, row-major [M, N]
inline std::vector<double> reference_product(const std::vector<float>& x, const std::vector<float>& w, int M, int N,
                                             int K) {
  std::vector<double> ref(size_t(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += double(x[size_t(m) * K + k]) * w[size_t(n) * K + k];
      ref[size_t(m) * N + n] = acc;
    }
  return ref;
}

// max |y - reference| / max |reference| of the ref.size() floats at device address `dev` (after the device's work)
inline double rel_error(const std::vector<double>& ref, const float* dev) {
  std::vector<float> y(ref.size());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(y.data(), dev, y.size() * 4, cudaMemcpyDeviceToHost));
  double worst = 0, scale = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    worst = std::fmax(worst, std::fabs(ref[i] - y[i]));
    scale = std::fmax(scale, std::fabs(ref[i]));
  }
  return worst / scale;
}

// Whether row M - 1 of Y [M, N] equals Y1 [N] (that row computed alone) bit for bit, after the device's work
inline bool same_last_row(const float* Y, const float* Y1, int M, int N) {
  std::vector<float> a(N), b(N);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(a.data(), Y + size_t(M - 1) * N, size_t(N) * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(b.data(), Y1, size_t(N) * 4, cudaMemcpyDeviceToHost));
  return a == b;
}

// GPU us per call: `calls` launches captured in one CUDA graph, replayed (the kernels are shorter than a launch from
// the host, so back-to-back launches would time the host), as onnxruntime's CUDA graphs run them
template <typename F>
float graph_us(cudaStream_t stream, F&& run, int calls) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) run();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 2; ++i) CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0), cudaEventCreate(&t1);
  cudaEventRecord(t0, stream);
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(exec, stream));
  cudaEventRecord(t1, stream);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0), cudaEventDestroy(t1);
  cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
  return ms * 1000.0f / (5 * calls);
}

// Y [count] = the sum of the `parts` slices of part [parts, count], in order (the benches' split-K kernels' second
// kernel: a fixed order of sums)
__global__ void add_parts(const float* __restrict__ part, float* __restrict__ Y, int count, int parts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float sum = part[i];
  for (int q = 1; q < parts; ++q) sum += part[size_t(q) * count + i];
  Y[i] = sum;
}

// the three cuBLAS calls used, by their C ABI
using Create = int (*)(void**);
using SetMath = int (*)(void*, int);
using SetStream = int (*)(void*, cudaStream_t);
using Sgemm = int (*)(void*, int, int, int, int, int, const float*, const float*, int, const float*, int, const float*,
                      float*, int);
struct Blas {
  void* handle = nullptr;
  Sgemm sgemm = nullptr;
  bool open(cudaStream_t stream, int math_mode = 0) {  // 0: CUBLAS_DEFAULT_MATH (no TF32), 3: TF32 tensor ops
    const char* names[] = {std::getenv("CUBLAS_LIB"), "libcublas.so", "libcublas.so.13", "libcublas.so.12"};
    for (const char* name : names) {
      if (name == nullptr) continue;
      void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
      if (lib == nullptr) continue;
      auto create = reinterpret_cast<Create>(dlsym(lib, "cublasCreate_v2"));
      auto math = reinterpret_cast<SetMath>(dlsym(lib, "cublasSetMathMode"));
      sgemm = reinterpret_cast<Sgemm>(dlsym(lib, "cublasSgemm_v2"));
      if (create == nullptr || math == nullptr || sgemm == nullptr || create(&handle) != 0) continue;
      math(handle, math_mode);
      auto set_stream = reinterpret_cast<SetStream>(dlsym(lib, "cublasSetStream_v2"));
      if (set_stream == nullptr || set_stream(handle, stream) != 0) continue;
      std::printf("cuBLAS: %s\n", name);
      return true;
    }
    std::printf("cuBLAS: not found (set CUBLAS_LIB); timing the kernel alone\n");
    return false;
  }
};

// The GEMM benches' products: mamba-130m's projections and LM head, and the default model's ("d.")
struct Projection {
  const char* name;
  int n, k;
};
constexpr Projection kProjections[] = {{"in_proj", 3072, 768},  {"x_proj", 80, 1536},     {"out_proj", 768, 1536},
                                       {"lm_head", 50280, 768}, {"d.in_proj", 768, 192},  {"d.x_proj", 44, 384},
                                       {"d.out_proj", 192, 384}, {"d.lm_head", 4096, 192}};

// A product's operands: random X [rows, K] and W [N, K] on the host, X on the device, and copies of W on the device
// (~160 MiB of them), cycled through by the timed calls so that every call reads its weight from memory as a
// model's step does (a model's weights do not fit in L2; one small weight called again would)
struct Operands {
  std::vector<float> hx, hw;
  float *x = nullptr, *w = nullptr;  // w: `copies` copies of W, one after the other
  int copies = 1;
  Operands(std::mt19937& rng, int rows, int N, int K) : hx(size_t(rows) * K), hw(size_t(N) * K) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : hx) v = normal(rng);
    for (auto& v : hw) v = normal(rng) / std::sqrt(float(K));
    copies = int(std::max<size_t>(1, (size_t(160) << 20) / (hw.size() * 4)));
    CHECK(cudaMalloc(&x, hx.size() * 4));
    CHECK(cudaMalloc(&w, hw.size() * 4 * copies));
    for (int c = 0; c < copies; ++c)
      CHECK(cudaMemcpy(w + hw.size() * c, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  }
  const float* weight(int call) const { return w + hw.size() * (call % copies); }
  ~Operands() { cudaFree(x), cudaFree(w); }
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;
};

// Y [M, N] = X W^T by cuBLAS ("tn", as onnxruntime's Gemm calls it), X the first M rows of ops.x, W [N, K] at w
inline void blas_tn(const Blas& blas, const Operands& ops, const float* w, float* Y, int M, int N, int K) {
  const float one = 1.0f, zero = 0.0f;
  blas.sgemm(blas.handle, 1, 0, N, M, K, &one, w, K, ops.x, K, &zero, Y, N);
}

// GPU us per blas_tn call: `calls` of them in a CUDA graph (graph_us), each on the next copy of W (`next` advances);
// one call first, outside the capture (cuBLAS's first call of a shape may allocate)
inline float blas_tn_us(const Blas& blas, cudaStream_t stream, const Operands& ops, float* Y, int M, int N, int K,
                        int& next, int calls) {
  auto run = [&] { blas_tn(blas, ops, ops.weight(next++), Y, M, N, K); };
  run();
  CHECK(cudaStreamSynchronize(stream));
  return graph_us(stream, run, calls);
}
