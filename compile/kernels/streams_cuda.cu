// The CUDA streams the library makes for the runtime's sessions (mamba_ops.h: create_stream, create_stream_on_sms).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "mamba_ops.h"

namespace mambatrt {

void* create_stream(bool urgent) {
  cudaStream_t stream = nullptr;
  int least = 0, greatest = 0;
  if (urgent && cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess) greatest = 0;
  const int priority = urgent ? greatest : 0;
  return cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority) == cudaSuccess ? stream : nullptr;
}

// The driver's green-context calls are looked up at run time (cudaGetDriverEntryPointByVersion), not linked: the
// library then loads under any driver, and only this stream needs one of CUDA 12.4 or later. The green context
// lives as long as the process (its stream's sessions do too). Runtime-API launches and CUDA graph captures on its
// stream run in its partition; memory is the primary context's, shared with every other stream.
void* create_stream_on_sms(bool urgent, int sms, int* granted, const char** why) {
  *granted = 0;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetDevResource_v12040 get_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 split = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 describe = nullptr;
  PFN_cuGreenCtxCreate_v12040 create = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream_create = nullptr;
  const auto entry = [](const char* name, unsigned version, void** fn) {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const bool ok = cudaGetDriverEntryPointByVersion(name, fn, version, cudaEnableDefault, &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess && *fn != nullptr;
    if (!ok) cudaGetLastError();
    return ok;
  };
  if (!entry("cuDeviceGet", 2000, reinterpret_cast<void**>(&device_get)) ||
      !entry("cuDeviceGetDevResource", 12040, reinterpret_cast<void**>(&get_resource)) ||
      !entry("cuDevSmResourceSplitByCount", 12040, reinterpret_cast<void**>(&split)) ||
      !entry("cuDevResourceGenerateDesc", 12040, reinterpret_cast<void**>(&describe)) ||
      !entry("cuGreenCtxCreate", 12040, reinterpret_cast<void**>(&create)) ||
      !entry("cuGreenCtxStreamCreate", 12050, reinterpret_cast<void**>(&stream_create))) {
    *why = "the CUDA driver has no green contexts (needs CUDA 12.5 or later)";
    return nullptr;
  }
  int ordinal = 0;
  if (cudaGetDevice(&ordinal) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {  // the primary context, made
    *why = "no CUDA device";
    return nullptr;
  }
  CUdevice device;
  CUdevResource whole, part, rest;
  unsigned groups = 1;
  CUdevResourceDesc desc;
  CUgreenCtx green;
  CUstream stream = nullptr;
  if (device_get(&device, ordinal) != CUDA_SUCCESS ||
      get_resource(device, &whole, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS) {
    *why = "the device's SMs cannot be partitioned";
    return nullptr;
  }
  if (sms < 1 || unsigned(sms) >= whole.sm.smCount) {
    *why = "the SM count must be at least 1 and below the device's";
    return nullptr;
  }
  if (split(&part, &groups, &whole, &rest, 0, unsigned(sms)) != CUDA_SUCCESS || groups != 1 ||
      describe(&desc, &part, 1) != CUDA_SUCCESS ||
      create(&green, desc, device, CU_GREEN_CTX_DEFAULT_STREAM) != CUDA_SUCCESS) {
    *why = "the driver refused a partition of that many SMs";
    return nullptr;
  }
  int least = 0, greatest = 0;
  if (urgent && cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess) greatest = 0;
  if (stream_create(&stream, green, CU_STREAM_NON_BLOCKING, urgent ? greatest : 0) != CUDA_SUCCESS) {
    *why = "the driver could not create a stream in the partition";
    return nullptr;
  }
  *granted = int(part.sm.smCount);
  return stream;
}

}  // namespace mambatrt
