// MoE routing on the device: per token, top-k experts and their weights, for both router kinds
// (gpt-oss: top-k of the logits, softmax over those k; qwen3_moe: softmax over all, top-k, optional
// renormalisation). Ties go to the lower expert id, as on the CPU. The expert projections are in gemv.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace nb::cuda {

// logits [n_tokens, n_experts] -> ids [n_tokens, top_k] I32, weights [n_tokens, top_k] F32.
void launch_moe_route(const float* logits, int64_t n_tokens, int n_experts, int top_k, bool softmax_first,
                      bool renormalize, int32_t* ids, float* weights, cudaStream_t s);

// An MoE block's head at decode, one launch: x [T, d] += y [T, d] in place (y null: no add), h [T, d] =
// rms_norm(x) * norm_w, logits [T, E] = router h + bias (router BF16 [E, d], bias [E] or null), then the
// routes as launch_moe_route. arrivals: kNormRouteMaxTokens zeroed counters (left zeroed).
// Deferred routes (x_out non-null, one token; ids and weights null): x + y goes to x_out instead of x, and
// the routes stay as the logits, which the one-token expert kernels select from (gemv.cuh, RouteLogits).
inline constexpr int kNormRouteMaxTokens = 16;
inline constexpr int kNormRouteMaxChunks = 16;  // 16-byte chunks (8 BF16) per lane of a router row
inline constexpr int kNormRouteMaxDim = kNormRouteMaxChunks * 8 * 32;  // d <= 4096
inline constexpr int kNormRouteMaxExperts = 4096;
bool norm_route_supports(const DevWeight& router, int64_t n_tokens, int top_k);
void launch_norm_route(float* x, const float* y, const float* norm_w, float eps, int64_t n_tokens,
                       const DevWeight& router, const float* bias, int top_k, bool softmax_first, bool renormalize,
                       float* h, float* logits, int32_t* ids, float* weights, unsigned* arrivals, float* x_out,
                       cudaStream_t s, void* staged_h = nullptr);
// staged_h (deferred mode, d % 32 == 0; optional): norm_route_staged_bytes(d) of device memory, where one more
// block writes h as the one-token FP4 FC1 kernel stages its x (stage.cuh: hi planes times 2^s, max |h| into
// [2^14, 2^15)), then 2^-s as the first float of one more 16-byte word; FC1 then copies them after its wait
// instead of taking h's maximum and converting it there (launch_moe_fc1_logits' staged_x).
size_t norm_route_staged_bytes(int d);

}  // namespace nb::cuda
