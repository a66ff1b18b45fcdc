// Backend: the op-level interface every architecture's forward pass is written against, once.
// cpu/ implements it in plain fp32 as the reference; the CUDA backend implements the same ops.
// Activations are Tensors (shape, dtype, device); weights are model/Weight and carry their format;
// a forward step's token metadata (positions, block tables) travels in one BatchInfo.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/tensor.h"
#include "model/weight.h"

namespace nb {

// An owned, row-major activation buffer on one device. Views (view()) share the storage.
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  Device device = Device::kCpu;
  std::shared_ptr<uint8_t[]> storage;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int rank() const { return static_cast<int>(shape.size()); }
  bool empty() const { return storage == nullptr; }
  // Same bytes, another shape of the same size.
  Tensor view(std::vector<int64_t> new_shape) const {
    Tensor t = *this;
    t.shape = std::move(new_shape);
    NB_CHECK(t.numel() == numel(), "view " + shape_string(t.shape) + " of " + shape_string(shape));
    return t;
  }
  template <class T>
  T* data() const {
    return reinterpret_cast<T*>(storage.get());
  }
};

// Paged KV cache: per layer, K and V in blocks of kKvBlock tokens. A sequence owns a block table;
// position p lives in block table[p / kKvBlock], slot p % kKvBlock. Sliding-window layers keep every
// position too (the window only limits what attention reads), which keeps the layout uniform.
inline constexpr int kKvBlock = 16;

struct KvCache {
  int n_blocks = 0;
  std::vector<Tensor> k, v;  // [n_layers] of [n_blocks, kKvBlock, n_kv_heads, head_dim]
};

// One sequence's part of a batch: its tokens are rows [begin, begin + n_new) of the batch.
struct SeqInfo {
  int32_t begin = 0, n_new = 0, n_past = 0;
  std::vector<int32_t> block_table;
};

// Everything about a forward step that is not a weight or an activation; validated by Model::forward.
struct BatchInfo {
  std::vector<int32_t> tokens;     // [n_tokens]; -1 - j: row j of the last sample_async's ids (Backend)
  std::vector<int32_t> positions;  // [n_tokens]: n_past + i within each sequence
  std::vector<int32_t> seq_of;     // [n_tokens]: index into seqs
  std::vector<SeqInfo> seqs;
  std::vector<int32_t> logit_rows;  // batch rows whose logits are returned, in batch order
  int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
  // Whether logit_rows is every row in order (a decode step): the rows need no gather.
  bool logits_of_every_row() const {
    for (size_t i = 0; i < logit_rows.size(); ++i)
      if (logit_rows[i] != static_cast<int32_t>(i)) return false;
    return static_cast<int64_t>(logit_rows.size()) == n_tokens();
  }
};

// RoPE in the half-split (NeoX / rotate_half) layout: dims [0, d/2) pair with [d/2, d).
// angle(p, i) = p * inv_freq[i]; cos and sin are both multiplied by attention_scale (YaRN).
struct RopeTable {
  std::vector<float> inv_freq;  // [head_dim / 2]
  float attention_scale = 1.0f;
};

struct AttentionParams {
  float scale = 1.0f;             // logit scale, 1/sqrt(head_dim)
  int window = 0;                 // > 0: query at p sees keys in (p - window, p]; 0: full causal
  const Tensor* sinks = nullptr;  // [n_heads] extra logit per head whose probability is dropped; or null
};

// The experts of one MoE layer, one Weight per expert (stacked checkpoint tensors are sliced per
// expert, per-expert tensors are fused per expert), so both producers load into the same shape.
enum class GluLayout : uint8_t {
  kInterleaved,  // fc1 row 2j is gate j, row 2j+1 is up j (gpt-oss, formats.md §2.3)
  kHalves,       // fc1 rows [0, d) are gate, [d, 2d) are up (gate_proj and up_proj fused)
};
enum class Activation : uint8_t {
  kSilu,           // silu(gate) * up
  kGptOssClamped,  // g = min(gate, L), u = clamp(up, -L, L), g * sigmoid(1.702 g) * (u + 1) (§2.4)
};
struct GluParams {
  Activation activation = Activation::kSilu;
  float limit = 0.0f;  // kGptOssClamped: swiglu_limit
};

struct MoeExperts {
  int n_experts = 0, d_expert = 0;
  GluLayout layout = GluLayout::kHalves;
  std::vector<Weight> fc1;    // [n_experts] of [2 * d_expert, d_model]
  std::vector<Weight> fc2;    // [n_experts] of [d_model, d_expert]
  Tensor fc1_bias, fc2_bias;  // [n_experts, 2 * d_expert], [n_experts, d_model]; empty when absent
};

