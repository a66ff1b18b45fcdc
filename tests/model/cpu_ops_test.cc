// CPU backend ops against direct formulas written independently here: RoPE tables (YaRN numbers of
// formats.md §2.6, llama3 §6.1), attention with sinks, sliding window and paged blocks, FP4 linear vs
// dequantize-then-matmul, routing and experts. Fresh random inputs each run; the seed is printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numbers>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "model/rope.h"
#include "support/random_inputs.h"

namespace nb {
namespace {

using test::HostBytes;
using test::randn;
using test::rng;

Tensor to_tensor(CpuBackend& be, const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t = be.alloc(DType::kF32, std::move(shape));
  NB_CHECK(t.numel() == static_cast<int64_t>(v.size()));
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

RopeConfig gpt_oss_rope() {
  RopeConfig r;
  r.type = RopeType::kYarn;
  r.theta = 150000;
  r.factor = 32;
  r.beta_fast = 32;
  r.beta_slow = 1;
  r.truncate = false;
  r.original_max_position_embeddings = 4096;
  return r;
}

TEST(Rope, YarnMatchesFormatsDoc) {
  const YarnRange r = yarn_correction_range(gpt_oss_rope(), 64);
  EXPECT_NEAR(r.low, 8.0928, 1e-4);
  EXPECT_NEAR(r.high, 17.3980, 1e-4);
  const RopeTable t = make_rope_table(gpt_oss_rope(), 64);
  EXPECT_NEAR(t.attention_scale, 1.34657, 1e-5);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double extrapolation = 1.0 / std::pow(150000.0, 2.0 * i / 64), interpolation = extrapolation / 32;
    const double ramp = std::clamp((i - r.low) / (r.high - r.low), 0.0, 1.0);
    EXPECT_NEAR(t.inv_freq[i], interpolation * ramp + extrapolation * (1 - ramp), 1e-6 * extrapolation) << i;
  }
  EXPECT_FLOAT_EQ(t.inv_freq[0], 1.0f);                                          // below low: extrapolation
  EXPECT_NEAR(t.inv_freq[31], 1.0 / std::pow(150000.0, 62.0 / 64) / 32, 1e-12);  // above high: interpolation
}

TEST(Rope, Llama3Scaling) {
  RopeConfig r;
  r.type = RopeType::kLlama3;
  r.theta = 500000;
  r.factor = 8;
  r.low_freq_factor = 1;
  r.high_freq_factor = 4;
  r.original_max_position_embeddings = 8192;
  const RopeTable t = make_rope_table(r, 128);
  EXPECT_EQ(t.attention_scale, 1.0f);
  int kept = 0, divided = 0, smoothed = 0;
  for (int i = 0; i < 64; ++i) {
    const double f = 1.0 / std::pow(500000.0, 2.0 * i / 128), wavelen = 2 * std::numbers::pi / f;
    double want;
    if (wavelen < 8192.0 / 4) {
      want = f, ++kept;
    } else if (wavelen > 8192.0) {
      want = f / 8, ++divided;
    } else {
      const double s = (8192.0 / wavelen - 1) / (4 - 1);
      want = (1 - s) * f / 8 + s * f, ++smoothed;
    }
    EXPECT_NEAR(t.inv_freq[i], want, 1e-6 * f) << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
}

TEST(Rope, RotatesHalfSplitPairs) {
  CpuBackend be(2);
  BatchInfo b;
  b.tokens = {0, 0};
  b.positions = {0, 5};
  RopeTable table{{0.5f, 0.25f}, 2.0f};
  std::vector<float> v = randn(2 * 1 * 4);
  Tensor x = to_tensor(be, v, {2, 1, 4});
  be.rope(x, b, table);
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 2; ++i) {
      const double a = b.positions[t] * table.inv_freq[i], x1 = v[t * 4 + i], x2 = v[t * 4 + i + 2];
      EXPECT_NEAR(x.data<float>()[t * 4 + i], 2 * (x1 * std::cos(a) - x2 * std::sin(a)), 1e-5);
      EXPECT_NEAR(x.data<float>()[t * 4 + i + 2], 2 * (x2 * std::cos(a) + x1 * std::sin(a)), 1e-5);
    }
}

// Two sequences with scrambled block tables; attention over the cache vs the direct formula on the
// unpaged K/V, with and without sinks and a sliding window.
TEST(Attention, SinksWindowPagedMatchesDirect) {
  CpuBackend be(2);
  const int n_heads = 4, n_kv = 2, hd = 8, group = n_heads / n_kv;
  const std::vector<int> lens = {37, 20};
  const std::vector<std::vector<int32_t>> tables = {{5, 0, 7}, {2, 6}};
  auto cache = be.new_kv_cache(1, 8, n_kv, hd);
  BatchInfo b;
  for (int s = 0; s < 2; ++s) {
    b.seqs.push_back({static_cast<int32_t>(b.tokens.size()), lens[s], 0, tables[s]});
    for (int i = 0; i < lens[s]; ++i) {
      b.tokens.push_back(0);
      b.positions.push_back(i);
      b.seq_of.push_back(s);
    }
  }
  const int64_t T = b.n_tokens();
  const std::vector<float> q = randn(T * n_heads * hd), k = randn(T * n_kv * hd), v = randn(T * n_kv * hd);
  const std::vector<float> sinks = randn(n_heads, 2.0f);
  be.kv_write(*cache, 0, to_tensor(be, k, {T, n_kv, hd}), to_tensor(be, v, {T, n_kv, hd}), b);
  const Tensor sink_t = to_tensor(be, sinks, {n_heads});
  for (int window : {0, 5, 16}) {
    for (bool with_sinks : {false, true}) {
      const float scale = 0.35f;
      Tensor out = be.attention(to_tensor(be, q, {T, n_heads, hd}), *cache, 0, b,
                                {scale, window, with_sinks ? &sink_t : nullptr});
      double max_err = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int s = b.seq_of[t], p = b.positions[t], begin = b.seqs[s].begin;
        for (int h = 0; h < n_heads; ++h) {
          std::vector<double> logit;
          std::vector<int> keys;
          for (int kp = 0; kp <= p; ++kp) {
            if (window > 0 && kp <= p - window) continue;
            double l = 0;
            for (int d = 0; d < hd; ++d)
              l += q[(t * n_heads + h) * hd + d] * k[((begin + kp) * n_kv + h / group) * hd + d];
            logit.push_back(l * scale);
            keys.push_back(kp);
          }
          double m = with_sinks ? sinks[h] : -1e30;
          for (double l : logit) m = std::max(m, l);
          double den = with_sinks ? std::exp(sinks[h] - m) : 0;
          for (double l : logit) den += std::exp(l - m);
          for (int d = 0; d < hd; ++d) {
            double o = 0;
            for (size_t j = 0; j < keys.size(); ++j)
              o += std::exp(logit[j] - m) / den * v[((begin + keys[j]) * n_kv + h / group) * hd + d];
            max_err = std::max(max_err, std::abs(o - out.data<float>()[(t * n_heads + h) * hd + d]));
          }
        }
      }
      EXPECT_LT(max_err, 1e-5) << "window " << window << " sinks " << with_sinks;
    }
  }
}

// Builds a random [n, k] weight in `format`, returning it and its exact dequantized values (decoded
// here block by block with formats/, independently of dequantize_row).
struct TestWeight {
  Weight w;
  std::vector<float> dense;  // [n, k]
  std::vector<uint8_t> codes, scales;
};

TestWeight make_weight(WeightFormat format, int64_t n, int64_t k, fmt::GlobalScale convention) {
  TestWeight t;
  const std::vector<float> src = randn(n * k);
  t.dense.resize(n * k);
  t.codes.resize(n * k / 2);
  WeightPart part;
  part.rows = n;
  if (format == WeightFormat::kMXFP4) {
    t.scales.resize(n * k / 32);
    for (int64_t b = 0; b < n * k / 32; ++b) {
      t.scales[b] = fmt::mxfp4_encode_block(&src[b * 32], &t.codes[b * 16]);
      fmt::mxfp4_decode_block(&t.codes[b * 16], t.scales[b], &t.dense[b * 32]);
    }
    part.scales = {t.scales.data(), DType::kU8, {n, k / 32}};
  } else {
    t.scales.resize(n * k / 16);
    const float s2 = fmt::nvfp4_global_scale(4.0f);
    part.global_scale = convention == fmt::GlobalScale::kMultiply ? s2 : 1.0f / s2;
    part.convention = convention;
    for (int64_t b = 0; b < n * k / 16; ++b) {
      t.scales[b] = fmt::nvfp4_encode_block(&src[b * 16], s2, &t.codes[b * 8]);
      fmt::nvfp4_decode_block(&t.codes[b * 8], t.scales[b], part.global_scale, convention, &t.dense[b * 16]);
    }
    part.scales = {t.scales.data(), DType::kF8_E4M3, {n, k / 16}};
  }
  part.data = {t.codes.data(), DType::kU8, {n, k / 2}};
  t.w.format = format;
  t.w.n = n;
  t.w.k = k;
  t.w.parts.push_back(part);
  return t;
}

void expect_linear_matches(WeightFormat format, fmt::GlobalScale convention) {
  CpuBackend be(2);
  const int64_t T = 5, n = 48, k = 96;
  TestWeight tw = make_weight(format, n, k, convention);
  const std::vector<float> x = randn(T * k), bias = randn(n);
  const Tensor bias_t = to_tensor(be, bias, {n});
  Tensor y = be.linear(to_tensor(be, x, {T, k}), tw.w, &bias_t);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < n; ++j) {
      double want = bias[j];
      for (int64_t i = 0; i < k; ++i) want += double{x[t * k + i]} * tw.dense[j * k + i];
      ASSERT_NEAR(y.data<float>()[t * n + j], want, 1e-4 * (1 + std::abs(want))) << "t " << t << " row " << j;
    }
}

