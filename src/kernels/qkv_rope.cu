// See qkv_rope.cuh. One warp per (token, head) over the q, k and v heads: the warp sums the head's squares
// (q/k norm), then each lane rotates pairs (i, i + half) and stores them: q to q_out, k and v (v unrotated)
// encoded into the cache slot of the token's position.
#include "kernels/qkv_rope.cuh"

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"

namespace nb::cuda {
namespace {

// One warp per (token, head): a prefill step has n_tokens x (n_heads + 2 n_kv_heads) of them (pp2048 of
// gpt-oss: 163,840), so a block per head (128 threads, two block barriers, 32 of them busy at head_dim 64)
// spent ~0.2 ms per layer on what is ~50 MB of traffic (measured, bench/NOTES.md). The q/k norm's sum of
// squares is a warp reduction; the lanes read their elements twice (the second time from L1).
constexpr int kWarps = 8;
constexpr int kMaxHeadDim = 512;

template <KvKind K>
__global__ void __launch_bounds__(kWarps * 32) qkv_rope_kernel(const float* __restrict__ qkv, QkvRopeShape s,
                                                               DevBatch b, typename KvElem<K>::T* __restrict__ kc,
                                                               typename KvElem<K>::T* __restrict__ vc,
                                                               float* __restrict__ q_out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int n_all = s.n_heads + 2 * s.n_kv_heads, lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= static_cast<int64_t>(n_all) * b.n_tokens) return;  // a whole warp
  const int head = static_cast<int>(item % n_all), hd = s.head_dim, half = hd / 2;
  const int64_t t = item / n_all;
  const float* src = qkv + (t * n_all + head) * hd;
  const bool is_q = head < s.n_heads, is_k = !is_q && head < s.n_heads + s.n_kv_heads, is_v = !is_q && !is_k;
  const float* norm = is_q ? s.q_norm : is_k ? s.k_norm : nullptr;
  float inv = 1.0f;
  if (norm) {
    float ss = 0.0f;
    for (int i = lane; i < hd; i += 32) ss += src[i] * src[i];
    inv = rsqrtf(warp_sum(ss) / static_cast<float>(hd) + s.eps);
  }
  const int p = b.positions[t];
  using E = KvElem<K>;
  const int64_t slot = static_cast<int64_t>(b.tables[b.seq_of[t] * b.table_stride + p / kKvBlock]) * kKvBlock +
                       p % kKvBlock;
  if (is_v) {
    const int kvh = head - s.n_heads - s.n_kv_heads;
    for (int i = lane; i < hd; i += 32) vc[(slot * s.n_kv_heads + kvh) * hd + i] = E::enc(src[i]);
    return;
  }
  for (int d = lane; d < half; d += 32) {
    // rms_norm's expression, then rope's (norm_rope.cu), so the numbers match the separate ops.
    float x1 = src[d], x2 = src[d + half];
    if (norm) x1 = norm[d] * (x1 * inv), x2 = norm[d + half] * (x2 * inv);
    const float angle = static_cast<float>(p) * s.inv_freq[d];
    float sn, cs;
    sincosf(angle, &sn, &cs);
    cs *= s.attention_scale;
    sn *= s.attention_scale;
    const float y1 = x1 * cs - x2 * sn, y2 = x2 * cs + x1 * sn;
    if (is_q) {
      float* o = q_out + (t * s.n_heads + head) * hd;
      o[d] = y1;
      o[d + half] = y2;
    } else {
      typename E::T* o = kc + (slot * s.n_kv_heads + (head - s.n_heads)) * hd;
      o[d] = E::enc(y1);
      o[d + half] = E::enc(y2);
    }
  }
}

}  // namespace

void launch_qkv_rope_kv_write(KvKind kind, const float* qkv, const QkvRopeShape& s, const DevBatch& b, void* k_cache,
                              void* v_cache, float* q_out, cudaStream_t stream) {
  NB_CHECK(s.head_dim % 2 == 0 && s.head_dim <= kMaxHeadDim && b.n_tokens >= 1 && b.n_tokens <= 65535,
           "qkv_rope_kv_write: head_dim " + std::to_string(s.head_dim) + " (even, <= 512), tokens " +
               std::to_string(b.n_tokens));
  // Decode steps (a few tokens): one warp per block, so the heads spread over as many SMs as before.
  const int64_t items = static_cast<int64_t>(s.n_heads + 2 * s.n_kv_heads) * b.n_tokens;
  const int warps = b.n_tokens <= 8 ? 1 : kWarps;
  const dim3 grid(ceil_div(items, warps));
  const int kThreads = warps * 32;
  switch (kind) {
    case KvKind::kF32:
      launch_pdl(qkv_rope_kernel<KvKind::kF32>, grid, kThreads, 0, stream, qkv, s, b, static_cast<float*>(k_cache),
                 static_cast<float*>(v_cache), q_out);
      break;
    case KvKind::kBF16:
      launch_pdl(qkv_rope_kernel<KvKind::kBF16>, grid, kThreads, 0, stream, qkv, s, b,
                 static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), q_out);
      break;
    case KvKind::kFP8:
      launch_pdl(qkv_rope_kernel<KvKind::kFP8>, grid, kThreads, 0, stream, qkv, s, b, static_cast<uint8_t*>(k_cache),
                 static_cast<uint8_t*>(v_cache), q_out);
      break;
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
