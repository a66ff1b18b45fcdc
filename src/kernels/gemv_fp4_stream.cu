// Row-streaming FP4 GEMV for one token (decode at batch 1): the linear layers, the attention head (RMSNorm +
// QKV + RoPE + K/V write, stream_qkv_kernel) and the MoE expert projections (FC1 + GLU, with the router's
// top-k when the routes are deferred; FC2 + weighted combine), MXFP4 and NVFP4, on the checkpoint layout as
// it is.
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
// times 2^(e - 127 + c) for MXFP4, c = 14 for any trained weight and lower for a row whose largest block
// would overflow fp16 -- exact for blocks within 2^24 of the row's largest; times ue4m3 * 2^7 for NVFP4,
// always exact; 2^(14 - c), 2^7 and the global scale come back per output).
// Activations: x * 2^s (max |x| into [2^14, 2^15)) as one fp16 (11 bits, the default: the prefill GEMMs'
// CudaBackendOptions::gemm_fp16_activations) or fp16 hi + lo (~22 bits, as gemv_fp4.cu: two MMAs per slice,
// so the products are exact in the fp32 accumulators); 2^-s comes back per output. One fp16 halves the
// MMAs and shared-memory loads: H200, lm_head MXFP4 68 -> 81 % of the read bandwidth, tg128 +6 %.
// Staged by the producer (one fp16): the MoE kernels' inputs can arrive already in the staged layout
// (stage.cuh) -- FC1's x from norm_route (launch_norm_route's staged_h), FC2's act from FC1 (StagedActs,
// gpt-oss's bounded GLU: a fixed 2^s) -- and are then copied into shared memory with cp.async after the
// wait instead of taking maxima, converting and storing there, on cold instruction caches (kStaged kernels).
//
// Work: a warp walks row pairs (strided over the grid's warps; FC2: the top_k warps of a group take the
// choices of the same pair). A "unit" is a pair (FC2: one choice of it) across every chunk of k: NC items of
// 2 x 16 code bytes and the scale bytes per lane, NC a template argument (k <= 4096: gpt-oss, Qwen3,
// Llama-8B attention; longer rows take gemv_fp4.cu). The
// next unit's loads go out before the current unit's math (double-buffered registers); where 16 warps per SM
// would leave a partial second round (gpt-oss's attention head), one round of up to 24 warps per SM, each
// with its one unit and no second buffer, takes the pairs instead (kOneRound). The linear kernel
// issues its first loads before waiting for the previous kernel (the weights do not depend on it), so they
// overlap the activation staging; FC2, whose routes are older than FC1 (launch_moe_fc2's contract),
// prefetches its first unit into L2 then and loads it once act's maxima are taken, as FC1 does once x's
// are: ptxas puts the activation and weight loads on one scoreboard, so a max taken after a weight load
// waits for that load (DRAM at a kernel's start; the linear kernels' weights are there by their wait).

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "backend/backend.h"  // kKvBlock
#include "backend/cuda/cuda_check.h"
#include "kernels/gemv.cuh"
#include "kernels/route.cuh"
#include "kernels/stage.cuh"

