// Prefill attention; see flash_attention.cuh. Block = 8 warps = 128 query rows; row r is token
// r / group of the tile and head kv_head * group + r % group, so every row of a block reads the same K/V.
// Per 64-key tile (32 for fp32 tiles of 128 operand elements a row): the block brings K and V from the
// cache into padded shared memory (see Tile), each warp computes S = Q K^T for its 16 rows (mma m16n8k16, fp32
// accumulate), masks (causal, window), updates its online softmax (max, sum in fp32, base-2 exponent) and adds
// P V (P from the S accumulators, V through ldmatrix.trans). Operand types by cache kind:
//   BF16: Q, K, P, V in bf16 (Q and P rounded to 2^-9 relative, as the cache rounds K and V).
//   FP8:  fp16 (E4M3 converts to fp16 exactly; Q and P rounded to 2^-12 relative; |q| clamped to 65504).
//   fp32: each operand split into bf16 hi + lo (x - hi - lo <= 2^-18 |x|) and a b ~ ah bh + ah bl + al bh,
//         three mmas per product: ~2^-16 relative per term, close to the fp32 reference the goldens need.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "kernels/flash_attention.cuh"

namespace nb::cuda {
namespace {

// Warps per block (16 query rows each). Every row of a block shares each K/V tile, so more rows means
// fewer tile reads from L2 per FLOP (gpt-oss pp2048 with 64 rows: ~0.5 GB of L2 reads per full layer).
// 8 at every head_dim: at head_dim 64, <= 128 registers with one plane and two blocks per SM; at 128, ~220
// registers and one block (thirty-second session: 8 warps and 64-key BF16 tiles against 4 and 32, head_dim
// 128 pp2048 / pp8192 130 -> 166 / 141 -> 188 TFLOP/s, bench/NOTES.md).
constexpr int kWarps = 8;
constexpr float kLog2e = 1.4426950408889634f;

// Operand element type and number of bf16 planes for a cache kind.
template <KvKind K>
struct Operand {
  using T = __nv_bfloat16;
  static constexpr int kPlanes = 1;
};
template <>
struct Operand<KvKind::kFP8> {
  using T = __half;
  static constexpr int kPlanes = 1;
};
template <>
struct Operand<KvKind::kF32> {
  using T = __nv_bfloat16;
  static constexpr int kPlanes = 2;
};

template <class T>
__device__ __forceinline__ T to_op(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 to_op<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half to_op<__half>(float x) {
  return __float2half_rn(fminf(fmaxf(x, -65504.0f), 65504.0f));
}
template <class T>
__device__ __forceinline__ float from_op(T x);
template <>
__device__ __forceinline__ float from_op<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// x as planes: hi (and lo = x - hi when there are two).
template <class T, int P>
__device__ __forceinline__ void split(float x, T (&out)[P]) {
  out[0] = to_op<T>(x);
  if constexpr (P == 2) out[1] = to_op<T>(x - from_op<T>(out[0]));
}

template <class T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  const uint16_t a = reinterpret_cast<const uint16_t&>(lo), b = reinterpret_cast<const uint16_t&>(hi);
  return uint32_t{a} | (uint32_t{b} << 16);
}

// acc += a b for one m16n8k16 tile.
template <class T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // src-size 0 fills the 16 bytes with zeros and reads nothing.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Tile geometry. kN keys per tile: 64, or 32 where an fp32 tile row is 128 operand elements or more (registers
// for S; BF16 and FP8 at head_dim 128 keep 64: one block per SM at their ~220 registers). Rows of shared memory
// are padded by 8 elements (16 bytes) so the 8 rows a B-fragment load or an ldmatrix touches fall on distinct banks.
// How a tile reaches shared memory, by cache kind:
//   BF16 (kAsync): the bytes are the operand; cp.async fills the next tiles' buffers while one is computed (kBuf
//     2 or 3 in the kernel).
//   FP8 (kStaged): the raw codes go by cp.async two tiles ahead into two staging slots (kN x D bytes each for K and
//     for V, after the operand buffer); the thread that copied a chunk converts it into the one operand buffer once
//     its own copies landed (no barrier for the slot), so only the conversion is left between the barriers.
//   fp32: loaded, split and stored through registers into one buffer.
template <KvKind K, int D>
struct Tile {
  using T = typename Operand<K>::T;
  static constexpr int kPlanes = Operand<K>::kPlanes;
  static constexpr bool kAsync = K == KvKind::kBF16;
  static constexpr bool kStaged = K == KvKind::kFP8;
  static constexpr int kN = kAsync || kStaged || D * kPlanes < 128 ? 64 : 32;
  static constexpr int kStride = D + 8;
  static constexpr int kElems = kPlanes * kN * kStride;  // one buffer of K (or V)
  static constexpr int kStageBytes = kStaged ? kN * D : 0;  // one staging slot of K (or V) codes
  static constexpr int kThreads = kWarps * 32, kRows = kWarps * 16;
  static constexpr int kMinBlocks = D <= 64 && kPlanes == 1 ? 2 : 1;  // per SM, through the register cap
  // Operand buffers of the large form (see big_form_fits) and of the small one. Measured (H100, thirty-fifth
  // session): BF16 three buffers pay at head_dim 64 (+2-3 %) but cost head_dim 128 3-4 % against two; a second
  // FP8 operand buffer (tile it + 1 converted while tile it is computed, one barrier per tile) was 0-2 % slower
  // than one.
  static constexpr int kBigBuf = kAsync ? (D <= 64 ? 3 : 2) : 1, kSmallBuf = kAsync ? 2 : 1;
  // Dynamic shared memory of K and V with `buffers` operand buffers each (and two staging slots each).
  static constexpr int smem_bytes(int buffers) {
    return 2 * buffers * kElems * static_cast<int>(sizeof(T)) + 2 * 2 * kStageBytes;
  }
  static_assert(D % 16 == 0 && kN % 16 == 0);
};

// The 16-byte chunks of a tile's K (and V) rows a thread moves: chunk i = threadIdx.x + r * kThreads for
// r < kPer is key i / kPerRow, elements [kG (i % kPerRow), + kG) of its row. A trip count known at compile time
// (no loop control), and one page-table lookup serves a chunk's K and V.
template <KvKind K, int D>
struct Chunks {
  using Src = typename KvElem<K>::T;
  static constexpr int kG = 16 / sizeof(Src);  // elements per chunk
  static constexpr int kPerRow = D / kG;
  static constexpr int kTotal = Tile<K, D>::kN * kPerRow, kThreads = Tile<K, D>::kThreads;
  static constexpr int kPer = (kTotal + kThreads - 1) / kThreads;  // per thread (the last round partial if any)
  static constexpr bool kPartial = kTotal % kThreads != 0;
};

// Four E4M3 codes (one word, code i in byte i) as fp16 bits, codes 0, 1 in `lo` and 2, 3 in `hi` (low half first).
// Exact for every finite code: the sign stays the top bit, the 4 exponent and 3 mantissa bits land at fp16 bits
// 7..13 (the value times 2^-8, subnormals included), then one multiply by 256. The NaN code 0x7F reads as 480
// (the cache holds it only for a NaN activation; the per-element conversion before clamped it to 65504).
__device__ __forceinline__ void fp8_pairs_to_half(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t p01 = __byte_perm(w, 0, 0x1404), p23 = __byte_perm(w, 0, 0x3424);  // code << 8 per half
  lo = hmul2((p01 & 0x80008000u) | ((p01 >> 1) & 0x3f803f80u), 0x5c005c00u);      // 0x5c00 = 256
  hi = hmul2((p23 & 0x80008000u) | ((p23 >> 1) & 0x3f803f80u), 0x5c005c00u);
}

// The page-table entry of each chunk this thread moves for the tile of keys [k0, k0 + kN), -1 past `last`
// (those chunks become zeros: finite, and the mask drops them). Read before the barrier that precedes the
// copies, so the table's round trip overlaps the wait instead of standing in front of the copies.
template <KvKind K, int D>
__device__ __forceinline__ void locate_tile(const int32_t* __restrict__ table, int k0, int last,
                                            int (&ent)[Chunks<K, D>::kPer]) {
  using C = Chunks<K, D>;
#pragma unroll
  for (int r = 0; r < C::kPer; ++r) {
    const int i = threadIdx.x + r * C::kThreads, kp = k0 + i / C::kPerRow;
    ent[r] = (!C::kPartial || i < C::kTotal) && kp <= last ? __ldg(table + kp / kKvBlock) : -1;
  }
}

// Element offset in the K / V cache of chunk i (key k0 + i / kPerRow) of KV head kvh, at page-table entry e.
template <KvKind K, int D>
__device__ __forceinline__ int64_t chunk_offset(int e, int i, int k0, int kvh, int n_kv_heads) {
  using C = Chunks<K, D>;
  const int kp = k0 + i / C::kPerRow;
  const int64_t slot = static_cast<int64_t>(e) * kKvBlock + kp % kKvBlock;
  return (slot * n_kv_heads + kvh) * D + (i % C::kPerRow) * C::kG;
}

// BF16: cp.async of the located chunks into the tile buffers kdst / vdst ([kN][kStride]); the caller commits.
template <KvKind K, int D>
__device__ __forceinline__ void copy_tile(const typename KvElem<K>::T* __restrict__ kc,
                                          const typename KvElem<K>::T* __restrict__ vc,
                                          const int (&ent)[Chunks<K, D>::kPer], int k0, int kvh, int n_kv_heads,
                                          typename Tile<K, D>::T* kdst, typename Tile<K, D>::T* vdst) {
  using C = Chunks<K, D>;
  constexpr int kS = Tile<K, D>::kStride;
#pragma unroll
  for (int r = 0; r < C::kPer; ++r) {
    const int i = threadIdx.x + r * C::kThreads;
    if (C::kPartial && i >= C::kTotal) break;
    const bool valid = ent[r] >= 0;
    const int64_t off = valid ? chunk_offset<K, D>(ent[r], i, k0, kvh, n_kv_heads) : 0;  // 0: nothing read
    const int at = (i / C::kPerRow) * kS + (i % C::kPerRow) * C::kG;
    cp_async16(kdst + at, kc + off, valid);  // the cache's bf16 bits are the operand
    cp_async16(vdst + at, vc + off, valid);
  }
}

// BF16, the lookup and the copies in one pass (each chunk's entry loaded right before its copies): the form
// for kernels at the 128-register cap, where entries held across the barrier cost spills (see the kernel).
template <KvKind K, int D>
__device__ __forceinline__ void fetch_tile(const typename KvElem<K>::T* __restrict__ kc,
                                           const typename KvElem<K>::T* __restrict__ vc, const int32_t* table,
                                           int k0, int last, int kvh, int n_kv_heads, typename Tile<K, D>::T* kdst,
                                           typename Tile<K, D>::T* vdst) {
  using C = Chunks<K, D>;
  constexpr int kS = Tile<K, D>::kStride;
#pragma unroll
  for (int r = 0; r < C::kPer; ++r) {
    const int i = threadIdx.x + r * C::kThreads;
    if (C::kPartial && i >= C::kTotal) break;
    const int key = i / C::kPerRow, ch = i % C::kPerRow, kp = k0 + key;
    const bool valid = kp <= last;
    int64_t off = 0;  // (offset 0 is a valid address where nothing is read)
    if (valid) {
      const int64_t slot = static_cast<int64_t>(table[kp / kKvBlock]) * kKvBlock + kp % kKvBlock;
      off = (slot * n_kv_heads + kvh) * D + ch * C::kG;
    }
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
      cp_async16((kv == 0 ? kdst : vdst) + key * kS + ch * C::kG, (kv == 0 ? kc : vc) + off, valid);
  }
}

// FP8: cp.async of the located chunks' raw codes into a staging slot (chunk i at byte 16 i of kst / vst); the
// caller commits. The same thread converts them (convert_tile), so the slot needs no barrier.
template <KvKind K, int D>
__device__ __forceinline__ void stage_tile(const uint8_t* __restrict__ kc, const uint8_t* __restrict__ vc,
                                           const int (&ent)[Chunks<K, D>::kPer], int k0, int kvh, int n_kv_heads,
                                           uint8_t* kst, uint8_t* vst) {
  using C = Chunks<K, D>;
  static_assert(C::kG == 16);
  // The slot may be the one this thread just converted from: keep the compiler from moving the copies (asm
  // without a memory clobber) above those shared-memory reads.
  asm volatile("" ::: "memory");
#pragma unroll
  for (int r = 0; r < C::kPer; ++r) {
    const int i = threadIdx.x + r * C::kThreads;
    if (C::kPartial && i >= C::kTotal) break;
    const bool valid = ent[r] >= 0;
    const int64_t off = valid ? chunk_offset<K, D>(ent[r], i, k0, kvh, n_kv_heads) : 0;
    cp_async16(kst + 16 * i, kc + off, valid);  // invalid chunks: zero codes, +0 after conversion
    cp_async16(vst + 16 * i, vc + off, valid);
  }
}

// FP8: this thread's staged chunks (their copies landed: the caller waited) as fp16 operands into kdst / vdst.
// 16 codes -> 16 fp16 by bit moves and one multiply per pair (fp8_pairs_to_half).
template <KvKind K, int D>
__device__ __forceinline__ void convert_tile(const uint8_t* kst, const uint8_t* vst, __half* kdst, __half* vdst) {
  using C = Chunks<K, D>;
  constexpr int kS = Tile<K, D>::kStride;
#pragma unroll
  for (int r = 0; r < C::kPer; ++r) {
    const int i = threadIdx.x + r * C::kThreads;
    if (C::kPartial && i >= C::kTotal) break;
    const int at = (i / C::kPerRow) * kS + (i % C::kPerRow) * C::kG;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const uint4 raw = *reinterpret_cast<const uint4*>((kv == 0 ? kst : vst) + 16 * i);
      uint4 h0, h1;
      fp8_pairs_to_half(raw.x, h0.x, h0.y);
      fp8_pairs_to_half(raw.y, h0.z, h0.w);
      fp8_pairs_to_half(raw.z, h1.x, h1.y);
      fp8_pairs_to_half(raw.w, h1.z, h1.w);
      uint4* row = reinterpret_cast<uint4*>((kv == 0 ? kdst : vdst) + at);
      row[0] = h0;
      row[1] = h1;
    }
  }
}

// fp32: keys [k0, k0 + kN) into kdst / vdst ([kPlanes][kN][kStride]) through registers, each value split into
// its bf16 planes; keys past `last` become zeros.
template <KvKind K, int D>
__device__ __forceinline__ void load_tile(const float* __restrict__ kc, const float* __restrict__ vc,
                                          const int32_t* __restrict__ table, int k0, int last, int kvh,
                                          int n_kv_heads, typename Tile<K, D>::T* kdst,
                                          typename Tile<K, D>::T* vdst) {
  using C = Chunks<K, D>;
  using T = typename Tile<K, D>::T;
  constexpr int kN = Tile<K, D>::kN, kS = Tile<K, D>::kStride, kP = Tile<K, D>::kPlanes;
  int ent[C::kPer];
  locate_tile<K, D>(table, k0, last, ent);
#pragma unroll
  for (int r = 0; r < C::kPer; ++r) {
    const int i = threadIdx.x + r * C::kThreads;
    if (C::kPartial && i >= C::kTotal) break;
    const int at = (i / C::kPerRow) * kS + (i % C::kPerRow) * C::kG;
    const int64_t off = ent[r] >= 0 ? chunk_offset<K, D>(ent[r], i, k0, kvh, n_kv_heads) : -1;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const float4 raw = off >= 0 ? *reinterpret_cast<const float4*>((kv == 0 ? kc : vc) + off)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      const float e[4] = {raw.x, raw.y, raw.z, raw.w};
      T* row = (kv == 0 ? kdst : vdst) + at;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        T parts[kP];
        split<T, kP>(e[j], parts);
#pragma unroll
        for (int p = 0; p < kP; ++p) row[p * kN * kS + j] = parts[p];
      }
    }
  }
}

