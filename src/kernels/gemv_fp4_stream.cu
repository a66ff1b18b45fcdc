// Row-streaming FP4 GEMV for one token (decode at batch 1): the linear layers and the MoE expert
// projections (FC1 + GLU, FC2 + weighted combine), MXFP4 and NVFP4, on the checkpoint layout as it is.
//
// Why another kernel (gemv_fp4.cu stays for 2..8 tokens): that one gives each lane 16 bytes of 8 rows
// in the mma fragment layout, so a warp's load touches 16 rows x 64 bytes; a load-only test on the H200
// capped that pattern at 81 % of the read bandwidth, and its MoE launches sat at 22-37 % (bench/NOTES.md).
// Here a warp reads 512 contiguous bytes of a row per load (the pattern that reached 99 %): lane l holds
// elements [32 l, 32 l + 32) of a 1024-element chunk of rows r0 and r1 -- for MXFP4 exactly one scale block.
//
// The multiply still runs on mma.sync m16n8k16 (one per 16 elements of each row: no per-element
// conversion or FMA). Pseudo-row g of A (g = lane / 4) is row r0's segment g (lanes 4g..4g+3, 128
// elements), pseudo-row g + 8 is row r1's segment g; column n of B carries the activations of segment n.
// So C[g][g] is row r0's dot over segment g and C[g + 8][g] row r1's: the diagonal, which lane
// (g, t = g / 2) holds; the other C entries are cross terms, never read. Each lane supplies exactly its
// own codes as A and its own 32 activations as B, so the staged activations are lane-contiguous and the
// block scale is folded into the decoded weights (one fp16 multiply per pair: E2M1 * 2^-14 by bit moves,
// times 2^(e + 14) for MXFP4 -- exact for e in [-23, 1], any trained weight; warps whose blocks have a
// larger scale take an exact fp32 path for that item -- or ue4m3 * 2^7 for NVFP4, always exact, with
// 2^7 and the global scale back per output).
// Activations: x * 2^s (max |x| into [2^14, 2^15)) as fp16 hi + lo (~22 bits, as gemv_fp4.cu), so the
// products are exact in the fp32 accumulators; 2^-s comes back per output.
//
// Work: a warp walks row pairs (strided over all warps of the grid) chunk by chunk; each (pair, chunk)
// is an "item" of 2 x 16 code bytes and the scale bytes per lane, and kDepth items stay in flight in a
// register ring. The linear kernel issues its first loads before waiting for the previous kernel (the
// weights do not depend on it), so they overlap the activation staging.
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "kernels/gemv.cuh"