namespace nb::cuda {
namespace {

// Warps per block: 16 on sm_90 (the H100/H200 numbers in bench/RESULTS.md), 8 on sm_12x, whose ptxas
// spills 0.6-1 KiB per thread in the NVFP4 kernels under the 16-warp cap of 128 registers and needs none at
// 8 warps (up to 255 registers; less bandwidth per SM to cover there: GB10 273 GB/s over 48 SMs). The
// linear and FC1 blocks have exactly kBlockThreads threads, FC2's a multiple of top_k warps up to that;
// kWarps is the most any block has. NIBBLE_STREAM_WARPS_SM90 (a compile definition) sets sm_90's count for
// measurements (scripts/gpu-ab.sh NIBBLE_AB_VARIANTS; 20 and 24 measured slower, NOTES.md eleventh session).
#ifndef NIBBLE_STREAM_WARPS_SM90
#define NIBBLE_STREAM_WARPS_SM90 16
#endif
constexpr int kWarpsSm90 = NIBBLE_STREAM_WARPS_SM90;
static_assert(kWarpsSm90 >= 8 && kWarpsSm90 <= 32);
constexpr int kWarps = kWarpsSm90;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kBlockThreads = 256;
#else
constexpr int kBlockThreads = kWarpsSm90 * 32;
#endif
// The attention head's one-round blocks (stream_qkv_kernel<.., kOneRound>): up to this many warps, each with
// exactly one unit, so no second register buffer for a next unit (~30 registers fewer: 24 warps fit in 85).
constexpr int kOneRoundWarps = 24;
// The linear kernel's (its staging and the first unit's weights are live together: 85 registers spilled).
constexpr int kOneRoundWarpsLinear = 20;
constexpr int kMaxWarps = kWarps > kOneRoundWarps ? kWarps : kOneRoundWarps;
// sm_12x never launches the one-round kernels (one_round: it keeps its 8-warp rounds), so their bodies are not
// built there (ptxas spilled 12-28 bytes in them for sm_121a).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr bool kOneRoundBuilt = false;
#else
constexpr bool kOneRoundBuilt = true;
#endif
constexpr int kMaxRows = 8;  // staged activation rows (FC2: one per choice)
constexpr int kMaxSmem = 96 * 1024;

// Timestamps for measurement builds (gemv.cuh: stream_stamps). Off: stamp() compiles to nothing.
#ifndef NIBBLE_STREAM_STAMPS
#define NIBBLE_STREAM_STAMPS 0
#endif
enum StampKind { kStampLinear, kStampQkv, kStampFc1, kStampFc2 };
enum StampPoint { kAtEntry, kAtWaited, kAtRouted, kAtMaxed, kAtStaged, kAtLoaded, kAtUnit1, kAtWalked };
#if NIBBLE_STREAM_STAMPS
__device__ unsigned long long g_stamps[kStampKinds][kStampBlocks][kStampPoints];
#endif
// The linear kernels stamp only weights of fewer than 65536 rows: the lm_head does not overwrite the last O.
__device__ __forceinline__ bool stamps_linear(const DevWeight& w) { return w.n < 65536; }
__device__ __forceinline__ void stamp([[maybe_unused]] StampKind kind, [[maybe_unused]] StampPoint point) {
#if NIBBLE_STREAM_STAMPS
  if (blockIdx.x >= kStampBlocks || (point == kAtUnit1 && threadIdx.x >= 32)) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (point == kAtWalked) {  // the block's last warp
    if ((threadIdx.x & 31) == 0) atomicMax(&g_stamps[kind][blockIdx.x][point], t);
  } else if (threadIdx.x == 0) {
    g_stamps[kind][blockIdx.x][point] = t;
  }
#endif
}
// stamp() once `dep` (a register of the thread's first weight load) has arrived: kAtLoaded, whether the first
// unit's weights were in by the time x was staged. The wait this forces is the measurement's own cost.
__device__ __forceinline__ void stamp_after([[maybe_unused]] StampKind kind, [[maybe_unused]] StampPoint point,
                                            [[maybe_unused]] uint32_t dep) {
#if NIBBLE_STREAM_STAMPS
  if (blockIdx.x >= kStampBlocks || threadIdx.x != 0) return;
  uint32_t bump;
  asm volatile("{ .reg .pred p; setp.eq.u32 p, %1, 0x7fffffff; selp.u32 %0, 1, 0, p; }" : "=r"(bump) : "r"(dep));
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  g_stamps[kind][blockIdx.x][point] = t + bump;
#endif
}

// Staging, in phases so that its global-memory round trip overlaps other work: stage_index (before the
// kernel's wait) places this thread's first kHold octets (8 elements) of the rows, stage_issue loads them
// into registers; stage_max folds their max |x| (and that of any octets beyond, which stage_store reads
// again) into the block's per-row maxima (float bits, atomicMax: all non-negative; zeroed by stage_zero
// before a barrier); after a barrier stage_scales turns the maxima into power-of-two prescales (threads <
// rows); after another, stage_store writes the hi and lo planes; a final barrier before the planes are read.
// A warp's 32 consecutive octets share one row (rows hold a multiple of 128 octets), so the maxima reduce
// per warp first.
constexpr int kHold = 4;  // gpt-oss FC2 (4 rows of 2880) needs 3 per thread of 512
// The held octets' places (stage_index, before the kernel's wait: integer divisions, none of which depends
// on x; after the wait each launch runs its staging on cold instruction caches, the fewer instructions
// there the better) and values.
struct Held {
  float v[kHold][8];
  int row[kHold], elem[kHold], word[kHold];  // octet_at's; row -1: past the rows
};
struct StageShared {
  unsigned row_max[kMaxRows];
  float pre[kMaxRows], unscale[kMaxRows];
};

__device__ __forceinline__ void load_octet(const float* x, int64_t ld, int i, int e, int k, float (&v)[8]) {
  if (e >= k) {
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = 0.0f;
    return;
  }
  const float4 a = __ldg(reinterpret_cast<const float4*>(x + i * ld + e));
  const float4 b = __ldg(reinterpret_cast<const float4*>(x + i * ld + e) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ float octet_max(const float (&v)[8]) {
  float m = 0.0f;
#pragma unroll
  for (int q = 0; q < 8; ++q) m = fmaxf(m, fabsf(v[q]));
  return m;
}

__device__ __forceinline__ void stage_zero(StageShared& ss) {
  if (threadIdx.x < kMaxRows) ss.row_max[threadIdx.x] = 0u;
}
__device__ __forceinline__ void stage_index(int rows, int k, Held& h) {
  const int total = rows * n_chunks(k) * kChunk / 8;
#pragma unroll
  for (int j = 0; j < kHold; ++j) {
    const int f = threadIdx.x + j * blockDim.x;
    octet_at(f, k, h.row[j], h.elem[j], h.word[j]);
    if (f >= total) h.row[j] = -1;
  }
}
__device__ __forceinline__ void stage_issue(const float* __restrict__ x, int64_t ld, int k, Held& h) {
#pragma unroll
  for (int j = 0; j < kHold; ++j)
    if (h.row[j] >= 0) load_octet(x, ld, h.row[j], h.elem[j], k, h.v[j]);
}
__device__ void stage_max(const float* __restrict__ x, int64_t ld, int rows, int k, const Held& h, StageShared& ss) {
  const int total = rows * n_chunks(k) * kChunk / 8, lane = threadIdx.x & 31;
  auto fold = [&](int i, float m) {  // warp-uniform: the warp's octets share row i
    m = warp_max(m);
    if (lane == 0) atomicMax(&ss.row_max[i], __float_as_uint(m));
  };
#pragma unroll
  for (int j = 0; j < kHold; ++j)
    if (h.row[j] >= 0) fold(h.row[j], octet_max(h.v[j]));
  for (int f = threadIdx.x + kHold * blockDim.x; f < total; f += blockDim.x) {
    int i, e, w;
    octet_at(f, k, i, e, w);
    float v[8];
    load_octet(x, ld, i, e, k, v);
    fold(i, octet_max(v));
  }
}
__device__ __forceinline__ void stage_scales(int rows, StageShared& ss) {
  if (threadIdx.x < rows) {
    const int sh = fp16_prescale_shift(__uint_as_float(ss.row_max[threadIdx.x]));
    ss.pre[threadIdx.x] = pow2f(sh);
    ss.unscale[threadIdx.x] = pow2f(-sh);
  }
}
__device__ void stage_store(const float* __restrict__ x, int64_t ld, int rows, int k, const Held& h,
                            const StageShared& ss, bool split, uint4* planes) {
  const int total = rows * n_chunks(k) * kChunk / 8, half = hi_words(k);
  auto store = [&](int i, int w, float (&v)[8]) {
    const float p = ss.pre[i];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] *= p;
    uint4 hi, lo;
    split_octet(v, hi, lo);
    uint4* row = planes + static_cast<size_t>(i) * row_words(k);
    row[w] = hi;
    if (split) row[half + w] = lo;
  };
#pragma unroll
  for (int j = 0; j < kHold; ++j) {
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = h.v[j][q];
    if (h.row[j] >= 0) store(h.row[j], h.word[j], v);
  }
  for (int f = threadIdx.x + kHold * blockDim.x; f < total; f += blockDim.x) {
    int i, e, w;
    octet_at(f, k, i, e, w);
    float v[8];
    load_octet(x, ld, i, e, k, v);
    store(i, w, v);
  }
}

template <WKind K>
struct Fmt;
// Folds: the fp16x2 factor that turns a decoded E2M1 pair (e2m1 * 2^-14) into the weight times 2^(c - 14),
// c the row's window (MXFP4, below); fp4_post (gemv.cuh) and 2^(14 - c) come back per output.
template <>
struct Fmt<WKind::kMXFP4> {
  static constexpr int kBs = 32;
  // 2^(e - 127 + c) rounded to fp16 (exact for e + c in [103, 142]; the window keeps every block <= 142).
  __device__ static void folds(uint32_t s, int c, uint32_t (&f)[2]) {
    const __half h = __float2half_rn(__uint_as_float((s & 0xffu) + c << 23));
    f[0] = f[1] = pack_half2(h, h);
  }
  // The row's window c = min(14, 142 - max e) over the unit (all chunks of the row, every lane): 14 for any
  // trained weight (|w| <= 12: e <= 128), smaller for rows with larger blocks, whose blocks more than 2^24
  // below the row's largest then round (far under the fp32 sum's own error).
  template <int NC>
  __device__ static void windows(const uint32_t (&s0)[NC], const uint32_t (&s1)[NC], int& c0, int& c1) {
    uint32_t m0 = 0, m1 = 0;
#pragma unroll
    for (int i = 0; i < NC; ++i) m0 = max(m0, s0[i]), m1 = max(m1, s1[i]);
    c0 = min(14, 142 - static_cast<int>(__reduce_max_sync(0xffffffffu, m0)));
    c1 = min(14, 142 - static_cast<int>(__reduce_max_sync(0xffffffffu, m1)));
  }
};
template <>
struct Fmt<WKind::kNVFP4> {
  static constexpr int kBs = 16;
  // Blocks 0 and 1 of the lane's 32 elements (scale bytes 0, 1 of s): ue4m3 * 2^7 in fp16, always exact
  // (window fixed at 14). The 7 code bits at fp16 bits 7..13 are ue4m3 * 2^-8; times 2^15.
  __device__ static void folds(uint32_t s, int, uint32_t (&f)[2]) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const uint32_t h = (s >> (8 * b) & 0x7fu) << 7;
      f[b] = hmul2(h | h << 16, 0x78007800u);
    }
  }
  template <int NC>
  __device__ static void windows(const uint32_t (&)[NC], const uint32_t (&)[NC], int& c0, int& c1) {
    c0 = c1 = 14;
  }
};

// One item: a lane's 16 code bytes of rows r0 and r1 in one chunk, and their scale codes.
// The scale codes stay as loaded, one register per row: packing them into one register right after the
// loads made the warp wait there for the next unit's bytes before computing the current one (ncu: ~20 % of
// the stall samples on that one instruction, eighth session).
struct Item {
  uint4 a, b;
  uint32_t s0, s1;  // rows r0 and r1's scale codes (MXFP4: one byte, NVFP4: two)
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

// Weight loads that leave the L2 to everything else: each weight byte is read once per token, and at the
// default priority the ~2.7 GB a token streams evicted what the step reads again (the activations, the next
// kernels' code, the weights FC2 prefetches for the next layer). NIBBLE_STREAM_EVICT_FIRST=0 (a compile
// definition, for measurements) loads them at the default priority.
#ifndef NIBBLE_STREAM_EVICT_FIRST
#define NIBBLE_STREAM_EVICT_FIRST 1
#endif
__device__ __forceinline__ uint64_t stream_policy() {
  uint64_t p = 0;
#if NIBBLE_STREAM_EVICT_FIRST
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}
__device__ __forceinline__ uint4 ld_stream16(const void* a, [[maybe_unused]] uint64_t pol) {
#if NIBBLE_STREAM_EVICT_FIRST
  uint4 v;
  asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(a), "l"(pol));
  return v;
#else
  return __ldg(static_cast<const uint4*>(a));
#endif
}
template <int kBytes>  // 1 or 2
__device__ __forceinline__ uint32_t ld_stream_scale(const uint8_t* a, [[maybe_unused]] uint64_t pol) {
#if NIBBLE_STREAM_EVICT_FIRST
  uint32_t v;
  if constexpr (kBytes == 1) {
    asm("ld.global.nc.L2::cache_hint.u8 %0, [%1], %2;" : "=r"(v) : "l"(a), "l"(pol));
  } else {
    asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=r"(v) : "l"(a), "l"(pol));
  }
  return v;
#else
  if constexpr (kBytes == 1) return __ldg(a);
  return __ldg(reinterpret_cast<const uint16_t*>(a));
#endif
}

// A unit's NC items: every chunk of rows r0 and r1. Lanes past the end of the last chunk get zero codes
// (their staged activations are zeros too).
template <WKind K, int NC>
__device__ __forceinline__ void load_unit(const Rows& r, int k, Item (&it)[NC]) {
  const int lane = threadIdx.x & 31;
  constexpr int cs = kChunk / Fmt<K>::kBs;  // scale bytes of a row per chunk
  constexpr int sb = K == WKind::kMXFP4 ? 1 : 2;  // NVFP4: two adjacent bytes, 2-byte aligned (checked at launch)
  const uint64_t pol = stream_policy();
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    if (c == NC - 1 && c * kChunk + lane * 32 >= k) {
      it[c].a = it[c].b = make_uint4(0, 0, 0, 0);
      it[c].s0 = it[c].s1 = 127u;
      continue;
    }
    it[c].a = ld_stream16(r.codes[0] + c * (kChunk / 2), pol);
    it[c].b = ld_stream16(r.codes[1] + c * (kChunk / 2), pol);
    it[c].s0 = ld_stream_scale<sb>(r.scales[0] + c * cs, pol);
    it[c].s1 = ld_stream_scale<sb>(r.scales[1] + c * cs, pol);
  }
}

// load_unit's lines into L2 only (no registers, no scoreboard: nothing waits for them).
template <WKind K, int NC>
__device__ __forceinline__ void prefetch_unit(const Rows& r, int k) {
  const int lane = threadIdx.x & 31;
  constexpr int cs = kChunk / Fmt<K>::kBs;  // scale bytes of a row per chunk
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    if (c == NC - 1 && c * kChunk + lane * 32 >= k) continue;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(r.codes[0] + c * (kChunk / 2)));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(r.codes[1] + c * (kChunk / 2)));
    if (lane % 4 == 0) {  // (a lane's scale bytes: 1 or 2 of the 128-byte line the warp's 32 lanes share)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(r.scales[0] + c * cs));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(r.scales[1] + c * cs));
    }
  }
}

__device__ __forceinline__ uint32_t word(const uint4& c, int w) {
  return w == 0 ? c.x : w == 1 ? c.y : w == 2 ? c.z : c.w;
}

// acc[w / 2] += this item's products (rows r0, r1 against the lane's staged activations of the item's
// chunk: hi planes at xs, and with kSplit the lo planes at xs + half), the weights folded with the rows'
// windows c0, c1; two accumulator sets halve the HMMA dependency chain.
template <WKind K, bool kSplit>
__device__ __forceinline__ void compute_item(const Item& it, const uint4* xs, int half, int c0, int c1,
                                             float (&acc)[2][4]) {
  using F = Fmt<K>;
  const int lane = threadIdx.x & 31;
  const uint32_t sa = it.s0, sb = it.s1;
  uint32_t fa[2], fb[2];
  F::folds(sa, c0, fa);
  F::folds(sb, c1, fb);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 h = xs[w * 32 + lane], l = kSplit ? xs[half + w * 32 + lane] : uint4{};
    uint32_t ha[4], hb[4];
    e2m1_word(word(it.a, w), ha);
    e2m1_word(word(it.b, w), hb);
#pragma unroll
    for (int i = 0; i < 4; ++i) ha[i] = hmul2(ha[i], fa[w / 2]), hb[i] = hmul2(hb[i], fb[w / 2]);
    // Slice 2w + s: pairs 2s and 2s + 1 of the word (k positions 2t.. and 2t + 8.. of the slice).
    const uint32_t a0[4] = {ha[0], hb[0], ha[1], hb[1]}, a1[4] = {ha[2], hb[2], ha[3], hb[3]};
    float(&c)[4] = acc[w / 2];
    mma_f16_16816(c, a0, h.x, h.y);
    if (kSplit) mma_f16_16816(c, a0, l.x, l.y);
    mma_f16_16816(c, a1, h.z, h.w);
    if (kSplit) mma_f16_16816(c, a1, l.z, l.w);
  }
}

