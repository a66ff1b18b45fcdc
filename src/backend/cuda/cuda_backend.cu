// CudaBackend: memory (caching pool, weight copies), the translation of model Weights into kernel
// descriptors, and the Backend ops as kernel launches on one stream. Kernels live in src/kernels/.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "base/log.h"
#include "kernels/attention.cuh"
#include "kernels/flash_attention.cuh"
#include "kernels/gemm_dense.cuh"
#include "kernels/gemm_fp4.cuh"
#include "kernels/gemv.cuh"
#include "kernels/moe.cuh"
#include "kernels/moe_gemm.cuh"
#include "kernels/norm_rope.cuh"
#include "kernels/prefetch.cuh"
#include "kernels/qkv_rope.cuh"
#include "kernels/quant.cuh"
#include "kernels/sample.cuh"
#include "kernels/stage.cuh"

namespace nb {

using cuda::DevWeight;
using cuda::KvKind;
using cuda::WKind;

namespace {

// Freed activation buffers are kept by size class and handed out again; the stream orders reuse, since
// every op runs on the one stream. Size classes: powers of two up to 1 MiB, then whole MiB.
class Pool {
 public:
  ~Pool() { release_all(); }
  static size_t size_class(size_t bytes) {
    if (bytes <= 256) return 256;
    if (bytes <= (1u << 20)) {
      size_t c = 256;
      while (c < bytes) c <<= 1;
      return c;
    }
    return (bytes + (1u << 20) - 1) & ~size_t{(1u << 20) - 1};
  }
  // While a graph is captured its scratch comes from, and returns to, the graph's own list, so no later
  // allocation outside the graph can hold memory the graph writes on replay.
  void begin_private(std::multimap<size_t, void*>* list) { private_ = list; }
  void end_private() { private_ = nullptr; }

  void* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::multimap<size_t, void*>& from = private_ ? *private_ : free_;
      auto it = from.find(bytes);
      if (it != from.end()) {
        void* p = it->second;
        from.erase(it);
        return p;
      }
    }
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      release_all();
      err = cudaMalloc(&p, bytes);
    }
    if (err != cudaSuccess)
      cuda_oom(bytes, "activations", "use a smaller batch (--max-num-seqs, --max-num-batched-tokens) or KV cache");
    return p;
  }
  void put(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    (private_ ? *private_ : free_).emplace(bytes, p);
  }
  void release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, p] : free_) cudaFree(p);
    free_.clear();
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::multimap<size_t, void*>* private_ = nullptr;
};

// One captured decode step: its metadata buffer (the graph reads token ids, positions and block tables
// from it), its scratch memory and its logits.
struct GraphRec {
  int eager_runs = 0;
  cudaGraphExec_t exec = nullptr;
  Tensor meta, logits;
  std::multimap<size_t, void*> scratch;
  std::vector<const void*> cache_ptrs;
};

// A checkpoint tensor's host bytes and where their device copy lives.
struct Region {
  uintptr_t host_begin = 0, host_end = 0;
  uint8_t* dev = nullptr;
};

struct ExpertDev {
  cuda::ExpertTable table;
  Tensor fc1, fc2;      // the DevWeight arrays, device memory
  Tensor rows;          // ExpertTable::rows, device memory (simple rows, FP4)
  // FC2's input as the one-token FC1 kernel stages it (cuda::StagedActs; FP4 simple rows): moe_fc1 hands it
  // to FC1, moe_fc2 to FC2, which copies the planes where FC1 staged the act it is given.
  Tensor staged_buf;
  cuda::StagedActs staged;
  std::weak_ptr<uint8_t[]> staged_of;  // the act tensor staged (an address alone could be a later tensor's)
};

// Rows first, first + step, ... of the FP4 weight w (all in one part, the caller checked), with their
// biases at bias + first + r * step (or none): see cuda::RowMap.
cuda::RowMap row_map(const DevWeight& w, int first, int step, const float* bias) {
  int p = 0;
  while (p < w.n_parts - 1 && first >= w.part[p].rows) first -= w.part[p++].rows;
  const cuda::DevPart& part = w.part[p];
  const bool nv = w.kind == WKind::kNVFP4;
  const int code_bytes = w.k / 2, scale_bytes = w.k / (nv ? 16 : 32);
  cuda::RowMap m;
  m.codes = part.data + static_cast<int64_t>(first) * code_bytes;
  m.scales = part.scales + static_cast<int64_t>(first) * scale_bytes;
  m.bias = bias;
  m.code_step = step * code_bytes, m.scale_step = step * scale_bytes, m.step = step;
  m.post = cuda::fp4_post(w.kind, part);
  return m;
}

// Token counts from which the tensor-core GEMMs beat the GEMV kernels (bench/gemm_bench.cu, crossover
// table; H200, 2026-11-22): the GEMV path re-reads the weight for every 4 tokens (linear) or every
// (token, choice) pair (MoE). QKV broke even at 16 tokens and was 1.7x faster at 32; the gpt-oss-20b MoE
// layer broke even at 32 and was 2.4x faster at 64.
constexpr int kGemmMinTokens = 32;
constexpr int kMoeGemmMinTokens = 48;
constexpr int64_t kArrivals = 65536;  // Impl::arrivals

KvKind kv_kind_of(DType t) {
  switch (t) {
    case DType::kF32:
      return KvKind::kF32;
    case DType::kBF16:
      return KvKind::kBF16;
    default:
      return KvKind::kFP8;
  }
}

}  // namespace

struct CudaBackend::Impl {
  CudaDeviceInfo info;
  CudaBackendOptions options;
  // The FP4 prefill GEMMs' activations (dense and MoE): E4M3 where asked for and an sm_90a tile exists, else
  // one fp16 or hi + lo.
  bool fp8_gemms() const { return options.gemm_fp8_activations && cuda::gemm_fp8_supported(); }
  cuda::GemmActs prefill_acts() const {
    return fp8_gemms() ? cuda::GemmActs::kFp8 : options.gemm_fp16_activations ? cuda::GemmActs::kFp16 : cuda::GemmActs::kSplit;
  }
  cudaStream_t stream = nullptr;
  std::shared_ptr<Pool> pool = std::make_shared<Pool>();
  std::vector<Region> regions;          // sorted by host_begin
  std::vector<void*> owned;             // weight buffers: checkpoint copies, re-quantized, random
  std::unordered_map<const void*, ExpertDev> experts;   // by fc1[0]'s data pointer
  // By RopeTable::inv_freq.data(): the host values and their device copy.
  std::unordered_map<const float*, std::pair<std::vector<float>, Tensor>> rope_tables;
  // The last batch's metadata, on the host (to see whether it changed) and on the device.
  std::vector<int32_t> h_batch;
  Tensor d_batch;
  cuda::DevBatch dev_batch;
  const int32_t* d_tokens = nullptr;
  const int32_t* d_logit_rows = nullptr;
  const int32_t* d_seq_begin = nullptr;  // [n_seqs + 1] token ranges, for prefill attention
  std::vector<int32_t> h_logit_rows;
  // Keyed by the batch's shape and, where decode attention picks its kernel by context length (grouped_decode,
  // kGroupAuto), whether some context is past kGroupMinKeys.
  std::map<std::tuple<int64_t, size_t, int32_t, size_t, const void*, bool>, GraphRec> graphs;
  std::unique_ptr<cuda::DenseGemm> dense_gemm;  // cuBLASLt, made at the first BF16 prefill GEMM
  // Arrival counters for kernels whose last block to finish does a reduction (norm_route, attention):
  // zeroed once here, and every such kernel leaves the counters it used at zero. Stream order keeps two
  // kernels from using them at once (a PDL kernel touches them only after its pdl_wait).
  unsigned* arrivals = nullptr;
  // h of the last one-token norm_route as the FP4 FC1 kernel stages its x (launch_norm_route's staged_h), and
  // which h that was: moe_fc1 hands the planes to FC1 when its x is that h. One buffer for every layer: the
  // next norm_route writes it only after that FC1 has finished (stream order through each kernel's wait).
  void* staged_h = nullptr;
  size_t staged_h_bytes = 0;
  std::weak_ptr<uint8_t[]> staged_h_of;  // (an address alone could be a later tensor's)
  // The staged h if x is the h it holds (once: the next moe_fc1 gets null).
  void* take_staged_h(const Tensor& x) {
    const bool same = x.storage && staged_h_of.lock() == x.storage;
    staged_h_of.reset();
    return same ? staged_h : nullptr;
  }
  // The last one-token attention output as the FP4 O projection stages its input (AttnShape::stage_planes):
  // planes then shifts (cuda::StagedRow), for rows of staged_o_k; and which output that was (attention sets
  // it, the next linear takes it: O when its x is that output). One buffer for every layer, as staged_h.
  void* staged_o = nullptr;
  int staged_o_k = 0;
  std::weak_ptr<uint8_t[]> staged_o_of;
  const float* staged_o_x = nullptr;
  // Set once a staged output went to a projection the FP4 kernel does not take (a BF16 or FP8 O:
  // --dense-format keep|fp8): later attention launches stop staging (the write costs the attention kernel
  // ~0.25 us per layer). Decided at the first decode step, which runs eagerly before its graph's capture.
  bool staged_o_unused = false;
  // The staged output if x is the output it holds (once: the next linear gets null).
  std::optional<cuda::StagedRow> take_staged_o(const Tensor& x) {
    const bool same = x.storage && staged_o_of.lock() == x.storage && x.data<float>() == staged_o_x;
    staged_o_of.reset();
    if (!same) return std::nullopt;
    const size_t planes = size_t{16} * cuda::hi_words(staged_o_k);
    return cuda::StagedRow{staged_o, static_cast<const int8_t*>(staged_o) + planes};
  }
  // L2 prefetch hints handed to the next one-token MoE launch (moe_experts_then_prefetch): FC1 with deferred
  // routes (before its wait: NIBBLE_PREFETCH_IN_FC1), else FC2; the kernel issues them and clears n; any left
  // are launched as their own kernel after the experts.
  cuda::PrefetchRanges moe_prefetch;
  // The ids of the last sample_async, [Backend::kKeptSampledRows]: a step's token -1 - j reads row j (the
  // embedding kernel, in stream order after the sampling that wrote them).
  int32_t* last_ids = nullptr;
  // Pinned (and mapped) host memory with the event after the stream's last use of it: the staging of small
  // host-to-device copies (a copy from pageable memory may wait for the stream, which would make the host
  // wait for the step it is queueing behind), and per queued sample its specs and ids, which the sampling
  // kernels read and write in place (no copy between two decode steps in the stream).
  struct Pinned {
    void* host = nullptr;
    void* dev = nullptr;  // the same memory as the device addresses it
    size_t capacity = 0, bytes = 0;
    int64_t rows = 0;  // (sampled: the ids' count)
    cudaEvent_t done = nullptr;
  };
  static constexpr int kPinnedRing = 8;
  std::vector<Pinned> staging = std::vector<Pinned>(kPinnedRing), sampled = std::vector<Pinned>(kPinnedRing);
  int next_staging = 0, next_sampled = 0, n_sampled = 0;  // sampled: a ring of n_sampled queued from the oldest

