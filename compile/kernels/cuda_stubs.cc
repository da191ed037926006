// The CUDA entry points of mamba_ops.h in a build without nvcc (compile/kernels.py compiles this file into CPU-only
// builds alone): the CUDA provider's ops are not registered there, and the C API answers that there is no CUDA.
#include "mamba_ops.h"

namespace mambatrt {

const char* conv_cuda(const ConvArgs&, void*) { return "built without CUDA"; }
const char* scan_cuda(const ScanArgs&, void*) { return "built without CUDA"; }
const char* add_norm_cuda(const NormArgs&, void*) { return "built without CUDA"; }
void* create_stream(bool) { return nullptr; }
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

}  // namespace mambatrt