TEST(Linear, Mxfp4MatchesDequantizeThenMatmul) { expect_linear_matches(WeightFormat::kMXFP4, {}); }
TEST(Linear, Nvfp4ModeloptMatchesDequantizeThenMatmul) {
  expect_linear_matches(WeightFormat::kNVFP4, fmt::GlobalScale::kMultiply);
}
TEST(Linear, Nvfp4CompressedTensorsMatchesDequantizeThenMatmul) {
  expect_linear_matches(WeightFormat::kNVFP4, fmt::GlobalScale::kDivide);
}

// NIBBLE_GEMM_FP8=1's emulation (CpuBackend fp8_emulation: the sm_90a FP8 GEMMs' roundings) against the rule
// written here from scratch: each token row to 4 significant bits at one power-of-two scale (its max |x| in
// [2^7, 2^8) of E4M3's range, so small entries may land in E4M3's subnormals), each weight e2m1 * block scale
// rounded to 4 significant bits (exact for MXFP4; NVFP4 products like 1.5 * 1.125 round), the NVFP4 global
// factor on the sum. Random normal weights keep every block within E4M3's normal range of its row's fold.
void expect_fp8_emulation(WeightFormat format, fmt::GlobalScale convention) {
  CpuBackend exact(2), emulated(2, /*fp8_emulation=*/true);
  const int64_t T = 4, n = 40, k = 128;
  TestWeight tw = make_weight(format, n, k, convention);
  std::vector<float> x = randn(T * k);
  x[k + 3] = 200.0f;  // a row whose other entries keep few bits (some subnormal in E4M3)
  const std::vector<float> bias = randn(n);
  const Tensor bias_t = to_tensor(emulated, bias, {n});
  const Tensor y = emulated.linear(to_tensor(emulated, x, {T, k}), tw.w, &bias_t);
  const Tensor y_exact = exact.linear(to_tensor(exact, x, {T, k}), tw.w, &bias_t);
  auto to_e4m3_at = [](double v, int s) {  // v * 2^s rounded to E4M3, scaled back
    return std::ldexp(double{fmt::e4m3_to_float(fmt::float_to_e4m3(static_cast<float>(std::ldexp(v, s))))}, -s);
  };
  auto four_bits = [&](double v) {  // v rounded to 4 significant bits
    int e = 0;
    std::frexp(v, &e);  // |v| in [2^(e-1), 2^e): scaled into [1, 2), E4M3's normal range
    return v == 0 ? 0.0 : to_e4m3_at(v, 1 - e);
  };
  const float global = format == WeightFormat::kMXFP4 ? 1.0f
                       : convention == fmt::GlobalScale::kMultiply ? tw.w.parts[0].global_scale
                                                                   : 1.0f / tw.w.parts[0].global_scale;
  int changed = 0;
  for (int64_t t = 0; t < T; ++t) {
    float mx = 0;
    for (int64_t i = 0; i < k; ++i) mx = std::max(mx, std::abs(x[t * k + i]));
    int e = 0;
    std::frexp(mx, &e);
    for (int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double wv = tw.dense[j * k + i] / global;  // e2m1 * block scale, exact
        want += to_e4m3_at(x[t * k + i], 8 - e) * four_bits(wv);
      }
      want = want * global + bias[j];
      const float got = y.data<float>()[t * n + j];
      ASSERT_NEAR(got, want, 1e-5 * (1 + std::abs(want))) << "t " << t << " row " << j;
      changed += got != y_exact.data<float>()[t * n + j];
    }
  }
  EXPECT_GT(changed, T * n / 2) << "the emulation changed too few outputs";
}

