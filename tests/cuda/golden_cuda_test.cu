// The committed goldens (tests/data/models/*/reference.json, HF transformers) on --device cuda, with the
// same bounds as the CPU golden test in CI: per-position NLL within 0.02 as one batch, as chunks over
// scrambled blocks and as two sequences in one batch; greedy ids through the KV cache equal up to the
// first step whose reference margin is < 0.05. These run with an fp32 KV cache, as the CPU reference
// does; the BF16 and FP8 caches round K and V and are reported with looser bounds. The same bounds hold
// with the tiled prefill attention forced for every step, and chunked prefill matches one-shot prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "model/model.h"
#include "support/golden.h"

namespace nb {
namespace {

using test::kMinMargin;
using test::kNllTolerance;
using test::nll_of;

class GoldenCuda : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!cuda_device_info(0).ok()) GTEST_SKIP() << "no usable GPU";
    dir_ = std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/" + GetParam();
    if (!std::filesystem::exists(dir_ + "/reference.json")) GTEST_SKIP() << "no golden at " << dir_;
    std::ifstream f(dir_ + "/reference.json");
    ref_ = nlohmann::json::parse(f);
    tokens_ = ref_["tokens"].get<std::vector<int32_t>>();
    ref_nll_ = ref_["nll"].get<std::vector<double>>();
    load(DType::kF32);
  }
  // gemm: 0 the default thresholds (hi + lo activations), 1 every linear and MoE layer through the prefill
  // GEMMs (hi + lo), 2 the same with one fp16 per activation, 3 the default thresholds with one fp16 per
  // activation (what a user gets: prefill GEMMs and one-token decode GEMVs round to one fp16).
  void load(DType kv, int gemm = 0, int prefill_attention_min_tokens = 0) {
    ModelOptions o;
    o.device = Device::kCuda;
    o.kv_cache_dtype = kv;
    if (gemm == 1 || gemm == 2) o.gemm_min_tokens = o.moe_gemm_min_tokens = 1;
    o.gemm_fp16_activations = gemm >= 2;
    o.prefill_attention_min_tokens = prefill_attention_min_tokens;
    auto m = Model::load(dir_, o);
    ASSERT_TRUE(m.ok()) << m.status().message();
    model_ = std::move(m.value());
    vocab_ = model_->config().vocab_size;
  }
  double chunked_nll_error(const std::vector<int>& chunks, const std::vector<int32_t>& table) {
    return test::chunked_nll_error(*model_, tokens_, ref_nll_, chunks, table);
  }
  double nll_error(const float* logits, int first) { return test::nll_error(logits, first, vocab_, tokens_, ref_nll_); }

  std::string dir_;
  nlohmann::json ref_;
  std::unique_ptr<Model> model_;
  int vocab_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<double> ref_nll_;
};

TEST_P(GoldenCuda, Nll) {
  const double one = chunked_nll_error({64}, {0, 1, 2, 3});
  const double chunks = chunked_nll_error({10, 1, 53}, {6, 2, 7, 0});
  load(DType::kF32, 3);  // one fp16 per activation, the one-token chunk through the decode GEMVs
  const double fp16 = chunked_nll_error({10, 1, 53}, {6, 2, 7, 0});
  std::printf("%s cuda: max NLL error, one batch %.2e, chunks 10+1+53 %.2e; one fp16 activations, chunks %.2e\n",
              GetParam().c_str(), one, chunks, fp16);
  EXPECT_LT(one, kNllTolerance);
  EXPECT_LT(chunks, kNllTolerance);
  EXPECT_LT(fp16, kNllTolerance);
}

// The prompts (64 tokens) are below the default GEMM thresholds in places, so force the prefill GEMMs
// (kernels/gemm_fp4.cu, moe_gemm.cu; on sm_90a their wgmma tile) for every FP4 linear and MoE layer: both
// activation modes keep the CI bound (one fp16, the default, measured at 7e-3 .. 1.2e-2; hi + lo ~1.5e-4).
TEST_P(GoldenCuda, NllThroughPrefillGemms) {
  load(DType::kF32, 1);
  const double one = chunked_nll_error({64}, {0, 1, 2, 3});
  const double chunks = chunked_nll_error({10, 1, 53}, {6, 2, 7, 0});
  load(DType::kF32, 2);
  const double fp16 = chunked_nll_error({64}, {0, 1, 2, 3});
  std::printf("%s cuda, prefill GEMMs: max NLL error, one batch %.2e, chunks %.2e; fp16 activations %.2e\n",
              GetParam().c_str(), one, chunks, fp16);
  EXPECT_LT(one, kNllTolerance);
  EXPECT_LT(chunks, kNllTolerance);
  EXPECT_LT(fp16, kNllTolerance);
}

