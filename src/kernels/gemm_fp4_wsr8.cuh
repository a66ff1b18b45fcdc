// The sm_90a register-fragment tile (gemm_fp4_wsr.cuh) with FP8 activations: y = A x W^T with A's rows rounded
// to E4M3 (one power-of-two scale per token) and W's FP4 codes decoded in registers to E4M3 A fragments of
// wgmma m64nNk32 .e4m3 -- the tensor pipe's FP8 rate, twice its fp16 one. A W4A8 product: opt-in
// (CudaBackendOptions::gemm_fp8_activations, NIBBLE_GEMM_FP8=1), not the default, since the activations keep 4
// significant bits instead of fp16's 11 (bench/NOTES.md, thirtieth session, for what it costs and gives).
//
// What is exact and what rounds. Per weight row the tile picks a fold shift c (row_fold): 2^c times the row's
// largest block scale is at most 64, so every weight * 2^c is at most 6 * 64 = 384 < 448 (E4M3's largest).
// A weight's E4M3 value is then e2m1 * scale * 2^c rounded to nearest: exact for MXFP4 blocks within 14
// binades of the row's largest (2^x e2m1 with x in [-8, 6]: E4M3's subnormals end at 2^-9), exact for NVFP4
// only where e2m1 * ue4m3 has at most 4 significant bits (e2m1 1.5 * ue4m3 1.125 = 1.6875 needs 5: NVFP4
// weights round, by at most 2^-4 relative). The epilogue multiplies by 2^-c (and the NVFP4 global scale).
//
// The decode. An E4M3 lookup table per (row, block) -- the 8 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} * scale *
// 2^c as bytes in two registers (fp16 products, cvt.rn.satfinite.e4m3x2) -- and per word of 8 codes two
// byte permutes (prmt) for the magnitudes and two for the signs: 11 instructions per 8 weights, no multiply.
//
// Geometry. A stage holds a k-tile of 128 (fp16's 64 in the same 128 bytes per token row): the activations'
// BM x 128 bytes in the ws tiles' core-matrix layout (ws::chunk_of with 16-byte chunks of 16 fp8 values) and
// two of fetch_raw's raw slots (the k-tile's two 64-wide halves). Lane t of a warp takes physical elements
// [32 t, 32 t + 32) of its rows' k-tile -- one MXFP4 block, two NVFP4 blocks: 16 code bytes, words sl = 0..3
// for the 4 k32 slices. wgmma's A fragment of slice sl holds, per register, 4 consecutive k of one row (rows g,
// g + 8; k 4t..4t+3, then 16+4t..16+4t+3): word sl's elements 0-3 then 4-7. The activations are stored in that
// order (stored byte 32 sl + kk of a k-tile holds physical element phys8 below), so the sums pair correctly.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/gemm_fp4_wsr.cuh"