// 2^x by the SFU alone (ex2.approx.ftz: ~2 ulp, results below 2^-126 flushed to 0). exp2f adds a range
// check and two multiplies per call to keep subnormal results; a probability below 2^-126 is 0 in P's bf16 /
// fp16 anyway, and exp2(-inf) is still +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// One K/V tile (keys k0.., in shared memory kb / vb) for a warp's 16 rows: S = Q K^T, the mask (kMasked: causal
// and window per row, key kp seen by row h iff lo_excl[h] < kp <= pos[h]; keys past the block's last are zeros
// and masked too), the online softmax update and O += P V. Logits stay unscaled until the exponent:
// p = 2^(s sc - m) is one FFMA and one ex2 per element, the running max m is in scaled (base-2) units (sc > 0,
// so the max commutes with the scale). Per element of an unmasked tile: FMNMX, FFMA, MUFU, FADD and half an
// F2FP -- the instruction budget next to the two MMAs each element takes at head_dim 64.
template <KvKind K, int D, bool kMasked>
__device__ __forceinline__ void tile_step(const uint32_t (&qa)[Tile<K, D>::kPlanes][D / 16][4],
                                          const typename Tile<K, D>::T* kb, const typename Tile<K, D>::T* vb,
                                          int k0, const int (&pos)[2], const int (&lo_excl)[2], float sc,
                                          float (&m)[2], float (&l)[2], float (&o)[D / 8][4]) {
  using G = Tile<K, D>;
  using T = typename G::T;
  constexpr int kN = G::kN, kS = G::kStride, kP = G::kPlanes, kKs = D / 16, kNt = kN / 8;
  static_assert(kKs % 2 == 0 || kKs == 1);
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float s[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    // ldmatrix (not transposed) of 8 keys x 8 dims gives lane (g, c) keys g's dims 2c, 2c + 1: the B fragment.
    // Lanes 8i..8i+7 address matrix i = dims +8 i, so one x4 covers two k-steps (b0, b1, b0', b1').
    const T* kr = kb + (nt * 8 + (lane & 7)) * kS + (lane >> 3) * 8;
#pragma unroll
    for (int kk = 0; kk < kKs; kk += 2) {
      if constexpr (kKs == 1) {  // head_dim 16: one k-step, the fragment as two 32-bit loads (words 0 and 4)
        const uint32_t* k1 = reinterpret_cast<const uint32_t*>(kb + (nt * 8 + g) * kS + 2 * c);
        mma<T>(s[nt], qa[0][0], k1[0], k1[4]);
        if constexpr (kP == 2) {
          const uint32_t* kl = k1 + kN * kS / 2;  // the lo plane (kS is even)
          mma<T>(s[nt], qa[0][0], kl[0], kl[4]);
          mma<T>(s[nt], qa[1][0], k1[0], k1[4]);
        }
      } else {
        uint32_t b[4];
        ldmatrix_x4(b, kr + kk * 16);
        mma<T>(s[nt], qa[0][kk], b[0], b[1]);
        mma<T>(s[nt], qa[0][kk + 1], b[2], b[3]);
        if constexpr (kP == 2) {
          uint32_t bl[4];
          ldmatrix_x4(bl, kr + kN * kS + kk * 16);
          mma<T>(s[nt], qa[0][kk], bl[0], bl[1]);
          mma<T>(s[nt], qa[0][kk + 1], bl[2], bl[3]);
          mma<T>(s[nt], qa[1][kk], b[0], b[1]);
          mma<T>(s[nt], qa[1][kk + 1], b[2], b[3]);
        }
      }
    }
  }
  // Mask and the new running max per row (the 4 lanes of a quad share a row), in unscaled logits.
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int h = j >> 1;
      if constexpr (kMasked) {
        const int kp = k0 + nt * 8 + 2 * c + (j & 1);
        s[nt][j] = kp <= pos[h] && kp > lo_excl[h] ? s[nt][j] : -INFINITY;
      }
      mx[h] = fmaxf(mx[h], s[nt][j]);
    }
  float corr[2], base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float mnew = fmaxf(m[h], mx[h] * sc);
    // A row that has seen nothing yet keeps max -inf: nothing to rescale, and 2^-inf = 0 below.
    base[h] = mnew == -INFINITY ? 0.0f : mnew;
    corr[h] = fast_exp2(m[h] - base[h]);
    m[h] = mnew;
    l[h] *= corr[h];
  }
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[nt][j] = fast_exp2(fmaf(s[nt][j], sc, -base[j >> 1]));
      l[j >> 1] += s[nt][j];
    }
  // Once the running max settles most tiles leave it unchanged (corr exactly 1 for every row of the warp):
  // skip the rescale of the D / 2 accumulators then.
  if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= corr[0], o[dt][1] *= corr[0];
      o[dt][2] *= corr[1], o[dt][3] *= corr[1];
    }
  }
  // O += P V: the S accumulators of key tiles 2j and 2j + 1 are exactly the A fragment of keys 16j..16j+15.