  // A pinned buffer of at least `bytes` whose previous use by the stream has finished.
  static void* reuse(Pinned& p, size_t bytes) {
    if (p.done) CUDA_CHECK(cudaEventSynchronize(p.done));
    else CUDA_CHECK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    if (p.capacity < bytes) {
      if (p.host) CUDA_CHECK(cudaFreeHost(p.host));
      p.capacity = std::max<size_t>(bytes, 4096);
      CUDA_CHECK(cudaHostAlloc(&p.host, p.capacity, cudaHostAllocMapped));
      CUDA_CHECK(cudaHostGetDevicePointer(&p.dev, p.host, 0));
    }
    p.bytes = bytes;
    return p.host;
  }

  // Host to device in stream order, through pinned staging: returns without waiting for the stream.
  void upload_async(void* dst, const void* src, size_t bytes) {
    Pinned& p = staging[next_staging];
    next_staging = (next_staging + 1) % kPinnedRing;
    std::memcpy(reuse(p, bytes), src, bytes);
    CUDA_CHECK(cudaMemcpyAsync(dst, p.host, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaEventRecord(p.done, stream));
  }

  ~Impl() {
    if (stream) cudaStreamSynchronize(stream);
    for (std::vector<Pinned>* ring : {&staging, &sampled})
      for (Pinned& p : *ring) {
        if (p.host) cudaFreeHost(p.host);
        if (p.done) cudaEventDestroy(p.done);
      }
    if (last_ids) cudaFree(last_ids);
    for (auto& [key, g] : graphs) {
      if (g.exec) cudaGraphExecDestroy(g.exec);
      g.meta = Tensor();
      g.logits = Tensor();
      for (auto& [size, p] : g.scratch) cudaFree(p);
    }
    graphs.clear();
    for (void* p : owned) cudaFree(p);
    if (arrivals) cudaFree(arrivals);
    if (staged_h) cudaFree(staged_h);
    if (staged_o) cudaFree(staged_o);
    experts.clear();
    rope_tables.clear();
    d_batch = Tensor();
    pool->release_all();
    if (stream) cudaStreamDestroy(stream);
  }

  Tensor make(DType dtype, std::vector<int64_t> shape) {
    Tensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.device = Device::kCuda;
    const size_t bytes = Pool::size_class(std::max<int64_t>(1, t.numel() * dtype_bits(dtype) / 8));
    void* p = pool->get(bytes);
    std::shared_ptr<Pool> keep = pool;
    t.storage = std::shared_ptr<uint8_t[]>(static_cast<uint8_t*>(p),
                                           [keep, bytes](uint8_t* q) { keep->put(q, bytes); });
    if (options.poison) CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, stream));
    return t;
  }

  void* owned_alloc(size_t bytes) {
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      pool->release_all();
      err = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    }
    if (err != cudaSuccess) cuda_oom(bytes, "weights", "");
    owned.push_back(p);
    return p;
  }

  const uint8_t* dev_ptr(const TensorView& v, const std::string& name) const {
    if (!v.data) return nullptr;
    if (v.device == Device::kCuda) return static_cast<const uint8_t*>(v.data);
    const uintptr_t h = reinterpret_cast<uintptr_t>(v.data);
    auto it = std::upper_bound(regions.begin(), regions.end(), h,
                               [](uintptr_t x, const Region& r) { return x < r.host_begin; });
    NB_CHECK(it != regions.begin() && h < std::prev(it)->host_end,
             "weight '" + name + "' (host bytes at " + std::to_string(h) + ") is not on the device: not among the " +
                 std::to_string(regions.size()) + " uploaded ranges");
    const Region& r = *std::prev(it);
    return r.dev + (h - r.host_begin);
  }

  DevWeight dev_weight(const Weight& w) const {
    DevWeight d;
    d.n = static_cast<int32_t>(w.n);
    d.k = static_cast<int32_t>(w.k);
    NB_CHECK(!w.parts.empty() && w.parts.size() <= cuda::kMaxParts, "weight with " + std::to_string(w.parts.size()) +
                                                                         " parts");
    d.n_parts = static_cast<int32_t>(w.parts.size());
    int elems = 32, elem_bits = 4;  // per 16-byte chunk, bits per element
    switch (w.format) {
      case WeightFormat::kBF16: {
        const DType dt = w.parts[0].data.dtype;
        d.kind = dt == DType::kF32 ? WKind::kF32 : dt == DType::kF16 ? WKind::kF16 : WKind::kBF16;
        elem_bits = dt == DType::kF32 ? 32 : 16;
        elems = 128 / elem_bits;
        break;
      }
      case WeightFormat::kFP8E4M3:
        d.kind = WKind::kFP8, elems = 16, elem_bits = 8;
        break;
      case WeightFormat::kMXFP4:
        d.kind = WKind::kMXFP4;
        break;
      case WeightFormat::kNVFP4:
        d.kind = WKind::kNVFP4;
        break;
    }
    bool aligned = w.k % elems == 0;
    for (size_t i = 0; i < w.parts.size(); ++i) {
      const WeightPart& p = w.parts[i];
      cuda::DevPart& q = d.part[i];
      q.data = dev_ptr(p.data, p.name);
      q.scales = dev_ptr(p.scales, p.name);
      q.global = p.global_scale;
      q.divide = p.convention == fmt::GlobalScale::kDivide;
      q.rows = static_cast<int32_t>(p.rows);
      aligned = aligned && reinterpret_cast<uintptr_t>(q.data) % 16 == 0 && (w.k * elem_bits / 8) % 16 == 0;
    }
    d.vec_ok = aligned;
    return d;
  }

  static std::vector<int32_t> batch_words(const BatchInfo& b, int32_t* stride_out) {
    const int64_t T = b.n_tokens();
    int32_t stride = 1;
    for (const SeqInfo& s : b.seqs) stride = std::max<int32_t>(stride, static_cast<int32_t>(s.block_table.size()));
    std::vector<int32_t> h;
    h.reserve(3 * T + b.logit_rows.size() + b.seqs.size() * (stride + 1) + 1);
    h.insert(h.end(), b.tokens.begin(), b.tokens.end());
    h.insert(h.end(), b.positions.begin(), b.positions.end());
    h.insert(h.end(), b.seq_of.begin(), b.seq_of.end());
    h.insert(h.end(), b.logit_rows.begin(), b.logit_rows.end());
    for (const SeqInfo& s : b.seqs) {
      h.insert(h.end(), s.block_table.begin(), s.block_table.end());
      h.insert(h.end(), stride - s.block_table.size(), 0);
    }
    for (const SeqInfo& s : b.seqs) h.push_back(s.begin);
    h.push_back(static_cast<int32_t>(T));
    *stride_out = stride;
    return h;
  }

  // Points the ops at batch metadata in `buf` (uploading h into it).
  void bind_batch(const BatchInfo& b, std::vector<int32_t> h, int32_t stride, const Tensor& buf) {
    upload_async(buf.data<int32_t>(), h.data(), h.size() * 4);
    const int64_t T = b.n_tokens();
    const int32_t* base = buf.data<int32_t>();
    d_tokens = base;
    d_logit_rows = base + 3 * T;
    h_logit_rows = b.logit_rows;
    dev_batch = cuda::DevBatch{base + T, base + 2 * T, base + 3 * T + b.logit_rows.size(), stride, T};
    d_seq_begin = dev_batch.tables + b.seqs.size() * stride;
    h_batch = std::move(h);
  }

  // Uploads the batch's token metadata when it differs from the last one (ops of one forward share it).
  const cuda::DevBatch& batch(const BatchInfo& b) {
    int32_t stride = 0;
    std::vector<int32_t> h = batch_words(b, &stride);
    if (h != h_batch) {
      d_batch = make(DType::kI32, {static_cast<int64_t>(h.size())});
      bind_batch(b, std::move(h), stride, d_batch);
    }
    return dev_batch;
  }

  Tensor upload_i32(const std::vector<int32_t>& v) {
    Tensor t = make(DType::kI32, {static_cast<int64_t>(v.size())});
    CUDA_CHECK(cudaMemcpyAsync(t.data<int32_t>(), v.data(), v.size() * 4, cudaMemcpyHostToDevice, stream));
    return t;
  }

  ExpertDev& expert_tables(const MoeExperts& ex);
};

