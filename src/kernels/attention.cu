// Attention kernels; see attention.cuh. A block of kWarps warps handles one (token, head, split): warps
// take keys in turn, each lane holds head_dim / 32 dims of q and of the output, a key's logit is a warp
// sum, and each warp keeps an online softmax (max, sum, weighted V). The block merges its warps into one
// partial (max, sum, out) per split; combine_splits merges the splits and adds the sink to the
// denominator (sink logits take part in the max, exactly as the reference softmax over [keys, sink]):
// in the last split block of each (token, head) to finish when AttnShape::arrivals is given (one launch),
// else in a second kernel.
// With skip_min_new, tokens of long new runs (prefill chunks) are left to the tiled kernel.
// attention_keys_kernel (below) takes the one-launch path for head_dim 64 and 128: lanes over keys, one
// round trip per 8 keys of a warp instead of one per key, and one split up to 128 keys.
#include "kernels/attention.cuh"

#include <algorithm>
#include <climits>
#include <cstring>

#include "backend/cuda/cuda_check.h"
#include "backend/backend.h"
#include "kernels/stage.cuh"

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
  const int s = __ldcg(b.seq_of + t);  // (through L2: the keys kernel reads it before its wait)
  return __ldcg(a.seq_begin + s + 1) - __ldcg(a.seq_begin + s) >= a.skip_min_new;
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

// The final values of (token, head) th -- v: dims lane + 32 i of the warp -- into out, and with
// a.stage_planes (one token: th is the head) as O's staged input: fp16 at 2^s, s from the head's max |v|
// (fp16_prescale_shift, as the linear kernel would take it for a row whose max this is), and s per group
// of 32 dims. Called by one warp; D >= head_dim / 32 (the caller's bound: registers).
template <int D>
__device__ void write_head(const AttnShape& a, int64_t th, const float (&v)[D], float* __restrict__ out) {
  const int lane = threadIdx.x & 31, hd = a.head_dim;
  float mx = 0.0f;
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (lane + 32 * i < hd) out[th * hd + lane + 32 * i] = v[i], mx = fmaxf(mx, fabsf(v[i]));
  if (!a.stage_planes) return;
  // (max |v| as one redux: non-negative floats order as their bits)
  const float head_max = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(mx)));
  const int s = fp16_prescale_shift(head_max), k = a.n_heads * hd, e0 = static_cast<int>(th) * hd;
  const float pre = pow2f(s);
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (lane + 32 * i < hd)
      a.stage_planes[staged_half(0, e0 + lane + 32 * i, k)] = __half_as_ushort(__float2half_rn(v[i] * pre));
  if (lane < hd / 32) a.stage_shifts[e0 / 32 + lane] = static_cast<int8_t>(s);
}

// Merges the splits of (token, head) th into out, adding the sink to the denominator. Loads bypass L1:
// in the fused path the partials were written by other blocks of the same grid. Every load of a phase is
// issued at once -- the first warp's lanes read the splits' (max, sum) pairs, then each thread's output
// dims read all splits' partials in an unrolled loop -- so the merge costs two memory round trips rather
// than one per split (it runs in the last split block, on the decode step's critical path).
constexpr int kMaxSplits = 64;
// S splits (0 .. S - 1) of the a.n_splits slots per (token, head) hold partials. D: as write_head's.
template <int D = kDimsPerLane>
__device__ void combine_splits(int64_t th, const float* __restrict__ ml, const float* __restrict__ po,
                               const AttnShape& a, int S, float* __restrict__ out) {
  __shared__ float weight[kMaxSplits];  // exp(m_s - m) / l per split (0 for an empty split)
  const int h = static_cast<int>(th % a.n_heads), stride = a.n_splits, hd = a.head_dim;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float ms[2], ls[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int sp = lane + 32 * j;
      ms[j] = sp < S ? __ldcg(ml + 2 * (th * stride + sp)) : -INFINITY;
      ls[j] = sp < S ? __ldcg(ml + 2 * (th * stride + sp) + 1) : 0.0f;
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
  if (a.stage_planes) {  // one warp takes every dim: the head's max is a warp max (write_head)
    if (threadIdx.x >= 32) return;
    float v[D];
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int d = threadIdx.x + 32 * i;
      float acc = 0.0f;
      if (d < hd) {
#pragma unroll 8
        for (int sp = 0; sp < S; ++sp) acc += __ldcg(po + (th * stride + sp) * hd + d) * weight[sp];
      }
      v[i] = acc;
    }
    write_head(a, th, v, out);
    return;
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < S; ++sp) acc += __ldcg(po + (th * stride + sp) * hd + d) * weight[sp];
    out[th * hd + d] = acc;
  }
}