namespace nb::cuda {
namespace {

constexpr int kChunk = 1024;  // elements of a row per warp load: 32 lanes x 32
constexpr int kWarps = 16, kThreads = kWarps * 32;
constexpr int kDepth = 4;    // items in flight per warp
constexpr int kMaxRows = 8;  // staged activation rows (FC2: one per choice)
constexpr int kMaxSmem = 96 * 1024;

// Staged activations of one row: per chunk c, 4 octet planes j of 32 lanes x 16 bytes (plane j of lane l =
// elements 32 l + 8 j .. + 8 of the chunk in the octet order 0 4 1 5 2 6 3 7, common.cuh), hi planes of
// every chunk, then lo planes. A lane's loads are consecutive 16-byte words across the warp: no conflicts.
__host__ __device__ constexpr int n_chunks(int k) { return (k + kChunk - 1) / kChunk; }
__host__ __device__ constexpr int row_words(int k) { return 2 * n_chunks(k) * 4 * 32; }  // uint4 per staged row
__host__ __device__ constexpr size_t stage_bytes(int rows, int k) { return size_t{16} * rows * row_words(k); }

// All threads: stage `rows` rows of x (row i at x + i * ld, k floats, k % 32 == 0), each with its own
// power-of-two prescale; unscale[i] = 2^-s_i. Ends with a barrier.
__device__ void stage_rows(const float* __restrict__ x, int64_t ld, int rows, int k, uint4* planes, float* red,
                           float* unscale) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nc = n_chunks(k);
  __shared__ float pre[kMaxRows];
  for (int i = 0; i < rows; ++i) {
    float mx = 0.0f;
    for (int q = threadIdx.x; q < k / 4; q += blockDim.x) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(x + i * ld) + q);
      mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    mx = warp_max(mx);
    if (lane == 0) red[i * kWarps + warp] = mx;
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    float mx = 0.0f;
    for (int q = 0; q < kWarps; ++q) mx = fmaxf(mx, red[threadIdx.x * kWarps + q]);
    const int sh = fp16_prescale_shift(mx);
    pre[threadIdx.x] = ldexpf(1.0f, sh);
    unscale[threadIdx.x] = ldexpf(1.0f, -sh);
  }
  __syncthreads();
  const int octets = nc * kChunk / 8, half = nc * 4 * 32;  // per row; uint4 words of the hi planes
  for (int f = threadIdx.x; f < rows * octets; f += blockDim.x) {
    const int i = f / octets, o = f % octets;
    const int c = o / 128, l = (o / 4) % 32, j = o % 4, e = c * kChunk + l * 32 + j * 8;
    float v[8] = {};
    if (e < k) {
      const float p = pre[i];
      const float4 a = __ldg(reinterpret_cast<const float4*>(x + i * ld + e));
      const float4 b = __ldg(reinterpret_cast<const float4*>(x + i * ld + e) + 1);
      v[0] = a.x * p, v[1] = a.y * p, v[2] = a.z * p, v[3] = a.w * p;
      v[4] = b.x * p, v[5] = b.y * p, v[6] = b.z * p, v[7] = b.w * p;
    }
    uint4 h, lo;
    split_octet(v, h, lo);
    uint4* row = planes + static_cast<size_t>(i) * row_words(k);
    row[(c * 4 + j) * 32 + l] = h;
    row[half + (c * 4 + j) * 32 + l] = lo;
  }
  __syncthreads();
}

template <WKind K>
struct Fmt;
template <>
struct Fmt<WKind::kMXFP4> {
  static constexpr int kBs = 32;
  static constexpr float kPost = 1.0f;  // the fold makes the decoded weight exact
  // fp16x2 (both halves) of 2^(e - 127 + 14): float 2^(e - 113) rounded to fp16 (0 below 2^-24, inf above).
  __device__ static void folds(uint32_t s, uint32_t (&f)[2]) {
    const __half h = __float2half_rn(__uint_as_float((s & 0xffu) + 14u << 23));
    f[0] = f[1] = pack_half2(h, h);
  }
  // Warp-uniform: does any lane's block need the exact path (2^(e - 113) overflows fp16: |w| may exceed 12)?
  __device__ static bool too_large(uint32_t sa, uint32_t sb) { return __any_sync(0xffffffffu, (sa > 128u) | (sb > 128u)); }
  __device__ static float factor(uint32_t s, int) { return __uint_as_float((s & 0xffu) << 23) * 16384.0f; }
};
template <>
struct Fmt<WKind::kNVFP4> {
  static constexpr int kBs = 16;
  static constexpr float kPost = 128.0f;  // the fold's 2^-7, back per output (with the global scale)
  // Blocks 0 and 1 of the lane's 32 elements (scale bytes 0, 1 of s): ue4m3 * 2^7 in fp16, exact. The 7
  // code bits at fp16 bits 7..13 are ue4m3 * 2^-8; times 2^15.
  __device__ static void folds(uint32_t s, uint32_t (&f)[2]) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const uint32_t h = (s >> (8 * b) & 0x7fu) << 7;
      f[b] = hmul2(h | h << 16, 0x78007800u);
    }
  }
  __device__ static bool too_large(uint32_t, uint32_t) { return false; }
  __device__ static float factor(uint32_t s, int b) {
    return __uint_as_float((s >> (8 * b) & 0x7fu) << 20) * 0x1p120f * 16384.0f;
  }
};

// One item: a lane's 16 code bytes of rows r0 and r1 and their scale codes.
struct Item {
  uint4 a, b;
  uint32_t sa, sb;
};

// Where a lane reads rows r0 and r1 (chunk 0).
struct Rows {
  const uint8_t* codes[2];
  const uint8_t* scales[2];
};

