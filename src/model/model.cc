// Model::load (config, checkpoint, backend, architecture), batch validation and describe().
#include "model/model.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "base/log.h"
#if NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace nb {
namespace {

// Environment variable `name`: null when unset, else its value, which must be `a` or `b`.
Result<const char*> env_choice(const char* name, const char* a, const char* b) {
  const char* v = std::getenv(name);
  if (v && std::string(v) != a && std::string(v) != b)
    return error(std::string(name) + "=" + v + ": expected " + a + " or " + b);
  return v;
}

// What every architecture needs from the config; a zero here would divide or index out of range.
Status check_dims(const ModelConfig& c) {
  auto need = [](bool ok, const std::string& what) { return ok ? Status() : error("config.json: " + what); };
  NB_RETURN_IF_ERROR(need(c.vocab_size > 0 && c.d_model > 0 && c.n_layers > 0,
                          "vocab_size, hidden_size and "
                          "num_hidden_layers must be > 0"));
  NB_RETURN_IF_ERROR(need(c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0,
                          "num_attention_heads must be a positive multiple of num_key_value_heads"));
  NB_RETURN_IF_ERROR(need(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim must be even and > 0"));
  if (c.n_experts > 0)
    NB_RETURN_IF_ERROR(
        need(c.top_k > 0 && c.top_k <= c.n_experts && c.d_expert > 0,
             "MoE needs 0 < num_experts_per_tok <= num_experts and an expert intermediate size"));
  NB_RETURN_IF_ERROR(need(c.layer_sliding.empty() || static_cast<int>(c.layer_sliding.size()) == c.n_layers,
                          "layer_types must have num_hidden_layers entries"));
  return Status();
}

}  // namespace

Model::Model(ModelConfig config, Checkpoint checkpoint, std::unique_ptr<Backend> backend)
    : config_(std::move(config)), checkpoint_(std::move(checkpoint)), backend_(std::move(backend)) {}

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, const ModelOptions& options) {
  // Environment switches, checked on every backend so that a misspelt value is an error, not a silently
  // ignored setting. NIBBLE_GEMM_ACTIVATIONS (CUDA prefill GEMMs and one-token FP4 GEMVs): fp16 (the default)
  // or hi-lo (~22 bits, slower). Benchmark switches, 0 or 1: NIBBLE_FP4_STREAM (CUDA one-token FP4 GEMV, read
  // by the kernels) NIBBLE_DECODE_FUSION (CudaBackendOptions::decode_fusion), NIBBLE_GEMM_WS (::gemm_ws;
  // unset: the backend's choice), NIBBLE_GEMM_FP8 (::gemm_fp8_activations, off by default; on the CPU backend its emulation), NIBBLE_FC1_EVEN
  // (the one-token MoE FC1 grid, read by its launcher), NIBBLE_STREAM_ONE_ROUND (the one-token FP4 kernels' one-round grids, read by their launchers),
  // NIBBLE_ATTN_KEYS (the lanes-over-keys decode attention, read by its launcher), NIBBLE_ATTN_GROUP (1: the
  // grouped long-context decode attention, opt-in until measured; 0 never), NIBBLE_FP4_MMA
  // (the 2..8-token tensor-core FP4 GEMV), NIBBLE_WGMMA (the sm_90a prefill GEMM tile), NIBBLE_L2_PREFETCH
  // (CudaBackendOptions::l2_prefetch, off by default: 1 turns it on), NIBBLE_DEFER_ROUTES (::defer_routes),
  // NIBBLE_FUSED_HEAD (::fused_head), NIBBLE_O_STAGED (::stage_o_input) and NIBBLE_MOE_DENSE_GEMM
  // (::moe_dense_gemm). A test switch: NIBBLE_STREAM_SMS,
  // a positive SM count (the one-token FP4 kernels' grids sized for at most that many SMs). Measurement switches read by the GEMM
  // launchers: NIBBLE_WSP_STAGES (2: the portable warp-specialized tile at GB10's depth),
  // NIBBLE_MOE_VARIANT (0-3: a portable MoE block tile), NIBBLE_MOE_WSR (the sm_90a MoE GEMMs' register-fragment
  // tile: 0 never, 1 always, 2 always with two fragment sets; unset: where experts average >= 192 rows),
  // NIBBLE_MOE_WSR_BM (128 or 256: its token-tile height), NIBBLE_WS_RS (0-2: the sm_90a dense tile's variant,
  // gemm_fp4.cuh gemm_ws_rs), NIBBLE_WS_BM (128 or 256: its tokens per tile) and, read by the flash-attention
  // launcher, NIBBLE_FA_BUFFERS (2: the BF16 cache's two-buffer kernels sm_120 / sm_121 take, on any GPU).
  // (Values unused in a CPU-only build.)
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* gemm_acts, env_choice("NIBBLE_GEMM_ACTIVATIONS", "fp16", "hi-lo"));
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_FP4_STREAM", "0", "1").status());
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* fusion, env_choice("NIBBLE_DECODE_FUSION", "0", "1"));
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* gemm_ws, env_choice("NIBBLE_GEMM_WS", "0", "1"));
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* gemm_fp8, env_choice("NIBBLE_GEMM_FP8", "0", "1"));
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_FC1_EVEN", "0", "1").status());
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_STREAM_ONE_ROUND", "0", "1").status());
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_ATTN_KEYS", "0", "1").status());
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_ATTN_GROUP", "0", "1").status());
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_FP4_MMA", "0", "1").status());
  NB_RETURN_IF_ERROR(env_choice("NIBBLE_WGMMA", "0", "1").status());
  if (const char* v = std::getenv("NIBBLE_MOE_WSR"); v && (std::string(v).size() != 1 || v[0] < '0' || v[0] > '2'))
    return error(std::string("NIBBLE_MOE_WSR=") + v + ": expected 0, 1 or 2");
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* l2_prefetch, env_choice("NIBBLE_L2_PREFETCH", "0", "1"));
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* defer_routes, env_choice("NIBBLE_DEFER_ROUTES", "0", "1"));
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* fused_head, env_choice("NIBBLE_FUSED_HEAD", "0", "1"));
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* o_staged, env_choice("NIBBLE_O_STAGED", "0", "1"));
  NB_ASSIGN_OR_RETURN([[maybe_unused]] const char* moe_dense, env_choice("NIBBLE_MOE_DENSE_GEMM", "0", "1"));
  if (const char* v = std::getenv("NIBBLE_STREAM_SMS")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || n < 1 || n > 100000)
      return error(std::string("NIBBLE_STREAM_SMS=") + v + ": expected a positive SM count");
  }
  if (const char* v = std::getenv("NIBBLE_WS_RS"); v && (std::string(v).size() != 1 || v[0] < '0' || v[0] > '2'))
    return error(std::string("NIBBLE_WS_RS=") + v + ": expected 0, 1 or 2");
  if (const char* v = std::getenv("NIBBLE_MOE_WSR_BM"); v && std::string(v) != "128" && std::string(v) != "256")
    return error(std::string("NIBBLE_MOE_WSR_BM=") + v + ": expected 128 or 256");
  if (const char* v = std::getenv("NIBBLE_WS_BM"); v && std::string(v) != "128" && std::string(v) != "256")
    return error(std::string("NIBBLE_WS_BM=") + v + ": expected 128 or 256");
  if (const char* v = std::getenv("NIBBLE_WSP_STAGES"); v && std::string(v) != "2")
    return error(std::string("NIBBLE_WSP_STAGES=") + v + ": expected 2 (unset: the GPU's own depth)");
  if (const char* v = std::getenv("NIBBLE_FA_BUFFERS"); v && std::string(v) != "2")
    return error(std::string("NIBBLE_FA_BUFFERS=") + v + ": expected 2 (unset: what the GPU's shared memory holds)");
  if (const char* v = std::getenv("NIBBLE_MOE_VARIANT");
      v && !(std::strlen(v) == 1 && v[0] >= '0' && v[0] <= '3'))
    return error(std::string("NIBBLE_MOE_VARIANT=") + v +
                 ": expected 0, 1, 2 or 3 (unset: the backend's choice)");
  NB_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(dir));
  NB_RETURN_IF_ERROR(check_dims(config).with_context(dir));
  // The backend, and the weights' bytes on its device (CPU: the mmapped checkpoint as it is).
  Checkpoint ckpt;
  if (!options.dummy_weights) {
    NB_ASSIGN_OR_RETURN(ckpt, Checkpoint::open(dir));
  }
  std::unique_ptr<Backend> backend;
  WeightFactory* factory = nullptr;
  if (options.device == Device::kCpu) {
    if (options.dense_format != DenseFormat::kKeep) return error("--dense-format needs the CUDA backend");
    // NIBBLE_GEMM_FP8=1 on the CPU: every FP4 product emulates the FP8 GEMMs' roundings (the GPU takes them
    // in prefill on sm_90a), to measure what they cost a checkpoint on any machine.
    auto cpu = std::make_unique<CpuBackend>(options.n_threads, gemm_fp8 && std::string(gemm_fp8) == "1");
    if (options.dummy_weights) factory = cpu.get();
    backend = std::move(cpu);
  } else {
#if NIBBLE_HAVE_CUDA
    CudaBackendOptions co;
    co.kv_cache_dtype = options.kv_cache_dtype;
    co.gemm_min_tokens = options.gemm_min_tokens;
    co.moe_gemm_min_tokens = options.moe_gemm_min_tokens;
    co.gemm_fp16_activations = options.gemm_fp16_activations;
    if (gemm_acts) co.gemm_fp16_activations = std::string(gemm_acts) == "fp16";
    if (fusion) co.decode_fusion = std::string(fusion) == "1";
    if (gemm_ws) co.gemm_ws = std::string(gemm_ws) == "1" ? 1 : 0;
    if (gemm_fp8) co.gemm_fp8_activations = std::string(gemm_fp8) == "1";
    if (l2_prefetch) co.l2_prefetch = std::string(l2_prefetch) == "1";
    if (defer_routes) co.defer_routes = std::string(defer_routes) == "1";
    if (fused_head) co.fused_head = std::string(fused_head) == "1";
    if (o_staged) co.stage_o_input = std::string(o_staged) == "1";
    if (moe_dense) co.moe_dense_gemm = std::string(moe_dense) == "1";
    if (options.prefill_attention_min_tokens > 0) co.prefill_attention_min_tokens = options.prefill_attention_min_tokens;
    NB_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> cuda, CudaBackend::create(co));
    if (!options.dummy_weights) {
      NB_ASSIGN_OR_RETURN(CudaLoadStats st, cuda->upload_checkpoint(ckpt));
      NB_LOG_INFO("weights to the GPU: %.2f GB in %.2f s (%.1f GB/s)", st.bytes / 1e9, st.seconds,
                  st.seconds > 0 ? st.bytes / 1e9 / st.seconds : 0.0);
    }
    factory = cuda.get();
    backend = std::move(cuda);
