// The library's C API: the functions the Python runtime and the tests call through ctypes, beside onnxruntime's
// entry point (RegisterCustomOps, ort_ops.cc). Every symbol is prefixed mambatrt_ops_ and exported; the library's
// other symbols are hidden (-fvisibility=hidden). ctypes.CDLL of the path onnxruntime registered gets the same loaded
// copy, so these calls see and set the state of the kernels onnxruntime runs.
#include <cstdint>

#include "mamba_ops.h"

#define MAMBATRT_EXPORT __attribute__((visibility("default")))

extern "C" {

// A new non-blocking stream for one session's user_compute_stream (the kernels launch on the stream onnxruntime
// reports for the session: ort_ops.cc's stream_of): decode and prefill sessions on two streams run side by side;
// ``urgent`` (not 0): of the highest priority, so that decode kernels go before the prefill kernels queued beside
// them. nullptr without CUDA.
MAMBATRT_EXPORT void* mambatrt_ops_new_stream(int urgent) { return mambatrt::create_stream(urgent != 0); }

// A new non-blocking stream like mambatrt_ops_new_stream's whose kernels run on ``sms`` of the device's SMs only (a
// green context's partition; *granted: how many, the request rounded up to the device's granularity): nullptr
// with *why set where the driver or device has no green contexts.
MAMBATRT_EXPORT void* mambatrt_ops_new_stream_on_sms(int urgent, int sms, int* granted, const char** why) {
  *why = nullptr;
  return mambatrt::create_stream_on_sms(urgent != 0, sms, granted, why);
}

// The serving pool's sampler on the GPU (mambatrt::sample_cuda): one token per row of a decode or prefill launch's
// logits, for rows that sample with a temperature alone (or greedily), so that only the tokens come back to the host.
MAMBATRT_EXPORT const char* mambatrt_ops_sample(const float* logits, int64_t rows, int64_t stride, int64_t vocab,
                                                const double* params, int64_t* picks, void* stream) {
  return mambatrt::sample_cuda(logits, rows, stride, vocab, params, picks, stream);
}

// The stream the last kernel launched by this library ran on (nullptr: the CPU provider's kernels; 1 before any
// ran): the tests check that a session's kernels run on the stream it was given.
MAMBATRT_EXPORT void* mambatrt_ops_last_stream() { return mambatrt::last_stream(); }

// Whether MambaLinear's CPU kernel is the packed AVX-512 one (1) or the plain loop (0): the runtime runs the kernels
// graphs' CPU copies (their products as MambaLinear) only where it is the packed one.
MAMBATRT_EXPORT int mambatrt_ops_cpu_linear() { return mambatrt::linear_cpu_packs() ? 1 : 0; }

// Whether MambaLinear's CPU kernel for 16-bit and int8 weights is a strip kernel, AVX-512 or AVX2 (1), or the plain
// loop (0): the runtime runs the CPU copies of fp16 and int8 bundles (MambaLinear16, MambaLinear8) only where it is a
// strip kernel.
MAMBATRT_EXPORT int mambatrt_ops_cpu_linear_rows() { return mambatrt::linear_cpu_rows() ? 1 : 0; }

// For tests only: caps the CPU kernels' instruction-set build at ``isa`` ("sse2", "avx2", or "avx512": no cap), so
// that the tests hold every build to the portable graphs on one machine. The library picks the best build the CPU
// has on its own; a test calls this before it creates sessions (mambatrt_ops_cpu_linear's answer follows the cap).
// 0 on success, 1 for an unknown name (nothing changed).
MAMBATRT_EXPORT int mambatrt_ops_cap_cpu_isa(const char* isa) { return mambatrt::cap_cpu_isa(isa) ? 0 : 1; }

// The CPU kernels' instruction-set build that runs ("sse2", "avx2", "avx512"; "portable" off x86-64): the best the
// CPU has, or the cap a test set.
MAMBATRT_EXPORT const char* mambatrt_ops_cpu_isa() { return mambatrt::cpu_isa(); }

// Why the CUDA kernels cannot run here (e.g. no code for this GPU's architecture), or nullptr: the runtime asks before
// it runs the kernels graphs on CUDA, so an unsupported GPU gets another flavour instead of a failed launch.
MAMBATRT_EXPORT const char* mambatrt_ops_cuda_check() { return mambatrt::cuda_check(); }

// How many of MambaLinear's products ran as cuBLAS TF32 GEMMs on split operands since the library loaded (the
// prefill launches' projections on sm_90: mamba_linear_blas.cuh), for the tests and `serve`'s report
MAMBATRT_EXPORT int64_t mambatrt_ops_linear_split_products() { return mambatrt::linear_split_products(); }

// 1 when the CUDA kernels are compiled in.
MAMBATRT_EXPORT int mambatrt_ops_has_cuda() {
#ifdef MAMBATRT_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
