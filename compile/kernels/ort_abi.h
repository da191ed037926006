// The part of onnxruntime's C ABI that a custom-op library needs, declared here because onnxruntime's Python
// wheels ship no C headers. onnxruntime hands the library a table of function pointers (OrtApi) whose entries
// never move between releases (new ones are appended), so an entry is read by its position; the positions below
// are those of the release that added them (they hold in every later one; this project needs onnxruntime >= 1.18).
// A custom op describes itself with MambatrtCustomOp, laid out as onnxruntime's OrtCustomOp of API version 13 (it
// reads no field past GetInputMemoryType for that version).
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {
struct OrtStatus;
struct OrtValue;
struct OrtKernelContext;
struct OrtKernelInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;

struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

struct MambatrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const MambatrtCustomOp* op, const void* api, const OrtKernelInfo* info);
  const char* (*GetName)(const MambatrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const MambatrtCustomOp* op);
  int (*GetInputType)(const MambatrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const MambatrtCustomOp* op);
  int (*GetOutputType)(const MambatrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const MambatrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const MambatrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const MambatrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const MambatrtCustomOp* op, size_t index);
};
}

namespace ort {

constexpr uint32_t kApiVersion = 13;
constexpr int kFloat = 1;     // ONNX TensorProto.FLOAT
constexpr int kFloat16 = 10;  // ONNX TensorProto.FLOAT16
constexpr int kBFloat16 = 16;  // ONNX TensorProto.BFLOAT16
constexpr int kInt8 = 3;       // ONNX TensorProto.INT8

// Positions in the OrtApi table and the signatures there.
using GetErrorMessageFn = const char* (*)(const OrtStatus* status);
using CreateCustomOpDomainFn = OrtStatus* (*)(const char* domain, OrtCustomOpDomain** out);
using CustomOpDomainAddFn = OrtStatus* (*)(OrtCustomOpDomain* domain, const MambatrtCustomOp* op);
using AddCustomOpDomainFn = OrtStatus* (*)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
using GetTensorMutableDataFn = OrtStatus* (*)(OrtValue* value, void** out);
using GetDimensionsCountFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
using GetDimensionsFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n);
using GetTensorTypeAndShapeFn = OrtStatus* (*)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
using KernelContextGetInputFn = OrtStatus* (*)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
using KernelContextGetOutputFn = OrtStatus* (*)(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t n,
                                                OrtValue** out);
using ReleaseTensorTypeAndShapeInfoFn = void (*)(OrtTensorTypeAndShapeInfo* info);
using KernelContextGetGPUComputeStreamFn = OrtStatus* (*)(const OrtKernelContext* ctx, void** out);
using KernelContextParallelForFn = OrtStatus* (*)(const OrtKernelContext* ctx, void (*fn)(void*, size_t),
                                                  size_t total, size_t num_batch, void* data);

enum Slot : int {
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextGetGPUComputeStream = 193,  // API version 14 (onnxruntime 1.14) and later
  kKernelContextParallelFor = 274,          // API version 17 (onnxruntime 1.17) and later: the session's threads
};
constexpr uint32_t kParallelForVersion = 17;

template <typename Fn>
Fn at(const void* api, Slot slot) {
  return reinterpret_cast<Fn>(static_cast<void* const*>(const_cast<void*>(api))[slot]);
}

}  // namespace ort