#pragma unroll
  for (int j = 0; j < kN / 16; ++j) {
    uint32_t pa[kP][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float* src = &s[2 * j + (r >> 1)][2 * (r & 1)];
      T x0[kP], x1[kP];
      split<T, kP>(src[0], x0);
      split<T, kP>(src[1], x1);
#pragma unroll
      for (int p = 0; p < kP; ++p) pa[p][r] = pack2(x0[p], x1[p]);
    }
    // ldmatrix.trans: lanes 8i..8i+7 address rows of matrix i = (keys +8 if i odd, dims +8 if i >= 2).
    const int key = j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dofs = (lane >> 4) * 8;
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t vf[4];
      ldmatrix_x4_trans(vf, vb + key * kS + dp * 16 + dofs);
      mma<T>(o[2 * dp], pa[0], vf[0], vf[1]);
      mma<T>(o[2 * dp + 1], pa[0], vf[2], vf[3]);
      if constexpr (kP == 2) {
        uint32_t vl[4];
        ldmatrix_x4_trans(vl, vb + kN * kS + key * kS + dp * 16 + dofs);
        mma<T>(o[2 * dp], pa[0], vl[0], vl[1]);
        mma<T>(o[2 * dp + 1], pa[0], vl[2], vl[3]);
        mma<T>(o[2 * dp], pa[1], vf[0], vf[1]);
        mma<T>(o[2 * dp + 1], pa[1], vf[2], vf[3]);
      }
    }
  }
}