namespace {

void check_f32(const Tensor& t, const char* op) {
  NB_CHECK(t.device == Device::kCuda && t.dtype == DType::kF32,
           std::string(op) + ": expects an fp32 tensor on the CUDA device, got " + shape_string(t.shape));
}

}  // namespace

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const CudaBackendOptions& options) {
  if (options.kv_cache_dtype != DType::kBF16 && options.kv_cache_dtype != DType::kF8_E4M3 &&
      options.kv_cache_dtype != DType::kF32)
    return error("--kv-cache-dtype: the CUDA backend stores the KV cache as bf16, fp8 (E4M3) or f32");
  NB_ASSIGN_OR_RETURN(CudaDeviceInfo info, cuda_device_info(options.device));
  auto impl = std::make_unique<Impl>();
  impl->info = info;
  impl->options = options;
  NB_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  NB_RETURN_IF_ERROR(cuda_status(cudaMalloc(&impl->arrivals, kArrivals * sizeof(unsigned)), "cudaMalloc"));
  NB_RETURN_IF_ERROR(cuda_status(cudaMemset(impl->arrivals, 0, kArrivals * sizeof(unsigned)), "cudaMemset"));
  NB_RETURN_IF_ERROR(cuda_status(cudaMalloc(&impl->last_ids, kKeptSampledRows * sizeof(int32_t)), "cudaMalloc"));
  NB_RETURN_IF_ERROR(cuda_status(cudaMemset(impl->last_ids, 0, kKeptSampledRows * sizeof(int32_t)), "cudaMemset"));
  if (options.gemm_fp8_activations && !impl->fp8_gemms())
    NB_LOG_WARN("NIBBLE_GEMM_FP8=1: the FP8 prefill GEMMs need an sm_90a GPU and build (%s); prefill keeps fp16 activations",
                describe(info).c_str());
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

std::string CudaBackend::name() const {
  static const char* kKv[] = {"f32", "bf16", "fp8"};
  return "cuda: " + describe(impl_->info) + ", kv cache " + kKv[static_cast<int>(kv_kind_of(impl_->options.kv_cache_dtype))] +
         (impl_->fp8_gemms() ? ", FP8 prefill GEMMs (W4A8)" : "");
}

void* CudaBackend::stream() const { return impl_->stream; }

Status CudaBackend::synchronize() { return cuda_status(cudaStreamSynchronize(impl_->stream), "CUDA stream"); }

Result<CudaLoadStats> CudaBackend::upload_checkpoint(const Checkpoint& ckpt) {
  std::vector<TensorView> views;
  for (const std::string& name : ckpt.names()) views.push_back(ckpt.find(name)->view());
  return upload_views(views);
}

Result<CudaLoadStats> CudaBackend::upload_views(const std::vector<TensorView>& views) {
  const auto t0 = std::chrono::steady_clock::now();
  // Every tensor gets a 256-byte aligned slot in one device buffer (file offsets need not be aligned);
  // the copies go out back to back on the stream from the mmapped (and, where the OS allows, pinned) file.
  struct Item {
    const uint8_t* host;
    size_t bytes, offset;
  };
  std::vector<Item> items;
  size_t total = 0;
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (const TensorView& v : views) {
    if (!v.data || v.device == Device::kCuda) continue;
    const size_t bytes = static_cast<size_t>(v.nbytes());
    if (bytes == 0) continue;
    items.push_back({static_cast<const uint8_t*>(v.data), bytes, total});
    total += (bytes + 255) & ~size_t{255};
    lo = std::min(lo, reinterpret_cast<uintptr_t>(v.data));
    hi = std::max(hi, reinterpret_cast<uintptr_t>(v.data) + bytes);
  }
  if (items.empty()) return CudaLoadStats{};
  size_t free_b = 0, total_b = 0;
  NB_RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo"));
  if (total > free_b)
    return error("CUDA out of memory: the checkpoint needs " + std::to_string(total >> 20) + " MiB on the device, " +
                 std::to_string(free_b >> 20) + " MiB are free");
  uint8_t* dev = nullptr;
  NB_RETURN_IF_ERROR(cuda_status(cudaMalloc(&dev, total), "cudaMalloc (checkpoint weights)"));
  impl_->owned.push_back(dev);
  // Pin the mapped files' pages for DMA when the OS lets us (several shards span one range here only
  // when they are adjacent; otherwise pin each item's range).
  std::vector<void*> pinned;
  auto pin = [&](uintptr_t a, uintptr_t b) {
    const uintptr_t page = 4096;
    a &= ~(page - 1);
    b = (b + page - 1) & ~(page - 1);
    if (cudaHostRegister(reinterpret_cast<void*>(a), b - a, cudaHostRegisterReadOnly) == cudaSuccess)
      pinned.push_back(reinterpret_cast<void*>(a));
    else
      (void)cudaGetLastError();  // pageable copies still work, slower
  };
  if (total >= (size_t{256} << 20) && hi - lo <= total + (size_t{64} << 20)) pin(lo, hi);
  for (const Item& it : items) {
    NB_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(dev + it.offset, it.host, it.bytes, cudaMemcpyHostToDevice, impl_->stream), "weight copy"));
    impl_->regions.push_back({reinterpret_cast<uintptr_t>(it.host), reinterpret_cast<uintptr_t>(it.host) + it.bytes,
                              dev + it.offset});
  }
  const Status st = synchronize();
  for (void* p : pinned) cudaHostUnregister(p);
  NB_RETURN_IF_ERROR(st);
  std::sort(impl_->regions.begin(), impl_->regions.end(),
            [](const Region& a, const Region& b) { return a.host_begin < b.host_begin; });
  CudaLoadStats stats;
  stats.bytes = static_cast<int64_t>(total);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

Tensor CudaBackend::alloc(DType dtype, std::vector<int64_t> shape) { return impl_->make(dtype, std::move(shape)); }

Tensor CudaBackend::upload(const TensorView& host) {
  std::vector<float> f(host.numel());
  if (host.dtype == DType::kF32) {
    std::memcpy(f.data(), host.data, f.size() * 4);
  } else if (host.dtype == DType::kBF16) {
    for (size_t i = 0; i < f.size(); ++i) f[i] = fmt::bf16_to_float(host.as<uint16_t>()[i]);
  } else {
    NB_CHECK(host.dtype == DType::kF16, "upload of a non-float tensor");
    for (size_t i = 0; i < f.size(); ++i) f[i] = f16_to_float(host.as<uint16_t>()[i]);
  }
  Tensor t = alloc(DType::kF32, host.shape);
  CUDA_CHECK(cudaMemcpyAsync(t.data<float>(), f.data(), f.size() * 4, cudaMemcpyHostToDevice, impl_->stream));
  return t;
}

std::vector<float> CudaBackend::to_host(const Tensor& t) {
  check_f32(t, "to_host");
  std::vector<float> out(t.numel());
  CUDA_CHECK(cudaMemcpyAsync(out.data(), t.data<float>(), out.size() * 4, cudaMemcpyDeviceToHost, impl_->stream));
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  return out;
}

DType CudaBackend::kv_cache_dtype() const { return impl_->options.kv_cache_dtype; }

std::unique_ptr<KvCache> CudaBackend::new_kv_cache(int n_layers, int n_blocks, int n_kv_heads, int head_dim) {
  auto cache = std::make_unique<KvCache>();
  cache->n_blocks = n_blocks;
  const DType dt = impl_->options.kv_cache_dtype;
  // The whole cache up front, so that too large a cache is one message naming it, not a failure in a step.
  const size_t layer_bytes = static_cast<size_t>(n_blocks) * kKvBlock * n_kv_heads * head_dim * dtype_bits(dt) / 8;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (2 * n_layers * Pool::size_class(layer_bytes) > free_b) {
    impl_->pool->release_all();
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  }
  if (2 * n_layers * Pool::size_class(layer_bytes) > free_b)
    cuda_oom(2 * n_layers * layer_bytes,
             "the KV cache (" + std::to_string(n_blocks) + " blocks of " + std::to_string(kKvBlock) + " tokens, " +
                 std::to_string(n_layers) + " layers)",
             "lower --max-model-len, --num-gpu-blocks-override or --kv-cache-memory-bytes");
  for (int l = 0; l < n_layers; ++l) {
    cache->k.push_back(alloc(dt, {n_blocks, kKvBlock, n_kv_heads, head_dim}));
    cache->v.push_back(alloc(dt, {n_blocks, kKvBlock, n_kv_heads, head_dim}));
    // Unwritten slots are never read (attention stops at the token's position), but keep them finite.
    CUDA_CHECK(cudaMemsetAsync(cache->k.back().data<uint8_t>(), 0, cache->k.back().numel() * dtype_bits(dt) / 8,
                               impl_->stream));
    CUDA_CHECK(cudaMemsetAsync(cache->v.back().data<uint8_t>(), 0, cache->v.back().numel() * dtype_bits(dt) / 8,
                               impl_->stream));
  }
  return cache;
}

Tensor CudaBackend::embedding(const Weight& table, const BatchInfo& b) {
  impl_->batch(b);
  Tensor out = alloc(DType::kF32, {b.n_tokens(), table.k});  // [n_tokens, d_model]
  cuda::launch_embedding(impl_->dev_weight(table), impl_->d_tokens, impl_->last_ids, b.n_tokens(), out.data<float>(),
                         impl_->stream);
  return out;
}

Tensor CudaBackend::rms_norm(const Tensor& x, const Tensor& w, float eps) {
  check_f32(x, "rms_norm");
  const int64_t d = x.dim(-1);
  NB_CHECK(w.numel() == d, "rms_norm weight " + shape_string(w.shape) + " for rows of " + std::to_string(d));
  Tensor out = alloc(DType::kF32, x.shape);
  cuda::launch_rms_norm(x.data<float>(), nullptr, w.data<float>(), x.numel() / d, static_cast<int>(d), eps,
                        out.data<float>(), impl_->stream);
  return out;
}

Tensor CudaBackend::add_rms_norm(Tensor& x, const Tensor& y, const Tensor& w, float eps) {
  check_f32(x, "add_rms_norm");
  check_f32(y, "add_rms_norm");
  const int64_t d = x.dim(-1);
  NB_CHECK(x.numel() == y.numel() && w.numel() == d,
           "add_rms_norm: x " + shape_string(x.shape) + ", y " + shape_string(y.shape) + ", weight " + shape_string(w.shape));
  Tensor out = alloc(DType::kF32, x.shape);
  cuda::launch_rms_norm(x.data<float>(), y.data<float>(), w.data<float>(), x.numel() / d, static_cast<int>(d), eps,
                        out.data<float>(), impl_->stream);
  return out;
}

// w's parts (codes and scales) appended to r, unless prefetching is off or w is over a third of the L2 (it
// would evict what the ops in between use, and itself).
static void add_prefetch(CudaBackend::Impl& I, const Weight& w, cuda::PrefetchRanges& r) {
  if (!I.options.l2_prefetch || w.empty() || w.bytes() > static_cast<int64_t>(I.info.l2_bytes / 3)) return;
  auto add = [&](const TensorView& v, const std::string& name) {
    const uint8_t* p = I.dev_ptr(v, name);
    if (!p || r.n == cuda::kMaxPrefetchRanges) return;
    r.begin[r.n] = p, r.bytes[r.n] = static_cast<uint32_t>(std::min<int64_t>(v.nbytes(), INT32_MAX)), ++r.n;
  };
  for (const WeightPart& part : w.parts) add(part.data, part.name), add(part.scales, part.name);
}

