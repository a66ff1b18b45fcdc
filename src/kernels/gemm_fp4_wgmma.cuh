// The Hopper (sm_90a) block tile of the prefill FP4 GEMMs: the same product as gemm_fp4_tile.cuh
// (C[tokens, weight rows] += A x W^T, W in MXFP4/NVFP4 as the checkpoint stores it), on wgmma instead of
// mma.sync. Only the sm_90a build has its instructions (other arches compile traps); the backend asks
// gemm_wgmma() and otherwise runs the portable tile (GB10 and other sm_12x GPUs always do).
//
// Roles. wgmma multiplies a 64-row A from registers by an N-column B from shared memory. The weights are
// A: each warpgroup (4 warps) owns 64 weight rows of the block's 128 and decodes them from their codes
// straight into A fragments; the activations are B, N = BM tokens, read by the tensor cores from the
// stage's activation tile (cp.async, 128-byte rows XOR-swizzled in 16-byte chunks: the layout wgmma's
// 128B-swizzle descriptor describes). The accumulators are D[weight row][token], 64 x BM per warpgroup.
//
// Per 64-wide k-tile a lane needs, for its rows g and g + 8 of its warp's 16, the A values at k {2t, 2t+1}
// and {2t+8, 2t+9} of each k16 slice. The activations are stored in the order (stored_of) that makes
// those physical elements [16 t, 16 t + 16) of the k-tile: 8 contiguous code bytes per row, one block
// scale (MXFP4: block t / 2, NVFP4: block t), decoded as in the portable tile (e2m1 * 2^-14 by bit
// moves, times 2^14 and the block factor in fp16: exact for MXFP4 blocks with exponents in [-23, 13],
// always exact for NVFP4). Code word w of a row gives pairs (i, i + 4), i = 0..3 (common.cuh
// e2m1_word); pair q = 4 w + i feeds slice q / 2 as the low (q even) or high (q odd) k half. So stored
// position p = 16 s + 8 hh + 2 t + b of a k-tile holds physical element 16 t + base(2 s + hh) + 4 b,
// base(q) = q < 4 ? q : q + 4.
#pragma once

#include <cuda_fp16.h>

#include "kernels/gemm_fp4_tile.cuh"