TEST_P(GoldenCuda, TwoSequencesOneBatch) {
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
  EXPECT_LT(nll_error(out->data(), 1), kNllTolerance);
}

// Greedy decoding through the KV cache, with hi + lo activations and with one fp16 (the default in use).
TEST_P(GoldenCuda, GreedyWithKvCache) {
  for (int gemm : {0, 3}) {
    load(DType::kF32, gemm);
    const auto& g = ref_["greedy"];
    const std::vector<int32_t> prompt = g["prompt"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = g["ids"].get<std::vector<int32_t>>();
    const std::vector<double> margins = g["margins"].get<std::vector<double>>();
    const size_t checked =
        std::find_if(margins.begin(), margins.end(), [](double m) { return m < kMinMargin; }) - margins.begin();
    auto cache = model_->new_kv_cache(8);
    const std::vector<int32_t> table = {4, 1, 6};
    Batch b{prompt, {{table, 0, static_cast<int32_t>(prompt.size()), false}}};
    for (size_t step = 0; step < want.size(); ++step) {
      auto out = model_->forward(b, *cache);
      ASSERT_TRUE(out.ok()) << out.status().message();
      const int next = static_cast<int>(std::max_element(out->begin(), out->end()) - out->begin());
      if (step < checked) EXPECT_EQ(next, want[step]) << "greedy step " << step << (gemm ? ", one fp16" : "");
      const int32_t past = b.seqs[0].n_past + b.seqs[0].n_new;
      b = Batch{{want[step]}, {{table, past, 1, false}}};
    }
  }
}

// The decode loop of async scheduling: each step queued before the previous step's ids are read, its tokens
// named by their rows in those ids (-1 - row, read on the device by the embedding inside the step's CUDA graph),
// gives the ids of a loop that copies the logits to the host, samples them on a separate backend and sends the
// ids back. Two sequences, so the rows matter: row 0 greedy, row 1 drawn (temperature, top-p, a new u every
// step); the last steps all greedy (without the draw's kernel); enough steps for the graph's eager run, capture
// and replays.
TEST_P(GoldenCuda, QueuedStepsReadTheirTokensOnTheDevice) {
  const std::vector<int32_t> prompt = ref_["greedy"]["prompt"].get<std::vector<int32_t>>();
  const int32_t n0 = static_cast<int32_t>(prompt.size()), n1 = std::max<int32_t>(1, n0 / 2);
  const std::vector<int32_t> t0 = {0, 1, 2, 3}, t1 = {4, 5, 6, 7};
  constexpr int kSteps = 14, kDrawnSteps = 9;
  auto first = [&] {
    Batch b{prompt, {{t0, 0, n0, false}, {t1, 0, n1, false}}};
    b.tokens.insert(b.tokens.end(), prompt.rbegin(), prompt.rbegin() + n1);  // the second prompt: reversed
    return b;
  };
  auto next = [&](int step, std::vector<int32_t> tokens) {
    return Batch{std::move(tokens), {{t0, n0 + step, 1, false}, {t1, n1 + step, 1, false}}};
  };
  auto specs_at = [&](int step) {  // step -1: the prompt's
    std::vector<SampleSpec> s(2);
    if (step < kDrawnSteps) s[1] = SampleSpec{0.9f, 0.95f, 0, 0.0f, std::fmod(0.37 * (step + 2), 1.0)};
    return s;
  };
  auto sampler = CudaBackend::create(CudaBackendOptions{});
  ASSERT_TRUE(sampler.ok()) << sampler.status().message();
  std::vector<int32_t> host_ids, queued_ids;
  int not_argmax = 0;  // row 1's draws that are not its argmax (reported: the draw's kernel made a difference)
  {
    auto cache = model_->new_kv_cache(8);
    auto sample = [&](const Batch& b, int step) {
      auto logits = model_->forward(b, *cache);
      if (!logits.ok()) {
        ADD_FAILURE() << logits.status().message();
        return std::vector<int32_t>(2, 0);
      }
      const Tensor l = (*sampler)->upload(TensorView{logits->data(), DType::kF32, {2, vocab_}, Device::kCpu});
      std::vector<int32_t> ids = (*sampler)->sample(l, specs_at(step));
      not_argmax += ids[1] != std::max_element(logits->begin() + vocab_, logits->end()) - (logits->begin() + vocab_);
      return ids;
    };
    std::vector<int32_t> ids = sample(first(), -1);
    for (int step = 0; step < kSteps; ++step) {
      host_ids.insert(host_ids.end(), ids.begin(), ids.end());
      ids = sample(next(step, ids), step);
    }
  }
  {
    auto cache = model_->new_kv_cache(8);
    ASSERT_TRUE(model_->enqueue_sampled(first(), *cache, specs_at(-1)).ok());
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(model_->enqueue_sampled(next(step, {-1, -2}), *cache, specs_at(step)).ok());
      const std::vector<int32_t> ids = model_->wait_sampled();
      queued_ids.insert(queued_ids.end(), ids.begin(), ids.end());
    }
    model_->wait_sampled();
    // A row the last step did not sample is refused, naming it.
    auto bad = model_->forward_sampled(next(kSteps, {-1, -3}), *cache, specs_at(kSteps));
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("names row 2"), std::string::npos) << bad.status().message();
  }
  EXPECT_EQ(queued_ids, host_ids);
  std::printf("%s cuda, queued steps: %d of %d draws not the argmax\n", GetParam().c_str(), not_argmax, kDrawnSteps + 1);
}

