// Element-wise and row-wise activation ops: embedding gather, RMSNorm (optionally fused with the residual
// add), RoPE in the half-split layout, SwiGLU, add, row gather. fp32 activations, fp32 statistics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace nb::cuda {

// out[t, :] = table[tokens[t], :] decoded to fp32. out [n_tokens, table.k].
// tokens [n_tokens]: a token -1 - j is last_ids[j] (the previous step's sampled ids, on the device).
void launch_embedding(const DevWeight& table, const int32_t* tokens, const int32_t* last_ids, int64_t n_tokens,
                      float* out, cudaStream_t s);
// out[r, :] = w * x[r, :] / sqrt(mean(x[r, :]^2) + eps), rows of d. With residual: x[r, :] += residual[r, :]
// first (in place), then the norm of the sum.
void launch_rms_norm(float* x, const float* residual, const float* w, int64_t rows, int d, float eps, float* out,
                     cudaStream_t s);
// In place on x [n_tokens, n_heads, head_dim]: rotate dims (i, i + half) by positions[t] * inv_freq[i],
// cos and sin scaled by attention_scale.
void launch_rope(float* x, const int32_t* positions, const float* inv_freq, float attention_scale, int64_t n_tokens,
                 int n_heads, int head_dim, cudaStream_t s);
void launch_swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t s);
void launch_add(float* x, const float* y, int64_t n, cudaStream_t s);
// out[i, :] = x[rows[i], :], row_bytes per row.
void launch_gather_rows(const uint8_t* x, const int32_t* rows, int64_t n_rows, int64_t row_bytes, uint8_t* out,
                        cudaStream_t s);

}  // namespace nb::cuda