namespace nb::cuda::wg {

constexpr int kBN = 128;  // weight rows per block: two warpgroups of 64
constexpr int kBK = 64;   // k per pipeline stage
constexpr int kThreads = 256;

// k padded to whole k-tiles: the row stride of the stored activations (the pad is stored as zeros).
__host__ __device__ constexpr int padded_k(int k) { return (k + kBK - 1) / kBK * kBK; }

// The physical element (0..63) of a k-tile that stored position p (0..63) holds (see the header).
__host__ __device__ constexpr int stored_of(int p) {
  const int s = p >> 4, hh = (p >> 3) & 1, t = (p >> 1) & 3, b = p & 1, q = 2 * s + hh;
  return 16 * t + (q < 4 ? q : q + 4) + 4 * b;
}

// The stored position (0..63) of physical element j (0..63) of a k-tile: the inverse of stored_of.
__host__ __device__ constexpr int position_of(int j) {
  const int t = j >> 4, word = (j >> 3) & 1, i = j & 3, b = (j >> 2) & 1, q = 4 * word + i;
  return 16 * (q >> 1) + 8 * (q & 1) + 2 * t + b;
}

// BM tokens (wgmma N: 64 or 128) x 128 weight rows. Stages: [A (and lo) tiles][codes][scales], the A tiles
// first and 1024-byte aligned (the 128B swizzle's period).
template <int BM, bool kSplit>
struct Tile {
  static_assert(BM == 64 || BM == 128, "wgmma N of 64 or 128");
  static constexpr int kRows = BM;
  static constexpr int kABytes = BM * kBK * 2;
  static constexpr int kAStage = kABytes * (kSplit ? 2 : 1);
  static constexpr int kCodeBytes = kBN * kBK / 2;  // 128 rows x 32 code bytes
  static constexpr int kScaleBytes = kBN * 4;        // one 32-bit word of scale codes per row
  static constexpr int kStageBytes = kAStage + kCodeBytes + kScaleBytes;
  // Two blocks per SM on the H200 (227 KiB): up to 4 stages within ~110 KiB each.
  static constexpr int kBudget = 110 * 1024;
  static constexpr int kStages = kBudget / kStageBytes < 4 ? kBudget / kStageBytes : 4;
  static_assert(kStages >= 2, "the ring needs two stages");
  static constexpr int kCodeOffset = kStages * kAStage;
  static constexpr int kScaleOffset = kCodeOffset + kStages * kCodeBytes;
  static constexpr int kSmem = kScaleOffset + kStages * kScaleBytes + 1024;  // + alignment slack
  static constexpr int kAcc = BM / 2;  // fp32 accumulators per thread (m64 x BM over 128 threads)
  // Blocks per SM asked of __launch_bounds__: more warpgroups hide each one's wait for its wgmmas; 64-token
  // fp16 tiles (~80 registers, 51 KiB) fit 3.
  static constexpr int kMinBlocks = BM == 64 && !kSplit ? 3 : 2;
};

// --- wgmma (sm_90a) ---------------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a K-major tile of 128-byte rows with the 128B swizzle: start address,
// leading byte offset 16 (unused for swizzled K-major), stride 1024 bytes between 8-row core groups.
__device__ __forceinline__ uint64_t sw128_desc(const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// d (m64 x N fp32, the warpgroup's fragments) += a (m64 x k16 fp16 fragments) x B (k16 x N from the descriptor).
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
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
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_m64n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_m64n32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_m64n16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7"
      "}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_m64n96(float (&d)[48], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
      "}, {%48,%49,%50,%51}, %52, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#else
__device__ __forceinline__ void wgmma_fence() {}
__device__ __forceinline__ void wgmma_commit() {}
__device__ __forceinline__ void wgmma_wait0() {}
__device__ __forceinline__ void fence_proxy_async() {}
__device__ __forceinline__ void wgmma_m64n128(float (&)[64], const uint32_t (&)[4], uint64_t) { __trap(); }
__device__ __forceinline__ void wgmma_m64n64(float (&)[32], const uint32_t (&)[4], uint64_t) { __trap(); }
__device__ __forceinline__ void wgmma_m64n96(float (&)[48], const uint32_t (&)[4], uint64_t) { __trap(); }
__device__ __forceinline__ void wgmma_m64n32(float (&)[16], const uint32_t (&)[4], uint64_t) { __trap(); }
__device__ __forceinline__ void wgmma_m64n16(float (&)[8], const uint32_t (&)[4], uint64_t) { __trap(); }
#endif

// The first N / 2 of a thread's accumulators (tokens 0 .. N-1) += a x B: N = 16, 32, 64, 96, 128.
template <int N, int kAcc>
__device__ __forceinline__ void wgmma(float (&acc)[kAcc], const uint32_t (&a)[4], uint64_t desc) {
  static_assert(N / 2 <= kAcc);
  float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&acc);
  if constexpr (N == 128) wgmma_m64n128(d, a, desc);
  else if constexpr (N == 96) wgmma_m64n96(d, a, desc);
  else if constexpr (N == 64) wgmma_m64n64(d, a, desc);
  else if constexpr (N == 32) wgmma_m64n32(d, a, desc);
  else wgmma_m64n16(d, a, desc);
}

// This row's scale codes of k-tile kt: MXFP4 blocks 2 kt, 2 kt + 1, NVFP4 blocks 4 kt .. 4 kt + 3 (bytes
// b[0..]); blocks past k (a half k-tile at the end) as 0, which decodes to zeros. Kept as separate bytes
// until pack_scales, a step later, so the loads stay in flight: combining them at once stalled every
// k-step for a whole global-memory latency (ncu: long-scoreboard stalls; bench/NOTES.md).
template <WKind K>
struct ScaleBytes {
  static constexpr int kPer = K == WKind::kMXFP4 ? 2 : 4;
  uint32_t b[kPer];
};
template <WKind K>
__device__ __forceinline__ ScaleBytes<K> load_scales(const gemm::BRow& br, int kt, int k) {
  ScaleBytes<K> r;
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16;
  const int b0 = kt * r.kPer, n_blocks = k / kBlk;
#pragma unroll
  for (int i = 0; i < r.kPer; ++i) r.b[i] = br.scales && b0 + i < n_blocks ? __ldg(br.scales + b0 + i) : 0u;
  return r;
}
template <WKind K>
__device__ __forceinline__ uint32_t pack_scales(const ScaleBytes<K>& s) {
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < s.kPer; ++i) w |= s.b[i] << (8 * i);
  return w;
}