void CudaBackend::prefetch(const Weight& w) {
  cuda::PrefetchRanges r;
  add_prefetch(*impl_, w, r);
  cuda::launch_l2_prefetch(r, impl_->stream);
}

Tensor CudaBackend::moe_experts_then_prefetch(const Tensor& x, const Routes& routes, const MoeExperts& ex,
                                              const GluParams& glu, const std::vector<const Weight*>& next) {
  cuda::PrefetchRanges& r = impl_->moe_prefetch;
  struct Clear {
    cuda::PrefetchRanges& r;
    ~Clear() { r.n = 0; }  // (also when an op throws: no stale hints for a later FC2)
  } clear{r};
  r.n = 0;
  for (const Weight* w : next) add_prefetch(*impl_, *w, r);
  Tensor y = moe_experts(x, routes, ex, glu);  // the one-token FC1 (deferred routes) or FC2 issues r, clears it
  cuda::launch_l2_prefetch(r, impl_->stream);  // (no-op when n == 0)
  return y;
}

Tensor CudaBackend::linear(const Tensor& x, const Weight& w, const Tensor* bias) {
  check_f32(x, "linear");
  NB_CHECK(x.dim(-1) == w.k, "linear: input " + shape_string(x.shape) + " for weight " + w.shape_string());
  NB_CHECK(!bias || bias->numel() == w.n, "linear: bias size");
  std::vector<int64_t> shape = x.shape;
  shape.back() = w.n;
  Tensor out = alloc(DType::kF32, shape);
  const DevWeight dw = impl_->dev_weight(w);
  const int64_t m = x.numel() / w.k;
  const float* b = bias ? bias->data<float>() : nullptr;
  const int min_m = impl_->options.gemm_min_tokens > 0 ? impl_->options.gemm_min_tokens : kGemmMinTokens;
  if (m >= min_m && cuda::gemm_fp4_supports(dw)) {  // prefill: tensor cores, the weight read once per tile
    const cuda::GemmActs mode = impl_->prefill_acts();
    const cuda::TiledTile tile =
        cuda::gemm_tiled_tile(m, static_cast<int>(w.n), mode, impl_->options.gemm_ws);
    const bool tiled = tile != cuda::TiledTile::kNone;
    Tensor scratch = alloc(DType::kU8, {cuda::gemm_activations_bytes(m, static_cast<int>(w.k), mode, tiled)});
    cuda::GemmActivations a =
        cuda::gemm_activations_in(scratch.data<uint8_t>(), m, static_cast<int>(w.k), mode, tiled);
    a.wsp = tile == cuda::TiledTile::kWsp;
    a.rs = tile == cuda::TiledTile::kWs ? cuda::gemm_ws_rs() : 0;  // (the FP8 tile has one form: ignored)
    cuda::launch_gemm_activations(x.data<float>(), nullptr, 1, m, static_cast<int>(w.k), mode, a, impl_->stream);
    cuda::launch_gemm_fp4(dw, a, m, b, out.data<float>(), mode, impl_->stream);
    return out;
  }
  if (m >= min_m && cuda::DenseGemm::supports(dw)) {  // BF16 prefill: cuBLASLt, bf16 hi + lo activations
    if (!impl_->dense_gemm) impl_->dense_gemm = std::make_unique<cuda::DenseGemm>();
    Tensor scratch = alloc(DType::kU8, {cuda::DenseGemm::scratch_bytes(m, w.k)});
    impl_->dense_gemm->run(dw, x.data<float>(), m, b, out.data<float>(), scratch.data<uint8_t>(), impl_->stream);
    return out;
  }
  const std::optional<cuda::StagedRow> staged = impl_->take_staged_o(x);
  if (staged && dw.kind != cuda::WKind::kMXFP4 && dw.kind != cuda::WKind::kNVFP4) impl_->staged_o_unused = true;
  cuda::launch_linear(dw, x.data<float>(), m, b, out.data<float>(), impl_->options.gemm_fp16_activations,
                      impl_->stream, staged ? &*staged : nullptr);
  return out;
}

// The RoPE table's inverse frequencies on the device, uploaded at first use (before any graph capture).
static const float* rope_table(CudaBackend& be, CudaBackend::Impl& I, const RopeTable& rope) {
  // Keyed by address, checked by value: a table freed and another made at the same address (tests do
  // that) must not find the old copy.
  auto it = I.rope_tables.find(rope.inv_freq.data());
  if (it == I.rope_tables.end() || it->second.first != rope.inv_freq) {
    TensorView v{rope.inv_freq.data(), DType::kF32, {static_cast<int64_t>(rope.inv_freq.size())}};
    it = I.rope_tables.insert_or_assign(rope.inv_freq.data(), std::make_pair(rope.inv_freq, be.upload(v))).first;
  }
  return it->second.second.data<float>();
}

void CudaBackend::rope(Tensor& x, const BatchInfo& b, const RopeTable& rope) {
  check_f32(x, "rope");
  const int64_t half = x.dim(2) / 2;
  NB_CHECK(x.dim(0) == b.n_tokens() && static_cast<int64_t>(rope.inv_freq.size()) == half, "rope shapes");
  const float* inv_freq = rope_table(*this, *impl_, rope);
  const cuda::DevBatch& db = impl_->batch(b);
  cuda::launch_rope(x.data<float>(), db.positions, inv_freq, rope.attention_scale, x.dim(0),
                    static_cast<int>(x.dim(1)), static_cast<int>(x.dim(2)), impl_->stream);
}

void CudaBackend::kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchInfo& b) {
  check_f32(k, "kv_write");
  check_f32(v, "kv_write");
  const Tensor& kc = cache.k[layer];
  NB_CHECK(k.dim(1) == kc.dim(2) && k.dim(2) == kc.dim(3) && k.shape == v.shape, "kv_write shapes");
  const cuda::DevBatch& db = impl_->batch(b);
  cuda::launch_kv_write(kv_kind_of(kc.dtype), kc.data<uint8_t>(), cache.v[layer].data<uint8_t>(), k.data<float>(),
                        v.data<float>(), db, static_cast<int>(k.dim(1)), static_cast<int>(k.dim(2)), impl_->stream);
}

// The head layout, norms and RoPE table of QkvParams on the device.
static cuda::QkvRopeShape qkv_shape(CudaBackend& be, CudaBackend::Impl& I, const QkvParams& p) {
  cuda::QkvRopeShape s;
  s.n_heads = p.n_heads;
  s.n_kv_heads = p.n_kv_heads;
  s.head_dim = p.head_dim;
  s.q_norm = p.q_norm ? p.q_norm->data<float>() : nullptr;
  s.k_norm = p.k_norm ? p.k_norm->data<float>() : nullptr;
  s.eps = p.eps;
  s.inv_freq = p.rope ? rope_table(be, I, *p.rope) : nullptr;
  s.attention_scale = p.rope ? p.rope->attention_scale : 1.0f;
  return s;
}

Tensor CudaBackend::qkv_rope_kv_write(const Tensor& qkv, const QkvParams& p, KvCache& cache, int layer,
                                      const BatchInfo& b) {
  check_f32(qkv, "qkv_rope_kv_write");
  const int64_t T = qkv.dim(0), hd = p.head_dim;
  const Tensor& kc = cache.k[layer];
  NB_CHECK(p.rope && qkv.numel() == T * (p.n_heads + 2 * p.n_kv_heads) * hd && T == b.n_tokens() &&
               kc.dim(2) == p.n_kv_heads && kc.dim(3) == hd && static_cast<int64_t>(p.rope->inv_freq.size()) == hd / 2,
           "qkv_rope_kv_write: qkv " + shape_string(qkv.shape) + " for " + std::to_string(p.n_heads) + " + 2 x " +
               std::to_string(p.n_kv_heads) + " heads of " + std::to_string(hd) + ", cache " + shape_string(kc.shape));
  NB_CHECK((!p.q_norm || p.q_norm->numel() == hd) && (!p.k_norm || p.k_norm->numel() == hd),
           "qkv_rope_kv_write: q/k norm weights must have head_dim elements");
  const cuda::QkvRopeShape s = qkv_shape(*this, *impl_, p);
  const cuda::DevBatch& db = impl_->batch(b);
  Tensor q = alloc(DType::kF32, {T, p.n_heads, hd});
  cuda::launch_qkv_rope_kv_write(kv_kind_of(kc.dtype), qkv.data<float>(), s, db, kc.data<uint8_t>(),
                                 cache.v[layer].data<uint8_t>(), q.data<float>(), impl_->stream);
  return q;
}

Tensor CudaBackend::norm_qkv_rope_kv_write(Tensor& x, const Tensor& y, const Tensor& norm, float eps, const Weight& w,
                                           const Tensor* bias, const QkvParams& p, KvCache& cache, int layer,
                                           const BatchInfo& b) {
  check_f32(x, "norm_qkv_rope_kv_write");
  const Tensor& kc = cache.k[layer];
  const cuda::DevWeight dw = impl_->dev_weight(w);
  const int64_t d = x.dim(-1), hd = p.head_dim;
  const bool fits = x.rank() == 2 && x.dim(0) == 1 && b.n_tokens() == 1 && dw.k == d && norm.numel() == d &&
                    (y.empty() || y.numel() == d) && (!bias || bias->numel() == w.n) && p.rope &&
                    static_cast<int64_t>(p.rope->inv_freq.size()) == hd / 2 && kc.dim(2) == p.n_kv_heads &&
                    kc.dim(3) == hd;
  const cuda::QkvRopeShape s = qkv_shape(*this, *impl_, p);
  if (!impl_->options.decode_fusion || !impl_->options.fused_head || !fits ||
      !cuda::qkv_head_stream_supports(dw, s, impl_->options.gemm_fp16_activations))
    return Backend::norm_qkv_rope_kv_write(x, y, norm, eps, w, bias, p, cache, layer, b);
  if (!y.empty()) check_f32(y, "norm_qkv_rope_kv_write");
  Tensor x_new = y.empty() ? Tensor() : alloc(DType::kF32, x.shape);
  Tensor q = alloc(DType::kF32, {1, p.n_heads, hd});
  cuda::QkvHeadArgs a;
  a.x = x.data<float>();
  a.y = y.empty() ? nullptr : y.data<float>();
  a.norm_w = norm.data<float>();
  a.eps = eps;
  a.x_out = y.empty() ? nullptr : x_new.data<float>();
  a.bias = bias ? bias->data<float>() : nullptr;
  a.s = s;
  a.b = impl_->batch(b);
  a.kv = kv_kind_of(kc.dtype);
  a.k_cache = kc.data<uint8_t>();
  a.v_cache = cache.v[layer].data<uint8_t>();
  a.q_out = q.data<float>();
  cuda::launch_qkv_head_stream(dw, a, impl_->stream);
  if (!y.empty()) x = x_new;
  return q;
}

