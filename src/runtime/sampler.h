// Sampling parameters and the host sampler: greedy, temperature, top-k, top-p, min-p, seeded.
// The order follows vLLM / llama.cpp: penalties -> temperature -> top-k -> top-p -> min-p -> draw.
// The CUDA backend samples on the GPU with the same rules; this is the reference.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>

#include "base/status.h"

namespace nb {

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int top_k = 0;             // 0 or -1: all
  float min_p = 0.0f;        // [0, 1]
  uint64_t seed = 0;
  bool has_seed = false;

  bool greedy() const { return temperature <= 0.0f; }
  // Error naming the field when a value is out of range (the server turns it into a 400).
  Status validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // logits: [vocab] for one sequence. Returns the sampled id.
  int32_t sample(std::span<const float> logits);
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

// Index of the largest logit (lowest index on ties), as greedy decoding and the goldens use.
int32_t argmax(std::span<const float> logits);

}  // namespace nb