template <WKind K>
__device__ __forceinline__ Rows lane_rows(const DevPart& pa, int ra, const DevPart& pb, int rb, int k) {
  using F = Fmt<K>;
  const int lane = threadIdx.x & 31;
  Rows r;
  r.codes[0] = pa.data + static_cast<int64_t>(ra) * (k / 2) + lane * 16;
  r.codes[1] = pb.data + static_cast<int64_t>(rb) * (k / 2) + lane * 16;
  r.scales[0] = pa.scales + static_cast<int64_t>(ra) * (k / F::kBs) + lane * (32 / F::kBs);
  r.scales[1] = pb.scales + static_cast<int64_t>(rb) * (k / F::kBs) + lane * (32 / F::kBs);
  return r;
}

template <WKind K>
__device__ __forceinline__ void load_item(const Rows& r, int c, int k, Item& it) {
  using F = Fmt<K>;
  const int lane = threadIdx.x & 31;
  if (c * kChunk + lane * 32 >= k) {  // past the row's end: zero codes (the B side reads staged zeros)
    it.a = it.b = make_uint4(0, 0, 0, 0);
    it.sa = it.sb = 127u;
    return;
  }
  it.a = __ldg(reinterpret_cast<const uint4*>(r.codes[0] + c * (kChunk / 2)));
  it.b = __ldg(reinterpret_cast<const uint4*>(r.codes[1] + c * (kChunk / 2)));
  if constexpr (K == WKind::kMXFP4) {
    it.sa = __ldg(r.scales[0] + c * 32);
    it.sb = __ldg(r.scales[1] + c * 32);
  } else {  // two adjacent bytes; the scale rows are 2-byte aligned (checked at launch)
    it.sa = __ldg(reinterpret_cast<const uint16_t*>(r.scales[0] + c * 64));
    it.sb = __ldg(reinterpret_cast<const uint16_t*>(r.scales[1] + c * 64));
  }
}

__device__ __forceinline__ uint32_t word(const uint4& c, int w) { return w == 0 ? c.x : w == 1 ? c.y : w == 2 ? c.z : c.w; }

// acc += this item's products (rows r0, r1 against the lane's staged activations `xs` of the item's
// chunk: hi planes at xs, lo planes at xs + half). Blocks the fold cannot hold go through `exact`.
template <WKind K>
__device__ __forceinline__ void compute_item(const Item& it, const uint4* xs, int half, float (&acc)[4],
                                             float (&exact)[2]) {
  using F = Fmt<K>;
  const int lane = threadIdx.x & 31;
  if (F::too_large(it.sa, it.sb)) {  // warp-uniform, rare: fp32 products with the true block factors
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4 h = xs[w * 32 + lane], l = xs[half + w * 32 + lane];
      float xv[8];
      const uint32_t hw[4] = {h.x, h.y, h.z, h.w}, lw[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // octet order: word i = elements (i, i + 4)
        float h0, h1, l0, l1;
        half2_bits_to_float2(hw[i], h0, h1);
        half2_bits_to_float2(lw[i], l0, l1);
        xv[i] = h0 + l0, xv[i + 4] = h1 + l1;
      }
      float wa[8], wb[8];
      e2m1x8_scaled(word(it.a, w), wa);
      e2m1x8_scaled(word(it.b, w), wb);
      float sa = 0.0f, sb = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) sa = fmaf(wa[i], xv[i], sa), sb = fmaf(wb[i], xv[i], sb);
      exact[0] = fmaf(sa, F::factor(it.sa, w / 2), exact[0]);
      exact[1] = fmaf(sb, F::factor(it.sb, w / 2), exact[1]);
    }
    return;
  }
  uint32_t fa[2], fb[2];
  F::folds(it.sa, fa);
  F::folds(it.sb, fb);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 h = xs[w * 32 + lane], l = xs[half + w * 32 + lane];
    uint32_t ha[4], hb[4];
    e2m1_word(word(it.a, w), ha);
    e2m1_word(word(it.b, w), hb);
#pragma unroll
    for (int i = 0; i < 4; ++i) ha[i] = hmul2(ha[i], fa[w / 2]), hb[i] = hmul2(hb[i], fb[w / 2]);
    // Slice 2w + s: pairs 2s and 2s + 1 of the word (k positions 2t.. and 2t + 8.. of the slice).
    const uint32_t a0[4] = {ha[0], hb[0], ha[1], hb[1]}, a1[4] = {ha[2], hb[2], ha[3], hb[3]};
    mma_f16_16816(acc, a0, h.x, h.y);
    mma_f16_16816(acc, a0, l.x, l.y);
    mma_f16_16816(acc, a1, h.z, h.w);
    mma_f16_16816(acc, a1, l.z, l.w);
  }
}

