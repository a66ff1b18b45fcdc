// The CPU reference backend: plain fp32 math on the host, split over a ThreadPool. Every op is the
// textbook formula, written for a reader checking it against the HF transformers reference.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "base/thread_pool.h"

namespace nb {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n_threads = 0) : pool_(n_threads) {}
  std::string name() const override { return "cpu (" + std::to_string(pool_.size()) + " threads)"; }

  Tensor alloc(DType dtype, std::vector<int64_t> shape) override;
  Tensor upload(const TensorView& host) override;
  std::vector<float> to_host(const Tensor& t) override;
  std::unique_ptr<KvCache> new_kv_cache(int n_layers, int n_blocks, int n_kv_heads, int head_dim) override;

  Tensor embedding(const Weight& table, const BatchInfo& b) override;
  Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) override;
  Tensor linear(const Tensor& x, const Weight& w, const Tensor* bias) override;
  void rope(Tensor& x, const BatchInfo& b, const RopeTable& rope) override;
  void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchInfo& b) override;
  Tensor attention(const Tensor& q, const KvCache& cache, int layer, const BatchInfo& b,
                   const AttentionParams& p) override;
  Routes moe_route(const Tensor& logits, int top_k, RouterKind kind, bool renormalize) override;
  Tensor moe_experts(const Tensor& x, const Routes& routes, const MoeExperts& experts,
                     const GluParams& glu) override;
  Tensor swiglu(const Tensor& gate, const Tensor& up) override;
  void add(Tensor& x, const Tensor& y) override;
  Tensor gather_rows(const Tensor& x, const std::vector<int32_t>& rows) override;

 private:
  // out[t, n] = x[t, :] . w[n, :] (+ bias[n]) for the n_rows rows of x; each weight row is decoded once.
  void matmul(const float* x, int64_t n_rows, const Weight& w, const float* bias, float* out);

  ThreadPool pool_;
};

}  // namespace nb
