// Row-streaming FP4 GEMV for one token (decode at batch 1): the linear layers and the MoE expert
// projections (FC1 + GLU, FC2 + weighted combine), MXFP4 and NVFP4, on the checkpoint layout as it is.
// By default only linear layers with tall or long rows use it (see use() below for what was measured).
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
// Work: a warp walks row pairs (strided over all warps of the grid). A "unit" is a pair (FC2: a pair and
// one choice) across every chunk of k: NC items of 2 x 16 code bytes and the scale bytes per lane, NC a
// template argument (k <= 4096: gpt-oss, Qwen3, Llama-8B attention; longer rows take gemv_fp4.cu). Each
// warp keeps kStages - 1 units in flight: their codes go by cp.async into a per-warp ring in shared memory
// (no registers held while in flight; a lane reads back only what it copied), their scale codes and
// epilogue values (biases) into registers. The linear kernel issues its first units before waiting for the
// previous kernel (the weights do not depend on it), so they overlap the activation staging.
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "kernels/gemv.cuh"

namespace nb::cuda {
namespace {

constexpr int kChunk = 1024;  // elements of a row per warp load: 32 lanes x 32
constexpr int kWarps = 16, kThreads = kWarps * 32;
constexpr int kMaxRows = 8;  // staged activation rows (FC2: one per choice)

// Staged activations of one row: per chunk c, 4 octet planes j of 32 lanes x 16 bytes (plane j of lane l =
// elements 32 l + 8 j .. + 8 of the chunk in the octet order 0 4 1 5 2 6 3 7, common.cuh), hi planes of
// every chunk, then lo planes. A lane's loads are consecutive 16-byte words across the warp: no conflicts.
__host__ __device__ constexpr int n_chunks(int k) { return (k + kChunk - 1) / kChunk; }
__host__ __device__ constexpr int row_words(int k) {
  return 2 * n_chunks(k) * 4 * 32;
}  // uint4 per staged row
__host__ __device__ constexpr size_t stage_bytes(int rows, int k) { return size_t{16} * rows * row_words(k); }

// All threads: stage `rows` rows of x (row i at x + i * ld, k floats, k % 32 == 0), each with its own
// power-of-two prescale; unscale[i] = 2^-s_i. Ends with a barrier.
__device__ void stage_rows(const float* __restrict__ x, int64_t ld, int rows, int k, uint4* planes,
                           float* red, float* unscale) {
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
    for (int q = 0; q < static_cast<int>(blockDim.x >> 5); ++q) mx = fmaxf(mx, red[threadIdx.x * kWarps + q]);
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
  __device__ static bool too_large(uint32_t sa, uint32_t sb) {
    return __any_sync(0xffffffffu, (sa > 128u) | (sb > 128u));
  }
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

// One item: a lane's 16 code bytes of rows r0 and r1 in one chunk, and their scale codes.
struct Item {
  uint4 a, b;
  uint32_t s;  // row r0's scale codes in bits 0..15, row r1's in 16..31 (MXFP4: one byte each, NVFP4: two)
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

// cp.async (sm_80): 16 bytes global -> shared without registers; src_bytes 0 writes zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Issues a unit's NC items: the codes by cp.async into the lane's ring slot `slot` (uint4 [NC][2][32]),
// the scale codes by plain loads into the returned words (they are consumed kStages - 1 units later, so
// the loads are long done). Lanes past the end of the last chunk get zero codes (their staged activations
// are zeros too) and a harmless scale.
template <WKind K, int NC>
__device__ __forceinline__ void issue_unit(const Rows& r, int k, uint4* slot, uint32_t (&s)[NC]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const bool live = c < NC - 1 || c * kChunk + lane * 32 < k;
    cp_async16(slot + (2 * c) * 32 + lane, live ? r.codes[0] + c * (kChunk / 2) : r.codes[0], live ? 16 : 0);
    cp_async16(slot + (2 * c + 1) * 32 + lane, live ? r.codes[1] + c * (kChunk / 2) : r.codes[1], live ? 16 : 0);
    if (!live) {
      s[c] = 127u | 127u << 16;
    } else if constexpr (K == WKind::kMXFP4) {
      s[c] = __ldg(r.scales[0] + c * 32) | static_cast<uint32_t>(__ldg(r.scales[1] + c * 32)) << 16;
    } else {  // two adjacent bytes; the scale rows are 2-byte aligned (checked at launch)
      s[c] = __ldg(reinterpret_cast<const uint16_t*>(r.scales[0] + c * 64)) |
             static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(r.scales[1] + c * 64))) << 16;
    }
  }
}

__device__ __forceinline__ uint32_t word(const uint4& c, int w) {
  return w == 0 ? c.x : w == 1 ? c.y : w == 2 ? c.z : c.w;
}

// acc[w / 2] += this item's products (rows r0, r1 against the lane's staged activations of the item's
// chunk: hi planes at xs, lo planes at xs + half); two accumulator sets halve the HMMA dependency chain.
// Blocks the fold cannot hold go through `exact` instead.
// The exact path for an item whose blocks the fold cannot hold (warp-uniform, rare): fp32 products with the
// true block factors into exact[0..1]. Out of line: the hot loop stays small enough for the instruction cache.
template <WKind K>
__device__ __noinline__ void exact_item(const Item& it, const uint4* xs, int half, float (&exact)[2]) {
  using F = Fmt<K>;
  const int lane = threadIdx.x & 31;
  const uint32_t sa = it.s & 0xffffu, sb = it.s >> 16;
#pragma unroll 1
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
    float da = 0.0f, db = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) da = fmaf(wa[i], xv[i], da), db = fmaf(wb[i], xv[i], db);
    exact[0] = fmaf(da, F::factor(sa, w / 2), exact[0]);
    exact[1] = fmaf(db, F::factor(sb, w / 2), exact[1]);
  }
}

