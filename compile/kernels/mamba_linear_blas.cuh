// MambaLinear's products of many rows (a prefill launch's projections) as two of cuBLAS's TF32 GEMMs over operands
// split into TF32 parts beforehand, at fp32 accuracy.
//
// Why: from a few hundred rows on, the projections are bound by the tensor cores' rate, and CUTLASS's fast-fp32
// GEMMs (mamba_linear_cutlass.cuh) run on sm_80's MMAs, which on Hopper reach about half of the warpgroup MMAs'
// TF32 rate. cuBLAS's TF32 GEMMs run the warpgroup MMAs, but one TF32 product keeps 11 bits of each operand (error
// ~3e-4, not fp32's). Split beforehand, a = hi + lo with hi a TF32 value (mamba_linear.cuh's split), the product is
// 3xTF32's, a.b = hi.hi + (hi.lo + lo.hi), as two stock GEMMs:
//   Y  = [X_hi | X_lo] [W_lo | W_hi]^T   (K x 2: the small terms)
//   Y += X_hi W_hi^T                      (the large one, through the same buffers with leading dimension 2K)
// hi is exact in TF32 whichever way the GEMM converts its inputs; lo loses its bits past TF32 (<= 2^-21 |a|), as in
// the in-kernel split. Error against double at mamba-130m's shapes 2.1e-6 (in_proj) and 4.1e-6 (out_proj) of the
// largest output, against 4e-7 on CUTLASS: the warpgroup MMAs' kernels sum less exactly (the same GEMMs below 64
// rows, on other kernels, 1.2e-7 to 6e-7), still fp32's order where TF32's one product is 3e-4. At 1024 rows an
// H200 took 61.3 us for mamba-130m's in_proj against CUTLASS's 74.0, and 37.3 against 42.8 for out_proj
// (docs/benchmarks.md).
//
// Costs: [W_lo | W_hi] is made once per weight (twice W's memory, on the device, for the session's life), X's split
// by a kernel into a buffer of the stream's (M x 2K floats). Neither can be made inside a CUDA graph capture
// (cudaMalloc), so a product runs here only where its buffers were made by an earlier call outside a capture with
// as many rows or more (a captured prefill launch first runs plainly: runtime/runners/ort/cuda_staging.py); otherwise the caller
// runs another kernel. A stream's X buffers are never freed (a captured graph keeps their addresses), nor its
// cuBLAS handle. One X buffer per stream: a stream's products are queued by one thread at a time (onnxruntime runs a
// session's nodes in turn on its stream; mambatrt runs a session from one thread), so a product's split and GEMMs
// follow each other on the stream and the next product's split comes after them. cuBLAS is opened at run time by its
// soname (onnxruntime's CUDA provider has loaded it already): no link-time dependency.
#pragma once
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <vector>

#include "mamba_linear.cuh"

namespace mambatrt_blas {

// the cuBLAS entry points used, and the enum values they take (cublas_api.h, library_types.h)
using Handle = void*;
using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, cudaStream_t);
using SetWorkspaceFn = int (*)(Handle, void*, size_t);
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
constexpr int kOpN = 0, kOpT = 1;
constexpr int kReal32 = 0;                            // CUDA_R_32F
constexpr int kComputeFastTF32 = 77;                  // CUBLAS_COMPUTE_32F_FAST_TF32
constexpr int kGemmDefault = -1;                      // CUBLAS_GEMM_DEFAULT
constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

struct Api {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  GemmExFn gemm = nullptr;
  bool ok = false;
};

inline const Api& api() {
  static const Api opened = [] {
    Api a;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) continue;
      a.create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
      a.set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
      a.set_workspace = reinterpret_cast<SetWorkspaceFn>(dlsym(lib, "cublasSetWorkspace_v2"));
      a.gemm = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
      a.ok = a.create && a.set_stream && a.set_workspace && a.gemm;
      if (a.ok) break;
    }
    return a;
  }();
  return opened;
}

// Whether a product of this shape runs here: on sm_90 and newer (the warpgroup MMAs), from 512 rows (in_proj 37.2
// against CUTLASS's 40.6 us at 512 and 61.3 against 74.0 at 1024, out_proj 26.0 against 29.7 and 37.3 against 42.8;
// at 256 rows slower: 24.0 against 23.0 and 23.3 against 17.2, the split and the second launch costing more than the
// MMAs save), for weights of 512 rows or more (x_proj's 80: 22.9 against 15.3 us at 1024), with 16-byte aligned
// rows (on an H200, docs/benchmarks.md); MambaLinear has no bias
inline bool wins(const float* X, const float* W, const float* Y, int M, int N, int K) {
  static const int major = mambatrt::device_attribute(cudaDevAttrComputeCapabilityMajor);
  const auto bits = reinterpret_cast<uintptr_t>(X) | reinterpret_cast<uintptr_t>(W) | reinterpret_cast<uintptr_t>(Y);
  return major >= 9 && M >= 512 && N >= 512 && K % 4 == 0 && N % 4 == 0 && bits % 16 == 0;
}