// Each of a block's W warps' online-softmax state after its keys: max, sum and unnormalized output over the
// head's dims; w the warps' factors to a common max (finish_split).
template <int W>
struct WarpParts {
  float m[W], l[W], o[W][kMaxHeadDim], w[W];
};

// After the block's warps filled `parts` (and a barrier): the split's partial -- the warps merged to one
// (max, sum, out) -- goes to ml / po, and with arrivals the last of the n_live splits of (token, head) to
// finish merges them all. A split that is the only one writes the final output itself (the sink joins the
// max and the denominator here): no partial, fence or arrival. sink: a.sinks[h] (loaded early by the
// caller) or -inf.
template <int W, int D = kDimsPerLane>
__device__ void finish_split(WarpParts<W>& parts, int64_t t, int h, int split, int n_live, float sink,
                             const AttnShape& a, float* __restrict__ ml, float* __restrict__ po,
                             float* __restrict__ attn_out) {
  const int hd = a.head_dim;
  const int64_t th = t * a.n_heads + h;
  const bool direct = n_live == 1 && a.arrivals;
  float bm = -INFINITY;
  for (int w = 0; w < W; ++w) bm = fmaxf(bm, parts.m[w]);
  if (direct) bm = fmaxf(bm, sink);
  if (threadIdx.x < W) parts.w[threadIdx.x] = parts.m[threadIdx.x] == -INFINITY ? 0.0f : expf(parts.m[threadIdx.x] - bm);
  __syncthreads();
  float bl = direct && a.sinks ? expf(sink - bm) : 0.0f;  // the sink only adds to the denominator
  for (int w = 0; w < W; ++w) bl += parts.l[w] * parts.w[w];
  const int64_t out = th * a.n_splits + split;
  if (direct && a.stage_planes) {  // one warp takes every dim, as in combine_splits
    if (threadIdx.x >= 32) return;
    float v[D];
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int d = threadIdx.x + 32 * i;
      float acc = 0.0f;
      if (d < hd)
        for (int w = 0; w < W; ++w) acc += parts.o[w][d] * parts.w[w];
      v[i] = acc / bl;
    }
    write_head(a, th, v, attn_out);
    return;
  }
  for (int d = threadIdx.x; d < hd; d += W * 32) {
    float acc = 0.0f;
    for (int w = 0; w < W; ++w) acc += parts.o[w][d] * parts.w[w];
    if (direct)
      attn_out[th * hd + d] = acc / bl;
    else
      po[out * hd + d] = acc;
  }
  if (direct) return;
  if (threadIdx.x == 0) ml[2 * out] = bm, ml[2 * out + 1] = bl;
  if (!a.arrivals) return;  // attention_combine_kernel follows
  // The last split of (token, head) to finish merges them all (its count reset for the next launch).
  __shared__ bool last;
  __threadfence();  // this block's partial is visible device-wide before it counts
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&a.arrivals[th], 1u) == static_cast<unsigned>(n_live) - 1;
    if (last) a.arrivals[th] = 0u;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  combine_splits<D>(th, ml, po, a, n_live, attn_out);
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
  __shared__ WarpParts<kWarps> parts;
  if (lane == 0) parts.m[warp] = m, parts.l[warp] = l;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i)
    if (lane + 32 * i < hd) parts.o[warp][lane + 32 * i] = o[i];
  __syncthreads();
  finish_split(parts, t, h, split, a.n_splits, a.sinks ? a.sinks[h] : -INFINITY, a, ml, po, attn_out);
}