#else
    return error("--device cuda: this build has no CUDA backend (configure with nvcc present)");
#endif
  }
  std::unique_ptr<Model> model;
  switch (config.arch) {
    case Arch::kGptOss:
      if (config.quant.method != QuantMethod::kMxfp4 && config.quant.method != QuantMethod::kNone)
        return error(dir + ": gpt_oss with " + quant_method_name(config.quant.method) +
                     " is not supported (gpt-oss experts are MXFP4)");
      model = new_gpt_oss(std::move(config), std::move(ckpt), std::move(backend));
      break;
    case Arch::kQwen3:
    case Arch::kQwen3Moe:
    case Arch::kLlama:
      if (config.quant.method == QuantMethod::kMxfp4)
        return error(dir + ": " + arch_name(config.arch) + " with mxfp4 is not supported");
      model = config.arch == Arch::kLlama ? new_llama(std::move(config), std::move(ckpt), std::move(backend))
                                          : new_qwen3(std::move(config), std::move(ckpt), std::move(backend));
      break;
  }
  NB_CHECK(model != nullptr, "unhandled architecture");
  WeightLoader loader(model->checkpoint_, model->config_, *model->backend_, model->catalog_);
  loader.use_factory(factory, options.dummy_weights, options.dense_format);
  NB_RETURN_IF_ERROR(model->load_weights(loader).with_context(dir));
  return model;
}

