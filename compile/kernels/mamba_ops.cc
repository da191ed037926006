// mambatrt's onnxruntime custom-op library: MambaConv, MambaScan, MambaAddNorm16 and MambaLinear (mamba_ops.h), registered for
// the CPU provider and, when built with nvcc, for the CUDA provider. onnxruntime loads it with
// SessionOptions.register_custom_ops_library and calls RegisterCustomOps.
//
// Why: a Mamba layer under onnxruntime's own ops is ~18 kernels per decode step (the dt path, the gate tail,
// splits); these two ops cover everything between the in/x/out projections, so a layer is ~6 kernels and the
// prefill scan walks its rows in registers instead of in a graph. MambaAddNorm16 takes the two Casts per layer out of
// fp16 bundles (at batch 1 they cost what fp16 matrix products save).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "mamba_ops.h"
#include "ort_abi.h"

namespace {

void* g_stream = nullptr;  // the stream of sessions whose provider reports none (see stream_of)
const void* g_api_parallel = nullptr;  // onnxruntime's API table where it has KernelContext_ParallelFor, else null
void* g_last_stream = reinterpret_cast<void*>(1);  // the stream the last kernel ran on (mambatrt_ops_last_stream)

[[noreturn]] void fail(const char* op, const char* what) {
  // KernelCompute of this API version cannot return an error; a shape the graph contract rules out is a bug
  std::fprintf(stderr, "mambatrt custom op %s: %s\n", op, what);
  std::abort();
}

void check(const void* api, OrtStatus* status, const char* op) {
  if (status == nullptr) return;
  const char* message = ort::at<ort::GetErrorMessageFn>(api, ort::kGetErrorMessage)(status);
  fail(op, message);
}

struct Tensor {
  float* data = nullptr;
  std::vector<int64_t> dims;
};

Tensor input(const void* api, OrtKernelContext* ctx, size_t index, const char* op) {
  const OrtValue* value = nullptr;
  check(api, ort::at<ort::KernelContextGetInputFn>(api, ort::kKernelContextGetInput)(ctx, index, &value), op);
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api, ort::at<ort::GetTensorTypeAndShapeFn>(api, ort::kGetTensorTypeAndShape)(value, &info), op);
  size_t n = 0;
  check(api, ort::at<ort::GetDimensionsCountFn>(api, ort::kGetDimensionsCount)(info, &n), op);
  Tensor t;
  t.dims.resize(n);
  check(api, ort::at<ort::GetDimensionsFn>(api, ort::kGetDimensions)(info, t.dims.data(), n), op);
  ort::at<ort::ReleaseTensorTypeAndShapeInfoFn>(api, ort::kReleaseTensorTypeAndShapeInfo)(info);
  void* data = nullptr;
  check(api, ort::at<ort::GetTensorMutableDataFn>(api, ort::kGetTensorMutableData)(const_cast<OrtValue*>(value), &data),
        op);
  t.data = static_cast<float*>(data);
  return t;
}

float* output(const void* api, OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& dims, const char* op) {
  OrtValue* value = nullptr;
  check(api,
        ort::at<ort::KernelContextGetOutputFn>(api, ort::kKernelContextGetOutput)(ctx, index, dims.data(), dims.size(),
                                                                                 &value),
        op);
  void* data = nullptr;
  check(api, ort::at<ort::GetTensorMutableDataFn>(api, ort::kGetTensorMutableData)(value, &data), op);
  return static_cast<float*>(data);
}

// The stream of the session running this kernel: onnxruntime's compute stream for its CUDA provider (the
// user_compute_stream a runtime gave that session), so that each session's kernels are ordered with its own
// onnxruntime kernels and land in its CUDA graphs, and two sessions on two streams run side by side (prefill beside
// decode). nullptr for the CPU provider.
void* stream_of(const void* api, OrtKernelContext* ctx, const char* op) {
  void* stream = nullptr;
  check(api,
        ort::at<ort::KernelContextGetGPUComputeStreamFn>(api, ort::kKernelContextGetGPUComputeStream)(ctx, &stream),
        op);
  g_last_stream = stream;
  return stream != nullptr ? stream : g_stream;
}

void expect(bool ok, const char* op, const char* what) {
  if (!ok) fail(op, what);
}

enum class Kind { kConv, kScan, kNorm, kLinear };

struct OpDef : MambatrtCustomOp {
  const char* name;
  const char* provider;  // nullptr: the CPU provider
  Kind kind;
  bool half;  // the ...16 variant: xz (and MambaScan16's y) in float16
  size_t inputs, outputs;
};

constexpr size_t kXzInput[] = {0, 6, 0, 0};  // the float16 input of MambaConv16, MambaScan16, MambaAddNorm16

struct Kernel {
  const void* api;
  const OpDef* def;
  std::mutex mutex;  // onnxruntime may run one session (so this node) from several threads at once
  const float* kept_from = nullptr;  // the weight `kept` was made from
  float* kept = nullptr;             // that weight in the layout a CPU kernel wants (kept_layout; free()d with the node)
  size_t kept_floats = 0;
  void* linear_state = nullptr;  // MambaLinear's on CUDA (its weight split for cuBLAS: linear_cuda)
};

// Weight w in the layout a CPU kernel wants (`floats` floats, written by fill), made on the node's first run and
// kept, 64-byte aligned: the CPU kernels want a weight's channels innermost (vectorized over E), or MambaLinear's in
// strips, where the ops take it channels outermost, as torch stores it and the CUDA kernels read it. Transposing on
// every run cost more than a decode step's use of it (E 1536, R 48); kept per node (one weight each), it is made
// once. A weight here is an initializer of mambatrt's graphs, whose memory onnxruntime keeps for the session, so its
// address names its contents.
template <typename Fill>
const float* kept_layout(Kernel& k, const float* w, size_t floats, Fill fill) {
  std::lock_guard<std::mutex> lock(k.mutex);
  if (k.kept_from != w || k.kept_floats != floats) {
    std::free(k.kept);
    k.kept = nullptr, k.kept_from = nullptr;
    void* p = nullptr;
    if (posix_memalign(&p, 64, floats * sizeof(float)) != 0) fail(k.def->name, "out of memory");
    fill(static_cast<float*>(p));
    k.kept = static_cast<float*>(p), k.kept_from = w, k.kept_floats = floats;
  }
  return k.kept;
}

// w [rows, cols] as [cols, rows]
const float* transposed(Kernel& k, const float* w, int64_t rows, int64_t cols) {
  return kept_layout(k, w, size_t(rows * cols), [&](float* out) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = w[r * cols + c];
  });
}

// MambaLinear's weight w [N, K] as the packed CPU kernel takes it (mamba_ops.h: linear_cpu_packs): 16-column strips
// [ceil(N / 16)][K][16], the last strip's missing columns zero, each step of a strip one cache line.
const float* packed_strips(Kernel& k, const float* w, int64_t n, int64_t kk) {
  const int64_t strips = (n + 15) / 16;
  return kept_layout(k, w, size_t(strips * kk * 16), [&](float* out) {
    for (int64_t s = 0; s < strips; ++s)
      for (int64_t i = 0; i < kk; ++i)
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t col = s * 16 + j;
          out[(s * kk + i) * 16 + j] = col < n ? w[col * kk + i] : 0.0f;
        }
  });
}

// Rows come as [B, T, C], or a decode step's as [B, C] (T = 1); a state as [B, E, S] or as a Split of the stacked
// states gives a layer's, [B, 1, E, S] (mamba_ops.h). These read such a tensor's dims in the [B, T, C] / [B, E, S]
// terms (false: another rank or shape) and give the dims of an output of the same form.
bool row_dims(const Tensor& t, int64_t dims[3]) {
  const size_t r = t.dims.size();
  if (r != 2 && r != 3) return false;
  dims[0] = t.dims[0], dims[1] = r == 3 ? t.dims[1] : 1, dims[2] = t.dims[r - 1];
  return true;
}
bool state_dims(const Tensor& t, int64_t dims[3]) {
  const size_t r = t.dims.size();
  if (r != 3 && (r != 4 || t.dims[1] != 1)) return false;
  dims[0] = t.dims[0], dims[1] = t.dims[r - 2], dims[2] = t.dims[r - 1];
  return true;
}
std::vector<int64_t> like(const Tensor& t, int64_t last) {
  std::vector<int64_t> dims = t.dims;
  dims.back() = last;
  return dims;
}