// The two rows' dots: the diagonal accumulator entries (lane t == g / 2 holds C[g][g] and C[g + 8][g]),
// reduced over the warp in 6 shuffles (the halves of the warp sum one row each,
// then swap). v0, v1 on every lane.
__device__ __forceinline__ void pair_sums(const float (&acc)[2][4], float& v0, float& v1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool diag = t == (g >> 1), odd = g & 1, upper = lane & 16;
  // The two sets added on every lane first, then selected (not added inside the selects: this way measured
  // +0.9 % tg128 over three rounds, eleventh session -- the unit's tail is on each warp's critical path).
  float s[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = acc[0][i] + acc[1][i];
  const float r0 = diag ? (odd ? s[1] : s[0]) : 0.0f;
  const float r1 = diag ? (odd ? s[3] : s[2]) : 0.0f;
  float keep = upper ? r1 : r0;
  keep += __shfl_xor_sync(0xffffffffu, upper ? r0 : r1, 16);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) keep += __shfl_xor_sync(0xffffffffu, keep, o);
  const float other = __shfl_xor_sync(0xffffffffu, keep, 16);
  v0 = upper ? other : keep;
  v1 = upper ? keep : other;
}

// One unit's two dots from its NC items (the row's staged activations at xs): the rows' windows, the items'
// products, the warp sums, each dot scaled back by 2^(14 - c) -- built from its bits (c <= 14; 1 unless a
// window moved): exp2f's special cases cost ~10 instructions per unit.
template <WKind K, int NC, bool kSplit>
__device__ __forceinline__ float2 unit_dots(const Item (&it)[NC], const uint4* xs) {
  uint32_t s0[NC], s1[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) s0[c] = it[c].s0, s1[c] = it[c].s1;
  int c0, c1;
  Fmt<K>::windows(s0, s1, c0, c1);
  float acc[2][4] = {};
#pragma unroll
  for (int c = 0; c < NC; ++c) compute_item<K, kSplit>(it[c], xs + c * 128, NC * 128, c0, c1, acc);
  float v0, v1;
  pair_sums(acc, v0, v1);
  return make_float2(v0 * __int_as_float(141 - c0 << 23), v1 * __int_as_float(141 - c1 << 23));
}

// A unit of work: row pair p; the MoE FC1 pair's choice i and output j too (p = i d_expert + j), which
// Fc1Op::next advances without a division.
struct Unit {
  int p, i, j;
};

// The walk shared by the three kernels. `op` says how many row pairs there are (op.n_pairs), which unit
// follows a warp's unit (op.next: warps stride over the pairs), where a unit reads (op.rows) and what
// happens with its two dots (op.finish, on every lane, with what op.epilogue loaded for the unit: biases).
// `cur` holds the first unit's items (the caller loads them, the linear kernel before waiting for the
// previous kernel). The next unit's loads -- weights and epilogue values, so that no global load latency
// is left for the finish -- go out before the current unit's math: NC items per warp in flight.
// kOneRound: the warp has exactly the one unit in `cur` (the caller sized the grid so): no next unit.
template <WKind K, int NC, bool kSplit, class Op, bool kOneRound = false>
__device__ __forceinline__ void walk(Op& op, int k, const uint4* planes, Unit u, Item (&cur)[NC]) {
  const int words = row_words(k);
  if constexpr (kOneRound) {
    const float2 epi = op.epilogue(u);
    const float2 v = unit_dots<K, NC, kSplit>(cur, planes + static_cast<size_t>(op.xrow()) * words);
    op.finish(u, v.x, v.y, epi);
    op.done();
    return;
  }
  Item nxt[NC];
  float2 epi = op.epilogue(u), epi_next;
  auto step = [&](Item(&now)[NC], Item(&next)[NC]) -> bool {
    const Unit un = op.next(u);
    const bool more = un.p < op.n_pairs;
    // Only while there is a next unit (a branch). The ninth session had FC1 load past its last unit instead
    // (the current unit again, no branch: under the branch ptxas then copied its loads into the buffer after
    // it); against today's code that placed the second step's loads behind its math, and the branch
    // measured tg128 +0.5 % (NOTES.md eighteenth session).
    if (more) load_unit<K, NC>(op.rows(un), k, next), epi_next = op.epilogue(un);
    const float2 v = unit_dots<K, NC, kSplit>(now, planes + static_cast<size_t>(op.xrow()) * words);
    op.finish(u, v.x, v.y, epi);
    u = un, epi = epi_next;
    return more;
  };
#if NIBBLE_STREAM_STAMPS
  const bool more = step(cur, nxt);
  if (op.stamped()) stamp(Op::kStamp, kAtUnit1);
  if (more)
    while (step(nxt, cur) && step(cur, nxt)) {
    }
#else
  static_cast<void>(Op::kStamp);
  while (step(cur, nxt) && step(nxt, cur)) {
  }
#endif
  op.done();  // (ops that defer their finish: Fc1Op, Fc2Op)
}

// ---- Linear: y[r] = w[r] . x (+ bias[r]) ----
template <WKind K, bool kFlat>
struct LinearOp {
  static constexpr StampKind kStamp = kStampLinear;  // (measurement builds)
  __device__ bool stamped() const { return stamps_linear(w); }
  const DevWeight& w;
  const float* bias;
  float* y;
  float unscale;
  int n_pairs, stride;
  // flat: one part, an even row count and NC <= 3 (the lm_head): pair p's rows are pair 0's plus p k code bytes
  // (two rows of k / 2) and p 2 k / kBs scale bytes, a 32 x 32 -> 64-bit multiply-add per pointer (a part's
  // codes are < 4 GiB: launch_linear_fp4_stream checks), no clamp of the second row. The lm_head walk executes
  // 548 instructions per unit instead of 560 (sm_90a SASS), and it is bound by them: H200, MXFP4 80.6 -> 80.1
  // us, NVFP4 86.8 -> 85.7 us. Not at NC = 4 (kFlat false: not compiled): the NVFP4 O kernel (one unit per
  // warp) spilled 12 bytes and lost 2 %.
  bool flat;
  Rows pair0;  // (flat) this lane's rows 0 and 1
  __device__ int xrow() const { return 0; }
  __device__ Unit next(Unit u) const { return Unit{u.p + stride, 0, u.p + stride}; }
  __device__ Rows rows(Unit u) const {
    if (kFlat && flat) {
      const uint32_t p = u.p, code_step = w.k, scale_step = 2 * w.k / Fmt<K>::kBs;
      Rows r;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        r.codes[i] = pair0.codes[i] + static_cast<uint64_t>(p) * code_step;
        r.scales[i] = pair0.scales[i] + static_cast<uint64_t>(p) * scale_step;
      }
      return r;
    }
    int ra = 2 * u.p, rb = min(2 * u.p + 1, w.n - 1);
    if (w.n_parts == 1) return lane_rows<K>(w.part[0], ra, w.part[0], rb, w.k);
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
    const float pf = w.n_parts == 1 ? fp4_post(K, w.part[0]) : fp4_post(K, find_part(w, rr));
    y[r] = (lane ? v1 : v0) * unscale * pf + (lane ? b.y : b.x);
  }
  __device__ void done() const {}
};

// x staged by its producer (kStaged, StagedRow: the attention kernel's output for the O projection) into
// shared memory: each thread's words of the planes, and to each warp its own copy of the groups' shifts, by
// cp.async -- no registers: the first unit's weight loads, in flight since before the wait, share the load
// scoreboard with any register load, and loading the planes into registers instead made the whole decode
// step 6 % slower (H200, twenty-sixth session) -- then each thread brings its own words to the row's one
// prescale 2^smin, smin = min_g s_g (the prescale the row's max gives, as stage_scales takes it): times
// 2^(smin - s_g), exact (a power of two; only values below fp16's normal range round again). One L2 round
// trip and one barrier after the wait, as the MoE kernels' staged inputs, against stage_issue ..
// stage_store's round trip, atomics and three barriers. Returns 2^-smin.
__device__ float stage_copy_row(const StagedRow& st, int k, uint4* planes) {
  __shared__ __align__(16) int8_t shifts[kMaxWarps][4 * 32];  // (k <= 4096: n_chunks(k) * 32 groups)
  const int lane = threadIdx.x & 31, groups = n_chunks(k) * 32, words = hi_words(k);
  int8_t* mine = shifts[threadIdx.x >> 5];
  const uint4* src = static_cast<const uint4*>(st.planes);
  for (int w = threadIdx.x; w < words; w += blockDim.x) cp_async16(planes + w, src + w, true);
  if (lane < groups / 16) cp_async16(mine + 16 * lane, st.shifts + 16 * lane, true);
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();  // the warp's shifts, copied by its first lanes, visible to all of its lanes
  int smin = 127;
  for (int g = lane; g < groups; g += 32) smin = min(smin, static_cast<int>(mine[g]));
  smin = __reduce_min_sync(0xffffffffu, smin);
  for (int w = threadIdx.x; w < words; w += blockDim.x) {  // (the words this thread copied)
    uint4 v = planes[w];
    const int g = w / 128 * 32 + w % 32;  // (chunk c, plane j, lane l): elements c 1024 + 32 l + 8 j ..
    const int sh = max(smin - static_cast<int>(mine[g]), -30);  // (<= -25: fp16's zero)
    const __half f = __float2half_rn(pow2f(sh));
    const uint32_t f2 = pack_half2(f, f);
    v.x = hmul2(v.x, f2), v.y = hmul2(v.y, f2), v.z = hmul2(v.z, f2), v.w = hmul2(v.w, f2);
    planes[w] = v;
  }
  __syncthreads();
  return pow2f(-smin);
}

