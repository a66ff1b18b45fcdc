// Random inputs shared by the op tests (CPU and CUDA): one generator per test binary, seeded fresh every
// run with the seed printed, so a failure can be replayed with NIBBLE_TEST_SEED=<seed>.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "base/tensor.h"

namespace nb::test {

inline std::mt19937& rng() {
  static std::mt19937 g = [] {
    const char* fixed = std::getenv("NIBBLE_TEST_SEED");
    const unsigned seed = fixed ? static_cast<unsigned>(std::strtoul(fixed, nullptr, 10)) : std::random_device{}();
    std::printf("%s seed %u (NIBBLE_TEST_SEED=%u replays it)\n", program_invocation_short_name, seed, seed);
    return std::mt19937(seed);
  }();
  return g;
}

inline std::vector<float> randn(int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng());
  return v;
}

// Host storage for weights built in a test; the views point into it.
struct HostBytes {
  std::vector<std::vector<uint8_t>> blocks;
  TensorView add(std::vector<uint8_t> bytes, DType dt, std::vector<int64_t> shape) {
    blocks.push_back(std::move(bytes));
    return TensorView{blocks.back().data(), dt, std::move(shape)};
  }
};

}  // namespace nb::test
