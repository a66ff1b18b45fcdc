// The committed goldens (tests/data/models/*/reference.json, made by tools/reference/make_goldens.py with
// HF transformers) and how a model is scored against them; shared by the CPU and CUDA golden tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/model.h"

namespace nb::test {

inline constexpr double kNllTolerance = 0.02;  // per position, the CI bound
inline constexpr double kMinMargin = 0.05;     // greedy ids must agree up to the first step with a smaller margin

inline std::string golden_dir(const std::string& name) {
  return std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/" + name;
}

// -log softmax(row)[target], in double.
inline double nll_of(const float* row, int vocab, int target) {
  const double m = *std::max_element(row, row + vocab);
  double s = 0;
  for (int i = 0; i < vocab; ++i) s += std::exp(row[i] - m);
  return m + std::log(s) - row[target];
}

// Max |nll - ref_nll| over a golden's predictions (token i + 1 from logits row first + i, rows of vocab).
inline double nll_error(const float* logits, int first, int vocab, const std::vector<int32_t>& tokens,
                        const std::vector<double>& ref_nll) {
  double err = 0;
  for (size_t i = 0; i + 1 < tokens.size(); ++i)
    err = std::max(err, std::abs(nll_of(logits + (first + i) * vocab, vocab, tokens[i + 1]) - ref_nll[i]));
  return err;
}

// The tokens fed to `model` as consecutive chunks of one sequence (all logits) over `block_table`;
// returns nll_error of the concatenated logits.
inline double chunked_nll_error(Model& model, const std::vector<int32_t>& tokens, const std::vector<double>& ref_nll,
                                const std::vector<int>& chunks, const std::vector<int32_t>& block_table) {
  auto cache = model.new_kv_cache(8);
  std::vector<float> logits;
  int32_t past = 0;
  for (int n : chunks) {
    Batch b;
    b.tokens.assign(tokens.begin() + past, tokens.begin() + past + n);
    b.seqs.push_back({block_table, past, n, true});
    auto out = model.forward(b, *cache);
    EXPECT_TRUE(out.ok()) << out.status().message();
    if (!out.ok()) return INFINITY;
    logits.insert(logits.end(), out->begin(), out->end());
    past += n;
  }
  EXPECT_EQ(past, static_cast<int32_t>(tokens.size()));
  return nll_error(logits.data(), 0, model.config().vocab_size, tokens, ref_nll);
}

}  // namespace nb::test