// kOneRound: as stream_qkv_kernel's (Qwen3-30B-A3B's QKV: 2560 row pairs, as gpt-oss's head).
// kStaged: x staged by its producer (stage_copy_row).
template <WKind K, int NC, bool kSplit, bool kOneRound, bool kStaged>
__global__ void __launch_bounds__(kOneRound ? kOneRoundWarpsLinear * 32 : kBlockThreads, 1)
    stream_linear_kernel(const __grid_constant__ DevWeight w, const float* __restrict__ x,
                         const float* __restrict__ bias, float* __restrict__ y, const StagedRow staged) {
  static_assert(!(kStaged && (kSplit || kOneRound)), "staged x: one fp16 per activation, rounds of units");
  if constexpr (kOneRound && !kOneRoundBuilt) {  // never launched there (one_round)
    __trap();
    return;
  }
  extern __shared__ uint4 planes[];
  const bool stamped = stamps_linear(w);
  if (stamped) stamp(kStampLinear, kAtEntry);
  __shared__ StageShared ss;
  stage_zero(ss);
  __syncthreads();
  // (The host launches exactly Device::warps warps per block, or the one-round count.)
  const int nw = kOneRound ? static_cast<int>(blockDim.x >> 5) : kBlockThreads / 32;
  constexpr bool kFlat = NC <= 3;
  const bool flat = kFlat && w.n_parts == 1 && w.n % 2 == 0;  // (LinearOp::flat)
  LinearOp<K, kFlat> op{w, bias, y, 0.0f, (w.n + 1) / 2, static_cast<int>(gridDim.x) * nw, flat,
                 flat ? lane_rows<K>(w.part[0], 0, w.part[0], 1, w.k) : Rows{}};
  const int p0 = static_cast<int>(blockIdx.x) * nw + static_cast<int>(threadIdx.x >> 5);
  const Unit first{p0, 0, p0};
  // The first unit's weights stream in while the previous kernel finishes and x is staged.
  Item cur[NC];
  if (first.p < op.n_pairs) load_unit<K, NC>(op.rows(first), w.k, cur);
  if constexpr (kStaged) {
    pdl_wait();
    if (stamped) stamp(kStampLinear, kAtWaited);
    op.unscale = stage_copy_row(staged, w.k, planes);
  } else {
    Held h;
    stage_index(1, w.k, h);
    pdl_wait();
    if (stamped) stamp(kStampLinear, kAtWaited);
    stage_issue(x, w.k, w.k, h);
    stage_max(x, w.k, 1, w.k, h, ss);  // then barrier, prescales, barrier, planes, barrier
    if (stamped) stamp(kStampLinear, kAtMaxed);
    __syncthreads();
    stage_scales(1, ss);
    __syncthreads();
    stage_store(x, w.k, 1, w.k, h, ss, kSplit, planes);
    __syncthreads();
    op.unscale = ss.unscale[0];
  }
  if (stamped) stamp(kStampLinear, kAtStaged);
  if (stamped) stamp_after(kStampLinear, kAtLoaded, cur[0].a.x);
  if (first.p < op.n_pairs) walk<K, NC, kSplit, LinearOp<K, kFlat>, kOneRound>(op, w.k, planes, first, cur);
  if (stamped) stamp(kStampLinear, kAtWalked);
}

// ---- Attention head at one token: h = rms_norm(x + y) * norm_w, qkv = w h + bias, RoPE on q and k, k and v
// into the cache, q out: add_rms_norm, linear and qkv_rope_kv_write in one launch (QkvHeadArgs) ----
// A unit pairs the rows RoPE rotates together, (i, i + head_dim / 2) of a q or k head, so that the lane
// finishing it holds both; v rows pair as (2 j, 2 j + 1).
template <WKind K>
struct QkvOp {
  static constexpr StampKind kStamp = kStampQkv;  // (measurement builds)
  __device__ bool stamped() const { return true; }
  const DevWeight& w;
  const QkvHeadArgs& a;
  float unscale;
  int n_pairs, stride, qk_pairs, half;
  int pos;       // the token's position
  int64_t slot;  // its cache slot
  __device__ int xrow() const { return 0; }
  __device__ Unit next(Unit u) const { return Unit{u.p + stride, 0, 0}; }
  __device__ void pair_rows(int p, int& ra, int& rb) const {
    if (p < qk_pairs) {
      ra = p / half * a.s.head_dim + p % half, rb = ra + half;
    } else {
      ra = 2 * p, rb = ra + 1;  // (nh + nkv) hd + 2 (p - qk_pairs)
    }
  }
  __device__ Rows rows(Unit u) const {
    int ra, rb;
    pair_rows(u.p, ra, rb);
    if (w.n_parts == 1) return lane_rows<K>(w.part[0], ra, w.part[0], rb, w.k);
    const DevPart& pa = find_part(w, ra);
    const DevPart& pb = find_part(w, rb);
    return lane_rows<K>(pa, ra, pb, rb, w.k);
  }
  __device__ float2 epilogue(Unit u) const {
    if (!a.bias) return make_float2(0.0f, 0.0f);
    int ra, rb;
    pair_rows(u.p, ra, rb);
    return make_float2(__ldg(a.bias + ra), __ldg(a.bias + rb));
  }
  __device__ void store_kv(void* cache, int64_t i, float v) const {
    switch (a.kv) {
      case KvKind::kF32:
        static_cast<float*>(cache)[i] = v;
        break;
      case KvKind::kBF16:
        static_cast<uint16_t*>(cache)[i] = KvElem<KvKind::kBF16>::enc(v);
        break;
      case KvKind::kFP8:
        static_cast<uint8_t*>(cache)[i] = KvElem<KvKind::kFP8>::enc(v);
        break;
    }
  }
  __device__ void finish(Unit u, float v0, float v1, float2 b) const {  // lane 0: both rows
    if ((threadIdx.x & 31) != 0) return;
    int ra, rb;
    pair_rows(u.p, ra, rb);
    int la = ra, lb = rb;
    const float pa = w.n_parts == 1 ? fp4_post(K, w.part[0]) : fp4_post(K, find_part(w, la));
    const float pb = w.n_parts == 1 ? fp4_post(K, w.part[0]) : fp4_post(K, find_part(w, lb));
    // linear's value, then qkv_rope's expressions (the numbers of the separate ops)
    const float ya = v0 * unscale * pa + b.x, yb = v1 * unscale * pb + b.y;
    const QkvRopeShape& s = a.s;
    const int hd = s.head_dim, nkv = s.n_kv_heads;
    if (u.p >= qk_pairs) {
      const int64_t base = slot * nkv * hd + (ra - (s.n_heads + nkv) * hd);  // v head and element
      store_kv(a.v_cache, base, ya);
      store_kv(a.v_cache, base + 1, yb);
      return;
    }
    const int head = u.p / half, d = u.p % half;
    const float angle = static_cast<float>(pos) * __ldg(s.inv_freq + d);
    float sn, cs;
    sincosf(angle, &sn, &cs);
    cs *= s.attention_scale;
    sn *= s.attention_scale;
    const float y1 = ya * cs - yb * sn, y2 = yb * cs + ya * sn;
    if (head < s.n_heads) {
      a.q_out[head * hd + d] = y1;
      a.q_out[head * hd + d + half] = y2;
    } else {
      const int64_t base = (slot * nkv + (head - s.n_heads)) * hd + d;
      store_kv(a.k_cache, base, y1);
      store_kv(a.k_cache, base + half, y2);
    }
  }
  __device__ void done() const {}
};

// Staging of h = rms_norm(x + y) * norm_w (one row of k <= kMaxK): thread i holds octets i + blockDim j of the
// padded row (kNormHold of them); nw, this thread's norm weights, were loaded before the wait. The sum of
// squares adds per-warp partials in warp order (deterministic), the maxima as stage_max. Block 0 writes
// x + y to x_out.
constexpr int kMaxK = 4096;  // (shape_ok: k <= kMaxChunks chunks)
constexpr int kNormHold = (kMaxK / 8 + kBlockThreads - 1) / kBlockThreads;
struct NormShared {
  float partial[kMaxWarps];
};
// The thread's octets' places (as stage_index, before the wait): element (k past the row: zeros) and plane
// word, -1 past the planes.
struct NormPlaces {
  int at[kNormHold], word[kNormHold];
};
__device__ __forceinline__ void load_norm_weights(const float* norm_w, int k, float (&nw)[kNormHold][8],
                                                  NormPlaces& pl) {
#pragma unroll
  for (int j = 0; j < kNormHold; ++j) {
    const int f = threadIdx.x + j * blockDim.x;
    int i, e;
    octet_at(f, k, i, e, pl.word[j]);
    pl.at[j] = i == 0 ? e : k;
    if (f >= n_chunks(k) * kChunk / 8) pl.word[j] = -1;
    load_octet(norm_w, 0, 0, pl.at[j], k, nw[j]);
  }
}
__device__ void stage_norm(const QkvHeadArgs& a, int k, const float (&nw)[kNormHold][8], const NormPlaces& pl,
                           StageShared& ss, NormShared& ns, uint4* planes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[kNormHold][8];
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormHold; ++j) {
    const int at = pl.at[j];
    load_octet(a.x, 0, 0, at, k, v[j]);
    if (a.y) {
      float t[8];
      load_octet(a.y, 0, 0, at, k, t);
#pragma unroll
      for (int q = 0; q < 8; ++q) v[j][q] += t[q];
      if (a.x_out && blockIdx.x == 0 && at < k) {
        float4* o = reinterpret_cast<float4*>(a.x_out + at);
        o[0] = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
        o[1] = make_float4(v[j][4], v[j][5], v[j][6], v[j][7]);
      }
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) sq += v[j][q] * v[j][q];
  }
  sq = warp_sum(sq);
  if (lane == 0) ns.partial[warp] = sq;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) total += ns.partial[i];
  const float inv = rsqrtf(total / static_cast<float>(k) + a.eps);
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormHold; ++j) {
#pragma unroll
    for (int q = 0; q < 8; ++q) v[j][q] = nw[j][q] * (v[j][q] * inv);  // rms_norm's expression
    m = fmaxf(m, octet_max(v[j]));
  }
  m = warp_max(m);
  if (lane == 0) atomicMax(&ss.row_max[0], __float_as_uint(m));
  __syncthreads();
  stage_scales(1, ss);
  __syncthreads();
  const float p = ss.pre[0];