// CpuThreads on onnxruntime's CPU provider: the session's intra-op thread pool (in turn on the calling thread where
// the session has one thread).
struct OrtPool {
  const void* api;
  OrtKernelContext* ctx;
  const char* op;
};
void ort_parallel(void* pool, void (*fn)(void*, size_t), size_t n, void* data) {
  const OrtPool& p = *static_cast<const OrtPool*>(pool);
  const auto parallel_for = ort::at<ort::KernelContextParallelForFn>(p.api, ort::kKernelContextParallelFor);
  check(p.api, parallel_for(p.ctx, fn, n, 0, data), p.op);
}
// The threads of `pool`'s session where onnxruntime has KernelContext_ParallelFor, else none (`pool` outlives the run)
mambatrt::CpuThreads session_threads(OrtPool& pool) {
  if (pool.api == nullptr) return {};
  return {ort_parallel, &pool};
}

void compute_conv(Kernel& k, OrtKernelContext* ctx) {
  const char* op = k.def->name;
  Tensor xz = input(k.api, ctx, 0, op), w = input(k.api, ctx, 1, op), b = input(k.api, ctx, 2, op),
         past = input(k.api, ctx, 3, op);
  int64_t x[3], p[3];
  expect(row_dims(xz, x) && w.dims.size() == 2 && b.dims.size() == 1 && state_dims(past, p), op, "ranks");
  mambatrt::ConvArgs a{xz.data, w.data, b.data, past.data, nullptr, nullptr, x[0], x[1], w.dims[0], w.dims[1], x[2],
                       k.def->half};
  expect(a.kernel >= 2 && a.kernel <= mambatrt::kMaxConvWidth, op, "conv width K must be 2..8");
  expect(a.xz_width >= a.inner && b.dims[0] == a.inner, op, "xz narrower than E, or bias not [E]");
  expect(p[0] == a.batch && p[1] == a.inner && p[2] == a.kernel - 1, op, "past not [B,E,K-1]");
  a.y = output(k.api, ctx, 0, like(xz, a.inner), op);
  a.present = output(k.api, ctx, 1, past.dims, op);
  void* stream = stream_of(k.api, ctx, op);
  if (k.def->provider == nullptr) {
    a.weight_t = transposed(k, a.weight, a.inner, a.kernel);
    OrtPool pool{g_api_parallel, ctx, op};
    a.threads = session_threads(pool);
    mambatrt::conv_cpu(a);
  } else if (const char* err = mambatrt::conv_cuda(a, stream)) {
    fail(op, err);
  }
}

void compute_scan(Kernel& k, OrtKernelContext* ctx) {
  const char* op = k.def->name;
  Tensor t[8];
  for (size_t i = 0; i < 8; ++i) t[i] = input(k.api, ctx, i, op);
  const Tensor &u = t[0], &xdbl = t[1], &dtw = t[2], &dtb = t[3], &A = t[4], &D = t[5], &xz = t[6], &past = t[7];
  int64_t ud[3], xd[3], zd[3], p[3];
  expect(row_dims(u, ud) && row_dims(xdbl, xd) && row_dims(xz, zd) && xdbl.dims.size() == u.dims.size() &&
             xz.dims.size() == u.dims.size() && dtw.dims.size() == 2 && A.dims.size() == 2 && state_dims(past, p),
         op, "ranks");
  mambatrt::ScanArgs a{u.data,  xdbl.data, dtw.data, dtb.data,  A.data,      D.data, xz.data, past.data, nullptr,
                       nullptr, ud[0],     ud[1],    ud[2],     A.dims[1],   dtw.dims[1], xd[2], zd[2], k.def->half};
  expect(a.state >= 1 && a.state <= mambatrt::kMaxState, op, "state size N must be 1..32");
  expect(a.xdbl_width == a.rank + 2 * a.state && dtw.dims[0] == a.inner && A.dims[0] == a.inner, op,
         "xdbl not [B,T,R+2N], dt_weight not [E,R] or A not [E,N]");
  expect(dtb.dims[0] == a.inner && D.dims[0] == a.inner && a.xz_width >= a.inner, op, "dt_bias, D or xz width");
  expect(xd[0] == a.batch && zd[0] == a.batch && xd[1] == a.rows && zd[1] == a.rows, op,
         "xdbl or xz rows differ from u");
  expect(p[0] == a.batch && p[1] == a.inner && p[2] == a.state, op, "past not [B,E,N]");
  a.y = output(k.api, ctx, 0, u.dims, op);
  a.present = output(k.api, ctx, 1, past.dims, op);
  void* stream = stream_of(k.api, ctx, op);
  if (k.def->provider == nullptr) {
    a.dt_weight_t = transposed(k, a.dt_weight, a.inner, a.rank);
    OrtPool pool{g_api_parallel, ctx, op};
    a.threads = session_threads(pool);
    mambatrt::scan_cpu(a);
  } else if (const char* err = mambatrt::scan_cuda(a, stream)) {
    fail(op, err);
  }
}

void compute_norm(const Kernel& k, OrtKernelContext* ctx) {
  const char* op = k.def->name;
  Tensor x = input(k.api, ctx, 0, op), res = input(k.api, ctx, 1, op), w = input(k.api, ctx, 2, op),
         eps = input(k.api, ctx, 3, op);
  expect(x.dims.size() == 2 && res.dims == x.dims && w.dims.size() == 1 && w.dims[0] == x.dims[1], op,
         "x and residual not [R,D] or weight not [D]");
  int64_t eps_size = 1;
  for (int64_t d : eps.dims) eps_size *= d;
  expect(eps_size == 1, op, "eps not one value");
  mambatrt::NormArgs a{x.data, res.data, w.data, eps.data, nullptr, nullptr, x.dims[0], x.dims[1]};
  a.normed = output(k.api, ctx, 0, x.dims, op);
  a.sum = output(k.api, ctx, 1, x.dims, op);
  void* stream = stream_of(k.api, ctx, op);
  if (k.def->provider == nullptr) {
    mambatrt::add_norm_cpu(a);
  } else if (const char* err = mambatrt::add_norm_cuda(a, stream)) {
    fail(op, err);
  }
}

void compute_linear(Kernel& k, OrtKernelContext* ctx) {
  const char* op = k.def->name;
  Tensor x = input(k.api, ctx, 0, op), w = input(k.api, ctx, 1, op);
  expect(x.dims.size() == 2 && w.dims.size() == 2 && x.dims[1] == w.dims[1], op, "x not [R,K] or weight not [N,K]");
  expect(x.dims[0] < (int64_t(1) << 31) && w.dims[0] < (int64_t(1) << 31) && w.dims[1] < (int64_t(1) << 31), op,
         "a dimension past 2^31");
  mambatrt::LinearArgs a{x.data, w.data, nullptr, x.dims[0], w.dims[0], w.dims[1], &k.linear_state};
  a.y = output(k.api, ctx, 0, {x.dims[0], w.dims[0]}, op);
  void* stream = stream_of(k.api, ctx, op);
  if (k.def->provider == nullptr) {
    OrtPool pool{g_api_parallel, ctx, op};
    if (mambatrt::linear_cpu_packs()) {
      a.weight_packed = packed_strips(k, a.weight, a.out, a.in);
      a.threads = session_threads(pool);
    }
    return mambatrt::linear_cpu(a);
  }
  const char* err = nullptr;
  {
    std::lock_guard<std::mutex> lock(k.mutex);  // the node's state (linear_cuda) is made on a run
    err = mambatrt::linear_cuda(a, stream);
  }
  if (err != nullptr) fail(op, err);
}

// -- the OrtCustomOp callbacks ----------------------------------------------------------------------------------
const OpDef& def_of(const MambatrtCustomOp* op) { return *static_cast<const OpDef*>(op); }

