// MambaLinear's CUDA entry points (shapes in mamba_ops.h): its own kernels (mamba_linear.cuh), CUTLASS's GEMMs where
// the build has them (mamba_linear_cutlass.cuh) and cuBLAS's TF32 GEMMs on split operands (mamba_linear_blas.cuh).
#include <atomic>

#include <cuda_runtime.h>

#include "mamba_linear.cuh"
#include "mamba_linear_blas.cuh"
#include "mamba_ops.h"

namespace mambatrt {

static std::atomic<int64_t> g_split_products{0};
int64_t linear_split_products() { return g_split_products.load(std::memory_order_relaxed); }

// Products of many rows through cuBLAS's TF32 GEMMs on split operands where that wins and its buffers are ready
// (mamba_linear_blas.cuh: the node's split weight kept in a.state), else MambaLinear's own kernels and CUTLASS's
const char* linear_cuda(const LinearArgs& a, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int M = int(a.rows), N = int(a.out), K = int(a.in);
  // float32 throughout: the op's CUDA form takes no other types (ort_ops.cc)
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.weight);
  float* y = static_cast<float*>(a.y);
  cudaError_t err = cudaSuccess;
  if (a.state != nullptr && mambatrt_blas::wins(x, w, y, M, N, K) && mambatrt_blas::api().ok) {
    if (*a.state == nullptr) *a.state = new mambatrt_blas::Weights;
    auto& weights = *static_cast<mambatrt_blas::Weights*>(*a.state);
    if (mambatrt_blas::launch(weights, x, w, y, M, N, K, s, &err)) {
      g_split_products.fetch_add(1, std::memory_order_relaxed);
      return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
    }
  }
  err = mambatrt_linear::launch(x, w, nullptr, y, M, N, K, s);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

void linear_release(void* state) { delete static_cast<mambatrt_blas::Weights*>(state); }

const char* linear_prepare() {
  const cudaError_t err = mambatrt_linear::prepare();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace mambatrt
