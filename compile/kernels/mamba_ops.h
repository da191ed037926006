// Shapes of mambatrt's custom ops (domain "mambatrt") and the kernels that compute them: one CPU implementation
// (cpu_kernels.cc, cpu_scan.cc, cpu_linear.cc) and one CUDA implementation (*_cuda.cu) of each; ort_ops.cc hands them onnxruntime's
// tensors, c_api.cc answers ctypes.
//
// Letters: B sequences, T rows per sequence, E inner width, N state size, K conv width, R time-step rank,
// W width of the in_proj output row (2E: x then z), X width of the x_proj output row (R + 2N: dt, B, C).
//
// MambaConv(xz [B, T, W], weight [E, K], bias [E], past [B, E, K-1]) -> y [B, T, E], present [B, E, K-1]
//   y = silu(depthwise causal conv over the K-1 past columns and the x half of xz); present = the last K-1 inputs.
// MambaScan(u [B, T, E], xdbl [B, T, X], dt_weight [E, R], dt_bias [E], A [E, N], D [E], xz [B, T, W],
//           past [B, E, N]) -> y [B, T, E], present [B, E, N]
//   dt = softplus(xdbl[.., :R] @ dt_weight^T + dt_bias); h = exp(dt A) h + dt u B; y = (C . h + D u) * silu(z).
// Both also take a decode step's rows as [B, C] (T = 1; y then [B, E]) and a layer's state as a Split of the stacked
// states gives it, [B, 1, E, ..] (present then the same shape): same memory layout, no Squeeze nodes around them.
// MambaConv16 and MambaScan16: the same with xz (and MambaScan16's y) in float16, as an fp16 bundle's in/out
// projections produce and take them, so the graph needs no Cast around the ops; everything else stays float32.
// MambaLinear(x [R, K], weight [N, K]) -> y [R, N] = x weight^T, fp32: the kernels graphs' in/x/out projections in
//   the copies a bundle keeps for the CUDA and CPU providers (kernels-cuda, kernels-cpu graphs); its CUDA kernel runs
//   the products on the tensor cores at fp32 accuracy (mamba_linear.cuh), its CPU kernels (cpu_linear.cc) stream the
//   weight packed in strips on AVX-512 CPUs, or as it is stored row by row on AVX2 CPUs.
// The CPU's forms with 16-bit and 8-bit weights (the kernels graphs' CPU copies of fp16, bf16 and int8 bundles):
//   MambaLinear16(x float16, weight float16) -> y float16; MambaLinearBF16(x, weight bfloat16) -> y;
//   MambaLinear8(x, weight int8, scale [N]) -> y = x (weight * scale[:, None])^T. Each computes in fp32.
// MambaAddNorm16(x [R, D] float16, residual [R, D], weight [D], eps [1]) -> normed [R, D] float16, sum [R, D]
//   sum = x + residual (the float32 residual stream); normed = sum / sqrt(mean(sum^2) + eps) * weight: an fp16
//   bundle's out_proj output joins the stream and the next in_proj's input leaves it without a Cast either way.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mambatrt {

// Where the CPU kernels run a launch's tasks: `parallel` runs fn(data, i) for every i in [0, n) and returns when all
// have, on the session's intra-op threads (onnxruntime's KernelContext_ParallelFor, with `pool`); null: in turn on
// the calling thread.
struct CpuThreads {
  void (*parallel)(void* pool, void (*fn)(void*, size_t), size_t n, void* data) = nullptr;
  void* pool = nullptr;
};

struct ConvArgs {
  const void* xz;  // float, or float16 when `half`
  const float* weight;
  const float* bias;
  const float* past;
  float* y;
  float* present;
  int64_t batch, rows, inner, kernel, xz_width;
  bool half;
  const float* weight_t = nullptr;  // [K, E]: weight transposed, for the CPU kernel (the CUDA kernel reads weight)
  CpuThreads threads;  // for the CPU kernel's tasks (sequences, blocks of channels)
};

struct ScanArgs {
  const float* u;
  const float* xdbl;
  const float* dt_weight;
  const float* dt_bias;
  const float* a;
  const float* d;
  const void* xz;  // float, or float16 when `half`
  const float* past;
  void* y;  // float, or float16 when `half`
  float* present;
  int64_t batch, rows, inner, state, rank, xdbl_width, xz_width;
  bool half;
  const float* dt_weight_t = nullptr;  // [R, E]: dt_weight transposed, for the CPU kernel (CUDA reads dt_weight)
  CpuThreads threads;  // for the CPU kernel's tasks (blocks of channels, sequences)
};

struct NormArgs {
  const void* x;  // float16
  const float* residual;
  const float* weight;
  const float* eps;  // one value, where the op's inputs are (device memory under the CUDA provider)
  void* normed;      // float16
  float* sum;
  int64_t rows, width;
};