void* create_kernel(const MambatrtCustomOp* op, const void* api, const OrtKernelInfo*) {
  Kernel* k = new Kernel;
  k->api = api;
  k->def = &def_of(op);
  // a session's load, never inside a CUDA graph capture; an error here is the launches' error too (they report it)
  if (k->def->kind == Kind::kLinear && k->def->provider != nullptr) mambatrt::linear_prepare();
  if (k->def->kind == Kind::kScan && k->def->provider != nullptr) mambatrt::scan_prepare();
  return k;
}
const char* get_name(const MambatrtCustomOp* op) { return def_of(op).name; }
const char* get_provider(const MambatrtCustomOp* op) { return def_of(op).provider; }
int input_type(const MambatrtCustomOp* op, size_t index) {
  const OpDef& d = def_of(op);
  return d.half && index == kXzInput[int(d.kind)] ? ort::kFloat16 : ort::kFloat;
}
int output_type(const MambatrtCustomOp* op, size_t index) {
  const OpDef& d = def_of(op);
  return d.half && d.kind != Kind::kConv && index == 0 ? ort::kFloat16 : ort::kFloat;
}
size_t input_count(const MambatrtCustomOp* op) { return def_of(op).inputs; }
size_t output_count(const MambatrtCustomOp* op) { return def_of(op).outputs; }
void kernel_compute(void* kernel, OrtKernelContext* ctx) {
  Kernel& k = *static_cast<Kernel*>(kernel);
  switch (k.def->kind) {
    case Kind::kConv:
      return compute_conv(k, ctx);
    case Kind::kScan:
      return compute_scan(k, ctx);
    case Kind::kNorm:
      return compute_norm(k, ctx);
    case Kind::kLinear:
      return compute_linear(k, ctx);
  }
}
void kernel_destroy(void* kernel) {
  Kernel* k = static_cast<Kernel*>(kernel);
  if (k->linear_state != nullptr) mambatrt::linear_release(k->linear_state);
  std::free(k->kept);
  delete k;
}
int required(const MambatrtCustomOp*, size_t) { return 0; }       // INPUT_OUTPUT_REQUIRED
int default_memory(const MambatrtCustomOp*, size_t) { return 0; }  // OrtMemTypeDefault

OpDef make(const char* name, const char* provider, Kind kind, bool half) {
  OpDef d{};
  d.version = ort::kApiVersion;
  d.CreateKernel = create_kernel;
  d.GetName = get_name;
  d.GetExecutionProviderType = get_provider;
  d.GetInputType = input_type;
  d.GetInputTypeCount = input_count;
  d.GetOutputType = output_type;
  d.GetOutputTypeCount = output_count;
  d.KernelCompute = kernel_compute;
  d.KernelDestroy = kernel_destroy;
  d.GetInputCharacteristic = required;
  d.GetOutputCharacteristic = required;
  d.GetInputMemoryType = default_memory;
  d.name = name;
  d.provider = provider;
  d.kind = kind;
  d.half = half;
  d.inputs = kind == Kind::kScan ? 8 : kind == Kind::kLinear ? 2 : 4;
  d.outputs = kind == Kind::kLinear ? 1 : 2;
  return d;
}

const char* const kCuda = "CUDAExecutionProvider";
OpDef g_ops[] = {
    make("MambaConv", nullptr, Kind::kConv, false),  make("MambaScan", nullptr, Kind::kScan, false),
    make("MambaConv16", nullptr, Kind::kConv, true), make("MambaScan16", nullptr, Kind::kScan, true),
    make("MambaAddNorm16", nullptr, Kind::kNorm, true), make("MambaLinear", nullptr, Kind::kLinear, false),
#ifdef MAMBATRT_WITH_CUDA
    make("MambaConv", kCuda, Kind::kConv, false),    make("MambaScan", kCuda, Kind::kScan, false),
    make("MambaConv16", kCuda, Kind::kConv, true),   make("MambaScan16", kCuda, Kind::kScan, true),
    make("MambaAddNorm16", kCuda, Kind::kNorm, true),  make("MambaLinear", kCuda, Kind::kLinear, false),
#endif
};

}  // namespace

