// The CPU reference backend: plain fp32 math on the host, split over a ThreadPool. Every op is the
// textbook formula, written for a reader checking it against the HF transformers reference.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "base/thread_pool.h"
#include "model/weight_factory.h"

namespace nb {

// Also a WeightFactory for --dummy-weights (random weights of a config's shapes in host memory, small
// configs for tests); re-quantization (--dense-format) is the CUDA backend's.
class CpuBackend final : public Backend, public WeightFactory {
 public:
  // fp8_emulation: every FP4 product with the roundings of the sm_90a FP8-activation GEMMs (NIBBLE_GEMM_FP8=1:
  // E4M3 token rows at one power-of-two scale each, FP4 weights rounded to E4M3 at their row's fold;
  // model/weight.h fp8_round_row, fp8_weight_row), so that their effect on a checkpoint is measured here too.
  explicit CpuBackend(int n_threads = 0, bool fp8_emulation = false) : pool_(n_threads), fp8_emulation_(fp8_emulation) {}
  std::string name() const override {
    return "cpu (" + std::to_string(pool_.size()) + " threads" + (fp8_emulation_ ? ", FP8 activations emulated" : "") + ")";
  }

  Tensor alloc(DType dtype, std::vector<int64_t> shape) override;
  Tensor upload(const TensorView& host) override;
  std::vector<float> to_host(const Tensor& t) override;
  std::unique_ptr<KvCache> new_kv_cache(int n_layers, int n_blocks, int n_kv_heads, int head_dim) override;

  Tensor embedding(const Weight& table, const BatchInfo& b) override;
  Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) override;
  Tensor add_rms_norm(Tensor& x, const Tensor& y, const Tensor& w, float eps) override;
  Tensor linear(const Tensor& x, const Weight& w, const Tensor* bias) override;
  void rope(Tensor& x, const BatchInfo& b, const RopeTable& rope) override;
  void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchInfo& b) override;
  Tensor attention(const Tensor& q, const KvCache& cache, int layer, const BatchInfo& b,
                   const AttentionParams& p) override;
  Tensor qkv_rope_kv_write(const Tensor& qkv, const QkvParams& p, KvCache& cache, int layer,
                           const BatchInfo& b) override;
  Routes moe_route(const Tensor& logits, int top_k, RouterKind kind, bool renormalize) override;
  Tensor moe_experts(const Tensor& x, const Routes& routes, const MoeExperts& experts,
                     const GluParams& glu) override;
  Tensor swiglu(const Tensor& gate, const Tensor& up) override;
  void add(Tensor& x, const Tensor& y) override;
  Tensor gather_rows(const Tensor& x, const std::vector<int32_t>& rows) override;
  std::vector<int32_t> sample(const Tensor& logits, const std::vector<SampleSpec>& specs) override;

  Weight random_weight(WeightFormat format, int64_t n, int64_t k, float std, uint64_t seed,
                       const std::string& name) override;
  Tensor random_floats(const std::vector<int64_t>& shape, float mean, float std, uint64_t seed) override;
  Result<Weight> requantize(const Weight& w, WeightFormat format) override;

 private:
  // out[t, n] = x[t, :] . w[n, :] (+ bias[n]) for the n_rows rows of x; each weight row is decoded once.
  void matmul(const float* x, int64_t n_rows, const Weight& w, const float* bias, float* out);

  ThreadPool pool_;
  bool fp8_emulation_ = false;
};

}  // namespace nb