// kBuf operand buffers for K and for V. BF16: 2 or 3 (cp.async: kBuf - 1 tiles in flight while one is computed;
// the refill of a buffer is issued after the barrier that follows every warp's use of it, so one barrier per
// tile suffices). FP8: 1 (convert, barrier, compute, barrier), the codes of the next two tiles in flight.
// fp32: 1 (load and split, barrier, compute, barrier).
template <KvKind K, int D, int kBuf>
__global__ void __launch_bounds__(Tile<K, D>::kThreads, Tile<K, D>::kMinBlocks)
    flash_attention_kernel(const float* __restrict__ q, const typename KvElem<K>::T* __restrict__ kc,
                           const typename KvElem<K>::T* __restrict__ vc, DevBatch b,
                           const int32_t* __restrict__ seq_begin, int n_seqs, int min_new, AttnShape a,
                           float* __restrict__ out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  using G = Tile<K, D>;
  using T = typename G::T;
  constexpr int kN = G::kN, kP = G::kPlanes, kKs = D / 16, kRows = G::kRows;
  constexpr int kTile = G::kElems;
  static_assert(G::kAsync ? kBuf >= 2 : kBuf == 1);
  // K buffers, then V buffers (G::smem_bytes(kBuf)), then FP8's staging slots: K's two, V's two.
  extern __shared__ __align__(16) unsigned char fa_smem[];
  T* ks = reinterpret_cast<T*>(fa_smem);
  T* vs = ks + kBuf * kTile;
  uint8_t* kst = reinterpret_cast<uint8_t*>(vs + kBuf * kTile);
  uint8_t* vst = kst + 2 * G::kStageBytes;

  const int group = a.n_heads / a.n_kv_heads, per_tile = kRows / group, kvh = blockIdx.y;
  // Which sequence and which of its token tiles this block takes: the last tiles first, since in a
  // sequence later tokens see more keys (the longest blocks start in the first wave).
  int64_t tile = gridDim.x - 1 - static_cast<int64_t>(blockIdx.x);
  int seq = 0;
  for (; seq < n_seqs; ++seq) {
    const int n_new = seq_begin[seq + 1] - seq_begin[seq];
    const int64_t n = n_new >= min_new ? (n_new + per_tile - 1) / per_tile : 0;
    if (tile < n) break;
    tile -= n;
  }
  if (seq == n_seqs) return;
  const int t0 = seq_begin[seq] + static_cast<int>(tile) * per_tile;
  const int n_tok = min(per_tile, seq_begin[seq + 1] - t0);
  const int32_t* table = b.tables + static_cast<int64_t>(seq) * b.table_stride;

  // The block's key range: from the first token's window start to the last token (positions ascend).
  const int pos_first = b.positions[t0], pos_last = b.positions[t0 + n_tok - 1];
  const int lo = a.window > 0 ? max(0, pos_first - a.window + 1) : 0;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // This thread's two rows: warp * 16 + g and + 8.
  int pos[2], row_tok[2], row_head[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h, tk = r / group;
    const bool valid = tk < n_tok;
    row_tok[h] = valid ? t0 + tk : -1;
    row_head[h] = kvh * group + r % group;
    pos[h] = valid ? b.positions[t0 + tk] : -1;
  }
  // The warp's key range, to skip tiles none of its rows sees.
  int warp_last = max(pos[0], pos[1]);
  int warp_first = min(pos[0] < 0 ? INT_MAX : pos[0], pos[1] < 0 ? INT_MAX : pos[1]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    warp_last = max(warp_last, __shfl_xor_sync(0xffffffffu, warp_last, o));
    warp_first = min(warp_first, __shfl_xor_sync(0xffffffffu, warp_first, o));
  }
  const int warp_lo = a.window > 0 && warp_last >= 0 ? warp_first - a.window + 1 : 0;
  // Tiles every row of the warp sees whole need no mask: keys <= warp_first and > warp_last - window.
  const bool tail_rows = __any_sync(0xffffffffu, pos[0] < 0 || pos[1] < 0);
  // Each row's keys are (lo_excl, pos]: the window's start, or everything (a padding row, pos -1, sees none).
  int lo_excl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) lo_excl[h] = a.window > 0 ? pos[h] - a.window : INT_MIN;

  // Q fragments (A operand, rows g and g + 8, columns 2c.. and 2c + 8..), in kP planes.
  uint32_t qa[kP][kKs][4];