// -- CPU kernels ------------------------------------------------------------------------------------------------
// Comparisons may not trap (they never do here): GCC then turns exp_fast's clamp into selects, which vectorize.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
namespace mambatrt {

// exp(x) in plain arithmetic that compilers vectorize (SSE2 and up, no -ffast-math): x = k ln2 + r with k rounded
// to nearest by the 1.5 * 2^23 trick, |r| <= ln2 / 2 in two parts (Cody-Waite), Cephes' degree-6 polynomial for
// e^r, 2^k from the exponent bits: within 1 ulp of the exact e^x over the range below (checked against double exp
// on a dense sample, BENCHMARKS.md session 12). Why: the CPU scan takes one
// exponential per state element and row, and a libm call per element (not vectorized) was most of its time.
// Its constants, shared with its 16-lane form (exp_fast16), which takes the same steps
struct ExpFast {
  static constexpr float lo = -87.0f, hi = 88.0f;  // 2^k stays a normal float; e^-87 ~ 1.6e-38
  static constexpr float magic = 12582912.0f;      // 1.5 * 2^23: adding it rounds to an integer
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;  // ln 2 in two parts
  static constexpr float p[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

static inline float exp_fast(float x) {
  using C = ExpFast;
  x = x < C::lo ? C::lo : (x > C::hi ? C::hi : x);
  const float k = (x * C::log2e + C::magic) - C::magic;
  const float r = (x - k * C::ln2_hi) - k * C::ln2_lo;
  float p = C::p[0];  // the steps written out: as a loop, GCC's AVX2 chunk scan took 4-6 % longer
  p = p * r + C::p[1];
  p = p * r + C::p[2];
  p = p * r + C::p[3];
  p = p * r + C::p[4];
  p = p * r + C::p[5];
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return e * scale;
}

// softplus(x) = max(x, 0) + log1p(e^-|x|) with log1p(q) = 2 atanh(q / (2 + q)) as its odd series (q in (0, 1], so
// s = q / (2 + q) <= 1/3 and the terms past s^17 are below 1e-9 of the sum): accurate in relative terms for small
// q too (within 3e-7 relative of the exact value, sampled as exp_fast), and vectorizable, where libm's log1p per
// channel and row cost as much as the rest of the scan's dt path. torch's threshold: x > 20 gives x.
static inline float softplus_fast(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float q = exp_fast(-ax);
  const float s = q / (2.0f + q), s2 = s * s;
  float p = 1.0f / 17.0f;
  p = p * s2 + 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  const float log1p_q = 2.0f * s * p;
  return x > 20.0f ? x : (x > 0.0f ? x : 0.0f) + log1p_q;
}

static inline float silu_fast(float x) { return x / (1.0f + exp_fast(-x)); }

// The sum of 8 partial sums, in a fixed order (the results do not depend on how a loop was vectorized)
static inline float sum8(const float* part) {
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The CPU kernels' hot loops vectorize (exp_fast, softplus_fast, the scan's channel lanes); on x86-64 with GCC they
// are compiled a second time for AVX2 + FMA (8 lanes instead of SSE2's 4), run where the CPU has both (conv_cpu and
// scan_cpu below choose).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MAMBATRT_AVX2 1
#include <immintrin.h>
#endif

// IEEE float16 <-> float32 (round to nearest even), for the ...16 ops on the CPU
static float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalize
    exp = 127 - 15 + 1;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

static uint16_t float_to_half(float value) {
  uint32_t f;
  std::memcpy(&f, &value, 4);
  const uint32_t sign = (f >> 16) & 0x8000, man = f & 0x7fffff;
  const int32_t biased = int32_t((f >> 23) & 0xff);
  if (biased == 0xff) return uint16_t(sign | 0x7c00 | (man ? 0x200 : 0));  // inf, nan
  const int32_t exp = biased - 127 + 15;
  if (exp >= 31) return uint16_t(sign | 0x7c00);  // overflow: inf
  if (exp <= 0) {                                  // a float16 subnormal, or zero
    if (exp < -10) return uint16_t(sign);
    const uint32_t full = man | 0x800000;
    const int shift = 14 - exp;
    uint32_t half = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | uint32_t(exp << 10) | (man >> 13);
  const uint32_t rest = man & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry rounds up into the exponent
  return uint16_t(half);
}

struct F32 {
  static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static void store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
};
struct F16 {
  static float load(const void* p, int64_t i) { return half_to_float(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, int64_t i, float v) { static_cast<uint16_t*>(p)[i] = float_to_half(v); }
};

// fn(data, i) for i in [0, n): on t's threads where it has them and `spread` (the launch has work enough for them),
// else in turn on the calling thread
static void run_tasks(const CpuThreads& t, void (*fn)(void*, size_t), size_t n, void* data, bool spread = true) {
  if (t.parallel != nullptr && n > 1 && spread) return t.parallel(t.pool, fn, n, data);
  for (size_t i = 0; i < n; ++i) fn(data, i);
}

// The CPU conv's tasks: a block of kConvChannels channels of one sequence (channels never meet in the conv, so the
// bits do not depend on the threads)
constexpr int64_t kConvChannels = 256;
// The least work (a launch's products in the conv, state elements updated in the scan) that the CPU conv and scan
// hand to the session's threads: below it waking them took longer than the work (the default model's decode step)
constexpr int64_t kParallelWork = int64_t(1) << 16;

// The conv of one row per sequence (a decode step), K known at compile time: each channel's K-1 past columns are
// consecutive (past [E, K-1]), so the taps' sums run channel by channel in registers, in the order of the rows'
// loop below (bias, then the taps in order: the same bits), and present is past shifted by one float (one memmove
// per block of channels: present may be past itself) with the new column written into every (K-1)-th place. The
// rows' loop below (K passes over E with strided past reads, then a copy per channel) took 19-20 us per layer at
// batch 16 of the default model (E 384) on this project's VM's AVX-512 build, this one 11 (BENCHMARKS.md, session
// 27).
template <typename X, int64_t K>
static inline void conv_step_t(const ConvArgs& a, int64_t b, int64_t e0, int64_t e1) {
  const int64_t E = a.inner;
  const float* past = a.past + b * E * (K - 1);  // [E, K-1]
  const int64_t in = b * a.xz_width;
  float* y = a.y + b * E;
  for (int64_t e = e0; e < e1; ++e) {
    float acc = a.bias[e];
    for (int64_t k = 0; k < K - 1; ++k) acc += a.weight_t[k * E + e] * past[e * (K - 1) + k];
    acc += a.weight_t[(K - 1) * E + e] * X::load(a.xz, in + e);
    y[e] = silu_fast(acc);
  }
  float* present = a.present + b * E * (K - 1);
  if (K > 2) {  // the block's columns one to the left (the last filled below)
    std::memmove(present + e0 * (K - 1), past + e0 * (K - 1) + 1, sizeof(float) * size_t((e1 - e0) * (K - 1) - 1));
  }
  for (int64_t e = e0; e < e1; ++e) present[e * (K - 1) + K - 2] = X::load(a.xz, in + e);
}

// A chunk's rows of channels [e0, e1) of sequence b: rows outer, channels inner, so each tap is a contiguous run of
// channels (from the past columns for the first K-1 rows) and the inner loop vectorizes, exp_fast included
template <typename X>
static inline void conv_chunk_t(const ConvArgs& a, int64_t b, int64_t e0, int64_t e1) {
  const int64_t K = a.kernel, E = a.inner;
  alignas(64) float sums[kConvChannels];
  float* acc = sums - e0;  // acc[e] for e in [e0, e1)
  const float* past = a.past + b * E * (K - 1);  // [E, K-1]
  for (int64_t t = 0; t < a.rows; ++t) {
    for (int64_t e = e0; e < e1; ++e) acc[e] = a.bias[e];
    for (int64_t k = 0; k < K; ++k) {
      const float* w = a.weight_t + k * E;  // tap k of every channel
      const int64_t s = t - (K - 1) + k;  // the input row of tap k (negative: a past column)
      if (s < 0) {
        for (int64_t e = e0; e < e1; ++e) acc[e] += w[e] * past[e * (K - 1) + (K - 1 + s)];
      } else {
        const int64_t in = (b * a.rows + s) * a.xz_width;
        for (int64_t e = e0; e < e1; ++e) acc[e] += w[e] * X::load(a.xz, in + e);
      }
    }
    float* y = a.y + (b * a.rows + t) * E;
    for (int64_t e = e0; e < e1; ++e) y[e] = silu_fast(acc[e]);
  }
  float* present = a.present + b * E * (K - 1);  // the last K-1 inputs, past columns first
  for (int64_t e = e0; e < e1; ++e) {
    for (int64_t j = 0; j < K - 1; ++j) {
      const int64_t s = a.rows - (K - 1) + j;
      present[e * (K - 1) + j] =
          s < 0 ? past[e * (K - 1) + (K - 1 + s)] : X::load(a.xz, (b * a.rows + s) * a.xz_width + e);
    }
  }
}

template <typename X>
static inline void conv_task_t(void* data, size_t task) {
  const ConvArgs& a = *static_cast<const ConvArgs*>(data);
  const int64_t blocks = (a.inner + kConvChannels - 1) / kConvChannels, b = int64_t(task) / blocks;
  const int64_t e0 = int64_t(task) % blocks * kConvChannels, e1 = std::min(a.inner, e0 + kConvChannels);
  if (a.rows > 1) return conv_chunk_t<X>(a, b, e0, e1);
  static_assert(kMaxConvWidth == 8, "the cases below");
  switch (a.kernel) {
    case 2:
      return conv_step_t<X, 2>(a, b, e0, e1);
    case 3:
      return conv_step_t<X, 3>(a, b, e0, e1);
    case 4:
      return conv_step_t<X, 4>(a, b, e0, e1);
    case 5:
      return conv_step_t<X, 5>(a, b, e0, e1);
    case 6:
      return conv_step_t<X, 6>(a, b, e0, e1);
    case 7:
      return conv_step_t<X, 7>(a, b, e0, e1);
    default:
      return conv_step_t<X, 8>(a, b, e0, e1);
  }
}

// A launch's tasks, spread over the threads where the launch has kParallelWork
static void conv_run(const ConvArgs& a, void (*task)(void*, size_t)) {
  const size_t n = size_t(a.batch * ((a.inner + kConvChannels - 1) / kConvChannels));
  run_tasks(a.threads, task, n, const_cast<ConvArgs*>(&a), a.batch * a.rows * a.inner * a.kernel >= kParallelWork);
}

constexpr int64_t kLanes = 8;  // channels the CPU scan advances together (one AVX2 vector, two SSE2 ones; AVX-512: 16)

// Pass 2 of the CPU scan for a few rows of sequence b (a decode step): one channel at a time, its N state elements
// (contiguous in past, A and present: no transposes, which cost more than one row's update in the lane layout) padded
// with zeros to NP, a multiple of 8 known at compile time (short loops of a run-time length cost more in their
// set-up than in their arithmetic), as the vector; y sums C . h in 8 partial sums.
template <typename X, int64_t NP>
static inline void scan_rows_by_channel(const ScanArgs& a, int64_t b, const float* dt, const float* gate, int64_t e0,
                                        int64_t e1) {
  const int64_t E = a.inner, N = a.state, R = a.rank, T = a.rows;
  alignas(32) float h[kMaxState] = {}, A[kMaxState] = {}, Bt[kLanes][kMaxState], Ct[kLanes][kMaxState], part[8];
  for (int64_t t = 0; t < T; ++t) {
    const float* x = a.xdbl + (b * T + t) * a.xdbl_width;
    for (int64_t n = 0; n < NP; ++n) {
      Bt[t][n] = n < N ? x[R + n] : 0.0f;
      Ct[t][n] = n < N ? x[R + N + n] : 0.0f;
    }
  }
  if (T == 1 && N == NP) {  // a decode step: straight from past to present (the copies in and out cost as much)
    const float *__restrict__ Bv = Bt[0], *__restrict__ Cv = Ct[0];
    for (int64_t e = e0; e < e1; ++e) {
      const float *__restrict__ past = a.past + (b * E + e) * NP, *__restrict__ Ae = a.a + e * NP;
      float* __restrict__ present = a.present + (b * E + e) * NP;
      const float d = dt[e], u = a.u[b * E + e], v = d * u;
      for (int64_t j = 0; j < 8; ++j) part[j] = 0.0f;
      for (int64_t n = 0; n < NP; n += 8) {
        for (int64_t j = 0; j < 8; ++j) {
          const float hn = exp_fast(d * Ae[n + j]) * past[n + j] + v * Bv[n + j];
          present[n + j] = hn;
          part[j] += hn * Cv[n + j];
        }
      }
      X::store(a.y, b * E + e, (sum8(part) + a.d[e] * u) * gate[e]);
    }
    return;
  }
  for (int64_t e = e0; e < e1; ++e) {
    const float *past = a.past + (b * E + e) * N, *Ae = a.a + e * N;
    if (N == NP) {  // copies of a length known at compile time: a few vector moves
      for (int64_t n = 0; n < NP; ++n) h[n] = past[n], A[n] = Ae[n];
    } else {  // the padding past N stays zero
      for (int64_t n = 0; n < N; ++n) h[n] = past[n], A[n] = Ae[n];
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float d = dt[t * E + e], u = a.u[row * E + e], v = d * u;
      for (int64_t n = 0; n < NP; ++n) h[n] = exp_fast(d * A[n]) * h[n] + v * Bt[t][n];
      for (int64_t j = 0; j < 8; ++j) part[j] = 0.0f;
      for (int64_t n = 0; n < NP; n += 8)
        for (int64_t j = 0; j < 8; ++j) part[j] += h[n + j] * Ct[t][n + j];
      X::store(a.y, row * E + e, (sum8(part) + a.d[e] * u) * gate[t * E + e]);
    }
    float* present = a.present + (b * E + e) * N;
    if (N == NP) {
      for (int64_t n = 0; n < NP; ++n) present[n] = h[n];
    } else {
      for (int64_t n = 0; n < N; ++n) present[n] = h[n];
    }
  }
}

#ifdef MAMBATRT_AVX2
#define MAMBATRT_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))

// exp_fast on 16 lanes: the same steps (the clamp as max/min, which keep a NaN, as the selects do)
MAMBATRT_AVX512 static inline __m512 exp_fast16(__m512 x) {
  using C = ExpFast;
  x = _mm512_min_ps(_mm512_set1_ps(C::hi), _mm512_max_ps(_mm512_set1_ps(C::lo), x));
  const __m512 magic = _mm512_set1_ps(C::magic);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(C::log2e), magic), magic);
  const __m512 hi = _mm512_fnmadd_ps(k, _mm512_set1_ps(C::ln2_hi), x);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(C::ln2_lo), hi);
  __m512 p = _mm512_set1_ps(C::p[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p[5]));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

// Pass 1's dt sums (before softplus) of M rows from row0, 32 channels from e0, into out[M, E]: a small matrix product
// [M, R] x [R, 32] whose 2M sums stay in registers over the R products and whose weights are loaded once for the M
// rows, where the portable loop stores and reloads all of a row's d per r (a fifth of a 64-row chunk's scan). The
// same order of sums (the bias, then r in order), so the same bits whatever M is.
template <int M>
MAMBATRT_AVX512 static inline void dt_block(const ScanArgs& a, int64_t row0, int64_t e0, float* out) {
  const int64_t E = a.inner;
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 2; ++q) acc[m][q] = _mm512_loadu_ps(a.dt_bias + e0 + 16 * q);
  const float* x = a.xdbl + row0 * a.xdbl_width;
  for (int64_t r = 0; r < a.rank; ++r) {
    const float* w = a.dt_weight_t + r * E + e0;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    for (int m = 0; m < M; ++m) {
      const __m512 xr = _mm512_set1_ps(x[m * a.xdbl_width + r]);
      acc[m][0] = _mm512_fmadd_ps(xr, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xr, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(out + m * E + e0 + 16 * q, acc[m][q]);
}

// The dt sums of rows [row0, row0 + rows), channels [e_begin, e_end), into out[rows, E] (E a multiple of 32): eight
// rows at a time, then pairs
MAMBATRT_AVX512 static inline void dt_rows_avx512(const ScanArgs& a, int64_t row0, int64_t rows, int64_t e_begin,
                                                  int64_t e_end, float* out) {
  for (int64_t e0 = e_begin; e0 < e_end; e0 += 32) {
    int64_t t = 0;
    for (; t + 8 <= rows; t += 8) dt_block<8>(a, row0 + t, e0, out + t * a.inner);
    for (; t + 2 <= rows; t += 2) dt_block<2>(a, row0 + t, e0, out + t * a.inner);
    for (; t < rows; ++t) dt_block<1>(a, row0 + t, e0, out + t * a.inner);
  }
}

// y = (sum + D u) * gate for 16 channels from e, stored as X
template <typename X>
MAMBATRT_AVX512 static inline void store_y16(const ScanArgs& a, int64_t at, int64_t e, __m512 sum, __m512 u,
                                             __m512 g) {
  const __m512 y = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_loadu_ps(a.d + e), u, sum), g);
  if constexpr (std::is_same_v<X, F32>) {
    _mm512_storeu_ps(static_cast<float*>(a.y) + at, y);
  } else {
    alignas(64) float out[16];
    _mm512_store_ps(out, y);
    for (int64_t l = 0; l < 16; ++l) X::store(a.y, at + l, out[l]);
  }
}

// Pass 2 of a decode step (one row) of sequence b for N = 16 on AVX-512: a channel's 16 state elements as one vector
// (as scan_rows_by_channel's, which GCC ran as two 8-float halves with its partial sums stored and reloaded per
// channel), y its C . h summed across the vector in registers
template <typename X>
MAMBATRT_AVX512 static void scan_step16(const ScanArgs& a, int64_t b, const float* dt, const float* gate, int64_t e0,
                                        int64_t e1) {
  constexpr int64_t N = 16;
  const int64_t E = a.inner;
  const float* x = a.xdbl + b * a.xdbl_width + a.rank;
  const __m512 B = _mm512_loadu_ps(x), C = _mm512_loadu_ps(x + N);
  for (int64_t e = e0; e < e1; ++e) {
    const float d = dt[e], u = a.u[b * E + e];
    const __m512 past = _mm512_loadu_ps(a.past + (b * E + e) * N), A = _mm512_loadu_ps(a.a + e * N);
    const __m512 h = _mm512_fmadd_ps(exp_fast16(_mm512_mul_ps(_mm512_set1_ps(d), A)), past,
                                     _mm512_mul_ps(_mm512_set1_ps(d * u), B));
    _mm512_storeu_ps(a.present + (b * E + e) * N, h);
    const float y = _mm512_reduce_add_ps(_mm512_mul_ps(h, C));
    X::store(a.y, b * E + e, (y + a.d[e] * u) * gate[e]);
  }
}

// Pass 2 of a chunk (8 rows or more) for N = 16 on AVX-512: 16 channels per vector as the lane pass below, but the
// 16 state vectors held in registers over the rows (gathered from past once, scattered to present once), where the
// lane pass with N known only at run time loaded and stored them at every row. y sums C[n] h[n] in the order of n.
template <typename X>
MAMBATRT_AVX512 static void scan_chunk16(const ScanArgs& a, int64_t b, const float* dt, const float* gate,
                                         int64_t e_begin, int64_t e_end) {
  constexpr int64_t N = 16;
  const int64_t E = a.inner, R = a.rank, T = a.rows;
  const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(N));  // lane l -> channel l's state row
  for (int64_t e0 = e_begin; e0 < e_end; e0 += 16) {
    __m512 h[N], A[N];
    const float* past = a.past + (b * E + e0) * N;
    for (int64_t n = 0; n < N; ++n) {
      h[n] = _mm512_i32gather_ps(across, past + n, 4);
      A[n] = _mm512_i32gather_ps(across, a.a + e0 * N + n, 4);
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float *B = a.xdbl + row * a.xdbl_width + R, *C = B + N;
      const __m512 d = _mm512_loadu_ps(dt + t * E + e0), u = _mm512_loadu_ps(a.u + row * E + e0);
      const __m512 v = _mm512_mul_ps(d, u);
      __m512 y = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int64_t n = 0; n < N; ++n) {
        h[n] = _mm512_fmadd_ps(exp_fast16(_mm512_mul_ps(d, A[n])), h[n], _mm512_mul_ps(v, _mm512_set1_ps(B[n])));
        y = _mm512_fmadd_ps(h[n], _mm512_set1_ps(C[n]), y);
      }
      store_y16<X>(a, row * E + e0, e0, y, u, _mm512_loadu_ps(gate + t * E + e0));
    }
    float* present = a.present + (b * E + e0) * N;
    for (int64_t n = 0; n < N; ++n) _mm512_i32scatter_ps(present + n, across, h[n], 4);
  }
}
#endif

// The CPU scan in two passes per sequence. 1: dt = softplus(xdbl's dt part . dt_weight[e] + dt_bias[e]) and the gate
// silu(z) for every row and channel, channels innermost (vectorized). 2: the recurrence, rows in order, kLanes
// channels at a time: for each state element n the lanes share B[n] and C[n] and each decays by its own
// exp(dt A[e, n]), so every step is one vector operation over the lanes; y sums C[n] h[n] over n in order, as the
// sequential definition does. (One channel at a time spent its time in per-row scalar work: libm's exp per state
// element, softplus's log1p, the dt dot product.) Below kLanes rows (decode) pass 2 goes by channel instead
// (scan_rows_by_channel). The AVX-512 build with N = 16 (every Mamba-1 checkpoint's d_state) takes passes of its own
// in intrinsics (dt_rows_avx512, scan_chunk16, scan_step16): GCC kept the loops' sums and states in memory there.
// Channels never meet in the scan, so a launch is split into tasks of channels (scan_task_t) for the session's
// threads: on one thread the scan kept a server's many sequences from gaining what the products gained from more
// cores (BENCHMARKS.md, session 33). Each channel's arithmetic is the same in any task, so the bits do not depend on
// the threads.

// A scan task's channels: a multiple of every build's lanes and of dt_block's 32 channels (64: as fast as the one
// thread's pass over all channels, where 32 took longer; BENCHMARKS.md, session 33)
constexpr int64_t kScanChannels = 64;

// Pass 1 for channels [e_begin, e_end) of every row of the launch, into dt_all and gate_all [B * T, E]
template <typename X, bool Avx512>
static inline void scan_pass1(const ScanArgs& a, float* dt_all, float* gate_all, int64_t e_begin, int64_t e_end) {
  const int64_t E = a.inner, R = a.rank, T = a.rows;
  bool summed = false;  // whether the AVX-512 blocks made pass 1's dt sums
#ifdef MAMBATRT_AVX2
  // AVX-512: the dt sums as small matrix products (dt_rows_avx512) over all the launch's rows at once (its sequences
  // share the weights' loads)
  if constexpr (Avx512) {
    if (E % 32 == 0) {
      dt_rows_avx512(a, 0, a.batch * T, e_begin, e_end, dt_all);
      summed = true;
    }
  }
#endif
  for (int64_t row = 0; row < a.batch * T; ++row) {  // pass 1
    const float* x = a.xdbl + row * a.xdbl_width;
    float* d = dt_all + row * E;
    // dt_weight as [R, E] (dt_weight_t): every channel at once per r, the same order of sums at every batch and
    // row count (a sequence's dt has the same bits alone, batched or in a chunk)
    if (!summed) {
      for (int64_t e = e_begin; e < e_end; ++e) d[e] = a.dt_bias[e];
      for (int64_t r = 0; r < R; ++r) {
        const float xr = x[r];
        const float* w = a.dt_weight_t + r * E;
        for (int64_t e = e_begin; e < e_end; ++e) d[e] += xr * w[e];
      }
    }
    for (int64_t e = e_begin; e < e_end; ++e) d[e] = softplus_fast(d[e]);
    float* g = gate_all + row * E;
    const int64_t z0 = row * a.xz_width + a.xz_width - E;
    for (int64_t e = e_begin; e < e_end; ++e) g[e] = silu_fast(X::load(a.xz, z0 + e));
  }
}

// Pass 2 for channels [e_begin, e_end) of sequence b, from its dt and gate [T, E]
template <typename X, int64_t L, bool Avx512>
static inline void scan_pass2(const ScanArgs& a, const float* dts, const float* gate, int64_t b, int64_t e_begin,
                              int64_t e_end) {
  const int64_t E = a.inner, N = a.state, R = a.rank, T = a.rows;
  alignas(64) float h[kMaxState][L], A[kMaxState][L], dtl[L], ul[L], vl[L], yl[L];
#ifdef MAMBATRT_AVX2
  if constexpr (Avx512) {
    if (T >= kLanes && N == 16 && E % 16 == 0) return scan_chunk16<X>(a, b, dts, gate, e_begin, e_end);
    if (T == 1 && N == 16) return scan_step16<X>(a, b, dts, gate, e_begin, e_end);
  }
#endif
  if (T < kLanes) {  // pass 2 for a few rows (decode): a channel at a time, its state elements as the vector
    static_assert(kMaxState == 32, "the cases below");
    switch ((N + 7) / 8) {
      case 1:
        scan_rows_by_channel<X, 8>(a, b, dts, gate, e_begin, e_end);
        break;
      case 2:
        scan_rows_by_channel<X, 16>(a, b, dts, gate, e_begin, e_end);
        break;
      case 3:
        scan_rows_by_channel<X, 24>(a, b, dts, gate, e_begin, e_end);
        break;
      default:
        scan_rows_by_channel<X, 32>(a, b, dts, gate, e_begin, e_end);
    }
    return;
  }
  for (int64_t e0 = e_begin; e0 < e_end; e0 += L) {  // pass 2
    const int64_t lanes = e_end - e0 < L ? e_end - e0 : L;  // the lanes past the task's channels compute zeros
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t l = 0; l < L; ++l) {
        h[n][l] = l < lanes ? a.past[(b * E + e0 + l) * N + n] : 0.0f;
        A[n][l] = l < lanes ? a.a[(e0 + l) * N + n] : 0.0f;
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float* x = a.xdbl + row * a.xdbl_width;
      const float *B = x + R, *C = x + R + N;
      for (int64_t l = 0; l < L; ++l) {
        dtl[l] = l < lanes ? dts[t * E + e0 + l] : 0.0f;
        ul[l] = l < lanes ? a.u[row * E + e0 + l] : 0.0f;
        vl[l] = dtl[l] * ul[l];
        yl[l] = 0.0f;
      }
      for (int64_t n = 0; n < N; ++n) {
        const float bn = B[n], cn = C[n];
        for (int64_t l = 0; l < L; ++l) {
          h[n][l] = exp_fast(dtl[l] * A[n][l]) * h[n][l] + vl[l] * bn;
          yl[l] += h[n][l] * cn;
        }
      }
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t e = e0 + l;
        X::store(a.y, row * E + e, (yl[l] + a.d[e] * ul[l]) * gate[t * E + e]);
      }
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < lanes; ++l) a.present[(b * E + e0 + l) * N + n] = h[n][l];
  }
}

