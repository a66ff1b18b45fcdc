// Penalties and logprobs added to the sampler path: repetition over prompt and output, frequency and
// presence over the output only (vLLM semantics), range validation, and log-softmax logprobs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "runtime/sampler.h"

namespace nb {
namespace {

TEST(Penalties, RepetitionFrequencyPresence) {
  std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  const std::vector<int32_t> prompt = {0, 1};
  const std::vector<int32_t> output = {2, 2, 1};
  apply_penalties(logits, p, prompt, output);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);                  // prompt only: repetition divides a positive logit
  EXPECT_FLOAT_EQ(logits[1], -4.0f - 0.5f - 0.25f);  // negative logit multiplied, then once in output
  EXPECT_FLOAT_EQ(logits[2], 0.5f - 1.0f - 0.25f);   // twice in output
  EXPECT_FLOAT_EQ(logits[3], 0.5f);                  // untouched
}

TEST(Penalties, Validation) {
  SamplingParams p;
  EXPECT_TRUE(p.validate().ok());
  EXPECT_FALSE(has_penalties(p));
  p.presence_penalty = 2.5f;
  EXPECT_FALSE(p.validate().ok());
  p.presence_penalty = 0;
  p.frequency_penalty = -3;
  EXPECT_FALSE(p.validate().ok());
  p.frequency_penalty = 0;
  p.repetition_penalty = 0;
  EXPECT_FALSE(p.validate().ok());
}

TEST(Logprobs, LogSoftmaxAndTop) {
  std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f};
  TokenLogprobs lp = token_logprobs(logits, 2, 3);
  double z = 0;
  for (float l : logits) z += std::exp(l);
  EXPECT_NEAR(lp.logprob, 2.0 - std::log(z), 1e-5);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // ties: lower id first
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 2);
  EXPECT_NEAR(lp.top[2].second, lp.logprob, 1e-6);
  EXPECT_TRUE(token_logprobs(logits, 0, 0).top.empty());
}

}  // namespace
}  // namespace nb
