// The Hopper (sm_90a) warp-specialized, persistent tile of the dense prefill FP4 GEMM: y[tokens, weight rows]
// = A x W^T with W in MXFP4/NVFP4 as the checkpoint stores it, on wgmma with both operands in shared memory.
//
// Why a second Hopper tile. The wgmma tile (gemm_fp4_wgmma.cuh) decodes the weights into register A
// fragments: every k-step each warpgroup decodes, issues, waits for its own wgmmas (it must, before
// rewriting their registers) and meets a block barrier, so the tensor pipe idles between steps (30-38 % of
// cuBLASLt BF16; bench/NOTES.md). Here:
//   the decoder warpgroup (warps 8-11): a thread owns one of the block's 128 weight rows. Per k-tile it
//     waits until the stage is free (`empty`), decodes its 64 codes (copied into a shared-memory ring R
//     k-tiles ahead, fetch_raw) into the stage's fp16 weight tile and arrives on `full`; thread 0 also starts the
//     stage's activation tile (256 x 64 fp16) as one 32 KiB bulk copy that completes on `full`;
//   two multiplier warpgroups (warps 0-7) each own 64 of the weight rows: per k-tile they wait on `full`,
//     issue 4 wgmma m64n256k16 (both operands from shared memory, asynchronous) and release the previous
//     k-tile's stage once its wgmmas completed (wait_group 1), so the tensor pipe always has the next
//     k-tile's wgmmas queued. No block-wide barrier in the loop.
//   Persistent: one block per SM walks its tiles and the ring runs on across them, so the decoder fills the
//   next tile's stages while the multipliers store the last one.
// Shared-memory layout, no swizzle: each operand is a grid of 8 x 16-byte core matrices, the 8 rows of a core
// matrix 16 bytes apart, the 8 k-chunks of a row block 128 bytes apart (the descriptor's leading-dimension
// offset) and row blocks 1024 bytes apart (its stride offset). The activations are written in exactly this
// order by launch_gemm_activations (GemmActivations::tiled), so a stage's 256 x 64 tile is one contiguous
// 32 KiB bulk copy; inside each 8-element chunk the k order is 0 4 1 5 2 6 3 7 (the pairs e2m1_word
// decodes), on both operands. Decoding (decode_half): e2m1 * 2^-14 by bit moves, times the block factor in
// fp16 (exact for MXFP4 blocks with exponents in [-23, 13], always for NVFP4); NVFP4 global scales (with the
// 2^8 decode_half leaves out) and the activations' row scale in the epilogue.
#pragma once

#include <cuda_fp16.h>

#include "kernels/gemm_fp4_wgmma.cuh"