#pragma unroll
  for (int j = 0; j < kNormHold; ++j) {
    if (pl.word[j] < 0) continue;
#pragma unroll
    for (int q = 0; q < 8; ++q) v[j][q] *= p;
    uint4 hi, lo;
    split_octet(v[j], hi, lo);
    planes[pl.word[j]] = hi;
  }
  __syncthreads();
}

// kOneRound: every warp has exactly one unit (qkv_head sizes the grid so), blocks of up to kOneRoundWarps.
template <WKind K, int NC, bool kOneRound>
__global__ void __launch_bounds__(kOneRound ? kOneRoundWarps * 32 : kBlockThreads, 1)
    stream_qkv_kernel(const __grid_constant__ DevWeight w, const __grid_constant__ QkvHeadArgs a) {
  if constexpr (kOneRound && !kOneRoundBuilt) {  // never launched there (one_round)
    __trap();
    return;
  }
  extern __shared__ uint4 planes[];
  stamp(kStampQkv, kAtEntry);
  __shared__ StageShared ss;
  __shared__ NormShared ns;
  stage_zero(ss);
  // (The host launches exactly Device::warps warps per block, or the one-round count.)
  const int nw = kOneRound ? static_cast<int>(blockDim.x >> 5) : kBlockThreads / 32;
  const int half = a.s.head_dim / 2, qk_pairs = (a.s.n_heads + a.s.n_kv_heads) * half;
  QkvOp<K> op{w, a, 0.0f, qk_pairs + a.s.n_kv_heads * half, static_cast<int>(gridDim.x) * nw, qk_pairs, half, 0, 0};
  const int p0 = static_cast<int>(blockIdx.x) * nw + static_cast<int>(threadIdx.x >> 5);
  const Unit first{p0, 0, 0};
  // Before the wait: the first unit's weights, the norm weights, and where the token goes (batch metadata is
  // uploaded before the step's first kernel; read through L2, see pdl_wait).
  Item cur[NC];
  if (first.p < op.n_pairs) load_unit<K, NC>(op.rows(first), w.k, cur);
  float nwv[kNormHold][8];
  NormPlaces pl;
  load_norm_weights(a.norm_w, w.k, nwv, pl);
  op.pos = __ldcg(a.b.positions);
  op.slot = static_cast<int64_t>(__ldcg(a.b.tables + static_cast<int64_t>(__ldcg(a.b.seq_of)) * a.b.table_stride +
                                        op.pos / kKvBlock)) * kKvBlock + op.pos % kKvBlock;
  pdl_wait();
  stamp(kStampQkv, kAtWaited);
  stage_norm(a, w.k, nwv, pl, ss, ns, planes);
  op.unscale = ss.unscale[0];
  stamp(kStampQkv, kAtStaged);
  if (first.p < op.n_pairs) stamp_after(kStampQkv, kAtLoaded, cur[0].a.x);
  if (first.p < op.n_pairs) walk<K, NC, false, QkvOp<K>, kOneRound>(op, w.k, planes, first, cur);
  stamp(kStampQkv, kAtWalked);
}

__device__ __forceinline__ float map_bias(const RowMap& m, int r) { return m.bias ? __ldg(m.bias + r * m.step) : 0.0f; }
__device__ __forceinline__ Rows map_rows(const RowMap& a, int ra, const RowMap& b, int rb, int lane_scale_bytes) {
  const int lane = threadIdx.x & 31;
  Rows r;
  r.codes[0] = a.codes + static_cast<int64_t>(ra) * a.code_step + lane * 16;
  r.codes[1] = b.codes + static_cast<int64_t>(rb) * b.code_step + lane * 16;
  r.scales[0] = a.scales + static_cast<int64_t>(ra) * a.scale_step + lane * lane_scale_bytes;
  r.scales[1] = b.scales + static_cast<int64_t>(rb) * b.scale_step + lane * lane_scale_bytes;
  return r;
}

// The token's routes: ids [top_k] and weights [top_k] as routed, or (lg.logits set: deferred routes, FC1
// only) the router logits, whose top-k each block forms itself; block 0 then writes ids and weights out
// (fenced: FC2 reads them before its wait, see stream_fc1_kernel).
struct RouteSrc {
  int32_t* ids;
  float* weights;
  RouteLogits lg;
};

// The routed experts of the one token: thread i < top_k copies choice i's row maps (FC1: gate and up, FC2:
// one; ExpertTable::rows, built on the host) into shared memory, and for FC2 its routing weight. Deferred
// routes: warp 0 selects them from the logits first (route_warp, as the routing kernels do). Ends with a
// block barrier. (Routes are read through L2: FC2 reads them before its wait, see pdl_wait.) table:
// ExpertTable::rows or a copy of it in shared memory.
__device__ void map_experts(const RowMap* table, const RouteSrc& r, int top_k, bool fc1, RowMap (*maps)[kMaxRows],
                            float* s_weights) {
  __shared__ float s_logits[kRouteLogitsMaxExperts];
  __shared__ int32_t s_ids[kMaxRows];
  __shared__ float s_w[kMaxRows];
  const bool select = r.lg.logits != nullptr;
  if (select && threadIdx.x < 32) {
    load_logits_warp(r.lg.logits, r.lg.n_experts, s_logits);
    route_warp(s_logits, r.lg.n_experts, top_k, r.lg.softmax_first, r.lg.renormalize, s_ids, s_w);
    __syncwarp();
  }
  if (threadIdx.x < top_k) {
    const int i = threadIdx.x, id = select ? s_ids[i] : __ldcg(r.ids + i);
    const RowMap* m = table + 3 * static_cast<int64_t>(id);
    if (fc1) {
      maps[0][i] = m[0];
      maps[1][i] = m[1];
    } else {
      maps[0][i] = m[2];
    }
    if (s_weights) s_weights[i] = select ? s_w[i] : __ldcg(r.weights + i);
    if (select && blockIdx.x == 0) {
      r.ids[i] = id, r.weights[i] = s_w[i];
      __threadfence();
    }
  }
  __syncthreads();
}

// A warp's units held for a deferred finish (Fc1Op, Fc2Op): lane n % 32 keeps unit n's two dots, biases and
// pair, so that the op finishes up to 32 units on all lanes at once instead of each on one lane as it ends.
struct HeldUnits {
  float v0 = 0.0f, v1 = 0.0f;
  float2 b{};
  int p = 0;  // this lane's unit
  int n = 0;  // units held (warp-uniform)
  // u's values onto lane n; true once 32 are held (the op finishes them then, and sets n to 0).
  __device__ bool hold(Unit u, float d0, float d1, float2 bias) {
    if ((threadIdx.x & 31) == n) v0 = d0, v1 = d1, b = bias, p = u.p;
    return ++n == 32;
  }
  __device__ bool mine() const { return (threadIdx.x & 31) < n; }
};

// ---- MoE FC1 + GLU: pair (choice i, output j) = gate row and up row of expert ids[i] ----
// NIBBLE_FC1_DEFER=0 (a compile definition, for measurements) finishes each unit on lane 0 as it ends.
#ifndef NIBBLE_FC1_DEFER
#define NIBBLE_FC1_DEFER 1
#endif
template <WKind K>
struct Fc1Op {
  static constexpr StampKind kStamp = kStampFc1;  // (measurement builds)
  __device__ bool stamped() const { return true; }
  const RowMap (*maps)[kMaxRows];  // [gate, up][top_k] in shared memory
  const ExpertTable& tab;
  Glu kind;
  float limit, unscale;
  float* act;
  int n_pairs, stride, stride_i, stride_j;  // stride = stride_i d_expert + stride_j
  uint16_t* staged;  // act for FC2 as it stages it (StagedActs: fp16 bits times stage_pre), or null
  float stage_pre;
  __device__ int xrow() const { return 0; }
  __device__ Unit next(Unit u) const {
    Unit n{u.p + stride, u.i + stride_i, u.j + stride_j};
    if (n.j >= tab.d_expert) n.j -= tab.d_expert, ++n.i;
    return n;
  }
  __device__ Rows rows(Unit u) const {
    return map_rows(maps[0][u.i], u.j, maps[1][u.i], u.j, 32 / Fmt<K>::kBs);
  }
  __device__ float2 epilogue(Unit u) const {  // the gate and up biases
    return make_float2(map_bias(maps[0][u.i], u.j), map_bias(maps[1][u.i], u.j));
  }
  // The GLU and its stores, for pair p = i d_expert + j.
  __device__ void glu_out(int p, int i, int j, float v0, float v1, float2 b) const {
    const float gate = v0 * unscale * maps[0][i].post + b.x;
    const float up = v1 * unscale * maps[1][i].post + b.y;
    const float a = glu_value(gate, up, kind == Glu::kGptOssInterleaved || kind == Glu::kGptOssHalves, limit);
    act[p] = a;
    if (staged) staged[staged_half(i, j, tab.d_expert)] = __half_as_ushort(__float2half_rn(a * stage_pre));
  }
#if NIBBLE_FC1_DEFER
  // Deferred: lane n % 32 keeps the warp's unit n (its dots, biases and pair), and every 32 units, and after
  // the last, each lane holding one finishes it -- all lanes at once. Finished per unit on lane 0, the GLU
  // and the stores were ~70 of the walk's ~650 warp instructions per unit, with one lane working.
  HeldUnits held;
  __device__ void finish(Unit u, float v0, float v1, float2 b) {
    if (held.hold(u, v0, v1, b)) done();
  }
  __device__ void done() {
    if (held.mine()) {
      const int i = held.p / tab.d_expert;
      glu_out(held.p, i, held.p - i * tab.d_expert, held.v0, held.v1, held.b);
    }
    held.n = 0;
  }
#else
  __device__ void finish(Unit u, float v0, float v1, float2 b) const {  // lane 0: both rows
    if ((threadIdx.x & 31) == 0) glu_out(u.p, u.i, u.j, v0, v1, b);
  }
  __device__ void done() const {}
#endif
};

