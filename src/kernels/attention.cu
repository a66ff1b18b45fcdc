// Attention kernels; see attention.cuh. A block of kWarps warps handles one (token, head, split): warps
// take keys in turn, each lane holds head_dim / 32 dims of q and of the output, a key's logit is a warp
// sum, and each warp keeps an online softmax (max, sum, weighted V). The block merges its warps into one
// partial (max, sum, out) per split; combine_splits merges the splits and adds the sink to the
// denominator (sink logits take part in the max, exactly as the reference softmax over [keys, sink]):
// in the last split block of each (token, head) to finish when AttnShape::arrivals is given (one launch),
// else in a second kernel.
// With skip_min_new, tokens of long new runs (prefill chunks) are left to the tiled kernel.
#include "kernels/attention.cuh"

#include "backend/cuda/cuda_check.h"
#include "backend/backend.h"

namespace nb::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerLane = kMaxHeadDim / 32;
static_assert(kMaxHeadDim % 32 == 0);

// Whether token t belongs to a sequence the tiled prefill kernel takes (AttnShape::skip_min_new).
__device__ __forceinline__ bool skipped(const DevBatch& b, const AttnShape& a, int64_t t) {
  if (a.skip_min_new <= 0) return false;
  const int s = b.seq_of[t];
  return a.seq_begin[s + 1] - a.seq_begin[s] >= a.skip_min_new;
}

template <KvKind K>
__global__ void kv_write_kernel(typename KvElem<K>::T* __restrict__ kc, typename KvElem<K>::T* __restrict__ vc,
                                const float* __restrict__ k, const float* __restrict__ v, DevBatch b, int row) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= b.n_tokens * row) return;
  const int64_t t = i / row, e = i % row;
  const int p = b.positions[t];
  const int64_t slot = static_cast<int64_t>(b.tables[b.seq_of[t] * b.table_stride + p / kKvBlock]) * kKvBlock +
                       p % kKvBlock;
  kc[slot * row + e] = KvElem<K>::enc(k[i]);
  vc[slot * row + e] = KvElem<K>::enc(v[i]);
}

// Merges the splits of (token, head) th into out, adding the sink to the denominator. Loads bypass L1:
// in the fused path the partials were written by other blocks of the same grid. Every load of a phase is
// issued at once -- the first warp's lanes read the splits' (max, sum) pairs, then each thread's output
// dims read all splits' partials in an unrolled loop -- so the merge costs two memory round trips rather
// than one per split (it runs in the last split block, on the decode step's critical path).
constexpr int kMaxSplits = 64;
__device__ void combine_splits(int64_t th, const float* __restrict__ ml, const float* __restrict__ po,
                               const AttnShape& a, float* __restrict__ out) {
  __shared__ float weight[kMaxSplits];  // exp(m_s - m) / l per split (0 for an empty split)
  const int h = static_cast<int>(th % a.n_heads), S = a.n_splits, hd = a.head_dim;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float ms[2], ls[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int sp = lane + 32 * j;
      ms[j] = sp < S ? __ldcg(ml + 2 * (th * S + sp)) : -INFINITY;
      ls[j] = sp < S ? __ldcg(ml + 2 * (th * S + sp) + 1) : 0.0f;
    }
    const float sink = a.sinks ? a.sinks[h] : -INFINITY;
    const float m = fmaxf(warp_max(fmaxf(ms[0], ms[1])), sink);
    float l = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) l += ms[j] == -INFINITY ? 0.0f : ls[j] * expf(ms[j] - m);
    l = warp_sum(l) + (a.sinks ? expf(sink - m) : 0.0f);  // the sink only adds to the denominator
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (lane + 32 * j < S) weight[lane + 32 * j] = ms[j] == -INFINITY ? 0.0f : expf(ms[j] - m) / l;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < S; ++sp) acc += __ldcg(po + (th * S + sp) * hd + d) * weight[sp];
    out[th * hd + d] = acc;
  }
}