TEST(Linear, Fp8EmulationMxfp4) { expect_fp8_emulation(WeightFormat::kMXFP4, {}); }
TEST(Linear, Fp8EmulationNvfp4BothConventions) {
  expect_fp8_emulation(WeightFormat::kNVFP4, fmt::GlobalScale::kMultiply);
  expect_fp8_emulation(WeightFormat::kNVFP4, fmt::GlobalScale::kDivide);
}

TEST(Linear, DenseBf16AndMultiPart) {
  CpuBackend be(2);
  const int64_t k = 8;
  std::vector<uint16_t> a(3 * k), b(2 * k);
  std::vector<float> dense;
  for (auto* part : {&a, &b})
    for (uint16_t& h : *part) {
      h = fmt::float_to_bf16(randn(1)[0]);
      dense.push_back(fmt::bf16_to_float(h));
    }
  Weight w;
  w.n = 5;
  w.k = k;
  w.parts.push_back({3, {a.data(), DType::kBF16, {3, k}}, {}, 1.0f, {}, "a"});
  w.parts.push_back({2, {b.data(), DType::kBF16, {2, k}}, {}, 1.0f, {}, "b"});
  const std::vector<float> x = randn(k);
  Tensor y = be.linear(to_tensor(be, x, {1, k}), w, nullptr);
  for (int j = 0; j < 5; ++j) {
    double want = 0;
    for (int i = 0; i < k; ++i) want += double{x[i]} * dense[j * k + i];
    EXPECT_NEAR(y.data<float>()[j], want, 1e-5);
  }
}