namespace nb::cuda::ws {

constexpr int kBN = 128;       // weight rows per block: two multiplier warpgroups of 64
constexpr int kBM = 256;       // tokens per block (the wgmma N)
constexpr int kBK = 64;        // k per stage
constexpr int kStages = 4;
constexpr int kThreads = 384;  // two multiplier warpgroups + the decoder warpgroup
constexpr int kABytes = kBM * kBK * 2;  // 32 KiB of fp16 activations per stage
constexpr int kWBytes = kBN * kBK * 2;  // 16 KiB of decoded fp16 weights per stage
constexpr int kStageBytes = kABytes + kWBytes;
// The decoder's ring of raw k-tiles (cp.async, R <= kMaxRing slots): per slot each of the 128 rows' 32 code bytes,
// then the two aligned 4-byte words that hold its block scale bytes.
constexpr int kMaxRing = 5;
constexpr int kRawCodes = kBN * 32, kRawBytes = kRawCodes + kBN * 8;
constexpr int kSmem = kStages * kStageBytes + kMaxRing * kRawBytes;

// Measurement builds only (their results are wrong): each skips one part of the pipeline so that
// scripts/gpu-ab.sh variants (NIBBLE_AB_VARIANTS="dec:-DNIBBLE_WS_FAKE_DEC=1 ...") show what it costs --
// FAKE_ACT: activation copies after the first kStages k-tiles; FAKE_DEC: the decode after them; FAKE_EPI: the
// epilogue's stores (bench/NOTES.md, twelfth session).
#ifndef NIBBLE_WS_FAKE_ACT
#define NIBBLE_WS_FAKE_ACT 0
#endif
#ifndef NIBBLE_WS_FAKE_DEC
#define NIBBLE_WS_FAKE_DEC 0
#endif
#ifndef NIBBLE_WS_FAKE_EPI
#define NIBBLE_WS_FAKE_EPI 0
#endif

// Rows of the tiled activations: whole 256-token tiles (the pad rows are read, never stored from).
__host__ __device__ constexpr int64_t padded_rows(int64_t m) { return (m + kBM - 1) / kBM * kBM; }
// The 16-byte chunk index of (row r, k-tile kt, k-chunk c) in tiled activations of mp rows: per k-tile the
// rows' core matrices [r / 8][c][r % 8], so 256 consecutive rows of one k-tile are contiguous.
__host__ __device__ constexpr int64_t chunk_of(int64_t r, int64_t kt, int c, int64_t mp) {
  return ((kt * (mp / 8) + r / 8) * 8 + c) * 8 + r % 8;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
// One arrival that also expects `bytes` of asynchronous copies to complete on the barrier.
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16) from global to shared memory by the copy engine, completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// d (m64 x n256 fp32 fragments) = A (64 x 16, descriptor da) x B (16 x 256, descriptor db) (+ d when
// accumulate != 0), both K-major.
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(accumulate));
}
#endif

// Descriptor of a K-major operand in the core-matrix layout above: start address, k-chunk stride 128 bytes
// (leading-dimension offset), 8-row-block stride 1024 bytes (stride offset), no swizzle.
__device__ __forceinline__ uint64_t desc(const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (uint64_t{128 >> 4} << 16) | (uint64_t{1024 >> 4} << 32);
}

// A decoder thread's row in one k-tile comes through shared memory, not registers: cp.async copies its 32 code
// bytes and the two aligned 4-byte words that hold its block scale bytes (MXFP4 2, NVFP4 4, at any byte
// offset) into a ring slot R k-tiles ahead, and the decode waits for its own copy groups only
// (cp.async.wait_group). With plain loads into a register ring, ptxas gave the ring's loads few scoreboards,
// so the decode of k-tile kt also waited for the loads just issued for kt + R (ncu: the decoder stalled on
// the scale byte's first use, the multipliers waited for the decoder; twelfth session). Zeros past k or
// past the weight. The scale words are whole aligned words around the wanted bytes (cp.async copies 4, 8 or
// 16 aligned bytes): at most 3 bytes past the tensor's end, never across a page.
template <WKind K>
__device__ __forceinline__ void fetch_raw(const gemm::BRow& br, int kt, int k, int row, uint8_t* slot,
                                          const void* any_global) {
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16, kScaleBytes = K == WKind::kMXFP4 ? 2 : 4;
  const int kk = kt * kBK;
  const bool ok0 = br.codes && kk < k, ok1 = br.codes && kk + 32 < k;
  const uint8_t* c = ok0 ? br.codes + kk / 2 : static_cast<const uint8_t*>(any_global);
  gemm::cp_async16(slot + row * 32, c, ok0);
  gemm::cp_async16(slot + row * 32 + 16, ok1 ? c + 16 : c, ok1);
  const uintptr_t sp = ok0 ? reinterpret_cast<uintptr_t>(br.scales + kk / kBlk) : reinterpret_cast<uintptr_t>(any_global);
  const uintptr_t sa = sp & ~uintptr_t{3};
  const bool two = ok0 && (sp & 3) + kScaleBytes > 4;  // the bytes run into the next word
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(slot + kRawCodes + row * 8));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(sa), "r"(ok0 ? 4 : 0));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d + 4), "l"(two ? sa + 4 : sa), "r"(two ? 4 : 0));
}

