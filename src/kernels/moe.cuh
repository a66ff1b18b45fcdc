// MoE routing on the device: per token, top-k experts and their weights, for both router kinds
// (gpt-oss: top-k of the logits, softmax over those k; qwen3_moe: softmax over all, top-k, optional
// renormalisation). Ties go to the lower expert id, as on the CPU. The expert projections are in gemv.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace nb::cuda {

// logits [n_tokens, n_experts] -> ids [n_tokens, top_k] I32, weights [n_tokens, top_k] F32.
void launch_moe_route(const float* logits, int64_t n_tokens, int n_experts, int top_k, bool softmax_first,
                      bool renormalize, int32_t* ids, float* weights, cudaStream_t s);

}  // namespace nb::cuda