// rows [R, K] -> out [R, 2K]: [hi | lo] (lo_first false) or [lo | hi] of each row, float4 at a time (K % 4 == 0)
__global__ void split_rows(const float4* __restrict__ in, float4* __restrict__ out, int64_t rows, int k4,
                           bool lo_first) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * k4) return;
  const int64_t r = i / k4, c = i % k4;
  const float4 v = in[i];
  uint32_t h[4], l[4];
  mambatrt_linear::split(v.x, h[0], l[0]);
  mambatrt_linear::split(v.y, h[1], l[1]);
  mambatrt_linear::split(v.z, h[2], l[2]);
  mambatrt_linear::split(v.w, h[3], l[3]);
  const float4 hi = make_float4(__uint_as_float(h[0]), __uint_as_float(h[1]), __uint_as_float(h[2]),
                                __uint_as_float(h[3]));
  const float4 lo = make_float4(__uint_as_float(l[0]), __uint_as_float(l[1]), __uint_as_float(l[2]),
                                __uint_as_float(l[3]));
  out[r * 2 * k4 + c] = lo_first ? lo : hi;
  out[r * 2 * k4 + k4 + c] = lo_first ? hi : lo;
}

inline cudaError_t split(const float* in, float* out, int64_t rows, int K, bool lo_first, cudaStream_t stream) {
  const int64_t n = rows * (K / 4);
  split_rows<<<unsigned((n + 255) / 256), 256, 0, stream>>>(reinterpret_cast<const float4*>(in),
                                                            reinterpret_cast<float4*>(out), rows, K / 4, lo_first);
  return cudaGetLastError();
}

// A stream's cuBLAS handle (bound to it, with a workspace of its own, so that no call allocates inside a capture)
// and its buffer for X's split; every buffer it ever had is kept (see the header's comment)
struct StreamState {
  Handle handle = nullptr;
  float* x2 = nullptr;
  size_t x2_floats = 0;
  std::vector<void*> kept;
};

// The stream's state with an X buffer of `floats` or more, or nullptr (cuBLAS missing, a capture that would need a
// new buffer, an allocation or cuBLAS call that failed)
inline StreamState* stream_state(cudaStream_t stream, size_t floats) {
  static std::mutex mutex;
  static std::map<cudaStream_t, StreamState> states;
  std::lock_guard<std::mutex> lock(mutex);
  StreamState& s = states[stream];
  if (s.handle != nullptr && s.x2_floats >= floats) return &s;
  if (mambatrt::capturing(stream)) return nullptr;
  if (s.handle == nullptr) {
    void* workspace = nullptr;
    Handle h = nullptr;
    if (cudaMalloc(&workspace, kWorkspaceBytes) != cudaSuccess) {
      cudaGetLastError();  // cleared: the caller's kernel runs instead
      return nullptr;
    }
    if (api().create(&h) != 0 || api().set_stream(h, stream) != 0 ||
        api().set_workspace(h, workspace, kWorkspaceBytes) != 0) {
      cudaFree(workspace);
      return nullptr;
    }
    s.handle = h;
    s.kept.push_back(workspace);
  }
  if (s.x2_floats < floats) {  // at least twice the last: the kept buffers add up to less than twice the largest
    floats = std::max(floats, 2 * s.x2_floats);
    void* x2 = nullptr;
    if (cudaMalloc(&x2, floats * sizeof(float)) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    s.kept.push_back(x2);
    s.x2 = static_cast<float*>(x2), s.x2_floats = floats;
  }
  return &s;
}

// One weight's [W_lo | W_hi] [N, 2K], made from W on the first call outside a capture (a node's: the weight is an
// initializer, whose address names its contents for the session's life)
struct Weights {
  const float* from = nullptr;
  float* w2 = nullptr;
  Weights() = default;
  Weights(const Weights&) = delete;
  Weights& operator=(const Weights&) = delete;
  ~Weights() {
    if (w2 != nullptr) cudaFree(w2);
  }
  bool ready(const float* W, int N, int K, cudaStream_t stream) {
    if (from == W) return true;
    if (mambatrt::capturing(stream)) return false;
    if (w2 != nullptr) cudaFree(w2), w2 = nullptr, from = nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, size_t(N) * 2 * K * sizeof(float)) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    w2 = static_cast<float*>(p);
    if (split(W, w2, N, K, true, stream) != cudaSuccess) return false;
    from = W;
    return true;
  }
};

// Y = X W^T through the two GEMMs, when wins() and the buffers are ready (true); false: nothing was queued, the
// caller runs another kernel. *err: a failed launch (true returned with it).
inline bool launch(Weights& weights, const float* X, const float* W, float* Y, int M, int N, int K,
                   cudaStream_t stream, cudaError_t* err) {
  *err = cudaSuccess;
  if (!api().ok) return false;
  StreamState* s = stream_state(stream, size_t(M) * 2 * K);
  if (s == nullptr || !weights.ready(W, N, K, stream)) return false;
  if ((*err = split(X, s->x2, M, K, false, stream)) != cudaSuccess) return true;
  const float one = 1.0f, zero = 0.0f;
  // column-major: Y^T [N, M] = W2 [2K, N]^T . X2 [2K, M], then += W_hi^T . X_hi (leading dimensions 2K); where the
  // first is refused nothing has touched Y, and the caller's kernel computes it
  if (api().gemm(s->handle, kOpT, kOpN, N, M, 2 * K, &one, weights.w2, kReal32, 2 * K, s->x2, kReal32, 2 * K, &zero,
                 Y, kReal32, N, kComputeFastTF32, kGemmDefault) != 0)
    return false;
  if (api().gemm(s->handle, kOpT, kOpN, N, M, K, &one, weights.w2 + K, kReal32, 2 * K, s->x2, kReal32, 2 * K, &one, Y,
                 kReal32, N, kComputeFastTF32, kGemmDefault) != 0)
    *err = cudaErrorUnknown;
  return true;
}

}  // namespace mambatrt_blas
