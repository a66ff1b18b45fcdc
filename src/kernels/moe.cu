// Router kernel: one warp per token, the token's logits in shared memory; top-k by k rounds of a warp
// argmax (ties to the lower id). Softmax statistics in fp32, as the references compute them.
#include "kernels/moe.cuh"

#include "backend/cuda/cuda_check.h"
#include "kernels/common.cuh"

namespace nb::cuda {
namespace {

constexpr int kMaxTopK = 32;

__global__ void route_kernel(const float* __restrict__ logits, int n_experts, int top_k, bool softmax_first,
                             bool renormalize, int32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  extern __shared__ float s[];  // [n_experts]
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const float* l = logits + t * n_experts;
  float mx = -INFINITY;
  for (int e = lane; e < n_experts; e += 32) mx = fmaxf(mx, s[e] = l[e]);
  mx = warp_max(mx);
  if (softmax_first) {
    float sum = 0.0f;
    for (int e = lane; e < n_experts; e += 32) sum += (s[e] = expf(s[e] - mx));
    sum = warp_sum(sum);
    for (int e = lane; e < n_experts; e += 32) s[e] /= sum;
  }
  __syncwarp();
  float w[kMaxTopK];
  int id[kMaxTopK];
  for (int i = 0; i < top_k; ++i) {
    float best = -INFINITY;
    int best_id = n_experts;
    for (int e = lane; e < n_experts; e += 32)
      if (s[e] > best) best = s[e], best_id = e;  // ascending e: the first maximum wins within a lane
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (ob > best || (ob == best && oi < best_id)) best = ob, best_id = oi;
    }
    w[i] = best;
    id[i] = best_id;
    __syncwarp();
    if (lane == 0) s[best_id] = -INFINITY;
    __syncwarp();
  }
  if (lane != 0) return;
  if (!softmax_first) {
    const float m = w[0];  // the largest
    float sum = 0.0f;
    for (int i = 0; i < top_k; ++i) sum += (w[i] = expf(w[i] - m));
    for (int i = 0; i < top_k; ++i) w[i] /= sum;
  } else if (renormalize) {
    float sum = 0.0f;
    for (int i = 0; i < top_k; ++i) sum += w[i];
    for (int i = 0; i < top_k; ++i) w[i] /= sum;
  }
  for (int i = 0; i < top_k; ++i) {
    ids[t * top_k + i] = id[i];
    weights[t * top_k + i] = w[i];
  }
}

}  // namespace

void launch_moe_route(const float* logits, int64_t n_tokens, int n_experts, int top_k, bool softmax_first,
                      bool renormalize, int32_t* ids, float* weights, cudaStream_t s) {
  NB_CHECK(top_k >= 1 && top_k <= kMaxTopK && top_k <= n_experts, "moe_route: top_k out of range");
  NB_CHECK(n_tokens >= 1 && n_experts <= 8192, "moe_route: shapes");
  launch_pdl(route_kernel, static_cast<unsigned>(n_tokens), 32, n_experts * sizeof(float), s, logits, n_experts, top_k, softmax_first, renormalize, ids, weights);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
