// Tensor-core decode GEMV for FP4 weights (MXFP4, NVFP4) at batch 1..8, and the MoE expert projections
// at decode, on the checkpoint layout as it is (row-major codes [n, k/2], scales [n, k/bs]): no repacking,
// so the prefill GEMMs and every other reader share the bytes.
//
// Why tensor cores for a GEMV: at the H200's ~4.6 TB/s an SM must consume ~35 FP4 elements per clock,
// and it issues 4 warp-instructions (128 lane-instructions) per clock, so the whole per-element budget is
// ~3.6 lane-instructions. Software E2M1 decoding alone costs ~1.9 per element (below); an fp32 FMA per
// element plus its fp16 -> fp32 conversion would blow the budget (the CUDA-core kernel in gemv.cu runs at
// ~42 %). mma.sync m16n8k16 takes the decoded fp16 straight and does the multiply-adds 256 at a time.
//
// Per lane and group (bench/NOTES.md has the counts): 2 weight loads, 4 scale bytes, 4 half2 decodes per
// code word (~15 integer ops per 8 codes), one shared-memory load and one MMA per token per k16 step,
// 4 FFMAs per token per group. Nothing else is in the inner loop: no branches (B comes from a per-lane
// pointer fixed before the loop), no address arithmetic beyond one add per group.
//
// Tiles. A warp computes 16 output rows ("row A" = g, "row B" = g + 8 of lane (g = lane / 4, t = lane % 4),
// the MMA's row layout). A group = 4 consecutive scale blocks (bs = 32 for MXFP4, 16 for NVFP4) along k;
// lane t loads block t of the group for its rows A and B (MXFP4: 16 bytes each, NVFP4: 8). One MMA covers
// one k16 step of all 4 lanes' blocks at once: the k order inside a block is permuted (pairs of nibbles
// (i, i + 4) of a code word decode into one half2 with two shifts and masks), and the activations are
// staged in the same permuted order, so each lane's own codes are its A fragment.
// Block scales: one MMA sums over 4 different scale blocks (one per lane t). So column n of B carries the
// activations of block n % 4 only (hi half of x for n < 4, lo half for n >= 4), zeros elsewhere: then
// C[row][n] is the unscaled partial sum of block n % 4, and after the group's steps (8 for MXFP4, 4 for
// NVFP4) each lane scales its 4 C values by their block factors in fp32. Lane (g, t) feeds column g,
// which is non-zero only where g % 4 == t; the others read a zero region of shared memory.
// Activations: x * 2^s (power of two, so that max |x| lands in [2^14, 2^15): no fp16 overflow, lo parts
// stay normal) split into fp16 hi + lo (~22 bits). E2M1 -> fp16 by bit moves gives e2m1 * 2^-14 exactly,
// fp16 x fp16 products are exact in fp32; 2^14 * 2^-s come back once per output. The error is the fp32
// accumulation and x's 22-bit split, well inside the CPU reference's tolerance.
#include <algorithm>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "kernels/gemv.cuh"