template <WKind K, int NC, bool kSplit, bool kStaged>
__global__ void __launch_bounds__(kBlockThreads, 1)
    stream_fc1_kernel(const __grid_constant__ ExpertTable tab, const RouteSrc routes, int top_k,
                      const float* __restrict__ x, Glu kind, float limit, float* __restrict__ act,
                      bool table_in_smem, uint16_t* __restrict__ staged, float stage_pre,
                      const uint4* __restrict__ staged_x, const __grid_constant__ PrefetchRanges prefetch) {
  static_assert(!(kStaged && kSplit), "staged x is one fp16 per activation");
  extern __shared__ uint4 planes[];  // the staged x; then, with table_in_smem, a copy of tab.rows
  stamp(kStampFc1, kAtEntry);
  __shared__ StageShared ss;
  __shared__ RowMap maps[2][kMaxRows];
  stage_zero(ss);  // (map_experts' barrier orders it before stage_max)
  // Every expert's row maps copied before the wait (they are fixed at load time): after the routes are known
  // the routed ones are a shared-memory read, not an L2 round trip on the step's critical path.
  const RowMap* table = tab.rows;
  if (table_in_smem) {
    RowMap* copy = reinterpret_cast<RowMap*>(planes + row_words(tab.d_model));
    const int words = 3 * tab.n_experts * static_cast<int>(sizeof(RowMap) / sizeof(uint2));
    for (int i = threadIdx.x; i < words; i += blockDim.x)
      reinterpret_cast<uint2*>(copy)[i] = __ldg(reinterpret_cast<const uint2*>(tab.rows) + i);
    __syncthreads();
    table = copy;
  }
  // Routes and x come from the previous kernels. FC2 launches after our trigger and reads the routes before
  // its wait (launch_moe_fc2's contract): routed ones are complete once we pass our wait; deferred ones
  // once block 0 has written and fenced them in map_experts, so the trigger follows that.
  const bool deferred = routes.lg.logits != nullptr;
  // Weights of later ops (the next layer's attention projections) into L2 before the wait: DRAM is idle
  // from here until our first weights go out, after the routes (launch_moe_fc1_logits' prefetch).
  issue_l2_prefetch(prefetch, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  Held h;
  if constexpr (!kStaged) stage_index(1, tab.d_model, h);
  // The walk's constants and the first unit (divisions by d_expert) before the wait, too.
  const int nw = static_cast<int>(blockDim.x) >> 5;  // (up to kBlockThreads / 32: fc1() below)
  const int stride = static_cast<int>(gridDim.x) * nw, d = tab.d_expert;
  Fc1Op<K> op{maps, tab, kind, limit, 0.0f, act, top_k * d, stride, stride / d, stride % d, staged, stage_pre};
  const int p0 = static_cast<int>(blockIdx.x) * nw + static_cast<int>(threadIdx.x >> 5);
  const Unit first{p0, p0 / d, p0 % d};
  pdl_wait_only();
  stamp(kStampFc1, kAtWaited);
  if (!deferred) pdl_launch();
  Item cur[NC];
  // kStaged: x staged by norm_route. A kernel of its own (one staging, one walk): both stagings in one
  // kernel, with a walk after each or one walk after both, changed ptxas' code for the walk and its rounds
  // by 25 % (NOTES.md eighteenth session).
  if constexpr (kStaged) {
    // x staged by norm_route (launch_norm_route's staged_h): its planes copied into shared memory while the
    // routes are formed (cp.async: no registers, so the first weights need not wait behind them).
    const int half = hi_words(tab.d_model);
    for (int w = threadIdx.x; w < half; w += blockDim.x) cp_async16(planes + w, staged_x + w, true);
    cp_async_commit();
    if (threadIdx.x == 0) ss.unscale[0] = __uint_as_float(__ldcg(&staged_x[half].x));
    map_experts(table, routes, top_k, true, maps, nullptr);
    stamp(kStampFc1, kAtRouted);
    if (deferred) pdl_launch();
    if (first.p < op.n_pairs) load_unit<K, NC>(op.rows(first), tab.d_model, cur);
    cp_async_wait<0>();
    __syncthreads();
  } else {
    stage_issue(x, tab.d_model, tab.d_model, h);  // x in flight while the experts' descriptors are fetched
    map_experts(table, routes, top_k, true, maps, nullptr);
    stamp(kStampFc1, kAtRouted);
    if (deferred) pdl_launch();
    // x's maxima before the first weights are requested: ptxas gives the x loads and the weight loads one
    // scoreboard, so a max taken after the weight loads waited for the weights (DRAM, ~2.5 us at the
    // kernel's start) instead of x (L2); after it, the barriers and the planes overlap the weights' latency
    // (tg128 +1 %, eleventh session).
    stage_max(x, tab.d_model, 1, tab.d_model, h, ss);  // then barrier, prescales, barrier, planes, barrier
    stamp(kStampFc1, kAtMaxed);
    if (first.p < op.n_pairs) load_unit<K, NC>(op.rows(first), tab.d_model, cur);  // in flight while x is staged
    __syncthreads();
    stage_scales(1, ss);
    __syncthreads();
    stage_store(x, tab.d_model, 1, tab.d_model, h, ss, kSplit, planes);
    __syncthreads();
  }
  op.unscale = ss.unscale[0];
  stamp(kStampFc1, kAtStaged);
  if (first.p < op.n_pairs) stamp_after(kStampFc1, kAtLoaded, cur[0].a.x);
  if (first.p < op.n_pairs) walk<K, NC, kSplit>(op, tab.d_model, planes, first, cur);
  stamp(kStampFc1, kAtWalked);
}

// NIBBLE_FC2_DEFER=0 (a compile definition, for measurements) combines each round as it ends.
#ifndef NIBBLE_FC2_DEFER
#define NIBBLE_FC2_DEFER 1
#endif
constexpr int kFc2Part = NIBBLE_FC2_DEFER ? 32 : 2;  // rounds of part

// ---- MoE FC2 + combine: y[r] = sum_i weights[i] (fc2_{ids[i]}[r] . act[i] + bias), in choice order ----
// The top_k warps of a group take the choices of one row pair each round (warp w: choice w % top_k), so
// every warp has work (one pair's choices in sequence left a third of gpt-oss's warps idle); each writes its
// weighted rows to shared memory and after a block barrier the group's first warp adds them in choice
// order (deterministic, the reference's order). Every warp walks the same number of rounds: the pair count
// is padded to whole rounds, and padding pairs load clamped rows and write nothing.
template <WKind K>
struct Fc2Op {
  static constexpr StampKind kStamp = kStampFc2;  // (measurement builds)
  __device__ bool stamped() const { return true; }
  const RowMap* maps;  // [top_k] in shared memory, as are weights and unscale
  const ExpertTable& tab;
  const float* weights;
  const float* unscale;
  float (*part)[kWarps][2];  // [kFc2Part rounds][warp][row] in shared memory
  float* y;
  int n_pairs, stride, real_pairs, top_k, choice, round = 0;  // a warp keeps its choice
  __device__ int xrow() const { return choice; }
  __device__ Unit next(Unit u) const { return Unit{u.p + stride, 0, u.p + stride}; }
  __device__ Rows rows(Unit u) const {
    const int p = min(u.p, real_pairs - 1);
    const RowMap& m = maps[choice];
    return map_rows(m, 2 * p, m, min(2 * p + 1, tab.d_model - 1), 32 / Fmt<K>::kBs);
  }
  __device__ float2 epilogue(Unit u) const {  // the choice's biases of rows 2p, 2p + 1
    const int p = min(u.p, real_pairs - 1);
    return make_float2(map_bias(maps[choice], 2 * p), map_bias(maps[choice], min(2 * p + 1, tab.d_model - 1)));
  }
  // Row r's weighted value: the weight after the bias (formats.md §2.4).
  __device__ float weighted(float v, float b) const {
    return weights[choice] * (v * unscale[choice] * maps[choice].post + b);
  }
#if NIBBLE_FC2_DEFER
  // Deferred, as Fc1Op's: lane n % 32 keeps the warp's round n (its dots, biases and pair); every 32 rounds,
  // and after the last, every warp writes the rounds it holds to part[lane] and after a block barrier the
  // groups' first warps add them -- one barrier per 32 rounds instead of one per round, and the sums on all
  // lanes at once. Every warp walks the same rounds, so all arrive at the barriers together.
  HeldUnits held;
  __device__ void finish(Unit u, float v0, float v1, float2 b) {
    if (held.hold(u, v0, v1, b)) done();
  }
  __device__ void done() {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = tab.d_model, r = 2 * held.p;
    const bool real = held.mine() && held.p < real_pairs;
    if (real) {
      part[lane][warp][0] = weighted(held.v0, held.b.x);
      if (r + 1 < n) part[lane][warp][1] = weighted(held.v1, held.b.y);
    }
    __syncthreads();
    if (choice == 0 && real) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (r + q >= n) break;
        float sum = 0.0f;
        for (int c = 0; c < top_k; ++c) sum += part[lane][warp + c][q];
        y[r + q] = sum;
      }
    }
    __syncthreads();  // (part is written again by the next 32 rounds)
    held.n = 0;
  }
#else
  __device__ void finish(Unit u, float v0, float v1, float2 b) {  // every warp of the block, every round
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = tab.d_model, q = lane >> 4, r = 2 * u.p + q;
    float(&mine)[kWarps][2] = part[round & 1];
    if ((lane & 15) == 0 && r < n && u.p < real_pairs) mine[warp][q] = weighted(q ? v1 : v0, q ? b.y : b.x);
    __syncthreads();  // (the other buffer is written next round: one barrier per round suffices)
    if (choice == 0 && (lane & 15) == 0 && r < n && u.p < real_pairs) {
      float sum = 0.0f;
      for (int c = 0; c < top_k; ++c) sum += mine[warp + c][q];
      y[r] = sum;
    }
    ++round;
  }
  __device__ void done() const {}
#endif
};

