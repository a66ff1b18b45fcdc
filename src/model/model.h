// Model: the public face of an architecture for the CLI and the server. load() reads config.json and
// the safetensors, validates every tensor, and picks the forward pass by model_type; forward() runs
// one batch of tokens from one or more sequences over a paged KV cache and returns logits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "base/status.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/loader.h"
#include "model/weight_factory.h"

namespace nb {

struct ModelOptions {
  Device device = Device::kCpu;
  int n_threads = 0;  // CPU backend: 0 = all cores
  // CUDA backend only:
  DType kv_cache_dtype = DType::kBF16;       // kBF16, kF8_E4M3 or kF32
  DenseFormat dense_format = DenseFormat::kKeep;  // re-quantize dense attention projections and lm_head
  bool dummy_weights = false;                // random weights from config.json alone; no safetensors read
  int gemm_min_tokens = 0, moe_gemm_min_tokens = 0;  // prefill GEMM thresholds, see CudaBackendOptions
  bool gemm_fp16_activations = true;                // see CudaBackendOptions
  int prefill_attention_min_tokens = 0;      // > 0: overrides CudaBackendOptions' (tests: 1 = tiled always)
};

struct KvCacheOptions {
  int n_blocks = 0;  // 0: enough for max_tokens
  int max_tokens = 4096;
  int blocks() const { return n_blocks > 0 ? n_blocks : (max_tokens + kKvBlock - 1) / kKvBlock; }
};

// One sequence's tokens in a batch. Its tokens sit at positions n_past .. n_past + n_new - 1 and are
// written to the cache blocks named by block_table (block i holds positions 16 i .. 16 i + 15).
struct SeqSlice {
  std::vector<int32_t> block_table;
  int32_t n_past = 0;  // tokens already cached
  int32_t n_new = 0;
  bool all_logits = false;  // true: logits for every new token (scoring, eval); false: only the last
};

// Tokens of one or more sequences, grouped per sequence, contiguous, in seqs order.
struct Batch {
  std::vector<int32_t> tokens;  // [sum n_new]
  std::vector<SeqSlice> seqs;
};

class Model {
 public:
  static Result<std::unique_ptr<Model>> load(const std::string& dir, const ModelOptions& options);

  // For the architecture subclasses; callers use load().
  Model(ModelConfig config, Checkpoint checkpoint, std::unique_ptr<Backend> backend);
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  // "cpu" or "cuda" (the backend the ops run on).
  const char* device_name() const { return backend_->name().rfind("cuda", 0) == 0 ? "cuda" : "cpu"; }
  // For `nibble inspect`: architecture, dimensions, and per tensor class its format, shape, parameters
  // and bytes, with totals.
  std::string describe() const;
  std::unique_ptr<KvCache> new_kv_cache(int n_blocks) const;
  // Bytes one KV block (kKvBlock tokens, K and V, every layer) takes in the backend's cache dtype.
  int64_t kv_block_bytes() const;
  // Runs the batch, writing the new tokens' K/V into the cache; returns logits [n_rows, vocab] (fp32,
  // host), rows in batch order: every new token of a seq with all_logits, else its last token.
  // A malformed batch (token ids, block tables, counts) is an error, never a crash.
  Result<std::vector<float>> forward(const Batch& batch, KvCache& cache);
  // The same step, then one token id per logits row sampled on the backend under specs (one per row, in
  // row order); only the ids reach the host (Backend::sample).
  Result<std::vector<int32_t>> forward_sampled(const Batch& batch, KvCache& cache,
                                               const std::vector<SampleSpec>& specs);
  // forward_sampled without waiting: the step and its sampling are queued on the backend, and
  // wait_sampled() returns the ids of the oldest queued step. A later batch's token -1 - j names row j of
  // the last queued step's ids, which stay on the backend: a decode loop queues step n + 1 before it reads
  // step n's ids (Backend::sample_async). Every queued step must be waited for, in order.
  Status enqueue_sampled(const Batch& batch, KvCache& cache, const std::vector<SampleSpec>& specs);
  std::vector<int32_t> wait_sampled();

 protected:
  // The architecture's forward pass: logits [b.logit_rows.size(), vocab] on the backend.
  virtual Tensor run(const BatchInfo& b, KvCache& cache) = 0;
  // Loads and validates every weight; called once by load().
  virtual Status load_weights(WeightLoader& w) = 0;

  ModelConfig config_;
  Checkpoint checkpoint_;  // owns the mmapped data the weights point into
  std::unique_ptr<Backend> backend_;
  WeightCatalog catalog_;

 private:
  Result<BatchInfo> make_batch_info(const Batch& batch, const KvCache& cache) const;
  int64_t last_sampled_rows_ = 0;  // rows of the last queued step's ids a token -1 - j may name
  int n_queued_ = 0;               // enqueue_sampled steps not yet waited for
  // The logits of a validated batch, on the backend (a CUDA graph replay for decode steps).
  Tensor run_step(const BatchInfo& info, KvCache& cache);
};

// The architectures (one file each); called by Model::load.
std::unique_ptr<Model> new_gpt_oss(ModelConfig config, Checkpoint checkpoint,
                                   std::unique_ptr<Backend> backend);
std::unique_ptr<Model> new_qwen3(ModelConfig config, Checkpoint checkpoint, std::unique_ptr<Backend> backend);
std::unique_ptr<Model> new_llama(ModelConfig config, Checkpoint checkpoint, std::unique_ptr<Backend> backend);

}  // namespace nb
