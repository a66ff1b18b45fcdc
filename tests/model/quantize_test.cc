// Tests for model/quantize: the scale rules (MXFP4 OCP floor rule with saturation, NVFP4 two-level
// ModelOpt scales, FP8 per-channel, all round-to-nearest-even), whole-checkpoint round trips through the
// loader (golden gpt-oss MXFP4 -> BF16 -> nibble quantize gives the same model; llama BF16 -> NVFP4 /
// FP8 stays within each format's error bound), and bad input giving one error naming the problem.
#include "model/quantize.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "formats/blocks.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/model.h"

namespace nb {
namespace {

namespace fs = std::filesystem;

std::string golden(const std::string& name) {
  return std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/" + name;
}

fs::path temp_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / ("nb_quant_" + tag + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(QuantizeScales, Mxfp4OcpFloorRuleRoundsToEvenAndSaturates) {
  // One block of 32: amax 7 -> shared exponent floor(log2 7) - 2 = 0 (scale 1.0, code 127), so 7
  // saturates to 6. Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4.
  std::vector<float> w(32, 0.0f);
  const float in[] = {7.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -5.0f, -0.3f};
  const float want[] = {6.0f, 0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f, -4.0f, -0.5f};
  for (int i = 0; i < 10; ++i) w[i] = in[i];
  uint8_t codes[16], scale = 0;
  quantize_mxfp4(w.data(), 1, 32, codes, &scale);
  EXPECT_EQ(scale, 127);
  float out[32];
  fmt::mxfp4_decode_block(codes, scale, out);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(out[i], want[i]) << "element " << i << " = " << in[i];
  // amax 0.1 -> exponent floor(log2 0.1) - 2 = -6.
  std::fill(w.begin(), w.end(), 0.1f);
  quantize_mxfp4(w.data(), 1, 32, codes, &scale);
  EXPECT_EQ(scale, 127 - 6);
}

TEST(QuantizeScales, Nvfp4TwoLevelModelopt) {
  // Two rows of 32: global s2 = amax / (6 * 448); the block holding the tensor's amax gets scale 448
  // and its amax decodes exactly; an all-zero block gets scale 1.0 (UE4M3 code 0x38).
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> w(2 * 32);
  for (float& x : w) x = nd(rng);
  for (int i = 16; i < 32; ++i) w[i] = 0.0f;  // row 0, block 1
  w[40] = 0.5f;                               // the tensor amax, row 1 block 0
  std::vector<uint8_t> codes(32), scales(4);
  const float s2 = quantize_nvfp4(w.data(), 2, 32, codes.data(), scales.data());
  EXPECT_FLOAT_EQ(s2, 0.5f / 2688.0f);
  EXPECT_EQ(scales[1], 0x38);
  EXPECT_EQ(fmt::ue4m3_to_float(scales[2]), 448.0f);
  std::vector<float> out(64);
  for (int b = 0; b < 4; ++b)
    fmt::nvfp4_decode_block(codes.data() + 8 * b, scales[b], s2, fmt::GlobalScale::kMultiply,
                            out.data() + 16 * b);
  EXPECT_NEAR(out[40], 0.5f, 1e-6f);
  for (int i = 0; i < 64; ++i) {
    // Error bound: half the widest E2M1 gap (1.0, between 4 and 6) times the block's scale, plus the
    // UE4M3 scale rounding (relative 2^-4 of the block amax).
    const float f = fmt::ue4m3_to_float(scales[i / 16]) * s2;
    EXPECT_LE(std::fabs(out[i] - w[i]), f * 1.0f + 1e-7f) << i;
  }
}

TEST(QuantizeScales, Fp8PerChannelRoundsToEven) {
  // Row amax 448 -> scale 1; 1.0625 lies halfway between 1.0 and 1.125: ties to even -> 1.0;
  // 1.1875 (between 1.125 and 1.25) -> 1.25 (even mantissa).
  std::vector<float> w = {448.0f, 1.0625f, 1.1875f, -3.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::vector<uint8_t> codes(8);
  float scale = 0;
  quantize_fp8(w.data(), 1, 8, codes.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(fmt::e4m3_to_float(codes[0]), 448.0f);
  EXPECT_EQ(fmt::e4m3_to_float(codes[1]), 1.0f);
  EXPECT_EQ(fmt::e4m3_to_float(codes[2]), 1.25f);
  EXPECT_EQ(fmt::e4m3_to_float(codes[3]), -3.0f);
  // An all-zero row keeps scale 1 (no division by zero).
  std::vector<float> z(8, 0.0f);
  quantize_fp8(z.data(), 1, 8, codes.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
}

// Logits of the first 12 reference tokens through a fresh model on the CPU.
std::vector<float> logits_of(const std::string& dir) {
  auto m = Model::load(dir, ModelOptions{});
  EXPECT_TRUE(m.ok()) << m.status().message();
  if (!m.ok()) return {};
  auto cache = m.value()->new_kv_cache(4);
  Batch b;
  for (int i = 0; i < 12; ++i) b.tokens.push_back(1 + 17 * i % 400);
  SeqSlice s;
  s.block_table = {0, 1, 2, 3};
  s.n_new = 12;
  s.all_logits = true;
  b.seqs = {s};
  auto out = m.value()->forward(b, *cache);
  EXPECT_TRUE(out.ok()) << out.status().message();
  return out.ok() ? out.value() : std::vector<float>{};
}

// The golden gpt-oss MXFP4 checkpoint written back as BF16 in the HF layout (experts [E, k, n]).
std::string gpt_oss_as_bf16(const fs::path& dir) {
  auto ck = Checkpoint::open(golden("gpt_oss_mxfp4"));
  EXPECT_TRUE(ck.ok());
  SafetensorsWriter w;
  for (const std::string& name : ck.value().names()) {
    const Checkpoint::Entry* e = ck.value().find(name);
    const TensorView v = e->view();
    if (name.ends_with("_scales")) continue;
    if (!name.ends_with("_blocks")) {
      EXPECT_TRUE(w.add(name, e->info->dtype, e->info->shape, v.data, v.nbytes()).ok());
      continue;
    }
    const std::string base = name.substr(0, name.size() - 7);
    const TensorView sc = ck.value().find(base + "_scales")->view();
    const int64_t n_exp = e->info->shape[0], n = e->info->shape[1], k = e->info->shape[2] * 32;
    std::vector<uint16_t> out(n_exp * k * n);
    for (int64_t x = 0; x < n_exp; ++x)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t b = 0; b < k / 32; ++b) {
          float vals[32];
          fmt::mxfp4_decode_block(v.as<uint8_t>() + ((x * n + r) * (k / 32) + b) * 16,
                                  sc.as<uint8_t>()[(x * n + r) * (k / 32) + b], vals);
          for (int i = 0; i < 32; ++i) out[(x * k + b * 32 + i) * n + r] = fmt::float_to_bf16(vals[i]);
        }
    EXPECT_TRUE(w.add(base, DType::kBF16, {n_exp, k, n}, out).ok());
  }
  EXPECT_TRUE(w.write_dir(dir.string()).ok());
  std::string cfg;
  {
    std::ifstream in(golden("gpt_oss_mxfp4") + "/config.json");
    cfg.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto j = nlohmann::json::parse(cfg);
  j.erase("quantization_config");
  std::ofstream(dir / "config.json") << j.dump(2);
  fs::copy_file(golden("gpt_oss_mxfp4") + "/tokenizer.json", dir / "tokenizer.json");
  return dir.string();
}

TEST(QuantizeCheckpoint, GptOssMxfp4RoundTrip) {
  // MXFP4 values are exact in BF16 and the OCP rule re-encodes them exactly, so the golden checkpoint,
  // its BF16 copy (loaded through the transposed-experts path) and the re-quantized copy are one model.
  const fs::path root = temp_dir("gptoss");
  const std::string bf16 = gpt_oss_as_bf16(root / "bf16");
  QuantizeOptions o;
  o.input_dir = bf16;
  o.output_dir = (root / "mxfp4").string();
  o.format = QuantFormat::kMXFP4;
  auto r = quantize_checkpoint(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value().classes, std::vector<std::string>{"experts"});
  auto cfg = load_model_config(o.output_dir);
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(cfg.value().quant.method, QuantMethod::kMxfp4);
  auto ck = Checkpoint::open(o.output_dir);
  ASSERT_TRUE(ck.ok());
  EXPECT_TRUE(
      ck.value().get("model.layers.0.mlp.experts.gate_up_proj_blocks", DType::kU8, {4, 128, 2, 16}).ok());
  EXPECT_TRUE(ck.value().get("model.layers.0.mlp.experts.down_proj_scales", DType::kU8, {4, 64, 2}).ok());

  const std::vector<float> want = logits_of(golden("gpt_oss_mxfp4"));
  for (const std::string& dir : {bf16, o.output_dir}) {
    const std::vector<float> got = logits_of(dir);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f) << dir << " logit " << i;
  }
  fs::remove_all(root);
}

TEST(QuantizeCheckpoint, LlamaNvfp4AndFp8LoadAndStayClose) {
  const fs::path root = temp_dir("llama");
  const std::vector<float> want = logits_of(golden("llama_bf16"));
  std::vector<double> rel_err;
  for (QuantFormat f : {QuantFormat::kNVFP4, QuantFormat::kFP8}) {
    QuantizeOptions o;
    o.input_dir = golden("llama_bf16");
    o.output_dir = (root / (f == QuantFormat::kFP8 ? "fp8" : "nvfp4")).string();
    o.format = f;
    auto r = quantize_checkpoint(o);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r.value().tensors_quantized, 7 * 2);  // 2 layers x (q, k, v, o, gate, up, down)
    auto cfg = load_model_config(o.output_dir);
    ASSERT_TRUE(cfg.ok()) << cfg.status().message();
    EXPECT_EQ(cfg.value().quant.method,
              f == QuantFormat::kFP8 ? QuantMethod::kCompressedTensorsFp8 : QuantMethod::kModeloptNvfp4);
    EXPECT_TRUE(is_module_excluded(cfg.value().quant, "lm_head"));
    EXPECT_FALSE(is_module_excluded(cfg.value().quant, "model.layers.0.self_attn.q_proj"));
    auto ck = Checkpoint::open(o.output_dir);
    ASSERT_TRUE(ck.ok());
    const std::string q = "model.layers.0.self_attn.q_proj";
    if (f == QuantFormat::kNVFP4) {
      EXPECT_TRUE(ck.value().get(q + ".weight", DType::kU8, {64, 32}).ok());
      EXPECT_TRUE(ck.value().get(q + ".weight_scale", DType::kF8_E4M3, {64, 4}).ok());
      EXPECT_TRUE(ck.value().get(q + ".weight_scale_2", DType::kF32, {}).ok());
    } else {
      EXPECT_TRUE(ck.value().get(q + ".weight", DType::kF8_E4M3, {64, 64}).ok());
      EXPECT_TRUE(ck.value().get(q + ".weight_scale", DType::kF32, {64, 1}).ok());
    }
    EXPECT_TRUE(ck.value().get("lm_head.weight", DType::kBF16, {496, 64}).ok());
    const std::vector<float> got = logits_of(o.output_dir);
    ASSERT_EQ(got.size(), want.size());
    double err = 0, ref = 0;
    for (size_t i = 0; i < got.size(); ++i) err += std::pow(got[i] - want[i], 2), ref += std::pow(want[i], 2);
    rel_err.push_back(std::sqrt(err / ref));
  }
  // Relative RMS logit error on this random (chaotic) model: measured 0.25 (NVFP4) and 0.072 (FP8);
  // FP8's 3 mantissa bits must beat FP4's 1.
  EXPECT_LT(rel_err[0], 0.35);
  EXPECT_LT(rel_err[1], 0.1);
  EXPECT_LT(rel_err[1], rel_err[0] / 2);
  EXPECT_GT(rel_err[1], 0.0);
  fs::remove_all(root);
}

TEST(QuantizeCheckpoint, BadInputIsOneErrorNamingIt) {
  const fs::path root = temp_dir("bad");
  auto run = [&](const std::string& in, QuantFormat f, std::vector<std::string> layers) {
    QuantizeOptions o;
    o.input_dir = in;
    o.output_dir = (root / "out").string();
    o.format = f;
    o.layers = std::move(layers);
    auto r = quantize_checkpoint(o);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.status().message();
  };
  auto has = [](const std::string& msg, const std::string& needle) {
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  };
  has(run((root / "missing").string(), QuantFormat::kNVFP4, {}), "not a directory");
  has(run(golden("gpt_oss_mxfp4"), QuantFormat::kMXFP4, {}), "already quantized");
  has(run(golden("llama_bf16"), QuantFormat::kNVFP4, {"attn", "bogus"}),
      "--layers: unknown layer class 'bogus'");
  has(run(golden("llama_bf16"), QuantFormat::kMXFP4, {}), "--format mxfp4");
  has(run(golden("llama_bf16"), QuantFormat::kNVFP4, {"embed"}), "--layers embed");
  has(run(golden("llama_bf16"), QuantFormat::kNVFP4, {"experts"}), "no experts weights");
  // A layer stored in F32, not BF16.
  auto ck = Checkpoint::open(golden("llama_bf16"));
  ASSERT_TRUE(ck.ok());
  SafetensorsWriter w;
  for (const std::string& name : ck.value().names()) {
    const Checkpoint::Entry* e = ck.value().find(name);
    const TensorView v = e->view();
    if (name == "model.layers.1.mlp.up_proj.weight") {
      std::vector<float> f(v.numel());
      for (size_t i = 0; i < f.size(); ++i) f[i] = fmt::bf16_to_float(v.as<uint16_t>()[i]);
      ASSERT_TRUE(w.add(name, DType::kF32, e->info->shape, f).ok());
    } else {
      ASSERT_TRUE(w.add(name, e->info->dtype, e->info->shape, v.data, v.nbytes()).ok());
    }
  }
  const fs::path f32 = root / "f32";
  ASSERT_TRUE(w.write_dir(f32.string()).ok());
  fs::copy_file(golden("llama_bf16") + "/config.json", f32 / "config.json");
  has(run(f32.string(), QuantFormat::kFP8, {}), "tensor 'model.layers.1.mlp.up_proj.weight' is F32");
  fs::remove_all(root);
}

}  // namespace
}  // namespace nb
