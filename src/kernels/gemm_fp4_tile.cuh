// The block tile shared by the dense FP4 GEMM (gemm_fp4.cu) and the MoE grouped GEMM (moe_gemm.cu):
// C[BM tokens, 128 weight rows] += A[BM, k] (fp16, from launch_gemm_activations) x W^T, W in MXFP4 or NVFP4
// as the checkpoint stores it (codes [n, k/2], scales [n, k/blk]; no repacking). Portable sm_80-era
// instructions only (cp.async, ldmatrix, mma.sync m16n8k16), so GB10 runs the same code as the H200.
//
// Per k-tile of 64: cp.async brings A (and A's fp16 remainder "lo") into a ring of stages; this thread's
// 16 (4 warps: 32) bytes of the 128 rows' codes and their block scales come one step ahead into registers
// (plain loads); the block decodes the codes once into one of two fp16 weight tiles in shared memory (so
// the warps that share a weight column do not decode it twice) and the warps run the MMAs from ldmatrix
// fragments: 8 warps (4 x 2 of 32 x 64 at BM = 128, 2 x 4 of 32 x 32 at BM = 64) or, at BM = 128, 4 warps
// (2 x 2 of 64 x 64). Step k+1 is decoded into the other weight tile in four quarters, one after each k16
// slice of step k's MMAs, so the ALU work issues while the tensor pipe is busy, and one barrier per step
// suffices. Optionally (kPrefetch) the next slice's fragments are read during the current slice's MMAs.
// Decoding: E2M1 -> fp16 by bit operations (common.cuh: a code becomes e2m1 * 2^-14 exactly), then the block
// factor as an fp16 folded into the weight (one multiply, below):
//   MXFP4: 2^e (E8M0) is exact in fp16 for e in [-24, 15]; e2m1 * 2^e is exact for e in [-23, 13], i.e. any
//   block whose largest |w| lies in [2^-24, 49152]. Trained weights sit far inside (|w| ~ 2^-12 .. 2^2);
//   a block outside would round (below) or overflow (above). Folding costs one mul per element pair and no
//   fp32 re-scaling of the accumulators per 32-element block (which would double their registers).
//   NVFP4: e2m1 * ue4m3 is always exact in fp16 (at most 6 significant bits, |v| in [2^-10, 2688]); the
//   part's global scale (multiply or divide convention) is applied per output column in the epilogue.
// One multiply per element pair: the codes decode to e2m1 * 2^-14 (e2m1_word), and the block factor carries
// the 2^14 back, less a fixed power of two kFold that the epilogue multiplies back (fold_of<K>):
//   MXFP4: F = 2^(e + 14) (kFold = 1) while that fits fp16, e <= 1 (block max |w| up to 12); a block with
//   e in [2, 13] takes F = 2^15 and a second factor 2^(e - 1), a multiply its whole warp pays (a vote) and
//   trained checkpoints (|w| ~ 2^-12 .. 2^2) hardly ever need (the hi + lo tiles always pay it). Same exact
//   range as above, [-23, 13].
//   NVFP4: F = ue4m3 * 2^6 in [2^-3, 28672] (kFold = 2^-8): the weight stored as e2m1 * ue4m3 * 2^-8, exact
//   (at most 6 significant bits, >= 2^-18).
// The k order inside every 8 elements is permuted (0,4,1,5,2,6,3,7) -- the order the bit trick yields
// pairs in -- and the activations are stored in the same order, so the sum is the same.
#pragma once

#include <cuda_fp16.h>

#include "kernels/common.cuh"