// Decodes half a row's k-tile (16 code bytes q, the half's scale codes sc[0..1]) into a weight buffer: chunk c
// (8 elements, order 0 4 1 5 2 6 3 7) at dst + 128 c. e2m1_word gives e2m1 * 2^-14;
//   MXFP4: times 2^14, then times 2^(e - 127) (e8m0_half_bits: exact for e - 127 in [-24, 15]), so the weight
//     is e2m1 * 2^(e - 127), exact for blocks with exponents in [-23, 13]. (Folding 2^14 into the factor
//     saves a multiply per pair but needs a second path for the blocks it does not fit: measured slower on
//     the o and fc2 shapes, twelfth session.)
//   NVFP4: one multiply by F = ue4m3 * 2^6 (in [2^-3, 28672]: always normal), so the weight is e2m1 * ue4m3
//     * 2^-8, exact (at most 6 significant bits, >= 2^-18); the epilogue multiplies by 2^8.
template <WKind K>
__device__ __forceinline__ void decode_half(const uint4& q, const uint32_t (&sc)[2], uint8_t* dst) {
  uint32_t f[2];
  if constexpr (K == WKind::kMXFP4) {
    const uint32_t h = gemm::e8m0_half_bits(sc[0]);
    f[0] = f[1] = h | (h << 16);
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t h = (sc[i] & 0x7fu) << 7;  // ue4m3 * 2^-8 as fp16 bits
      f[i] = gemm::hmul2(h | (h << 16), 0x74007400u);  // * 2^14
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t word = c == 0 ? q.x : c == 1 ? q.y : c == 2 ? q.z : q.w;
    const uint32_t fc = f[K == WKind::kMXFP4 ? 0 : c >> 1];
    uint32_t h[4];
    e2m1_word(word, h);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // MXFP4: times 2^14, then 2^(e - 127); NVFP4: one multiply by ue4m3 * 2^6.
      h[i] = gemm::hmul2(K == WKind::kMXFP4 ? gemm::hmul2(h[i], 0x74007400u) : h[i], fc);
    }
    *reinterpret_cast<uint4*>(dst + 128 * c) = make_uint4(h[0], h[1], h[2], h[3]);
  }
}

// Decodes row d's k-tile kt from its ring slot `raw` (fetch_raw's copies, landed) into a weight tile at dst
// (the row's first chunk): its 32 code bytes as two halves with their scale bytes, which start at byte
// (address & 3) of the two copied words.
template <WKind K>
__device__ __forceinline__ void decode_k_tile(const uint8_t* raw, int d, const gemm::BRow& br, int kt, int k,
                                              uint8_t* dst) {
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16;
  const uint4 q0 = *reinterpret_cast<const uint4*>(raw + d * 32);
  const uint4 q1 = *reinterpret_cast<const uint4*>(raw + d * 32 + 16);
  const uint2 sw = *reinterpret_cast<const uint2*>(raw + kRawCodes + d * 8);
  const int sh =
      br.codes ? 8 * static_cast<int>(reinterpret_cast<uintptr_t>(br.scales + kt * kBK / kBlk) & 3) : 0;
  const uint32_t word = static_cast<uint32_t>((static_cast<uint64_t>(sw.y) << 32 | sw.x) >> sh);
  uint32_t sc0[2], sc1[2];
  if constexpr (K == WKind::kMXFP4) {
    sc0[0] = sc0[1] = word & 0xffu;
    sc1[0] = sc1[1] = kt * kBK + 32 < k ? (word >> 8) & 0xffu : 0u;
  } else {
    sc0[0] = word & 0xffu, sc0[1] = (word >> 8) & 0xffu;
    sc1[0] = (word >> 16) & 0xffu, sc1[1] = word >> 24;
  }
  decode_half<K>(q0, sc0, dst);
  decode_half<K>(q1, sc1, dst + 4 * 128);
}