// Decode attention over long contexts reads each K/V row once for the group's query heads (the grouped kernel,
// kernels/attention.cu) instead of once per query head. Past kGroupMinKeys keys of some sequence in the batch
// (and a window, if any, longer than that), or always / never with NIBBLE_ATTN_GROUP=1 / 0 (a measurement
// switch). A function of long_context(b) and the layer's window only, so that it is part of the graph key.
// kGroupAuto: the kernel has not run on a GPU yet (thirty-fifth session: no device time left), so it is taken
// only under NIBBLE_ATTN_GROUP=1 until its test (ctest cuda_backend_test_attn_group) and a measurement at depth
// (bench/NOTES.md) say where it pays.
constexpr bool kGroupAuto = false;
constexpr int kGroupMinKeys = 1024;
static bool long_context(const BatchInfo& b) {
  for (const SeqInfo& s : b.seqs)
    if (s.n_past + s.n_new > kGroupMinKeys) return true;
  return false;
}
static bool grouped_decode(const BatchInfo& b, int window) {
  static const char* force = std::getenv("NIBBLE_ATTN_GROUP");  // (Model::load checks its value)
  if (force) return force[0] == '1';
  return kGroupAuto && long_context(b) && (window <= 0 || window > kGroupMinKeys);
}

// One token: the attention kernel also stages out for the FP4 O projection (CudaBackendOptions::
// stage_o_input), in the one buffer, (re)made and cleared when the row length changes (the padding past k
// must be zeros, its groups' shifts 127) -- at an eager step: a decode graph's capture follows its warm-up.
// (attention() has reset staged_o_of: a launch that does not stage leaves no record.)
static void stage_attention_output(CudaBackend::Impl& I, cuda::AttnShape& a, int64_t n_tokens, const Tensor& out) {
  if (!I.options.stage_o_input || I.staged_o_unused || !I.options.gemm_fp16_activations ||
      !cuda::attention_can_stage(n_tokens, a))
    return;
  const int k = a.n_heads * a.head_dim;
  const size_t planes = size_t{16} * cuda::hi_words(k), shifts = static_cast<size_t>(cuda::n_chunks(k)) * 32;
  if (I.staged_o_k != k) {
    if (I.staged_o) CUDA_CHECK(cudaFree(I.staged_o));
    CUDA_CHECK(cudaMalloc(&I.staged_o, planes + shifts));
    CUDA_CHECK(cudaMemsetAsync(I.staged_o, 0, planes, I.stream));
    CUDA_CHECK(cudaMemsetAsync(static_cast<uint8_t*>(I.staged_o) + planes, 0x7f, shifts, I.stream));
    I.staged_o_k = k;
  }
  a.stage_planes = static_cast<uint16_t*>(I.staged_o);
  a.stage_shifts = static_cast<int8_t*>(I.staged_o) + planes;
  I.staged_o_of = out.storage;
  I.staged_o_x = out.data<float>();
}

Tensor CudaBackend::attention(const Tensor& q, const KvCache& cache, int layer, const BatchInfo& b,
                              const AttentionParams& p) {
  check_f32(q, "attention");
  impl_->staged_o_of.reset();  // (set again below where this launch stages its output)
  const Tensor& kc = cache.k[layer];
  cuda::AttnShape a;
  a.n_heads = static_cast<int>(q.dim(1));
  a.n_kv_heads = static_cast<int>(kc.dim(2));
  a.head_dim = static_cast<int>(q.dim(2));
  NB_CHECK(kc.dim(3) == a.head_dim && a.n_heads % a.n_kv_heads == 0, "attention shapes");
  a.scale = p.scale;
  a.window = p.window;
  a.sinks = p.sinks ? p.sinks->data<float>() : nullptr;
  const cuda::DevBatch& db = impl_->batch(b);
  Tensor out = alloc(DType::kF32, q.shape);
  // Sequences bringing many query tokens (prefill, chunks) take the tiled tensor-core kernel; the others
  // (decode) the split-context one, both in the same step when a chunk shares it with decodes: a decode
  // token alone would fill 1 / group of a tile's rows and walk its context in one block.
  const int min_new = impl_->options.prefill_attention_min_tokens;
  std::vector<int32_t> n_new;
  int64_t n_split_tokens = 0;  // tokens left to the split kernel
  for (const SeqInfo& s : b.seqs) n_new.push_back(s.n_new);
  const bool tiled = cuda::flash_attention_supported(a);
  for (int32_t n : n_new) n_split_tokens += tiled && n >= min_new ? 0 : n;
  if (n_split_tokens < b.n_tokens()) {
    cuda::launch_flash_attention(kv_kind_of(kc.dtype), q.data<float>(), kc.data<uint8_t>(),
                                 cache.v[layer].data<uint8_t>(), db, impl_->d_seq_begin,
                                 static_cast<int>(b.seqs.size()), min_new,
                                 cuda::flash_attention_tiles(n_new, min_new, a), a, out.data<float>(), impl_->stream);
    if (n_split_tokens == 0) return out;
    a.skip_min_new = min_new;
    a.seq_begin = impl_->d_seq_begin;
  }
  // Split the context so that heads x tokens x splits gives ~8 blocks per SM: a warp walks its keys one
  // after another (each a dependent load + warp sum), so decode wants many short walks. The count depends
  // on the shapes only, not on the context length, so a captured decode graph stays right as the context
  // grows (splits beyond the context are empty and cost one idle block each).
  const int64_t want = (8 * impl_->info.sm_count + a.n_heads * n_split_tokens - 1) / (a.n_heads * n_split_tokens);
  a.n_splits = static_cast<int>(std::clamp<int64_t>(want, 1, 64));
  if (impl_->options.decode_fusion && b.n_tokens() * a.n_heads <= kArrivals) a.arrivals = impl_->arrivals;
  if (grouped_decode(b, a.window) && cuda::attention_group_ok(a)) {
    // One block per (KV head, split): as many splits as fill one wave of resident blocks.
    a.grouped = true;
    const int64_t n = a.n_kv_heads * n_split_tokens;
    const int64_t blocks = int64_t{cuda::attention_group_blocks_per_sm(kv_kind_of(kc.dtype), a.head_dim)} *
                           impl_->info.sm_count;
    a.n_splits = static_cast<int>(std::clamp<int64_t>((blocks + n - 1) / n, 1, 64));
  }
  stage_attention_output(*impl_, a, b.n_tokens(), out);
  Tensor ws = alloc(DType::kF32, {cuda::attention_workspace_floats(b.n_tokens(), a)});
  cuda::launch_attention(kv_kind_of(kc.dtype), q.data<float>(), kc.data<uint8_t>(), cache.v[layer].data<uint8_t>(),
                         db, a, ws.data<float>(), out.data<float>(), impl_->stream);
  return out;
}

Routes CudaBackend::moe_route(const Tensor& logits, int top_k, RouterKind kind, bool renormalize) {
  check_f32(logits, "moe_route");
  const int64_t n_tokens = logits.dim(0), n_experts = logits.dim(1);
  Routes r{alloc(DType::kI32, {n_tokens, top_k}), alloc(DType::kF32, {n_tokens, top_k})};
  cuda::launch_moe_route(logits.data<float>(), n_tokens, static_cast<int>(n_experts), top_k,
                         kind == RouterKind::kSoftmaxThenTopK, renormalize, r.ids.data<int32_t>(),
                         r.weights.data<float>(), impl_->stream);
  return r;
}

// NIBBLE_STAGE_H=0 / NIBBLE_STAGE_ACTS=0 (compile definitions, for measurements: scripts/gpu-ab.sh
// NIBBLE_AB_VARIANTS): no staged h for FC1 / no staged act for FC2; the kernels then stage them themselves.
#ifndef NIBBLE_STAGE_H
#define NIBBLE_STAGE_H 1
#endif
#ifndef NIBBLE_STAGE_ACTS
#define NIBBLE_STAGE_ACTS 1
#endif
constexpr bool kStageH = NIBBLE_STAGE_H, kStageActs = NIBBLE_STAGE_ACTS;
// Which one-token MoE kernel issues moe_experts_then_prefetch's hints: FC1 before its wait (1, DRAM idle
// then) or FC2 after its first weights (0). A compile definition, for measurements.
#ifndef NIBBLE_PREFETCH_IN_FC1
#define NIBBLE_PREFETCH_IN_FC1 1
#endif

