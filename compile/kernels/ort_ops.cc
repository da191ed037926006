// The onnxruntime side of mambatrt's custom-op library: MambaConv, MambaScan, MambaAddNorm16 and MambaLinear
// (shapes in mamba_ops.h) described to onnxruntime as custom ops of domain "mambatrt", for its CPU provider and, when
// built with nvcc, for its CUDA provider. onnxruntime loads the library with SessionOptions.register_custom_ops_library
// and calls RegisterCustomOps; a node's KernelCompute reads its inputs' shapes, checks them, makes its outputs and
// hands the pointers to the CPU kernels (cpu_kernels.cc, cpu_scan.cc) or the CUDA ones (*_cuda.cu).
//
// Why the ops: a Mamba layer under onnxruntime's own ops is ~18 kernels per decode step (the dt path, the gate tail,
// splits); MambaConv and MambaScan cover everything between the in/x/out projections, so a layer is ~6 kernels and
// the prefill scan walks its rows in registers instead of in a graph. MambaAddNorm16 takes the two Casts per layer out
// of fp16 bundles (at batch 1 they cost what fp16 matrix products save).
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "mamba_ops.h"
#include "ort_abi.h"

namespace {

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
  return stream;
}

void expect(bool ok, const char* op, const char* what) {
  if (!ok) fail(op, what);
}

enum class Kind { kConv, kScan, kNorm, kLinear };

struct OpDef : MambatrtCustomOp {
  const char* name;
  const char* provider;  // nullptr: the CPU provider
  Kind kind;
  bool half;  // the ...16 variant: xz (and MambaScan16's y; MambaLinear16's x and y) in float16
  size_t inputs, outputs;
  mambatrt::WeightType weight = mambatrt::WeightType::kF32;  // MambaLinear's weight type
};

constexpr size_t kXzInput[] = {0, 6, 0, 0};  // the float16 input of MambaConv16, MambaScan16, MambaAddNorm16

struct Kernel {
  const void* api;
  const OpDef* def;
  std::mutex mutex;  // onnxruntime may run one session (so this node) from several threads at once
  const void* kept_from = nullptr;  // the weight `kept` was made from
  void* kept = nullptr;             // that weight in a CPU kernel's layout (kept_layout; free()d with the node)
  size_t kept_bytes = 0;
  void* linear_state = nullptr;  // MambaLinear's on CUDA (its weight split for cuBLAS: linear_cuda)
};

// Weight w in the layout a CPU kernel wants (`bytes` bytes, written by fill), made on the node's first run and
// kept, 64-byte aligned: the CPU kernels want a weight's channels innermost (vectorized over E), or MambaLinear's in
// strips, where the ops take it channels outermost, as torch stores it and the CUDA kernels read it. Transposing on
// every run cost more than a decode step's use of it (E 1536, R 48); kept per node (one weight each), it is made
// once. A weight here is an initializer of mambatrt's graphs, whose memory onnxruntime keeps for the session, so its
// address names its contents.
template <typename T, typename Fill>
const T* kept_layout(Kernel& k, const void* w, size_t elements, Fill fill) {
  std::lock_guard<std::mutex> lock(k.mutex);
  const size_t bytes = elements * sizeof(T);
  if (k.kept_from != w || k.kept_bytes != bytes) {
    std::free(k.kept);
    k.kept = nullptr, k.kept_from = nullptr;
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes) != 0) fail(k.def->name, "out of memory");
    fill(static_cast<T*>(p));
    k.kept = p, k.kept_from = w, k.kept_bytes = bytes;
  }
  return static_cast<const T*>(k.kept);
}

// w [rows, cols] as [cols, rows]
const float* transposed(Kernel& k, const float* w, int64_t rows, int64_t cols) {
  return kept_layout<float>(k, w, size_t(rows * cols), [&](float* out) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = w[r * cols + c];
  });
}