// acc (this thread's D fragments) += over the whole k, for the block's 128 weight rows and BM tokens; the
// wgmmas cover the first N <= BM tokens (a MoE tile whose expert has fewer rows), and only those rows of
// the activation tile are loaded.
// a_hi / a_lo: the tile's first activation row, row stride lda (>= padded_k(k), stored order; lo read only
// in kSplit); rows >= a_rows read as zero. br: the weight row of tile row threadIdx.x / 2, whose code half
// threadIdx.x % 2 this thread brings in (even threads also its scales).
template <WKind K, class T, bool kSplit, int N = T::kRows>
__device__ __forceinline__ void mainloop(uint8_t* smem_raw, const __half* __restrict__ a_hi, const __half* __restrict__ a_lo,
                                         int64_t lda, int a_rows, int k, const gemm::BRow& br, float (&acc)[T::kAcc]) {
  constexpr int S = T::kStages;
  static_assert(N % 16 == 0 && N <= T::kRows, "wgmma N: a multiple of 16, at most the tile's rows");
  // Aligned by adding to the shared pointer, not by integer casts: the compiler then keeps the address space
  // and reads the stage's codes and scales with LDS, where a generic address gave generic loads (ncu, 31st
  // session: their latency and the scale conversion's branches were ~13 % of a narrow MoE tile's stalls).
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + ((1024u - (base & 1023u)) & 1023u);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int n_kt = (k + kBK - 1) / kBK;
  auto a_tile = [&](int s, int lo) { return smem + s * T::kAStage + lo * T::kABytes; };
  auto code_tile = [&](int s) { return smem + T::kCodeOffset + s * T::kCodeBytes; };
  auto scale_tile = [&](int s) { return reinterpret_cast<uint32_t*>(smem + T::kScaleOffset + s * T::kScaleBytes); };
  const int my_row = tid >> 1, my_half = tid & 1;

  // Copies only the N rows the wgmmas read (no cp.async for the BM - N rows of a narrow MoE tile); N is a
  // multiple of 16 rows, whole 8-row swizzle atoms. Rows a_rows .. N - 1 are written as zeros.
  auto load_tile = [&](int kt, int s) {
    uint4* sa = reinterpret_cast<uint4*>(a_tile(s, 0));
    for (int c = tid; c < N * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool ok = r < a_rows;
      const int64_t off = ok ? r * lda + kt * kBK + ch * 8 : 0;
      gemm::cp_async16(sa + gemm::swz(r, ch), a_hi + off, ok);
      if constexpr (kSplit) gemm::cp_async16(reinterpret_cast<uint4*>(a_tile(s, 1)) + gemm::swz(r, ch), a_lo + off, ok);
    }
    const bool ok = br.codes && kt * kBK + 32 * my_half < k;
    gemm::cp_async16(code_tile(s) + my_row * 32 + 16 * my_half,
                     ok ? br.codes + kt * (kBK / 2) + 16 * my_half : reinterpret_cast<const uint8_t*>(a_hi), ok);
  };
  auto store_scales = [&](int s, uint32_t w) {
    if (my_half == 0) scale_tile(s)[my_row] = w;
  };

  // Prologue: k-tiles 0 .. S-3 in flight (their scales stored directly), the scales of S-2 loading. The
  // ring is refilled S - 2 steps ahead: a step's wgmmas still run while the next step meets the barrier and
  // issues its loads, so the stage they read is reused only two steps later.
  static_assert(S >= 3, "wgmmas in flight across a barrier need a stage of slack");
#pragma unroll
  for (int s = 0; s < S - 2; ++s) {
    if (s < n_kt) {
      load_tile(s, s);
      store_scales(s, my_half == 0 ? pack_scales<K>(load_scales<K>(br, s, k)) : 0u);
    }
    gemm::cp_async_commit();
  }
  ScaleBytes<K> pending{};  // the scales of the next k-tile to load, in flight
  if (S - 2 < n_kt && my_half == 0) pending = load_scales<K>(br, S - 2, k);

  // This lane's weight rows (tile rows): warpgroup wg's 64, warp's 16, rows g and g + 8.
  const int row_a = (warp >> 2) * 64 + (warp & 3) * 16 + g, row_b = row_a + 8;
  // A step's wgmmas are waited for (wait_group 0) only when the next step's decode is about to rewrite
  // their A fragments, after the barrier and the loads. (Two fragment sets with wait_group 1 would overlap
  // the decode too, but ptxas serializes wgmmas whose register inputs are written while earlier ones run,
  // C7513.)
  uint32_t frag[4][4];  // A fragments of the 4 k16 slices
  for (int kt = 0; kt < n_kt; ++kt) {
    gemm::cp_async_wait<S - 3>();
    fence_proxy_async();  // the cp.async writes are read next by the tensor cores (async proxy)
    // Stage kt landed for every thread; every warpgroup's wgmmas of step kt - 2 completed (waited before
    // the decode of step kt - 1), so that stage is free for k-tile kt + S - 2.
    __syncthreads();
    if (kt + S - 2 < n_kt) {
      load_tile(kt + S - 2, (kt + S - 2) % S);
      store_scales((kt + S - 2) % S, pack_scales<K>(pending));  // read after the barrier of step kt + S - 2
    }
    gemm::cp_async_commit();
    if (kt + S - 1 < n_kt && my_half == 0) pending = load_scales<K>(br, kt + S - 1, k);
    wgmma_wait0();  // step kt - 1's wgmmas are done with frag

    const int s = kt % S;
    const uint8_t* codes = code_tile(s);
    const uint8_t* sc = reinterpret_cast<const uint8_t*>(scale_tile(s));
    const int sb = K == WKind::kMXFP4 ? (t >> 1) : t;
    const uint32_t ha = K == WKind::kMXFP4 ? gemm::e8m0_half_bits(sc[4 * row_a + sb]) : gemm::ue4m3_half_bits(sc[4 * row_a + sb]);
    const uint32_t hb = K == WKind::kMXFP4 ? gemm::e8m0_half_bits(sc[4 * row_b + sb]) : gemm::ue4m3_half_bits(sc[4 * row_b + sb]);
    const uint32_t fa = ha | (ha << 16), fb = hb | (hb << 16);
    const uint2 ca = *reinterpret_cast<const uint2*>(codes + row_a * 32 + 8 * t);
    const uint2 cb = *reinterpret_cast<const uint2*>(codes + row_b * 32 + 8 * t);
#pragma unroll
    for (int wd = 0; wd < 2; ++wd) {
      uint32_t pa[4], pb[4];
      e2m1_word(wd ? ca.y : ca.x, pa);
      e2m1_word(wd ? cb.y : cb.x, pb);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pa[i] = gemm::hmul2(gemm::hmul2(pa[i], 0x74007400u), fa);  // * 2^14 * factor
        pb[i] = gemm::hmul2(gemm::hmul2(pb[i], 0x74007400u), fb);
      }
#pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        uint32_t* f = frag[2 * wd + sl];
        f[0] = pa[2 * sl], f[1] = pb[2 * sl], f[2] = pa[2 * sl + 1], f[3] = pb[2 * sl + 1];
      }
    }
    wgmma_fence();
