// Sampler: greedy is argmax; seeded sampling repeats; top-k / top-p / min-p never return a token
// outside the allowed set, and the empirical distribution matches the softmax at temperature.
#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

namespace nb {
namespace {

TEST(Sampler, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.1f, 3.0f, -1.0f, 3.0f};
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p);
  EXPECT_EQ(s.sample(logits), 1);
}

TEST(Sampler, SeedRepeats) {
  std::vector<float> logits(1000);
  for (int i = 0; i < 1000; ++i) logits[i] = std::sin(i * 0.37f) * 3;
  SamplingParams p;
  p.seed = 1234;
  p.has_seed = true;
  Sampler a(p), b(p);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(a.sample(logits), b.sample(logits));
}

TEST(Sampler, TopKTopPMinPRestrictTheSet) {
  std::vector<float> logits = {5.0f, 4.0f, 3.0f, 2.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.has_seed = true;
  p.top_k = 3;
  Sampler k3(p);
  for (int i = 0; i < 2000; ++i) ASSERT_LT(k3.sample(logits), 3);
  p.top_k = 0;
  p.top_p = 0.5f;  // softmax(5,4,...) top prob 0.636 >= 0.5: only token 0
  Sampler p5(p);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(p5.sample(logits), 0);
  p.top_p = 1.0f;
  p.min_p = 0.3f;  // p1/p0 = e^-1 = 0.37 kept, p2/p0 = e^-2 = 0.135 dropped
  Sampler m(p);
  for (int i = 0; i < 2000; ++i) ASSERT_LT(m.sample(logits), 2);
}

TEST(Sampler, DistributionMatchesSoftmaxAtTemperature) {
  std::vector<float> logits = {1.0f, 2.0f, 0.5f};
  SamplingParams p;
  p.temperature = 2.0f;
  p.has_seed = true;
  p.seed = 7;
  Sampler s(p);
  std::map<int, int> counts;
  const int n = 200000;
  for (int i = 0; i < n; ++i) counts[s.sample(logits)]++;
  double z = 0;
  for (float l : logits) z += std::exp(l / 2.0);
  for (int i = 0; i < 3; ++i) {
    const double expect = std::exp(logits[i] / 2.0) / z;
    EXPECT_NEAR(counts[i] / double(n), expect, 0.005) << "token " << i;
  }
}

TEST(Sampler, ValidateNamesTheField) {
  SamplingParams p;
  p.top_p = 0;
  EXPECT_NE(p.validate().message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_NE(p.validate().message().find("temperature"), std::string::npos);
  p = {};
  p.min_p = 2;
  EXPECT_NE(p.validate().message().find("min_p"), std::string::npos);
  EXPECT_TRUE(SamplingParams{}.validate().ok());
}

}  // namespace
}  // namespace nb

namespace nb {
namespace {

// Sampling elsewhere (Backend::sample) takes the rule and draw from next(): the same ids as sample() for
// one seed, and greedy requests draw nothing.
TEST(Sampler, NextGivesTheSameStreamAsSample) {
  const std::vector<float> logits = {0.5f, 1.5f, -0.2f, 1.1f, 0.9f, 2.0f};
  SamplingParams p;
  p.temperature = 0.9f, p.top_k = 4, p.top_p = 0.95f, p.seed = 1234, p.has_seed = true;
  Sampler a(p), b(p);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(a.sample(logits), sample_row(logits, b.next()));
  p.temperature = 0.0f;
  EXPECT_EQ(Sampler(p).next().u, 0.0);
  // u = 0 picks the most likely token; u just below 1 the last kept one (top-k 4 in sorted order: 5, 1, 3, 4).
  EXPECT_EQ(sample_row(logits, SampleSpec{1.0f, 1.0f, 4, 0.0f, 0.0}), 5);
  EXPECT_EQ(sample_row(logits, SampleSpec{1.0f, 1.0f, 4, 0.0f, 0.999999}), 4);
}

}  // namespace
}  // namespace nb