// acc[w / 2] += this item's products (rows r0, r1 against the lane's staged activations of the item's
// chunk: hi planes at xs, lo planes at xs + half); two accumulator sets halve the HMMA dependency chain.
// Blocks the fold cannot hold go through `exact` instead.
template <WKind K>
__device__ __forceinline__ void compute_item(const Item& it, const uint4* xs, int half, float (&acc)[2][4],
                                             float (&exact)[2]) {
  using F = Fmt<K>;
  const int lane = threadIdx.x & 31;
  const uint32_t sa = it.s & 0xffffu, sb = it.s >> 16;
  if (F::too_large(sa, sb)) return exact_item<K>(it, xs, half, exact);
  uint32_t fa[2], fb[2];
  F::folds(sa, fa);
  F::folds(sb, fb);
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
    float(&c)[4] = acc[w / 2];
    mma_f16_16816(c, a0, h.x, h.y);
    mma_f16_16816(c, a0, l.x, l.y);
    mma_f16_16816(c, a1, h.z, h.w);
    mma_f16_16816(c, a1, l.z, l.w);
  }
}

// The two rows' dots: the diagonal accumulator entries (lane t == g / 2 holds C[g][g] and C[g + 8][g])
// plus the exact-path sums, reduced over the warp in 6 shuffles (the halves of the warp sum one row each,
// then swap). v0, v1 on every lane.
__device__ __forceinline__ void pair_sums(const float (&acc)[2][4], const float (&exact)[2], float& v0,
                                          float& v1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool diag = t == (g >> 1), odd = g & 1, upper = lane & 16;
  const float r0 = exact[0] + (diag ? (odd ? acc[0][1] + acc[1][1] : acc[0][0] + acc[1][0]) : 0.0f);
  const float r1 = exact[1] + (diag ? (odd ? acc[0][3] + acc[1][3] : acc[0][2] + acc[1][2]) : 0.0f);
  float keep = upper ? r1 : r0;
  keep += __shfl_xor_sync(0xffffffffu, upper ? r0 : r1, 16);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) keep += __shfl_xor_sync(0xffffffffu, keep, o);
  const float other = __shfl_xor_sync(0xffffffffu, keep, 16);
  v0 = upper ? other : keep;
  v1 = upper ? keep : other;
}

// A unit of work: row pair p and sub-unit `sub` (FC2's choice; 0 elsewhere).
struct Unit {
  int p, sub;
};

