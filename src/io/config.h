// config.json -> ModelConfig, and quantization detection (formats.md §2.2, §3.3, §3.4, §6, §9).
// Both config dialects load: the classic hub form (rope_theta + rope_scaling, num_experts) and the
// transformers v5 form (rope_parameters, num_local_experts). Unknown keys are ignored; a missing
// required key, a wrong type or an unsupported model type / quant method is an error naming it.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace nb {

enum class Arch { kGptOss, kQwen3, kQwen3Moe, kLlama };
const char* arch_name(Arch a);  // the config.json model_type

enum class RopeType { kDefault, kYarn, kLlama3 };

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;
  // yarn
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 0.0;  // 0: derived (0.1 ln(factor) + 1)
  // llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  int original_max_position_embeddings = 0;
};

enum class QuantMethod {
  kNone,                    // plain BF16 (or F16/F32) checkpoint
  kMxfp4,                   // gpt-oss: experts as _blocks/_scales
  kModeloptNvfp4,           // ModelOpt: weight + weight_scale + weight_scale_2 (multiply)
  kCompressedTensorsNvfp4,  // compressed-tensors nvfp4-pack-quantized: weight_packed + weight_global_scale
                            // (divide)
  kCompressedTensorsFp8,    // compressed-tensors float-quantized: weight F8_E4M3 + per-channel F32 weight_scale
};
const char* quant_method_name(QuantMethod q);

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  int group_size = 0;                  // 32 for MXFP4, 16 for NVFP4
  std::vector<std::string> exclude;    // modules left unquantized: fnmatch globs, or "re:" regexes (CT)
  bool activations_quantized = false;  // NVFP4 W4A4 (input scales present); nibble runs weight-only
  std::string source;                  // "config.json" or "hf_quant_config.json"
  std::string kv_cache_quant;          // "FP8" when k_scale/v_scale are on disk; empty otherwise
};

// Whether the quant config leaves `module_name` (e.g. "model.layers.3.self_attn.q_proj") unquantized.
// A pattern excludes a module when it matches the module's name, an ancestor's name ("model.layers.*.
// self_attn" covers its q_proj), or the name followed by '.' (ModelOpt's "*mlp.gate.*", written for
// parameter names). Patterns are fnmatch globs (*, ?, [seq], [!seq]); "re:" makes the rest a regex
// that must match the whole name (std::regex, ECMAScript).
bool is_module_excluded(const QuantConfig& quant, const std::string& module_name);

struct ModelConfig {
  Arch arch = Arch::kLlama;
  std::string model_type;
  int vocab_size = 0;
  int d_model = 0;     // hidden_size
  int n_layers = 0;    // num_hidden_layers
  int n_heads = 0;     // num_attention_heads
  int n_kv_heads = 0;  // num_key_value_heads
  int head_dim = 0;    // head_dim, or hidden_size / num_attention_heads
  int d_ff = 0;        // intermediate_size (dense MLP; per expert for gpt-oss)
  // MoE (gpt-oss, qwen3_moe); n_experts == 0 for dense models.
  int n_experts = 0;  // num_local_experts / num_experts
  int top_k = 0;      // num_experts_per_tok / experts_per_token
  int d_expert = 0;   // moe_intermediate_size (qwen3_moe), intermediate_size (gpt-oss)
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  float rms_norm_eps = 1e-5f;
  RopeConfig rope;
  int max_position_embeddings = 0;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  int sliding_window = 0;           // 0: none
  std::vector<bool> layer_sliding;  // per layer: uses the sliding window
  float swiglu_limit = 0.0f;        // gpt-oss clamp (7.0); 0: none
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;
  QuantConfig quant;

  bool is_moe_layer(int layer) const;
};

// Reads DIR/config.json (and DIR/hf_quant_config.json when present).
Result<ModelConfig> load_model_config(const std::string& dir);
// Parses config.json text; quant_text is hf_quant_config.json's text or empty. Names errors by field.
Result<ModelConfig> parse_model_config(const std::string& config_text, const std::string& quant_text = "");

}  // namespace nb
