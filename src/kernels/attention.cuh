// Paged-KV-cache attention: the KV write after RoPE, and attention with per-head sinks and a sliding
// window, split over the context (each split a partial softmax, then one combine), for decode and prefill.
// Cache element types: fp32, BF16 or FP8 E4M3 (KvKind).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace nb::cuda {

// Token metadata on the device. Token t of sequence seq_of[t] sits at positions[t]; its keys live in
// blocks tables[seq_of[t] * table_stride + p / kKvBlock].
struct DevBatch {
  const int32_t* positions = nullptr;  // [n_tokens]
  const int32_t* seq_of = nullptr;     // [n_tokens]
  const int32_t* tables = nullptr;     // [n_seqs, table_stride]
  int32_t table_stride = 0;
  int64_t n_tokens = 0;
};

// cache [n_blocks, 16, n_kv_heads, head_dim] of `kind`; k, v [n_tokens, n_kv_heads, head_dim] fp32.
void launch_kv_write(KvKind kind, void* k_cache, void* v_cache, const float* k, const float* v, const DevBatch& b,
                     int n_kv_heads, int head_dim, cudaStream_t s);

struct AttnShape {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 1.0f;
  int window = 0;                 // > 0: keys (p - window, p]
  const float* sinks = nullptr;   // [n_heads] or null
  int n_splits = 1;               // context splits per (token, head)
  // > 0: tokens of sequences with at least this many new tokens are left out (the tiled prefill kernel
  // takes them in the same step); seq_begin [n_seqs + 1] holds the sequences' token ranges.
  int skip_min_new = 0;
  const int32_t* seq_begin = nullptr;
  // Non-null: n_tokens * n_heads zeroed counters (left zeroed); the last split of each (token, head) to
  // finish merges the splits, so the attention is one launch. Null: a second kernel merges them.
  unsigned* arrivals = nullptr;
  // One token, head_dim % 32 == 0 (attention_can_stage): the block that finishes head h also writes its
  // values as the one-token FP4 linear stages its input (stage.cuh: one fp16, hi planes of the row of
  // k = n_heads * head_dim) at a power-of-two prescale of its own, 2^s with s from the head's max |value|,
  // and s into stage_shifts[g] for each 32-element group g of the head -- so that the O projection copies
  // its input (StagedRow, gemv.cuh) instead of taking maxima and converting on the step's critical path.
  // stage_planes [hi_words(k) * 8] fp16 (padding past k zeroed by the owner), stage_shifts [n_chunks(k) * 32]
  // (padding groups 127: they never set the row's minimum).
  uint16_t* stage_planes = nullptr;
  int8_t* stage_shifts = nullptr;
  // One block per (KV head, split) for all of the group's query heads, each K/V row read once (long contexts;
  // attention_group_ok): grid n_kv_heads x n_tokens x n_splits instead of n_heads x ...
  bool grouped = false;
};
// Whether the grouped decode kernel takes the shape (head_dim 64 or 128, 2..8 query heads per KV head, arrivals).
bool attention_group_ok(const AttnShape& a);
// Resident blocks per SM of the grouped kernel for a cache kind and head_dim (64 or 128): its splits fill one wave.
int attention_group_blocks_per_sm(KvKind kind, int head_dim);
// Whether launch_attention can stage its output for the O projection (AttnShape::stage_planes).
bool attention_can_stage(int64_t n_tokens, const AttnShape& a);
// Scratch floats the launch needs for `n_tokens` tokens.
int64_t attention_workspace_floats(int64_t n_tokens, const AttnShape& a);
// out [n_tokens, n_heads, head_dim] fp32; q the same shape.
void launch_attention(KvKind kind, const float* q, const void* k_cache, const void* v_cache, const DevBatch& b,
                      const AttnShape& a, float* workspace, float* out, cudaStream_t s);

}  // namespace nb::cuda
