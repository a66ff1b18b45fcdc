// The Hopper (sm_90a) warp-specialized, persistent tile of the dense prefill FP4 GEMM with the weights decoded
// into register A fragments ("rs": wgmma's A from registers, B from shared memory). Same product, grid and
// epilogue as gemm_fp4_ws.cuh; what moves is the decode.
//
// Why. In the ws tile one decoder warpgroup decodes every weight of a k-tile into shared memory, fences the
// stores for the async proxy (a MEMBAR) and arrives on `full`; the two multiplier warpgroups wait for it
// ~57 % of their time (ncu, bench/NOTES.md sixth and twelfth sessions): the decoder is a latency chain one
// warp per scheduler long, and the tensor pipe idles behind it. Here there is no decoder:
//   the producer warpgroup (warps 8-11) only copies: per k-tile each thread cp.asyncs its row's 32 code bytes
//     and scale words into the stage (ws::fetch_raw's layout) with an arrival on `full` when they land, and
//     thread 0 starts the stage's activation bulk copy (BM tokens x 64, 32 KiB at BM = 256);
//   each multiplier warpgroup (warps 0-7, 64 weight rows) decodes its own A fragments from the stage's codes
//     (a lane: rows g and g + 8 of its warp, 16 elements each per k-tile -- gemm_fp4_wgmma.cuh's decode) and
//     issues 4 wgmma m64nBMk16 with A in registers. Per k-tile and SM that is ~800 warp instructions of decode
//     against 1024 cycles of tensor work (BM = 256), spread over 8 warps instead of 4, with no shared-memory
//     stores, no proxy fence and no hand-off.
// A fragment's registers must not change while a wgmma that reads them runs. kTwoSets = false: one set of
// fragments, every k-tile waits for its own previous wgmmas before decoding (the other warpgroup's wgmmas keep
// the pipe busy meanwhile); kTwoSets = true: a set per k-tile parity, the decode of k-tile kt overlapping the
// wgmmas of kt - 1 (wait_group 1), 16 more registers. Measured alike (H200, gpt-oss shapes, within 2 %), so the
// default is one set. Both take registers from the producer (setmaxnreg: 40 there, 232 for the multipliers).
// Measurement builds (wrong results): ws's NIBBLE_WS_FAKE_ACT / _DEC / _EPI skip, here too, the activation copies
// after the first S k-tiles, the decode after a tile's first two k-tiles, the epilogue's stores (bench/NOTES.md,
// twenty-seventh session: -0 to -5 %, -7 %, -5 to -12 % at M = 2048 / 8192).
// The activations are the ws tile's tiled layout (ws::chunk_of: 8 x 16-byte core matrices per 8 rows and
// k-tile, one contiguous copy per stage) with the k order of the wgmma tile inside each k-tile
// (wg::stored_of; GemmActivations::rs), so that lane t's A values are the physical elements [16 t, 16 t + 16)
// of the row's k-tile: 8 contiguous code bytes and one block scale.
#pragma once

#include <cuda_fp16.h>

#include "kernels/gemm_fp4_ws.cuh"