__global__ void attention_combine_kernel(const float* __restrict__ ml, const float* __restrict__ po, DevBatch b,
                                         AttnShape a, float* __restrict__ out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t th = blockIdx.x;  // token * n_heads + head
  if (skipped(b, a, th / a.n_heads)) return;
  combine_splits(th, ml, po, a, a.n_splits, out);
}

// ---- Decode attention with the lanes over keys (head_dim 64 or 128, the one-launch path) ----
// The kernel above walks a warp's keys one after another: one dependent round trip per key (page entry
// and K/V loads, then a warp sum), and its last split block merges the others (fence, arrival, two more
// round trips), which at decode is most of the layer's attention time (H200, tg128: ~7.9 us per layer at
// contexts <= 130) and grows by a round trip per key at long contexts. Here four lanes take a key (each a
// quarter of its K row), a warp 8 keys at once and a block of 16 warps 128: page entries, K rows and --
// lanes over dims, the slots broadcast by shuffles -- the V rows load together, one round trip per 8 keys
// of a warp. A split covers at least kSplitKeys keys, so that contexts up to that take one split, whose
// block writes the final output itself (finish_split); longer ones use as many of the n_splits slots as
// they fill, decided per (token, head) in the kernel so that a captured decode graph stays right as the
// context grows. The blocks of the other slots see that before waiting for the previous kernel, and exit.
constexpr int kKeyWarps = 16, kKeyLanes = 4, kWarpKeys = 32 / kKeyLanes;
constexpr int kSplitKeys = kKeyWarps * kWarpKeys;

template <class T, int N>
struct alignas(sizeof(T) * N) Elems {
  T e[N];
};
// Element i of cache elements held as 16-byte words (i a compile-time constant once unrolled).
__device__ __forceinline__ uint32_t word_of(const uint4& w, int c) {
  return c == 0 ? w.x : c == 1 ? w.y : c == 2 ? w.z : w.w;
}
// N elements of type T (2, 4, 8 or 16 bytes together, aligned so) as one load through L2.
template <class T, int N>
__device__ __forceinline__ Elems<T, N> load_elems(const T* p) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  Elems<T, N> r;
  if constexpr (kBytes == 2) {
    const unsigned short v = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&r, &v, 2);
  } else if constexpr (kBytes == 4) {
    const unsigned v = __ldcg(reinterpret_cast<const unsigned*>(p));
    memcpy(&r, &v, 4);
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    memcpy(&r, &v, 8);
  } else {
    static_assert(kBytes == 16);
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    memcpy(&r, &v, 16);
  }
  return r;
}
template <KvKind K>
__device__ __forceinline__ float word_elem(const uint4* w, int i) {
  if constexpr (K == KvKind::kF32) {
    return __uint_as_float(word_of(w[i / 4], i % 4));
  } else if constexpr (K == KvKind::kBF16) {
    const uint32_t x = word_of(w[i / 8], (i % 8) / 2);
    return __uint_as_float(i % 2 ? x & 0xffff0000u : x << 16);
  } else {
    return KvElem<K>::dec(static_cast<uint8_t>(word_of(w[i / 16], (i % 16) / 4) >> (8 * (i % 4))));
  }
}

