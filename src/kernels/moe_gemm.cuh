// MoE experts for many tokens (prefill) as grouped GEMMs on the tensor cores: the (token, choice) pairs are
// grouped by expert on the device (counts, offsets, a permutation; no padding), then one launch per
// projection runs every (expert, token tile, weight tile) of gemm_fp4_tile.cuh (or gemm_fp4_wgmma.cuh,
// gemm_fp4_wsp.cuh, gemm_fp4_wsr.cuh): FC1 with its bias and the GLU in the epilogue, FC2 with its bias and the routing weight,
// and a last kernel sums each token's top_k rows in choice order (deterministic; no float atomics). Decode
// sizes keep gemv.cuh's kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm_fp4.cuh"
#include "kernels/gemv.cuh"

namespace nb::cuda {

// What launch_moe_gemm takes: MXFP4/NVFP4 experts, d_model and d_expert multiples of 32 (the caller
// also checks that every expert's rows are 16-byte aligned).
bool moe_gemm_supports(const ExpertTable& t);

// Device scratch for n_pairs = n_tokens * top_k pairs (sizes from moe_gemm_scratch_*).
struct MoeGemmScratch {
  int32_t* offsets = nullptr;  // [n_experts + 1] first slot of each expert's rows
  int32_t* counts = nullptr;   // [n_experts] each expert's rows (the sm_90a register-fragment tile's slots are padded)
  int32_t* slot_of = nullptr;  // [n_pairs] the row (slot) of pair p = t * top_k + i
  int32_t* pair_of = nullptr;  // [n_pairs] the pair in slot s
  int2* tiles = nullptr;       // [moe_gemm_max_tiles] (expert, first row) of each token tile
  int32_t* n_tiles = nullptr;  // [1]
  GemmActivations x;           // [n_pairs, d_model] the tokens' rows in slot order
  float* act = nullptr;        // [n_pairs, d_expert] glu(fc1) in slot order
  GemmActivations a;           // [n_pairs, d_expert] act as fp16
  float* y_slot = nullptr;     // [n_pairs, d_model] weight * (fc2 + bias) per slot
};
int64_t moe_gemm_max_tiles(int64_t n_pairs, int n_experts);
// The scratch's size in bytes, and its pieces laid out in `buf` (256-byte aligned).
int64_t moe_gemm_scratch_bytes(const ExpertTable& t, int64_t n_pairs, GemmActs mode);
MoeGemmScratch moe_gemm_scratch_in(void* buf, const ExpertTable& t, int64_t n_pairs, GemmActs mode);

// y [n_tokens, d_model] = sum_i weights[t, i] * (fc2_e(glu(fc1_e(x[t]) + b1_e)) + b2_e), e = ids[t, i].
void launch_moe_gemm(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                     const float* x, Glu glu, float limit, GemmActs mode, const MoeGemmScratch& ws, float* y,
                     cudaStream_t s);

// BF16 experts at prefill (the backend groups the pairs on the host and runs each expert's FC1 and FC2 through
// cuBLASLt, gemm_dense.cuh); the two steps around those GEMMs:
// act [rows, d_expert] = glu of h [rows, 2 d_expert] (FC1's outputs, biases added) in `glu`'s layout.
void launch_moe_glu(const float* h, int64_t rows, int d_expert, Glu glu, float limit, float* act, cudaStream_t s);
// y [n_tokens, n] = sum over i in choice order of weights[t, i] * y_slot[slot_of[t * top_k + i]] (weights null: 1).
void launch_moe_combine(const float* y_slot, const int32_t* slot_of, const float* weights, int64_t n_tokens,
                        int top_k, int n, float* y, cudaStream_t s);

}  // namespace nb::cuda