namespace nb::cuda::gemm {

constexpr int kBN = 128;  // weight rows (output columns) per block
constexpr int kBK = 64;   // k per pipeline stage
constexpr int kWarps = 8, kThreads = kWarps * 32;

// Per output column of the tile: the weight row it reads (-1: none) and the NVFP4 global scale.
struct ColInfo {
  int row[kBN];
  float global[kBN];
  bool divide[kBN];
};

template <int BM, bool kSplit, bool kPrefetch = false, int kW = kWarps>
struct Tile {
  static_assert(BM == 64 || BM == 128, "64- or 128-row tiles");
  static_assert(kW == kWarps || (kW == 4 && BM == 128), "4 warps: 128 x 128 tiles only");
  static constexpr int kRows = BM;
  static constexpr bool kSplitA = kSplit, kPf = kPrefetch;
  static constexpr int kThreadsT = kW * 32;
  // Warp grid. 8 warps: 32-row warp tiles; at BM = 128, 4 x 2 (32 x 64 warp tiles read 20 % fewer shared bytes
  // per MMA in hi + lo than 64 x 32); at BM = 64, 2 x 4, so that a small expert's rows still spread over 4
  // warps and the registers stay low enough for 3 blocks per SM (bench/NOTES.md). 4 warps: 2 x 2 of 64 x 64
  // (a quarter fewer shared bytes per MMA again, 128 accumulators per thread).
  static constexpr int kWarpsM = kW == 4 ? 2 : BM / 32, kWarpsN = kW / kWarpsM;
  static constexpr int kWarpRows = BM / kWarpsM;
  static constexpr int kMT = kWarpRows / 16;        // m16 tiles per warp
  static constexpr int kNT = kBN / (8 * kWarpsN);   // n8 tiles per warp
  // Decode: kRowThreads threads per weight row, each decoding kHalves 32-wide k halves per k-tile.
  static constexpr int kRowThreads = kThreadsT / kBN, kHalves = 2 / kRowThreads;
  // Blocks per SM asked of __launch_bounds__ (and shared memory sized for them on the H200's 228 KiB):
  // BM = 64 grids (M = 512, every MoE tile) are many small blocks whose latency more blocks hide.
  // kPrefetch (a second set of fragment registers) needs more than the 85 registers 3 blocks leave.
  static constexpr int kMinBlocks = BM == 64 && !kPrefetch && kW == kWarps ? 3 : 2;
  static constexpr int kABytes = BM * kBK * 2;      // one fp16 A tile
  static constexpr int kStageBytes = kABytes * (kSplit ? 2 : 1);
  static constexpr int kBBytes = kBN * kBK * 2;  // one decoded fp16 weight tile (two of them)
  // GB10 (sm_121) allows 99 KiB of shared memory per block, ColInfo included, and 3 blocks of an H200 SM
  // 75 KiB each: as many A stages as fit, up to 4 (hi + lo: 2).
  static constexpr int kBudget = (kMinBlocks == 3 ? 75 : 99) * 1024 - static_cast<int>(sizeof(ColInfo)) - 2 * kBBytes;
  static constexpr int kStages = kBudget / kStageBytes < 4 ? kBudget / kStageBytes : 4;
  static_assert(kStages >= 2, "the A ring needs two stages");
  static constexpr int kSmem = kStages * kStageBytes + 2 * kBBytes;
  using Acc = float[kMT][kNT][4];  // mma C fragments: [m16 tile][n8 tile][4]
  // What __launch_bounds__ asks for: kMinBlocks where the SM's shared memory holds them (sm_90: 228 KiB);
  // sm_12x (GB10: ~100 KiB per SM) holds one block of either size, so its registers are not squeezed (at 128,
  // the prefetching dense tile spilled there); so does the measurement build -DNIBBLE_TILE_ONEBLOCK, which
  // runs sm_12x's occupancy on an sm_90 GPU (gemm_fp4.cu).
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200) || defined(NIBBLE_TILE_ONEBLOCK)
  static constexpr int kLaunchMinBlocks = 1;
#else
  static constexpr int kLaunchMinBlocks = kMinBlocks;
#endif
};