template <KvKind K, int HD>
__global__ void __launch_bounds__(kKeyWarps * 32) attention_keys_kernel(const float* __restrict__ q,
                                                                        const typename KvElem<K>::T* __restrict__ kc,
                                                                        const typename KvElem<K>::T* __restrict__ vc,
                                                                        DevBatch b, AttnShape a, float* __restrict__ ml,
                                                                        float* __restrict__ po,
                                                                        float* __restrict__ attn_out) {
  using E = KvElem<K>;
  using T = typename E::T;
  constexpr int kDims = HD / 32;                                 // V dims per lane
  constexpr int kKDims = HD / kKeyLanes;                         // K dims per lane
  constexpr int kKWords = kKDims * static_cast<int>(sizeof(T)) / 16;  // ... in 16-byte words
  static_assert(kKWords >= 1 && kKDims * sizeof(T) % 16 == 0);
  // Before the wait: the batch metadata (uploaded before the step's first kernel; through L2, see pdl_wait)
  // says which splits have keys, and the others exit at once -- at short contexts nearly all of the grid.
  const int h = blockIdx.x, split = blockIdx.z;
  const int64_t t = blockIdx.y;
  if (skipped(b, a, t)) return;
  const int pos = __ldcg(b.positions + t);
  const int first = a.window > 0 ? max(0, pos - a.window + 1) : 0;
  const int len = pos - first + 1, per = max(kSplitKeys, (len + a.n_splits - 1) / a.n_splits);
  const int n_live = (len + per - 1) / per;
  if (split >= n_live) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, key = lane / kKeyLanes, part = lane % kKeyLanes;
  const int kvh = h / (a.n_heads / a.n_kv_heads), row = a.n_kv_heads * HD;
  const int begin = first + split * per, end = min(pos + 1, begin + per);
  const int32_t* table = b.tables + __ldcg(b.seq_of + t) * b.table_stride;
  auto slot_of = [&](int c) {  // the cache slot of the lane's key in the chunk from c (0 past the end)
    const int kp = c + key;
    return kp < end ? __ldcg(table + kp / kKvBlock) * kKvBlock + kp % kKvBlock : 0;
  };
  // A chunk's K quarters (lanes over keys) and V dims (lanes over dims) into kr / vr: keys c + j in [lo, hi)
  // of those the chunk has, at the lanes' slots. Through L2: the first chunk may load before the wait.
  uint4 kr[kKWords];
  Elems<T, kDims> vr[kWarpKeys];
  auto load_chunk = [&](int c, int slot, int lo, int hi) {
    const int n = min(kWarpKeys, end - c);
    if (key < n && c + key >= lo && c + key < hi) {
      const uint4* src = reinterpret_cast<const uint4*>(kc + static_cast<int64_t>(slot) * row + kvh * HD + part * kKDims);
#pragma unroll
      for (int w = 0; w < kKWords; ++w) kr[w] = __ldcg(src + w);
    }
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j) {
      const int sj = __shfl_sync(0xffffffffu, slot, j * kKeyLanes);
      if (j < n && c + j >= lo && c + j < hi)
        vr[j] = load_elems<T, kDims>(vc + static_cast<int64_t>(sj) * row + kvh * HD + lane * kDims);
    }
  };
  const int c0 = begin + kWarpKeys * warp;
  int slot = slot_of(c0);
  // One new token in the step (batch-1 decode): every key but the newest was cached by earlier steps, so
  // the warp's first chunk loads before the wait and only the newest key (written by qkv_rope) after it.
  const bool early = b.n_tokens == 1 && c0 < end;
  if (early) load_chunk(c0, slot, INT_MIN, pos);
  const float sink = a.sinks ? a.sinks[h] : -INFINITY;  // (a weight)
  pdl_wait();  // q and the newest key and value come from the previous kernels
  if (early) load_chunk(c0, slot, pos, pos + 1);
  else if (c0 < end) load_chunk(c0, slot, INT_MIN, INT_MAX);
  __shared__ __align__(16) float qs[HD];
  if (threadIdx.x < HD) qs[threadIdx.x] = q[(t * a.n_heads + h) * HD + threadIdx.x] * a.scale;
  __syncthreads();

  float m = -INFINITY, l = 0.0f, o[kDims] = {};
  for (int c = c0; c < end; c += kSplitKeys) {
    const int n = min(kWarpKeys, end - c);  // keys c .. c + n - 1; lanes 4j .. 4j + 3 hold key c + j
    const bool live = key < n;
    const bool more = c + kSplitKeys < end;
    const int next_slot = more ? slot_of(c + kSplitKeys) : 0;  // (its round trip under this chunk's math)
    float s = 0.0f;
    if (live) {
#pragma unroll
      for (int i = 0; i < kKDims; i += 4) {
        const float4 qq = *reinterpret_cast<const float4*>(qs + part * kKDims + i);
        s += qq.x * word_elem<K>(kr, i) + qq.y * word_elem<K>(kr, i + 1) + qq.z * word_elem<K>(kr, i + 2) +
             qq.w * word_elem<K>(kr, i + 3);
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);  // the key's four quarters
    if (!live) s = -INFINITY;
    const float m_new = fmaxf(m, warp_max(s)), corr = expf(m - m_new);
    const float p = live ? expf(s - m_new) : 0.0f;
    l = l * corr + warp_sum(part == 0 ? p : 0.0f);
#pragma unroll
    for (int e = 0; e < kDims; ++e) o[e] *= corr;
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j * kKeyLanes);
      if (j < n) {
#pragma unroll
        for (int e = 0; e < kDims; ++e) o[e] += pj * E::dec(vr[j].e[e]);
      }
    }
    m = m_new;
    if (more) slot = next_slot, load_chunk(c + kSplitKeys, slot, INT_MIN, INT_MAX);
  }
  __shared__ WarpParts<kKeyWarps> parts;
  if (lane == 0) parts.m[warp] = m, parts.l[warp] = l;