// The two rows' dots from the accumulators (the diagonal entries, lane t == g / 2) plus the exact-path
// sums, on every lane.
__device__ __forceinline__ void row_sums(const float (&acc)[4], const float (&exact)[2], float& v0, float& v1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool diag = t == (g >> 1);
  v0 = exact[0] + (diag ? (g & 1 ? acc[1] : acc[0]) : 0.0f);
  v1 = exact[1] + (diag ? (g & 1 ? acc[3] : acc[2]) : 0.0f);
  v0 = warp_sum(v0);
  v1 = warp_sum(v1);
}

// The walk shared by the three kernels. `op` says how many row pairs there are (op.n_pairs), how many
// sub-units each pair has (op.subs: FC2's choices, else 1), where a (pair, sub) reads (op.rows) and what
// happens with its two dots (op.finish, called on every lane). Warps stride over the pairs.
template <WKind K, class Op>
__device__ __forceinline__ void walk(Op& op, int k, const uint4* planes, bool loads_started, Item (&ring)[kDepth],
                                     int n_items, int first_pair) {
  const int stride = gridDim.x * kWarps, nc = n_chunks(k), half = nc * 4 * 32, words = row_words(k);
  // Load cursor: the item kDepth ahead of the compute cursor.
  int lp = first_pair, ls = 0, lc = 0;
  Rows lr = op.rows(lp, 0);
  auto advance_load = [&] {
    if (++lc < nc) return;
    lc = 0;
    if (++ls == op.subs) ls = 0, lp += stride;
    if (lp < op.n_pairs) lr = op.rows(lp, ls);
  };
  if (!loads_started) {
#pragma unroll
    for (int j = 0; j < kDepth; ++j)
      if (j < n_items) load_item<K>(lr, lc, k, ring[j]), advance_load();
  } else {
    for (int j = 0; j < kDepth && j < n_items; ++j) advance_load();
  }
  int cp = first_pair, cs = 0, cc = 0;  // compute cursor; sub-unit cs reads staged activation row cs
  float acc[4] = {}, exact[2] = {};
  for (int i0 = 0; i0 < n_items; i0 += kDepth) {
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      const int i = i0 + j;
      if (i >= n_items) break;
      compute_item<K>(ring[j], planes + static_cast<size_t>(cs) * words + cc * 4 * 32, half, acc, exact);
      if (i + kDepth < n_items) load_item<K>(lr, lc, k, ring[j]), advance_load();
      if (++cc == nc) {
        float v0, v1;
        row_sums(acc, exact, v0, v1);
        op.finish(cp, cs, v0, v1);
        acc[0] = acc[1] = acc[2] = acc[3] = exact[0] = exact[1] = 0.0f;
        cc = 0;
        if (++cs == op.subs) cs = 0, cp += stride;
      }
    }
  }
}

__device__ __forceinline__ int items_of(int n_pairs, int first, int subs, int nc) {
  const int stride = gridDim.x * kWarps;
  const int pairs = first < n_pairs ? (n_pairs - first + stride - 1) / stride : 0;
  return pairs * subs * nc;
}

template <WKind K>
__device__ __forceinline__ float post(const DevPart& p) {
  return K == WKind::kNVFP4 ? Fmt<K>::kPost * (p.divide ? 1.0f / p.global : p.global) : 1.0f;
}

// ---- Linear: y[r] = w[r] . x (+ bias[r]) -------------------------------------------------------------------
template <WKind K>
struct LinearOp {
  const DevWeight& w;
  const float* bias;
  float* y;
  float unscale;
  int n_pairs, subs = 1;
  __device__ Rows rows(int p, int) const {
    int ra = 2 * p, rb = min(2 * p + 1, w.n - 1);
    const DevPart& pa = find_part(w, ra);
    const DevPart& pb = find_part(w, rb);
    return lane_rows<K>(pa, ra, pb, rb, w.k);
  }
  __device__ void finish(int p, int, float v0, float v1) const {
    if ((threadIdx.x & 31) != 0) return;
    for (int r = 2 * p; r < min(2 * p + 2, w.n); ++r) {
      int rr = r;
      const float v = (r == 2 * p ? v0 : v1) * unscale * post<K>(find_part(w, rr));
      y[r] = v + (bias ? bias[r] : 0.0f);
    }
  }
};

