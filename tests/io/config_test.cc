// Tests for io/config: each architecture in the classic and the transformers v5 dialect (the public
// gpt-oss-20b, Qwen3-8B, Qwen3-30B-A3B and Llama-3.1-8B values, formats.md §2.2 and §6), each quant
// flavour (§3, §9), exclusion patterns, and the errors for missing, mistyped or unsupported keys.
#include "io/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace nb {
namespace {

using json = nlohmann::json;

json gpt_oss_20b() {
  json layer_types = json::array();
  for (int i = 0; i < 24; ++i) layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  json j = json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                            "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true,
    "vocab_size": 201088})");
  j["layer_types"] = layer_types;
  return j;
}

// transformers v5: rope_parameters holds rope_theta and the yarn fields.
json gpt_oss_20b_v5() {
  json j = gpt_oss_20b();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j.erase("experts_per_token");
  j["rope_parameters"] = json::parse(R"({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
      "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": false})");
  return j;
}

json qwen3_8b() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

json qwen3_30b_a3b() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": true,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

json llama31_8b() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
    "vocab_size": 128256})");
}

// v5 form of a classic config: rope_theta and rope_scaling folded into rope_parameters.
json to_v5(json j) {
  json params = j.contains("rope_scaling") && j["rope_scaling"].is_object() ? j["rope_scaling"]
                                                                            : json{{"rope_type", "default"}};
  params["rope_theta"] = j["rope_theta"];
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = params;
  return j;
}

ModelConfig parse_ok(const json& j, const std::string& quant = "") {
  auto c = parse_model_config(j.dump(), quant);
  EXPECT_TRUE(c.ok()) << c.status().message();
  return c.ok() ? c.value() : ModelConfig{};
}

// Parses and expects an error containing every fragment.
void expect_error(const json& j, const std::vector<std::string>& fragments, const std::string& quant = "") {
  auto c = parse_model_config(j.dump(), quant);
  ASSERT_FALSE(c.ok());
  const std::string& msg = c.status().message();
  for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

void check_gpt_oss_20b(const ModelConfig& c) {
  EXPECT_EQ(c.arch, Arch::kGptOss);
  EXPECT_EQ(c.model_type, "gpt_oss");
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.d_model, 2880);
  EXPECT_EQ(c.n_layers, 24);
  EXPECT_EQ(c.n_heads, 64);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.d_ff, 2880);
  EXPECT_EQ(c.d_expert, 2880);
  EXPECT_EQ(c.n_experts, 32);
  EXPECT_EQ(c.top_k, 4);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.sliding_window, 128);
  ASSERT_EQ(c.layer_sliding.size(), 24u);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(c.layer_sliding[i], i % 2 == 0) << i;
  for (int i = 0; i < 24; ++i) EXPECT_TRUE(c.is_moe_layer(i)) << i;
  EXPECT_FLOAT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{200002});
  EXPECT_EQ(c.rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 150000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.quant.method, QuantMethod::kMxfp4);
  EXPECT_EQ(c.quant.group_size, 32);
  EXPECT_EQ(c.quant.exclude.size(), 4u);
  EXPECT_EQ(c.quant.source, "config.json");
}

TEST(ConfigTest, GptOss20bClassic) { check_gpt_oss_20b(parse_ok(gpt_oss_20b())); }

TEST(ConfigTest, GptOss20bV5) { check_gpt_oss_20b(parse_ok(gpt_oss_20b_v5())); }

TEST(ConfigTest, GptOssDefaultsAndOriginalKeys) {
  json j = gpt_oss_20b();
  for (const char* k :
       {"layer_types", "swiglu_limit", "attention_bias", "num_experts_per_tok", "num_local_experts"})
    j.erase(k);
  j["num_experts"] = 32;
  j["rope_scaling"].erase("truncate");
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.n_experts, 32);
  EXPECT_EQ(c.top_k, 4);  // experts_per_token
  EXPECT_FLOAT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.rope.truncate);
  ASSERT_EQ(c.layer_sliding.size(), 24u);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(c.layer_sliding[i], i % 2 == 0) << i;
}

