// After the fused QKV projection, in one launch: the optional per-head q/k RMSNorm (qwen3), RoPE on q and
// k, the K/V write into the paged cache, and q out. Replaces rms_norm x2 + rope x2 + kv_write of a decode
// layer (five launches) with one; the math is theirs (norm_rope.cu, attention.cu's kv_write).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention.cuh"
#include "kernels/common.cuh"

namespace nb::cuda {

struct QkvRopeShape {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const float* q_norm = nullptr;  // [head_dim] or null
  const float* k_norm = nullptr;  // [head_dim] or null
  float eps = 1e-6f;
  const float* inv_freq = nullptr;  // [head_dim / 2]
  float attention_scale = 1.0f;
};

// qkv [n_tokens, (n_heads + 2 n_kv_heads) * head_dim] fp32 (q heads, then k, then v); caches
// [n_blocks, 16, n_kv_heads, head_dim] of `kind`; q_out [n_tokens, n_heads, head_dim] fp32.
void launch_qkv_rope_kv_write(KvKind kind, const float* qkv, const QkvRopeShape& s, const DevBatch& b, void* k_cache,
                              void* v_cache, float* q_out, cudaStream_t stream);

}  // namespace nb::cuda