std::unique_ptr<KvCache> Model::new_kv_cache(int n_blocks) const {
  return backend_->new_kv_cache(config_.n_layers, n_blocks, config_.n_kv_heads, config_.head_dim);
}

int64_t Model::kv_block_bytes() const {
  return int64_t{2} * config_.n_layers * kKvBlock * config_.n_kv_heads * config_.head_dim *
         dtype_bits(backend_->kv_cache_dtype()) / 8;
}

Result<BatchInfo> Model::make_batch_info(const Batch& batch, const KvCache& cache) const {
  BatchInfo b;
  b.tokens = batch.tokens;
  if (batch.seqs.empty()) return error("batch: no sequences");
  int64_t total = 0;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SeqSlice& q = batch.seqs[s];
    const std::string where = "batch: sequence " + std::to_string(s) + ": ";
    if (q.n_new < 1 || q.n_past < 0) return error(where + "needs n_new >= 1 and n_past >= 0");
    const int64_t end = int64_t{q.n_past} + q.n_new;
    if (static_cast<int64_t>(q.block_table.size()) * kKvBlock < end)
      return error(where + "block table of " + std::to_string(q.block_table.size()) + " blocks cannot hold " +
                   std::to_string(end) + " positions");
    for (int32_t block : q.block_table)
      if (block < 0 || block >= cache.n_blocks)
        return error(where + "block id " + std::to_string(block) + " outside the cache's " +
                     std::to_string(cache.n_blocks) + " blocks");
    SeqInfo info{static_cast<int32_t>(total), q.n_new, q.n_past, q.block_table};
    for (int32_t i = 0; i < q.n_new; ++i) {
      b.positions.push_back(q.n_past + i);
      b.seq_of.push_back(static_cast<int32_t>(s));
      if (q.all_logits || i == q.n_new - 1) b.logit_rows.push_back(static_cast<int32_t>(total + i));
    }
    b.seqs.push_back(std::move(info));
    total += q.n_new;
  }
  if (total != b.n_tokens())
    return error("batch: sequences hold " + std::to_string(total) + " tokens but the batch has " +
                 std::to_string(b.n_tokens()));
  for (int64_t t = 0; t < b.n_tokens(); ++t) {
    const int32_t id = b.tokens[t];
    if (id < 0 && -1 - int64_t{id} >= last_sampled_rows_)
      return error("batch: token " + std::to_string(id) + " names row " + std::to_string(-1 - int64_t{id}) +
                   " of the last sampled step's ids (rows: " + std::to_string(last_sampled_rows_) + ")");
    if (id >= config_.vocab_size)
      return error("batch: token id " + std::to_string(id) + " outside the vocabulary of " +
                   std::to_string(config_.vocab_size));
  }
  return b;
}