enum class RouterKind : uint8_t {
  kTopKThenSoftmax,  // gpt-oss: top-k of the raw logits, softmax over those k
  kSoftmaxThenTopK,  // qwen3_moe: softmax over all experts, top-k, optional renormalisation
};

// What qkv_rope_kv_write needs besides the tensors: the head layout of the fused QKV rows, the optional
// per-head q/k RMSNorm weights (qwen3; null elsewhere) and the RoPE table.
struct QkvParams {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const Tensor* q_norm = nullptr;  // [head_dim] or null
  const Tensor* k_norm = nullptr;  // [head_dim] or null
  float eps = 1e-6f;
  const RopeTable* rope = nullptr;
};

// One logits row's sampling rule (runtime/sampler.h has the request-level SamplingParams): temperature 0
// is greedy (argmax, lowest id on ties); otherwise candidates are sorted by logit (ties: lower id first),
// cut to top_k (0: all), softmaxed at temperature, cut to the smallest prefix of mass >= top_p, then to
// those with probability >= min_p * the top one; u in [0, 1) times the kept mass picks the token.
struct SampleSpec {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  float min_p = 0.0f;
  double u = 0.0;  // uniform in [0, 1), drawn by the request's (seeded) generator on the host
};

struct Routes {
  Tensor ids;      // [n_tokens, top_k] I32 expert ids
  Tensor weights;  // [n_tokens, top_k] F32 routing weights
  // Deferred routes (the CUDA backend's add_rms_norm_route at one token): ids and weights are not written
  // yet; these router logits [n_tokens, n_experts] are, and moe_experts selects from them (by kind and
  // renormalize) in its first kernel, writing ids and weights then. Empty once ids and weights are written;
  // Backend::resolve_routes writes them on its own.
  Tensor logits;
  RouterKind kind = RouterKind::kTopKThenSoftmax;
  bool renormalize = false;
};

// An MoE block's input and its routes (Backend::add_rms_norm_route).
struct NormRoutes {
  Tensor h;  // [n_tokens, d_model] the normalized residual stream
  Routes routes;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Memory. upload() converts a host float tensor (F32, BF16 or F16: norms, biases, sinks) to F32.
  virtual Tensor alloc(DType dtype, std::vector<int64_t> shape) = 0;
  virtual Tensor upload(const TensorView& host) = 0;
  virtual std::vector<float> to_host(const Tensor& t) = 0;
  virtual std::unique_ptr<KvCache> new_kv_cache(int n_layers, int n_blocks, int n_kv_heads, int head_dim) = 0;
  // The element type new_kv_cache stores K and V in (the CPU reference keeps fp32).
  virtual DType kv_cache_dtype() const { return DType::kF32; }