#pragma unroll
  for (int e = 0; e < kDims; ++e) parts.o[warp][lane * kDims + e] = o[e];
  __syncthreads();
  finish_split<kKeyWarps, kDims>(parts, t, h, split, n_live, sink, a, ml, po, attn_out);
}

// ---- Decode attention over long contexts: one block per (KV head, split) for all of the group's query heads ----
// The kernel above gives each query head its own blocks, so each K/V row of a group is read by `group` blocks
// (8 for gpt-oss: at a 16K context ~270 MB per layer from L2 for 33.5 MB of cache), and its ~1000 blocks of
// short walks run in waves. Here a block takes a KV head's split for every query head of its group: the same
// chunk loads as the keys kernel (four lanes per key for K, lanes over dims for V, 8 keys per warp), each key
// decoded once and dotted with the group's q rows from shared memory; the chunk's weights go through shared
// memory (one broadcast read per key and 4 heads) instead of a shuffle per key and head. Warp g merges query
// head g: its split's partial (or, for a context of one split, the output), then, if it is the last split to
// arrive, every split's partial -- warp-level, so that the group's heads merge side by side.
constexpr int kGroupWarps = 8, kMaxGroup = 8;
constexpr int kGroupSplitKeys = kGroupWarps * kWarpKeys;  // a split's least keys (one chunk per warp)

// Warp-level combine_splits for (token, head) th: S splits' partials merged into out (and staged, write_head).
template <int D>
__device__ void warp_combine(int64_t th, const float* __restrict__ ml, const float* __restrict__ po,
                             const AttnShape& a, int S, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, h = static_cast<int>(th % a.n_heads), stride = a.n_splits, hd = a.head_dim;
  float ms[2], ls[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int sp = lane + 32 * j;
    ms[j] = sp < S ? __ldcg(ml + 2 * (th * stride + sp)) : -INFINITY;
    ls[j] = sp < S ? __ldcg(ml + 2 * (th * stride + sp) + 1) : 0.0f;
  }
  const float sink = a.sinks ? a.sinks[h] : -INFINITY;
  const float m = fmaxf(warp_max(fmaxf(ms[0], ms[1])), sink);
  float l = 0.0f;
#pragma unroll
  for (int j = 0; j < 2; ++j) l += ms[j] == -INFINITY ? 0.0f : ls[j] * expf(ms[j] - m);
  l = warp_sum(l) + (a.sinks ? expf(sink - m) : 0.0f);  // the sink only adds to the denominator
  float wt[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) wt[j] = ms[j] == -INFINITY ? 0.0f : expf(ms[j] - m) / l;
  float v[D] = {};
#pragma unroll 4
  for (int sp = 0; sp < S; ++sp) {
    const float w = __shfl_sync(0xffffffffu, sp < 32 ? wt[0] : wt[1], sp & 31);
#pragma unroll
    for (int i = 0; i < D; ++i) v[i] += __ldcg(po + (th * stride + sp) * hd + lane + 32 * i) * w;
  }
  write_head(a, th, v, out);
}