TEST(ConfigTest, Qwen3DenseBothDialects) {
  for (const json& j : {qwen3_8b(), to_v5(qwen3_8b())}) {
    ModelConfig c = parse_ok(j);
    EXPECT_EQ(c.arch, Arch::kQwen3);
    EXPECT_EQ(c.d_model, 4096);
    EXPECT_EQ(c.n_layers, 36);
    EXPECT_EQ(c.n_heads, 32);
    EXPECT_EQ(c.n_kv_heads, 8);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_EQ(c.d_ff, 12288);
    EXPECT_EQ(c.n_experts, 0);
    EXPECT_FALSE(c.is_moe_layer(0));
    EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
    EXPECT_FALSE(c.attention_bias);
    EXPECT_EQ(c.rope.type, RopeType::kDefault);
    EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
    EXPECT_EQ(c.sliding_window, 0);
    EXPECT_EQ(c.layer_sliding, std::vector<bool>(36, false));
    EXPECT_EQ(c.bos_token_id, 151643);
    EXPECT_EQ(c.eos_token_ids, std::vector<int>{151645});
    EXPECT_EQ(c.quant.method, QuantMethod::kNone);
  }
}

TEST(ConfigTest, Qwen3HeadDimDefault) {
  json j = qwen3_8b();
  j.erase("head_dim");
  j["hidden_size"] = 1024;
  j["num_attention_heads"] = 16;
  // Qwen3Config's class default head_dim is 128, not hidden/heads (= 64 here).
  EXPECT_EQ(parse_ok(j).head_dim, 128);
  json l = llama31_8b();
  EXPECT_EQ(parse_ok(l).head_dim, 128);  // hidden/heads
}

TEST(ConfigTest, Qwen3MoeBothDialects) {
  json v5 = to_v5(qwen3_30b_a3b());
  v5.erase("num_experts");
  v5["num_local_experts"] = 128;
  for (const json& j : {qwen3_30b_a3b(), v5}) {
    ModelConfig c = parse_ok(j);
    EXPECT_EQ(c.arch, Arch::kQwen3Moe);
    EXPECT_EQ(c.d_model, 2048);
    EXPECT_EQ(c.n_layers, 48);
    EXPECT_EQ(c.n_kv_heads, 4);
    EXPECT_EQ(c.n_experts, 128);
    EXPECT_EQ(c.top_k, 8);
    EXPECT_EQ(c.d_expert, 768);
    EXPECT_EQ(c.d_ff, 6144);
    EXPECT_TRUE(c.norm_topk_prob);
    for (int i = 0; i < 48; ++i) EXPECT_TRUE(c.is_moe_layer(i)) << i;
    EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  }
}

TEST(ConfigTest, Qwen3MoeSparseStepAndDenseLayers) {
  json j = qwen3_30b_a3b();
  j.erase("norm_topk_prob");
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {5};
  ModelConfig c = parse_ok(j);
  EXPECT_FALSE(c.norm_topk_prob);  // class default
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_FALSE(c.is_moe_layer(5));
  EXPECT_FALSE(c.is_moe_layer(48));
  j.erase("intermediate_size");
  expect_error(j, {"config.json: 'intermediate_size' is missing"});
  j = qwen3_30b_a3b();
  j.erase("intermediate_size");
  EXPECT_EQ(parse_ok(j).d_ff, 0);  // every layer is MoE: not needed
  j["mlp_only_layers"] = {48};
  expect_error(j, {"'mlp_only_layers'", "48"});
}

