// What the standalone CUDA benches in scripts/ share: a status check that exits with the failing call, and the
// time of one call by CUDA events.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                  \
  do {                                                                            \
    auto status_ = (x);                                                           \
    if (int(status_) != 0) {                                                      \
      std::printf("%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, int(status_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// us per call of run(): `warmup` calls first, then the mean over `reps` calls between two events
template <typename F>
float time_us(F&& run, int reps, int warmup = 10) {
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (int i = 0; i < warmup; ++i) run();
  cudaEventRecord(t0);
  for (int i = 0; i < reps; ++i) run();
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return ms * 1000.0f / reps;
}
