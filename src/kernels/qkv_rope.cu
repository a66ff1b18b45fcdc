// See qkv_rope.cuh. One block per (head, token) over the q, k and v heads: the head's vector goes to
// shared memory, the block sums its squares (q/k norm), then each thread rotates pairs (i, i + half)
// and stores them: q to q_out, k and v (v unrotated) encoded into the cache slot of the token's position.
#include "kernels/qkv_rope.cuh"

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"

namespace nb::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 512;

template <KvKind K>
__global__ void __launch_bounds__(kThreads) qkv_rope_kernel(const float* __restrict__ qkv, QkvRopeShape s,
                                                            DevBatch b, typename KvElem<K>::T* __restrict__ kc,
                                                            typename KvElem<K>::T* __restrict__ vc,
                                                            float* __restrict__ q_out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  __shared__ float x[kMaxHeadDim];
  __shared__ float partial[kThreads / 32];
  const int head = blockIdx.x, hd = s.head_dim, half = hd / 2;
  const int64_t t = blockIdx.y;
  const int n_all = s.n_heads + 2 * s.n_kv_heads;
  const float* src = qkv + (t * n_all + head) * hd;
  const bool is_q = head < s.n_heads, is_k = !is_q && head < s.n_heads + s.n_kv_heads, is_v = !is_q && !is_k;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hd; i += kThreads) {
    x[i] = src[i];
    ss += x[i] * x[i];
  }
  const float* norm = is_q ? s.q_norm : is_k ? s.k_norm : nullptr;
  float inv = 1.0f;
  if (norm) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < kThreads / 32; ++i) total += partial[i];
    inv = rsqrtf(total / static_cast<float>(hd) + s.eps);
  }
  __syncthreads();
  const int p = b.positions[t];
  using E = KvElem<K>;
  const int64_t slot = static_cast<int64_t>(b.tables[b.seq_of[t] * b.table_stride + p / kKvBlock]) * kKvBlock +
                       p % kKvBlock;
  if (is_v) {
    const int kvh = head - s.n_heads - s.n_kv_heads;
    for (int i = threadIdx.x; i < hd; i += kThreads) vc[(slot * s.n_kv_heads + kvh) * hd + i] = E::enc(x[i]);
    return;
  }
  for (int d = threadIdx.x; d < half; d += kThreads) {
    // rms_norm's expression, then rope's (norm_rope.cu), so the numbers match the separate ops.
    float x1 = x[d], x2 = x[d + half];
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
  const dim3 grid(s.n_heads + 2 * s.n_kv_heads, static_cast<unsigned>(b.n_tokens));
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