// A launch's tasks. A chunk's (rows >= kLanes): both passes over a block of kScanChannels channels of every
// sequence. A decode step's: pass 1 over a block of channels of every row, then (`by_sequence`) pass 2 over one
// sequence's channels, its past and present states each one stream through memory (in blocks of channels the
// many short runs took longer than the step's arithmetic).
struct ScanWork {
  const ScanArgs* a;
  float *dt, *gate;  // [B * T, E]
  bool by_sequence;
};

template <typename X, int64_t L = kLanes, bool Avx512 = false>
static inline void scan_task_t(void* data, size_t task) {
  const ScanWork& w = *static_cast<const ScanWork*>(data);
  const ScanArgs& a = *w.a;
  const int64_t E = a.inner, T = a.rows;
  if (w.by_sequence) {
    const int64_t b = int64_t(task);
    return scan_pass2<X, L, Avx512>(a, w.dt + b * T * E, w.gate + b * T * E, b, 0, E);
  }
  const int64_t e0 = int64_t(task) * kScanChannels, e1 = std::min(E, e0 + kScanChannels);
  scan_pass1<X, Avx512>(a, w.dt, w.gate, e0, e1);
  if (T < kLanes) return;  // a decode step: pass 2 by sequence
  for (int64_t b = 0; b < a.batch; ++b) scan_pass2<X, L, Avx512>(a, w.dt + b * T * E, w.gate + b * T * E, b, e0, e1);
}