NormRoutes CudaBackend::add_rms_norm_route(Tensor& x, const Tensor& y, const Tensor& norm, float eps,
                                           const Weight& router, const Tensor* router_bias, int top_k,
                                           RouterKind kind, bool renormalize) {
  check_f32(x, "add_rms_norm_route");
  const int64_t T = x.dim(0), d = x.dim(-1);
  const cuda::DevWeight dw = impl_->dev_weight(router);
  // Many tokens (prefill) or a router the kernel does not read: the three ops in turn.
  if (!impl_->options.decode_fusion || x.rank() != 2 || !cuda::norm_route_supports(dw, T, top_k) || dw.k != d)
    return Backend::add_rms_norm_route(x, y, norm, eps, router, router_bias, top_k, kind, renormalize);
  if (!y.empty()) check_f32(y, "add_rms_norm_route");
  NB_CHECK((y.empty() || y.numel() == x.numel()) && norm.numel() == d && (!router_bias || router_bias->numel() == router.n),
           "add_rms_norm_route: x " + shape_string(x.shape) + ", y " + shape_string(y.shape) + ", norm " +
               shape_string(norm.shape) + ", router " + router.shape_string());
  NormRoutes r;
  r.h = alloc(DType::kF32, x.shape);
  r.routes = Routes{alloc(DType::kI32, {T, top_k}), alloc(DType::kF32, {T, top_k})};
  Tensor logits = alloc(DType::kF32, {T, router.n});
  // One token: the routes stay as the logits (Routes), the sum goes to a new buffer (the kernel's blocks all
  // read x), so the kernel has no last block selecting the experts on the step's critical path.
  const bool defer = T == 1 && impl_->options.defer_routes && router.n <= cuda::kRouteLogitsMaxExperts;
  Tensor x_new = defer ? alloc(DType::kF32, x.shape) : Tensor();
  // Deferred, one fp16 per activation: h staged for the FP4 FC1 kernel too (its first call is an eager step,
  // never inside a graph capture: run_graphed's warm-up run).
  Impl& I = *impl_;
  const bool stage = kStageH && defer && I.options.gemm_fp16_activations && d % 32 == 0;
  if (stage && I.staged_h_bytes < cuda::norm_route_staged_bytes(static_cast<int>(d))) {
    if (I.staged_h) CUDA_CHECK(cudaFree(I.staged_h));
    I.staged_h_bytes = cuda::norm_route_staged_bytes(static_cast<int>(d));
    CUDA_CHECK(cudaMalloc(&I.staged_h, I.staged_h_bytes));
  }
  I.staged_h_of = stage ? std::weak_ptr<uint8_t[]>(r.h.storage) : std::weak_ptr<uint8_t[]>();
  cuda::launch_norm_route(x.data<float>(), y.empty() ? nullptr : y.data<float>(), norm.data<float>(), eps, T, dw,
                          router_bias ? router_bias->data<float>() : nullptr, top_k,
                          kind == RouterKind::kSoftmaxThenTopK, renormalize, r.h.data<float>(), logits.data<float>(),
                          defer ? nullptr : r.routes.ids.data<int32_t>(),
                          defer ? nullptr : r.routes.weights.data<float>(), impl_->arrivals,
                          defer ? x_new.data<float>() : nullptr, impl_->stream, stage ? I.staged_h : nullptr);
  if (defer) {
    x = x_new;
    r.routes.logits = logits;
    r.routes.kind = kind;
    r.routes.renormalize = renormalize;
  }
  return r;
}

Routes CudaBackend::resolve_routes(const Routes& r) {
  if (r.logits.empty()) return r;
  check_f32(r.logits, "resolve_routes");
  const int64_t n_tokens = r.logits.dim(0), top_k = r.ids.dim(1);
  cuda::launch_moe_route(r.logits.data<float>(), n_tokens, static_cast<int>(r.logits.dim(1)), static_cast<int>(top_k),
                         r.kind == RouterKind::kSoftmaxThenTopK, r.renormalize, r.ids.data<int32_t>(),
                         r.weights.data<float>(), impl_->stream);
  return Routes{r.ids, r.weights};
}

// Deferred routes the one-token expert kernels select from themselves (else resolve_routes first).
static bool logits_routes(const Routes& r, const cuda::ExpertTable& t) {
  return !r.logits.empty() && r.logits.dim(0) == 1 &&
         cuda::moe_fp4_stream_supports(t, static_cast<int>(r.ids.dim(1)), static_cast<int>(r.logits.dim(1)));
}
static cuda::RouteLogits route_logits(const Routes& r) {
  return {r.logits.data<float>(), static_cast<int>(r.logits.dim(1)), r.kind == RouterKind::kSoftmaxThenTopK,
          r.renormalize};
}

