// The CUDA backend: every Backend op on one GPU, on one stream, with kernels from src/kernels/.
// Activations are fp32 (the same numbers as the CPU reference up to summation order; decode is bound by
// weight bytes, so wider activations cost little); the KV cache is BF16, FP8 E4M3 or fp32. Weights are
// read where the loader put them: checkpoint tensors are copied to the device once (upload_checkpoint)
// and host views into the checkpoint are translated to their device copies; re-quantized and random
// weights are device buffers owned here. Activation memory comes from a caching pool, never a
// cudaMalloc per op. This header needs no CUDA headers, so host code (model.cc) can include it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "io/safetensors.h"
#include "model/weight_factory.h"

namespace nb {

struct CudaBackendOptions {
  int device = 0;
  DType kv_cache_dtype = DType::kBF16;  // kBF16, kF8_E4M3 or kF32
  bool poison = false;                  // tests: fill every new activation buffer with NaN bytes
  // Prefill: FP4 linears with at least this many tokens, and FP4 MoE layers with at least this many
  // tokens, run the tensor-core GEMMs (kernels/gemm_fp4.cuh, moe_gemm.cuh) instead of the GEMV kernels.
  // 0: the measured defaults (cuda_backend.cu); 1 forces the GEMMs (tests).
  int gemm_min_tokens = 0;
  int moe_gemm_min_tokens = 0;
  // The FP4 tensor-core paths round activations to one fp16 (11 bits; the default: prefill GEMMs measured
  // 1.2-1.3x faster end to end, the one-token decode GEMVs +6 % tg128) or keep hi + lo (~22 bits, the
  // goldens' 1e-4 accuracy; NIBBLE_GEMM_ACTIVATIONS=hi-lo). (The 2..8-token decode kernels keep hi + lo.)
  bool gemm_fp16_activations = true;
  // Dense FP4 prefill GEMMs with E4M3 activations on the FP8 tensor cores (sm_90a only; elsewhere ignored): a
  // W4A8 product, ~4 significant bits per activation and NVFP4 weight products rounded to E4M3
  // (kernels/gemm_fp4_wsr8.cuh). Off by default (NIBBLE_GEMM_FP8=1). The MoE grouped GEMMs too (moe_gemm.cu
  // moe_wsr8_kernel: FC1 from E4M3 token rows, its GLU output rounded to E4M3 per row for FC2).
  bool gemm_fp8_activations = false;
  // Attention in steps where a sequence has at least this many new tokens uses the tiled prefill kernel
  // (tests: 1 forces it everywhere). Measured on the H200, gpt-oss shapes after a 4096-token prefix: the
  // split kernel wins at 1-2 new tokens, the tiled one from 4 (1.7x) and 8 (3x); see bench/NOTES.md.
  int prefill_attention_min_tokens = 8;
  // Decode fusions (NIBBLE_DECODE_FUSION=0 turns them off: a benchmark baseline, and the tests' way to
  // cover the unfused kernels): add + RMSNorm + router + top-k as one kernel (add_rms_norm_route), and
  // decode attention merging its context splits in the last split block of each (token, head) instead
  // of a second kernel (which steps beyond 65536 (token, head) pairs use anyway).
  bool decode_fusion = true;
  // FP4 dense prefill GEMMs on a warp-specialized tile (one-fp16 activations only). sm_90a (gemm_fp4_ws.cuh):
  // -1 where its 128 x 256 blocks fill the GPU or, from 512 tokens, a third of it, else from 256 tokens the
  // portable tile where its 128 x 128 items fill half the SMs to one round; 0 never (the wgmma tile); 1 the
  // sm_90a tile from 256 tokens on (tests). Elsewhere, the portable tile (gemm_fp4_wsp.cuh): -1 and 1 from
  // 128 tokens on, 0 never (the block tile). NIBBLE_GEMM_WS=0|1.
  int gemm_ws = -1;
  // Backend::prefetch issues L2 prefetches (NIBBLE_L2_PREFETCH=1). Off by default since the twenty-first
  // session (H200, tg128 at a 64-token context: off +1.2 % gpt-oss-120b, +0.6 % 20b all-MXFP4, +0.5-1.1 %
  // FP8, `keep` neutral; after a 4096-token prompt the 20b 0.7 % slower off): the 14 MB of the next layer's
  // QKV and O that FC1 prefetched delayed its own weights more than they saved the small projections
  // (bench/NOTES.md).
  bool l2_prefetch = false;
  // add_rms_norm_route at one token defers the expert selection to the MoE kernels (Routes::logits;
  // NIBBLE_DEFER_ROUTES=0: the norm_route kernel selects them, a benchmark baseline).
  bool defer_routes = true;
  // norm_qkv_rope_kv_write at one token (FP4 QKV, no q/k norms, one fp16 per activation) as one kernel
  // (NIBBLE_FUSED_HEAD=0: the three ops, a benchmark baseline). Also off without decode_fusion.
  bool fused_head = true;
  // Attention at one token (head_dim % 32 == 0, n_heads * head_dim <= 4096) also writes its output as the
  // one-token FP4 O projection stages its input (cuda::AttnShape::stage_planes), which then copies it
  // (NIBBLE_O_STAGED=0: the O kernel stages the fp32 output itself, a benchmark baseline).
  bool stage_o_input = true;
  // Prefill MoE layers with BF16 experts (from moe_gemm_min_tokens): each routed expert's rows through
  // cuBLASLt, grouped on the host (NIBBLE_MOE_DENSE_GEMM=0: the per-token expert kernels, a baseline).
  bool moe_dense_gemm = true;
};

struct CudaLoadStats {
  int64_t bytes = 0;
  double seconds = 0;
};

class CudaBackend final : public Backend, public WeightFactory {
 public:
  // Errors: no usable GPU, a GPU this binary was not built for, an unsupported KV dtype.
  static Result<std::unique_ptr<CudaBackend>> create(const CudaBackendOptions& options);
  ~CudaBackend() override;
  std::string name() const override;

