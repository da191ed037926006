// The CPU scan (MambaScan's CPU kernel) alone: mamba-130m shapes (E 1536, N 16, R 48), 24 layers' states of their
// own (a launch's state traffic, not one layer's in cache), B sequences of T rows; best of 18 launches after 2.
//
//   g++ -O3 -std=c++17 -o /tmp/cpu_scan_bench scripts/cpu_scan_bench.cc && taskset -c 0 /tmp/cpu_scan_bench 16 1
//
// MAMBATRT_CPU_ISA=sse2|avx2 caps the build the library picks, as for the bundles; -DOPS='"path/mamba_ops.cc"'
// times another version of the kernels (an A/B of two checkouts). The checksum sums every y: a change that moves it
// beyond rounding changed the result.
#ifndef OPS
#define OPS "../compile/kernels/mamba_ops.cc"
#endif
#include OPS

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s BATCH ROWS\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoi(argv[1]), T = std::atoi(argv[2]), L = 24, E = 1536, N = 16, R = 48, W = R + 2 * N;
  std::mt19937 g(0);
  std::uniform_real_distribution<float> U(-1, 1);
  auto fill = [&](std::vector<float>& v, float s) {
    for (auto& x : v) x = U(g) * s;
  };
  std::vector<float> u(B * T * E), xdbl(B * T * W), dtw(E * R), dtwt(R * E), dtb(E), A(E * N), D(E), xz(B * T * 2 * E),
      y(B * T * E);
  fill(u, 1), fill(xdbl, 1), fill(dtw, 0.1f), fill(dtb, 0.5f), fill(D, 1), fill(xz, 1);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) A[e * N + n] = -(n + 1.0f);  // S4D-real, as Mamba initializes A
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r) dtwt[r * E + e] = dtw[e * R + r];
  std::vector<std::vector<float>> past(L, std::vector<float>(B * E * N)), present(L, std::vector<float>(B * E * N));
  for (auto& p : past) fill(p, 1);
  double best = 1e9, checksum = 0;
  for (int it = 0; it < 20; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t l = 0; l < L; ++l) {
      mambatrt::ScanArgs a{u.data(), xdbl.data(), dtw.data(),     dtb.data(), A.data(), D.data(), xz.data(),
                           past[l].data(), y.data(), present[l].data(), B, T, E, N, R, W, 2 * E, false, dtwt.data()};
      mambatrt::scan_cpu(a);
      std::swap(past[l], present[l]);
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (it >= 2) best = std::min(best, ms);
    for (float v : y) checksum += v;
  }
  std::printf("batch %ld, rows %ld: best %.2f ms for 24 layers (checksum %.6g)\n", long(B), long(T), best, checksum);
  return 0;
}