namespace nb::cuda::wsr {

using ws::kBK;
using ws::kBN;
constexpr int kThreads = 384;  // two multiplier warpgroups + the producer warpgroup

// BM tokens per tile (the wgmma N): 256, or 128 where that adds no round to the persistent grid (gemm_fp4.cu
// pick_ws_bm: 128-token tiles decode each weight for half the tokens, so they pay only where SMs would idle).
// A stage: [BM x 64 fp16 activations][each row's 32 code bytes][each row's two scale words] (ws::fetch_raw's
// slot layout).
template <int BM>
struct Geo {
  static_assert(BM == 128 || BM == 256, "wgmma N of 128 or 256");
  static constexpr int kABytes = BM * kBK * 2;
  static constexpr int kStageBytes = kABytes + ws::kRawBytes;
  static constexpr int kStages = BM == 256 ? 5 : 8;
  static constexpr int kSmem = kStages * kStageBytes;
};

template <int BM>
struct Pipe {
  uint8_t* smem;
  uint64_t* full;   // 128 producer arrivals (cp.async landed) + thread 0's arrival with the activation bytes
  uint64_t* empty;  // one arrival per multiplier warp
  __device__ uint8_t* act(int s) const { return smem + s * Geo<BM>::kStageBytes; }
  __device__ uint8_t* raw(int s) const { return smem + s * Geo<BM>::kStageBytes + Geo<BM>::kABytes; }
};

// ws::Sched with BM-token tiles.
template <int BM>
struct Sched : ws::Sched {
  __device__ int m0(int tile) const { return (tile / n_col_tiles) * BM; }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (m64 x n256 fp32 fragments) = a (m64 x k16 fp16 A fragments) x B (16 x 256, descriptor db) (+ d when
// accumulate != 0).
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n}\n"
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
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
template <int BM>
__device__ __forceinline__ void wgmma_rs(float (&d)[BM / 2], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  if constexpr (BM == 256) wgmma_rs_n256(d, a, db, accumulate);
  else wgmma_rs_n128(d, a, db, accumulate);
}
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(ws::smem_u32(b)) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
// The two multiplier warpgroups (256 threads) meet before the epilogue reads the tile's token scales.
__device__ __forceinline__ void multipliers_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// The producer warpgroup (d = threadIdx.x - 256: tile row d): for every k-tile of the block's schedule, wait
// until its stage is free, copy the row's codes and scale words into it (arriving on `full` when they land)
// and, thread 0, start the stage's activation copy. a_tiles: the tiled activations (mp rows).
template <WKind K, int BM>
__device__ __forceinline__ void producer(const Pipe<BM>& p, const Sched<BM>& sc, const DevWeight& w,
                                         const uint8_t* a_tiles, int64_t mp) {
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16, S = Geo<BM>::kStages, kABytes = Geo<BM>::kABytes;
  const int d = threadIdx.x - 256, n_tiles = sc.my_tiles();
  for (int it = 0, g = 0; it < n_tiles; ++it) {
    const int tile = sc.tile(it), m0 = sc.m0(tile), row = sc.n0(tile) + d;
    const gemm::BRow br = gemm::brow_of(w, row < w.n ? row : -1, w.k, kBlk);
    for (int kt = 0; kt < sc.n_kt; ++kt, ++g) {
      const int s = g % S;
      if (g >= S) ws::mbar_wait(p.empty + s, ((g / S) - 1) & 1);  // the multipliers released it
      ws::fetch_raw<K>(br, kt, w.k, d, p.raw(s), a_tiles);
      mbar_arrive_cp_async(p.full + s);
      if (d == 0 && NIBBLE_WS_FAKE_ACT && g >= S) {
        ws::mbar_arrive(p.full + s);
      } else if (d == 0) {
        ws::mbar_arrive_tx(p.full + s, kABytes);
        ws::bulk_copy(p.act(s), a_tiles + (kt * (mp / 8) + m0 / 8) * 1024, kABytes, p.full + s);
      }
    }
  }
  gemm::cp_async_wait<0>();
}

// The fp16x2 block factor of a lane's row in k-tile kt from the row's two copied scale words sw (its scale
// bytes start at byte `off` = the address's low bits): MXFP4 2^(e - 127) of block t / 2 (e8m0_half_bits);
// NVFP4 ue4m3 * 2^6 of block t (times e2m1 * 2^-14: the weight * 2^-8, which the epilogue multiplies back).
// Blocks past k give 0 (their codes were copied as zeros; the bytes there belong to the next row).
template <WKind K>
__device__ __forceinline__ uint32_t block_factor(uint2 sw, int off, int kt, int k, int t) {
  const int blk = K == WKind::kMXFP4 ? t >> 1 : t;
  const int sh = 8 * ((off + kt * (kBK / (K == WKind::kMXFP4 ? 32 : 16))) & 3) + 8 * blk;
  const uint32_t code = static_cast<uint32_t>((static_cast<uint64_t>(sw.y) << 32 | sw.x) >> sh) & 0xffu;
  const bool in_k = kt * kBK + blk * (K == WKind::kMXFP4 ? 32 : 16) < k;
  if constexpr (K == WKind::kMXFP4) {
    const uint32_t h = in_k ? gemm::e8m0_half_bits(code) : 0u;
    return h | (h << 16);
  } else {
    const uint32_t h = in_k ? (code & 0x7fu) << 7 : 0u;  // ue4m3 * 2^-8 as fp16 bits
    return gemm::hmul2(h | (h << 16), 0x74007400u);       // * 2^14
  }
}

// A lane's A fragments of one k-tile (4 k16 slices) for its rows a and b from the stage's raw codes: words
// of 8 codes give pairs (i, i + 4) (e2m1_word: e2m1 * 2^-14), times 2^14 and the factor (MXFP4) or the factor
// alone (NVFP4), in the wgmma tile's stored order (gemm_fp4_wgmma.cuh).
template <WKind K>
__device__ __forceinline__ void decode_frags(uint2 ca, uint2 cb, uint32_t fa, uint32_t fb, uint32_t (&frag)[4][4]) {
#pragma unroll
  for (int wd = 0; wd < 2; ++wd) {
    uint32_t pa[4], pb[4];
    e2m1_word(wd ? ca.y : ca.x, pa);
    e2m1_word(wd ? cb.y : cb.x, pb);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pa[i] = gemm::hmul2(K == WKind::kMXFP4 ? gemm::hmul2(pa[i], 0x74007400u) : pa[i], fa);
      pb[i] = gemm::hmul2(K == WKind::kMXFP4 ? gemm::hmul2(pb[i], 0x74007400u) : pb[i], fb);
    }
#pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
      uint32_t* f = frag[2 * wd + sl];
      f[0] = pa[2 * sl], f[1] = pb[2 * sl], f[2] = pa[2 * sl + 1], f[3] = pb[2 * sl + 1];
    }
  }
}