template <WKind K>
__global__ void __launch_bounds__(kThreads, 1)
    stream_linear_kernel(const __grid_constant__ DevWeight w, const float* __restrict__ x,
                         const float* __restrict__ bias, float* __restrict__ y) {
  extern __shared__ uint4 planes[];
  __shared__ float red[kMaxRows * kWarps], unscale[kMaxRows];
  LinearOp<K> op{w, bias, y, 0.0f, (w.n + 1) / 2};
  const int first = blockIdx.x * kWarps + (threadIdx.x >> 5), nc = n_chunks(w.k);
  const int n_items = items_of(op.n_pairs, first, 1, nc);
  // The first items' weights stream in while the previous kernel finishes and x is staged.
  Item ring[kDepth];
  if (n_items > 0) {
    Rows r = op.rows(first, 0);
    int p = first, c = 0;
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      if (j >= n_items) break;
      load_item<K>(r, c, w.k, ring[j]);
      if (++c == nc) c = 0, p += gridDim.x * kWarps, r = op.rows(min(p, op.n_pairs - 1), 0);
    }
  }
  pdl_wait();
  stage_rows(x, w.k, 1, w.k, planes, red, unscale);
  op.unscale = unscale[0];
  if (n_items > 0) walk<K>(op, w.k, planes, true, ring, n_items, first);
}

// The routed experts of the one token, copied to shared memory once (their part tables are read per pair).
__device__ __forceinline__ void copy_experts(const DevWeight* table, const int32_t* ids, int top_k, DevWeight* dst) {
  static_assert(sizeof(DevWeight) % 4 == 0);
  constexpr int kWords = sizeof(DevWeight) / 4;
  for (int i = threadIdx.x; i < top_k * kWords; i += blockDim.x) {
    const int c = i / kWords, q = i % kWords;
    reinterpret_cast<uint32_t*>(dst + c)[q] = __ldg(reinterpret_cast<const uint32_t*>(table + ids[c]) + q);
  }
  __syncthreads();
}

__device__ __forceinline__ float glu(float g, float u, Glu kind, float limit) {
  if (kind == Glu::kGptOssInterleaved || kind == Glu::kGptOssHalves) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g / (1.0f + expf(-1.702f * g)) * (u + 1.0f);
  }
  return g / (1.0f + expf(-g)) * u;
}

// ---- MoE FC1 + GLU: pair (choice i, output j) = gate row and up row of expert ids[i] -------------------------
template <WKind K>
struct Fc1Op {
  const DevWeight* sw;  // [top_k] in shared memory
  const ExpertTable& tab;
  const int32_t* ids;
  Glu kind;
  float limit, unscale;
  float* act;
  int n_pairs, subs = 1;
  __device__ void gate_up(int p, int& i, int& j, int& ga, int& gb) const {
    const int d = tab.d_expert;
    i = p / d, j = p % d;
    const bool inter = kind == Glu::kSiluInterleaved || kind == Glu::kGptOssInterleaved;
    ga = inter ? 2 * j : j, gb = inter ? 2 * j + 1 : d + j;
  }
  __device__ Rows rows(int p, int) const {
    int i, j, ra, rb;
    gate_up(p, i, j, ra, rb);
    const DevPart& pa = find_part(sw[i], ra);
    const DevPart& pb = find_part(sw[i], rb);
    return lane_rows<K>(pa, ra, pb, rb, tab.d_model);
  }
  __device__ void finish(int p, int, float v0, float v1) const {
    if ((threadIdx.x & 31) != 0) return;
    int i, j, ga, gb;
    gate_up(p, i, j, ga, gb);
    int ra = ga, rb = gb;
    float gate = v0 * unscale * post<K>(find_part(sw[i], ra)), up = v1 * unscale * post<K>(find_part(sw[i], rb));
    if (tab.fc1_bias) {
      const float* b = tab.fc1_bias + static_cast<int64_t>(ids[i]) * 2 * tab.d_expert;
      gate += b[ga], up += b[gb];
    }
    act[static_cast<int64_t>(i) * tab.d_expert + j] = glu(gate, up, kind, limit);
  }
};

