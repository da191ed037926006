// What the CUDA files of the library share: an attribute query of the current device, whether a stream is capturing,
// and the device functions of the conv and scan kernels (silu, one-instruction exponentials, softplus, loads and
// stores of float or float16).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

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

// What a stream's buffer (stream_buffer) holds
enum class StreamBuffer { kScan, kSplitK };

// A stream's device buffer of `kind` with `bytes` or more, zeroed when made, or nullptr inside a CUDA graph capture
// that would need a larger one or where the allocation fails (the caller then runs a kernel without it). Grown, to
// twice the last size or more, outside captures only; never freed, as a captured graph keeps its address. One per
// stream and kind: a stream's kernels run one after another, so its launches take the buffer in turn.
inline void* stream_buffer(cudaStream_t stream, StreamBuffer kind, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<cudaStream_t, StreamBuffer>, std::pair<void*, size_t>> buffers;
  std::lock_guard<std::mutex> lock(mutex);
  auto& [buffer, size] = buffers[{stream, kind}];
  if (size >= bytes) return buffer;
  if (capturing(stream)) return nullptr;
  bytes = std::max(bytes, 2 * size);
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError();  // cleared: the caller's launch runs without the buffer
    return nullptr;
  }
  if (cudaMemsetAsync(p, 0, bytes, stream) != cudaSuccess) {
    cudaFree(p);
    cudaGetLastError();
    return nullptr;
  }
  buffer = p, size = bytes;
  return buffer;
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