// The walk shared by the three kernels. `op` says how many row pairs there are (op.n_pairs), how many
// sub-units each pair has (op.subs), where a unit reads (op.rows) and what happens with its two dots
// (op.finish, on every lane, with what op.epilogue loaded for the unit: biases). Warps stride over the
// pairs. Each warp keeps kStages - 1 units in flight in its ring of kStages slots in shared memory: the
// codes by cp.async (no registers held), the scale codes and epilogue values by plain loads into registers
// that are stored into the slot one unit later (by then they have arrived). The loop body is one unit
// (slots indexed at run time), small enough for the instruction cache: a 4x unrolled body measured slower,
// its warps stalled on instruction fetch. Every lane reads back only what it wrote, so no warp barrier.
constexpr int kStages = 4;

// A warp's ring slot: codes uint4 [NC][2][32], then scale words uint32 [NC][32], then epilogue float2 [32].
template <int NC>
struct Slot {
  static constexpr int kBytes = NC * 2 * 32 * 16 + NC * 32 * 4 + 32 * 8;
};
template <int NC>
__host__ __device__ constexpr int ring_bytes() {
  return kStages * Slot<NC>::kBytes;
}

template <WKind K, int NC, class Op>
struct Walk {
  Op& op;
  int k, stride;
  uint8_t* ring;  // this warp's kStages slots
  Unit next;      // the next unit to issue
  uint32_t sc[NC];  // the last issued unit's scale codes and epilogue values, not yet stored
  float2 ep;
  int pending = -1;  // their slot

  __device__ Unit after(Unit u) const { return u.sub + 1 < op.subs ? Unit{u.p, u.sub + 1} : Unit{u.p + stride, 0}; }
  __device__ uint4* codes(int slot) const { return reinterpret_cast<uint4*>(ring + slot * Slot<NC>::kBytes); }
  __device__ uint32_t* scales(int slot) const {
    return reinterpret_cast<uint32_t*>(ring + slot * Slot<NC>::kBytes + NC * 2 * 32 * 16);
  }
  __device__ float2* epis(int slot) const {
    return reinterpret_cast<float2*>(ring + slot * Slot<NC>::kBytes + NC * 2 * 32 * 16 + NC * 32 * 4);
  }
  // Stores the pending unit's scale codes and epilogue values into its slot.
  __device__ __forceinline__ void settle() {
    if (pending < 0) return;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < NC; ++c) scales(pending)[c * 32 + lane] = sc[c];
    epis(pending)[lane] = ep;
    pending = -1;
  }
  __device__ __forceinline__ void issue(int slot) {
    settle();
    if (next.p < op.n_pairs) {
      issue_unit<K, NC>(op.rows(next), k, codes(slot), sc);
      ep = op.epilogue(next);
      pending = slot;
    }
    cp_async_commit();  // (empty past the end: the group count stays uniform)
    next = after(next);
  }
  __device__ __forceinline__ void start(Unit first) {
    next = first;
    for (int i = 0; i < kStages - 1; ++i) issue(i);
  }
  __device__ __forceinline__ void run(Unit u, const uint4* planes) {
    const int lane = threadIdx.x & 31, words = row_words(k);
#pragma unroll 1
    for (int i = 0; u.p < op.n_pairs; ++i, u = after(u)) {
      const int slot = i % kStages;
      cp_async_wait<kStages - 2>();            // this unit's copies (this lane's) have landed
      issue((i + kStages - 1) % kStages);      // into the slot the previous unit freed; settles unit i + 2
      const uint4* cs = codes(slot);
      const uint32_t* ss = scales(slot);
      const uint4* xs = planes + static_cast<size_t>(u.sub) * words;
      float acc[2][4] = {}, exact[2] = {};
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const Item it{cs[(2 * c) * 32 + lane], cs[(2 * c + 1) * 32 + lane], ss[c * 32 + lane]};
        compute_item<K>(it, xs + c * 128, NC * 128, acc, exact);
      }
      float v0, v1;
      pair_sums(acc, exact, v0, v1);
      op.finish(u, v0, v1, epis(slot)[lane]);
    }
    cp_async_wait<0>();
  }
};

template <WKind K>
__device__ __forceinline__ float post(const DevPart& p) {
  return K == WKind::kNVFP4 ? Fmt<K>::kPost * (p.divide ? 1.0f / p.global : p.global) : 1.0f;
}