template <KvKind K, int HD>
__global__ void __launch_bounds__(kGroupWarps * 32) attention_group_kernel(const float* __restrict__ q,
                                                                          const typename KvElem<K>::T* __restrict__ kc,
                                                                          const typename KvElem<K>::T* __restrict__ vc,
                                                                          DevBatch b, AttnShape a, float* __restrict__ ml,
                                                                          float* __restrict__ po,
                                                                          float* __restrict__ attn_out) {
  using E = KvElem<K>;
  using T = typename E::T;
  constexpr int kDims = HD / 32;                                      // V dims per lane
  constexpr int kKDims = HD / kKeyLanes;                              // K dims per lane
  constexpr int kKWords = kKDims * static_cast<int>(sizeof(T)) / 16;  // ... in 16-byte words
  static_assert(kKWords >= 1 && kKDims * sizeof(T) % 16 == 0);
  // Before the wait, as the keys kernel: splits without keys exit.
  const int kvh = blockIdx.x, split = blockIdx.z;
  const int64_t t = blockIdx.y;
  if (skipped(b, a, t)) return;
  const int pos = __ldcg(b.positions + t);
  const int first = a.window > 0 ? max(0, pos - a.window + 1) : 0;
  const int len = pos - first + 1, per = max(kGroupSplitKeys, (len + a.n_splits - 1) / a.n_splits);
  const int n_live = (len + per - 1) / per;
  if (split >= n_live) return;
  const int group = a.n_heads / a.n_kv_heads, h0 = kvh * group;  // query heads h0 .. h0 + group - 1
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, key = lane / kKeyLanes, part = lane % kKeyLanes;
  const int row = a.n_kv_heads * HD;
  const int begin = first + split * per, end = min(pos + 1, begin + per);
  const int32_t* table = b.tables + __ldcg(b.seq_of + t) * b.table_stride;
  // (The chunk loads repeat the keys kernel's: the two sharing one struct changed the keys kernel's SASS, the
  // tg128 path's, which this session could not measure.)
  auto slot_of = [&](int c) {
    const int kp = c + key;
    return kp < end ? __ldcg(table + kp / kKvBlock) * kKvBlock + kp % kKvBlock : 0;
  };
  uint4 kr[kKWords];
  Elems<T, kDims> vr[kWarpKeys];
  auto load_chunk = [&](int c, int slot, int lo, int hi) {
    const int n = min(kWarpKeys, end - c);
    if (key < n && c + key >= lo && c + key < hi) {
      const uint4* src = reinterpret_cast<const uint4*>(kc + static_cast<int64_t>(slot) * row + kvh * HD + part * kKDims);
#pragma unroll
      for (int w = 0; w < kKWords; ++w) kr[w] = __ldcg(src + w);
    }
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j) {
      const int sj = __shfl_sync(0xffffffffu, slot, j * kKeyLanes);
      if (j < n && c + j >= lo && c + j < hi)
        vr[j] = load_elems<T, kDims>(vc + static_cast<int64_t>(sj) * row + kvh * HD + lane * kDims);
    }
  };
  const int c0 = begin + kWarpKeys * warp;
  int slot = slot_of(c0);
  const bool early = b.n_tokens == 1 && c0 < end;
  if (early) load_chunk(c0, slot, INT_MIN, pos);
  pdl_wait();  // q and the newest key and value come from the previous kernels
  if (early) load_chunk(c0, slot, pos, pos + 1);
  else if (c0 < end) load_chunk(c0, slot, INT_MIN, INT_MAX);
  __shared__ __align__(16) float qs[kMaxGroup][HD];
  __shared__ __align__(16) float pw[kGroupWarps][kWarpKeys][kMaxGroup];  // a chunk's weights: key j, head g
  for (int i = threadIdx.x; i < group * HD; i += kGroupWarps * 32)
    qs[i / HD][i % HD] = q[(t * a.n_heads + h0) * HD + i] * a.scale;
  __syncthreads();

  float m[kMaxGroup], l[kMaxGroup], o[kMaxGroup][kDims];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kDims; ++e) o[g][e] = 0.0f;
  }
  for (int c = c0; c < end; c += kGroupSplitKeys) {
    const int n = min(kWarpKeys, end - c);  // keys c .. c + n - 1; lanes 4j .. 4j + 3 hold key c + j
    const bool live = key < n;
    const bool more = c + kGroupSplitKeys < end;
    const int next_slot = more ? slot_of(c + kGroupSplitKeys) : 0;  // (its round trip under this chunk's math)
    float kf[kKDims];  // the lane's quarter of the key, decoded once for every head
#pragma unroll
    for (int i = 0; i < kKDims; ++i) kf[i] = word_elem<K>(kr, i);
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kKDims; i += 4) {
        const float4 qq = *reinterpret_cast<const float4*>(&qs[g][part * kKDims + i]);
        s += qq.x * kf[i] + qq.y * kf[i + 1] + qq.z * kf[i + 2] + qq.w * kf[i + 3];
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);  // the key's four quarters
      if (!live) s = -INFINITY;
      // Max and sum over the warp's 8 keys (the four lanes of a key hold the same values).
      float mx = s;
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
      const float m_new = fmaxf(m[g], mx), corr = expf(m[g] - m_new);
      const float p = live ? expf(s - m_new) : 0.0f;
      float ps = p;
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, x);
      l[g] = l[g] * corr + ps;
      m[g] = m_new;