namespace nb::cuda {
namespace {

constexpr int kWarps = 8;  // per block of the linear and fc1 kernels; fc2 uses kFc2Warps
constexpr int kFc2Warps = 16;

template <WKind K>
struct Fp4Fmt;
template <>
struct Fp4Fmt<WKind::kMXFP4> {
  static constexpr int kBs = 32;       // elements per scale block
  static constexpr int kSteps = 8;     // k16 MMA steps per group (4 blocks x kBs / 16 / 4 lanes... = kBs / 4)
  static constexpr int kDepth = 3;     // groups of loads per warp in flight (1 KiB each)
  using Codes = uint4;                 // one lane's block of one row: 16 bytes
  // E8M0: 2^(c - 127) is the float with exponent field c. Code 0 (2^-127, a float subnormal) decodes as 0
  // and code 255 (NaN) as infinity: neither occurs in a real checkpoint's weights.
  __device__ static float factor(uint32_t c) { return __uint_as_float(c << 23); }
};
template <>
struct Fp4Fmt<WKind::kNVFP4> {
  static constexpr int kBs = 16;
  static constexpr int kSteps = 4;
  static constexpr int kDepth = 4;     // 512 B per group per warp: more groups
  using Codes = uint2;
  // UE4M3 exactly, subnormals included: the 7 code bits at float bits 20..26 make ue4m3 * 2^-120 (an
  // fp32 subnormal for code exponent 0), times 2^120. The per-tensor global scale is applied per output.
  __device__ static float factor(uint32_t c) { return __uint_as_float((c & 0x7fu) << 20) * 0x1p120f; }
};

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A code word's 8 E2M1 codes (nibble i = element i) as 4 fp16 pairs h[i] = (element i, element i + 4),
// each equal to e2m1 * 2^-14: the sign bit goes to fp16 bit 15 and the 3 magnitude bits to 9..11
// (exponent 0..3, mantissa top bit), so code 1 lands on the subnormal 2^-15. 11 integer ops for 8 codes:
// one shift + LOP3 gives, per byte, the even nibble's magnitude at bits 0..2 and its sign at bit 6
// (`ev`), another the odd nibble's magnitude at 1..3 and sign at 7 (`od`); then each pair is one shift
// and mask (or just the mask) away. Bits outside the mask are don't-cares throughout.
// The selects are inline PTX: written in C++ the compiler pushes each output's mask back through the
// shifts and ends with ~14 ops per word instead of 11.
__device__ __forceinline__ uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {  // (a & mask) | (b & ~mask)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
  return r;
}
__device__ __forceinline__ void e2m1_word(uint32_t q, uint32_t (&h)[4]) {
  constexpr uint32_t kMask = 0x8E008E00u;  // fp16 sign + bits 9..11, both halves
  const uint32_t ev = select_bits(0x07070707u, q, q << 3);  // even nibble: magnitude 0..2, sign at 6
  const uint32_t od = select_bits(0x0F0F0F0Fu, q >> 3, q);  // odd nibble: magnitude 1..3, sign at 7
  h[0] = (ev << 9) & kMask;  // bytes 0, 2: elements 0, 4
  h[1] = (od << 8) & kMask;  // elements 1, 5
  h[2] = (ev << 1) & kMask;  // bytes 1, 3: elements 2, 6
  h[3] = od & kMask;         // elements 3, 7
}

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// ---- Activation staging -------------------------------------------------------------------------------
// Shared memory (fp16 units): a zero region [kp], then per token hi [kp] and lo [kp]; kp = k padded to whole
// groups. Inside each octet of 8 elements the staged order is 0 4 1 5 2 6 3 7, so k16 step s of a block
// reads 4 consecutive halves (the B registers (x_i, x_i+4), (x_i+1, x_i+5)) matching e2m1_pair's pairs.
__host__ __device__ constexpr int padded_k(int k, int bs) { return (k + 4 * bs - 1) / (4 * bs) * (4 * bs); }
// Bytes of shared memory for m staged tokens.
__host__ __device__ constexpr size_t stage_bytes(int m, int k, int bs) {
  return static_cast<size_t>(1 + 2 * m) * padded_k(k, bs) * 2;
}

__device__ __forceinline__ uint32_t pack_half2(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) | (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}

// All threads of the block: stage m tokens of x (row t at x + t * ld, k floats) into smem; unscale[t] gets
// 2^14 (the weights' decode factor) * 2^-s. `red` is kMaxWarps floats of scratch. Ends with a barrier.
constexpr int kMaxWarps = 16;
__device__ void stage_x(const float* __restrict__ x, int64_t ld, int m, int k, int bs, uint16_t* smem, float* red,
                        float* unscale) {
  const int kp = padded_k(k, bs), nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < kp / 8; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  for (int t = 0; t < m; ++t) {
    const float* xt = x + t * ld;
    // Pass 1: max |x| -> power-of-two prescale.
    float mx = 0.0f;
    for (int i = threadIdx.x; i < k / 4; i += blockDim.x) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(xt) + i);
      mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    mx = warp_max(mx);
    __syncthreads();  // red is free (the previous token's readers are done)
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = 0.0f;
    for (int q = 0; q < nw; ++q) mx = fmaxf(mx, red[q]);
    int e = 0;
    if (mx > 0.0f && mx <= 3.4e38f) frexpf(mx, &e);  // mx in [2^(e-1), 2^e)
    const int sh = max(-120, min(120, 15 - e));
    const float pre = ldexpf(1.0f, sh);
    if (threadIdx.x == 0) unscale[t] = ldexpf(1.0f, -sh) * 16384.0f;
    // Pass 2: octets -> hi and lo halves in the permuted order.
    uint4* hi = reinterpret_cast<uint4*>(smem + static_cast<size_t>(1 + 2 * t) * kp);
    uint4* lo = reinterpret_cast<uint4*>(smem + static_cast<size_t>(2 + 2 * t) * kp);
    for (int o = threadIdx.x; o < kp / 8; o += blockDim.x) {
      float v[8] = {};
      if (8 * o < k) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(xt + 8 * o));
        const float4 b = __ldg(reinterpret_cast<const float4*>(xt + 8 * o) + 1);
        v[0] = a.x * pre, v[1] = a.y * pre, v[2] = a.z * pre, v[3] = a.w * pre;
        v[4] = b.x * pre, v[5] = b.y * pre, v[6] = b.z * pre, v[7] = b.w * pre;
      }
      uint32_t h[4], l[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // halves 2i, 2i + 1 of the octet = elements i, i + 4
        const __half h0 = __float2half_rn(v[i]), h1 = __float2half_rn(v[i + 4]);
        h[i] = pack_half2(h0, h1);
        l[i] = pack_half2(__float2half_rn(v[i] - __half2float(h0)), __float2half_rn(v[i + 4] - __half2float(h1)));
      }
      hi[o] = make_uint4(h[0], h[1], h[2], h[3]);
      lo[o] = make_uint4(l[0], l[1], l[2], l[3]);
    }
  }
  __syncthreads();
}