// Partials: ml [n_tokens, n_heads, n_splits, 2] (max, sum); po [n_tokens, n_heads, n_splits, head_dim].
template <KvKind K>
__global__ void __launch_bounds__(kThreads) attention_kernel(const float* __restrict__ q,
                                                             const typename KvElem<K>::T* __restrict__ kc,
                                                             const typename KvElem<K>::T* __restrict__ vc, DevBatch b,
                                                             AttnShape a, float* __restrict__ ml,
                                                             float* __restrict__ po, float* __restrict__ attn_out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  using E = KvElem<K>;
  const int h = blockIdx.x, split = blockIdx.z;
  const int64_t t = blockIdx.y;
  if (skipped(b, a, t)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = a.head_dim, kvh = h / (a.n_heads / a.n_kv_heads), row = a.n_kv_heads * hd;
  const int pos = b.positions[t];
  const int first = a.window > 0 ? max(0, pos - a.window + 1) : 0;
  const int len = pos - first + 1, per = (len + a.n_splits - 1) / a.n_splits;
  const int begin = first + split * per, end = min(pos + 1, begin + per);
  const int32_t* table = b.tables + b.seq_of[t] * b.table_stride;

  float qv[kDimsPerLane], o[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < hd ? q[(t * a.n_heads + h) * hd + d] * a.scale : 0.0f;
    o[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  auto slot_of = [&](int kp) {  // element offset of key kp's head kvh in the paged cache
    return kp < end ? (static_cast<int64_t>(table[kp / kKvBlock]) * kKvBlock + kp % kKvBlock) * row + kvh * hd : 0;
  };
  int64_t next = slot_of(begin + warp);
  for (int kp = begin + warp; kp < end; kp += kWarps) {
    const int64_t base = next;
    // The key's and the value's loads and the next key's page lookup go out together: one round trip per
    // key, not three.
    next = slot_of(kp + kWarps);
    typename E::T kr[kDimsPerLane], vr[kDimsPerLane];
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) kr[i] = kc[base + d], vr[i] = vc[base + d];
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i)
      if (lane + 32 * i < hd) s += qv[i] * E::dec(kr[i]);
    s = warp_sum(s);
    const float m_new = fmaxf(m, s), corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i)
      if (lane + 32 * i < hd) o[i] = o[i] * corr + p * E::dec(vr[i]);
    m = m_new;
  }
  // Merge the warps of the block.
  __shared__ float sm[kWarps], sl[kWarps], so[kWarps][kMaxHeadDim];
  if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i)
    if (lane + 32 * i < hd) so[warp][lane + 32 * i] = o[i];
  __syncthreads();
  float bm = -INFINITY;
  for (int w = 0; w < kWarps; ++w) bm = fmaxf(bm, sm[w]);
  const int64_t out = (t * a.n_heads + h) * a.n_splits + split;
  if (threadIdx.x == 0) {
    float bl = 0.0f;
    for (int w = 0; w < kWarps; ++w) bl += sm[w] == -INFINITY ? 0.0f : sl[w] * expf(sm[w] - bm);
    ml[2 * out] = bm;
    ml[2 * out + 1] = bl;
  }
  for (int d = threadIdx.x; d < hd; d += kThreads) {
    float acc = 0.0f;
    for (int w = 0; w < kWarps; ++w) acc += sm[w] == -INFINITY ? 0.0f : so[w][d] * expf(sm[w] - bm);
    po[out * hd + d] = acc;
  }
  if (!a.arrivals) return;  // attention_combine_kernel follows
  // The last split of (token, head) to finish merges them all (its count reset for the next launch).
  __shared__ bool last;
  __threadfence();  // this block's partial is visible device-wide before it counts
  __syncthreads();
  const int64_t th = t * a.n_heads + h;
  if (threadIdx.x == 0) {
    last = atomicAdd(&a.arrivals[th], 1u) == static_cast<unsigned>(a.n_splits) - 1;
    if (last) a.arrivals[th] = 0u;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  combine_splits(th, ml, po, a, attn_out);
}