TEST(ConfigTest, Llama31BothDialects) {
  for (const json& j : {llama31_8b(), to_v5(llama31_8b())}) {
    ModelConfig c = parse_ok(j);
    EXPECT_EQ(c.arch, Arch::kLlama);
    EXPECT_EQ(c.vocab_size, 128256);
    EXPECT_EQ(c.d_model, 4096);
    EXPECT_EQ(c.n_layers, 32);
    EXPECT_EQ(c.n_heads, 32);
    EXPECT_EQ(c.n_kv_heads, 8);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_EQ(c.d_ff, 14336);
    EXPECT_EQ(c.max_position_embeddings, 131072);
    EXPECT_EQ(c.bos_token_id, 128000);
    EXPECT_EQ(c.eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_EQ(c.rope.type, RopeType::kLlama3);
    EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
    EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
    EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, 1.0);
    EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, 4.0);
    EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
    EXPECT_EQ(c.layer_sliding, std::vector<bool>(32, false));
  }
}

TEST(ConfigTest, LlamaRopeTypeKeyAndKvHeadsDefault) {
  json j = llama31_8b();
  j["rope_scaling"].erase("rope_type");
  j["rope_scaling"]["type"] = "llama3";
  j.erase("num_key_value_heads");
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.rope.type, RopeType::kLlama3);
  EXPECT_EQ(c.n_kv_heads, 32);  // None means multi-head attention
}

// --- quantization
// -------------------------------------------------------------------------------------------

json modelopt_nvfp4(const std::string& algo) {
  return json::parse(R"({"quant_method": "modelopt", "quant_algo": ")" + algo + R"(",
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "ignore": ["lm_head", "*mlp.gate.*", "model.mtp*"],
    "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": false},
                                  "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
                                  "targets": ["Linear"]}},
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": false}})");
}

json ct_nvfp4(bool activations) {
  json q = json::parse(R"({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
      "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                  "symmetric": true, "dynamic": false, "scale_dtype": "float8_e4m3fn"}}},
    "ignore": ["lm_head", "re:.*mlp\\.gate$"], "kv_cache_scheme": null})");
  if (activations) {
    q["config_groups"]["group_0"]["input_activations"] = json::parse(
        R"({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"})");
  }
  return q;
}

TEST(ConfigTest, ModeloptNvfp4InConfigJson) {
  json j = qwen3_30b_a3b();
  j["quantization_config"] = modelopt_nvfp4("NVFP4");
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.quant.method, QuantMethod::kModeloptNvfp4);
  EXPECT_EQ(c.quant.group_size, 16);
  EXPECT_TRUE(c.quant.activations_quantized);
  EXPECT_EQ(c.quant.exclude, (std::vector<std::string>{"lm_head", "*mlp.gate.*", "model.mtp*"}));
  EXPECT_EQ(c.quant.kv_cache_quant, "FP8");
  EXPECT_EQ(c.quant.source, "config.json");
  EXPECT_STREQ(quant_method_name(c.quant.method), "modelopt-nvfp4");

  j["quantization_config"] = modelopt_nvfp4("W4A16_NVFP4");
  c = parse_ok(j);
  EXPECT_EQ(c.quant.method, QuantMethod::kModeloptNvfp4);
  EXPECT_FALSE(c.quant.activations_quantized);
}

TEST(ConfigTest, ModeloptLegacyHfQuantConfig) {
  const std::string legacy = R"({"producer": {"name": "modelopt", "version": "0.23.0"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                     "exclude_modules": ["lm_head", "model.layers.0.mlp*"]}})";
  ModelConfig c = parse_ok(llama31_8b(), legacy);
  EXPECT_EQ(c.quant.method, QuantMethod::kModeloptNvfp4);
  EXPECT_EQ(c.quant.group_size, 16);
  EXPECT_TRUE(c.quant.activations_quantized);
  EXPECT_EQ(c.quant.exclude.size(), 2u);
  EXPECT_EQ(c.quant.kv_cache_quant, "");
  EXPECT_EQ(c.quant.source, "hf_quant_config.json");

  expect_error(
      llama31_8b(),
      {"hf_quant_config.json", "'quantization.quant_algo' 'FP8' is not supported", "NVFP4", "W4A16_NVFP4"},
      R"({"quantization": {"quant_algo": "FP8"}})");
  expect_error(llama31_8b(), {"hf_quant_config.json", "'quantization.group_size' is 32"},
               R"({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})");
  expect_error(llama31_8b(), {"hf_quant_config.json", "'quantization' is missing"}, R"({"producer": {}})");
  expect_error(llama31_8b(), {"hf_quant_config.json", "not valid JSON"}, "{");
  // config.json's quantization_config wins over the legacy file.
  json j = llama31_8b();
  j["quantization_config"] = ct_nvfp4(false);
  EXPECT_EQ(parse_ok(j, legacy).quant.method, QuantMethod::kCompressedTensorsNvfp4);
}

