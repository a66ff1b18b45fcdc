// Top-k routing of one token by one warp, shared by the routing kernels (moe.cu) and the one-token MoE
// expert kernels that form their token's routes themselves (gemv_fp4_stream.cu, deferred routes).
#pragma once

#include <cstdint>

#include "kernels/common.cuh"

namespace nb::cuda {

inline constexpr int kMaxTopK = 32;
inline constexpr int kRouteRegExperts = 256;  // route_warp holds up to this many logits in registers

// n logits [n] (global, written by an earlier kernel: read through L2) into shared memory s by one warp,
// all of a lane's loads in flight at once for n <= kRouteRegExperts. (Against a load-then-store loop the
// norm_route kernel's last block measured the same, tenth session: the loop's loads were not the cost.)
__device__ inline void load_logits_warp(const float* logits, int n, float* s) {
  const int lane = threadIdx.x & 31;
  if (n <= kRouteRegExperts) {
    constexpr int kPer = kRouteRegExperts / 32;
    float v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[j] = lane + 32 * j < n ? __ldcg(logits + lane + 32 * j) : 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (lane + 32 * j < n) s[lane + 32 * j] = v[j];
  } else {
    for (int e = lane; e < n; e += 32) s[e] = __ldcg(logits + e);
  }
  __syncwarp();
}

// Top-k of one token's n_experts logits, held in shared memory s (overwritten), by one warp: k rounds of a
// warp argmax (ties to the lower id, as on the CPU; two redux.sync per round). Lane 0 writes ids [top_k]
// and weights [top_k] (global or shared memory): gpt-oss (softmax_first false) softmaxes the k chosen
// logits; qwen3_moe softmaxes all logits first and optionally renormalizes the k. Softmax statistics in
// fp32, as the references compute them. A round in which no logit left is above -inf (all NaN or -inf: a
// broken checkpoint or activation) takes the lowest id not chosen yet, with weight NaN -- the CPU ranks NaN
// with -inf -- so that ids stay in range and distinct: garbage out, never a read past the expert table.
__device__ inline void route_warp(float* s, int n_experts, int top_k, bool softmax_first, bool renormalize,
                                  int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int lane = threadIdx.x & 31;
  if (softmax_first) {
    float mx = -INFINITY;
    for (int e = lane; e < n_experts; e += 32) mx = fmaxf(mx, s[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < n_experts; e += 32) sum += (s[e] = expf(s[e] - mx));
    sum = warp_sum(sum);
    for (int e = lane; e < n_experts; e += 32) s[e] /= sum;
  }
  __syncwarp();
  // Floats as unsigned integers in the same order (-inf lowest), so that the warp's maximum is one redux.
  auto ordered = [](float f) {
    const uint32_t u = __float_as_uint(f);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
  };
  auto unordered = [](uint32_t k) { return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k); };
  // Chosen experts are marked with a NaN pattern no arithmetic produces (the GPU's NaN is 0x7fffffff): like
  // -inf it never wins a round, unlike -inf it tells a chosen expert from a logit.
  const float chosen = __uint_as_float(0xfffffffeu);
  auto is_chosen = [](float f) { return __float_as_uint(f) == 0xfffffffeu; };
  // The cold round: the lowest id whose value is not marked (first: the lane's, n_experts if none).
  auto pick_unchosen = [&](int i, int first) {
    const int who = static_cast<int>(__reduce_min_sync(0xffffffffu, static_cast<uint32_t>(first)));
    if (lane == 0) ids[i] = who, weights[i] = __uint_as_float(0x7fffffffu);
    return who;
  };
  // One round: the warp's largest value, then the lowest id holding it -- two redux.sync instead of five
  // dependent shuffle pairs (this runs on the decode step's critical path); (best, best_id): the lane's.
  auto pick = [&](int i, float best, int best_id) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, ordered(best));
    const int who = static_cast<int>(
        __reduce_min_sync(0xffffffffu, ordered(best) == top ? static_cast<uint32_t>(best_id) : 0xffffffffu));
    if (lane == 0) ids[i] = who, weights[i] = unordered(top);
    return who;
  };
  if (n_experts <= kRouteRegExperts) {
    // The lane's experts lane + 32 j in registers: the scans cost no shared-memory round trips.
    constexpr int kPer = kRouteRegExperts / 32;
    float v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[j] = lane + 32 * j < n_experts ? s[lane + 32 * j] : -INFINITY;
    for (int i = 0; i < top_k; ++i) {
      float best = -INFINITY;
      int best_id = n_experts;
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        if (v[j] > best) best = v[j], best_id = lane + 32 * j;  // ascending id: the first maximum wins
      int who = pick(i, best, best_id);
      if (who >= n_experts) {  // warp-uniform: every lane saw the same reductions
        int first = n_experts;
#pragma unroll
        for (int j = kPer - 1; j >= 0; --j)
          if (lane + 32 * j < n_experts && !is_chosen(v[j])) first = lane + 32 * j;
        who = pick_unchosen(i, first);
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        if (lane + 32 * j == who) v[j] = chosen;
    }
  } else {
    for (int i = 0; i < top_k; ++i) {
      float best = -INFINITY;
      int best_id = n_experts;
      for (int e = lane; e < n_experts; e += 32)
        if (s[e] > best) best = s[e], best_id = e;  // ascending e: the first maximum wins within a lane
      int who = pick(i, best, best_id);
      if (who >= n_experts) {  // warp-uniform, as above
        int first = n_experts;
        for (int e = lane; e < n_experts && first == n_experts; e += 32)
          if (!is_chosen(s[e])) first = e;
        who = pick_unchosen(i, first);
      }
      if (lane == who % 32) s[who] = chosen;  // (each lane scans only its own experts)
    }
  }
  if (lane != 0) return;  // lane 0 reads back only what it wrote
  if (!softmax_first) {
    const float m = weights[0];  // the largest
    float sum = 0.0f;
    for (int i = 0; i < top_k; ++i) sum += (weights[i] = expf(weights[i] - m));
    for (int i = 0; i < top_k; ++i) weights[i] /= sum;
  } else if (renormalize) {
    float sum = 0.0f;
    for (int i = 0; i < top_k; ++i) sum += weights[i];
    for (int i = 0; i < top_k; ++i) weights[i] /= sum;
  }
}

}  // namespace nb::cuda