// 16-byte chunk `chunk` (0..7) of 128-byte row `row`, XOR-swizzled so that ldmatrix (8 rows, one chunk) and
// the cp.async / decode stores (consecutive chunks) hit distinct banks.
__device__ __forceinline__ int swz(int row, int chunk) { return row * 8 + (chunk ^ (row & 7)); }

using cuda::cp_async16;  // (common.cuh; the tiles name them gemm::)
using cuda::cp_async_commit;
using cuda::cp_async_wait;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

using nb::cuda::hmul2;  // (common.cuh; the wgmma tile names it gemm::hmul2)

// fp16 bits of a UE4M3 code's value (exact: at most 448, at least 2^-9): the 7 bits at fp16 bits 7..13 are
// the value * 2^-8, times 256.
__device__ __forceinline__ uint32_t ue4m3_half_bits(uint32_t c) {
  const uint32_t h = (c & 0x7fu) << 7;
  return hmul2(h | (h << 16), 0x5c005c00u) & 0xffffu;  // 0x5c00 = 256
}

// a * (b's low half in both halves) or a * (b's high half in both): fp16x2 bits. ptxas folds the broadcast into
// the HMUL2's operand (.H0_H0 / .H1_H1), so two factors share one register.
__device__ __forceinline__ uint32_t hmul2_lo(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, %2;\nmov.b32 t, {l, l};\nmul.rn.f16x2 %0, %1, t;\n}"
      : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t hmul2_hi(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, %2;\nmov.b32 t, {h, h};\nmul.rn.f16x2 %0, %1, t;\n}"
      : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The power of two the decoded weights carry (the header's kFold): the epilogue multiplies it back.
template <WKind K>
__host__ __device__ constexpr float fold_of() { return K == WKind::kMXFP4 ? 1.0f : 256.0f; }

// fp16 bits of 2^x for x in [-127, 127] (0 or subnormal below fp16's range, inf above), through fp32 and one
// conversion: branch-free.
__device__ __forceinline__ uint32_t pow2_half_bits(int x) {
  return __half_as_ushort(__float2half_rn(__int_as_float((x + 127) << 23)));
}
// fp16 bits of 2^(e - 127) for an E8M0 code: exact for exponents in [-24, 15], 0 below, inf above, NaN for 0xFF.
// One conversion and a select: written as range checks it compiled to three compares and branches per call
// (ncu, 31st session: 12.6 % of the block tile's stall samples).
__device__ __forceinline__ uint32_t e8m0_half_bits(uint32_t e) {
  return e == 0xffu ? 0x7e00u : pow2_half_bits(static_cast<int>(e) - 127);
}
// An E8M0 code's one-multiply factors for e2m1_word's pairs (e2m1 * 2^-14), fp16 bits in one word: low half
// f = 2^(x + 14) for x = e - 127 <= 1 (else 2^15), high half g = 2^(x - 1) for the rare blocks above (else 1);
// NaN for e = 0xFF.
__device__ __forceinline__ uint32_t e8m0_fold_bits(uint32_t e) {
  const int x = static_cast<int>(e) - 127;
  const uint32_t hf = pow2_half_bits(min(x, 1) + 14);
  const uint32_t hg = e == 0xffu ? 0x7e00u : x > 1 ? pow2_half_bits(x - 1) : 0x3c00u;
  return hf | (hg << 16);
}

// This thread's weight row for the decode: tile row tid / 2, k half tid % 2 of each 64-wide k-tile.
struct BRow {
  const uint8_t* codes = nullptr;   // [k/2] E2M1 codes of the row, or null past the weight
  const uint8_t* scales = nullptr;  // [k/32] E8M0 or [k/16] UE4M3
};

__device__ __forceinline__ void set_col(ColInfo& ci, int c, const DevWeight& w, int row) {
  ci.row[c] = row;
  ci.global[c] = 1.0f;
  ci.divide[c] = false;
  if (row >= 0 && w.kind == WKind::kNVFP4) {
    int r = row;
    const DevPart& p = find_part(w, r);
    ci.global[c] = p.global;
    ci.divide[c] = p.divide;
  }
}

__device__ __forceinline__ BRow brow_of(const DevWeight& w, int row, int k, int scale_block) {
  BRow b;
  if (row < 0) return b;
  const DevPart& p = find_part(w, row);
  b.codes = p.data + static_cast<int64_t>(row) * (k / 2);
  b.scales = p.scales + static_cast<int64_t>(row) * (k / scale_block);
  return b;
}

// acc[mt][nt][4] (mma C layout) += A[rows a_rows, k] x W^T over the whole k for this block's 128 columns.
// a_hi / a_lo: the tile's first A row, row stride k (fp16, permuted k order); rows >= a_rows read as zero.
// T: a Tile<...>; br: this thread's weight row, tile row threadIdx.x / T::kRowThreads. kSkipEmpty: m16 tiles
// without rows (the tail of M, a small expert) skip their MMAs. That data-dependent branch makes the compiler
// fence every m16 tile's MMAs with reconvergence points (BSSY / WARPSYNC; a predicated mma.sync compiles to a
// branch per MMA), so the dense GEMM, whose only partial tile is the last, multiplies the zero rows instead.
template <WKind K, class T, bool kSkipEmpty>
__device__ __forceinline__ void mainloop(uint8_t* smem, const __half* __restrict__ a_hi, const __half* __restrict__ a_lo,
                                         int a_rows, int k, const BRow& br, typename T::Acc& acc) {
  constexpr int BM = T::kRows, H = T::kHalves;
  constexpr bool kSplit = T::kSplitA, kPrefetch = T::kPf;
  constexpr int S = T::kStages;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int warp_m = warp / T::kWarpsN, warp_n = warp % T::kWarpsN;
  auto stage_a = [&](int s, int lo) { return reinterpret_cast<uint4*>(smem + s * T::kStageBytes + lo * T::kABytes); };
  // Decoded weights [128][64] fp16, buffer kt % 2 for k-tile kt.
  auto tile_b = [&](int kt) { return reinterpret_cast<uint4*>(smem + S * T::kStageBytes + (kt & 1) * T::kBBytes); };
  const int n_kt = (k + kBK - 1) / kBK;
  static_assert(T::kRowThreads == 2 || T::kRowThreads == 1, "1 or 2 threads per weight row");
  const int my_row = T::kRowThreads == 2 ? tid >> 1 : tid, my_half = T::kRowThreads == 2 ? tid & 1 : 0;  // first of H halves

  // A: this thread copies 16-byte chunk a_ch of rows a_r0 + i * kRowStep (i < kCopies) of every k-tile; the
  // swizzle keeps the chunk's column for all of them (kRowStep is a multiple of 8), so the shared offsets
  // are one base plus constants and the global ones one pointer plus kt * 64.
  constexpr int kRowStep = T::kThreadsT / 8, kCopies = BM / kRowStep;
  static_assert(kRowStep % 8 == 0 && BM % kRowStep == 0, "whole rows of chunks per pass");
  const int a_r0 = tid >> 3, a_ch = tid & 7, a_dst = swz(a_r0, a_ch);
  const unsigned a_src = a_r0 * k + a_ch * 8, a_step = kRowStep * k;  // < BM * k elements: fits 32 bits
  const __half* const a_p0 = a_hi + a_src;  // this thread's first row and chunk
  unsigned a_live = 0;                      // bit i: row a_r0 + i * kRowStep holds a token
#pragma unroll
  for (int i = 0; i < kCopies; ++i) a_live |= static_cast<unsigned>(a_r0 + i * kRowStep < a_rows) << i;
  // One fp16: a pointer stepped by rows (fewer instructions than offsets; H100 M = 2048 NVFP4 -2 to -6 %, MXFP4
  // -1 %). hi + lo: unsigned offsets into both halves (its two pointers that way were 3-7 % slower).
  auto load_a = [&](int kt, int s) {
    const int k0 = kt * kBK;
    const bool k_ok = k0 + a_ch * 8 < k;
    if constexpr (kSplit) {
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const bool ok = k_ok && a_r0 + i * kRowStep < a_rows;
        const unsigned off = ok ? a_src + i * a_step + k0 : 0u;  // (no pointer selects or sign extension)
        cp_async16(stage_a(s, 0) + a_dst + i * kRowStep * 8, a_hi + off, ok);
        cp_async16(stage_a(s, 1) + a_dst + i * kRowStep * 8, a_lo + off, ok);
      }
    } else {
      const __half* p = a_p0 + k0;  // rows without tokens read nothing (a_hi as the address)
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const bool ok = k_ok && ((a_live >> i) & 1u);
        cp_async16(stage_a(s, 0) + a_dst + i * kRowStep * 8, ok ? p : a_hi, ok);
        p += a_step;
      }
    }
  };
  // This thread's 32 codes of k-tile kt (tile row my_row, k half `half`) and their scale codes (MXFP4: one,
  // NVFP4: two); zeros past k or the weight, so decoding them writes zeros. The factors are formed at the
  // decode, a step later, so nothing waits for these loads before then.
  auto fetch = [&](int kt, int half, uint4& c, uint32_t (&sc)[2]) {
    const int kk = kt * kBK + 32 * half;
    c = make_uint4(0, 0, 0, 0);
    sc[0] = sc[1] = 0;
    if (!br.codes || kk >= k) return;
    const unsigned u = static_cast<unsigned>(kk);  // (unsigned: the divisions are plain shifts)
    c = __ldg(reinterpret_cast<const uint4*>(br.codes + u / 2));
    if constexpr (K == WKind::kMXFP4) {
      sc[0] = __ldg(br.scales + u / 32);
    } else {
      sc[0] = __ldg(br.scales + u / 16);
      sc[1] = __ldg(br.scales + u / 16 + 1);
    }
  };
  // The factors of a half's scale codes (the header's one-multiply fold) as two fp16 in one word: MXFP4 f (low)
  // and g (high, 1 unless the block's exponent is above 1: e8m0_fold_bits); NVFP4 the factors of its two
  // 16-element halves.
  auto factors = [&](const uint32_t (&sc)[2]) -> uint32_t {
    if constexpr (K == WKind::kMXFP4) {
      return e8m0_fold_bits(sc[0]);
    } else {
      const uint32_t h = ((sc[0] & 0x7fu) << 7) | ((sc[1] & 0x7fu) << 23);  // ue4m3 * 2^-8 as fp16 bits
      return hmul2(h, 0x74007400u);                                         // * 2^14 = ue4m3 * 2^6
    }
  };
  // Quarter q (codes word q: 8 codes) of the decode into one 16-byte chunk of weight tile b. `slow`: some lane
  // of the warp has an MXFP4 block above 2^1 (warp-uniform). The hi + lo tiles always multiply g too: their
  // registers do not hold the vote's branch without spilling (MXFP4, 128 rows), and their MMAs dominate.
  auto decode = [&](const uint4& c, uint32_t fa, bool slow, int half, int q, uint4* b) {
    const uint32_t word = q == 0 ? c.x : q == 1 ? c.y : q == 2 ? c.z : c.w;
    uint32_t h[4];
    e2m1_word(word, h);  // e2m1 * 2^-14
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = K == WKind::kNVFP4 && q >= 2 ? hmul2_hi(h[i], fa) : hmul2_lo(h[i], fa);
    if (K == WKind::kMXFP4 && (kSplit || slow)) {
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = hmul2_hi(h[i], fa);
    }
    b[swz(my_row, 4 * half + q)] = make_uint4(h[0], h[1], h[2], h[3]);
  };
  auto any_slow = [&](const uint32_t (&fa)[H]) {
    bool s = false;
#pragma unroll
    for (int h = 0; h < H; ++h) s |= (fa[h] >> 16) != 0x3c00u;
    return K == WKind::kMXFP4 && !kSplit && __any_sync(0xffffffffu, s);
  };

  // One k16 slice's fragments: B for the warp's n8 tiles, A (and lo) for its m16 tiles.
  struct Frags {
    uint32_t b[T::kNT][2];
    uint32_t a[T::kMT][4];
    uint32_t l[T::kMT][4];
  };
  const int mt_rows = a_rows - warp_m * T::kWarpRows;  // rows of this warp's tile (kSkipEmpty: for its breaks)
  auto load_b = [&](const uint4* bs, int ks, uint32_t (&b)[T::kNT][2]) {
    const int j = lane >> 3;
#pragma unroll
    for (int p = 0; p < T::kNT / 2; ++p) {
      const int r = warp_n * (kBN / T::kWarpsN) + p * 16 + (j >> 1) * 8 + (lane & 7);
      uint32_t v[4];
      ldmatrix_x4(v, bs + swz(r, 2 * ks + (j & 1)));
      b[2 * p][0] = v[0], b[2 * p][1] = v[1], b[2 * p + 1][0] = v[2], b[2 * p + 1][1] = v[3];
    }
  };
  auto load_a_frag = [&](const uint4* sa, int ks, int mt, uint32_t (&a)[4]) {  // rows past a_rows: zeros
    const int j = lane >> 3, r = warp_m * T::kWarpRows + mt * 16 + (j & 1) * 8 + (lane & 7);
    ldmatrix_x4(a, sa + swz(r, 2 * ks + (j >> 1)));
  };
  auto mma_row = [&](int mt, const uint32_t (&a)[4], const uint32_t (&b)[T::kNT][2]) {
#pragma unroll
    for (int nt = 0; nt < T::kNT; ++nt) mma_f16_16816(acc[mt][nt], a, b[nt][0], b[nt][1]);
  };
  auto load_frags = [&](const uint4* bs, const uint4* sa, const uint4* sl, int ks, Frags& fr) {
    load_b(bs, ks, fr.b);
#pragma unroll
    for (int mt = 0; mt < T::kMT; ++mt) {
      if (kSkipEmpty && mt * 16 >= mt_rows) break;
      load_a_frag(sa, ks, mt, fr.a[mt]);
      if constexpr (kSplit) load_a_frag(sl, ks, mt, fr.l[mt]);
    }
  };
  auto mmas = [&](const Frags& fr) {
#pragma unroll
    for (int mt = 0; mt < T::kMT; ++mt) {
      if (kSkipEmpty && mt * 16 >= mt_rows) break;
      mma_row(mt, fr.a[mt], fr.b);
      if constexpr (kSplit) mma_row(mt, fr.l[mt], fr.b);
    }
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < n_kt) load_a(s, s);
    cp_async_commit();
  }
  uint4 c[H];
  uint32_t sc[H][2];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    fetch(0, my_half + h, c[h], sc[h]);
    // Tile 0 always takes MXFP4's second multiply (g is 1 unless a block needs it), so no vote here.
