// Attention-only benchmark (CudaBackend::attention on random q and cache contents): the tiled prefill kernel
// (kernels/flash_attention.cu) against the split-context kernel (kernels/attention.cu) on gpt-oss shapes
// (64 query heads, 8 KV heads, head_dim 64; full and 128-token window layers), per KV cache kind:
//   1. a prompt of N tokens at batch 1 (pp512 / pp2048 / pp8192): ms per layer and TFLOP/s, where
//      FLOPs = 4 * head_dim * n_heads * sum over queries of the keys each sees (QK^T and PV, causal);
//   2. n_new tokens after a 4096-token prefix (chunks and decode): where the tiled kernel starts to win,
//      which sets CudaBackendOptions::prefill_attention_min_tokens;
//   3. the tiled kernel at head_dim 128 (32 query heads; 4 KV heads as Qwen3-30B-A3B, 8 as Llama-3.1-8B; no
//      sinks), full attention, BF16 and FP8 caches.
// Usage: nibble_attention_bench [--quick]   (--quick: table 3 only, and gpt-oss pp2048 / pp8192 with BF16 and FP8 caches)
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"

namespace nb {
namespace {

// An attention layer's shape.
struct Shape {
  int heads, kv_heads, head_dim;
  bool sinks;
};
constexpr Shape kGptOss{64, 8, 64, true};

struct Setup {
  BatchInfo b;
  int n_blocks = 0;
};

Setup make_batch(int n_past, int n_new) {
  Setup s;
  s.n_blocks = (n_past + n_new + 15) / 16;
  std::vector<int32_t> table(s.n_blocks);
  for (int i = 0; i < s.n_blocks; ++i) table[i] = i;
  s.b.seqs.push_back(SeqInfo{0, n_new, n_past, table});
  for (int i = 0; i < n_new; ++i)
    s.b.tokens.push_back(0), s.b.positions.push_back(n_past + i), s.b.seq_of.push_back(0);
  return s;
}

// Milliseconds per attention call (mean of 20 after 3 warm-ups), cache filled with random K/V.
double time_attention(DType kv, int min_tokens, int n_past, int n_new, int window, const Shape& sh = kGptOss) {
  CudaBackendOptions o;
  o.kv_cache_dtype = kv;
  o.prefill_attention_min_tokens = min_tokens;
  auto g = CudaBackend::create(o);
  if (!g.ok()) return -1;
  CudaBackend& gpu = **g;
  const Setup all = make_batch(0, n_past + n_new), step = make_batch(n_past, n_new);
  auto cache = gpu.new_kv_cache(1, all.n_blocks, sh.kv_heads, sh.head_dim);
  const int64_t T = n_past + n_new;
  Tensor k = gpu.random_floats({T, sh.kv_heads, sh.head_dim}, 0, 1, 1),
         v = gpu.random_floats({T, sh.kv_heads, sh.head_dim}, 0, 1, 2);
  gpu.kv_write(*cache, 0, k, v, all.b);
  Tensor q = gpu.random_floats({n_new, sh.heads, sh.head_dim}, 0, 1, 3),
         sinks = gpu.random_floats({sh.heads}, 0, 1, 4);
  const AttentionParams p{1.0f / std::sqrt(static_cast<float>(sh.head_dim)), window, sh.sinks ? &sinks : nullptr};
  auto stream = static_cast<cudaStream_t>(gpu.stream());
  for (int i = 0; i < 3; ++i) gpu.attention(q, *cache, 0, step.b, p);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  constexpr int kIters = 20;
  cudaEventRecord(e0, stream);
  for (int i = 0; i < kIters; ++i) gpu.attention(q, *cache, 0, step.b, p);
  cudaEventRecord(e1, stream);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (!gpu.synchronize().ok()) return -1;
  return ms / kIters;
}

double flops(int n_past, int n_new, int window, const Shape& sh = kGptOss) {
  double keys = 0;
  for (int t = n_past; t < n_past + n_new; ++t) keys += window > 0 ? std::min(t + 1, window) : t + 1;
  return 4.0 * sh.head_dim * sh.heads * keys;
}

// Table 3: head_dim 128, tiled kernel only.
void head_dim_128() {
  std::printf("\nhead_dim 128, 32 query heads, no sinks, full attention (tiled kernel)\n\n");
  std::printf("| prompt | KV heads | KV cache | ms | TFLOP/s |\n|---|---|---|---|---|\n");
  for (int n : {512, 2048, 8192})
    for (int kvh : {4, 8})
      for (DType kv : {DType::kBF16, DType::kF8_E4M3}) {
        const Shape sh{32, kvh, 128, false};
        const double ms = time_attention(kv, 1, 0, n, 0, sh);
        std::printf("| pp%d | %d | %s | %.3f | %.1f |\n", n, kvh, std::string(dtype_name(kv)).c_str(), ms,
                    flops(0, n, 0, sh) / ms / 1e9);
        std::fflush(stdout);
      }
}

int run(bool quick) {
  auto info = cuda_device_info(0);
  if (!info.ok()) {
    std::fprintf(stderr, "nibble_attention_bench: %s\n", info.status().message().c_str());
    return 1;
  }
  std::printf("command: nibble_attention_bench\nGPU: %s\n", describe(*info).c_str());
  std::printf("gpt-oss attention: %d query heads, %d KV heads, head_dim %d, sinks\n\n", kGptOss.heads,
              kGptOss.kv_heads, kGptOss.head_dim);
  if (quick) {
    std::printf("| prompt | window | KV cache | tiled ms | tiled TFLOP/s |\n|---|---|---|---|---|\n");
    for (DType kv : {DType::kBF16, DType::kF8_E4M3})
      for (int n : {2048, 8192}) {
        const double ms = time_attention(kv, 1, 0, n, 0);
        std::printf("| pp%d | 0 | %s | %.3f | %.1f |\n", n, std::string(dtype_name(kv)).c_str(), ms,
                    flops(0, n, 0) / ms / 1e9);
      }
    head_dim_128();
    return 0;
  }
  std::printf("| prompt | window | KV cache | tiled ms | tiled TFLOP/s | split ms | split TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int n : {512, 2048, 8192})
    for (int window : {0, 128})
      for (DType kv : {DType::kBF16, DType::kF8_E4M3, DType::kF32}) {
        const double f = flops(0, n, window);
        const double tiled = time_attention(kv, 1, 0, n, window);
        // The split kernel at pp8192 full attention takes seconds; measure it where it is quick.
        const double split = n <= 2048 || window > 0 ? time_attention(kv, INT_MAX, 0, n, window) : -1;
        std::printf("| pp%d | %d | %s | %.3f | %.1f | %s | %s |\n", n, window,
                    std::string(dtype_name(kv)).c_str(), tiled, f / tiled / 1e9,
                    split > 0 ? std::to_string(split).c_str() : "-",
                    split > 0 ? std::to_string(f / split / 1e9).c_str() : "-");
        std::fflush(stdout);
      }
  std::printf("\nAfter a 4096-token prefix, full attention, BF16 cache (dispatch threshold)\n\n");
  std::printf("| new tokens | tiled ms | split ms |\n|---|---|---|\n");
  for (int n_new : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    const double tiled = time_attention(DType::kBF16, 1, 4096, n_new, 0);
    const double split = time_attention(DType::kBF16, INT_MAX, 4096, n_new, 0);
    std::printf("| %d | %.4f | %.4f |\n", n_new, tiled, split);
    std::fflush(stdout);
  }
  head_dim_128();
  return 0;
}

}  // namespace
}  // namespace nb

int main(int argc, char** argv) {
  const bool quick = argc == 2 && std::string(argv[1]) == "--quick";
  if (argc > 2 || (argc == 2 && !quick)) {
    std::fprintf(stderr, "nibble_attention_bench: arguments '%s%s': expected none or --quick\n", argv[1],
                 argc > 2 ? " ..." : "");
    return 2;
  }
  return nb::run(quick);
}