// ---- One warp, one 16-row tile, a range of groups --------------------------------------------------------
// Where a lane's two rows live: codes and scales of row A (tile row g) and row B (g + 8), already offset to
// the lane's block t of group 0 and its scale blocks bb = 2 (t & 1), bb + 1.
struct LaneRows {
  const uint8_t* codes[2];
  const uint8_t* scales[2];
};

template <WKind K>
__device__ __forceinline__ LaneRows lane_rows(const DevPart& pa, int ra, const DevPart& pb, int rb, int k) {
  using F = Fp4Fmt<K>;
  const int t = threadIdx.x & 3, bb = 2 * (t & 1);
  LaneRows r;
  r.codes[0] = pa.data + static_cast<int64_t>(ra) * (k / 2) + t * (F::kBs / 2);
  r.codes[1] = pb.data + static_cast<int64_t>(rb) * (k / 2) + t * (F::kBs / 2);
  r.scales[0] = pa.scales + static_cast<int64_t>(ra) * (k / F::kBs) + bb;
  r.scales[1] = pb.scales + static_cast<int64_t>(rb) * (k / F::kBs) + bb;
  return r;
}

// One group's loads for a lane: codes of rows A and B, and the 4 scale codes it applies.
template <WKind K>
struct GroupData {
  typename Fp4Fmt<K>::Codes a, b;
  uint32_t sa0, sa1, sb0, sb1;
};

// A whole group (every block inside k): plain loads at immediate offsets from the running pointers.
template <WKind K>
__device__ __forceinline__ void load_full(GroupData<K>& d, const LaneRows& r, int i) {
  using F = Fp4Fmt<K>;
  using C = typename F::Codes;
  d.a = __ldg(reinterpret_cast<const C*>(r.codes[0] + i * 2 * F::kBs));
  d.b = __ldg(reinterpret_cast<const C*>(r.codes[1] + i * 2 * F::kBs));
  d.sa0 = __ldg(r.scales[0] + 4 * i), d.sa1 = __ldg(r.scales[0] + 4 * i + 1);
  d.sb0 = __ldg(r.scales[1] + 4 * i), d.sb1 = __ldg(r.scales[1] + 4 * i + 1);
}

// The last group when k does not fill it: blocks past k read as zero codes and zero scales.
template <WKind K>
__device__ __forceinline__ void load_tail(GroupData<K>& d, const LaneRows& r, int grp, int n_blocks) {
  using F = Fp4Fmt<K>;
  using C = typename F::Codes;
  const int t = threadIdx.x & 3, bb = 2 * (t & 1), blk = 4 * grp + t, sb = 4 * grp + bb;
  d.a = d.b = C{};
  if (blk < n_blocks) {
    d.a = __ldg(reinterpret_cast<const C*>(r.codes[0]));
    d.b = __ldg(reinterpret_cast<const C*>(r.codes[1]));
  }
  d.sa0 = sb < n_blocks ? __ldg(r.scales[0]) : 0u;
  d.sb0 = sb < n_blocks ? __ldg(r.scales[1]) : 0u;
  d.sa1 = sb + 1 < n_blocks ? __ldg(r.scales[0] + 1) : 0u;
  d.sb1 = sb + 1 < n_blocks ? __ldg(r.scales[1] + 1) : 0u;
}

__device__ __forceinline__ void advance(LaneRows& r, int groups, int bs) {
  r.codes[0] += groups * 2 * bs, r.codes[1] += groups * 2 * bs;
  r.scales[0] += 4 * groups, r.scales[1] += 4 * groups;
}

// The lane's code word w (0..kBs/8-1) of rows A and B.
__device__ __forceinline__ uint32_t word(const uint4& c, int w) { return w == 0 ? c.x : w == 1 ? c.y : w == 2 ? c.z : c.w; }
__device__ __forceinline__ uint32_t word(const uint2& c, int w) { return w == 0 ? c.x : c.y; }