#pragma unroll
      for (int e = 0; e < kDims; ++e) o[g][e] *= corr;
      if (part == 0) pw[warp][key][g] = p;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j) {
      if (j < n) {
        float vj[kDims];
#pragma unroll
        for (int e = 0; e < kDims; ++e) vj[e] = E::dec(vr[j].e[e]);
#pragma unroll
        for (int g4 = 0; g4 < kMaxGroup; g4 += 4) {
          if (g4 >= group) break;
          const float4 p4 = *reinterpret_cast<const float4*>(&pw[warp][j][g4]);
          const float pj[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
          for (int gg = 0; gg < 4; ++gg)
#pragma unroll
            for (int e = 0; e < kDims; ++e) o[g4 + gg][e] += pj[gg] * vj[e];
        }
      }
    }
    __syncwarp();  // pw is rewritten by the next chunk
    if (more) slot = next_slot, load_chunk(c + kGroupSplitKeys, slot, INT_MIN, INT_MAX);
  }
  // The block's warps merged per query head: warp g takes head g.
  __shared__ float wm[kGroupWarps][kMaxGroup], wl[kGroupWarps][kMaxGroup];
  __shared__ __align__(16) float wo[kGroupWarps][kMaxGroup][HD];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (lane == 0) wm[warp][g] = m[g], wl[warp][g] = l[g];
#pragma unroll
    for (int e = 0; e < kDims; ++e) wo[warp][g][lane * kDims + e] = o[g][e];
  }
  __syncthreads();
  if (warp >= group) return;
  const int h = h0 + warp;
  const int64_t th = t * a.n_heads + h;
  const bool direct = n_live == 1;
  const float sink = a.sinks ? a.sinks[h] : -INFINITY;
  float bm = direct ? sink : -INFINITY;
#pragma unroll
  for (int w = 0; w < kGroupWarps; ++w) bm = fmaxf(bm, wm[w][warp]);
  float ww = 0.0f;  // lane w < kGroupWarps: warp w's factor to the common max
  if (lane < kGroupWarps) ww = wm[lane][warp] == -INFINITY ? 0.0f : expf(wm[lane][warp] - bm);
  float bl = lane < kGroupWarps ? wl[lane][warp] * ww : 0.0f;
  bl = warp_sum(bl) + (direct && a.sinks ? expf(sink - bm) : 0.0f);  // the sink only adds to the denominator
  float v[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kGroupWarps; ++w) acc += wo[w][warp][lane + 32 * i] * __shfl_sync(0xffffffffu, ww, w);
    v[i] = acc;
  }
  if (direct) {
#pragma unroll
    for (int i = 0; i < kDims; ++i) v[i] /= bl;
    write_head(a, th, v, attn_out);
    return;
  }
  const int64_t out = th * a.n_splits + split;
