// Routing kernels. route: one warp per token, the token's logits in shared memory, top-k by route_warp
// (route.cuh).
// norm_route (decode): the residual add, RMSNorm, the BF16 router projection and the same top-k in one
// launch, so an MoE block's head is one kernel instead of three.
#include "kernels/moe.cuh"

#include "backend/cuda/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/route.cuh"
#include "kernels/stage.cuh"

namespace nb::cuda {
namespace {

__global__ void route_kernel(const float* __restrict__ logits, int n_experts, int top_k, bool softmax_first,
                             bool renormalize, int32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  extern __shared__ float s[];  // [n_experts]
  const int64_t t = blockIdx.x;
  load_logits_warp(logits + t * n_experts, n_experts, s);
  route_warp(s, n_experts, top_k, softmax_first, renormalize, ids + t * top_k, weights + t * top_k);
}

// ---- norm_route: add + RMSNorm + router + top-k, one launch (decode) ----
// Block (b, t): warp w computes the logit of expert 8 b + w for token t, its lanes striding over the
// BF16 row in 16-byte chunks held in registers. Every block forms the token's normalized row itself (d
// floats from L2 instead of a launch): thread i holds float4s i + 256 j of x + y, all loaded at once (the
// latency of one load, not d / 256 in a row); the router row and the norm weight, which do not depend on
// the previous kernel, are loaded before pdl_wait. Block 0 writes the row out as h. The last block of the
// token to arrive (an atomic count, which it resets) writes x + y back into x -- every block has read x
// by then -- and runs the top-k on the logits the others left in global memory.
// Deferred mode (x_out set, one token): no last block -- its fence, atomic, logits reload and top-k sat on
// the decode step's critical path -- block 0 writes x + y to x_out (another buffer: the other blocks still
// read x) and the logits are the output; the expert kernels select from them (gemv.cuh, RouteLogits).
constexpr int kNormRouteWarps = 8;
constexpr int kNormRouteThreads = kNormRouteWarps * 32;
constexpr int kNormRouteMaxVec = kNormRouteMaxDim / 4 / kNormRouteThreads;  // float4s per thread
static_assert(kNormRouteMaxVec * 4 * kNormRouteThreads == kNormRouteMaxDim);

__global__ void __launch_bounds__(kNormRouteThreads)
    norm_route_kernel(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ norm_w, int d,
                      float eps, const uint16_t* __restrict__ router, const float* __restrict__ bias, int n_experts,
                      int top_k, bool softmax_first, bool renormalize, float* __restrict__ h,
                      float* __restrict__ logits, int32_t* __restrict__ ids, float* __restrict__ weights,
                      unsigned* __restrict__ arrivals, float* __restrict__ x_out, uint4* __restrict__ staged_h) {
  extern __shared__ float sm[];  // hn [d] the normalized row, sl [n_experts] the logits (last block)
  float* hn = sm;
  float* sl = sm + d;
  __shared__ float partial[kNormRouteWarps];
  __shared__ bool last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, chunks = d / 8, vecs = d / 4;
  const int e = static_cast<int>(blockIdx.x) * kNormRouteWarps + warp;
  const int64_t t = blockIdx.y;
  uint4 wr[kNormRouteMaxChunks];  // this lane's chunks lane + 32 i of router row e
#pragma unroll
  for (int i = 0; i < kNormRouteMaxChunks; ++i) {
    const int c = lane + 32 * i;
    wr[i] = e < n_experts && c < chunks ? __ldg(reinterpret_cast<const uint4*>(router + static_cast<int64_t>(e) * d) + c)
                                        : make_uint4(0u, 0u, 0u, 0u);
  }
  float4 nw[kNormRouteMaxVec], sv[kNormRouteMaxVec];  // norm weight and x + y at float4 threadIdx.x + 256 j
#pragma unroll
  for (int j = 0; j < kNormRouteMaxVec; ++j) {
    const int v = threadIdx.x + kNormRouteThreads * j;
    nw[j] = v < vecs ? __ldg(reinterpret_cast<const float4*>(norm_w) + v) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  pdl_wait();  // x and y come from the previous kernels
  const float4* x4 = reinterpret_cast<const float4*>(x + t * d);
  const float4* y4 = y ? reinterpret_cast<const float4*>(y + t * d) : nullptr;
#pragma unroll
  for (int j = 0; j < kNormRouteMaxVec; ++j) {
    const int v = threadIdx.x + kNormRouteThreads * j;
    sv[j] = v < vecs ? x4[v] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if (y4) {
#pragma unroll
    for (int j = 0; j < kNormRouteMaxVec; ++j) {
      const int v = threadIdx.x + kNormRouteThreads * j;
      if (v < vecs) {
        const float4 b = y4[v];
        sv[j].x += b.x, sv[j].y += b.y, sv[j].z += b.z, sv[j].w += b.w;
      }
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormRouteMaxVec; ++j) ss += sv[j].x * sv[j].x + sv[j].y * sv[j].y + sv[j].z * sv[j].z + sv[j].w * sv[j].w;
  ss = warp_sum(ss);
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < kNormRouteWarps; ++i) total += partial[i];
  const float inv = rsqrtf(total / static_cast<float>(d) + eps);
#pragma unroll
  for (int j = 0; j < kNormRouteMaxVec; ++j) {
    const int v = threadIdx.x + kNormRouteThreads * j;
    if (v >= vecs) continue;
    const float4 o = make_float4(nw[j].x * (sv[j].x * inv), nw[j].y * (sv[j].y * inv), nw[j].z * (sv[j].z * inv),
                                 nw[j].w * (sv[j].w * inv));
    reinterpret_cast<float4*>(hn)[v] = o;
    if (blockIdx.x == 0) reinterpret_cast<float4*>(h + t * d)[v] = o;
    if (blockIdx.x == 0 && x_out) reinterpret_cast<float4*>(x_out + t * d)[v] = sv[j];
  }
  __syncthreads();
  if (staged_h && blockIdx.x == gridDim.x - 1) {  // the staging block (no experts of its own)
    // h as FC1 stages x (stage.cuh): its max |h| sets the prescale 2^s, as fp16_prescale_shift does there.
    float m = 0.0f;
    for (int i = threadIdx.x; i < d; i += kNormRouteThreads) m = fmaxf(m, fabsf(hn[i]));
    m = warp_max(m);
    if (lane == 0) partial[warp] = m;  // (every thread read the sums of squares before the barrier above)
    __syncthreads();
    for (int i = 0; i < kNormRouteWarps; ++i) m = fmaxf(m, partial[i]);
    const int sh = fp16_prescale_shift(m);
    stage_row_hi(hn, d, pow2f(sh), staged_h);
    if (threadIdx.x == 0) staged_h[hi_words(d)] = make_uint4(__float_as_uint(pow2f(-sh)), 0u, 0u, 0u);
    return;
  }
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormRouteMaxChunks; ++i) {
    const int c = lane + 32 * i;
    if (c >= chunks) break;
    const uint32_t v[4] = {wr[i].x, wr[i].y, wr[i].z, wr[i].w};
    const float4 a = reinterpret_cast<const float4*>(hn)[2 * c], b = reinterpret_cast<const float4*>(hn)[2 * c + 1];
    const float hv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc += __uint_as_float(v[q] << 16) * hv[2 * q];
      acc += __uint_as_float(v[q] & 0xffff0000u) * hv[2 * q + 1];
    }
  }
  acc = warp_sum(acc);
  if (lane == 0 && e < n_experts) {
    logits[t * n_experts + e] = acc + (bias ? bias[e] : 0.0f);
    if (!x_out) __threadfence();  // the logit is visible device-wide before this block's arrival counts
  }
  if (x_out) return;  // deferred: the top-k is the expert kernels'

  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&arrivals[t], 1u) == gridDim.x - 1;
    if (last) arrivals[t] = 0u;  // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (y) {
#pragma unroll
    for (int j = 0; j < kNormRouteMaxVec; ++j) {
      const int v = threadIdx.x + kNormRouteThreads * j;
      if (v < vecs) reinterpret_cast<float4*>(x + t * d)[v] = sv[j];
    }
  }
  if (warp != 0) return;
  load_logits_warp(logits + t * n_experts, n_experts, sl);
  route_warp(sl, n_experts, top_k, softmax_first, renormalize, ids + t * top_k, weights + t * top_k);
}

}  // namespace

