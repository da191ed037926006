// CUDA kernels of MambaConv and MambaScan (shapes in mamba_ops.h), launched on onnxruntime's stream so that they
// are ordered with its other kernels and captured into its CUDA graphs.
#include <cuda_runtime.h>

#include "mamba_ops.h"

namespace mambatrt {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// One thread per (sequence, channel): the K-1 window stays in registers while the thread walks the rows.
__global__ void conv_kernel(ConvArgs a) {
  const int64_t b = blockIdx.y, e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= a.inner) return;
  const int64_t K = a.kernel, E = a.inner;
  float w[kMaxConvWidth], win[kMaxConvWidth];
#pragma unroll
  for (int k = 0; k < kMaxConvWidth; ++k) {
    w[k] = k < K ? a.weight[e * K + k] : 0.0f;
    win[k] = k < K - 1 ? a.past[(b * E + e) * (K - 1) + k] : 0.0f;
  }
  const float bias = a.bias[e];
  for (int64_t t = 0; t < a.rows; ++t) {
    const float x = a.xz[(b * a.rows + t) * a.xz_width + e];
    float acc = bias;
#pragma unroll
    for (int k = 0; k < kMaxConvWidth; ++k) {  // taps: the K-1 window, then this row's input
      if (k < K - 1) acc += w[k] * win[k];
      if (k == K - 1) acc += w[k] * x;
    }
    a.y[(b * a.rows + t) * E + e] = silu(acc);
#pragma unroll
    for (int k = 0; k < kMaxConvWidth - 1; ++k) {
      if (k < K - 2) win[k] = win[k + 1];
      if (k == K - 2) win[k] = x;
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxConvWidth - 1; ++k) {
    if (k < K - 1) a.present[(b * E + e) * (K - 1) + k] = win[k];
  }
}

// L lanes per channel (L a power of two >= N): lane n owns state element n; the dt projection is split over the
// lanes and both dot products are summed with shuffles inside the L-lane group.
template <int L>
__global__ void scan_kernel(ScanArgs a) {
  const int64_t b = blockIdx.y;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t e = tid / L;
  const int n = int(tid % L);
  const int64_t E = a.inner, N = a.state, R = a.rank;
  const bool channel = e < E, owner = channel && n < N;
  float h = owner ? a.past[(b * E + e) * N + n] : 0.0f;
  const float A = owner ? a.a[e * N + n] : 0.0f;
  const float dt_bias = channel ? a.dt_bias[e] : 0.0f;
  const float D = channel ? a.d[e] : 0.0f;
  const float* w = a.dt_weight + (channel ? e : 0) * R;
  for (int64_t t = 0; t < a.rows; ++t) {
    const int64_t row = b * a.rows + t;
    const float* x = a.xdbl + row * a.xdbl_width;  // dt [R] | B [N] | C [N]
    float s = 0.0f;
    if (channel) {
      for (int64_t r = n; r < R; r += L) s += x[r] * w[r];
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off, L);
    const float dt = softplus(s + dt_bias);
    const float u = channel ? a.u[row * E + e] : 0.0f;
    float p = 0.0f;
    if (owner) {
      h = expf(dt * A) * h + (dt * u) * x[R + n];
      p = h * x[R + N + n];
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off, L);
    if (channel && n == 0) {
      const float z = a.xz[row * a.xz_width + a.xz_width - E + e];
      a.y[row * E + e] = (p + D * u) * silu(z);
    }
  }
  if (owner) a.present[(b * E + e) * N + n] = h;
}

template <int L>
void launch_scan(const ScanArgs& a, cudaStream_t stream) {
  const int64_t threads = a.inner * L;
  dim3 grid(unsigned((threads + kThreads - 1) / kThreads), unsigned(a.batch));
  scan_kernel<L><<<grid, kThreads, 0, stream>>>(a);
}

}  // namespace

const char* conv_cuda(const ConvArgs& a, void* stream) {
  if (a.batch == 0 || a.rows == 0) return nullptr;
  dim3 grid(unsigned((a.inner + kThreads - 1) / kThreads), unsigned(a.batch));
  conv_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* scan_cuda(const ScanArgs& a, void* stream) {
  if (a.batch == 0 || a.rows == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.state <= 1) {
    launch_scan<1>(a, s);
  } else if (a.state <= 2) {
    launch_scan<2>(a, s);
  } else if (a.state <= 4) {
    launch_scan<4>(a, s);
  } else if (a.state <= 8) {
    launch_scan<8>(a, s);
  } else if (a.state <= 16) {
    launch_scan<16>(a, s);
  } else {
    launch_scan<32>(a, s);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

void* create_stream() {
  cudaStream_t stream = nullptr;
  return cudaStreamCreate(&stream) == cudaSuccess ? stream : nullptr;
}

}  // namespace mambatrt
