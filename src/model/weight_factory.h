// Load-time weight producers a device backend can offer the loader: random weights of a config's shapes
// (--dummy-weights, for benchmarking shapes whose files are not at hand) and re-quantization of dense
// layers (--dense-format). The CPU reference backend offers neither.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/weight.h"

namespace nb {

// --dense-format: what the dense BF16 attention projections and lm_head become at load time.
enum class DenseFormat : uint8_t { kKeep, kFP8, kMXFP4, kNVFP4 };
const char* dense_format_name(DenseFormat f);

class WeightFactory {
 public:
  virtual ~WeightFactory() = default;
  // A random [n, k] weight stored in `format` whose values have standard deviation about `std`, with
  // realistic block scales; the bytes live on the device and are owned by the factory.
  virtual Weight random_weight(WeightFormat format, int64_t n, int64_t k, float std, uint64_t seed,
                               const std::string& name) = 0;
  // mean + uniform noise of standard deviation std (norm weights, biases, sinks).
  virtual Tensor random_floats(const std::vector<int64_t>& shape, float mean, float std, uint64_t seed) = 0;
  // `w` re-quantized to `format` (FP8 per-row scale, MXFP4, NVFP4 with the ModelOpt recipe).
  virtual Result<Weight> requantize(const Weight& w, WeightFormat format) = 0;
};

}  // namespace nb
