// Llama 3 (formats.md §6.1): pre-norm GQA attention with llama3-scaled RoPE and a SwiGLU MLP;
// biases only when attention_bias says so.
#include <cmath>

#include "model/model.h"
#include "model/rope.h"

namespace nb {
namespace {

class Llama final : public Model {
 public:
  using Model::Model;

 private:
  struct Layer {
    AttentionWeights attn;
    Tensor mlp_norm;  // [d_model]
    DenseMlpWeights mlp;
  };

  Status load_weights(WeightLoader& w) override {
    const ModelConfig& c = config_;
    rope_ = make_rope_table(c.rope, c.head_dim);
    NB_ASSIGN_OR_RETURN(embed_, w.dense("model.embed_tokens.weight", c.vocab_size, c.d_model));
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Layer L;
      NB_ASSIGN_OR_RETURN(L.attn, load_attention(w, c, l, /*qk_norm=*/false, /*sinks=*/false));
      NB_ASSIGN_OR_RETURN(L.mlp_norm, w.floats(p + "post_attention_layernorm.weight", {c.d_model}));
      NB_ASSIGN_OR_RETURN(L.mlp, load_dense_mlp(w, p + "mlp", c.d_ff, c.d_model));
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
    const AttentionParams attn{1.0f / std::sqrt(static_cast<float>(hd)), 0, nullptr};
    Tensor x = be.embedding(embed_, b);  // [T, d_model], the residual stream
    Tensor y;                            // the last block's output, not yet added to x
    for (int l = 0; l < c.n_layers; ++l) {
      const Layer& L = layers_[l];
      // The previous block's output joins the residual stream inside the norm (the embedding starts it); the
      // norm, the QKV projection [T, (nh + 2 nkv) * hd], RoPE and the K/V write: q [T, nh, hd].
      const QkvParams qp{static_cast<int>(nh), static_cast<int>(nkv), static_cast<int>(hd), nullptr, nullptr,
                         c.rms_norm_eps, &rope_};
      Tensor q = be.norm_qkv_rope_kv_write(x, l == 0 ? Tensor() : y, L.attn.norm, c.rms_norm_eps, L.attn.qkv,
                                           optional(L.attn.qkv_bias), qp, cache, l, b);
      Tensor a = be.attention(q, cache, l, b, attn).view({T, nh * hd});
      Tensor o = be.linear(a, L.attn.o, optional(L.attn.o_bias));
      Tensor h = be.add_rms_norm(x, o, L.mlp_norm, c.rms_norm_eps);
      Tensor gate = be.linear(h, L.mlp.gate, nullptr);
      Tensor up = be.linear(h, L.mlp.up, nullptr);
      y = be.linear(be.swiglu(gate, up), L.mlp.down, nullptr);
    }
    x = be.add_rms_norm(x, y, final_norm_, c.rms_norm_eps);
    if (!b.logits_of_every_row()) x = be.gather_rows(x, b.logit_rows);  // (decode: no copy)
    return be.linear(x, lm_head_, nullptr);  // [n_logit_rows, vocab]
  }

  RopeTable rope_;
  Weight embed_, lm_head_;
  Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<Model> new_llama(ModelConfig config, Checkpoint checkpoint,
                                 std::unique_ptr<Backend> backend) {
  return std::make_unique<Llama>(std::move(config), std::move(checkpoint), std::move(backend));
}

}  // namespace nb