#pragma unroll
    for (int sl = 0; sl < 4; ++sl) {
      wgmma<N>(acc, frag[sl], sw128_desc(a_tile(s, 0) + 32 * sl));
      if constexpr (kSplit) wgmma<N>(acc, frag[sl], sw128_desc(a_tile(s, 1) + 32 * sl));
    }
    wgmma_commit();
  }
  wgmma_wait0();
  gemm::cp_async_wait<0>();
}

// mainloop with the narrowest wgmma N (16, 32, 64, 96, BM) that covers a_rows: a MoE tile is sized for the
// experts' average rows, and many experts have fewer; N is a template argument (wgmma shapes are).
template <WKind K, class T, bool kSplit>
__device__ __forceinline__ void mainloop_rows(uint8_t* smem_raw, const __half* __restrict__ a_hi,
                                              const __half* __restrict__ a_lo, int64_t lda, int a_rows, int k,
                                              const gemm::BRow& br, float (&acc)[T::kAcc]) {
  if (a_rows <= 16) return mainloop<K, T, kSplit, 16>(smem_raw, a_hi, a_lo, lda, a_rows, k, br, acc);
  if (a_rows <= 32) return mainloop<K, T, kSplit, 32>(smem_raw, a_hi, a_lo, lda, a_rows, k, br, acc);
  if constexpr (T::kRows == 64) {
    return mainloop<K, T, kSplit, 64>(smem_raw, a_hi, a_lo, lda, a_rows, k, br, acc);
  } else {
    if (a_rows <= 64) return mainloop<K, T, kSplit, 64>(smem_raw, a_hi, a_lo, lda, a_rows, k, br, acc);
    if (a_rows <= 96) return mainloop<K, T, kSplit, 96>(smem_raw, a_hi, a_lo, lda, a_rows, k, br, acc);
    return mainloop<K, T, kSplit, T::kRows>(smem_raw, a_hi, a_lo, lda, a_rows, k, br, acc);
  }
}

// Calls out(token, tile_row_a, tile_row_b, va, vb) for each of this thread's D pairs: weight rows (tile
// rows) row_a = g and row_b = g + 8 of its warp's 16, one token, v = acc * unscale[token] * the rows' global
// scales. Tokens >= a_rows are skipped; `out` checks the rows (ci.row < 0: past the weight).
template <class T, class Out>
__device__ __forceinline__ void epilogue(const float (&acc)[T::kAcc], const gemm::ColInfo& ci,
                                         const float* __restrict__ unscale, int a_rows, Out&& out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row_a = (warp >> 2) * 64 + (warp & 3) * 16 + g, row_b = row_a + 8;
  auto scaled = [&](float a, int r) { return ci.divide[r] ? a / ci.global[r] : a * ci.global[r]; };
#pragma unroll
  for (int j = 0; j < T::kRows / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int token = 8 * j + 2 * t + i;
      if (token >= a_rows) continue;
      const float u = unscale[token];
      out(token, row_a, row_b, scaled(acc[4 * j + i] * u, row_a), scaled(acc[4 * j + 2 + i] * u, row_b));
    }
  }
}

}  // namespace nb::cuda::wg