#pragma unroll
    for (int q = 0; q < 4; ++q) decode(c[h], factors(sc[h]), true, my_half + h, q, tile_b(0));
    fetch(1, my_half + h, c[h], sc[h]);
  }
  for (int kt = 0; kt < n_kt; ++kt) {
    cp_async_wait<S - 2>();
    // A stage kt landed for every thread and weight tile kt is decoded; every warp is done with step kt - 1,
    // so its A stage and its weight buffer (the one tile kt + 1 goes to) are free.
    __syncthreads();
    if (kt + S - 1 < n_kt) load_a(kt + S - 1, (kt + S - 1) % S);
    cp_async_commit();
    uint4 cn[H];  // codes and factors of tile kt + 1 (zeros past the end: decoded into a free buffer)
    uint32_t fn[H];
#pragma unroll
    for (int h = 0; h < H; ++h) {
      cn[h] = c[h];
      fn[h] = factors(sc[h]);
      fetch(kt + 2, my_half + h, c[h], sc[h]);
    }
    const bool slow = any_slow(fn);
    const uint4* bs = tile_b(kt);
    uint4* bn = tile_b(kt + 1);
    const uint4* sa = stage_a(kt % S, 0);
    const uint4* sl = stage_a(kt % S, 1);
    if constexpr (kPrefetch) {
      // The fragments of slice ks + 1 are read while slice ks's MMAs run (two register sets), so the tensor
      // pipe does not wait on ldmatrix inside a step; the first slice of a step still does.
      Frags fr[2];
      load_frags(bs, sa, sl, 0, fr[0]);
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        if (ks + 1 < kBK / 16) load_frags(bs, sa, sl, ks + 1, fr[(ks + 1) & 1]);
        mmas(fr[ks & 1]);
#pragma unroll
        for (int h = 0; h < H; ++h) decode(cn[h], fn[h], slow, my_half + h, ks, bn);
      }
    } else {
      // One register set: each slice's A fragment is reused for hi and lo in turn (3 blocks of 64 rows per
      // SM leave 80 registers); with one fp16 and no skipping, the slice's A fragments are all read before
      // its MMAs.
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        uint32_t b[T::kNT][2];
        load_b(bs, ks, b);
        if constexpr (!kSplit && !kSkipEmpty) {
          uint32_t a[T::kMT][4];
#pragma unroll
          for (int mt = 0; mt < T::kMT; ++mt) load_a_frag(sa, ks, mt, a[mt]);
#pragma unroll
          for (int mt = 0; mt < T::kMT; ++mt) mma_row(mt, a[mt], b);
        } else {
#pragma unroll
          for (int mt = 0; mt < T::kMT; ++mt) {
            if (kSkipEmpty && mt * 16 >= mt_rows) break;
            uint32_t a[4];
            load_a_frag(sa, ks, mt, a);
            mma_row(mt, a, b);
            if constexpr (kSplit) {
              load_a_frag(sl, ks, mt, a);
              mma_row(mt, a, b);
            }
          }
        }
#pragma unroll
        for (int h = 0; h < H; ++h) decode(cn[h], fn[h], slow, my_half + h, ks, bn);  // tile kt + 1, a quarter per slice
      }
    }
  }
  cp_async_wait<0>();
}