// A launch's scan, its tasks spread over the threads where it has kParallelWork; the scratch is the calling thread's
static void scan_run(const ScanArgs& a, void (*task)(void*, size_t)) {
  thread_local std::vector<float> dt, gate;
  dt.resize(size_t(a.batch * a.rows * a.inner));
  gate.resize(dt.size());
  ScanWork work{&a, dt.data(), gate.data(), false};
  const bool spread = a.batch * a.rows * a.inner * a.state >= kParallelWork;
  run_tasks(a.threads, task, size_t((a.inner + kScanChannels - 1) / kScanChannels), &work, spread);
  if (a.rows >= kLanes) return;
  work.by_sequence = true;
  run_tasks(a.threads, task, size_t(a.batch), &work, spread);
}

void add_norm_cpu(const NormArgs& a) {
  const int64_t D = a.width;
  for (int64_t r = 0; r < a.rows; ++r) {
    float* s = a.sum + r * D;
    double squares = 0.0;
    for (int64_t i = 0; i < D; ++i) {
      s[i] = F16::load(a.x, r * D + i) + a.residual[r * D + i];
      squares += double(s[i]) * s[i];
    }
    const float scale = 1.0f / std::sqrt(float(squares / double(D)) + *a.eps);
    for (int64_t i = 0; i < D; ++i) F16::store(a.normed, r * D + i, s[i] * scale * a.weight[i]);
  }
}

