// Qwen3 dense and Qwen3-MoE (formats.md §6.2, §6.3): Llama-style blocks plus a per-head RMSNorm on q
// and k before RoPE; MoE layers route with softmax over all experts, then top-k, optionally renormalised.
#include <cmath>

#include "model/model.h"
#include "model/rope.h"

namespace nb {
namespace {

class Qwen3 final : public Model {
 public:
  using Model::Model;

 private:
  struct Layer {
    AttentionWeights attn;
    Tensor mlp_norm;  // [d_model]
    bool moe = false;
    DenseMlpWeights mlp;  // dense layers
    Weight router;        // [n_experts, d_model], MoE layers
    MoeExperts experts;
  };

  Status load_weights(WeightLoader& w) override {
    const ModelConfig& c = config_;
    rope_ = make_rope_table(c.rope, c.head_dim);
    NB_ASSIGN_OR_RETURN(embed_, w.dense("model.embed_tokens.weight", c.vocab_size, c.d_model));
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Layer L;
      NB_ASSIGN_OR_RETURN(L.attn, load_attention(w, c, l, /*qk_norm=*/true, /*sinks=*/false));
      NB_ASSIGN_OR_RETURN(L.mlp_norm, w.floats(p + "post_attention_layernorm.weight", {c.d_model}));
      L.moe = c.arch == Arch::kQwen3Moe && c.is_moe_layer(l);
      if (L.moe) {
        NB_ASSIGN_OR_RETURN(L.router, w.linear(p + "mlp.gate", c.n_experts, c.d_model));
        NB_ASSIGN_OR_RETURN(L.experts,
                            w.per_expert_experts(p + "mlp.experts", c.n_experts, c.d_expert, c.d_model));
      } else {
        NB_ASSIGN_OR_RETURN(L.mlp, load_dense_mlp(w, p + "mlp", c.d_ff, c.d_model));
      }
      layers_.push_back(std::move(L));
    }
    NB_ASSIGN_OR_RETURN(final_norm_, w.floats("model.norm.weight", {c.d_model}));
    NB_ASSIGN_OR_RETURN(lm_head_, c.tie_word_embeddings
                                      ? w.dense("model.embed_tokens.weight", c.vocab_size, c.d_model)
                                      : w.linear("lm_head", c.vocab_size, c.d_model));
    return Status();
  }

  Tensor run(const BatchInfo& b, KvCache& cache) override {
    const ModelConfig& c = config_;
    Backend& be = *backend_;
    const int64_t T = b.n_tokens(), nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
    Tensor x = be.embedding(embed_, b);  // [T, d_model], the residual stream
    Tensor y;                            // the last block's output, not yet added to x
    for (int l = 0; l < c.n_layers; ++l) {
      const Layer& L = layers_[l];
      const AttentionParams attn{1.0f / std::sqrt(static_cast<float>(hd)), window(l), nullptr};
      // The previous block's output joins the residual stream inside the norm (the embedding starts it).
      Tensor h = l == 0 ? be.rms_norm(x, L.attn.norm, c.rms_norm_eps) : be.add_rms_norm(x, y, L.attn.norm, c.rms_norm_eps);
      Tensor qkv = be.linear(h, L.attn.qkv, optional(L.attn.qkv_bias));  // [T, (nh + 2 nkv) * hd]
      const QkvParams qp{static_cast<int>(nh), static_cast<int>(nkv), static_cast<int>(hd), &L.attn.q_norm, &L.attn.k_norm,
                         c.rms_norm_eps, &rope_};
      Tensor q = be.qkv_rope_kv_write(qkv, qp, cache, l, b);  // q [T, nh, hd]; k, v into the cache
      Tensor a = be.attention(q, cache, l, b, attn).view({T, nh * hd});
      Tensor o = be.linear(a, L.attn.o, optional(L.attn.o_bias));
      if (L.moe) {  // x += o, h = its norm, and the top-k of the router's logits for h, in one op
        NormRoutes m = be.add_rms_norm_route(x, o, L.mlp_norm, c.rms_norm_eps, L.router, nullptr, c.top_k,
                                             RouterKind::kSoftmaxThenTopK, c.norm_topk_prob);
        y = be.moe_experts(m.h, m.routes, L.experts, {Activation::kSilu, 0.0f});
      } else {
        h = be.add_rms_norm(x, o, L.mlp_norm, c.rms_norm_eps);
        Tensor gate = be.linear(h, L.mlp.gate, nullptr);
        Tensor up = be.linear(h, L.mlp.up, nullptr);
        y = be.linear(be.swiglu(gate, up), L.mlp.down, nullptr);
      }
    }
    x = be.add_rms_norm(x, y, final_norm_, c.rms_norm_eps);
    if (!b.logits_of_every_row()) x = be.gather_rows(x, b.logit_rows);  // (decode: no copy)
    return be.linear(x, lm_head_, nullptr);  // [n_logit_rows, vocab]
  }

  int window(int layer) const {
    const ModelConfig& c = config_;
    return !c.layer_sliding.empty() && c.layer_sliding[layer] ? c.sliding_window : 0;
  }

  RopeTable rope_;
  Weight embed_, lm_head_;
  Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<Model> new_qwen3(ModelConfig config, Checkpoint checkpoint,
                                 std::unique_ptr<Backend> backend) {
  return std::make_unique<Qwen3>(std::move(config), std::move(checkpoint), std::move(backend));
}

}  // namespace nb
