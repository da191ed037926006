// What the CUDA files of the library share: an attribute query of the current device, whether a stream is capturing,
// and the device functions of the conv and scan kernels (silu, one-instruction exponentials, softplus, loads and
// stores of float or float16).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mambatrt {

// An attribute of the current device (0 where the query fails); callers keep it in a static, once per process
inline int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&value, attribute, device);
  return value;
}

// Whether `stream` is capturing a CUDA graph (or cannot say): no allocation may happen then, as the captured graph
// would keep the address of memory made outside it
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone;
}

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = 2^(x log2(e))

// 2^x in one MUFU.EX2 (relative error ~2^-22; expf's accurate reduction is 9 instructions, and the scan of a chunk
// is bound by issuing instructions, as ncu shows)
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// silu with ex2 and a fast division: the chunk kernel's (its y differs from silu's by a few ulp)
__device__ __forceinline__ float silu_ex2(float x) { return __fdividef(x, 1.0f + ex2(-x * kLog2e)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// xz and MambaScan's y: float, or float16 for the ...16 ops
template <bool Half>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  if constexpr (Half) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
template <bool Half>
__device__ __forceinline__ void store(void* p, int64_t i, float v) {
  if constexpr (Half) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

}  // namespace
}  // namespace mambatrt