// ---- Linear: y[r] = w[r] . x (+ bias[r])
// -------------------------------------------------------------------
template <WKind K>
struct LinearOp {
  const DevWeight& w;
  const float* bias;
  float* y;
  float unscale;
  int n_pairs, subs = 1;
  __device__ Rows rows(Unit u) const {
    int ra = 2 * u.p, rb = min(2 * u.p + 1, w.n - 1);
    const DevPart& pa = find_part(w, ra);
    const DevPart& pb = find_part(w, rb);
    return lane_rows<K>(pa, ra, pb, rb, w.k);
  }
  __device__ float2 epilogue(Unit u) const {
    if (!bias) return make_float2(0.0f, 0.0f);
    return make_float2(__ldg(bias + 2 * u.p), __ldg(bias + min(2 * u.p + 1, w.n - 1)));
  }
  __device__ void finish(Unit u, float v0, float v1, float2 b) const {  // lane 0: row 2p, lane 16: row 2p + 1
    const int lane = threadIdx.x & 31, r = 2 * u.p + (lane >> 4);
    if ((lane & 15) != 0 || r >= w.n) return;
    int rr = r;
    y[r] = (lane ? v1 : v0) * unscale * post<K>(find_part(w, rr)) + (lane ? b.y : b.x);
  }
};

// Dynamic shared memory: the staged activation rows, then each warp's ring (kStages x NC KiB). The block has
// as many warps (<= kWarps) as the launch fitted into shared memory.
__device__ __forceinline__ uint8_t* warp_ring(uint4* smem, int staged_rows, int k, int ring_bytes) {
  return reinterpret_cast<uint8_t*>(smem + static_cast<size_t>(staged_rows) * row_words(k)) +
         (threadIdx.x >> 5) * ring_bytes;
}

template <WKind K, int NC>
__global__ void __launch_bounds__(kThreads, 1)
    stream_linear_kernel(const __grid_constant__ DevWeight w, const float* __restrict__ x,
                         const float* __restrict__ bias, float* __restrict__ y) {
  extern __shared__ uint4 smem[];
  __shared__ float red[kMaxRows * kWarps], unscale[kMaxRows];
  const int nw = blockDim.x >> 5;
  LinearOp<K> op{w, bias, y, 0.0f, (w.n + 1) / 2};
  Walk<K, NC, LinearOp<K>> walk{op, w.k, static_cast<int>(gridDim.x) * nw, warp_ring(smem, 1, w.k, ring_bytes<NC>())};
  const Unit first{static_cast<int>(blockIdx.x) * nw + static_cast<int>(threadIdx.x >> 5), 0};
  walk.start(first);  // the weights do not come from the previous kernel: they stream in meanwhile
  pdl_wait();
  stage_rows(x, w.k, 1, w.k, smem, red, unscale);
  op.unscale = unscale[0];
  walk.run(first, smem);
}