ExpertDev& CudaBackend::Impl::expert_tables(const MoeExperts& ex) {
  NB_CHECK(!ex.fc1.empty() && !ex.fc1[0].parts.empty(), "moe_experts: no experts");
  const void* key = ex.fc1[0].parts[0].data.data;
  auto it = experts.find(key);
  if (it != experts.end()) return it->second;
  ExpertDev d;
  cuda::ExpertTable& t = d.table;
  std::vector<DevWeight> fc1, fc2;
  t.vec_ok = true;
  bool simple = true;
  for (int e = 0; e < ex.n_experts; ++e) {
    fc1.push_back(dev_weight(ex.fc1[e]));
    fc2.push_back(dev_weight(ex.fc2[e]));
    t.vec_ok = t.vec_ok && fc1.back().vec_ok && fc2.back().vec_ok;
    const DevWeight &w1 = fc1.back(), &w2 = fc2.back();
    const bool two_halves = ex.layout == GluLayout::kHalves && w1.n_parts == 2 && w1.part[0].rows == ex.d_expert &&
                            w1.part[1].rows == ex.d_expert;
    simple = simple && (w1.n_parts == 1 || two_halves) && w2.n_parts == 1;
    NB_CHECK(fc1.back().kind == fc1[0].kind && fc2.back().kind == fc1[0].kind,
             "moe_experts: every expert projection must share one format");
  }
  const int64_t bytes = static_cast<int64_t>(sizeof(DevWeight)) * ex.n_experts;
  d.fc1 = make(DType::kU8, {bytes});
  d.fc2 = make(DType::kU8, {bytes});
  CUDA_CHECK(cudaMemcpyAsync(d.fc1.data<uint8_t>(), fc1.data(), bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(d.fc2.data<uint8_t>(), fc2.data(), bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // once per layer, at the first forward
  t.fc1 = reinterpret_cast<const DevWeight*>(d.fc1.data<uint8_t>());
  t.fc2 = reinterpret_cast<const DevWeight*>(d.fc2.data<uint8_t>());
  t.kind = fc1[0].kind;
  t.simple_rows = simple;
  t.n_experts = ex.n_experts;
  t.d_expert = ex.d_expert;
  t.d_model = static_cast<int>(ex.fc1[0].k);
  t.fc1_bias = ex.fc1_bias.empty() ? nullptr : ex.fc1_bias.data<float>();
  t.fc2_bias = ex.fc2_bias.empty() ? nullptr : ex.fc2_bias.data<float>();
  if (simple && (t.kind == WKind::kMXFP4 || t.kind == WKind::kNVFP4)) {
    // Each expert's gate, up and FC2 row maps: the one-token kernels copy a routed expert's three with one load.
    const bool inter = ex.layout == GluLayout::kInterleaved;
    const int dx = ex.d_expert, dm = t.d_model;
    std::vector<cuda::RowMap> rows;
    for (int e = 0; e < ex.n_experts; ++e) {
      const float* b1 = t.fc1_bias ? t.fc1_bias + static_cast<int64_t>(e) * 2 * dx : nullptr;
      const float* b2 = t.fc2_bias ? t.fc2_bias + static_cast<int64_t>(e) * dm : nullptr;
      rows.push_back(row_map(fc1[e], 0, inter ? 2 : 1, b1));                                  // gate: 2j or j
      rows.push_back(row_map(fc1[e], inter ? 1 : dx, inter ? 2 : 1, b1 ? b1 + (inter ? 1 : dx) : nullptr));  // up
      rows.push_back(row_map(fc2[e], 0, 1, b2));
    }
    const int64_t rb = static_cast<int64_t>(sizeof(cuda::RowMap) * rows.size());
    d.rows = make(DType::kU8, {rb});
    CUDA_CHECK(cudaMemcpyAsync(d.rows.data<uint8_t>(), rows.data(), rb, cudaMemcpyHostToDevice, stream));
    // Room for the one-token kernels' most routed rows; zeroed here once (the padding past d_expert stays so).
    constexpr int kStagedRows = 8;
    const size_t sb = cuda::staged_acts_bytes(kStagedRows, dx);
    d.staged_buf = make(DType::kU8, {static_cast<int64_t>(sb)});
    CUDA_CHECK(cudaMemsetAsync(d.staged_buf.data<uint8_t>(), 0, sb, stream));
    d.staged.planes = d.staged_buf.data<uint8_t>(), d.staged.rows = kStagedRows, d.staged.d_expert = dx;
    CUDA_CHECK(cudaStreamSynchronize(stream));
    t.rows = reinterpret_cast<const cuda::RowMap*>(d.rows.data<uint8_t>());
  }
  return experts.emplace(key, std::move(d)).first->second;
}

Tensor CudaBackend::moe_fc1(const Tensor& x, const Routes& routes, const MoeExperts& ex, const GluParams& glu) {
  check_f32(x, "moe_experts");
  const int64_t n_tokens = x.dim(0), top_k = routes.ids.dim(1);
  ExpertDev& d = impl_->expert_tables(ex);
  NB_CHECK(x.dim(1) == d.table.d_model, "moe_experts: input " + shape_string(x.shape));
  const bool inter = ex.layout == GluLayout::kInterleaved;
  const cuda::Glu g = glu.activation == Activation::kGptOssClamped
                          ? (inter ? cuda::Glu::kGptOssInterleaved : cuda::Glu::kGptOssHalves)
                          : (inter ? cuda::Glu::kSiluInterleaved : cuda::Glu::kSiluHalves);
  Tensor act = alloc(DType::kF32, {n_tokens * top_k, ex.d_expert});
  if (!routes.logits.empty()) {
    NB_CHECK(logits_routes(routes, d.table) && n_tokens == 1, "moe_fc1: deferred routes these kernels cannot select");
    cuda::launch_moe_fc1_logits(d.table, route_logits(routes), static_cast<int>(top_k), routes.ids.data<int32_t>(),
                                routes.weights.data<float>(), x.data<float>(), g, glu.limit, act.data<float>(),
                                impl_->options.gemm_fp16_activations, impl_->stream, kStageActs ? &d.staged : nullptr,
                                impl_->take_staged_h(x), NIBBLE_PREFETCH_IN_FC1 ? &impl_->moe_prefetch : nullptr);
  } else {
    impl_->staged_h_of.reset();
    cuda::launch_moe_fc1(d.table, routes.ids.data<int32_t>(), n_tokens * top_k, static_cast<int>(top_k),
                         x.data<float>(), g, glu.limit, act.data<float>(), impl_->options.gemm_fp16_activations,
                         impl_->stream, kStageActs ? &d.staged : nullptr);
  }
  d.staged_of = d.staged.act ? std::weak_ptr<uint8_t[]>(act.storage) : std::weak_ptr<uint8_t[]>();
  return act;
}

Tensor CudaBackend::moe_fc2(const Tensor& act, const Routes& routes, const MoeExperts& ex) {
  const int64_t top_k = routes.ids.dim(1), n_tokens = routes.ids.dim(0);
  ExpertDev& d = impl_->expert_tables(ex);
  NB_CHECK(act.dim(0) == n_tokens * top_k && act.dim(1) == ex.d_expert, "moe_fc2: act " + shape_string(act.shape));
  // This act as FC1 staged it (StagedActs), or FC2 stages it itself.
  const bool staged = kStageActs && act.storage && d.staged_of.lock() == act.storage;
  Tensor y = alloc(DType::kF32, {n_tokens, d.table.d_model});
  // The routes are older than the kernel before this one (moe_experts launches FC2 right after FC1 with the
  // same routes; the benchmark makes them first), as launch_moe_fc2 needs.
  // Deferred routes: moe_fc1 (the kernel right before) has written ids and weights.
  NB_CHECK(routes.logits.empty() || logits_routes(routes, d.table), "moe_fc2: deferred routes these kernels cannot take");
  cuda::launch_moe_fc2(d.table, routes.ids.data<int32_t>(), routes.weights.data<float>(), n_tokens,
                       static_cast<int>(top_k), act.data<float>(), y.data<float>(),
                       impl_->options.gemm_fp16_activations, impl_->stream, &impl_->moe_prefetch,
                       staged ? &d.staged : nullptr);
  return y;
}

// Prefill with BF16 experts (Qwen3-MoE and other unquantized MoE checkpoints): the CPU reference's shape on
// the GPU. The pairs (token, choice) are grouped by expert on the host -- one stream sync per MoE layer for
// the routes; prefill steps are never graph-captured (Model::run_step) -- then each routed expert's rows go
// through FC1 and FC2 as cuBLASLt GEMMs (bf16 hi + lo activations, as every BF16 prefill linear), with one
// GLU launch between and one weighted, choice-ordered combine after (deterministic). The per-token expert
// kernels this replaces re-read every routed expert's weights for each chunk of 4 tokens.
static bool dense_experts_ok(CudaBackend::Impl& I, const MoeExperts& ex) {
  if (ex.fc1.empty() || ex.d_expert % 4 != 0) return false;
  for (int e = 0; e < ex.n_experts; ++e)
    if (!cuda::DenseGemm::supports(I.dev_weight(ex.fc1[e])) || !cuda::DenseGemm::supports(I.dev_weight(ex.fc2[e])))
      return false;
  return true;
}

static Tensor moe_experts_dense(CudaBackend& be, CudaBackend::Impl& I, const Tensor& x, const Routes& routes,
                                const MoeExperts& ex, cuda::Glu glu, float limit) {
  const int64_t n_tokens = x.dim(0), d_model = x.dim(1), top_k = routes.ids.dim(1), n_pairs = n_tokens * top_k;
  const int64_t d_ff = ex.d_expert;
  // Group the pairs (p = t * top_k + i) by expert, in pair order within an expert as the CPU reference does:
  // pair p goes to slot slot_of[p] (the combine reads it back), slot s holds a row of token token_of[s].
  std::vector<int32_t> ids(static_cast<size_t>(n_pairs));
  CUDA_CHECK(cudaMemcpyAsync(ids.data(), routes.ids.data<int32_t>(), n_pairs * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, I.stream));
  CUDA_CHECK(cudaStreamSynchronize(I.stream));
  std::vector<int64_t> first(ex.n_experts + 1, 0);
  for (int32_t e : ids) {
    NB_CHECK(e >= 0 && e < ex.n_experts, "moe_experts: expert id " + std::to_string(e) + " out of range");
    ++first[e + 1];
  }
  for (int e = 0; e < ex.n_experts; ++e) first[e + 1] += first[e];
  std::vector<int32_t> token_of(n_pairs), slot_of(n_pairs);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < n_pairs; ++p) {
    const int64_t s = next[ids[p]]++;
    slot_of[p] = static_cast<int32_t>(s);
    token_of[s] = static_cast<int32_t>(p / top_k);
  }
  const Tensor xs = be.gather_rows(x, token_of);  // [n_pairs, d_model] in slot order
  const Tensor d_slot_of = I.upload_i32(slot_of);
  Tensor h = be.alloc(DType::kF32, {n_pairs, 2 * d_ff});    // FC1 + bias, slot order
  Tensor act = be.alloc(DType::kF32, {n_pairs, d_ff});      // glu(h)
  Tensor ys = be.alloc(DType::kF32, {n_pairs, d_model});    // FC2 + bias, slot order
  // bf16 hi + lo of all the rows at once, then one GEMM pair per routed expert on its slice.
  Tensor scratch = be.alloc(DType::kU8, {cuda::DenseGemm::scratch_bytes(n_pairs, std::max(d_model, d_ff))});
  if (!I.dense_gemm) I.dense_gemm = std::make_unique<cuda::DenseGemm>();
  cuda::DenseGemm& gemm = *I.dense_gemm;
  const float* b1 = ex.fc1_bias.empty() ? nullptr : ex.fc1_bias.data<float>();
  const float* b2 = ex.fc2_bias.empty() ? nullptr : ex.fc2_bias.data<float>();
  gemm.split(xs.data<float>(), n_pairs, d_model, scratch.data<uint8_t>(), I.stream);
  for (int e = 0; e < ex.n_experts; ++e) {  // FC1 of each routed expert
    const int64_t r0 = first[e], m = first[e + 1] - r0;
    if (m > 0)
      gemm.run_split(I.dev_weight(ex.fc1[e]), scratch.data<uint8_t>(), n_pairs, r0, m,
                     b1 ? b1 + e * 2 * d_ff : nullptr, h.data<float>() + r0 * 2 * d_ff, I.stream);
  }
  cuda::launch_moe_glu(h.data<float>(), n_pairs, static_cast<int>(d_ff), glu, limit, act.data<float>(), I.stream);
  gemm.split(act.data<float>(), n_pairs, d_ff, scratch.data<uint8_t>(), I.stream);
  for (int e = 0; e < ex.n_experts; ++e) {  // FC2
    const int64_t r0 = first[e], m = first[e + 1] - r0;
    if (m > 0)
      gemm.run_split(I.dev_weight(ex.fc2[e]), scratch.data<uint8_t>(), n_pairs, r0, m,
                     b2 ? b2 + e * d_model : nullptr, ys.data<float>() + r0 * d_model, I.stream);
  }
  Tensor y = be.alloc(DType::kF32, {n_tokens, d_model});
  cuda::launch_moe_combine(ys.data<float>(), d_slot_of.data<int32_t>(), routes.weights.data<float>(), n_tokens,
                           static_cast<int>(top_k), static_cast<int>(d_model), y.data<float>(), I.stream);
  return y;
}

Tensor CudaBackend::moe_experts(const Tensor& x, const Routes& deferred, const MoeExperts& ex, const GluParams& glu) {
  const int64_t n_tokens = x.dim(0), top_k = deferred.ids.dim(1);
  const ExpertDev& d = impl_->expert_tables(ex);
  if (logits_routes(deferred, d.table) && n_tokens == 1) return moe_fc2(moe_fc1(x, deferred, ex, glu), deferred, ex);
  const Routes routes = resolve_routes(deferred);
  const int min_t = impl_->options.moe_gemm_min_tokens > 0 ? impl_->options.moe_gemm_min_tokens : kMoeGemmMinTokens;
  const bool inter = ex.layout == GluLayout::kInterleaved;
  const cuda::Glu g = glu.activation == Activation::kGptOssClamped
                          ? (inter ? cuda::Glu::kGptOssInterleaved : cuda::Glu::kGptOssHalves)
                          : (inter ? cuda::Glu::kSiluInterleaved : cuda::Glu::kSiluHalves);
  if (n_tokens >= min_t && d.table.kind == WKind::kBF16 && impl_->options.moe_dense_gemm &&
      dense_experts_ok(*impl_, ex)) {
    // Its host sync cannot be captured: a decode graph (tests force the GEMMs from one token) keeps the kernels.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(impl_->stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) return moe_experts_dense(*this, *impl_, x, routes, ex, g, glu.limit);
  }
  if (n_tokens < min_t || !d.table.vec_ok || !cuda::moe_gemm_supports(d.table)) return moe_fc2(moe_fc1(x, routes, ex, glu), routes, ex);
  // Prefill: the experts as grouped tensor-core GEMMs, scratch from the pool.
  check_f32(x, "moe_experts");
  NB_CHECK(x.dim(1) == d.table.d_model && routes.ids.dim(0) == n_tokens, "moe_experts: input " + shape_string(x.shape));
  const cuda::GemmActs mode = impl_->prefill_acts();
  Tensor scratch = alloc(DType::kU8, {cuda::moe_gemm_scratch_bytes(d.table, n_tokens * top_k, mode)});
  const cuda::MoeGemmScratch ws = cuda::moe_gemm_scratch_in(scratch.data<uint8_t>(), d.table, n_tokens * top_k, mode);
  Tensor y = alloc(DType::kF32, {n_tokens, d.table.d_model});
  cuda::launch_moe_gemm(d.table, routes.ids.data<int32_t>(), routes.weights.data<float>(), n_tokens,
                        static_cast<int>(top_k), x.data<float>(), g, glu.limit, mode, ws, y.data<float>(),
                        impl_->stream);
  return y;
}

Tensor CudaBackend::run_graphed(const BatchInfo& b, const KvCache& cache, const std::function<Tensor()>& step) {
  Impl& I = *impl_;
  int32_t stride = 0;
  std::vector<int32_t> h = Impl::batch_words(b, &stride);
  // The graph bakes in the cache's buffers: a new cache at the same address must not replay an old graph.
  std::vector<const void*> cache_ptrs;
  for (size_t l = 0; l < cache.k.size(); ++l) cache_ptrs.push_back(cache.k[l].storage.get()), cache_ptrs.push_back(cache.v[l].storage.get());
  GraphRec& g = I.graphs[{b.n_tokens(), b.seqs.size(), stride, b.logit_rows.size(), &cache, kGroupAuto && long_context(b)}];
  if (g.cache_ptrs != cache_ptrs) {
    if (g.exec) CUDA_CHECK(cudaGraphExecDestroy(g.exec));
    g.exec = nullptr;
    g.eager_runs = 0;
    g.cache_ptrs = cache_ptrs;
  }
  if (g.meta.empty()) g.meta = I.make(DType::kI32, {static_cast<int64_t>(h.size())});
  I.bind_batch(b, std::move(h), stride, g.meta);
  if (g.exec) {
    CUDA_CHECK(cudaGraphLaunch(g.exec, I.stream));
    return g.logits;
  }
  if (g.eager_runs++ == 0) return step();  // warm-up: expert tables, RoPE tables, pool sizes
  I.pool->begin_private(&g.scratch);
  CUDA_CHECK(cudaStreamBeginCapture(I.stream, cudaStreamCaptureModeRelaxed));
  Tensor logits = step();
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(I.stream, &graph);
  I.pool->end_private();
  CUDA_CHECK(err);
  CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0));
  CUDA_CHECK(cudaGraphDestroy(graph));
  g.logits = logits;
  CUDA_CHECK(cudaGraphLaunch(g.exec, I.stream));
  return logits;
}