void launch_moe_route(const float* logits, int64_t n_tokens, int n_experts, int top_k, bool softmax_first,
                      bool renormalize, int32_t* ids, float* weights, cudaStream_t s) {
  NB_CHECK(top_k >= 1 && top_k <= kMaxTopK && top_k <= n_experts, "moe_route: top_k out of range");
  NB_CHECK(n_tokens >= 1 && n_experts <= 8192, "moe_route: shapes");
  launch_pdl(route_kernel, static_cast<unsigned>(n_tokens), 32, n_experts * sizeof(float), s, logits, n_experts, top_k, softmax_first, renormalize, ids, weights);
  CUDA_CHECK(cudaGetLastError());
}

bool norm_route_supports(const DevWeight& router, int64_t n_tokens, int top_k) {
  return router.kind == WKind::kBF16 && router.n_parts == 1 && router.vec_ok && router.k % 8 == 0 &&
         router.k <= kNormRouteMaxDim && n_tokens >= 1 && n_tokens <= kNormRouteMaxTokens &&
         top_k >= 1 && top_k <= kMaxTopK && top_k <= router.n && router.n <= kNormRouteMaxExperts;
}

void launch_norm_route(float* x, const float* y, const float* norm_w, float eps, int64_t n_tokens,
                       const DevWeight& router, const float* bias, int top_k, bool softmax_first, bool renormalize,
                       float* h, float* logits, int32_t* ids, float* weights, unsigned* arrivals, float* x_out,
                       cudaStream_t s, void* staged_h) {
  NB_CHECK(norm_route_supports(router, n_tokens, top_k), "norm_route: unsupported router or shapes");
  NB_CHECK(!x_out || (n_tokens == 1 && x_out != x && !ids && !weights), "norm_route: deferred mode is for one token");
  NB_CHECK(!staged_h || (x_out && router.k % 32 == 0), "norm_route: staged h needs deferred mode and d % 32 == 0");
  const int d = router.k, n_experts = router.n;
  const unsigned blocks = (n_experts + kNormRouteWarps - 1) / kNormRouteWarps + (staged_h ? 1 : 0);
  const dim3 grid(blocks, static_cast<unsigned>(n_tokens));
  const size_t smem = (static_cast<size_t>(d) + n_experts) * sizeof(float);
  launch_pdl(norm_route_kernel, grid, kNormRouteThreads, smem, s, x, y, norm_w, d, eps,
             reinterpret_cast<const uint16_t*>(router.part[0].data), bias, n_experts, top_k, softmax_first,
             renormalize, h, logits, ids, weights, arrivals, x_out, static_cast<uint4*>(staged_h));
  CUDA_CHECK(cudaGetLastError());
}

size_t norm_route_staged_bytes(int d) { return size_t{16} * (hi_words(d) + 1); }

}  // namespace nb::cuda