// The routed experts of the one token, copied to shared memory once (their part tables are read per unit),
// with their ids and, for FC2, routing weights.
__device__ __forceinline__ void copy_experts(const DevWeight* table, const int32_t* ids, const float* weights,
                                             int top_k, DevWeight* dst, int* s_ids, float* s_weights) {
  static_assert(sizeof(DevWeight) % 4 == 0);
  constexpr int kWords = sizeof(DevWeight) / 4;
  for (int i = threadIdx.x; i < top_k * kWords; i += blockDim.x) {
    const int c = i / kWords, q = i % kWords;
    reinterpret_cast<uint32_t*>(dst + c)[q] = __ldg(reinterpret_cast<const uint32_t*>(table + ids[c]) + q);
  }
  if (threadIdx.x < top_k) {
    s_ids[threadIdx.x] = ids[threadIdx.x];
    if (weights) s_weights[threadIdx.x] = weights[threadIdx.x];
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

// ---- MoE FC1 + GLU: pair (choice i, output j) = gate row and up row of expert ids[i]
// -------------------------
template <WKind K>
struct Fc1Op {
  const DevWeight* sw;  // [top_k] in shared memory
  const ExpertTable& tab;
  const int* ids;  // [top_k] in shared memory
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
  __device__ Rows rows(Unit u) const {
    int i, j, ra, rb;
    gate_up(u.p, i, j, ra, rb);
    const DevPart& pa = find_part(sw[i], ra);
    const DevPart& pb = find_part(sw[i], rb);
    return lane_rows<K>(pa, ra, pb, rb, tab.d_model);
  }
  __device__ float2 epilogue(Unit u) const {  // the gate and up biases
    if (!tab.fc1_bias) return make_float2(0.0f, 0.0f);
    int i, j, ga, gb;
    gate_up(u.p, i, j, ga, gb);
    const float* b = tab.fc1_bias + static_cast<int64_t>(ids[i]) * 2 * tab.d_expert;
    return make_float2(__ldg(b + ga), __ldg(b + gb));
  }
  __device__ void finish(Unit u, float v0, float v1, float2 b) const {  // lane 0: both rows
    if ((threadIdx.x & 31) != 0) return;
    int i, j, ga, gb;
    gate_up(u.p, i, j, ga, gb);
    int ra = ga, rb = gb;
    const float gate = v0 * unscale * post<K>(find_part(sw[i], ra)) + b.x;
    const float up = v1 * unscale * post<K>(find_part(sw[i], rb)) + b.y;
    act[static_cast<int64_t>(i) * tab.d_expert + j] = glu(gate, up, kind, limit);
  }
};

template <WKind K, int NC>
__global__ void __launch_bounds__(kThreads, 1)
    stream_fc1_kernel(const __grid_constant__ ExpertTable tab, const int32_t* __restrict__ ids, int top_k,
                      const float* __restrict__ x, Glu kind, float limit, float* __restrict__ act) {
  extern __shared__ uint4 smem[];
  __shared__ float red[kMaxRows * kWarps], unscale[kMaxRows];
  __shared__ DevWeight sw[kMaxRows];
  __shared__ int s_ids[kMaxRows];
  pdl_wait();  // ids and x come from the previous kernels
  copy_experts(tab.fc1, ids, nullptr, top_k, sw, s_ids, nullptr);
  const int nw = blockDim.x >> 5;
  Fc1Op<K> op{sw, tab, s_ids, kind, limit, 0.0f, act, top_k * tab.d_expert};
  Walk<K, NC, Fc1Op<K>> walk{op, tab.d_model, static_cast<int>(gridDim.x) * nw, warp_ring(smem, 1, tab.d_model, ring_bytes<NC>())};
  const Unit first{static_cast<int>(blockIdx.x) * nw + static_cast<int>(threadIdx.x >> 5), 0};
  walk.start(first);  // in flight while x is staged
  stage_rows(x, tab.d_model, 1, tab.d_model, smem, red, unscale);
  op.unscale = unscale[0];
  walk.run(first, smem);
}

// ---- MoE FC2 + combine: y[r] = sum_i weights[i] (fc2_{ids[i]}[r] . act[i] + bias), choices in order
// ---------
template <WKind K>
struct Fc2Op {
  const DevWeight* sw;  // [top_k] in shared memory, as are ids, weights and unscale
  const ExpertTable& tab;
  const int* ids;
  const float* weights;
  const float* unscale;
  float* y;
  int n_pairs, subs;
  float sum = 0.0f;  // lane 0: row 2p, lane 16: row 2p + 1, over the choices so far
  __device__ Rows rows(Unit u) const {
    int ra = 2 * u.p, rb = min(2 * u.p + 1, tab.d_model - 1);
    const DevPart& pa = find_part(sw[u.sub], ra);
    const DevPart& pb = find_part(sw[u.sub], rb);
    return lane_rows<K>(pa, ra, pb, rb, tab.d_expert);
  }
  __device__ float2 epilogue(Unit u) const {  // the choice's biases of rows 2p, 2p + 1
    if (!tab.fc2_bias) return make_float2(0.0f, 0.0f);
    const float* b = tab.fc2_bias + static_cast<int64_t>(ids[u.sub]) * tab.d_model;
    return make_float2(__ldg(b + 2 * u.p), __ldg(b + min(2 * u.p + 1, tab.d_model - 1)));
  }
  __device__ void finish(Unit u, float v0, float v1, float2 b) {
    const int lane = threadIdx.x & 31, n = tab.d_model, r = 2 * u.p + (lane >> 4), i = u.sub;
    if ((lane & 15) != 0 || r >= n) return;
    int rr = r;
    const float v = (lane ? v1 : v0) * unscale[i] * post<K>(find_part(sw[i], rr));
    sum = (i == 0 ? 0.0f : sum) +
          weights[i] * (v + (lane ? b.y : b.x));  // weight after the bias (formats.md §2.4)
    if (i + 1 == subs) y[r] = sum;
  }
};

template <WKind K, int NC>
__global__ void __launch_bounds__(kThreads, 1)
    stream_fc2_kernel(const __grid_constant__ ExpertTable tab, const int32_t* __restrict__ ids,
                      const float* __restrict__ weights, int top_k, const float* __restrict__ act,
                      float* __restrict__ y) {
  extern __shared__ uint4 smem[];
  __shared__ float red[kMaxRows * kWarps], unscale[kMaxRows];
  __shared__ DevWeight sw[kMaxRows];
  __shared__ int s_ids[kMaxRows];
  __shared__ float s_weights[kMaxRows];
  pdl_wait();  // act, ids and weights come from the previous kernels
  copy_experts(tab.fc2, ids, weights, top_k, sw, s_ids, s_weights);
  const int nw = blockDim.x >> 5;
  Fc2Op<K> op{sw, tab, s_ids, s_weights, unscale, y, (tab.d_model + 1) / 2, top_k};
  Walk<K, NC, Fc2Op<K>> walk{op, tab.d_expert, static_cast<int>(gridDim.x) * nw,
                             warp_ring(smem, top_k, tab.d_expert, ring_bytes<NC>())};
  const Unit first{static_cast<int>(blockIdx.x) * nw + static_cast<int>(threadIdx.x >> 5), 0};
  walk.start(first);  // in flight while act is staged
  stage_rows(act, tab.d_expert, top_k, tab.d_expert, smem, red, unscale);
  walk.run(first, smem);
}

// ---- Launch
// --------------------------------------------------------------------------------------------------- Where
// the kernels run, NIBBLE_FP4_STREAM: unset = the linear layers with tall or long rows, where they measured
// faster than gemv_fp4.cu (lm_head: 201088 rows, +6 / +19 points of the read bandwidth MXFP4 / NVFP4; O: k
// 4096, +4 / +7 points; bench/NOTES.md) -- QKV (5120 x 2880) and the MoE projections measured no faster, so
// they stay on gemv_fp4.cu; 1 = every one-token linear and MoE projection; 0 = off. A measurement knob for
// the benchmarks; the CUDA tests set 1 so every kernel here is checked.
struct Use {
  bool all_linear, tall_linear, moe;
};
const Use& use() {
  static const Use u = [] {
    const char* e = std::getenv("NIBBLE_FP4_STREAM");
    if (e && e[0] == '0') return Use{false, false, false};
    if (e && e[0] == '1') return Use{true, true, true};
    return Use{false, true, false};
  }();
  return u;
}
bool linear_wanted(const DevWeight& w) {
  return use().all_linear || (use().tall_linear && (n_chunks(w.k) >= 4 || w.n >= 16384));
}

bool fp4(WKind kind) { return kind == WKind::kMXFP4 || kind == WKind::kNVFP4; }

// k in whole lanes (k % 32), at most kMaxChunks chunks; rows of 16-byte aligned codes and, for NVFP4,
// 2-byte aligned scale pairs.
constexpr int kMaxChunks = 4;
bool shape_ok(int k) { return k % 32 == 0 && k > 0 && n_chunks(k) <= kMaxChunks; }
bool aligned(const DevWeight& w) {
  if (!w.vec_ok || !shape_ok(w.k)) return false;
  for (int p = 0; p < w.n_parts; ++p)
    if (w.kind == WKind::kNVFP4 && reinterpret_cast<uintptr_t>(w.part[p].scales) % 2 != 0) return false;
  return true;
}

struct Device {
  int sms = 0, smem_optin = 0;
};
const Device& device() {
  static const Device d = [] {
    Device r;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&r.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return r;
  }();
  return d;
}

size_t ring_bytes_of(int nc) {
  return nc == 1 ? ring_bytes<1>() : nc == 2 ? ring_bytes<2>() : nc == 3 ? ring_bytes<3>() : ring_bytes<4>();
}

// Warps per block: as many as fit the shared memory next to `staged` activation rows (kWarps on the H100 /
// H200; fewer on GPUs with ~100 KiB per SM, where less needs to be in flight), or 0 if not even 2 fit.
int warps_for(int staged, int k) {
  const size_t reserve = 8 * 1024;  // static shared memory (expert descriptors, reductions) and slack
  const size_t fixed = stage_bytes(staged, k) + reserve, per_warp = ring_bytes_of(n_chunks(k));
  if (fixed + 2 * per_warp > static_cast<size_t>(device().smem_optin)) return 0;
  return static_cast<int>(std::min<size_t>(kWarps, (device().smem_optin - fixed) / per_warp));
}

// One block per SM (the ring takes most of its shared memory), fewer when there are fewer row pairs.
template <class Kernel, class... Args>
void launch(Kernel kernel, int warps, int staged, int k, int n_pairs, cudaStream_t s, Args... args) {
  const size_t smem = stage_bytes(staged, k) + ring_bytes_of(n_chunks(k)) * warps;
  // (Always: static shared memory counts against the 48 KiB default too.)
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int grid = std::max(1, std::min(device().sms, ceil_div(n_pairs, warps)));
  launch_pdl(kernel, grid, warps * 32, smem, s, args...);
  CUDA_CHECK(cudaGetLastError());
}

// Calls f.template operator()<NC>() with NC = the chunk count of k (1..kMaxChunks).
template <class F>
void with_chunks(int k, F&& f) {
  switch (n_chunks(k)) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    default: return f.template operator()<4>();
  }
}

template <WKind K>
void linear(const DevWeight& w, int warps, const float* x, const float* bias, float* y, cudaStream_t s) {
  with_chunks(w.k, [&]<int NC>() {
    launch(stream_linear_kernel<K, NC>, warps, 1, w.k, (w.n + 1) / 2, s, w, x, bias, y);
  });
}

template <WKind K>
void fc1(const ExpertTable& t, int warps, const int32_t* ids, int top_k, const float* x, Glu glu, float limit,
         float* act, cudaStream_t s) {
  with_chunks(t.d_model, [&]<int NC>() {
    launch(stream_fc1_kernel<K, NC>, warps, 1, t.d_model, top_k * t.d_expert, s, t, ids, top_k, x, glu, limit, act);
  });
}

template <WKind K>
void fc2(const ExpertTable& t, int warps, const int32_t* ids, const float* weights, int top_k, const float* act,
         float* y, cudaStream_t s) {
  with_chunks(t.d_expert, [&]<int NC>() {
    launch(stream_fc2_kernel<K, NC>, warps, top_k, t.d_expert, (t.d_model + 1) / 2, s, t, ids, weights, top_k, act,
           y);
  });
}

bool table_ok(const ExpertTable& t, int top_k, int k) {
  return use().moe && fp4(t.kind) && t.vec_ok && shape_ok(k) && top_k >= 1 && top_k <= kMaxRows;
}

}  // namespace