// acc[t][0], acc[t][1]: the lane's share of rows A and B for token t, += this group.
template <WKind K, int M>
__device__ __forceinline__ void compute_group(const GroupData<K>& d, const uint32_t (&bptr)[M], int grp,
                                              float (&acc)[M][2]) {
  using F = Fp4Fmt<K>;
  float c[M][4];
#pragma unroll
  for (int t = 0; t < M; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
  const uint32_t goff = static_cast<uint32_t>(grp) * (4 * F::kBs * 2);  // bytes of staged x per group
#pragma unroll
  for (int s = 0; s < F::kSteps; ++s) {
    // A fragment: rows A, B x (pairs 2(s % 2), 2(s % 2) + 1) of code word s / 2.
    uint32_t ha[4], hb[4];
    e2m1_word(word(d.a, s / 2), ha);
    e2m1_word(word(d.b, s / 2), hb);
    const int i = 2 * (s % 2);
    const uint32_t a[4] = {ha[i], hb[i], ha[i + 1], hb[i + 1]};
#pragma unroll
    for (int t = 0; t < M; ++t) {  // tokens >= m compute on stale shared memory and are never written out
      const uint2 b = lds64(bptr[t] + goff + 8 * s);
      mma16816(c[t], a, b.x, b.y);
    }
  }
  const float fa0 = F::factor(d.sa0), fa1 = F::factor(d.sa1), fb0 = F::factor(d.sb0), fb1 = F::factor(d.sb1);
#pragma unroll
  for (int t = 0; t < M; ++t) {
    acc[t][0] = fmaf(c[t][0], fa0, fmaf(c[t][1], fa1, acc[t][0]));
    acc[t][1] = fmaf(c[t][2], fb0, fmaf(c[t][3], fb1, acc[t][1]));
  }
}

// Groups [g0, g1) of one tile for this lane (r points at group 0). kDepth groups of loads are in flight:
// the buffer of group i is refilled with group i + kDepth right after it is consumed, so kDepth - 1 stay
// in flight during each group's math. The loop runs over whole groups; a partial last group (k not a
// multiple of 4 blocks) is done once at the end with predicated loads.
template <WKind K, int M>
__device__ __forceinline__ void tile_dot(LaneRows r, const uint32_t (&bptr)[M], int g0, int g1, int n_blocks,
                                         float (&acc)[M][2]) {
  using F = Fp4Fmt<K>;
  constexpr int D = M >= 8 ? 1 : M >= 4 ? 2 : F::kDepth;  // many tokens: their accumulators take the registers
  const int gf = min(g1, n_blocks / 4);  // end of the whole groups in [g0, g1)
  advance(r, g0, F::kBs);
  GroupData<K> buf[D];
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (g0 + i < gf) load_full<K>(buf[i], r, i);
  int g = g0;
  for (; g < gf; g += D) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      if (g + i < gf) {
        compute_group<K, M>(buf[i], bptr, g + i, acc);
        if (g + i + D < gf) load_full<K>(buf[i], r, i + D);
      }
    }
    advance(r, D, F::kBs);
  }
  if (gf < g1) {  // the partial last group
    advance(r, gf - g, F::kBs);
    GroupData<K> d;
    load_tail<K>(d, r, gf, n_blocks);
    compute_group<K, M>(d, bptr, gf, acc);
  }
}

// Per-lane B pointers: lane (g, t) feeds MMA column g, non-zero only for g == t (hi) and g == t + 4 (lo).
template <WKind K, int M>
__device__ __forceinline__ void b_pointers(const uint16_t* smem, int kp, uint32_t (&bptr)[M]) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int region_of_token = g == t ? 1 : g == t + 4 ? 2 : 0;  // 1 + 2 tok: hi, 2 + 2 tok: lo, 0: zeros
#pragma unroll
  for (int tok = 0; tok < M; ++tok) {
    const int region = region_of_token == 0 ? 0 : region_of_token + 2 * tok;
    bptr[tok] = base + static_cast<uint32_t>(region * kp + t * Fp4Fmt<K>::kBs) * 2;
  }
}

// Rows A and B of a lane: the 4 lanes of a row group hold parts of the same two rows; sum them.
__device__ __forceinline__ void sum_lanes(float (&v)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    v[r] += __shfl_xor_sync(0xffffffffu, v[r], 1);
    v[r] += __shfl_xor_sync(0xffffffffu, v[r], 2);
  }
}

__device__ __forceinline__ float global_factor(const DevPart& p, WKind kind) {
  return kind == WKind::kNVFP4 ? (p.divide ? 1.0f / p.global : p.global) : 1.0f;
}

