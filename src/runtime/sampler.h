// Sampling parameters and the host sampler: greedy, temperature, top-k, top-p, min-p, seeded.
// The order follows vLLM / llama.cpp: penalties (apply_penalties) -> temperature -> top-k -> top-p -> min-p
// -> draw. The CUDA backend samples on the GPU with the same rules; this is the reference.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "base/status.h"

namespace nb {

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int top_k = 0;             // 0 or -1: all
  float min_p = 0.0f;        // [0, 1]
  uint64_t seed = 0;
  bool has_seed = false;
  // Penalties (OpenAI / vLLM semantics), applied by apply_penalties() before sample().
  float presence_penalty = 0.0f;    // [-2, 2]: subtracted once from every token already generated
  float frequency_penalty = 0.0f;   // [-2, 2]: subtracted per occurrence in the generated tokens
  float repetition_penalty = 1.0f;  // > 0: logits of prompt and generated tokens divided (> 0) or multiplied

  bool greedy() const { return temperature <= 0.0f; }
  // Error naming the field when a value is out of range (the server turns it into a 400).
  Status validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // logits: [vocab] for one sequence. Returns the sampled id: sample_row(logits, next()).
  int32_t sample(std::span<const float> logits);
  // The rule for the next token with its uniform draw, for sampling elsewhere (Backend::sample on the
  // GPU). Greedy requests draw nothing, so a seeded stream is the same either way.
  SampleSpec next();
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

bool has_penalties(const SamplingParams& p);
// In place on one sequence's logits [vocab]: repetition penalty over prompt and output tokens, then
// frequency and presence penalties over the output tokens (vLLM's order).
void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> output);

// Log-probabilities from raw logits [vocab] (log-softmax): the chosen token's, and the top_n best
// (descending, ties by lower id), as the OpenAI logprobs fields report them.
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t id, int top_n);

// The host implementation of SampleSpec (the CPU backend's Backend::sample and the reference for the GPU).
int32_t sample_row(std::span<const float> logits, const SampleSpec& spec);

// Index of the largest logit (lowest index on ties), as greedy decoding and the goldens use.
int32_t argmax(std::span<const float> logits);

}  // namespace nb