TEST(ConfigTest, CompressedTensorsNvfp4) {
  json j = qwen3_8b();
  j["quantization_config"] = ct_nvfp4(true);
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.quant.method, QuantMethod::kCompressedTensorsNvfp4);
  EXPECT_EQ(c.quant.group_size, 16);
  EXPECT_TRUE(c.quant.activations_quantized);
  EXPECT_EQ(c.quant.exclude, (std::vector<std::string>{"lm_head", "re:.*mlp\\.gate$"}));
  j["quantization_config"] = ct_nvfp4(false);  // NVFP4A16
  c = parse_ok(j);
  EXPECT_FALSE(c.quant.activations_quantized);
}

TEST(ConfigTest, QuantErrors) {
  json j = qwen3_8b();
  j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  expect_error(j, {"config.json: 'quantization_config.quant_method' 'gptq' is not supported",
                   "mxfp4, modelopt, compressed-tensors"});
  j["quantization_config"] = {{"bits", 4}};
  expect_error(j, {"'quantization_config.quant_method' is missing"});
  j["quantization_config"] = modelopt_nvfp4("MIXED_PRECISION");
  expect_error(j,
               {"'quantization_config.quant_algo' 'MIXED_PRECISION' is not supported", "NVFP4, W4A16_NVFP4"});
  j["quantization_config"] = ct_nvfp4(false);
  j["quantization_config"]["format"] = "mxfp4-pack-quantized";
  expect_error(
      j, {"'quantization_config.format' 'mxfp4-pack-quantized' is not supported", "nvfp4-pack-quantized"});
  j["quantization_config"] = ct_nvfp4(false);
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32;
  expect_error(j, {"'quantization_config.config_groups.group_0.weights.group_size' is 32"});
  j["quantization_config"] = ct_nvfp4(false);
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  expect_error(j, {"config_groups.group_0.weights.num_bits"});
  j["quantization_config"] = ct_nvfp4(false);
  j["quantization_config"]["quantization_status"] = "frozen";
  expect_error(j, {"'quantization_config.quantization_status' is 'frozen'"});
  j["quantization_config"] = ct_nvfp4(false);
  j["quantization_config"]["ignore"] = {"re:(unclosed"};
  expect_error(j, {"'quantization_config.ignore'", "re:(unclosed", "not a valid regular expression"});
  j["quantization_config"] = "mxfp4";
  expect_error(j, {"'quantization_config' must be an object"});
  j["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", "lm_head"}};
  expect_error(j, {"'quantization_config.modules_to_not_convert' must be a list of strings"});
}