// ---- Plain linear ------------------------------------------------------------------------------------------
// Grid: blocks loop over tile sets of kWarps / ksplit tiles; ksplit warps share a tile's groups and meet in
// shared memory in a fixed order. Dynamic smem: the staged tokens.
template <WKind K, int M>
__global__ void __launch_bounds__(kWarps * 32, M <= 2 ? 3 : 2)
    fp4_linear_kernel(const __grid_constant__ DevWeight w, const float* __restrict__ x, int m,
                      const float* __restrict__ bias, float* __restrict__ y, int ksplit) {
  using F = Fp4Fmt<K>;
  extern __shared__ uint4 smem_x[];
  __shared__ float red[kWarps][M][16];
  __shared__ float scratch[kMaxWarps];
  __shared__ float unscale[M];
  uint16_t* sx = reinterpret_cast<uint16_t*>(smem_x);
  pdl_wait();  // x comes from the previous kernel on the stream (see launch_pdl)
  stage_x(x, w.k, m, w.k, F::kBs, sx, scratch, unscale);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint32_t bptr[M];
  b_pointers<K, M>(sx, padded_k(w.k, F::kBs), bptr);
  const int n = w.n, n_blocks = w.k / F::kBs, n_groups = (n_blocks + 3) / 4;
  const int tpb = kWarps / ksplit, part = warp % ksplit;
  const int gpp = (n_groups + ksplit - 1) / ksplit, g0 = min(n_groups, part * gpp), g1 = min(n_groups, g0 + gpp);
  const int n_tiles = (n + 15) / 16, n_sets = (n_tiles + tpb - 1) / tpb;
  for (int set = blockIdx.x; set < n_sets; set += gridDim.x) {  // uniform over the block: it synchronizes
    const int tile = set * tpb + warp / ksplit;
    float acc[M][2] = {};
    int ra = min(tile * 16 + g, n - 1), rb = min(tile * 16 + g + 8, n - 1);
    const DevPart& pa = find_part(w, ra);
    const DevPart& pb = find_part(w, rb);
    if (tile < n_tiles) tile_dot<K, M>(lane_rows<K>(pa, ra, pb, rb, w.k), bptr, g0, g1, n_blocks, acc);
    const float fa = global_factor(pa, K), fb = global_factor(pb, K);
#pragma unroll
    for (int tok = 0; tok < M; ++tok) {
      sum_lanes(acc[tok]);
      acc[tok][0] *= fa, acc[tok][1] *= fb;
    }
    const int row = tile * 16 + g;
    if (ksplit == 1) {  // lane t == 0 of each row group writes its rows g and g + 8
      if (t == 0 && tile < n_tiles) {
#pragma unroll
        for (int tok = 0; tok < M; ++tok) {
          if (tok >= m) break;
          if (row < n) y[static_cast<int64_t>(tok) * n + row] = acc[tok][0] * unscale[tok] + (bias ? bias[row] : 0.0f);
          if (row + 8 < n)
            y[static_cast<int64_t>(tok) * n + row + 8] = acc[tok][1] * unscale[tok] + (bias ? bias[row + 8] : 0.0f);
        }
      }
      continue;
    }
    if (t == 0) {
#pragma unroll
      for (int tok = 0; tok < M; ++tok) red[warp][tok][g] = acc[tok][0], red[warp][tok][g + 8] = acc[tok][1];
    }
    __syncthreads();
    if (part == 0 && lane < 16 && tile < n_tiles && tile * 16 + lane < n) {
      const int r = tile * 16 + lane;
#pragma unroll
      for (int tok = 0; tok < M; ++tok) {
        if (tok >= m) break;
        float v = red[warp][tok][lane];
        for (int q = 1; q < ksplit; ++q) v += red[warp + q][tok][lane];
        y[static_cast<int64_t>(tok) * n + r] = v * unscale[tok] + (bias ? bias[r] : 0.0f);
      }
    }
    __syncthreads();
  }
}