// One k-tile of a multiplier warpgroup: wait for the stage, read the lane's codes and scale words, decode
// into `frag` and issue the 4 wgmmas. g: the block's k-tile counter (stage and phase). N < BM (the MoE tiles'
// narrower token tiles, moe_gemm.cu): wgmma m64nNk16 over the stage's first N tokens, always accumulating
// (the caller zeroes acc).
template <WKind K, int BM, int N = BM>
__device__ __forceinline__ void k_step(const Pipe<BM>& p, int g, int kt, int k, int row_a, int row_b, int off_a,
                                       int off_b, bool wait_before_decode, uint32_t (&frag)[4][4],
                                       float (&acc)[BM / 2]) {
  constexpr int S = Geo<BM>::kStages;
  const int lane = threadIdx.x & 31, t = lane & 3;
  const int s = g % S;
  ws::mbar_wait(p.full + s, (g / S) & 1);
  const uint8_t* raw = p.raw(s);
  const uint2 ca = *reinterpret_cast<const uint2*>(raw + row_a * 32 + 8 * t);
  const uint2 cb = *reinterpret_cast<const uint2*>(raw + row_b * 32 + 8 * t);
  const uint2 swa = *reinterpret_cast<const uint2*>(raw + ws::kRawCodes + row_a * 8);
  const uint2 swb = *reinterpret_cast<const uint2*>(raw + ws::kRawCodes + row_b * 8);
  const uint32_t fa = block_factor<K>(swa, off_a, kt, k, t), fb = block_factor<K>(swb, off_b, kt, k, t);
  if (wait_before_decode) {
    wg::wgmma_wait0();  // the previous k-tile's wgmmas are done with frag: release its stage
    if (kt > 0 && lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);
  }
  if (!NIBBLE_WS_FAKE_DEC || kt < 2) decode_frags<K>(ca, cb, fa, fb, frag);
  wg::wgmma_fence();
  const uint8_t* a = p.act(s);
#pragma unroll
  for (int sl = 0; sl < kBK / 16; ++sl) {
    if constexpr (N == BM) wgmma_rs<BM>(acc, frag[sl], ws::desc(a + 256 * sl), kt == 0 && sl == 0 ? 0 : 1);
    else wg::wgmma<N>(acc, frag[sl], ws::desc(a + 256 * sl));
  }
  wg::wgmma_commit();
}
#endif

}  // namespace nb::cuda::wsr
