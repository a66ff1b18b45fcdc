// Prefill attention over the paged KV cache, FlashAttention-style: a block takes the query rows of a few
// tokens of one sequence times the heads of one KV head group (GQA: the group shares each K/V tile),
// streams K/V tiles of 64 keys through shared memory and keeps an online softmax in fp32; QK^T and PV run
// on mma.sync m16n8k16 (sm_80 instructions only). Head dims 16..128 in powers of two. Same semantics as
// launch_attention: causal, keys (p - window, p] when window > 0, a per-head sink logit in the denominator,
// any n_past (chunked prefill).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/attention.cuh"

namespace nb::cuda {

// Whether launch_flash_attention takes this shape: head_dim 16, 32, 64 or 128 and at most one tile's rows
// (128) of query heads per KV head. Other shapes stay on launch_attention.
bool flash_attention_supported(const AttnShape& a);

// Blocks the launch needs for the sequences with at least min_new of these numbers of new tokens (one
// block per tile of rows / group tokens per KV head).
int64_t flash_attention_tiles(const std::vector<int32_t>& n_new, int min_new, const AttnShape& a);

// q, out [n_tokens, n_heads, head_dim] fp32; caches [n_blocks, 16, n_kv_heads, head_dim] of `kind`, already
// holding every key the batch's tokens see (kv_write first). seq_begin [n_seqs + 1]: token ranges of the
// sequences in the batch (contiguous, positions ascending). Only sequences with at least min_new new
// tokens are computed (the others' rows of out are left as they are, for launch_attention with
// AttnShape::skip_min_new = min_new); n_tiles from flash_attention_tiles.
void launch_flash_attention(KvKind kind, const float* q, const void* k_cache, const void* v_cache,
                            const DevBatch& b, const int32_t* seq_begin, int n_seqs, int min_new,
                            int64_t n_tiles, const AttnShape& a, float* out, cudaStream_t s);

}  // namespace nb::cuda