template <WKind K, int NC, bool kSplit, bool kStaged>
__global__ void __launch_bounds__(kBlockThreads, 1)
    stream_fc2_kernel(const __grid_constant__ ExpertTable tab, const RouteSrc routes, int top_k,
                      const float* __restrict__ act, float* __restrict__ y, int rounds,
                      const __grid_constant__ PrefetchRanges prefetch, const uint4* __restrict__ staged,
                      float staged_unscale) {
  static_assert(!(kStaged && kSplit), "staged act is one fp16 per activation");
  extern __shared__ uint4 planes[];
  stamp(kStampFc2, kAtEntry);
  __shared__ StageShared ss;
  __shared__ RowMap maps[1][kMaxRows];
  __shared__ float s_weights[kMaxRows];
  __shared__ float part[kFc2Part][kWarps][2];
  stage_zero(ss);  // (map_experts' barrier orders it before stage_max)
  const int warp = threadIdx.x >> 5, groups = (blockDim.x >> 5) / top_k, stride = gridDim.x * groups;
  const int real_pairs = (tab.d_model + 1) / 2;
  Fc2Op<K> op{maps[0], tab, s_weights, ss.unscale, part, y, rounds * stride, stride, real_pairs, top_k, warp % top_k};
  const int p0 = static_cast<int>(blockIdx.x) * groups + warp / top_k;
  const Unit first{p0, 0, p0};
  Item cur[NC];
  // The routes were complete when the previous kernel (FC1) let this one launch (launch_moe_fc2's contract:
  // see stream_fc1_kernel), so they and the experts' descriptors are read, and the first unit's weights
  // fetched, before our wait: only act comes from FC1.
  map_experts(tab.rows, routes, top_k, false, maps, s_weights);
  stamp(kStampFc2, kAtRouted);
  // kStaged: act staged by FC1 (StagedActs; a kernel of its own: see stream_fc1_kernel). After the wait only
  // a copy into shared memory, which holds no registers (cp.async), so the first unit's weights go straight
  // into registers now. Else they go into L2 now (no registers: see below), into registers once act's
  // maxima are in.
  if constexpr (kStaged) {
    load_unit<K, NC>(op.rows(first), tab.d_expert, cur);
    if (threadIdx.x < top_k) ss.unscale[threadIdx.x] = staged_unscale;
  } else {
    prefetch_unit<K, NC>(op.rows(first), tab.d_expert);
  }
  // Weights of the next ops (the next layer's attention projections) into L2 while this kernel leaves DRAM
  // half idle: after our first weights, so that those go out first; in place of a prefetch launch, whose
  // boundary sat on the step's critical path (~1 us per layer).
  issue_l2_prefetch(prefetch, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  Held h;
  if constexpr (!kStaged) stage_index(top_k, tab.d_expert, h);
  pdl_wait();  // act comes from the previous kernel
  stamp(kStampFc2, kAtWaited);
  if constexpr (kStaged) {
    const int half = hi_words(tab.d_expert), words = row_words(tab.d_expert);
    for (int w = threadIdx.x; w < half; w += blockDim.x)
      for (int i = 0; i < top_k; ++i) cp_async16(planes + i * words + w, staged + i * half + w, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  } else {
    stage_issue(act, tab.d_expert, tab.d_expert, h);
    stage_max(act, tab.d_expert, top_k, tab.d_expert, h, ss);  // then barrier, prescales, barrier, planes, barrier
    stamp(kStampFc2, kAtMaxed);
    // (Loaded into registers before the wait, as before the eleventh session, the weights shared the act
    // loads' scoreboard and the max waited for them: tg128 +1.5 % this way.)
    load_unit<K, NC>(op.rows(first), tab.d_expert, cur);
    __syncthreads();
    stage_scales(top_k, ss);
    __syncthreads();
    stage_store(act, tab.d_expert, top_k, tab.d_expert, h, ss, kSplit, planes);
    __syncthreads();
  }
  stamp(kStampFc2, kAtStaged);
  stamp_after(kStampFc2, kAtLoaded, cur[0].a.x);
  walk<K, NC, kSplit>(op, tab.d_expert, planes, first, cur);
  stamp(kStampFc2, kAtWalked);
}

}  // namespace

bool stream_stamps(bool clear, std::vector<uint64_t>* out) {
#if NIBBLE_STREAM_STAMPS
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
  constexpr size_t n = size_t{kStampKinds} * kStampBlocks * kStampPoints;
  if (clear) {
    void* p = nullptr;
    CUDA_CHECK(cudaGetSymbolAddress(&p, g_stamps));
    CUDA_CHECK(cudaMemset(p, 0, n * sizeof(uint64_t)));
  }
  if (out) {
    out->resize(n);
    CUDA_CHECK(cudaMemcpyFromSymbol(out->data(), g_stamps, n * sizeof(uint64_t)));
  }
  return true;
#else
  (void)clear, (void)out;
  return false;
#endif
}

namespace {

// ---- Launch ----
// NIBBLE_FP4_STREAM=0 turns these kernels off (gemv_fp4.cu's tensor-core kernels take one token then): a
// measurement knob for the benchmarks, and how the CUDA tests keep those kernels' one-token paths covered.
bool enabled() {
  static const bool on = knob_on("NIBBLE_FP4_STREAM");
  return on;
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
  int sms = 0, warps = kWarps;  // warps per block, as kBlockThreads for the device's arch
  bool sm12x = false;           // sm_12x: its one-round kernels are not built (kOneRoundBuilt)
};
const Device& device() {
  static const Device d = [] {
    Device r;
    int dev = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    r.warps = major >= 12 ? 8 : kWarpsSm90;
    r.sm12x = major >= 12;
    // NIBBLE_STREAM_SMS=n (tests): size the grids for at most n SMs, so that a warp walks many units (the
    // deferred finishes' flush every 32 units runs; Model::load checks the value).
    if (const char* e = std::getenv("NIBBLE_STREAM_SMS"); e && std::atoi(e) > 0) r.sms = std::min(r.sms, std::atoi(e));
    return r;
  }();
  return d;
}

// Blocks for n_pairs row pairs at `warps` per block: one per SM as the shared memory and registers allow,
// fewer when there are fewer pairs than warps.
template <class Kernel>
int grid_for(Kernel kernel, int warps, size_t smem, int n_pairs) {
  // (Always: static shared memory counts against the 48 KiB default too.)
  CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * 32, smem));
  return std::max(1, std::min(std::max(1, per_sm) * device().sms, ceil_div(n_pairs, warps)));
}

// Calls f.template operator()<NC, kSplit>() with NC = the chunk count of k (1..kMaxChunks) and kSplit =
// split (hi + lo activations).
template <class F>
void with_chunks(int k, bool split, F&& f) {
  auto go = [&]<int NC>() { return split ? f.template operator()<NC, true>() : f.template operator()<NC, false>(); };
  switch (n_chunks(k)) {
    case 1:
      return go.template operator()<1>();
    case 2:
      return go.template operator()<2>();
    case 3:
      return go.template operator()<3>();
    default:
      return go.template operator()<4>();
  }
}

// One round: where the pairs need a second round of Device::warps warps per SM (gpt-oss's attention head:
// 2560 pairs on 132 x 16 warps, the last 448 a second round of ~3 us) but fit one of up to kOneRoundWarps,
// blocks of ceil(pairs / SMs) warps take one unit each (H200 tg128 +3 %, NOTES.md fifteenth session).
// Measured on sm_90 only; NIBBLE_STREAM_ONE_ROUND=0 keeps the rounds. sm_12x keeps them always (kOneRoundBuilt).
bool one_round(int pairs, int max_warps, int& warps) {
  static const bool on = knob_on("NIBBLE_STREAM_ONE_ROUND");
  const Device& d = device();
  warps = ceil_div(pairs, std::max(1, d.sms));
  return on && !d.sm12x && d.warps == kWarpsSm90 && warps > d.warps && warps <= max_warps;
}

template <WKind K>
void linear(const DevWeight& w, const float* x, const float* bias, float* y, bool split, cudaStream_t s,
            const StagedRow* staged) {
  const size_t smem = stage_bytes(1, w.k);
  const int pairs = (w.n + 1) / 2;
  int one_warps = 0;
  const bool one = one_round(pairs, kOneRoundWarpsLinear, one_warps);
  // (The one-round grids stage x themselves: no gpt-oss O projection takes them.)
  const StagedRow st = staged && !split && !one ? *staged : StagedRow{};
  with_chunks(w.k, split, [&]<int NC, bool kSplit>() {
    if (one) {
      auto kernel = stream_linear_kernel<K, NC, kSplit, true, false>;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      launch_pdl(kernel, ceil_div(pairs, one_warps), one_warps * 32, smem, s, w, x, bias, y, st);
      return;
    }
    auto go = [&](auto kernel) {
      const int warps = device().warps;
      launch_pdl(kernel, grid_for(kernel, warps, smem, pairs), warps * 32, smem, s, w, x, bias, y, st);
    };
    if constexpr (!kSplit) {
      if (st.planes) return go(stream_linear_kernel<K, NC, false, false, true>);
    }
    go(stream_linear_kernel<K, NC, kSplit, false, false>);
  });
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void qkv_head(const DevWeight& w, const QkvHeadArgs& a, cudaStream_t s) {
  const size_t smem = stage_bytes(1, w.k);
  const int pairs = (a.s.n_heads + 2 * a.s.n_kv_heads) * a.s.head_dim / 2;
  int one_warps = 0;
  const bool one = one_round(pairs, kOneRoundWarps, one_warps);
  auto go = [&](auto kernel, auto kernel_one) {
    if (one) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel_one, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      launch_pdl(kernel_one, ceil_div(pairs, one_warps), one_warps * 32, smem, s, w, a);
      return;
    }
    const int warps = device().warps;
    launch_pdl(kernel, grid_for(kernel, warps, smem, pairs), warps * 32, smem, s, w, a);
  };
  switch (n_chunks(w.k)) {
    case 1: return go(stream_qkv_kernel<K, 1, false>, stream_qkv_kernel<K, 1, true>);
    case 2: return go(stream_qkv_kernel<K, 2, false>, stream_qkv_kernel<K, 2, true>);
    case 3: return go(stream_qkv_kernel<K, 3, false>, stream_qkv_kernel<K, 3, true>);
    default: return go(stream_qkv_kernel<K, 4, false>, stream_qkv_kernel<K, 4, true>);
  }
}

// StagedActs' shift for this GLU: every |act| <= limit (limit + 1) (gpt-oss's clamped SwiGLU: gate <= limit,
// gate sigmoid(1.702 gate) > -0.17, |up + 1| <= limit + 1) lands below 2^14; false where act is unbounded.
bool staged_shift(Glu glu, float limit, int& shift) {
  if (glu != Glu::kGptOssInterleaved && glu != Glu::kGptOssHalves) return false;
  if (!(limit > 0.0f && limit <= 4096.0f)) return false;  // (NaN too)
  const double bound = std::max(1.0, static_cast<double>(limit)) * (limit + 1.0);
  shift = 14 - static_cast<int>(std::ceil(std::log2(bound)));
  return true;
}