#pragma unroll
  for (int kk = 0; kk < kKs; ++kk)
#pragma unroll
    for (int part = 0; part < 2; ++part)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 x = make_float2(0.0f, 0.0f);
        if (row_tok[h] >= 0)
          x = *reinterpret_cast<const float2*>(
              q + (static_cast<int64_t>(row_tok[h]) * a.n_heads + row_head[h]) * D + kk * 16 + part * 8 +
              2 * c);
        T x0[kP], x1[kP];
        split<T, kP>(x.x, x0);
        split<T, kP>(x.y, x1);
#pragma unroll
        for (int p = 0; p < kP; ++p) qa[p][kk][part * 2 + h] = pack2(x0[p], x1[p]);
      }

  // Online softmax state in base 2: logits scaled by scale * log2(e). A sink is an extra key of value 0:
  // it starts the running max and contributes 1 (once per row: lane c == 0) to the sum.
  float m[2], l[2], o[D / 8][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = a.sinks ? a.sinks[row_head[h]] * kLog2e : -INFINITY;
    l[h] = a.sinks && c == 0 ? 1.0f : 0.0f;
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  const float sc = a.scale * kLog2e;

  using C = Chunks<K, D>;
  int ent[C::kPer];  // page-table entries of this thread's chunks of the next tile to copy
  constexpr int kAhead = G::kAsync ? kBuf - 1 : 2;  // tiles whose copies are in flight (BF16, FP8)
  if constexpr (G::kAsync || G::kStaged) {
#pragma unroll
    for (int t = 0; t < kAhead; ++t) {
      const int kt = lo + t * kN;
      if (kt <= pos_last) {
        if constexpr (G::kAsync) {
          fetch_tile<K, D>(kc, vc, table, kt, pos_last, kvh, a.n_kv_heads, ks + t * kTile, vs + t * kTile);
        } else {
          locate_tile<K, D>(table, kt, pos_last, ent);
          stage_tile<K, D>(kc, vc, ent, kt, kvh, a.n_kv_heads, kst + t * G::kStageBytes, vst + t * G::kStageBytes);
        }
      }
      cp_async_commit();  // (empty groups keep one group per tile)
    }
  }
  for (int k0 = lo, it = 0; k0 <= pos_last; k0 += kN, ++it) {
    T* kb = ks + (it % kBuf) * kTile;
    T* vb = vs + (it % kBuf) * kTile;
    if constexpr (G::kAsync) {
      // This thread's copies of tile it have landed; after the barrier everyone's have, and every warp is done
      // with tile it - 1, whose buffer now takes tile it + kAhead. Its page-table entries are read before the
      // wait where registers allow; at the 128-register cap of two blocks per SM (head_dim <= 64) holding them
      // across the barrier made ptxas spill in the loop and cost 3 % (thirty-fifth session), so after it there.
      if constexpr (G::kMinBlocks == 1) {
        const int kn = k0 + kAhead * kN, nb = (it + kAhead) % kBuf;
        if (kn <= pos_last) locate_tile<K, D>(table, kn, pos_last, ent);
        cp_async_wait<kAhead - 1>();
        __syncthreads();
        if (kn <= pos_last) copy_tile<K, D>(kc, vc, ent, kn, kvh, a.n_kv_heads, ks + nb * kTile, vs + nb * kTile);
      } else {
        cp_async_wait<kAhead - 1>();
        __syncthreads();
        const int kn = k0 + kAhead * kN, nb = (it + kAhead) % kBuf;
        if (kn <= pos_last)
          fetch_tile<K, D>(kc, vc, table, kn, pos_last, kvh, a.n_kv_heads, ks + nb * kTile, vs + nb * kTile);
      }
      cp_async_commit();
    } else if constexpr (G::kStaged) {
      // Tile it's codes (landed for this thread) converted into the buffer (every warp is done with tile it - 1:
      // the barrier at the loop's end), its slot refilled with tile it + 2.
      const int kn = k0 + 2 * kN, slot = it % 2;
      if (kn <= pos_last) locate_tile<K, D>(table, kn, pos_last, ent);
      cp_async_wait<1>();
      convert_tile<K, D>(kst + slot * G::kStageBytes, vst + slot * G::kStageBytes, kb, vb);
      if (kn <= pos_last)
        stage_tile<K, D>(kc, vc, ent, kn, kvh, a.n_kv_heads, kst + slot * G::kStageBytes,
                         vst + slot * G::kStageBytes);
      cp_async_commit();
      __syncthreads();
    } else {
      load_tile<K, D>(kc, vc, table, k0, pos_last, kvh, a.n_kv_heads, kb, vb);
      __syncthreads();
    }
    // Warp-uniform: skip tiles no row of the warp sees; mask only tiles some row sees in part.
    if (k0 <= warp_last && k0 + kN - 1 >= warp_lo) {
      const bool masked =
          tail_rows || k0 + kN - 1 > warp_first || (a.window > 0 && k0 <= warp_last - a.window);
      if (masked)
        tile_step<K, D, true>(qa, kb, vb, k0, pos, lo_excl, sc, m, l, o);
      else
        tile_step<K, D, false>(qa, kb, vb, k0, pos, lo_excl, sc, m, l, o);
    }
    if constexpr (kBuf == 1) __syncthreads();  // the one buffer is refilled in the next iteration
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row_tok[h] < 0) continue;
    const float inv = 1.0f / l[h];  // > 0: every row sees its own key
    float* dst = out + (static_cast<int64_t>(row_tok[h]) * a.n_heads + row_head[h]) * D + 2 * c;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
  }
}