// The block's shared state: kStages stages, each [activations 32 KiB][decoded weights 16 KiB], with a
// `full` barrier (128 decoder arrivals + decoder thread 0's arrival with the activations' byte count) and an
// `empty` one (one arrival per multiplier warp); and the token scales (unscale) of the block's last
// kStages + 1 tiles, which the decoder writes before its first `full` arrival of a tile and the
// multipliers read in its epilogue (the decoder runs at most kStages k-tiles ahead of the multipliers'
// releases, so it cannot reach a tile kStages + 1 tiles later before that epilogue is done).
struct Pipe {
  uint8_t* smem;
  uint64_t* full;
  uint64_t* empty;
  float* unscale;  // [kStages + 1][kBM]
  __device__ uint8_t* act(int s) const { return smem + s * kStageBytes; }
  __device__ uint8_t* wts(int s) const { return smem + s * kStageBytes + kABytes; }
  __device__ uint8_t* raw(int j) const { return smem + kStages * kStageBytes + j * kRawBytes; }
  __device__ float* tile_unscale(int it) const { return unscale + (it % (kStages + 1)) * kBM; }
};

// The persistent schedule: block b runs tiles b, b + gridDim.x, ...; tile i covers weight rows
// (i % n_col_tiles) * kBN and tokens (i / n_col_tiles) * kBM (consecutive blocks share a token tile, so its
// activations are read from L2 by all of them). Each tile is n_kt k-tiles; the stage ring counts k-tiles
// across tiles.
struct Sched {
  int n_col_tiles, n_tiles, n_kt;
  __device__ int tile(int it) const { return blockIdx.x + it * gridDim.x; }
  __device__ int my_tiles() const { return n_tiles > static_cast<int>(blockIdx.x) ? (n_tiles - blockIdx.x - 1) / gridDim.x + 1 : 0; }
  __device__ int n0(int tile) const { return (tile % n_col_tiles) * kBN; }
  __device__ int m0(int tile) const { return (tile / n_col_tiles) * kBM; }
};