Tensor CudaBackend::swiglu(const Tensor& gate, const Tensor& up) {
  check_f32(gate, "swiglu");
  NB_CHECK(gate.shape == up.shape, "swiglu shapes");
  Tensor out = alloc(DType::kF32, gate.shape);
  cuda::launch_swiglu(gate.data<float>(), up.data<float>(), out.data<float>(), gate.numel(), impl_->stream);
  return out;
}

void CudaBackend::add(Tensor& x, const Tensor& y) {
  check_f32(x, "add");
  NB_CHECK(x.numel() == y.numel(), "add shapes");
  cuda::launch_add(x.data<float>(), y.data<float>(), x.numel(), impl_->stream);
}

Tensor CudaBackend::gather_rows(const Tensor& x, const std::vector<int32_t>& rows) {
  const int64_t row_bytes = x.numel() / x.dim(0) * dtype_bits(x.dtype) / 8;
  std::vector<int64_t> shape = x.shape;
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor out = alloc(x.dtype, shape);
  // The logit rows of the bound batch are already on the device (and must be, inside a graph capture).
  Tensor d_rows;
  const int32_t* rows_ptr = impl_->d_logit_rows;
  if (rows != impl_->h_logit_rows || !rows_ptr) {
    d_rows = impl_->upload_i32(rows);
    rows_ptr = d_rows.data<int32_t>();
  }
  cuda::launch_gather_rows(x.data<uint8_t>(), rows_ptr, static_cast<int64_t>(rows.size()), row_bytes,
                           out.data<uint8_t>(), impl_->stream);
  return out;
}

std::vector<int32_t> CudaBackend::sample(const Tensor& logits, const std::vector<SampleSpec>& specs) {
  NB_CHECK(impl_->n_sampled == 0, "sample: queued samples not waited for");
  sample_async(logits, specs);
  return wait_sampled();
}

void CudaBackend::sample_async(const Tensor& logits, const std::vector<SampleSpec>& specs) {
  check_f32(logits, "sample");
  Impl& I = *impl_;
  const int64_t rows = logits.dim(0), vocab = logits.dim(-1);
  NB_CHECK(static_cast<int64_t>(specs.size()) == rows, "sample: " + std::to_string(specs.size()) +
                                                           " specs for " + std::to_string(rows) + " rows");
  NB_CHECK(I.n_sampled < Impl::kPinnedRing, "sample_async: too many samples queued");
  // The slot: the specs [rows], then room for the ids [rows] (host_ids: in place, see launch_sample).
  const size_t spec_bytes = (rows * sizeof(cuda::DevSampleSpec) + 15) / 16 * 16;
  Impl::Pinned& p = I.sampled[(I.next_sampled + I.n_sampled++) % Impl::kPinnedRing];
  auto* h = static_cast<cuda::DevSampleSpec*>(Impl::reuse(p, spec_bytes + rows * 4));
  p.rows = rows;
  for (int64_t r = 0; r < rows; ++r)
    h[r] = {specs[r].temperature, specs[r].top_p, specs[r].top_k, specs[r].min_p, specs[r].u};
  // The ids go straight to last_ids unless there are more rows than it keeps.
  const bool kept = rows <= kKeptSampledRows;
  Tensor d_more = kept ? Tensor() : alloc(DType::kI32, {rows});
  int32_t* d_ids = kept ? I.last_ids : d_more.data<int32_t>();
  bool greedy = false, sampled = false;
  for (const SampleSpec& sp : specs) (sp.temperature <= 0.0f || sp.top_k == 1 ? greedy : sampled) = true;
  Tensor part_v = alloc(DType::kF32, {rows, cuda::kArgmaxSplit}), part_i = alloc(DType::kI32, {rows, cuda::kArgmaxSplit});
  const cuda::ArgmaxScratch scratch{part_v.data<float>(), part_i.data<int32_t>(), I.arrivals};  // (65535 rows a launch)
  cuda::launch_sample(logits.data<float>(), rows, vocab, static_cast<const cuda::DevSampleSpec*>(p.dev), d_ids,
                      reinterpret_cast<int32_t*>(static_cast<uint8_t*>(p.dev) + spec_bytes), greedy, sampled, scratch,
                      I.stream);
  if (!kept)
    CUDA_CHECK(cudaMemcpyAsync(I.last_ids, d_ids, kKeptSampledRows * 4, cudaMemcpyDeviceToDevice, I.stream));
  CUDA_CHECK(cudaEventRecord(p.done, I.stream));
}

std::vector<int32_t> CudaBackend::wait_sampled() {
  Impl& I = *impl_;
  NB_CHECK(I.n_sampled > 0, "wait_sampled: nothing queued");
  Impl::Pinned& p = I.sampled[I.next_sampled];
  I.next_sampled = (I.next_sampled + 1) % Impl::kPinnedRing;
  --I.n_sampled;
  CUDA_CHECK(cudaEventSynchronize(p.done));
  const size_t rows = p.rows, spec_bytes = p.bytes - rows * 4;  // (see sample_async: specs, then ids)
  const int32_t* ids = reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(p.host) + spec_bytes);
  return std::vector<int32_t>(ids, ids + rows);
}

// ---- WeightFactory -------------------------------------------------------------------------------

Weight CudaBackend::random_weight(WeightFormat format, int64_t n, int64_t k, float std, uint64_t seed,
                                  const std::string& name) {
  Weight w;
  w.format = format;
  w.n = n;
  w.k = k;
  WeightPart p;
  p.rows = n;
  p.name = name;
  WKind kind = WKind::kBF16;
  int64_t data_bytes = n * k * 2, scale_bytes = 0;
  DType data_dtype = DType::kBF16, scale_dtype = DType::kU8;
  std::vector<int64_t> data_shape = {n, k}, scale_shape;
  switch (format) {
    case WeightFormat::kBF16:
      break;
    case WeightFormat::kFP8E4M3:
      kind = WKind::kFP8, data_bytes = n * k, data_dtype = DType::kU8, scale_bytes = n * 4, scale_dtype = DType::kF32;
      scale_shape = {n};
      break;
    case WeightFormat::kMXFP4:
      kind = WKind::kMXFP4, data_bytes = n * k / 2, data_dtype = DType::kU8, scale_bytes = n * k / 32;
      data_shape = {n, k / 2}, scale_shape = {n, k / 32};
      break;
    case WeightFormat::kNVFP4:
      kind = WKind::kNVFP4, data_bytes = n * k / 2, data_dtype = DType::kU8, scale_bytes = n * k / 16;
      scale_dtype = DType::kF8_E4M3, data_shape = {n, k / 2}, scale_shape = {n, k / 16};
      p.global_scale = 1.0f / 448.0f;
      break;
  }
  auto* data = static_cast<uint8_t*>(impl_->owned_alloc(data_bytes));
  auto* scales = scale_bytes ? static_cast<uint8_t*>(impl_->owned_alloc(scale_bytes)) : nullptr;
  cuda::launch_random_weight(kind, n, k, std, seed, data, scales, impl_->stream);
  p.data = TensorView{data, data_dtype, data_shape, Device::kCuda};
  if (scales) p.scales = TensorView{scales, scale_dtype, scale_shape, Device::kCuda};
  w.parts.push_back(std::move(p));
  return w;
}

Tensor CudaBackend::random_floats(const std::vector<int64_t>& shape, float mean, float std, uint64_t seed) {
  Tensor t = alloc(DType::kF32, shape);
  cuda::launch_random_floats(t.data<float>(), t.numel(), mean, std, seed, impl_->stream);
  return t;
}

Result<Weight> CudaBackend::requantize(const Weight& w, WeightFormat format) {
  if (format == WeightFormat::kBF16) return w;
  const DevWeight src = impl_->dev_weight(w);
  const int64_t n = w.n, k = w.k;
  Weight out;
  out.format = format;
  out.n = n;
  out.k = k;
  WeightPart p;
  p.rows = n;
  p.name = w.parts[0].name;
  float global = 1.0f;
  WKind kind = WKind::kFP8;
  if (format == WeightFormat::kMXFP4 && k % 32 != 0) return error(p.name + ": MXFP4 needs k % 32 == 0");
  if (format == WeightFormat::kNVFP4) {
    if (k % 16 != 0) return error(p.name + ": NVFP4 needs k % 16 == 0");
    Tensor amax = alloc(DType::kF32, {1});
    cuda::launch_amax(src, amax.data<float>(), impl_->stream);
    const float a = to_host(amax)[0];
    global = fmt::nvfp4_global_scale(a);
    kind = WKind::kNVFP4;
  } else if (format == WeightFormat::kMXFP4) {
    kind = WKind::kMXFP4;
  }
  const bool fp4 = kind != WKind::kFP8;
  const int64_t data_bytes = fp4 ? n * k / 2 : n * k;
  const int64_t scale_bytes = kind == WKind::kFP8 ? n * 4 : n * k / (kind == WKind::kNVFP4 ? 16 : 32);
  auto* data = static_cast<uint8_t*>(impl_->owned_alloc(data_bytes));
  auto* scales = static_cast<uint8_t*>(impl_->owned_alloc(scale_bytes));
  cuda::launch_quantize(src, kind, global, data, scales, impl_->stream);
  p.data = TensorView{data, DType::kU8, {n, fp4 ? k / 2 : k}, Device::kCuda};
  p.scales = TensorView{scales, kind == WKind::kFP8 ? DType::kF32 : kind == WKind::kNVFP4 ? DType::kF8_E4M3 : DType::kU8,
                        kind == WKind::kFP8 ? std::vector<int64_t>{n} : std::vector<int64_t>{n, scale_bytes / n},
                        Device::kCuda};
  p.global_scale = global;
  p.convention = fmt::GlobalScale::kMultiply;
  out.parts.push_back(std::move(p));
  NB_RETURN_IF_ERROR(synchronize());
  return out;
}

}  // namespace nb