bool launch_linear_fp4_stream(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                              cudaStream_t s) {
  if (!fp4(w.kind) || m != 1 || !aligned(w) || !linear_wanted(w)) return false;
  const int warps = warps_for(1, w.k);
  if (warps == 0) return false;
  if (w.kind == WKind::kMXFP4) linear<WKind::kMXFP4>(w, warps, x, bias, y, s);
  else linear<WKind::kNVFP4>(w, warps, x, bias, y, s);
  return true;
}

// Expert tables: ExpertTable::vec_ok covers 16-byte rows; every expert tensor starts 256-byte aligned in the
// upload buffer, so the NVFP4 scale pairs are aligned too.
bool launch_moe_fc1_fp4_stream(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x,
                               Glu glu, float limit, float* act, cudaStream_t s) {
  if (n_pairs != top_k || !table_ok(t, top_k, t.d_model)) return false;
  const int warps = warps_for(1, t.d_model);
  if (warps == 0) return false;
  if (t.kind == WKind::kMXFP4) fc1<WKind::kMXFP4>(t, warps, ids, top_k, x, glu, limit, act, s);
  else fc1<WKind::kNVFP4>(t, warps, ids, top_k, x, glu, limit, act, s);
  return true;
}

bool launch_moe_fc2_fp4_stream(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens,
                               int top_k, const float* act, float* y, cudaStream_t s) {
  if (n_tokens != 1 || !table_ok(t, top_k, t.d_expert)) return false;
  const int warps = warps_for(top_k, t.d_expert);
  if (warps == 0) return false;
  if (t.kind == WKind::kMXFP4) fc2<WKind::kMXFP4>(t, warps, ids, weights, top_k, act, y, s);
  else fc2<WKind::kNVFP4>(t, warps, ids, weights, top_k, act, y, s);
  return true;
}

}  // namespace nb::cuda