  // Copies every tensor of the checkpoint to the device in large asynchronous copies; weight views into
  // the checkpoint then resolve to the copies. Errors: out of device memory.
  Result<CudaLoadStats> upload_checkpoint(const Checkpoint& ckpt);
  // The same for any host byte ranges (tests build weights in host memory).
  Result<CudaLoadStats> upload_views(const std::vector<TensorView>& views);
  // Waits for all queued work; returns the first asynchronous CUDA error as a Status.
  Status synchronize();
  void* stream() const;  // cudaStream_t, for benchmarks and graphs

  Tensor alloc(DType dtype, std::vector<int64_t> shape) override;
  Tensor upload(const TensorView& host) override;
  std::vector<float> to_host(const Tensor& t) override;
  std::unique_ptr<KvCache> new_kv_cache(int n_layers, int n_blocks, int n_kv_heads, int head_dim) override;
  DType kv_cache_dtype() const override;

  Tensor embedding(const Weight& table, const BatchInfo& b) override;
  Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) override;
  Tensor add_rms_norm(Tensor& x, const Tensor& y, const Tensor& w, float eps) override;
  Tensor linear(const Tensor& x, const Weight& w, const Tensor* bias) override;
  void prefetch(const Weight& w) override;
  void rope(Tensor& x, const BatchInfo& b, const RopeTable& rope) override;
  void kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchInfo& b) override;
  Tensor attention(const Tensor& q, const KvCache& cache, int layer, const BatchInfo& b,
                   const AttentionParams& p) override;
  Tensor qkv_rope_kv_write(const Tensor& qkv, const QkvParams& p, KvCache& cache, int layer,
                           const BatchInfo& b) override;
  Routes moe_route(const Tensor& logits, int top_k, RouterKind kind, bool renormalize) override;
  Routes resolve_routes(const Routes& r) override;
  Tensor norm_qkv_rope_kv_write(Tensor& x, const Tensor& y, const Tensor& norm, float eps, const Weight& qkv,
                                const Tensor* qkv_bias, const QkvParams& p, KvCache& cache, int layer,
                                const BatchInfo& b) override;
  NormRoutes add_rms_norm_route(Tensor& x, const Tensor& y, const Tensor& norm, float eps, const Weight& router,
                                const Tensor* router_bias, int top_k, RouterKind kind, bool renormalize) override;
  Tensor moe_experts(const Tensor& x, const Routes& routes, const MoeExperts& experts,
                     const GluParams& glu) override;
  Tensor moe_experts_then_prefetch(const Tensor& x, const Routes& routes, const MoeExperts& experts,
                                   const GluParams& glu, const std::vector<const Weight*>& next) override;
  Tensor swiglu(const Tensor& gate, const Tensor& up) override;
  void add(Tensor& x, const Tensor& y) override;
  Tensor gather_rows(const Tensor& x, const std::vector<int32_t>& rows) override;
  std::vector<int32_t> sample(const Tensor& logits, const std::vector<SampleSpec>& specs) override;
  // The ids stay on the device for the next step's embedding (Impl::last_ids); their host copy lands in a
  // pinned buffer, read after its event.
  void sample_async(const Tensor& logits, const std::vector<SampleSpec>& specs) override;
  std::vector<int32_t> wait_sampled() override;

  // moe_experts in its two launches, for the kernel benchmark: act [n_tokens * top_k, d_expert] after
  // fc1 + GLU; y [n_tokens, d_model] after fc2 and the weighted combine. moe_fc2's routes must be complete
  // before the kernel preceding it begins (as after moe_fc1 with the same routes).
  // Deferred routes (Routes::logits) only where the one-token kernels take them (one token, FP4 experts).
  Tensor moe_fc1(const Tensor& x, const Routes& routes, const MoeExperts& experts, const GluParams& glu);
  Tensor moe_fc2(const Tensor& act, const Routes& routes, const MoeExperts& experts);

  // Runs `step` (which enqueues one forward pass over `b` and returns its logits) as a CUDA graph, one per
  // (batch shape, cache): the first call for a shape runs eagerly (builds lazily made tables), the second
  // captures, later calls upload the new token metadata into the captured buffers and replay. Scratch
  // memory used inside a graph belongs to that graph. Meant for decode steps (a few tokens).
  Tensor run_graphed(const BatchInfo& b, const KvCache& cache, const std::function<Tensor()>& step);

  Weight random_weight(WeightFormat format, int64_t n, int64_t k, float std, uint64_t seed,
                       const std::string& name) override;
  Tensor random_floats(const std::vector<int64_t>& shape, float mean, float std, uint64_t seed) override;
  Result<Weight> requantize(const Weight& w, WeightFormat format) override;

  struct Impl;

 private:
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nb
