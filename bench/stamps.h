// Per-block timestamps of the one-token stream kernels (kernels/gemv.cuh: stream_stamps), printed by the
// benchmarks in measurement builds (-DNIBBLE_STREAM_STAMPS=1); nothing in other builds. For each kernel kind:
// its blocks' entry, end of wait, routes mapped (MoE), x maxima taken, x staged, first weights in, first warp's
// first unit done, last warp out
// of the walk, as min / median / max microseconds
// after t0, the earliest entry of any kind (so consecutive kernels line up on one axis).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/gemv.cuh"

namespace nb {

inline void print_stream_stamps(const char* label) {
  using namespace cuda;
  std::vector<uint64_t> st;
  if (!stream_stamps(false, &st)) return;
  auto at = [&](int kind, int block, int point) { return st[(size_t(kind) * kStampBlocks + block) * kStampPoints + point]; };
  uint64_t t0 = UINT64_MAX;
  for (int k = 0; k < kStampKinds; ++k)
    for (int b = 0; b < kStampBlocks; ++b)
      if (at(k, b, 0)) t0 = std::min(t0, at(k, b, 0));
  static const char* kinds[kStampKinds] = {"linear", "qkv head", "fc1", "fc2"};
  static const char* points[kStampPoints] = {"entry", "waited", "routed", "maxed", "staged", "loaded", "unit1", "walked"};
  for (int k = 0; k < kStampKinds; ++k) {
    std::printf("stamps %s %-8s:", label, kinds[k]);
    for (int p = 0; p < kStampPoints; ++p) {
      std::vector<double> us;
      for (int b = 0; b < kStampBlocks; ++b)
        if (at(k, b, 0) && at(k, b, p)) us.push_back(double(at(k, b, p) - t0) / 1e3);
      if (us.empty()) continue;
      std::sort(us.begin(), us.end());
      std::printf(" %s %.2f/%.2f/%.2f", points[p], us.front(), us[us.size() / 2], us.back());
      if (p == 0) std::printf(" (%zu blocks)", us.size());
    }
    std::printf("\n");
  }
}

}  // namespace nb
