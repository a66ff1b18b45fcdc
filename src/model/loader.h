// Weight loading: finds each module's storage format from the tensors on disk (formats.md §9), checks
// every name, dtype and shape against the config before any compute, and records what it loaded for
// `nibble inspect`. Errors name the tensor. Also the layer pieces shared by the architectures.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/weight.h"
#include "model/weight_factory.h"

namespace nb {

// What was loaded, per tensor class (the name with layer and expert numbers replaced by '*').
struct WeightClass {
  std::string format;  // "dense BF16", "nvfp4 (modelopt)", ...
  std::string shape;   // of one instance
  int64_t count = 0, parameters = 0, bytes = 0;
};
using WeightCatalog = std::map<std::string, WeightClass>;

class WeightLoader {
 public:
  WeightLoader(const Checkpoint& ckpt, const ModelConfig& config, Backend& backend, WeightCatalog& catalog)
      : ckpt_(ckpt), config_(config), backend_(backend), catalog_(catalog) {}

  // A linear layer's weight [n, k] under `prefix` (e.g. "model.layers.0.self_attn.q_proj"), in whatever
  // format is on disk: P.weight dense; P.weight U8 + P.weight_scale (ModelOpt NVFP4); P.weight_packed
  // (compressed-tensors NVFP4).
  Result<Weight> linear(const std::string& prefix, int64_t n, int64_t k);
  // Several linear layers with the same input, stacked along n into one Weight (one part each, ns[i] rows
  // for prefixes[i]); they must share one storage format (and dtype, when dense).
  Result<Weight> fused(const std::vector<std::string>& prefixes, const std::vector<int64_t>& ns, int64_t k);
  Result<Weight> fused(const std::vector<std::string>& prefixes, int64_t n_each, int64_t k) {
    return fused(prefixes, std::vector<int64_t>(prefixes.size(), n_each), k);
  }
  // A dense matrix stored under exactly `name` (embeddings).
  Result<Weight> dense(const std::string& name, int64_t n, int64_t k);
  // A float vector or small tensor (norm weights, biases, sinks), converted to F32 on the backend.
  Result<Tensor> floats(const std::string& name, const std::vector<int64_t>& shape);
  // Float vectors names[i] of sizes[i], concatenated into one F32 tensor [sum sizes] (fused biases).
  Result<Tensor> concat_floats(const std::vector<std::string>& names, const std::vector<int64_t>& sizes);
  // MoE experts: gpt-oss stacked MXFP4 (P.gate_up_proj_blocks ...) or per expert (P.E.gate_proj ...).
  Result<MoeExperts> stacked_mxfp4_experts(const std::string& prefix, int n_experts, int d_expert,
                                           int d_model);
  Result<MoeExperts> per_expert_experts(const std::string& prefix, int n_experts, int d_expert, int d_model);

  bool has(const std::string& name) const { return ckpt_.has(name); }

  // Device-side producers (CUDA backend): with dummy, every weight is random, of the format the config
  // implies, and the checkpoint is not read; dense != kKeep re-quantizes the dense attention projections
  // and lm_head.
  void use_factory(WeightFactory* factory, bool dummy, DenseFormat dense) {
    factory_ = factory;
    dummy_ = dummy;
    dense_ = dense;
  }

 private:
  Result<TensorView> get_float(const std::string& name, const std::vector<int64_t>& shape);
  Result<float> scalar(const std::string& name);
  Status check_method(const std::string& tensor, QuantMethod found) const;
  void record(const std::string& name, const std::string& format, const std::vector<int64_t>& shape,
              int64_t params, int64_t bytes);

  Result<Weight> dummy_linear(const std::string& prefix, int64_t n, int64_t k, WeightFormat format);
  Result<Weight> maybe_requantize(const std::string& prefix, Weight w);

  WeightFactory* factory_ = nullptr;
  bool dummy_ = false;
  DenseFormat dense_ = DenseFormat::kKeep;
  const Checkpoint& ckpt_;
  const ModelConfig& config_;
  Backend& backend_;
  WeightCatalog& catalog_;
};

// Pre-norm attention block weights (llama, qwen3, gpt-oss). Empty tensors are absent parts. q, k and v
// are one Weight of three parts, so the projection is one launch (Backend::qkv_rope_kv_write splits it).
struct AttentionWeights {
  Tensor norm;  // [d_model] input_layernorm
  Weight qkv;   // [(n_heads + 2 n_kv) * head_dim, d_model]: q_proj, k_proj, v_proj rows in that order
  Weight o;     // [d_model, n_heads * head_dim]
  Tensor qkv_bias, o_bias;                // attention_bias; qkv_bias is q, k, v biases concatenated
  Tensor q_norm, k_norm;                  // [head_dim] qwen3
  Tensor sinks;                           // [n_heads] gpt-oss
};
Result<AttentionWeights> load_attention(WeightLoader& w, const ModelConfig& c, int layer, bool qk_norm,
                                        bool sinks);

// SwiGLU MLP: down(silu(gate x) * up x).
struct DenseMlpWeights {
  Weight gate, up, down;  // [d_ff, d_model] x2, [d_model, d_ff]
};
Result<DenseMlpWeights> load_dense_mlp(WeightLoader& w, const std::string& prefix, int d_ff, int d_model);

// Tensor pointer for an optional bias: null when absent.
inline const Tensor* optional(const Tensor& t) { return t.empty() ? nullptr : &t; }

std::string catalog_table(const WeightCatalog& catalog);

}  // namespace nb