// The ring depth for n_kt k-tiles per tile: one that divides n_kt, so that the ring runs on across tiles
// with every slot index a compile-time constant (gpt-oss: k = 2880 is 45 k-tiles, 4096 is 64).
inline int ring_for(int n_kt) {
  return n_kt % 5 == 0 ? 5 : n_kt % 4 == 0 ? 4 : n_kt % 3 == 0 ? 3 : n_kt % 2 == 0 ? 2 : 1;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The decoder warpgroup (d = threadIdx.x - 256: tile row d): for every k-tile of the block's schedule, wait
// until its stage is free, decode the row's 64 codes into the stage and arrive on `full`; thread 0 also
// starts the stage's activation copy, and at a tile's first k-tile the warpgroup writes its token scales.
// Each k-tile's codes were copied R k-tiles earlier (R divides n_kt: slot kt % R of a tile is slot kt % R
// of the next one, so the ring runs on across tiles with compile-time slots). a_tiles: the tiled
// activations (mp rows); unscale: their row scales [m].
template <WKind K, int R>
__device__ __forceinline__ void decoder(const Pipe& p, const Sched& sc, const DevWeight& w, const uint8_t* a_tiles,
                                        int64_t mp, const float* __restrict__ unscale, int m) {
  static_assert(R <= kMaxRing);
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16;
  const int d = threadIdx.x - 256, k = w.k, n_tiles = sc.my_tiles();
  auto brow = [&](int it) {
    const int row = it < n_tiles ? sc.n0(sc.tile(it)) + d : w.n;
    return gemm::brow_of(w, row < w.n ? row : -1, k, kBlk);
  };
  const int slot = (d >> 3) * 1024 + (d & 7) * 16;  // this row's first chunk in a weight tile
  gemm::BRow br = brow(0), br_next = brow(1);
#pragma unroll
  for (int j = 0; j < R; ++j) {
    fetch_raw<K>(br, j, k, d, p.raw(j), a_tiles);
    gemm::cp_async_commit();
  }
  for (int it = 0, g = 0; it < n_tiles; ++it) {
    const int m0 = sc.m0(sc.tile(it));
    for (int kt0 = 0; kt0 < sc.n_kt; kt0 += R) {
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int kt = kt0 + j, s = g % kStages;
        if (g >= kStages) mbar_wait(p.empty + s, ((g / kStages) - 1) & 1);  // the multipliers released it
        if (kt == 0) {
          float* us = p.tile_unscale(it);
          us[d] = m0 + d < m ? unscale[m0 + d] : 0.0f;
          us[d + 128] = m0 + d + 128 < m ? unscale[m0 + d + 128] : 0.0f;
        }
        if (d == 0 && NIBBLE_WS_FAKE_ACT && g >= kStages) mbar_arrive(p.full + s);
        else if (d == 0) {
          mbar_arrive_tx(p.full + s, kABytes);
          bulk_copy(p.act(s), a_tiles + (kt * (mp / 8) + m0 / 8) * 1024, kABytes, p.full + s);
        }
        // This thread's copies of k-tile kt have landed (the R - 1 later groups may still be in flight).
        gemm::cp_async_wait<R - 1>();
        // (decode_k_tile's lines, kept inline: through the helper ptxas reorders this kernel's SASS, and this
        // tile's time has moved with code that changed nothing it executes -- thirteenth session, NOTES.md.)
        const uint8_t* raw = p.raw(j);
        const uint4 q0 = *reinterpret_cast<const uint4*>(raw + d * 32);
        const uint4 q1 = *reinterpret_cast<const uint4*>(raw + d * 32 + 16);
        // The scale bytes start at byte (address & 3) of the two words.
        const uint2 sw = *reinterpret_cast<const uint2*>(raw + kRawCodes + d * 8);
        const int sh = br.codes ? 8 * static_cast<int>(reinterpret_cast<uintptr_t>(br.scales + kt * kBK / kBlk) & 3) : 0;
        const uint32_t word = static_cast<uint32_t>((static_cast<uint64_t>(sw.y) << 32 | sw.x) >> sh);
        uint32_t sc0[2], sc1[2];
        if constexpr (K == WKind::kMXFP4) {
          sc0[0] = sc0[1] = word & 0xffu;
          sc1[0] = sc1[1] = kt * kBK + 32 < k ? (word >> 8) & 0xffu : 0u;
        } else {
          sc0[0] = word & 0xffu, sc0[1] = (word >> 8) & 0xffu;
          sc1[0] = (word >> 16) & 0xffu, sc1[1] = word >> 24;
        }
        if (!NIBBLE_WS_FAKE_DEC || g < kStages) {
          decode_half<K>(q0, sc0, p.wts(s) + slot);
          decode_half<K>(q1, sc1, p.wts(s) + slot + 4 * 128);
        }
        wg::fence_proxy_async();  // the stores above are read next by the tensor cores (async proxy)
        mbar_arrive(p.full + s);
        // Refill the slot R k-tiles ahead: this tile's k-tile kt + R, or the next tile's kt + R - n_kt. After the
        // fence, which is a MEMBAR.ALL.CTA in SASS (any proxy-fence form; it waits for this thread's memory
        // operations in flight): the fence costs ~4 % of the GEMM even so (twelfth session).
        if (kt + R < sc.n_kt) fetch_raw<K>(br, kt + R, k, d, p.raw(j), a_tiles);
        else fetch_raw<K>(br_next, kt + R - sc.n_kt, k, d, p.raw(j), a_tiles);
        gemm::cp_async_commit();
        ++g;
      }
    }
    br = br_next;
    br_next = brow(it + 2);
  }
  gemm::cp_async_wait<0>();
}