Tensor Model::run_step(const BatchInfo& info, KvCache& cache) {
#if NIBBLE_HAVE_CUDA
  // Decode steps (a few tokens) replay one CUDA graph per batch shape.
  if (auto* cuda = dynamic_cast<CudaBackend*>(backend_.get()); cuda && info.n_tokens() <= 8)
    return cuda->run_graphed(info, cache, [&] { return run(info, cache); });
#endif
  return run(info, cache);
}

Result<std::vector<float>> Model::forward(const Batch& batch, KvCache& cache) {
  if (cache.k.size() != static_cast<size_t>(config_.n_layers))
    return error("KV cache made for another model");
  NB_ASSIGN_OR_RETURN(BatchInfo info, make_batch_info(batch, cache));
  return backend_->to_host(run_step(info, cache));
}

Result<std::vector<int32_t>> Model::forward_sampled(const Batch& batch, KvCache& cache,
                                                    const std::vector<SampleSpec>& specs) {
  if (n_queued_ > 0) return error("forward_sampled: " + std::to_string(n_queued_) + " queued steps not waited for");
  NB_RETURN_IF_ERROR(enqueue_sampled(batch, cache, specs));
  return wait_sampled();
}

Status Model::enqueue_sampled(const Batch& batch, KvCache& cache, const std::vector<SampleSpec>& specs) {
  if (cache.k.size() != static_cast<size_t>(config_.n_layers))
    return error("KV cache made for another model");
  NB_ASSIGN_OR_RETURN(BatchInfo info, make_batch_info(batch, cache));
  if (specs.size() != info.logit_rows.size())
    return error("forward_sampled: " + std::to_string(specs.size()) + " sampling specs for " +
                 std::to_string(info.logit_rows.size()) + " logits rows");
  backend_->sample_async(run_step(info, cache), specs);
  last_sampled_rows_ = std::min<int64_t>(static_cast<int64_t>(specs.size()), Backend::kKeptSampledRows);
  ++n_queued_;
  return Status();
}

std::vector<int32_t> Model::wait_sampled() {
  NB_CHECK(n_queued_ > 0, "wait_sampled: no queued step");
  --n_queued_;
  return backend_->wait_sampled();
}

std::string Model::describe() const {
  const ModelConfig& c = config_;
  char line[512];
  std::string out;
  std::snprintf(line, sizeof(line), "architecture: %s   quantization: %s   backend: %s\n", arch_name(c.arch),
                quant_method_name(c.quant.method), backend_->name().c_str());
  out += line;
  std::snprintf(
      line, sizeof(line),
      "dims: vocab %d, d_model %d, layers %d, heads %d, kv heads %d, head_dim %d, d_ff %d, rms eps %g\n",
      c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.rms_norm_eps);
  out += line;
  if (c.n_experts > 0) {
    std::snprintf(line, sizeof(line), "moe: %d experts, top %d, d_expert %d, norm_topk_prob %s\n",
                  c.n_experts, c.top_k, c.d_expert, c.norm_topk_prob ? "true" : "false");
    out += line;
  }
  static const char* kRope[] = {"default", "yarn", "llama3"};
  std::snprintf(line, sizeof(line), "rope: %s, theta %g, factor %g; sliding window %d; tied embeddings %s\n",
                kRope[static_cast<int>(c.rope.type)], c.rope.theta, c.rope.factor, c.sliding_window,
                c.tie_word_embeddings ? "yes" : "no");
  out += line;
  return out + catalog_table(catalog_);
}

}  // namespace nb