TEST(ConfigTest, ModuleExclusion) {
  ModelConfig g = parse_ok(gpt_oss_20b());
  EXPECT_TRUE(is_module_excluded(g.quant, "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(is_module_excluded(g.quant, "model.layers.23.self_attn"));
  EXPECT_TRUE(is_module_excluded(g.quant, "model.layers.5.mlp.router"));
  EXPECT_TRUE(is_module_excluded(g.quant, "lm_head"));
  EXPECT_TRUE(is_module_excluded(g.quant, "model.embed_tokens"));
  EXPECT_FALSE(is_module_excluded(g.quant, "model.layers.0.mlp.experts"));
  EXPECT_FALSE(is_module_excluded(g.quant, "model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(is_module_excluded(g.quant, "lm_head_extra"));

  QuantConfig q;
  q.exclude = {"*mlp.gate.*", "model.mtp*", "layers.[0-2].attn", "re:.*shared_expert_gate$", "x?y"};
  EXPECT_TRUE(is_module_excluded(q, "model.layers.0.mlp.gate"));
  EXPECT_FALSE(is_module_excluded(q, "model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(is_module_excluded(q, "model.layers.0.mlp.experts.3.gate_proj"));
  EXPECT_TRUE(is_module_excluded(q, "model.mtp.fc"));
  EXPECT_TRUE(is_module_excluded(q, "model.mtp"));
  EXPECT_TRUE(is_module_excluded(q, "layers.1.attn.q"));
  EXPECT_FALSE(is_module_excluded(q, "layers.3.attn.q"));
  EXPECT_TRUE(is_module_excluded(q, "model.layers.7.mlp.shared_expert_gate"));
  EXPECT_FALSE(is_module_excluded(q, "model.layers.7.mlp.shared_expert_gate_x"));
  EXPECT_TRUE(is_module_excluded(q, "xzy"));
  EXPECT_FALSE(is_module_excluded(q, "xy"));
  q.exclude = {"re:(bad"};
  EXPECT_FALSE(is_module_excluded(q, "anything"));  // a hand-built bad regex never matches, never throws
  q.exclude = {"a[!b]c", "[", "*"};
  EXPECT_TRUE(is_module_excluded(q, "anything"));
  q.exclude = {"a[!b]c"};
  EXPECT_TRUE(is_module_excluded(q, "axc"));
  EXPECT_FALSE(is_module_excluded(q, "abc"));
  EXPECT_FALSE(is_module_excluded(QuantConfig{}, "lm_head"));
}

// --- errors
// ---------------------------------------------------------------------------------------------------

TEST(ConfigTest, MissingAndWrongTypeKeys) {
  json j = gpt_oss_20b();
  j.erase("num_attention_heads");
  expect_error(j, {"config.json: 'num_attention_heads' is missing"});
  j = gpt_oss_20b();
  j["num_attention_heads"] = "64";
  expect_error(j, {"config.json: 'num_attention_heads' must be an integer, found a JSON string"});
  j["num_attention_heads"] = 64.5;
  expect_error(j, {"'num_attention_heads' must be an integer, found a float"});
  j = gpt_oss_20b();
  j["num_attention_heads"] = nullptr;
  expect_error(j, {"'num_attention_heads' is missing"});
  j = gpt_oss_20b();
  j["hidden_size"] = 1ll << 40;
  expect_error(j, {"'hidden_size' is out of range"});
  j = gpt_oss_20b();
  j.erase("num_key_value_heads");
  expect_error(j, {"'num_key_value_heads' is missing"});  // no MHA fallback for gpt-oss
  j = gpt_oss_20b();
  j.erase("num_local_experts");
  expect_error(j, {"'num_local_experts' is missing"});
  j = gpt_oss_20b();
  j.erase("num_experts_per_tok");
  j.erase("experts_per_token");
  expect_error(j, {"'num_experts_per_tok' is missing"});
  j = gpt_oss_20b();
  j["experts_per_token"] = 2;
  expect_error(j, {"'num_experts_per_tok' and 'experts_per_token' disagree"});
  j = gpt_oss_20b();
  j["rope_scaling"]["factor"] = "32";
  expect_error(j, {"'rope_scaling.factor' must be a number"});
  j = gpt_oss_20b();
  j["rope_scaling"].erase("factor");
  expect_error(j, {"'rope_scaling.factor' is missing"});
  j = gpt_oss_20b_v5();
  j["rope_parameters"]["truncate"] = "no";
  expect_error(j, {"'rope_parameters.truncate' must be true or false"});
  j = gpt_oss_20b();
  j["attention_bias"] = 1;
  expect_error(j, {"'attention_bias' must be true or false"});
  j = llama31_8b();
  j["eos_token_id"] = {128001, "x"};
  expect_error(j, {"'eos_token_id' must be a list of integers"});
  j = llama31_8b();
  j["rope_scaling"].erase("low_freq_factor");
  expect_error(j, {"'rope_scaling.low_freq_factor' is missing"});
  j = llama31_8b();
  j.erase("model_type");
  expect_error(j, {"config.json: 'model_type' is missing"});
  j = qwen3_8b();
  j.erase("intermediate_size");
  expect_error(j, {"'intermediate_size' is missing"});
  j = qwen3_30b_a3b();
  j.erase("moe_intermediate_size");
  expect_error(j, {"'moe_intermediate_size' is missing"});
}

TEST(ConfigTest, UnsupportedValues) {
  json j = llama31_8b();
  j["model_type"] = "mistral";
  expect_error(j, {"config.json: model_type 'mistral' is not supported", "gpt_oss, qwen3, qwen3_moe, llama"});
  j = llama31_8b();
  j["rope_scaling"]["rope_type"] = "dynamic";
  expect_error(j, {"'rope_scaling.rope_type' 'dynamic' is not supported", "default, yarn, llama3"});
  j = gpt_oss_20b();
  j["layer_types"][3] = "linear_attention";
  expect_error(j, {"'layer_types'[3] is 'linear_attention'"});
  j["layer_types"] = {"full_attention"};
  expect_error(j, {"'layer_types' has 1 entries but 'num_hidden_layers' is 24"});
}

TEST(ConfigTest, SanityChecks) {
  json j = gpt_oss_20b();
  j["num_key_value_heads"] = 6;
  expect_error(j, {"'num_attention_heads' (64) must be a multiple of 'num_key_value_heads' (6)"});
  j = gpt_oss_20b();
  j["num_experts_per_tok"] = j["experts_per_token"] = 33;
  expect_error(j, {"'num_experts_per_tok' (33) exceeds the number of experts (32)"});
  j = gpt_oss_20b();
  j["hidden_size"] = 0;
  expect_error(j, {"'hidden_size' must be positive"});
  j = gpt_oss_20b();
  j["num_attention_heads"] = -1;
  expect_error(j, {"'num_attention_heads' must be positive"});
  j = gpt_oss_20b();
  j["num_hidden_layers"] = 0;
  expect_error(j, {"'num_hidden_layers' must be in"});
  j = gpt_oss_20b();
  j["sliding_window"] = 0;
  expect_error(j, {"'sliding_window' must be positive"});
  j = qwen3_8b();
  j["head_dim"] = 127;
  expect_error(j, {"'head_dim' must be even"});
  j = qwen3_8b();
  j["rms_norm_eps"] = 0;
  expect_error(j, {"'rms_norm_eps' must be positive"});
  j = llama31_8b();
  j["rope_scaling"]["high_freq_factor"] = 0.5;
  expect_error(j, {"'high_freq_factor' must exceed 'low_freq_factor'"});
}

TEST(ConfigTest, NotJson) {
  auto c = parse_model_config("{\"model_type\": ");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("config.json: not valid JSON"), std::string::npos);
  c = parse_model_config("[1]");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("config.json: not a JSON object"), std::string::npos);
}

TEST(ConfigTest, Qwen3SlidingWindow) {
  json j = qwen3_8b();
  j["use_sliding_window"] = true;
  j["sliding_window"] = 4096;
  j["max_window_layers"] = 30;
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.sliding_window, 4096);
  for (int i = 0; i < 36; ++i) EXPECT_EQ(c.layer_sliding[i], i >= 30) << i;
}

TEST(ConfigTest, NamesAndLoadFromDirectory) {
  EXPECT_STREQ(arch_name(Arch::kGptOss), "gpt_oss");
  EXPECT_STREQ(arch_name(Arch::kQwen3Moe), "qwen3_moe");
  EXPECT_STREQ(quant_method_name(QuantMethod::kNone), "none");
  EXPECT_STREQ(quant_method_name(QuantMethod::kMxfp4), "mxfp4");

  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / ("nibble_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << llama31_8b().dump(2);
  std::ofstream(dir / "hf_quant_config.json")
      << R"({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
            "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}})";
  auto c = load_model_config(dir.string());
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c.value().arch, Arch::kLlama);
  EXPECT_EQ(c.value().quant.method, QuantMethod::kModeloptNvfp4);
  EXPECT_FALSE(c.value().quant.activations_quantized);
  EXPECT_EQ(c.value().quant.kv_cache_quant, "FP8");

  std::ofstream(dir / "config.json") << "{\"model_type\": \"llama\"}";
  c = load_model_config(dir.string());
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(dir.string() + ": config.json: 'vocab_size' is missing"),
            std::string::npos)
      << c.status().message();

  auto missing = load_model_config((dir / "nope").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("config.json: cannot open"), std::string::npos);
  fs::remove_all(dir);
}

// The tiny checkpoints written by tools/reference with HF transformers: their config.json files (and
// ModelOpt's hf_quant_config.json) must load with the flavour their directory name says.
TEST(ConfigTest, CommittedTinyCheckpoints) {
  namespace fs = std::filesystem;
  const fs::path models = fs::path(NIBBLE_SOURCE_DIR) / "tests" / "data" / "models";
  int loaded = 0;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(models, ec)) {
    if (!fs::exists(de.path() / "config.json")) continue;
    auto c = load_model_config(de.path().string());
    ASSERT_TRUE(c.ok()) << c.status().message();
    const std::string name = de.path().filename().string();
    QuantMethod want = QuantMethod::kNone;
    if (name.find("mxfp4") != std::string::npos) want = QuantMethod::kMxfp4;
    if (name.find("modelopt") != std::string::npos) want = QuantMethod::kModeloptNvfp4;
    if (name.find("_ct") != std::string::npos) want = QuantMethod::kCompressedTensorsNvfp4;
    EXPECT_EQ(c.value().quant.method, want) << name;
    EXPECT_EQ(name.rfind(arch_name(c.value().arch), 0), 0u) << name;
    ++loaded;
  }
  if (loaded == 0) GTEST_SKIP() << "no checkpoints under " << models;
}

// The benchmark configs under configs/ (public config.json values; --dummy-weights builds models from them): each
// loads, and the -NVFP4 ones are ModelOpt NVFP4 with lm_head and the MoE router kept BF16 and the rest quantized.
TEST(ConfigTest, BenchmarkConfigs) {
  namespace fs = std::filesystem;
  const fs::path configs = fs::path(NIBBLE_SOURCE_DIR) / "configs";
  int loaded = 0;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(configs, ec)) {
    if (!fs::exists(de.path() / "config.json")) continue;
    const std::string name = de.path().filename().string();
    auto c = load_model_config(de.path().string());
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().message();
    const bool nvfp4 = name.size() > 6 && name.compare(name.size() - 6, 6, "-NVFP4") == 0;
    const QuantMethod want = name.rfind("gpt-oss", 0) == 0 ? QuantMethod::kMxfp4
                             : nvfp4                        ? QuantMethod::kModeloptNvfp4
                                                            : QuantMethod::kNone;
    EXPECT_EQ(c.value().quant.method, want) << name;
    if (nvfp4) {
      const QuantConfig& q = c.value().quant;
      EXPECT_TRUE(is_module_excluded(q, "lm_head")) << name;
      EXPECT_FALSE(is_module_excluded(q, "model.layers.3.self_attn.q_proj")) << name;
      EXPECT_FALSE(is_module_excluded(q, "model.layers.3.mlp.down_proj")) << name;
      if (c.value().n_experts > 0) {
        EXPECT_TRUE(is_module_excluded(q, "model.layers.3.mlp.gate")) << name;
        EXPECT_FALSE(is_module_excluded(q, "model.layers.3.mlp.experts.5.gate_proj")) << name;
      }
    }
    ++loaded;
  }
  EXPECT_GE(loaded, 6) << "benchmark configs under " << configs;
}

}  // namespace
}  // namespace nb