template <WKind K>
__global__ void __launch_bounds__(kThreads, 1)
    stream_fc1_kernel(const __grid_constant__ ExpertTable tab, const int32_t* __restrict__ ids, int top_k, const float* __restrict__ x,
                      Glu kind, float limit, float* __restrict__ act) {
  extern __shared__ uint4 planes[];
  __shared__ float red[kMaxRows * kWarps], unscale[kMaxRows];
  __shared__ DevWeight sw[kMaxRows];
  pdl_wait();  // ids and x come from the previous kernels
  copy_experts(tab.fc1, ids, top_k, sw);
  stage_rows(x, tab.d_model, 1, tab.d_model, planes, red, unscale);
  Fc1Op<K> op{sw, tab, ids, kind, limit, unscale[0], act, top_k * tab.d_expert};
  const int first = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int n_items = items_of(op.n_pairs, first, 1, n_chunks(tab.d_model));
  Item ring[kDepth];
  if (n_items > 0) walk<K>(op, tab.d_model, planes, false, ring, n_items, first);
}

// ---- MoE FC2 + combine: y[r] = sum_i weights[i] (fc2_{ids[i]}[r] . act[i] + bias), choices in order ---------
template <WKind K>
struct Fc2Op {
  const DevWeight* sw;  // [top_k] in shared memory
  const ExpertTable& tab;
  const int32_t* ids;
  const float* weights;
  const float* unscale;  // [top_k] in shared memory
  float* y;
  int n_pairs, subs;
  float sum[2] = {0.0f, 0.0f};  // the current pair's rows, over the choices so far
  __device__ Rows rows(int p, int i) const {
    int ra = 2 * p, rb = min(2 * p + 1, tab.d_model - 1);
    const DevPart& pa = find_part(sw[i], ra);
    const DevPart& pb = find_part(sw[i], rb);
    return lane_rows<K>(pa, ra, pb, rb, tab.d_expert);
  }
  __device__ void finish(int p, int i, float v0, float v1) {
    if ((threadIdx.x & 31) != 0) return;  // lane 0 keeps the sums
    const int n = tab.d_model;
    const float wt = weights[i];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      int r = min(2 * p + q, n - 1);
      const float bias = tab.fc2_bias ? tab.fc2_bias[static_cast<int64_t>(ids[i]) * n + r] : 0.0f;
      const float v = (q == 0 ? v0 : v1) * unscale[i] * post<K>(find_part(sw[i], r));
      sum[q] = (i == 0 ? 0.0f : sum[q]) + wt * (v + bias);  // weight after the bias (formats.md §2.4)
    }
    if (i + 1 < subs) return;
    y[2 * p] = sum[0];
    if (2 * p + 1 < n) y[2 * p + 1] = sum[1];
  }
};

template <WKind K>
__global__ void __launch_bounds__(kThreads, 1)
    stream_fc2_kernel(const __grid_constant__ ExpertTable tab, const int32_t* __restrict__ ids, const float* __restrict__ weights, int top_k,
                      const float* __restrict__ act, float* __restrict__ y) {
  extern __shared__ uint4 planes[];
  __shared__ float red[kMaxRows * kWarps], unscale[kMaxRows];
  __shared__ DevWeight sw[kMaxRows];
  pdl_wait();  // act, ids and weights come from the previous kernels
  copy_experts(tab.fc2, ids, top_k, sw);
  stage_rows(act, tab.d_expert, top_k, tab.d_expert, planes, red, unscale);
  Fc2Op<K> op{sw, tab, ids, weights, unscale, y, (tab.d_model + 1) / 2, top_k};
  const int first = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int n_items = items_of(op.n_pairs, first, top_k, n_chunks(tab.d_expert));
  Item ring[kDepth];
  if (n_items > 0) walk<K>(op, tab.d_expert, planes, false, ring, n_items, first);
}