// Where this launch's FC1 stages act for FC2 (StagedActs), or null; records what it staged in st.
uint16_t* stage_for_fc2(StagedActs* st, int top_k, int d_expert, Glu glu, float limit, bool split, const float* act,
                        float& pre) {
  if (!st) return nullptr;
  int shift = 0;
  st->act = nullptr;
  if (split || !st->planes || st->rows < top_k || st->d_expert != d_expert || !staged_shift(glu, limit, shift))
    return nullptr;
  st->act = act, st->shift = shift;
  pre = std::ldexp(1.0f, shift);
  return static_cast<uint16_t*>(st->planes);
}

template <WKind K>
void fc1(const ExpertTable& t, const RouteSrc& r, int top_k, const float* x, Glu glu, float limit,
         float* act, bool split, cudaStream_t s, StagedActs* st, const void* staged_x = nullptr,
         const PrefetchRanges& prefetch = PrefetchRanges{}) {
  // Every warp the same number of row-pair units, on as many SMs as that allows: the fewest warps per block
  // whose grid of (nearly) full rounds still fits one block per SM (gpt-oss: 11520 pairs, 128 blocks x 15
  // warps x 6 rounds -- 90 units per SM; 16 warps took 120 blocks, 96 units per SM; 132 blocks x 16 left the
  // last round 45 % full). NIBBLE_FC1_EVEN=0 keeps 16 warps on every SM (measurement knob).
  static const bool even = knob_on("NIBBLE_FC1_EVEN");
  // With at most 256 experts their row maps fit in shared memory beside x (gpt-oss-120b: 15 KiB).
  const bool table_in_smem = t.n_experts <= kRouteLogitsMaxExperts;
  static_assert(sizeof(RowMap) % sizeof(uint2) == 0);
  const size_t smem = stage_bytes(1, t.d_model) + (table_in_smem ? 3 * sizeof(RowMap) * t.n_experts : 0);
  const int n_pairs = top_k * t.d_expert;
  float pre = 1.0f;
  uint16_t* staged = stage_for_fc2(st, top_k, t.d_expert, glu, limit, split, act, pre);
  with_chunks(t.d_model, split, [&]<int NC, bool kSplit>() {
    auto go = [&](auto kernel) {
      int warps = device().warps, grid = grid_for(kernel, warps, smem, n_pairs);
      if (even) {
        const int rounds = ceil_div(n_pairs, grid * warps), max_grid = grid;
        for (int w = warps; w >= 1 && ceil_div(n_pairs, rounds * w) <= max_grid; --w)
          warps = w, grid = ceil_div(n_pairs, rounds * w);
      }
      launch_pdl(kernel, grid, warps * 32, smem, s, t, r, top_k, x, glu, limit, act, table_in_smem, staged, pre,
                 static_cast<const uint4*>(staged_x), prefetch);
    };
    if constexpr (!kSplit) {
      if (staged_x) return go(stream_fc1_kernel<K, NC, false, true>);
    }
    go(stream_fc1_kernel<K, NC, kSplit, false>);
  });
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void fc2(const ExpertTable& t, const RouteSrc& r, int top_k, const float* act, float* y, bool split,
         const PrefetchRanges& prefetch, const StagedActs* st, cudaStream_t s) {
  // act as the last FC1 launch given st staged it (stage_for_fc2 checked the room and the shapes then).
  const bool use = st && act && st->act == act && !split;
  const uint4* staged = use ? static_cast<const uint4*>(st->planes) : nullptr;
  const float unscale = use ? std::ldexp(1.0f, -st->shift) : 1.0f;
  // Blocks of warps / top_k groups of top_k warps; rounds of gridDim x groups pairs, the grid sized so that
  // the last round is (nearly) full.
  const size_t smem = stage_bytes(top_k, t.d_expert);
  const int groups = device().warps / top_k, n_pairs = (t.d_model + 1) / 2;
  with_chunks(t.d_expert, split, [&]<int NC, bool kSplit>() {
    auto go = [&](auto kernel) {
      const int max_grid = grid_for(kernel, groups * top_k, smem, n_pairs * top_k);  // (pairs x top_k warps)
      const int rounds = ceil_div(n_pairs, max_grid * groups), grid = ceil_div(n_pairs, rounds * groups);
      launch_pdl(kernel, grid, groups * top_k * 32, smem, s, t, r, top_k, act, y, rounds, prefetch, staged, unscale);
    };
    if constexpr (!kSplit) {
      if (staged) return go(stream_fc2_kernel<K, NC, false, true>);
    }
    go(stream_fc2_kernel<K, NC, kSplit, false>);
  });
  CUDA_CHECK(cudaGetLastError());
}

// Routes as routed (the kernels only read them).
RouteSrc route_ids(const int32_t* ids, const float* weights) {
  return RouteSrc{const_cast<int32_t*>(ids), const_cast<float*>(weights), RouteLogits{}};
}

bool table_ok(const ExpertTable& t, int top_k, int k) {
  return enabled() && fp4(t.kind) && t.vec_ok && t.simple_rows && t.rows && shape_ok(k) && top_k >= 1 && top_k <= kMaxRows &&
         stage_bytes(top_k, k) <= kMaxSmem;
}

}  // namespace

int stream_grid_sms() { return device().sms; }

bool launch_linear_fp4_stream(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                              bool fp16_acts, cudaStream_t s, const StagedRow* staged) {
  if (!enabled() || !fp4(w.kind) || m != 1 || !aligned(w)) return false;
  if (w.n_parts == 1 && static_cast<int64_t>(w.n) * w.k / 2 >= (int64_t{1} << 32)) return false;  // (LinearOp)
  if (w.kind == WKind::kMXFP4)
    linear<WKind::kMXFP4>(w, x, bias, y, !fp16_acts, s, staged);
  else
    linear<WKind::kNVFP4>(w, x, bias, y, !fp16_acts, s, staged);
  return true;
}

bool qkv_head_stream_supports(const DevWeight& w, const QkvRopeShape& s, bool fp16_acts) {
  return enabled() && fp16_acts && fp4(w.kind) && aligned(w) && !s.q_norm && !s.k_norm && s.head_dim % 2 == 0 &&
         w.n == (s.n_heads + 2 * s.n_kv_heads) * s.head_dim && w.k % 8 == 0;
}

void launch_qkv_head_stream(const DevWeight& w, const QkvHeadArgs& a, cudaStream_t s) {
  NB_CHECK(qkv_head_stream_supports(w, a.s, true) && a.x && a.norm_w && a.b.n_tokens == 1 && (!a.y || a.x_out != a.x),
           "qkv_head: unsupported weight or head layout");
  if (w.kind == WKind::kMXFP4)
    qkv_head<WKind::kMXFP4>(w, a, s);
  else
    qkv_head<WKind::kNVFP4>(w, a, s);
  CUDA_CHECK(cudaGetLastError());
}

// Expert tables: ExpertTable::vec_ok covers 16-byte rows; every expert tensor starts 256-byte aligned in the
// upload buffer, so the NVFP4 scale pairs are aligned too.
bool launch_moe_fc1_fp4_stream(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k,
                               const float* x, Glu glu, float limit, float* act, bool fp16_acts, cudaStream_t s,
                               StagedActs* staged) {
  if (n_pairs != top_k || !table_ok(t, top_k, t.d_model)) return false;
  if (t.kind == WKind::kMXFP4)
    fc1<WKind::kMXFP4>(t, route_ids(ids, nullptr), top_k, x, glu, limit, act, !fp16_acts, s, staged);
  else
    fc1<WKind::kNVFP4>(t, route_ids(ids, nullptr), top_k, x, glu, limit, act, !fp16_acts, s, staged);
  return true;
}

bool launch_moe_fc2_fp4_stream(const ExpertTable& t, const int32_t* ids, const float* weights,
                               int64_t n_tokens, int top_k, const float* act, float* y, bool fp16_acts,
                               cudaStream_t s, PrefetchRanges* prefetch, const StagedActs* staged) {
  if (n_tokens != 1 || !table_ok(t, top_k, t.d_expert)) return false;
  const PrefetchRanges pf = prefetch ? *prefetch : PrefetchRanges{};
  if (t.kind == WKind::kMXFP4)
    fc2<WKind::kMXFP4>(t, route_ids(ids, weights), top_k, act, y, !fp16_acts, pf, staged, s);
  else
    fc2<WKind::kNVFP4>(t, route_ids(ids, weights), top_k, act, y, !fp16_acts, pf, staged, s);
  if (prefetch) prefetch->n = 0;  // (issued by the kernel)
  return true;
}

bool moe_fp4_stream_supports(const ExpertTable& t, int top_k, int n_experts) {
  return table_ok(t, top_k, t.d_model) && table_ok(t, top_k, t.d_expert) && top_k <= n_experts &&
         n_experts <= kRouteLogitsMaxExperts;
}

void launch_moe_fc1_logits(const ExpertTable& t, const RouteLogits& r, int top_k, int32_t* ids, float* weights,
                           const float* x, Glu glu, float limit, float* act, bool fp16_acts, cudaStream_t s,
                           StagedActs* staged, const void* staged_x, PrefetchRanges* prefetch) {
  NB_CHECK(moe_fp4_stream_supports(t, top_k, r.n_experts) && r.logits && ids && weights,
           "moe_fc1: routes as logits need the one-token FP4 kernels");
  const RouteSrc src{ids, weights, r};
  const PrefetchRanges pf = prefetch ? *prefetch : PrefetchRanges{};
  if (t.kind == WKind::kMXFP4)
    fc1<WKind::kMXFP4>(t, src, top_k, x, glu, limit, act, !fp16_acts, s, staged, staged_x, pf);
  else
    fc1<WKind::kNVFP4>(t, src, top_k, x, glu, limit, act, !fp16_acts, s, staged, staged_x, pf);
  if (prefetch) prefetch->n = 0;  // (issued by the kernel)
}

size_t staged_acts_bytes(int rows, int d_expert) { return size_t{16} * rows * hi_words(d_expert); }

}  // namespace nb::cuda