// ---- MoE fc1 + GLU --------------------------------------------------------------------------------------
// Grid (blocks over tile sets, pairs). A tile is 8 outputs j: lane (g, t)'s row A is gate(j0 + g) and its
// row B is up(j0 + g) in either layout, so the GLU happens in the lane that holds both sums.
template <WKind K>
__global__ void __launch_bounds__(kWarps * 32, 3)
    fp4_moe_fc1_kernel(ExpertTable tab, const int32_t* __restrict__ ids, int n_pairs, int top_k,
                       const float* __restrict__ x, Glu glu, float limit, float* __restrict__ act, int ksplit) {
  using F = Fp4Fmt<K>;
  extern __shared__ uint4 smem_x[];
  __shared__ float red[kWarps][16];
  __shared__ float scratch[kMaxWarps];
  __shared__ float unscale[1];
  uint16_t* sx = reinterpret_cast<uint16_t*>(smem_x);
  pdl_wait();  // x and ids come from the previous kernels on the stream (see launch_pdl)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int d = tab.d_expert, k = tab.d_model, n_blocks = k / F::kBs, n_groups = (n_blocks + 3) / 4;
  const bool interleaved = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  const int tpb = kWarps / ksplit, part = warp % ksplit;
  const int gpp = (n_groups + ksplit - 1) / ksplit, g0 = min(n_groups, part * gpp), g1 = min(n_groups, g0 + gpp);
  const int n_tiles = (d + 7) / 8, n_sets = (n_tiles + tpb - 1) / tpb;
  uint32_t bptr[1];
  b_pointers<K, 1>(sx, padded_k(k, F::kBs), bptr);
  for (int p = blockIdx.y; p < n_pairs; p += gridDim.y) {
    const int e = ids[p];
    const DevWeight& w = tab.fc1[e];
    __syncthreads();  // the previous pair's readers of the staged x are done
    stage_x(x + static_cast<int64_t>(p / top_k) * k, k, 1, k, F::kBs, sx, scratch, unscale);
    for (int set = blockIdx.x; set < n_sets; set += gridDim.x) {
      const int tile = set * tpb + warp / ksplit, j = min(tile * 8 + g, d - 1);
      const int ga = interleaved ? 2 * j : j, gb = interleaved ? 2 * j + 1 : d + j;  // gate and up rows
      int ra = ga, rb = gb;
      const DevPart& pa = find_part(w, ra);
      const DevPart& pb = find_part(w, rb);
      float acc[1][2] = {};
      if (tile < n_tiles) tile_dot<K, 1>(lane_rows<K>(pa, ra, pb, rb, k), bptr, g0, g1, n_blocks, acc);
      sum_lanes(acc[0]);
      float gate = acc[0][0] * global_factor(pa, K), up = acc[0][1] * global_factor(pb, K);
      if (ksplit > 1) {
        if (t == 0) red[warp][g] = gate, red[warp][g + 8] = up;
        __syncthreads();
        if (part == 0 && t == 0) {
          for (int q = 1; q < ksplit; ++q) gate += red[warp + q][g], up += red[warp + q][g + 8];
        }
        __syncthreads();
      }
      if (part == 0 && t == 0 && tile < n_tiles && tile * 8 + g < d) {
        gate *= unscale[0], up *= unscale[0];
        if (tab.fc1_bias) {
          gate += tab.fc1_bias[static_cast<int64_t>(e) * 2 * d + ga];
          up += tab.fc1_bias[static_cast<int64_t>(e) * 2 * d + gb];
        }
        float a;
        if (glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves) {
          gate = fminf(gate, limit);
          up = fminf(fmaxf(up, -limit), limit);
          a = gate / (1.0f + expf(-1.702f * gate)) * (up + 1.0f);
        } else {
          a = gate / (1.0f + expf(-gate)) * up;
        }
        act[static_cast<int64_t>(p) * d + j] = a;
      }
    }
  }
}

// ---- MoE fc2 + weighted combine -------------------------------------------------------------------------
// Grid (blocks over tiles of 16 output rows, tokens). A block of kFc2Warps warps = per_round choices x
// ksplit parts of k; the block stages the round's activation rows once and loops over its tiles. top_k
// choices take ceil(top_k / per_round) rounds (one for gpt-oss and qwen3); a round adds to y in a fixed
// order, so the sum is deterministic.
template <WKind K>
__global__ void __launch_bounds__(kFc2Warps * 32, 1)
    fp4_moe_fc2_kernel(ExpertTable tab, const int32_t* __restrict__ ids, const float* __restrict__ weights,
                       int n_tokens, int top_k, const float* __restrict__ act, float* __restrict__ y, int ksplit,
                       int per_round) {
  using F = Fp4Fmt<K>;
  extern __shared__ uint4 smem_x[];
  __shared__ float red[kFc2Warps][16];
  __shared__ float scratch[kMaxWarps];
  __shared__ float unscale[kFc2Warps];
  pdl_wait();  // act, ids and weights come from the previous kernels on the stream
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n = tab.d_model, k = tab.d_expert, n_blocks = k / F::kBs, n_groups = (n_blocks + 3) / 4;
  const int c = warp / ksplit, part = warp % ksplit;  // this warp's choice within the round, its k part
  const int gpp = (n_groups + ksplit - 1) / ksplit, g0 = min(n_groups, part * gpp), g1 = min(n_groups, g0 + gpp);
  const int n_tiles = (n + 15) / 16, kp = padded_k(k, F::kBs);
  uint16_t* sx = reinterpret_cast<uint16_t*>(smem_x);
  uint32_t bptr[1];
  b_pointers<K, 1>(sx + static_cast<size_t>(c) * 3 * kp, kp, bptr);
  for (int tok = blockIdx.y; tok < n_tokens; tok += gridDim.y) {
    for (int r0 = 0; r0 < top_k; r0 += per_round) {
      const int in_round = min(per_round, top_k - r0);
      __syncthreads();  // the previous round's readers are done
      for (int i = 0; i < in_round; ++i)
        stage_x(act + (static_cast<int64_t>(tok) * top_k + r0 + i) * k, k, 1, k, F::kBs, sx + static_cast<size_t>(i) * 3 * kp,
                scratch, unscale + i);
      const int pc = tok * top_k + r0 + c;  // this warp's (token, choice) pair
      const DevWeight* w = c < in_round ? &tab.fc2[ids[pc]] : nullptr;
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        float v[2] = {};
        if (w) {
          int ra = min(tile * 16 + g, n - 1), rb = min(tile * 16 + g + 8, n - 1);
          const DevPart& pa = find_part(*w, ra);
          const DevPart& pb = find_part(*w, rb);
          float acc[1][2] = {};
          tile_dot<K, 1>(lane_rows<K>(pa, ra, pb, rb, k), bptr, g0, g1, n_blocks, acc);
          sum_lanes(acc[0]);
          v[0] = acc[0][0] * global_factor(pa, K), v[1] = acc[0][1] * global_factor(pb, K);
        }
        if (t == 0) red[warp][g] = v[0], red[warp][g + 8] = v[1];
        __syncthreads();
        const int row = tile * 16 + lane;
        if (warp == 0 && lane < 16 && row < n) {
          float out = r0 == 0 ? 0.0f : y[static_cast<int64_t>(tok) * n + row];
          for (int i = 0; i < in_round; ++i) {
            float sum = red[i * ksplit][lane];
            for (int q = 1; q < ksplit; ++q) sum += red[i * ksplit + q][lane];
            const int pi = tok * top_k + r0 + i, e = ids[pi];
            const float b = tab.fc2_bias ? tab.fc2_bias[static_cast<int64_t>(e) * n + row] : 0.0f;
            out += weights[pi] * (sum * unscale[i] + b);  // weight applied after the bias (formats.md §2.4)
          }
          y[static_cast<int64_t>(tok) * n + row] = out;
        }
        __syncthreads();
      }
    }
  }
}

