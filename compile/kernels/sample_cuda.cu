// The sampler on the GPU (shapes and contract in mamba_ops.h: sample_cuda): one token per row of a launch's logits.
#include <algorithm>
#include <mutex>
#include <vector>

#include <cuda_runtime.h>

#include "mamba_ops.h"

namespace mambatrt {

// One token per row of logits [rows, stride] (its first `vocab` columns), as the host's sample_token picks it for a
// row with temperature alone (runtime/engine/sampling.py): temperature 0, the first index of the largest logit; else, in
// float64, p = exp(x / T - max(x / T)), cdf = its running sum in index order, and the first index whose cdf exceeds
// u x cdf[vocab - 1] (the last index when rounding leaves none). A thread sums a contiguous run of indices, so the
// running sum adds in index order, grouped by runs (the host's inverse_cdf groups by blocks of 64): the pick can
// differ from the host's only where u x total falls within rounding (~1e-16 relative) of a boundary. Why on the
// device: a host pick needs the row's logits copied over and a pass of numpy over the vocabulary per row, which at
// 64 rows of a 50k vocabulary took ten times the decode launch (docs/benchmarks.md).
constexpr int kSampleThreads = 512;

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* logits, int64_t stride, int64_t vocab, const double* params, int64_t* out) {
  __shared__ double scratch[kSampleThreads / 32];
  __shared__ double prefix[kSampleThreads];
  __shared__ int64_t found[kSampleThreads / 32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * stride;
  const double t = params[2 * row], u = params[2 * row + 1];
  const int64_t per = (vocab + kSampleThreads - 1) / kSampleThreads;
  const int64_t begin = min(vocab, int64_t(threadIdx.x) * per), end = min(vocab, begin + per);
  int64_t pick = vocab;  // this thread's candidate; the smallest over the block wins
  if (t == 0.0) {
    float best = -INFINITY;
    for (int64_t i = begin; i < end; ++i) {
      if (pick == vocab || x[i] > best) best = x[i], pick = i;
    }
    // the largest value, the smallest index among equals: warp by warp, then across warps through shared memory
    for (int o = 16; o > 0; o >>= 1) {
      const float b = __shfl_xor_sync(0xffffffffu, best, o);
      const int64_t p = __shfl_xor_sync(0xffffffffu, pick, o);
      if (p != vocab && (pick == vocab || b > best || (b == best && p < pick))) best = b, pick = p;
    }
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = best, found[threadIdx.x >> 5] = pick;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kSampleThreads / 32; ++w) {
        const double b = scratch[w];
        const int64_t p = found[w];
        if (p != vocab && (pick == vocab || b > best || (b == best && p < pick))) best = b, pick = p;
      }
      out[row] = pick == vocab ? 0 : pick;
    }
    return;
  }
  double m = -INFINITY;
  for (int64_t i = begin; i < end; ++i) m = fmax(m, double(x[i]) / t);
  for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  for (int w = 0; w < kSampleThreads / 32; ++w) m = fmax(m, scratch[w]);
  double sum = 0.0;
  for (int64_t i = begin; i < end; ++i) sum += exp(double(x[i]) / t - m);
  prefix[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {  // the runs' sums in index order (512 adds: a few microseconds, once per row)
    double run = 0.0;
    for (int k = 0; k < kSampleThreads; ++k) {
      const double s = prefix[k];
      prefix[k] = run;
      run += s;
    }
    scratch[0] = run;
  }
  __syncthreads();
  const double target = u * scratch[0];
  double c = prefix[threadIdx.x];
  for (int64_t i = begin; i < end; ++i) {
    c += exp(double(x[i]) / t - m);
    if (c > target) {
      pick = i;
      break;
    }
  }
  for (int o = 16; o > 0; o >>= 1) pick = min(pick, __shfl_xor_sync(0xffffffffu, pick, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) found[threadIdx.x >> 5] = pick;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kSampleThreads / 32; ++w) pick = min(pick, found[w]);
    out[row] = min(pick, vocab - 1);
  }
}

// Device buffers for sample_cuda's draws and picks, one per stream, grown as needed: the engine's decode thread
// (first tokens onward) and its prefill thread (a prompt's first token) sample on streams of their own at once.
struct SampleScratch {
  void* stream;
  void* buffer;
  int64_t capacity;
};

const char* sample_cuda(const float* logits, int64_t rows, int64_t stride, int64_t vocab, const double* params,
                        int64_t* picks, void* stream) {
  static std::mutex lock;
  static std::vector<SampleScratch> scratches;
  void* scratch = nullptr;
  int64_t capacity = 0;
  {
    std::lock_guard<std::mutex> guard(lock);
    const auto same = [&](const SampleScratch& e) { return e.stream == stream; };
    auto it = std::find_if(scratches.begin(), scratches.end(), same);
    if (it == scratches.end()) it = scratches.insert(scratches.end(), SampleScratch{stream, nullptr, 0});
    if (rows > it->capacity) {
      if (it->buffer != nullptr) cudaFree(it->buffer);
      it->capacity = rows < 256 ? 256 : rows;
      if (cudaMalloc(&it->buffer, it->capacity * (2 * sizeof(double) + sizeof(int64_t))) != cudaSuccess) {
        it->buffer = nullptr, it->capacity = 0;
        return "cudaMalloc failed";
      }
    }
    scratch = it->buffer, capacity = it->capacity;
  }
  double* d_params = static_cast<double*>(scratch);
  int64_t* d_out = reinterpret_cast<int64_t*>(d_params + 2 * capacity);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemcpyAsync(d_params, params, rows * 2 * sizeof(double), cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) {
    sample_kernel<<<unsigned(rows), kSampleThreads, 0, s>>>(logits, stride, vocab, d_params, d_out);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpyAsync(picks, d_out, rows * sizeof(int64_t), cudaMemcpyDeviceToHost, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace mambatrt
