// Golden tests: the CPU forward of each tiny checkpoint under tests/data/models/ against HF transformers
// (reference.json, written by tools/reference/make_goldens.py). Per-position NLL within 0.02, as one
// 64-token batch, as chunks crossing block boundaries with scrambled block tables, and as two sequences
// in one batch; greedy decoding one token per forward through the KV cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/model.h"
#include "support/golden.h"

namespace nb {
namespace {

using test::kMinMargin;
using test::kNllTolerance;
using test::nll_of;

std::string model_dir(const std::string& name) { return test::golden_dir(name); }

int argmax(const float* row, int vocab) { return static_cast<int>(std::max_element(row, row + vocab) - row); }

class Golden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = model_dir(GetParam());
    ASSERT_TRUE(std::filesystem::exists(dir + "/reference.json"))
        << "no golden at " << dir << " (tools/reference/make_goldens.py writes it)";
    std::ifstream f(dir + "/reference.json");
    ref_ = nlohmann::json::parse(f);
    auto m = Model::load(dir, ModelOptions{Device::kCpu, 2});
    ASSERT_TRUE(m.ok()) << m.status().message();
    model_ = std::move(m.value());
    vocab_ = model_->config().vocab_size;
    tokens_ = ref_["tokens"].get<std::vector<int32_t>>();
    ref_nll_ = ref_["nll"].get<std::vector<double>>();
    ASSERT_EQ(tokens_.size(), ref_nll_.size() + 1);
  }

  // Scores tokens_ fed as consecutive chunks of one sequence (all logits); returns max |nll - ref|.
  double chunked_nll_error(const std::vector<int>& chunks, const std::vector<int32_t>& block_table) {
    return test::chunked_nll_error(*model_, tokens_, ref_nll_, chunks, block_table);
  }
  // Max |nll - ref| over the 63 predictions, logits rows starting at `first` row.
  double nll_error(const float* logits, int first) { return test::nll_error(logits, first, vocab_, tokens_, ref_nll_); }

  nlohmann::json ref_;
  std::unique_ptr<Model> model_;
  int vocab_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<double> ref_nll_;
};

// What `nibble serve` sizes its KV cache by: K and V of every layer for one block, in the backend's cache
// dtype (fp32 on the CPU reference).
TEST_P(Golden, KvBlockBytes) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(model_->kv_block_bytes(), int64_t{2} * c.n_layers * kKvBlock * c.n_kv_heads * c.head_dim * 4);
}

TEST_P(Golden, NllOneBatch) {
  const double err = chunked_nll_error({64}, {0, 1, 2, 3});
  std::printf("%s: max NLL error, one batch: %.2e\n", GetParam().c_str(), err);
  EXPECT_LT(err, kNllTolerance);
}

TEST_P(Golden, NllChunksScrambledBlocks) {
  // 10 + 1 + 53: chunk edges inside blocks, n_past > 0, a one-token step, blocks out of order.
  const double err = chunked_nll_error({10, 1, 53}, {6, 2, 7, 0});
  std::printf("%s: max NLL error, chunks 10+1+53: %.2e\n", GetParam().c_str(), err);
  EXPECT_LT(err, kNllTolerance);
}

TEST_P(Golden, NllTwoSequencesOneBatch) {
  // Sequence 0: the first 20 tokens (last logits only); sequence 1: all 64 (every logit).
  auto cache = model_->new_kv_cache(8);
  Batch b;
  b.tokens.assign(tokens_.begin(), tokens_.begin() + 20);
  b.tokens.insert(b.tokens.end(), tokens_.begin(), tokens_.end());
  b.seqs.push_back({{5, 7}, 0, 20, false});
  b.seqs.push_back({{1, 3, 0, 2}, 0, 64, true});
  auto out = model_->forward(b, *cache);
  ASSERT_TRUE(out.ok()) << out.status().message();
  ASSERT_EQ(out->size(), static_cast<size_t>(65 * vocab_));
  EXPECT_LT(std::abs(nll_of(out->data(), vocab_, tokens_[20]) - ref_nll_[19]), kNllTolerance);
  const double err = nll_error(out->data(), 1);
  std::printf("%s: max NLL error, two sequences: %.2e\n", GetParam().c_str(), err);
  EXPECT_LT(err, kNllTolerance);
}

TEST_P(Golden, LastLogitsTop5) {
  auto cache = model_->new_kv_cache(4);
  Batch b{tokens_, {{{0, 1, 2, 3}, 0, 64, false}}};
  auto out = model_->forward(b, *cache);
  ASSERT_TRUE(out.ok()) << out.status().message();
  for (const auto& entry : ref_["last_logits_top5"]) {
    const int id = entry[0].get<int>();
    EXPECT_NEAR((*out)[id], entry[1].get<double>(), 0.02) << "logit of token " << id;
  }
}

TEST_P(Golden, GreedyWithKvCache) {
  const auto& g = ref_["greedy"];
  const std::vector<int32_t> prompt = g["prompt"].get<std::vector<int32_t>>();
  const std::vector<int32_t> want = g["ids"].get<std::vector<int32_t>>();
  const std::vector<double> margins = g["margins"].get<std::vector<double>>();
  const size_t checked =
      std::find_if(margins.begin(), margins.end(), [](double m) { return m < kMinMargin; }) - margins.begin();
  auto cache = model_->new_kv_cache(8);
  const std::vector<int32_t> table = {4, 1, 6};
  Batch b{prompt, {{table, 0, static_cast<int32_t>(prompt.size()), false}}};
  size_t agree = 0;
  for (size_t step = 0; step < want.size(); ++step) {
    auto out = model_->forward(b, *cache);
    ASSERT_TRUE(out.ok()) << out.status().message();
    const int next = argmax(out->data(), vocab_);
    if (step < checked) {
      EXPECT_EQ(next, want[step]) << "greedy step " << step << " (margin " << margins[step] << ")";
    }
    if (next == want[step] && agree == step) ++agree;
    const int32_t past = b.seqs[0].n_past + b.seqs[0].n_new;
    b = Batch{{want[step]}, {{table, past, 1, false}}};  // teacher-force the reference continuation
  }
  std::printf("%s: greedy agrees on %zu/%zu steps (%zu required, first margin < %.2f at step %zu)\n",
              GetParam().c_str(), agree, want.size(), checked, kMinMargin, checked);
}

INSTANTIATE_TEST_SUITE_P(Models, Golden,
                         ::testing::Values("gpt_oss_mxfp4", "qwen3_moe_nvfp4_modelopt", "qwen3_nvfp4_ct",
                                           "llama_bf16"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace nb