TEST(Norm, RmsNorm) {
  CpuBackend be(1);
  const std::vector<float> x = randn(3 * 16), w = randn(16);
  Tensor y = be.rms_norm(to_tensor(be, x, {3, 16}), to_tensor(be, w, {16}), 1e-5f);
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int i = 0; i < 16; ++i) ms += double{x[r * 16 + i]} * x[r * 16 + i] / 16;
    for (int i = 0; i < 16; ++i)
      EXPECT_NEAR(y.data<float>()[r * 16 + i], w[i] * x[r * 16 + i] / std::sqrt(ms + 1e-5), 1e-5);
  }
}

TEST(Moe, RoutingBothKinds) {
  CpuBackend be(1);
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f, 0.7f, 3.0f};
  const Tensor l = to_tensor(be, logits, {1, 6});
  // Top-2 = experts 5 (3.0) and 1 (2.0).
  Routes a = be.moe_route(l, 2, RouterKind::kTopKThenSoftmax, false);
  EXPECT_EQ(a.ids.data<int32_t>()[0], 5);
  EXPECT_EQ(a.ids.data<int32_t>()[1], 1);
  EXPECT_NEAR(a.weights.data<float>()[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  double z = 0;
  for (float v : logits) z += std::exp(v);
  Routes b = be.moe_route(l, 2, RouterKind::kSoftmaxThenTopK, false);
  EXPECT_NEAR(b.weights.data<float>()[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(b.weights.data<float>()[1], std::exp(2.0) / z, 1e-6);
  Routes c = be.moe_route(l, 2, RouterKind::kSoftmaxThenTopK, true);
  EXPECT_NEAR(c.weights.data<float>()[0], a.weights.data<float>()[0], 1e-6);
}

// NaN logits rank as -inf, ties to the lower id: ids stay in range and distinct (a broken router must not
// index past the expert table).
TEST(Moe, RoutingNonFiniteLogits) {
  CpuBackend be(1);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const Tensor l = to_tensor(be, {nan, 1.0f, -inf, nan, 2.0f, nan}, {1, 6});
  Routes a = be.moe_route(l, 4, RouterKind::kTopKThenSoftmax, false);
  const std::vector<int32_t> want = {4, 1, 0, 2};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(a.ids.data<int32_t>()[i], want[i]) << i;
}

// Experts vs a direct loop, for gpt-oss (interleaved, clamped, biased) and Qwen3 (halves, SiLU).
TEST(Moe, ExpertsMatchDirect) {
  CpuBackend be(2);
  const int n_experts = 3, d = 32, f = 32, T = 4, top_k = 2;
  for (bool gpt_oss : {true, false}) {
    MoeExperts ex;
    ex.n_experts = n_experts;
    ex.d_expert = f;
    ex.layout = gpt_oss ? GluLayout::kInterleaved : GluLayout::kHalves;
    std::vector<TestWeight> keep;
    for (int e = 0; e < n_experts; ++e) {
      keep.push_back(make_weight(WeightFormat::kMXFP4, 2 * f, d, {}));
      keep.push_back(make_weight(WeightFormat::kNVFP4, d, f, fmt::GlobalScale::kMultiply));
    }
    for (int e = 0; e < n_experts; ++e) ex.fc1.push_back(keep[2 * e].w), ex.fc2.push_back(keep[2 * e + 1].w);
    const std::vector<float> b1 = randn(n_experts * 2 * f), b2 = randn(n_experts * d);
    if (gpt_oss)
      ex.fc1_bias = to_tensor(be, b1, {n_experts, 2 * f}), ex.fc2_bias = to_tensor(be, b2, {n_experts, d});
    const std::vector<float> x = randn(T * d, 2.0f);
    Routes r{be.alloc(DType::kI32, {T, top_k}),
             to_tensor(be, {0.7f, 0.3f, 0.5f, 0.5f, 0.9f, 0.1f, 0.2f, 0.8f}, {T, top_k})};
    const std::vector<int32_t> ids = {0, 2, 1, 0, 2, 1, 1, 2};
    std::copy(ids.begin(), ids.end(), r.ids.data<int32_t>());
    const GluParams glu{gpt_oss ? Activation::kGptOssClamped : Activation::kSilu, 7.0f};
    Tensor y = be.moe_experts(to_tensor(be, x, {T, d}), r, ex, glu);
    for (int t = 0; t < T; ++t) {
      std::vector<double> want(d, 0.0);
      for (int i = 0; i < top_k; ++i) {
        const int e = ids[t * top_k + i];
        const std::vector<float>& w1 = keep[2 * e].dense;
        const std::vector<float>& w2 = keep[2 * e + 1].dense;
        std::vector<double> h(2 * f), a(f);
        for (int j = 0; j < 2 * f; ++j) {
          h[j] = gpt_oss ? b1[e * 2 * f + j] : 0.0;
          for (int c = 0; c < d; ++c) h[j] += double{x[t * d + c]} * w1[j * d + c];
        }
        for (int j = 0; j < f; ++j) {
          if (gpt_oss) {
            const double g = std::min(h[2 * j], 7.0), u = std::clamp(h[2 * j + 1], -7.0, 7.0);
            a[j] = g / (1 + std::exp(-1.702 * g)) * (u + 1);
          } else {
            a[j] = h[j] / (1 + std::exp(-h[j])) * h[f + j];
          }
        }
        for (int c = 0; c < d; ++c) {
          double o = gpt_oss ? b2[e * d + c] : 0.0;
          for (int j = 0; j < f; ++j) o += a[j] * w2[c * f + j];
          want[c] += r.weights.data<float>()[t * top_k + i] * o;
        }
      }
      for (int c = 0; c < d; ++c)
        EXPECT_NEAR(y.data<float>()[t * d + c], want[c], 1e-3 * (1 + std::abs(want[c])))
            << gpt_oss << " " << t;
    }
  }
}

}  // namespace
}  // namespace nb

namespace nb {
namespace {

TEST(Norm, AddRmsNormAddsInPlaceThenNorms) {
  CpuBackend be(1);
  const std::vector<float> x = randn(3 * 16), y = randn(3 * 16), w = randn(16);
  Tensor tx = to_tensor(be, x, {3, 16});
  Tensor out = be.add_rms_norm(tx, to_tensor(be, y, {3, 16}), to_tensor(be, w, {16}), 1e-5f);
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int i = 0; i < 16; ++i) ms += double{x[r * 16 + i] + y[r * 16 + i]} * (x[r * 16 + i] + y[r * 16 + i]) / 16;
    for (int i = 0; i < 16; ++i) {
      const float sum = x[r * 16 + i] + y[r * 16 + i];
      EXPECT_EQ(tx.data<float>()[r * 16 + i], sum);
      EXPECT_NEAR(out.data<float>()[r * 16 + i], w[i] * sum / std::sqrt(ms + 1e-5), 1e-5);
    }
  }
}

// The fused QKV epilogue against direct formulas: per-head RMSNorm, then the half-split rotation by
// position * inv_freq (scaled by attention_scale), q returned, k and v at their paged slots.
TEST(Attention, QkvRopeKvWriteMatchesDirect) {
  CpuBackend be(1);
  const int nh = 4, nkv = 2, hd = 8, half = hd / 2, row = (nh + 2 * nkv) * hd;
  RopeConfig rc = gpt_oss_rope();
  const RopeTable rope = make_rope_table(rc, hd);
  BatchInfo b;
  b.tokens = {1, 1, 1};
  b.positions = {20, 21, 5};
  b.seq_of = {0, 0, 1};
  b.seqs = {SeqInfo{0, 2, 20, {3, 0}}, SeqInfo{2, 1, 5, {1}}};
  const std::vector<float> qkv = randn(3 * row), qn = randn(hd), kn = randn(hd);
  Tensor tqn = to_tensor(be, qn, {hd}), tkn = to_tensor(be, kn, {hd});
  for (bool norms : {false, true}) {
    auto cache = be.new_kv_cache(1, 4, nkv, hd);
    const QkvParams p{nh, nkv, hd, norms ? &tqn : nullptr, norms ? &tkn : nullptr, 1e-6f, &rope};
    Tensor q = be.qkv_rope_kv_write(to_tensor(be, qkv, {3, row}), p, *cache, 0, b);
    ASSERT_EQ(q.shape, (std::vector<int64_t>{3, nh, hd}));
    for (int t = 0; t < 3; ++t) {
      const int pos = b.positions[t];
      const int64_t slot = int64_t{b.seqs[b.seq_of[t]].block_table[pos / kKvBlock]} * kKvBlock + pos % kKvBlock;
      for (int h = 0; h < nh + 2 * nkv; ++h) {
        const float* x = qkv.data() + t * row + h * hd;
        const bool is_q = h < nh, is_v = h >= nh + nkv;
        std::vector<double> v(x, x + hd);
        if (norms && !is_v) {
          double ms = 0;
          for (double e : v) ms += e * e / hd;
          for (int i = 0; i < hd; ++i) v[i] = (is_q ? qn : kn)[i] * v[i] / std::sqrt(ms + 1e-6);
        }
        std::vector<double> want = v;
        if (!is_v) {
          for (int i = 0; i < half; ++i) {
            const double a = static_cast<float>(pos) * rope.inv_freq[i];
            const double c = std::cos(a) * rope.attention_scale, s = std::sin(a) * rope.attention_scale;
            want[i] = v[i] * c - v[i + half] * s;
            want[i + half] = v[i + half] * c + v[i] * s;
          }
        }
        const float* got = is_q    ? q.data<float>() + (t * nh + h) * hd
                           : is_v ? cache->v[0].data<float>() + (slot * nkv + h - nh - nkv) * hd
                                  : cache->k[0].data<float>() + (slot * nkv + h - nh) * hd;
        for (int i = 0; i < hd; ++i) EXPECT_NEAR(got[i], want[i], 2e-4) << "t " << t << " head " << h << " dim " << i;
      }
    }
  }
}

// A step whose logit rows are every row in order needs no gather before the lm_head (the models skip it).
TEST(BatchInfo, LogitsOfEveryRow) {
  BatchInfo b;
  b.tokens = {5, 6, 7};
  b.logit_rows = {0, 1, 2};
  EXPECT_TRUE(b.logits_of_every_row());
  b.logit_rows = {2};  // a prefill step: the last token's
  EXPECT_FALSE(b.logits_of_every_row());
  b.logit_rows = {0, 2, 1};
  EXPECT_FALSE(b.logits_of_every_row());
  b.logit_rows = {0, 1};
  EXPECT_FALSE(b.logits_of_every_row());
  b.tokens = {9};
  b.logit_rows = {0};  // a one-token decode step
  EXPECT_TRUE(b.logits_of_every_row());
}

}  // namespace
}  // namespace nb