// How MambaLinear's weight is stored: float32, float16, bfloat16, or int8 with a float32 scale per output (the
// weight of output n is its int8 row times scale[n])
enum class WeightType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };

struct LinearArgs {
  const void* x;       // [R, K]: float, or float16 when `half`
  const void* weight;  // [N, K] as weight_type says (CUDA: float)
  void* y;             // [R, N]: as x
  int64_t rows, out, in;
  void** state = nullptr;  // the node's: what linear_cuda keeps from one run to the next (linear_release frees it)
  WeightType weight_type = WeightType::kF32;
  bool half = false;            // x and y float16
  const float* scale = nullptr;  // [N]: the int8 weight's scales
  const void* weight_packed = nullptr;  // the CPU kernels' strips of the weight (linear_cpu_packs, linear_cpu_rows)
  CpuThreads threads;  // for the CPU kernels' tasks (strips, blocks of outputs)
};

constexpr int64_t kMaxConvWidth = 8;  // K: the CUDA kernel keeps the window in registers
constexpr int64_t kMaxState = 32;     // N: one warp lane per state element

void conv_cpu(const ConvArgs& a);
void scan_cpu(const ScanArgs& a);
void add_norm_cpu(const NormArgs& a);
void linear_cpu(const LinearArgs& a);
// Whether linear_cpu runs the packed AVX-512 kernel (the CPU has AVX-512, cap_cpu_isa does not cap it), which the
// runtime takes for float32 weights over onnxruntime's Gemms: it wants LinearArgs::weight_packed, the weight as
// 16-column strips [ceil(N / 16)][K][16], 64-byte aligned.
bool linear_cpu_packs();
// Whether linear_cpu runs a strip kernel (the packed AVX-512 one, else the AVX2 one) for every weight type: the CPU
// has AVX2, FMA and F16C, cap_cpu_isa does not cap below it. It too wants LinearArgs::weight_packed, strips
// [ceil(N / 16)][K][16] of the weight's own type, 64-byte aligned (the same strips for both kernels).
bool linear_cpu_rows();
// Caps the CPU kernels' build at `isa` ("sse2", "avx2"; "avx512": no cap), for tests; false for an unknown name
bool cap_cpu_isa(const char* isa);
// The CPU kernels' build that runs: "sse2", "avx2" or "avx512" on x86-64, else "portable"
const char* cpu_isa();
// CUDA launches on `stream` (a cudaStream_t); return an error message or nullptr.
const char* conv_cuda(const ConvArgs& a, void* stream);
const char* scan_cuda(const ScanArgs& a, void* stream);
const char* add_norm_cuda(const NormArgs& a, void* stream);
const char* linear_cuda(const LinearArgs& a, void* stream);
void linear_release(void* state);  // a node's LinearArgs::state, at the node's end
int64_t linear_split_products();    // products run as cuBLAS TF32 GEMMs on split operands since the library loaded
const char* linear_prepare();  // once per process, outside CUDA graph captures (CUTLASS's shared-memory limits)
const char* scan_prepare();    // likewise (the chunk kernel's shared-memory limit, the dt products' GEMMs')
// A new non-blocking stream (cudaStreamNonBlocking: it runs beside other streams and the legacy default stream's
// copies), or nullptr. ``urgent``: the device's highest stream priority (its blocks are scheduled before those of
// streams of normal priority).
void* create_stream(bool urgent);
// A new non-blocking stream whose kernels run on ``sms`` of the device's SMs only (rounded up to the partition
// granularity, 8 on Hopper; *granted says how many): a green context's stream (CUDA 12.4+ driver), so that
// long launches on it leave the other SMs to streams of the whole device. nullptr with *why set when the driver or
// device cannot.
void* create_stream_on_sms(bool urgent, int sms, int* granted, const char** why);
// One token per row of logits [rows, stride] (the first `vocab` columns) on `stream`, as the host's sample_token
// picks it for a row with a temperature alone: params (host) holds each row's (temperature, uniform draw in [0, 1))
// as two doubles, picks (host) gets the tokens; an error message or nullptr. Synchronizes the stream. Threads may
// call it at once on different streams (each stream has its own device buffers).
const char* sample_cuda(const float* logits, int64_t rows, int64_t stride, int64_t vocab, const double* params,
                        int64_t* picks, void* stream);
// Why the CUDA kernels cannot run on the current device (no code for its architecture, no device), or nullptr.
const char* cuda_check();
// The stream the last kernel ran on (ort_ops.cc): nullptr on the CPU provider, 1 before any kernel ran.
void* last_stream();

}  // namespace mambatrt