__global__ void attention_combine_kernel(const float* __restrict__ ml, const float* __restrict__ po, DevBatch b,
                                         AttnShape a, float* __restrict__ out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t th = blockIdx.x;  // token * n_heads + head
  if (skipped(b, a, th / a.n_heads)) return;
  combine_splits(th, ml, po, a, out);
}

template <KvKind K>
void attention_for(const float* q, const void* kc, const void* vc, const DevBatch& b, const AttnShape& a, float* ws,
                   float* out, cudaStream_t s) {
  using T = typename KvElem<K>::T;
  float* ml = ws;
  float* po = ws + b.n_tokens * a.n_heads * a.n_splits * 2;
  launch_pdl(attention_kernel<K>, dim3(a.n_heads, b.n_tokens, a.n_splits), kThreads, 0, s, q, static_cast<const T*>(kc), static_cast<const T*>(vc), b, a, ml, po, out);
  CUDA_CHECK(cudaGetLastError());
  if (a.arrivals) return;  // the splits combined themselves
  launch_pdl(attention_combine_kernel, b.n_tokens * a.n_heads, 64, 0, s, ml, po, b, a, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_kv_write(KvKind kind, void* kc, void* vc, const float* k, const float* v, const DevBatch& b,
                     int n_kv_heads, int head_dim, cudaStream_t s) {
  const int row = n_kv_heads * head_dim;
  const unsigned blocks = static_cast<unsigned>((b.n_tokens * row + 255) / 256);
  switch (kind) {
    case KvKind::kF32:
      launch_pdl(kv_write_kernel<KvKind::kF32>, blocks, 256, 0, s, static_cast<float*>(kc), static_cast<float*>(vc), k, v, b, row);
      break;
    case KvKind::kBF16:
      launch_pdl(kv_write_kernel<KvKind::kBF16>, blocks, 256, 0, s, static_cast<uint16_t*>(kc), static_cast<uint16_t*>(vc), k, v,
                                                            b, row);
      break;
    case KvKind::kFP8:
      launch_pdl(kv_write_kernel<KvKind::kFP8>, blocks, 256, 0, s, static_cast<uint8_t*>(kc), static_cast<uint8_t*>(vc), k, v,
                                                           b, row);
      break;
  }
  CUDA_CHECK(cudaGetLastError());
}

int64_t attention_workspace_floats(int64_t n_tokens, const AttnShape& a) {
  return n_tokens * a.n_heads * a.n_splits * (2 + a.head_dim);
}

void launch_attention(KvKind kind, const float* q, const void* kc, const void* vc, const DevBatch& b,
                      const AttnShape& a, float* ws, float* out, cudaStream_t s) {
  NB_CHECK(a.head_dim > 0 && a.head_dim <= kMaxHeadDim && a.n_kv_heads > 0 && a.n_heads % a.n_kv_heads == 0,
           "attention: head_dim must be <= 256 and heads a multiple of kv heads");
  NB_CHECK(a.n_splits >= 1 && a.n_splits <= kMaxSplits && b.n_tokens <= 65535, "attention: grid");
  NB_CHECK(a.skip_min_new <= 0 || a.seq_begin, "attention: skip_min_new needs seq_begin");
  switch (kind) {
    case KvKind::kF32:
      return attention_for<KvKind::kF32>(q, kc, vc, b, a, ws, out, s);
    case KvKind::kBF16:
      return attention_for<KvKind::kBF16>(q, kc, vc, b, a, ws, out, s);
    case KvKind::kFP8:
      return attention_for<KvKind::kFP8>(q, kc, vc, b, a, ws, out, s);
  }
}

}  // namespace nb::cuda