template <KvKind K, int D, int kBuf>
void launch_with(const float* q, const void* kc, const void* vc, const DevBatch& b, const int32_t* seq_begin,
                 int n_seqs, int min_new, int64_t n_tiles, const AttnShape& a, float* out, cudaStream_t s) {
  using E = typename KvElem<K>::T;
  constexpr int kSmem = Tile<K, D>::smem_bytes(kBuf);
  if constexpr (kSmem > 48 * 1024) {  // past the default dynamic limit: opt in once per instance
    static const bool opted = [] {
      CUDA_CHECK(cudaFuncSetAttribute(flash_attention_kernel<K, D, kBuf>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      return true;
    }();
    (void)opted;
  }
  launch_pdl(flash_attention_kernel<K, D, kBuf>, dim3(static_cast<unsigned>(n_tiles), a.n_kv_heads),
             Tile<K, D>::kThreads, kSmem, s, q, static_cast<const E*>(kc), static_cast<const E*>(vc), b,
             seq_begin, n_seqs, min_new, a, out);
  CUDA_CHECK(cudaGetLastError());
}

// The large form (Tile::kBigBuf operand buffers: BF16 three at head_dim <= 64) where kMinBlocks blocks of it fit
// one SM's shared memory (Hopper: 228 KiB per SM), else the small one (kSmallBuf: two): sm_120 / sm_121 have
// ~100 KiB per SM and 99 KiB per block, where a third buffer would cost head_dim 64 its second block per SM.
template <KvKind K, int D>
bool big_form_fits() {
  // NIBBLE_FA_BUFFERS=2 takes the small form anywhere (a ctest entry checks it on an sm_90 GPU; Model::load
  // rejects other values).
  static const bool force_small = [] {
    const char* e = std::getenv("NIBBLE_FA_BUFFERS");
    return e != nullptr && std::string(e) == "2";
  }();
  if (force_small) return false;
  int dev = 0, per_sm = 0, per_block = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  constexpr int kBig = Tile<K, D>::smem_bytes(Tile<K, D>::kBigBuf), kReserved = 1024;  // the driver's reserve
  return kBig <= per_block && Tile<K, D>::kMinBlocks * (kBig + kReserved) <= per_sm;
}

template <KvKind K, int D>
void launch_for(const float* q, const void* kc, const void* vc, const DevBatch& b, const int32_t* seq_begin,
                int n_seqs, int min_new, int64_t n_tiles, const AttnShape& a, float* out, cudaStream_t s) {
  using G = Tile<K, D>;
  if constexpr (G::kBigBuf == G::kSmallBuf) {
    launch_with<K, D, G::kBigBuf>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
  } else if (big_form_fits<K, D>()) {
    launch_with<K, D, G::kBigBuf>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
  } else {
    launch_with<K, D, G::kSmallBuf>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
  }
}

template <KvKind K>
void launch_kind(const float* q, const void* kc, const void* vc, const DevBatch& b, const int32_t* seq_begin,
                 int n_seqs, int min_new, int64_t n_tiles, const AttnShape& a, float* out, cudaStream_t s) {
  switch (a.head_dim) {
    case 16:
      return launch_for<K, 16>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
    case 32:
      return launch_for<K, 32>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
    case 64:
      return launch_for<K, 64>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
    case 128:
      return launch_for<K, 128>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
  }
}

}  // namespace

bool flash_attention_supported(const AttnShape& a) {
  const bool dim = a.head_dim == 16 || a.head_dim == 32 || a.head_dim == 64 || a.head_dim == 128;
  return dim && a.n_kv_heads > 0 && a.n_heads % a.n_kv_heads == 0 &&
         a.n_heads / a.n_kv_heads <= 16 * kWarps;
}

int64_t flash_attention_tiles(const std::vector<int32_t>& n_new, int min_new, const AttnShape& a) {
  const int per_tile = 16 * kWarps / (a.n_heads / a.n_kv_heads);
  int64_t n = 0;
  for (int32_t t : n_new)
    if (t >= min_new) n += (t + per_tile - 1) / per_tile;
  return n;
}

void launch_flash_attention(KvKind kind, const float* q, const void* kc, const void* vc, const DevBatch& b,
                            const int32_t* seq_begin, int n_seqs, int min_new, int64_t n_tiles,
                            const AttnShape& a, float* out, cudaStream_t s) {
  NB_CHECK(flash_attention_supported(a), "flash attention: head_dim " + std::to_string(a.head_dim) +
                                             " with " + std::to_string(a.n_heads) + "/" +
                                             std::to_string(a.n_kv_heads) + " heads is not supported");
  NB_CHECK(n_tiles >= 1 && n_tiles < (int64_t{1} << 31) && a.n_kv_heads <= 65535, "flash attention: grid");
  // The kernel takes the running max on unscaled logits (max commutes with a positive scale only).
  NB_CHECK(a.scale > 0.0f, "flash attention: softmax scale " + std::to_string(a.scale) + " is not positive");
  switch (kind) {
    case KvKind::kF32:
      return launch_kind<KvKind::kF32>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
    case KvKind::kBF16:
      return launch_kind<KvKind::kBF16>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
    case KvKind::kFP8:
      return launch_kind<KvKind::kFP8>(q, kc, vc, b, seq_begin, n_seqs, min_new, n_tiles, a, out, s);
  }
}

}  // namespace nb::cuda