// ---- Launch helpers ------------------------------------------------------------------------------------
struct DeviceLimits {
  int sms = 0, smem_optin = 0;
};
const DeviceLimits& limits() {
  static const DeviceLimits l = [] {
    DeviceLimits d;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return d;
  }();
  return l;
}

// Opts `kernel` in to the dynamic shared memory it needs; false if the device cannot give it.
template <class Kernel>
bool fits_smem(Kernel kernel, size_t smem) {
  cudaFuncAttributes fa{};
  CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  if (smem + fa.sharedSizeBytes > static_cast<size_t>(limits().smem_optin)) return false;
  if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return true;
}

template <class Kernel>
int resident_blocks(Kernel kernel, int threads, size_t smem) {
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return std::max(1, per_sm) * limits().sms;
}

// The k split for `units` independent row tiles: the largest power of two <= kWarps that keeps every part
// >= 2 groups and still fits the resident warps in one wave (a second wave of a latency-bound kernel costs
// a whole extra latency). Tall weights (lm_head) get 1.
int choose_ksplit(int64_t units, int n_groups, int resident_warps, int max_split) {
  for (int ks = max_split; ks >= 2; ks /= 2)
    if (n_groups >= 2 * ks && units * ks <= resident_warps) return ks;
  return 1;
}

template <WKind K, int M>
bool linear_for(const DevWeight& w, const float* x, int m, const float* bias, float* y, cudaStream_t s) {
  using F = Fp4Fmt<K>;
  auto kernel = fp4_linear_kernel<K, M>;
  const size_t smem = stage_bytes(M, w.k, F::kBs);
  if (!fits_smem(kernel, smem)) return false;
  const int resident = resident_blocks(kernel, kWarps * 32, smem);
  const int n_groups = (w.k / F::kBs + 3) / 4, n_tiles = ceil_div(w.n, 16);
  const int ks = choose_ksplit(n_tiles, n_groups, resident * kWarps, kWarps);
  const int n_sets = ceil_div(n_tiles, kWarps / ks);
  launch_pdl(kernel, std::min(n_sets, resident), kWarps * 32, smem, s, w, x, m, bias, y, ks);
  CUDA_CHECK(cudaGetLastError());
  return true;
}

template <WKind K>
bool linear_kind(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, cudaStream_t s) {
  const int mm = static_cast<int>(m);
  if (m == 1) return linear_for<K, 1>(w, x, mm, bias, y, s);
  if (m == 2) return linear_for<K, 2>(w, x, mm, bias, y, s);
  if (m <= 4) return linear_for<K, 4>(w, x, mm, bias, y, s);
  return linear_for<K, 8>(w, x, mm, bias, y, s);
}

// NIBBLE_FP4_MMA=0 turns these kernels off (the CUDA-core kernels of gemv.cu run instead): a measurement
// knob for the benchmarks.
bool enabled() {
  static const bool on = [] {
    const char* e = std::getenv("NIBBLE_FP4_MMA");
    return !(e && e[0] == '0');
  }();
  return on;
}

