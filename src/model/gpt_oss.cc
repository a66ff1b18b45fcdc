// gpt-oss (formats.md §2): attention with biases, per-head sinks and a sliding window on alternate
// layers, YaRN RoPE; MoE with top-k-then-softmax routing over MXFP4 experts whose gate/up rows are
// interleaved and whose SwiGLU is clamped, with the +1 on up.
#include <cmath>

#include "model/model.h"
#include "model/rope.h"

namespace nb {
namespace {

class GptOss final : public Model {
 public:
  using Model::Model;

 private:
  struct Layer {
    AttentionWeights attn;
    Tensor mlp_norm;     // [d_model]
    Weight router;       // [n_experts, d_model]
    Tensor router_bias;  // [n_experts]
    MoeExperts experts;
  };

  Status load_weights(WeightLoader& w) override {
    const ModelConfig& c = config_;
    rope_ = make_rope_table(c.rope, c.head_dim);
    NB_ASSIGN_OR_RETURN(embed_, w.dense("model.embed_tokens.weight", c.vocab_size, c.d_model));
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Layer L;
      NB_ASSIGN_OR_RETURN(L.attn, load_attention(w, c, l, /*qk_norm=*/false, /*sinks=*/true));
      NB_ASSIGN_OR_RETURN(L.mlp_norm, w.floats(p + "post_attention_layernorm.weight", {c.d_model}));
      NB_ASSIGN_OR_RETURN(L.router, w.linear(p + "mlp.router", c.n_experts, c.d_model));
      NB_ASSIGN_OR_RETURN(L.router_bias, w.floats(p + "mlp.router.bias", {c.n_experts}));
      NB_ASSIGN_OR_RETURN(L.experts,
                          w.stacked_mxfp4_experts(p + "mlp.experts", c.n_experts, c.d_expert, c.d_model));
      layers_.push_back(std::move(L));
    }
    NB_ASSIGN_OR_RETURN(final_norm_, w.floats("model.norm.weight", {c.d_model}));
    NB_ASSIGN_OR_RETURN(lm_head_, c.tie_word_embeddings
                                      ? w.dense("model.embed_tokens.weight", c.vocab_size, c.d_model)
                                      : w.linear("lm_head", c.vocab_size, c.d_model));
    if (c.swiglu_limit <= 0) return error("config.json: gpt_oss needs swiglu_limit > 0");
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
      const AttentionParams attn{1.0f / std::sqrt(static_cast<float>(hd)), window(l), &L.attn.sinks};
      // The previous block's output joins the residual stream inside the norm (the embedding starts it); the
      // norm, the QKV projection [T, (nh + 2 nkv) * hd], RoPE and the K/V write: q [T, nh, hd].
      const QkvParams qp{static_cast<int>(nh), static_cast<int>(nkv), static_cast<int>(hd), nullptr, nullptr,
                         c.rms_norm_eps, &rope_};
      Tensor q = be.norm_qkv_rope_kv_write(x, l == 0 ? Tensor() : y, L.attn.norm, c.rms_norm_eps, L.attn.qkv,
                                           optional(L.attn.qkv_bias), qp, cache, l, b);
      Tensor a = be.attention(q, cache, l, b, attn).view({T, nh * hd});
      Tensor o = be.linear(a, L.attn.o, optional(L.attn.o_bias));
      // x += o, h = its norm, and the top-k of the router's logits for h, in one op.
      NormRoutes m = be.add_rms_norm_route(x, o, L.mlp_norm, c.rms_norm_eps, L.router, &L.router_bias, c.top_k,
                                           RouterKind::kTopKThenSoftmax, /*renormalize=*/false);
      // Decode: the next attention projections' weights as L2 prefetch hints (the CUDA backend issues them
      // from the FC1 kernel before its wait, during this layer's norm and routes -- from FC2 they competed
      // with FC2's own weights: measured; a prefetch launch of their own after FC2, or O's after the QKV
      // kernel, sat on the step's critical path: measured). Only with NIBBLE_L2_PREFETCH=1: at short contexts
      // they now cost more than they save (CudaBackendOptions::l2_prefetch).
      std::vector<const Weight*> next;
      if (T == 1 && l + 1 < c.n_layers) next = {&layers_[l + 1].attn.qkv, &layers_[l + 1].attn.o};
      y = be.moe_experts_then_prefetch(m.h, m.routes, L.experts, {Activation::kGptOssClamped, c.swiglu_limit},
                                       next);
    }
    x = be.add_rms_norm(x, y, final_norm_, c.rms_norm_eps);
    if (!b.logits_of_every_row()) x = be.gather_rows(x, b.logit_rows);  // (decode: no copy)
    return be.linear(x, lm_head_, nullptr);  // [n_logit_rows, vocab]
  }

  // Layers marked sliding in the config attend to the last sliding_window positions.
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

std::unique_ptr<Model> new_gpt_oss(ModelConfig config, Checkpoint checkpoint,
                                   std::unique_ptr<Backend> backend) {
  return std::make_unique<GptOss>(std::move(config), std::move(checkpoint), std::move(backend));
}

}  // namespace nb