// Eight partial sums per dot product (vectorized without -ffast-math): MambaLinear on a CPU without AVX-512 (or with
// MAMBATRT_CPU_ISA capping it), where the runtime takes the Gemms (MLAS) instead; this loop lets the tests run the
// kernels graphs' copies on any machine.
static void linear_cpu_loop(const LinearArgs& a) {
  const int64_t K = a.in;
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = a.x + r * K;
    for (int64_t n = 0; n < a.out; ++n) {
      const float* w = a.weight + n * K;
      float part[8] = {};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int i = 0; i < 8; ++i) part[i] += x[k + i] * w[k + i];
      float s = sum8(part);
      for (; k < K; ++k) s += x[k] * w[k];
      a.y[r * a.out + n] = s;
    }
  }
}

#ifdef MAMBATRT_AVX2
// flatten: everything the kernel calls is inlined, so compiled for the target too. AVX-512 (F, VL, BW, DQ): the same
// loops with masked tails and wider registers where the loops are long enough (the conv over E, the decode step's
// 16 state elements), and 16 channels per vector in the chunk scan: on a Zen 4 core faster than the AVX2 build in
// every kernel (BENCHMARKS.md, session 13), with the same sums in the same order (the lanes are channels of their
// own: the same bits), except where the scan takes its AVX-512 passes for N = 16 (scan_step16 sums a channel's y
// across its vector in another order; BENCHMARKS.md, session 29).
#define MAMBATRT_CPU_BUILD(NAME, TARGET, LANES)                                                  \
  template <typename X>                                                                          \
  __attribute__((target(TARGET), flatten)) static void conv_task_##NAME(void* args, size_t i) {  \
    conv_task_t<X>(args, i);                                                                     \
  }                                                                                              \
  template <typename X>                                                                          \
  __attribute__((target(TARGET), flatten)) static void scan_task_##NAME(void* work, size_t i) {  \
    scan_task_t<X, LANES, LANES == 16>(work, i);                                                 \
  }
MAMBATRT_CPU_BUILD(avx2, "avx2,fma", kLanes)
MAMBATRT_CPU_BUILD(avx512, "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma", 16)
#undef MAMBATRT_CPU_BUILD

// The build to run: 2 AVX-512, 1 AVX2 + FMA (which both use), 0 the SSE2 baseline; the best the CPU (and the OS:
// libgcc checks the saved register state) has, at most MAMBATRT_CPU_ISA's ("sse2" or "avx2"), so that the tests hold
// every build to the portable graphs on one machine.
static int cpu_level() {
  static const int level = [] {
    const char* cap = std::getenv("MAMBATRT_CPU_ISA");
    const int most = cap == nullptr ? 2 : std::strcmp(cap, "sse2") == 0 ? 0 : std::strcmp(cap, "avx2") == 0 ? 1 : 2;
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    const int has = avx512 ? 2 : (avx2 ? 1 : 0);
    return has < most ? has : most;
  }();
  return level;
}

// MambaLinear with AVX-512 (the kernels graphs' CPU copies): y [M, N] = x [M, K] W^T, W packed as
// 16-column strips [S][K][16] (packed_strips), rows in blocks of up to 16. A tile is T strips x R rows of
// accumulators, one register each; a step k loads one cache line of each strip and broadcasts x[r][k] (the block's
// rows packed as [K][R], so a step's broadcasts share a line) into R x T FMAs. Each output is one FMA chain over K in
// order, whatever the tile, so a row's bits do not depend on the batch it runs in. Why not MLAS's Gemm: at a decode
// launch's few rows MLAS streams the weights and multiplies in turn more than at once (BENCHMARKS.md, session 31);
// here the strips are prefetched about a memory latency ahead (more steps ahead the more rows a step multiplies),
// and with more than 16 rows the row blocks take a few strips each in turn while those are in L2, so the weights
// come from memory once per launch. The strips are split into tasks for the session's threads (linear_task), each
// output computed by one thread whole: the same bits on any number of threads.
template <int R, int T>
MAMBATRT_AVX512 static inline void linear_tile(const float* xp, const float* wp, int64_t K, int64_t N, int64_t s,
                                               float* y) {
  constexpr int64_t ahead = R >= 12 ? 32 : R >= 6 ? 16 : 4;  // steps
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const float* w = wp + s * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[T];
    for (int t = 0; t < T; ++t) {
      wv[t] = _mm512_load_ps(w + (t * K + k) * 16);
      _mm_prefetch(reinterpret_cast<const char*>(w + (t * K + k + ahead) * 16), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xp[k * R + r]);
      for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(xv, wv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = (s + t) * 16, left = N - col;
    const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + col, m, acc[t][r]);
  }
}

// Strips [s0, s1) for a block of R rows: T strips a tile, as many as the registers hold beside R rows (R x T <= 24)
// and a task's strips divide into (kStripsPerTask, 4).
template <int R>
MAMBATRT_AVX512 static void linear_strips(const float* xp, const float* wp, int64_t K, int64_t N, int64_t s0,
                                          int64_t s1, float* y) {
  constexpr int T = R <= 4 ? 4 : R <= 12 ? 2 : 1;
  int64_t s = s0;
  for (; s + T <= s1; s += T) linear_tile<R, T>(xp, wp, K, N, s, y);
  for (; s < s1; ++s) linear_tile<R, 1>(xp, wp, K, N, s, y);
}

// One task of a launch: strips [task x kStripsPerTask, ...) of every row block in turn (with more than 16 rows, the
// task's 4 strips stay in L2 for all the blocks: 192-384 KiB). Tasks write disjoint columns, so they run on any
// threads in any order with the same results; 4 strips a task leave a launch's smaller products (out_proj: 48
// strips at mamba-130m) enough tasks for several threads.
constexpr int64_t kStripsPerTask = 4;
struct LinearTask {
  const LinearArgs* a;
  const float* packed_x;  // each block of rows as [K][R]
};