// A multiplier warpgroup (wg 0 or 1: the tile's weight rows 64 wg ..), one tile: acc (D [its 64 rows][256
// tokens]) = the tile's product. g: the block's k-tile counter (stage and phase). The wgmmas of k-tile g - 1
// are waited for (wait_group 1) only once those of g are issued; then g - 1's stage is released.
__device__ __forceinline__ void multiply_tile(const Pipe& p, const Sched& sc, int& g, float (&acc)[128]) {
  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31;
  for (int kt = 0; kt < sc.n_kt; ++kt, ++g) {
    const int s = g % kStages;
    mbar_wait(p.full + s, (g / kStages) & 1);
    const uint8_t* wt = p.wts(s) + wg * 8 * 1024;  // this warpgroup's 8 row blocks
    const uint8_t* a = p.act(s);
    wg::wgmma_fence();
#pragma unroll
    for (int sl = 0; sl < kBK / 16; ++sl) wgmma_ss_n256(acc, desc(wt + 256 * sl), desc(a + 256 * sl), kt == 0 && sl == 0 ? 0 : 1);
    wg::wgmma_commit();
    wgmma_wait1();  // k-tile g - 1's wgmmas are done: its stage can be refilled
    if (kt > 0 && lane == 0) mbar_arrive(p.empty + (g - 1) % kStages);
  }
  wg::wgmma_wait0();
  if (lane == 0) mbar_arrive(p.empty + (g - 1) % kStages);  // the tile's last stage
}
#endif

// A multiplier thread's two output rows (ra = n0 + its tile row a, rb = ra + 8): y = acc * token scale * s + b.
struct RowPair {
  int ra, rb;
  bool oka, okb;   // inside the weight
  float sa, sb;    // NVFP4: the parts' global scales (times 2^8, decode_half's fold); else 1
  float ba, bb;    // bias or 0
};
template <WKind K>
__device__ __forceinline__ RowPair row_pair(const DevWeight& w, const float* __restrict__ bias, int n0) {
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2;
  RowPair r;
  r.ra = n0 + wg * 64 + warp * 16 + g, r.rb = r.ra + 8;
  r.oka = r.ra < w.n, r.okb = r.rb < w.n;
  // NVFP4 global scales as multipliers (a divide-convention part's reciprocal: within an ulp of dividing).
  auto row_scale = [&](int row) {
    if (K != WKind::kNVFP4 || row >= w.n) return 1.0f;
    const DevPart& part = find_part(w, row);
    return 256.0f * (part.divide ? 1.0f / part.global : part.global);  // (2^8: decode_half's NVFP4 fold)
  };
  r.sa = row_scale(r.ra), r.sb = row_scale(r.rb);
  r.ba = bias && r.oka ? bias[r.ra] : 0.0f, r.bb = bias && r.okb ? bias[r.rb] : 0.0f;
  return r;
}

// Writes a multiplier thread's D elements of tile (n0, m0): y[m0 + token][n0 + row] = acc * unscale[token] *
// the row's NVFP4 global scale (+ bias), for tokens < a_rows and rows < n. A thread's two weight rows are
// fixed (g and g + 8 of its warp's 16), so their scales, biases and bounds are read once; its tokens are
// 8 j + 2 t + {0, 1}; us: the tile's token scales in shared memory;
// BM: the tile's tokens (the register-fragment tile also runs 128); xa, xb: further factors of the two rows
// (the FP8 tile's folds, gemm_fp4_wsr8.cuh).
template <WKind K, int BM = kBM>
__device__ __forceinline__ void epilogue(const float (&acc)[BM / 2], const DevWeight& w, const float* us,
                                         const float* __restrict__ bias, float* __restrict__ y, int n0, int64_t m0,
                                         int a_rows, float xa = 1.0f, float xb = 1.0f) {
  const int t = threadIdx.x & 3, n = w.n;
  const RowPair rp = row_pair<K>(w, bias, n0);
  const int ra = rp.ra, rb = rp.rb;
  const bool oka = rp.oka, okb = rp.okb;
  const float sa = rp.sa * xa, sb = rp.sb * xb, ba = rp.ba, bb = rp.bb;
  float* ya = y + m0 * n + ra;
  float* yb = y + m0 * n + rb;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int token = 8 * j + 2 * t + i;
      if (token < a_rows) {
        const float u = us[token];
        if (oka) ya[static_cast<int64_t>(token) * n] = acc[4 * j + i] * u * sa + ba;
        if (okb) yb[static_cast<int64_t>(token) * n] = acc[4 * j + 2 + i] * u * sb + bb;
      }
    }
  }
}

}  // namespace nb::cuda::ws