// The tiled prefill attention for every step (one-token steps included): one batch, chunks of many sizes
// through the cached prefix (the gpt-oss model's window is 8, so most chunks start past it).
TEST_P(GoldenCuda, TiledAttentionEverywhere) {
  load(DType::kF32, 0, 1);
  const double one = chunked_nll_error({64}, {0, 1, 2, 3});
  const double chunks = chunked_nll_error({10, 1, 53}, {6, 2, 7, 0});
  const double small = chunked_nll_error({5, 7, 3, 9, 17, 6, 17}, {3, 0, 7, 5});
  std::printf("%s cuda, tiled attention: max NLL error, one batch %.2e, chunks 10+1+53 %.2e, 5+7+3+9+17+6+17 %.2e\n",
              GetParam().c_str(), one, chunks, small);
  EXPECT_LT(one, kNllTolerance);
  EXPECT_LT(chunks, kNllTolerance);
  EXPECT_LT(small, kNllTolerance);
}

// Chunked prefill (default dispatch: chunks below the tiled kernel's threshold take the split kernel)
// equals one-shot prefill well inside the golden bound: a logit difference e moves an NLL by at most 2 e.
TEST_P(GoldenCuda, ChunkedEqualsOneShot) {
  auto logits_of = [&](const std::vector<int>& chunks) {
    auto cache = model_->new_kv_cache(8);
    std::vector<float> all;
    int32_t past = 0;
    for (int n : chunks) {
      Batch b;
      b.tokens.assign(tokens_.begin() + past, tokens_.begin() + past + n);
      b.seqs.push_back({{2, 0, 3, 1}, past, n, true});
      auto out = model_->forward(b, *cache);
      EXPECT_TRUE(out.ok()) << out.status().message();
      if (out.ok()) all.insert(all.end(), out->begin(), out->end());
      past += n;
    }
    return all;
  };
  const std::vector<float> one = logits_of({64});
  for (const std::vector<int>& chunks : {std::vector<int>{40, 24}, std::vector<int>{5, 59}, std::vector<int>{61, 3}}) {
    const std::vector<float> got = logits_of(chunks);
    ASSERT_EQ(got.size(), one.size());
    double err = 0;
    for (size_t i = 0; i < one.size(); ++i) err = std::max(err, double(std::abs(one[i] - got[i])));
    std::printf("%s cuda: chunks %d+%d vs one batch: max |logit difference| %.2e\n", GetParam().c_str(), chunks[0],
                chunks[1], err);
    EXPECT_LT(err, 2e-3);
  }
}

TEST_P(GoldenCuda, RoundedKvCachesReported) {
  for (DType kv : {DType::kBF16, DType::kF8_E4M3}) {
    load(kv);
    const double err = chunked_nll_error({64}, {0, 1, 2, 3});
    std::printf("%s cuda, %s kv cache: max NLL error %.2e\n", GetParam().c_str(),
                std::string(dtype_name(kv)).c_str(), err);
    // Reported, not bounded by the CI tolerance: K/V rounding (2^-9 relative in BF16, 2^-4 in E4M3 without a
    // scale) moves the large logits of these tiny random models by up to ~1 nat.
    EXPECT_TRUE(std::isfinite(err));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenCuda,
                         ::testing::Values("gpt_oss_mxfp4", "qwen3_moe_nvfp4_modelopt", "qwen3_nvfp4_ct",
                                           "llama_bf16"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace nb