// Calls out(row, col, v0, v1) for every pair of adjacent tile columns (col even) of this thread's
// accumulators in rows < a_rows, with v = acc * unscale[row] * kFold * the column's global scale. `out` checks
// the columns (ci.row[col] < 0: past the weight).
template <WKind K, class T, class Out>
__device__ __forceinline__ void epilogue(const typename T::Acc& acc, const ColInfo& ci,
                                         const float* __restrict__ unscale, int a_rows, Out&& out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warp_m = warp / T::kWarpsN, warp_n = warp % T::kWarpsN;
#pragma unroll
  for (int mt = 0; mt < T::kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_m * T::kWarpRows + mt * 16 + g + 8 * half;
      if (row >= a_rows) continue;
      const float u = unscale[row] * fold_of<K>();  // the weights' kFold back
#pragma unroll
      for (int nt = 0; nt < T::kNT; ++nt) {
        const int col = warp_n * (kBN / T::kWarpsN) + nt * 8 + 2 * t;
        float v[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float a = acc[mt][nt][2 * half + i] * u;
          v[i] = ci.divide[col + i] ? a / ci.global[col + i] : a * ci.global[col + i];
        }
        out(row, col, v[0], v[1]);
      }
    }
  }
}

}  // namespace nb::cuda::gemm