// MambaLinear's weight w [N, K] (elements of T) as the CPU kernels take it (mamba_ops.h: linear_cpu_packs,
// linear_cpu_rows): 16-column strips [ceil(N / 16)][K][16], the last strip's missing columns zero, each step of a
// strip 16 consecutive elements.
template <typename T>
const void* packed_strips(Kernel& k, const void* weight, int64_t n, int64_t kk) {
  const T* w = static_cast<const T*>(weight);
  const int64_t strips = (n + 15) / 16;
  return kept_layout<T>(k, w, size_t(strips * kk * 16), [&](T* out) {
    for (int64_t s = 0; s < strips; ++s)
      for (int64_t i = 0; i < kk; ++i)
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t col = s * 16 + j;
          out[(s * kk + i) * 16 + j] = col < n ? w[col * kk + i] : T(0);
        }
  });
}

const void* packed_strips(Kernel& k, mambatrt::WeightType type, const void* w, int64_t n, int64_t kk) {
  switch (type) {
    case mambatrt::WeightType::kF16:
    case mambatrt::WeightType::kBF16:
      return packed_strips<uint16_t>(k, w, n, kk);
    case mambatrt::WeightType::kI8:
      return packed_strips<int8_t>(k, w, n, kk);
    default:
      return packed_strips<float>(k, w, n, kk);
  }
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
  a.weight_type = k.def->weight, a.half = k.def->half;
  if (a.weight_type == mambatrt::WeightType::kI8) {
    Tensor scale = input(k.api, ctx, 2, op);
    expect(scale.dims.size() >= 1 && scale.dims[0] == a.out && (scale.dims.size() == 1 || scale.dims[1] == 1), op,
           "scale not [N] or [N,1]");
    a.scale = scale.data;
  }
  a.y = output(k.api, ctx, 0, {x.dims[0], w.dims[0]}, op);
  void* stream = stream_of(k.api, ctx, op);
  if (k.def->provider == nullptr) {
    OrtPool pool{g_api_parallel, ctx, op};
    if (mambatrt::linear_cpu_rows()) {  // both packed kernels (linear_cpu_packs implies it) take the strips
      a.weight_packed = packed_strips(k, a.weight_type, w.data, a.out, a.in);
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
int weight_element(mambatrt::WeightType w) {
  switch (w) {
    case mambatrt::WeightType::kF16:
      return ort::kFloat16;
    case mambatrt::WeightType::kBF16:
      return ort::kBFloat16;
    case mambatrt::WeightType::kI8:
      return ort::kInt8;
    default:
      return ort::kFloat;
  }
}
int input_type(const MambatrtCustomOp* op, size_t index) {
  const OpDef& d = def_of(op);
  if (d.kind == Kind::kLinear && index == 1) return weight_element(d.weight);
  if (d.kind == Kind::kLinear && index == 0) return d.half ? ort::kFloat16 : ort::kFloat;
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

// MambaLinear's CPU forms with 16-bit and int8 weights (mamba_ops.h)
OpDef make_linear(const char* name, mambatrt::WeightType weight, bool half) {
  OpDef d = make(name, nullptr, Kind::kLinear, half);
  d.weight = weight;
  d.inputs = weight == mambatrt::WeightType::kI8 ? 3 : 2;
  return d;
}

const char* const kCuda = "CUDAExecutionProvider";
OpDef g_ops[] = {
    make("MambaConv", nullptr, Kind::kConv, false),  make("MambaScan", nullptr, Kind::kScan, false),
    make("MambaConv16", nullptr, Kind::kConv, true), make("MambaScan16", nullptr, Kind::kScan, true),
    make("MambaAddNorm16", nullptr, Kind::kNorm, true), make("MambaLinear", nullptr, Kind::kLinear, false),
    make_linear("MambaLinear16", mambatrt::WeightType::kF16, true),
    make_linear("MambaLinearBF16", mambatrt::WeightType::kBF16, false),
    make_linear("MambaLinear8", mambatrt::WeightType::kI8, false),
#ifdef MAMBATRT_WITH_CUDA
    make("MambaConv", kCuda, Kind::kConv, false),    make("MambaScan", kCuda, Kind::kScan, false),
    make("MambaConv16", kCuda, Kind::kConv, true),   make("MambaScan16", kCuda, Kind::kScan, true),
    make("MambaAddNorm16", kCuda, Kind::kNorm, true),  make("MambaLinear", kCuda, Kind::kLinear, false),
#endif
};

}  // namespace

namespace mambatrt {
void* last_stream() { return g_last_stream; }
}  // namespace mambatrt

// onnxruntime's entry point: the ops of domain "mambatrt" added to the session's options
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
}  // extern "C"