#pragma unroll
  for (int i = 0; i < kDims; ++i) po[out * HD + lane + 32 * i] = v[i];
  if (lane == 0) ml[2 * out] = bm, ml[2 * out + 1] = bl;
  // The last split of (token, head) to finish merges them all (its count reset for the next launch).
  __threadfence();  // this warp's partial is visible device-wide before it counts
  __syncwarp();
  unsigned last = 0;
  if (lane == 0) {
    last = atomicAdd(&a.arrivals[th], 1u) == static_cast<unsigned>(n_live) - 1;
    if (last) a.arrivals[th] = 0u;
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  warp_combine<kDims>(th, ml, po, a, n_live, attn_out);
}

// NIBBLE_ATTN_KEYS=0 keeps decode on the key-by-key kernel (a measurement knob).
bool keys_kernel_enabled() {
  static const bool on = knob_on("NIBBLE_ATTN_KEYS");
  return on;
}

template <KvKind K>
void attention_for(const float* q, const void* kc, const void* vc, const DevBatch& b, const AttnShape& a, float* ws,
                   float* out, cudaStream_t s) {
  using T = typename KvElem<K>::T;
  float* ml = ws;
  float* po = ws + b.n_tokens * a.n_heads * a.n_splits * 2;
  if (a.grouped) {  // (attention_group_ok)
    auto kernel = a.head_dim == 64 ? attention_group_kernel<K, 64> : attention_group_kernel<K, 128>;
    launch_pdl(kernel, dim3(a.n_kv_heads, b.n_tokens, a.n_splits), kGroupWarps * 32, 0, s, q, static_cast<const T*>(kc),
               static_cast<const T*>(vc), b, a, ml, po, out);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  const dim3 grid(a.n_heads, b.n_tokens, a.n_splits);
  if (a.arrivals && keys_kernel_enabled() && (a.head_dim == 64 || a.head_dim == 128)) {
    auto kernel = a.head_dim == 64 ? attention_keys_kernel<K, 64> : attention_keys_kernel<K, 128>;
    launch_pdl(kernel, grid, kKeyWarps * 32, 0, s, q, static_cast<const T*>(kc), static_cast<const T*>(vc), b, a, ml, po, out);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  launch_pdl(attention_kernel<K>, grid, kThreads, 0, s, q, static_cast<const T*>(kc), static_cast<const T*>(vc), b, a, ml, po, out);
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

bool attention_group_ok(const AttnShape& a) {
  const int group = a.n_kv_heads > 0 ? a.n_heads / a.n_kv_heads : 0;
  return a.arrivals && (a.head_dim == 64 || a.head_dim == 128) && group >= 2 && group <= kMaxGroup &&
         a.n_heads % a.n_kv_heads == 0;
}

int attention_group_blocks_per_sm(KvKind kind, int head_dim) {
  static int known[3][2] = {};  // per kind and head_dim (the process's one device)
  int& n = known[static_cast<int>(kind)][head_dim == 64 ? 0 : 1];
  if (n > 0) return n;
  auto per_sm = [](auto kernel) {
    int b = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kGroupWarps * 32, 0));
    return std::max(b, 1);
  };
  auto of = [&](auto k64, auto k128) { return head_dim == 64 ? per_sm(k64) : per_sm(k128); };
  switch (kind) {
    case KvKind::kF32:
      n = of(attention_group_kernel<KvKind::kF32, 64>, attention_group_kernel<KvKind::kF32, 128>);
      break;
    case KvKind::kBF16:
      n = of(attention_group_kernel<KvKind::kBF16, 64>, attention_group_kernel<KvKind::kBF16, 128>);
      break;
    case KvKind::kFP8:
      n = of(attention_group_kernel<KvKind::kFP8, 64>, attention_group_kernel<KvKind::kFP8, 128>);
      break;
  }
  return n;
}

bool attention_can_stage(int64_t n_tokens, const AttnShape& a) {
  return n_tokens == 1 && a.head_dim % 32 == 0 && static_cast<int64_t>(a.n_heads) * a.head_dim <= 4 * kChunk;
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
  NB_CHECK(!a.grouped || attention_group_ok(a), "attention: grouped decode needs head_dim 64 / 128, 2-8 heads per KV head");
  NB_CHECK(!a.stage_planes || (attention_can_stage(b.n_tokens, a) && a.stage_shifts),
           "attention: staged output is for one token and head_dim % 32 == 0");
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