MAMBATRT_AVX512 static void linear_task(void* data, size_t task) {
  const LinearTask& t = *static_cast<const LinearTask*>(data);
  const LinearArgs& a = *t.a;
  const int64_t M = a.rows, K = a.in, N = a.out, S = (N + 15) / 16;
  const int64_t first = int64_t(task) * kStripsPerTask, end = std::min(S, first + kStripsPerTask);
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const float* xp = t.packed_x + r0 * K;
    float* y = a.y + r0 * N;
    switch (std::min<int64_t>(16, M - r0)) {
#define MAMBATRT_ROWS(R)                                          \
  case R:                                                         \
    linear_strips<R>(xp, a.weight_packed, K, N, first, end, y); \
    break;
      MAMBATRT_ROWS(1) MAMBATRT_ROWS(2) MAMBATRT_ROWS(3) MAMBATRT_ROWS(4) MAMBATRT_ROWS(5) MAMBATRT_ROWS(6)
      MAMBATRT_ROWS(7) MAMBATRT_ROWS(8) MAMBATRT_ROWS(9) MAMBATRT_ROWS(10) MAMBATRT_ROWS(11) MAMBATRT_ROWS(12)
      MAMBATRT_ROWS(13) MAMBATRT_ROWS(14) MAMBATRT_ROWS(15) MAMBATRT_ROWS(16)
#undef MAMBATRT_ROWS
    }
  }
}

MAMBATRT_AVX512 static void linear_cpu_avx512(const LinearArgs& a) {
  const int64_t M = a.rows, K = a.in, S = (a.out + 15) / 16;
  thread_local std::vector<float> packed_x;  // the calling thread's; the tasks only read it
  packed_x.resize(size_t(M * K));
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t R = std::min<int64_t>(16, M - r0);
    float* xp = packed_x.data() + r0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) xp[k * R + r] = a.x[(r0 + r) * K + k];
  }
  LinearTask task{&a, packed_x.data()};
  const size_t tasks = size_t((S + kStripsPerTask - 1) / kStripsPerTask);
  run_tasks(a.threads, linear_task, tasks, &task);
}
#endif

bool linear_cpu_packs() {
#ifdef MAMBATRT_AVX2
  return cpu_level() == 2;
#else
  return false;
#endif
}

void linear_cpu(const LinearArgs& a) {
#ifdef MAMBATRT_AVX2
  if (a.weight_packed != nullptr) return linear_cpu_avx512(a);
#endif
  linear_cpu_loop(a);
}

void conv_cpu(const ConvArgs& a) {
#ifdef MAMBATRT_AVX2
  if (cpu_level() == 2) return conv_run(a, a.half ? conv_task_avx512<F16> : conv_task_avx512<F32>);
  if (cpu_level() == 1) return conv_run(a, a.half ? conv_task_avx2<F16> : conv_task_avx2<F32>);
#endif
  conv_run(a, a.half ? conv_task_t<F16> : conv_task_t<F32>);
}
void scan_cpu(const ScanArgs& a) {
#ifdef MAMBATRT_AVX2
  if (cpu_level() == 2) return scan_run(a, a.half ? scan_task_avx512<F16> : scan_task_avx512<F32>);
  if (cpu_level() == 1) return scan_run(a, a.half ? scan_task_avx2<F16> : scan_task_avx2<F32>);
#endif
  scan_run(a, a.half ? scan_task_t<F16> : scan_task_t<F32>);
}

#ifndef MAMBATRT_WITH_CUDA
const char* conv_cuda(const ConvArgs&, void*) { return "built without CUDA"; }
const char* scan_cuda(const ScanArgs&, void*) { return "built without CUDA"; }
const char* add_norm_cuda(const NormArgs&, void*) { return "built without CUDA"; }
void* create_stream(bool, bool) { return nullptr; }
const char* sample_cuda(const float*, int64_t, int64_t, int64_t, const double*, int64_t*, void*) {
  return "built without CUDA";
}
void* create_stream_on_sms(bool, int, int*, const char** why) {
  *why = "built without CUDA";
  return nullptr;
}
const char* cuda_check() { return "built without CUDA (no nvcc)"; }
const char* linear_cuda(const LinearArgs&, void*) { return "built without CUDA"; }
void linear_release(void*) {}
int64_t linear_split_products() { return 0; }
const char* linear_prepare() { return nullptr; }
const char* scan_prepare() { return nullptr; }
#endif

}  // namespace mambatrt

// -- entry points -----------------------------------------------------------------------------------------------
extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                     const OrtApiBase* base) {
  const void* api = base->GetApi(ort::kApiVersion);
  if (api == nullptr) return nullptr;  // cannot happen with onnxruntime >= 1.13; the session then lacks the ops
  if (g_api_parallel == nullptr) g_api_parallel = base->GetApi(ort::kParallelForVersion);  // >= 1.17
  OrtCustomOpDomain* domain = nullptr;  // lives as long as the process: sessions keep pointers into it
  if (OrtStatus* s = ort::at<ort::CreateCustomOpDomainFn>(api, ort::kCreateCustomOpDomain)("mambatrt", &domain)) {
    return s;
  }
  for (const OpDef& op : g_ops) {
    if (OrtStatus* s = ort::at<ort::CustomOpDomainAddFn>(api, ort::kCustomOpDomainAdd)(domain, &op)) return s;
  }
  return ort::at<ort::AddCustomOpDomainFn>(api, ort::kAddCustomOpDomain)(options, domain);
}

// One stream per process, ordered with the legacy default stream: the kernels' stream for runtimes that give every
// session the same user_compute_stream (mambatrt before session 12); nullptr without CUDA.
__attribute__((visibility("default"))) void* mambatrt_ops_stream() {
  if (g_stream == nullptr) g_stream = mambatrt::create_stream(true, false);
  return g_stream;
}

// A new non-blocking stream for one session's user_compute_stream (the kernels launch on the stream onnxruntime
// reports for the session, stream_of): decode and prefill sessions on two streams run side by side; ``urgent`` (not
// 0): of the highest priority, so that decode kernels go before the prefill kernels queued beside them. nullptr
// without CUDA. Its presence tells the runtime that this library launches on each session's stream.
__attribute__((visibility("default"))) void* mambatrt_ops_new_stream(int urgent) {
  return mambatrt::create_stream(false, urgent != 0);
}

// A new non-blocking stream like mambatrt_ops_new_stream's whose kernels run on ``sms`` of the device's SMs only (a
// green context's partition; *granted: how many, the request rounded up to the device's granularity): nullptr
// with *why set where the driver or device has no green contexts.
__attribute__((visibility("default"))) void* mambatrt_ops_new_stream_on_sms(int urgent, int sms, int* granted,
                                                                          const char** why) {
  *why = nullptr;
  return mambatrt::create_stream_on_sms(urgent != 0, sms, granted, why);
}

// The serving pool's sampler on the GPU (mambatrt::sample_cuda): one token per row of a decode or prefill launch's
// logits, for rows that sample with a temperature alone (or greedily), so that only the tokens come back to the host.
__attribute__((visibility("default"))) const char* mambatrt_ops_sample(const float* logits, int64_t rows,
                                                                      int64_t stride, int64_t vocab,
                                                                      const double* params, int64_t* picks,
                                                                      void* stream) {
  return mambatrt::sample_cuda(logits, rows, stride, vocab, params, picks, stream);
}

// The stream the last kernel launched by this library ran on (nullptr: the CPU provider's kernels; 1 before any
// ran): the tests check that a session's kernels run on the stream it was given.
__attribute__((visibility("default"))) void* mambatrt_ops_last_stream() { return g_last_stream; }

// Whether MambaLinear's CPU kernel is the packed AVX-512 one (1) or the plain loop (0): the runtime runs the kernels
// graphs' CPU copies (their products as MambaLinear) only where it is the packed one.
__attribute__((visibility("default"))) int mambatrt_ops_cpu_linear() { return mambatrt::linear_cpu_packs() ? 1 : 0; }

// Why the CUDA kernels cannot run here (e.g. no code for this GPU's architecture), or nullptr: the runtime asks before
// it runs the kernels graphs on CUDA, so an unsupported GPU gets another flavour instead of a failed launch.
__attribute__((visibility("default"))) const char* mambatrt_ops_cuda_check() { return mambatrt::cuda_check(); }

// How many of MambaLinear's products ran as cuBLAS TF32 GEMMs on split operands since the library loaded (the
// prefill launches' projections on sm_90: mamba_linear_blas.cuh), for the tests and `serve`'s report
__attribute__((visibility("default"))) int64_t mambatrt_ops_linear_split_products() {
  return mambatrt::linear_split_products();
}

// 1 when the CUDA kernels are compiled in.
__attribute__((visibility("default"))) int mambatrt_ops_has_cuda() {
#ifdef MAMBATRT_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}
}