  // Ops. Each returns a new tensor unless it says "in place".
  virtual Tensor embedding(const Weight& table, const BatchInfo& b) = 0;            // [n_tokens, d_model]
  virtual Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) = 0;         // over the last dim
  // The residual add fused with the next norm: x += y in place, returns rms_norm(x, w, eps) of the sum.
  virtual Tensor add_rms_norm(Tensor& x, const Tensor& y, const Tensor& w, float eps) = 0;
  virtual Tensor linear(const Tensor& x, const Weight& w, const Tensor* bias) = 0;  // [.., k] -> [.., n]
  virtual void rope(Tensor& x, const BatchInfo& b,
                    const RopeTable& rope) = 0;  // in place, [n_tokens, heads, head_dim]
  virtual void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchInfo& b) = 0;
  virtual Tensor attention(const Tensor& q, const KvCache& cache, int layer, const BatchInfo& b,
                           const AttentionParams& p) = 0;  // q [n_tokens, n_heads, head_dim] -> same shape
  // After the fused QKV projection: qkv [n_tokens, (n_heads + 2 n_kv_heads) * head_dim] holds q, k, v heads
  // in that order. Applies the q/k norms (when given) and RoPE to q and k, writes k and v into the cache
  // at the tokens' positions, returns q [n_tokens, n_heads, head_dim]. The same numbers as rms_norm, rope
  // and kv_write in turn.
  virtual Tensor qkv_rope_kv_write(const Tensor& qkv, const QkvParams& p, KvCache& cache, int layer,
                                   const BatchInfo& b) = 0;
  // An attention block's head: h = add_rms_norm(x, y, norm, eps) (x += y; y empty: rms_norm(x) alone), then
  // qkv_rope_kv_write(linear(h, qkv, qkv_bias), p, cache, layer, b): returns q. The same numbers as those
  // ops in turn, which is what this default does; the CUDA backend runs it as one kernel at one token, where
  // x may move to another buffer (the sum is written beside the old one).
  virtual Tensor norm_qkv_rope_kv_write(Tensor& x, const Tensor& y, const Tensor& norm, float eps, const Weight& qkv,
                                        const Tensor* qkv_bias, const QkvParams& p, KvCache& cache, int layer,
                                        const BatchInfo& b) {
    const Tensor h = y.empty() ? rms_norm(x, norm, eps) : add_rms_norm(x, y, norm, eps);
    return qkv_rope_kv_write(linear(h, qkv, qkv_bias), p, cache, layer, b);
  }
  virtual Routes moe_route(const Tensor& logits, int top_k, RouterKind kind, bool renormalize) = 0;
  // An MoE block's head: h = add_rms_norm(x, y, norm, eps) (x += y; y empty: rms_norm(x) alone), routes =
  // moe_route(linear(h, router, router_bias), top_k, kind, renormalize). The same numbers as those ops in
  // turn, which is what this default does; the CUDA backend runs it as one kernel at decode, where x may
  // move to another buffer (the sum is written beside the old one) and the routes may be deferred (Routes).
  virtual NormRoutes add_rms_norm_route(Tensor& x, const Tensor& y, const Tensor& norm, float eps,
                                        const Weight& router, const Tensor* router_bias, int top_k, RouterKind kind,
                                        bool renormalize) {
    NormRoutes r;
    r.h = y.empty() ? rms_norm(x, norm, eps) : add_rms_norm(x, y, norm, eps);
    r.routes = moe_route(linear(r.h, router, router_bias), top_k, kind, renormalize);
    return r;
  }
  // Routes with ids and weights written (deferred ones selected from their logits now; others as they are).
  virtual Routes resolve_routes(const Routes& r) { return r; }
  virtual Tensor moe_experts(const Tensor& x, const Routes& routes, const MoeExperts& experts,
                             const GluParams& glu) = 0;  // [n_tokens, d_model]: sum_k w_k (fc2(glu(fc1 x)))
  // moe_experts, then prefetch(*w) for each of `next` (weights the ops after it read soon); a backend may
  // issue those hints while the experts run instead (the CUDA backend: from its one-token FC2 kernel).
  virtual Tensor moe_experts_then_prefetch(const Tensor& x, const Routes& routes, const MoeExperts& experts,
                                           const GluParams& glu, const std::vector<const Weight*>& next) {
    Tensor y = moe_experts(x, routes, experts, glu);
    for (const Weight* w : next) prefetch(*w);
    return y;
  }
  virtual Tensor swiglu(const Tensor& gate, const Tensor& up) = 0;                    // silu(gate) * up
  virtual void add(Tensor& x, const Tensor& y) = 0;                                   // in place: x += y
  virtual Tensor gather_rows(const Tensor& x, const std::vector<int32_t>& rows) = 0;  // [rows, ..]
  // A hint that w is read soon (by an op a few ops later): a backend may start moving its bytes closer (the
  // CUDA backend: into the L2 cache, while the ops in between leave DRAM idle). No effect on any result.
  virtual void prefetch(const Weight& /*w*/) {}
  // One token id per row of logits [rows, vocab] under specs[row] (see SampleSpec); only the ids reach
  // the host.
  virtual std::vector<int32_t> sample(const Tensor& logits, const std::vector<SampleSpec>& specs) = 0;

  // Sampling the caller does not wait for: a decode loop queues step n + 1 before it reads step n's ids, so
  // the device does not idle while the host reads ids and prepares the next step. sample_async queues
  // sample(logits, specs); wait_sampled returns the ids of the oldest queued one not yet returned. The ids
  // of the latest sample_async (its first kKeptSampledRows rows) stay on the backend: a later step's token
  // -1 - j (BatchInfo::tokens) is its row j, read where the ids are (the CUDA backend: on the device).
  // This default samples at once and keeps the ids on the host.
  static constexpr int64_t kKeptSampledRows = 65536;
  virtual void sample_async(const Tensor& logits, const std::vector<SampleSpec>& specs) {
    sampled_.push_back(sample(logits, specs));
    last_sampled_ = sampled_.back();
    if (static_cast<int64_t>(last_sampled_.size()) > kKeptSampledRows) last_sampled_.resize(kKeptSampledRows);
  }
  virtual std::vector<int32_t> wait_sampled() {
    NB_CHECK(!sampled_.empty(), "wait_sampled: nothing queued");
    std::vector<int32_t> ids = std::move(sampled_.front());
    sampled_.pop_front();
    return ids;
  }

 protected:
  // Batch row t's token id, resolving -1 - j to the kept ids of the last sample_async (host backends).
  int32_t token_at(const BatchInfo& b, int64_t t) const {
    const int32_t id = b.tokens[t];
    return id >= 0 ? id : last_sampled_.at(static_cast<size_t>(-1 - static_cast<int64_t>(id)));
  }

 private:
  std::vector<int32_t> last_sampled_;
  std::deque<std::vector<int32_t>> sampled_;
};

}  // namespace nb