// ---- Launch ---------------------------------------------------------------------------------------------------
// NIBBLE_FP4_STREAM=0 turns these kernels off (the tensor-core kernels of gemv_fp4.cu take batch 1 then):
// a measurement knob for the benchmarks.
bool enabled() {
  static const bool on = [] {
    const char* e = std::getenv("NIBBLE_FP4_STREAM");
    return !(e && e[0] == '0');
  }();
  return on;
}

bool fp4(WKind kind) { return kind == WKind::kMXFP4 || kind == WKind::kNVFP4; }

// Rows of 16-byte aligned code chunks (k % 32) and, for NVFP4, 2-byte aligned scale pairs.
bool aligned(const DevWeight& w) {
  if (!w.vec_ok || w.k % 32 != 0) return false;
  for (int p = 0; p < w.n_parts; ++p)
    if (w.kind == WKind::kNVFP4 && reinterpret_cast<uintptr_t>(w.part[p].scales) % 2 != 0) return false;
  return true;
}

template <class Kernel>
int grid_for(Kernel kernel, size_t smem, int n_pairs) {
  static int sms = [] {
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  return std::max(1, std::min(std::max(1, per_sm) * sms, ceil_div(n_pairs, kWarps)));
}

template <WKind K>
void linear(const DevWeight& w, const float* x, const float* bias, float* y, cudaStream_t s) {
  const size_t smem = stage_bytes(1, w.k);
  auto kernel = stream_linear_kernel<K>;
  launch_pdl(kernel, grid_for(kernel, smem, (w.n + 1) / 2), kThreads, smem, s, w, x, bias, y);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void fc1(const ExpertTable& t, const int32_t* ids, int top_k, const float* x, Glu glu, float limit, float* act,
         cudaStream_t s) {
  const size_t smem = stage_bytes(1, t.d_model);
  auto kernel = stream_fc1_kernel<K>;
  launch_pdl(kernel, grid_for(kernel, smem, top_k * t.d_expert), kThreads, smem, s, t, ids, top_k, x, glu, limit, act);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void fc2(const ExpertTable& t, const int32_t* ids, const float* weights, int top_k, const float* act, float* y,
         cudaStream_t s) {
  const size_t smem = stage_bytes(top_k, t.d_expert);
  auto kernel = stream_fc2_kernel<K>;
  launch_pdl(kernel, grid_for(kernel, smem, (t.d_model + 1) / 2), kThreads, smem, s, t, ids, weights, top_k, act, y);
  CUDA_CHECK(cudaGetLastError());
}

bool table_ok(const ExpertTable& t, int top_k, int k) {
  return enabled() && fp4(t.kind) && t.vec_ok && k % 32 == 0 && top_k >= 1 && top_k <= kMaxRows &&
         stage_bytes(top_k, k) <= kMaxSmem;
}

}  // namespace

bool launch_linear_fp4_stream(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                              cudaStream_t s) {
  if (!enabled() || !fp4(w.kind) || m != 1 || !aligned(w) || stage_bytes(1, w.k) > kMaxSmem) return false;
  if (w.kind == WKind::kMXFP4) linear<WKind::kMXFP4>(w, x, bias, y, s);
  else linear<WKind::kNVFP4>(w, x, bias, y, s);
  return true;
}

// The NVFP4 scale pairs of an expert table are checked on the host when the table is built (ExpertTable::vec_ok
// covers 16-byte rows; the scales of every expert tensor start 256-byte aligned in the upload buffer).
bool launch_moe_fc1_fp4_stream(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x,
                               Glu glu, float limit, float* act, cudaStream_t s) {
  if (n_pairs != top_k || !table_ok(t, top_k, t.d_model)) return false;
  if (t.kind == WKind::kMXFP4) fc1<WKind::kMXFP4>(t, ids, top_k, x, glu, limit, act, s);
  else fc1<WKind::kNVFP4>(t, ids, top_k, x, glu, limit, act, s);
  return true;
}

bool launch_moe_fc2_fp4_stream(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens,
                               int top_k, const float* act, float* y, cudaStream_t s) {
  if (n_tokens != 1 || !table_ok(t, top_k, t.d_expert)) return false;
  if (t.kind == WKind::kMXFP4) fc2<WKind::kMXFP4>(t, ids, weights, top_k, act, y, s);
  else fc2<WKind::kNVFP4>(t, ids, weights, top_k, act, y, s);
  return true;
}

}  // namespace nb::cuda