bool fp4_ok(WKind kind) { return enabled() && (kind == WKind::kMXFP4 || kind == WKind::kNVFP4); }

template <WKind K>
bool moe_fc1_kind(const ExpertTable& t, const int32_t* ids, int n_pairs, int top_k, const float* x, Glu glu,
                  float limit, float* act, cudaStream_t s) {
  using F = Fp4Fmt<K>;
  auto kernel = fp4_moe_fc1_kernel<K>;
  const size_t smem = stage_bytes(1, t.d_model, F::kBs);
  if (!fits_smem(kernel, smem)) return false;
  const int resident = resident_blocks(kernel, kWarps * 32, smem);
  const int n_groups = (t.d_model / F::kBs + 3) / 4, n_tiles = ceil_div(t.d_expert, 8);
  const int pairs = std::min(n_pairs, 65535);
  const int ks = choose_ksplit(static_cast<int64_t>(n_tiles) * pairs, n_groups, resident * kWarps, kWarps);
  const int n_sets = ceil_div(n_tiles, kWarps / ks);
  const int per_pair = std::max(1, resident / pairs);
  launch_pdl(kernel, dim3(std::min(n_sets, per_pair), pairs), kWarps * 32, smem, s, t, ids, n_pairs, top_k, x, glu,
             limit, act, ks);
  CUDA_CHECK(cudaGetLastError());
  return true;
}

template <WKind K>
bool moe_fc2_kind(const ExpertTable& t, const int32_t* ids, const float* weights, int n_tokens, int top_k,
                  const float* act, float* y, cudaStream_t s) {
  using F = Fp4Fmt<K>;
  auto kernel = fp4_moe_fc2_kernel<K>;
  // Choices per round: all top_k when they fit the warps and shared memory, else fewer.
  int per_round = std::min(top_k, kFc2Warps);
  while (per_round > 1 && stage_bytes(1, t.d_expert, F::kBs) * per_round + 1024 > static_cast<size_t>(limits().smem_optin) / 2)
    per_round /= 2;
  const size_t smem = stage_bytes(1, t.d_expert, F::kBs) * per_round;
  if (!fits_smem(kernel, smem)) return false;
  const int n_groups = (t.d_expert / F::kBs + 3) / 4;
  int ks = 1;
  while (ks * 2 * per_round <= kFc2Warps && n_groups >= 4 * ks) ks *= 2;
  const int resident = resident_blocks(kernel, kFc2Warps * 32, smem);
  const int tokens = std::min(n_tokens, 65535);
  const int per_token = std::max(1, resident / tokens);
  const dim3 grid(std::min(ceil_div(t.d_model, 16), per_token), tokens);
  launch_pdl(kernel, grid, kFc2Warps * 32, smem, s, t, ids, weights, n_tokens, top_k, act, y, ks, per_round);
  CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace

bool launch_linear_fp4_mma(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                           cudaStream_t s) {
  if (!fp4_ok(w.kind) || !w.vec_ok || m < 1 || m > 8 || w.k % 16 != 0) return false;
  return w.kind == WKind::kMXFP4 ? linear_kind<WKind::kMXFP4>(w, x, m, bias, y, s)
                                 : linear_kind<WKind::kNVFP4>(w, x, m, bias, y, s);
}

bool launch_moe_fc1_fp4(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x,
                        Glu glu, float limit, float* act, cudaStream_t s) {
  // Alignment is per expert (the ExpertTable does not record it): the backend only builds FP4 tables whose
  // experts are all 16-byte aligned (vec_ok), see fp4_table_ok.
  if (!fp4_ok(t.kind) || !t.fp4_vec_ok || t.d_model % 16 != 0 || n_pairs < 1) return false;
  const int np = static_cast<int>(std::min<int64_t>(n_pairs, 1 << 30));
  return t.kind == WKind::kMXFP4 ? moe_fc1_kind<WKind::kMXFP4>(t, ids, np, top_k, x, glu, limit, act, s)
                                 : moe_fc1_kind<WKind::kNVFP4>(t, ids, np, top_k, x, glu, limit, act, s);
}

bool launch_moe_fc2_fp4(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                        const float* act, float* y, cudaStream_t s) {
  if (!fp4_ok(t.kind) || !t.fp4_vec_ok || t.d_expert % 16 != 0 || n_tokens < 1 || top_k > 64) return false;
  const int nt = static_cast<int>(std::min<int64_t>(n_tokens, 1 << 30));
  return t.kind == WKind::kMXFP4 ? moe_fc2_kind<WKind::kMXFP4>(t, ids, weights, nt, top_k, act, y, s)
                                 : moe_fc2_kind<WKind::kNVFP4>(t, ids, weights, nt, top_k, act, y, s);
}

}  // namespace nb::cuda