namespace nb::cuda::wsr8 {

using ws::kBN;
constexpr int kBK = 128;  // k per stage (128 bytes of fp8 activations per token row)
constexpr int kThreads = 384;

__host__ __device__ constexpr int padded_k(int k) { return (k + kBK - 1) / kBK * kBK; }
// The physical element (0..127) of a k-tile at stored byte q (0..127): slice q / 32, lane group (q % 32) / 4 (its
// first 16 bytes: the words' elements 0-3, its last 16: elements 4-7), byte q % 4.
__host__ __device__ constexpr int phys8(int q) {
  const int sl = q / 32, kk = q % 32, t = (kk % 16) / 4;
  return 32 * t + 8 * sl + (kk >= 16 ? 4 : 0) + kk % 4;
}

template <int BM>
struct Geo {
  static_assert(BM == 128 || BM == 256, "wgmma N of 128 or 256");
  static constexpr int kABytes = BM * kBK;
  static constexpr int kStageBytes = kABytes + 2 * ws::kRawBytes;
  static constexpr int kStages = BM == 256 ? 5 : 8;
  static constexpr int kSmem = kStages * kStageBytes;
};

template <int BM>
struct Pipe {
  uint8_t* smem;
  uint64_t* full;   // 128 producer arrivals (cp.async landed) + thread 0's arrival with the activation bytes
  uint64_t* empty;  // one arrival per multiplier warp
  __device__ uint8_t* act(int s) const { return smem + s * Geo<BM>::kStageBytes; }
  // half h (0, 1) of stage s's raw codes: fetch_raw's slot for the k-tile's elements [64 h, 64 h + 64)
  __device__ uint8_t* raw(int s, int h) const {
    return smem + s * Geo<BM>::kStageBytes + Geo<BM>::kABytes + h * ws::kRawBytes;
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_e4m3_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, {%128,%129,%130,%131}, %132, p, 1, 1;\n}\n"
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
__device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
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
// Narrower always-accumulating forms for the MoE tiles' last token tiles (moe_gemm.cu: N < BM, acc zeroed first).
__device__ __forceinline__ void wgmma_e4m3_acc_n16(float (&d)[8], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7"
      "}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wgmma_e4m3_acc_n32(float (&d)[16], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wgmma_e4m3_acc_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wgmma_e4m3_acc_n96(float (&d)[48], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
      "}, {%48,%49,%50,%51}, %52, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// d's first N / 2 fragments += a x B (N <= BM); N = 128 and 256 through the forms above.
template <int N, int kAcc>
__device__ __forceinline__ void wgmma_e4m3_into(float (&acc)[kAcc], const uint32_t (&a)[4], uint64_t db) {
  static_assert(N / 2 <= kAcc);
  float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&acc);
  if constexpr (N == 256) wgmma_e4m3_n256(d, a, db, 1);
  else if constexpr (N == 128) wgmma_e4m3_n128(d, a, db, 1);
  else if constexpr (N == 96) wgmma_e4m3_acc_n96(d, a, db);
  else if constexpr (N == 64) wgmma_e4m3_acc_n64(d, a, db);
  else if constexpr (N == 32) wgmma_e4m3_acc_n32(d, a, db);
  else wgmma_e4m3_acc_n16(d, a, db);
}
template <int BM>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[BM / 2], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  if constexpr (BM == 256) wgmma_e4m3_n256(d, a, db, accumulate);
  else wgmma_e4m3_n128(d, a, db, accumulate);
}

// The producer warpgroup (d = threadIdx.x - 256: tile row d), as wsr::producer with 128-wide k-tiles: the row's two
// 64-wide halves into the stage's two raw slots, one arrival when both landed.
template <WKind K, int BM>
__device__ __forceinline__ void producer(const Pipe<BM>& p, const wsr::Sched<BM>& sc, const DevWeight& w,
                                         const uint8_t* a_tiles, int64_t mp) {
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16, S = Geo<BM>::kStages, kABytes = Geo<BM>::kABytes;
  const int d = threadIdx.x - 256, n_tiles = sc.my_tiles();
  for (int it = 0, g = 0; it < n_tiles; ++it) {
    const int tile = sc.tile(it), m0 = sc.m0(tile), row = sc.n0(tile) + d;
    const gemm::BRow br = gemm::brow_of(w, row < w.n ? row : -1, w.k, kBlk);
    for (int kt = 0; kt < sc.n_kt; ++kt, ++g) {
      const int s = g % S;
      if (g >= S) ws::mbar_wait(p.empty + s, ((g / S) - 1) & 1);  // the multipliers released it
      ws::fetch_raw<K>(br, 2 * kt, w.k, d, p.raw(s, 0), a_tiles);
      ws::fetch_raw<K>(br, 2 * kt + 1, w.k, d, p.raw(s, 1), a_tiles);
      wsr::mbar_arrive_cp_async(p.full + s);
      if (d == 0) {
        ws::mbar_arrive_tx(p.full + s, kABytes);
        ws::bulk_copy(p.act(s), a_tiles + (kt * (mp / 8) + m0 / 8) * 1024, kABytes, p.full + s);
      }
    }
  }
  gemm::cp_async_wait<0>();
}

// A row's fold (see the header): the largest of its nb scale bytes at `scales` (null: a row past the weight),
// read by the 4 lanes of a quad (t = lane % 4) as aligned words with the bytes outside the row masked off;
// returns c with 2^c * (that scale) <= 64. MXFP4: E8M0 e -> c = 133 - e (NaN codes 0xFF skipped); NVFP4: UE4M3 ->
// c = 6 - ceil(log2(ue4m3)). Rows whose scales are all zero get the fold of the smallest scale.
template <WKind K>
__device__ __forceinline__ int row_fold(const uint8_t* scales, int nb, int t) {
  uint32_t mx = 0;
  if (scales) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(scales);
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(a & ~uintptr_t{3});
    const int off = static_cast<int>(a & 3), n_words = (off + nb + 3) / 4;
    for (int i = t; i < n_words; i += 4) {
      uint32_t v = __ldg(wp + i);
      if (4 * i < off) v &= 0xffffffffu << (8 * (off - 4 * i));
      if (4 * i + 4 > off + nb) v &= 0xffffffffu >> (8 * (4 * i + 4 - off - nb));
      if constexpr (K == WKind::kMXFP4) {
        v &= ~(__vcmpeq4(v, 0xffffffffu));  // NaN codes do not set the fold
      } else {
        v &= 0x7f7f7f7fu;  // (the sign bit is unused)
      }
      mx = __vmaxu4(mx, v);
    }
  }
  mx = __vmaxu4(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = __vmaxu4(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  mx = __vmaxu4(mx, mx >> 16);
  const int b = static_cast<int>(max(mx & 0xffu, (mx >> 8) & 0xffu));
  if constexpr (K == WKind::kMXFP4) {
    return 133 - b;
  } else {
    const int e = b >> 3, m = b & 7;
    const int lg = e == 0 ? (m <= 1 ? 0 : m <= 2 ? 1 : m <= 4 ? 2 : 3) - 9 : e - 7 + (m != 0 ? 1 : 0);
    return 6 - (b == 0 ? -9 : lg);
  }
}

// fp16 bits (both halves) of a block's scale * 2^c: MXFP4 2^(e - 127 + c) (0 below fp16's range, NaN for 0xFF),
// NVFP4 ue4m3 * 2^c; 0 for blocks past k.
template <WKind K>
__device__ __forceinline__ uint32_t block_scale_half2(uint32_t code, int c, bool in_k) {
  uint32_t h;
  if constexpr (K == WKind::kMXFP4) {
    // 2^(e - 127 + c) <= 2^6 (row_fold), through an fp32 -> fp16 conversion that flushes what fp16 cannot hold.
    // (Not e8m0_half_bits of a clamped e: ptxas 13.0 fused that clamp and its == 255 test into one VIMNMX
    // whose predicate sent every block to the NaN branch.)
    const int x = max(static_cast<int>(code) - 127 + c, -126);
    h = code == 0xffu ? 0x7e00u : gemm::pow2_half_bits(x);
  } else {
    const float v = __half2float(__ushort_as_half(static_cast<unsigned short>((code & 0x7fu) << 7)));  // ue4m3 * 2^-8
    h = __half_as_ushort(__float2half_rn(v * pow2f(c + 8)));
  }
  h = in_k ? h : 0u;
  return h | (h << 16);
}

// The E4M3 bytes of the 8 E2M1 magnitudes times an fp16 factor f (both halves): x = bytes for codes 0-3, y 4-7.
__device__ __forceinline__ uint2 e4m3_lut(uint32_t f2) {
  uint16_t u[4];
  const uint32_t pairs[4] = {0x38000000u, 0x3e003c00u, 0x42004000u, 0x46004400u};  // (0, .5) (1, 1.5) (2, 3) (4, 6)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2_raw h;
    const uint32_t v = gemm::hmul2(pairs[i], f2);
    h.x = static_cast<unsigned short>(v & 0xffffu), h.y = static_cast<unsigned short>(v >> 16);
    u[i] = __nv_cvt_halfraw2_to_fp8x2(h, __NV_SATFINITE, __NV_E4M3);  // low byte from the low half
  }
  return make_uint2(u[0] | (static_cast<uint32_t>(u[1]) << 16), u[2] | (static_cast<uint32_t>(u[3]) << 16));
}

// 8 E2M1 codes (element i in bits 4i..4i+3) to E4M3 through a table: lo = elements 0-3, hi = 4-7 (byte i of
// each: element i, i + 4). prmt picks the magnitude byte by the code's low 3 bits and a 0x00 / 0x80 byte by its
// sign bit.
__device__ __forceinline__ void e2m1_e4m3_word(uint32_t q, uint2 lut, uint32_t& lo, uint32_t& hi) {
  const uint32_t m = q & 0x77777777u, s = (q >> 3) & 0x11111111u;
  lo = __byte_perm(lut.x, lut.y, m) | __byte_perm(0x8000u, 0u, s);
  hi = __byte_perm(lut.x, lut.y, m >> 16) | __byte_perm(0x8000u, 0u, s >> 16);
}

// A lane's rows' fold shifts and scale-byte offsets for one tile.
struct LaneRows {
  int row_a, row_b;  // tile rows of the lane's fragments
  int off_a, off_b;  // low address bits of the rows' first scale bytes (fetch_raw copies the aligned words)
  int c_a, c_b;      // row_fold
};

// One k-tile of a multiplier warpgroup: wait for the stage, read the lane's 16 code bytes and scale words of
// each row, build the rows' tables, wait for its own previous wgmmas (the other warpgroup's keep the pipe busy)
// and release their stage, decode into `frag`, issue the 4 wgmmas. (One fragment set: a set per k-tile parity,
// as gemm_fp4_wsr.cuh's kTwoSets, measured no faster here either -- bench/NOTES.md, thirtieth session.)
// N < BM (the MoE tiles' narrower token tiles): wgmma m64nNk32 over the stage's first N tokens, always
// accumulating (the caller zeroes acc).
template <WKind K, int BM, int N = BM>
__device__ __forceinline__ void k_step(const Pipe<BM>& p, int g, int kt, int k, const LaneRows& lr,
                                       uint32_t (&frag)[4][4], float (&acc)[BM / 2]) {
  constexpr int S = Geo<BM>::kStages;
  const int lane = threadIdx.x & 31, t = lane & 3, h = t >> 1, q = t & 1;
  const int s = g % S, kt2 = 2 * kt + h;  // kt2: the 64-wide k-tile of the lane's raw slot
  ws::mbar_wait(p.full + s, (g / S) & 1);
  const uint8_t* raw = p.raw(s, h);
  const uint4 ca = *reinterpret_cast<const uint4*>(raw + lr.row_a * 32 + 16 * q);
  const uint4 cb = *reinterpret_cast<const uint4*>(raw + lr.row_b * 32 + 16 * q);
  const uint2 swa = *reinterpret_cast<const uint2*>(raw + ws::kRawCodes + lr.row_a * 8);
  const uint2 swb = *reinterpret_cast<const uint2*>(raw + ws::kRawCodes + lr.row_b * 8);
  // The lane's scale bytes: MXFP4 block q of the half (one table per row), NVFP4 blocks 2q, 2q + 1 (two).
  constexpr int kPerHalf = K == WKind::kMXFP4 ? 2 : 4, kBlk = K == WKind::kMXFP4 ? 32 : 16;
  auto code_at = [&](uint2 sw, int off, int blk) {
    const int sh = 8 * ((off + kt2 * kPerHalf) & 3) + 8 * blk;
    return static_cast<uint32_t>((static_cast<uint64_t>(sw.y) << 32 | sw.x) >> sh) & 0xffu;
  };
  uint2 la[2], lb[2];
  constexpr int kTables = K == WKind::kMXFP4 ? 1 : 2;
#pragma unroll
  for (int i = 0; i < kTables; ++i) {
    const int blk = kTables == 1 ? q : 2 * q + i;
    const bool in_k = kt2 * 64 + blk * kBlk < k;
    la[i] = e4m3_lut(block_scale_half2<K>(code_at(swa, lr.off_a, blk), lr.c_a, in_k));
    lb[i] = e4m3_lut(block_scale_half2<K>(code_at(swb, lr.off_b, blk), lr.c_b, in_k));
  }
  wg::wgmma_wait0();  // the previous k-tile's wgmmas are done with frag: release its stage
  if (kt > 0 && lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);
  const uint32_t wa[4] = {ca.x, ca.y, ca.z, ca.w}, wb[4] = {cb.x, cb.y, cb.z, cb.w};
#pragma unroll
  for (int sl = 0; sl < 4; ++sl) {
    const int ti = kTables == 1 ? 0 : sl >> 1;  // NVFP4: words 0-1 in block 2q, 2-3 in 2q + 1
    e2m1_e4m3_word(wa[sl], la[ti], frag[sl][0], frag[sl][2]);
    e2m1_e4m3_word(wb[sl], lb[ti], frag[sl][1], frag[sl][3]);
  }
  wg::wgmma_fence();
  const uint8_t* a = p.act(s);
#pragma unroll
  for (int sl = 0; sl < 4; ++sl) {
    if constexpr (N == BM) wgmma_e4m3<BM>(acc, frag[sl], ws::desc(a + 256 * sl), kt == 0 && sl == 0 ? 0 : 1);
    else wgmma_e4m3_into<N>(acc, frag[sl], ws::desc(a + 256 * sl));
  }
  wg::wgmma_commit();
}
#endif

}  // namespace nb::cuda::wsr8
