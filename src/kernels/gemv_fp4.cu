// Tensor-core decode GEMV for FP4 weights (MXFP4, NVFP4) at batch 1..8, and the MoE expert projections
// at decode, on the checkpoint layout as it is (row-major codes [n, k/2], scales [n, k/bs]): no repacking,
// so the prefill GEMMs and every other reader share the bytes. One token normally goes to
// gemv_fp4_stream.cu (faster there); these kernels take it where that one declines (k > 4096, k % 32 != 0)
// or is switched off (NIBBLE_FP4_STREAM=0).
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
  static constexpr int kSteps = 8;     // k16 MMA steps per group: each lane walks its block 4 elements a step
  using Codes = uint4;                 // one lane's block of one row: 16 bytes
  // E8M0: 2^(c - 127) is the float with exponent field c. Code 0 (2^-127, a float subnormal) decodes as 0
  // and code 255 (NaN) as infinity: neither occurs in a real checkpoint's weights.
  __device__ static float factor(uint32_t c) { return __uint_as_float(c << 23); }
};
template <>
struct Fp4Fmt<WKind::kNVFP4> {
  static constexpr int kBs = 16;
  static constexpr int kSteps = 4;
  using Codes = uint2;
  // UE4M3 exactly, subnormals included: the 7 code bits at float bits 20..26 make ue4m3 * 2^-120 (an
  // fp32 subnormal for code exponent 0), times 2^120. The per-tensor global scale is applied per output.
  __device__ static float factor(uint32_t c) { return __uint_as_float((c & 0x7fu) << 20) * 0x1p120f; }
};

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// ---- Activation staging -------------------------------------------------------------------------------
// Shared memory (fp16 units): a zero region [kp], then per token hi [kp] and lo [kp]; kp = k padded to whole
// groups. Inside each octet of 8 elements the staged order is 0 4 1 5 2 6 3 7, so k16 step s of a block
// reads 4 consecutive halves (the B registers (x_i, x_i+4), (x_i+1, x_i+5)) matching e2m1_word's pairs
// (the prescale and the hi + lo split are common.cuh's, shared with the prefill GEMMs' activations).
__host__ __device__ constexpr int padded_k(int k, int bs) { return (k + 4 * bs - 1) / (4 * bs) * (4 * bs); }
// Bytes of shared memory for m staged tokens.
__host__ __device__ constexpr size_t stage_bytes(int m, int k, int bs) {
  return static_cast<size_t>(1 + 2 * m) * padded_k(k, bs) * 2;
}

// All threads of the block: stage m <= kMaxTokens tokens of x (row t at x + t * ld, k floats) into smem;
// unscale[t] gets 2^14 (the weights' decode factor) * 2^-s_t. `red` is kMaxWarps * kMaxTokens floats of
// scratch. Two barriers for all tokens (the maxima are reduced together); ends with a barrier. Pass 2
// reads x again: the same thread read it in pass 1, so it comes from L1, not L2 (keeping it in
// registers instead measured nothing and spilled next to the weight loads in flight).
constexpr int kMaxWarps = 16, kMaxTokens = 8;
__device__ void stage_x(const float* __restrict__ x, int64_t ld, int m, int k, int bs, uint16_t* smem, float* red,
                        float* unscale) {
  const int kp = padded_k(k, bs), nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < kp / 8; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  // Pass 1: max |x| of every token -> power-of-two prescales.
  for (int t = 0; t < m; ++t) {
    const float* xt = x + t * ld;
    float mx = 0.0f;
    for (int i = threadIdx.x; i < k / 4; i += blockDim.x) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(xt) + i);
      mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    mx = warp_max(mx);
    if (lane == 0) red[t * kMaxWarps + warp] = mx;
  }
  __syncthreads();
  if (threadIdx.x < m) {
    float mx = 0.0f;
    for (int q = 0; q < nw; ++q) mx = fmaxf(mx, red[threadIdx.x * kMaxWarps + q]);
    const int sh = fp16_prescale_shift(mx);
    red[threadIdx.x * kMaxWarps] = ldexpf(1.0f, sh);  // the prescale, read below
    unscale[threadIdx.x] = ldexpf(1.0f, -sh) * 16384.0f;
  }
  __syncthreads();
  // Pass 2: octets -> hi and lo halves in the permuted order.
  const int octets = kp / 8;
  for (int f = threadIdx.x; f < m * octets; f += blockDim.x) {
    const int t = f / octets, o = f % octets;
    const float* xt = x + t * ld;
    const float pre = red[t * kMaxWarps];
    float v[8] = {};
    if (8 * o < k) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(xt + 8 * o));
      const float4 b = __ldg(reinterpret_cast<const float4*>(xt + 8 * o) + 1);
      v[0] = a.x * pre, v[1] = a.y * pre, v[2] = a.z * pre, v[3] = a.w * pre;
      v[4] = b.x * pre, v[5] = b.y * pre, v[6] = b.z * pre, v[7] = b.w * pre;
    }
    uint4 h, l;
    split_octet(v, h, l);
    reinterpret_cast<uint4*>(smem + static_cast<size_t>(1 + 2 * t) * kp)[o] = h;
    reinterpret_cast<uint4*>(smem + static_cast<size_t>(2 + 2 * t) * kp)[o] = l;
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

// One group's data for a lane: codes of rows A and B, and the 4 scale codes it applies.
template <WKind K>
struct GroupData {
  typename Fp4Fmt<K>::Codes a, b;
  uint32_t sa, sb;  // rows A and B: scale codes of the lane's blocks bb (bits 0..7) and bb + 1 (8..15)
};

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
      mma_f16_16816(c[t], a, b.x, b.y);
    }
  }
  const float fa0 = F::factor(d.sa & 0xffu), fa1 = F::factor(d.sa >> 8), fb0 = F::factor(d.sb & 0xffu),
              fb1 = F::factor(d.sb >> 8);
#pragma unroll
  for (int t = 0; t < M; ++t) {
    acc[t][0] = fmaf(c[t][0], fa0, fmaf(c[t][1], fa1, acc[t][0]));
    acc[t][1] = fmaf(c[t][2], fb0, fmaf(c[t][3], fb1, acc[t][1]));
  }
}

// A lane's next groups in flight: codes and scales in a register ring S groups deep. start(...) issues
// the first S groups of [g0, g1) and needs only the weights, not the activations, so kernels call it
// before waiting for the previous kernel and staging x (the weight latency overlaps both); run(...)
// consumes group g from stage (g - g0) % S and refills that stage with group g + S. (Measured slower and
// dropped, bench/NOTES.md: a cp.async ring in shared memory 4-6 groups deep, ~30 more instructions per
// group and no occupancy gained; an L2 prefetch S groups beyond the ring.)
// A group's loads into registers. Whole groups (all but maybe the last) load unpredicated at immediate
// offsets from the running pointers; in a partial last group, blocks past k read as zero codes and scales.
// A lane's two scale bytes per row are adjacent: one 16-bit load when every lane's are 2-byte aligned
// (`pairs`, warp-uniform: k / bs even and aligned scale tensors, i.e. every shape in use), which halves
// the scale loads; each scale load touches 8 or 16 rows' sectors, so they cost L1 wavefronts like
// the code loads that carry 16 times the bytes.
template <WKind K>
__device__ __forceinline__ void load_group(const LaneRows& r, int rel, int grp, int n_blocks, bool pairs,
                                           GroupData<K>& d) {
  using F = Fp4Fmt<K>;
  using C = typename F::Codes;
  const int64_t co = static_cast<int64_t>(rel) * 2 * F::kBs, so = static_cast<int64_t>(rel) * 4;
  const bool whole = 4 * grp + 4 <= n_blocks;
  const int t = threadIdx.x & 3, bb = 2 * (t & 1), sb = 4 * grp + bb;
  if (whole) {
    d.a = __ldg(reinterpret_cast<const C*>(r.codes[0] + co));
    d.b = __ldg(reinterpret_cast<const C*>(r.codes[1] + co));
    if (pairs) {
      d.sa = __ldg(reinterpret_cast<const uint16_t*>(r.scales[0] + so));
      d.sb = __ldg(reinterpret_cast<const uint16_t*>(r.scales[1] + so));
    } else {
      d.sa = __ldg(r.scales[0] + so) | (static_cast<uint32_t>(__ldg(r.scales[0] + so + 1)) << 8);
      d.sb = __ldg(r.scales[1] + so) | (static_cast<uint32_t>(__ldg(r.scales[1] + so + 1)) << 8);
    }
    return;
  }
  d.a = d.b = C{};
  if (4 * grp + t < n_blocks) {
    d.a = __ldg(reinterpret_cast<const C*>(r.codes[0] + co));
    d.b = __ldg(reinterpret_cast<const C*>(r.codes[1] + co));
  }
  d.sa = (sb < n_blocks ? __ldg(r.scales[0] + so) : 0u) |
         (sb + 1 < n_blocks ? static_cast<uint32_t>(__ldg(r.scales[0] + so + 1)) << 8 : 0u);
  d.sb = (sb < n_blocks ? __ldg(r.scales[1] + so) : 0u) |
         (sb + 1 < n_blocks ? static_cast<uint32_t>(__ldg(r.scales[1] + so + 1)) << 8 : 0u);
}

template <WKind K, int S, int kBatch = 1>
struct RegPipe {
  LaneRows r;
  GroupData<K> buf[S];
  int g0, g1, n_blocks;
  bool pairs;

  __device__ __forceinline__ void start(LaneRows rows, int first, int end, int nb) {
    advance(rows, first, Fp4Fmt<K>::kBs);
    r = rows, g0 = first, g1 = end, n_blocks = nb;
    const bool even = ((reinterpret_cast<uintptr_t>(r.scales[0]) | reinterpret_cast<uintptr_t>(r.scales[1])) & 1) == 0;
    pairs = __all_sync(0xffffffffu, even);
#pragma unroll
    for (int i = 0; i < S; ++i)
      if (g0 + i < g1) load_group<K>(r, i, g0 + i, n_blocks, pairs, buf[i]);
  }
  // Refills go out in batches of kBatch adjacent groups: a row's next kBatch * 64 bytes (MXFP4) leave
  // together instead of 64 at a time.
  template <int M>
  __device__ __forceinline__ void run(const uint32_t (&bptr)[M], float (&acc)[M][2]) {
    constexpr int B = kBatch;
    static_assert(S % B == 0);
    for (int g = g0; g < g1; g += S) {
#pragma unroll
      for (int i = 0; i < S; ++i) {
        if (g + i >= g1) break;
        compute_group<K, M>(buf[i], bptr, g + i, acc);
        if (i % B == B - 1) {
#pragma unroll
          for (int j = i - B + 1; j <= i; ++j) {
            if (g + j + S < g1) load_group<K>(r, j + S, g + j + S, n_blocks, pairs, buf[j]);
          }
        }
      }
      if (g + S > g1) break;  // (the batch of a partial last round needs no refill)
      advance(r, S, Fp4Fmt<K>::kBs);
    }
  }
};

// Per-lane B pointers: lane (g, t) feeds MMA column g, non-zero only for g == t (hi) and g == t + 4 (lo).
// Tokens first_token .. first_token + M - 1 of the staged ones.
template <WKind K, int M>
__device__ __forceinline__ void b_pointers(const uint16_t* smem, int kp, int first_token, uint32_t (&bptr)[M]) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int region_of_token = g == t ? 1 : g == t + 4 ? 2 : 0;  // 1 + 2 tok: hi, 2 + 2 tok: lo, 0: zeros
#pragma unroll
  for (int tok = 0; tok < M; ++tok) {
    const int region = region_of_token == 0 ? 0 : region_of_token + 2 * (first_token + tok);
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
template <WKind K, int M, class Pipe>
__global__ void __launch_bounds__(kWarps * 32, M <= 2 ? 3 : 2)
    fp4_linear_kernel(const __grid_constant__ DevWeight w, const float* __restrict__ x, int m,
                      const float* __restrict__ bias, float* __restrict__ y, int ksplit) {
  using F = Fp4Fmt<K>;
  extern __shared__ uint4 smem_x[];
  __shared__ float red[kWarps][M][16];
  __shared__ float scratch[kMaxWarps * kMaxTokens];
  __shared__ float unscale[M];
  uint16_t* sx = reinterpret_cast<uint16_t*>(smem_x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n = w.n, n_blocks = w.k / F::kBs, n_groups = (n_blocks + 3) / 4;
  const int tpb = kWarps / ksplit, part = warp % ksplit;
  const int gpp = (n_groups + ksplit - 1) / ksplit, g0 = min(n_groups, part * gpp), g1 = min(n_groups, g0 + gpp);
  const int n_tiles = (n + 15) / 16, n_sets = (n_tiles + tpb - 1) / tpb;
  Pipe pipe;
  // The first tile's weights start streaming before the activations exist (they do not come from the
  // previous kernel), then x is staged.
  auto start_tile = [&](int set, int& ra, int& rb) -> bool {
    const int tile = set * tpb + warp / ksplit;
    ra = min(tile * 16 + g, n - 1), rb = min(tile * 16 + g + 8, n - 1);
    if (tile >= n_tiles) return false;
    int pa = ra, pb = rb;
    const DevPart& da = find_part(w, pa);
    const DevPart& db = find_part(w, pb);
    pipe.start(lane_rows<K>(da, pa, db, pb, w.k), g0, g1, n_blocks);
    return true;
  };
  int ra = 0, rb = 0;
  bool live = blockIdx.x < n_sets && start_tile(blockIdx.x, ra, rb);
  pdl_wait();  // x comes from the previous kernel on the stream (see launch_pdl)
  stage_x(x, w.k, m, w.k, F::kBs, sx, scratch, unscale);
  uint32_t bptr[M];
  b_pointers<K, M>(sx, padded_k(w.k, F::kBs), 0, bptr);
  for (int set = blockIdx.x; set < n_sets; set += gridDim.x) {  // uniform over the block: it synchronizes
    if (set != blockIdx.x) live = start_tile(set, ra, rb);
    const int tile = set * tpb + warp / ksplit;
    float acc[M][2] = {};
    if (live) pipe.template run<M>(bptr, acc);
    int pa = ra, pb = rb;
    const float fa = global_factor(find_part(w, pa), K), fb = global_factor(find_part(w, pb), K);
#pragma unroll
    for (int tok = 0; tok < M; ++tok) {
      sum_lanes(acc[tok]);
      acc[tok][0] *= fa, acc[tok][1] *= fb;
    }
    const int row = tile * 16 + g;
    if (ksplit == 1) {  // lane t == 0 of each row group writes its rows g and g + 8
      if (t == 0 && live) {
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

// All threads: a DevWeight from global memory into shared memory, then a barrier.
__device__ __forceinline__ void copy_weight(const DevWeight* src, DevWeight* dst) {
  static_assert(sizeof(DevWeight) % 4 == 0);
  constexpr int kWords = sizeof(DevWeight) / 4;
  if (threadIdx.x < kWords)
    reinterpret_cast<uint32_t*>(dst)[threadIdx.x] = __ldg(reinterpret_cast<const uint32_t*>(src) + threadIdx.x);
  __syncthreads();
}

// ---- MoE fc1 + GLU --------------------------------------------------------------------------------------
// Grid (blocks over tile sets, pairs). A tile is 8 outputs j: lane (g, t)'s row A is gate(j0 + g) and its
// row B is up(j0 + g) in either layout, so the GLU happens in the lane that holds both sums.
template <WKind K, class Pipe>
__global__ void __launch_bounds__(kWarps * 32, 3)
    fp4_moe_fc1_kernel(ExpertTable tab, const int32_t* __restrict__ ids, int n_pairs, int top_k,
                       const float* __restrict__ x, Glu glu, float limit, float* __restrict__ act, int ksplit) {
  using F = Fp4Fmt<K>;
  extern __shared__ uint4 smem_x[];
  __shared__ float red[kWarps][16];
  __shared__ float scratch[kMaxWarps * kMaxTokens];
  __shared__ float unscale[1];
  uint16_t* sx = reinterpret_cast<uint16_t*>(smem_x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int d = tab.d_expert, k = tab.d_model, n_blocks = k / F::kBs, n_groups = (n_blocks + 3) / 4;
  const bool interleaved = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  const int tpb = kWarps / ksplit, part = warp % ksplit;
  const int gpp = (n_groups + ksplit - 1) / ksplit, g0 = min(n_groups, part * gpp), g1 = min(n_groups, g0 + gpp);
  const int n_tiles = (d + 7) / 8, n_sets = (n_tiles + tpb - 1) / tpb;
  __shared__ DevWeight sw;  // the pair's expert, copied once: its part table is read per tile
  uint32_t bptr[1];
  b_pointers<K, 1>(sx, padded_k(k, F::kBs), 0, bptr);
  pdl_wait_then_launch();  // x and ids come from the previous kernels on the stream (see launch_pdl)
  for (int p = blockIdx.y; p < n_pairs; p += gridDim.y) {
    const int e = ids[p];
    __syncthreads();  // the previous pair's readers of sw and of the staged x are done
    copy_weight(tab.fc1 + e, &sw);
    const DevWeight& w = sw;
    Pipe pipe;
    int ga = 0, gb = 0;  // this lane's gate and up rows of the current tile
    float bias_g = 0.0f, bias_u = 0.0f;
    auto start_tile = [&](int set) -> bool {
      const int tile = set * tpb + warp / ksplit, j = min(tile * 8 + g, d - 1);
      ga = interleaved ? 2 * j : j, gb = interleaved ? 2 * j + 1 : d + j;
      if (tile >= n_tiles) return false;
      int ra = ga, rb = gb;
      const DevPart& pa = find_part(w, ra);
      const DevPart& pb = find_part(w, rb);
      pipe.start(lane_rows<K>(pa, ra, pb, rb, k), g0, g1, n_blocks);
      if (tab.fc1_bias && part == 0 && t == 0) {  // needed at the end; loaded now, off the critical path
        bias_g = __ldg(tab.fc1_bias + static_cast<int64_t>(e) * 2 * d + ga);
        bias_u = __ldg(tab.fc1_bias + static_cast<int64_t>(e) * 2 * d + gb);
      }
      return true;
    };
    bool live = blockIdx.x < n_sets && start_tile(blockIdx.x);
    stage_x(x + static_cast<int64_t>(p / top_k) * k, k, 1, k, F::kBs, sx, scratch, unscale);
    for (int set = blockIdx.x; set < n_sets; set += gridDim.x) {
      if (set != blockIdx.x) live = start_tile(set);
      const int tile = set * tpb + warp / ksplit, j = tile * 8 + g;
      float acc[1][2] = {};
      if (live) pipe.template run<1>(bptr, acc);
      sum_lanes(acc[0]);
      int ra = ga, rb = gb;
      float gate = acc[0][0] * global_factor(find_part(w, ra), K), up = acc[0][1] * global_factor(find_part(w, rb), K);
      if (ksplit > 1) {
        if (t == 0) red[warp][g] = gate, red[warp][g + 8] = up;
        __syncthreads();
        if (part == 0 && t == 0) {
          for (int q = 1; q < ksplit; ++q) gate += red[warp + q][g], up += red[warp + q][g + 8];
        }
        __syncthreads();
      }
      if (part == 0 && t == 0 && tile < n_tiles && j < d) {
        gate = gate * unscale[0] + bias_g, up = up * unscale[0] + bias_u;
        const bool gpt_oss = glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves;
        act[static_cast<int64_t>(p) * d + j] = glu_value(gate, up, gpt_oss, limit);
      }
    }
  }
}

// ---- MoE fc2 + weighted combine -------------------------------------------------------------------------
// Grid (blocks over tiles of 16 output rows, tokens). A block of kFc2Warps warps = per_round choices x
// ksplit parts of k; the block stages the round's activation rows once and loops over its tiles. top_k
// choices take ceil(top_k / per_round) rounds (one for gpt-oss and qwen3); a round adds to y in a fixed
// order, so the sum is deterministic.
template <WKind K, class Pipe>
__global__ void __launch_bounds__(kFc2Warps * 32, 2)
    fp4_moe_fc2_kernel(ExpertTable tab, const int32_t* __restrict__ ids, const float* __restrict__ weights,
                       int n_tokens, int top_k, const float* __restrict__ act, float* __restrict__ y, int ksplit,
                       int per_round) {
  using F = Fp4Fmt<K>;
  extern __shared__ uint4 smem_x[];
  __shared__ float red[kFc2Warps][16];
  __shared__ float scratch[kMaxWarps * kMaxTokens];
  __shared__ float unscale[kMaxTokens];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n = tab.d_model, k = tab.d_expert, n_blocks = k / F::kBs, n_groups = (n_blocks + 3) / 4;
  const int c = warp / ksplit, part = warp % ksplit;  // this warp's choice within the round, its k part
  const int gpp = (n_groups + ksplit - 1) / ksplit, g0 = min(n_groups, part * gpp), g1 = min(n_groups, g0 + gpp);
  const int n_tiles = (n + 15) / 16, kp = padded_k(k, F::kBs);
  __shared__ DevWeight sw[kMaxTokens];  // the round's experts, copied once: their part tables are read per tile
  uint16_t* sx = reinterpret_cast<uint16_t*>(smem_x);
  uint32_t bptr[1];
  b_pointers<K, 1>(sx, kp, c, bptr);
  pdl_wait();  // act, ids and weights come from the previous kernels on the stream
  for (int tok = blockIdx.y; tok < n_tokens; tok += gridDim.y) {
    for (int r0 = 0; r0 < top_k; r0 += per_round) {
      const int in_round = min(per_round, top_k - r0);
      __syncthreads();  // the previous round's readers of sw and of the staged x are done
      for (int i = 0; i < in_round; ++i) copy_weight(tab.fc2 + ids[tok * top_k + r0 + i], &sw[i]);
      const DevWeight* w = c < in_round ? &sw[c] : nullptr;
      Pipe pipe;
      auto start_tile = [&](int tile) -> bool {
        if (!w || tile >= n_tiles) return false;
        int ra = min(tile * 16 + g, n - 1), rb = min(tile * 16 + g + 8, n - 1);
        const DevPart& pa = find_part(*w, ra);
        const DevPart& pb = find_part(*w, rb);
        pipe.start(lane_rows<K>(pa, ra, pb, rb, k), g0, g1, n_blocks);
        return true;
      };
      bool live = start_tile(blockIdx.x);
      stage_x(act + (static_cast<int64_t>(tok) * top_k + r0) * k, k, in_round, k, F::kBs, sx, scratch, unscale);
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        if (tile != blockIdx.x) live = start_tile(tile);
        float v[2] = {};
        if (live) {
          float acc[1][2] = {};
          pipe.template run<1>(bptr, acc);
          sum_lanes(acc[0]);
          int ra = min(tile * 16 + g, n - 1), rb = min(tile * 16 + g + 8, n - 1);
          v[0] = acc[0][0] * global_factor(find_part(*w, ra), K), v[1] = acc[0][1] * global_factor(find_part(*w, rb), K);
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

// Register ring depths: what the kernels' register budgets (80 per thread: 3 blocks of 8 warps per SM;
// fc2: 64) hold without spilling in the main loop.
template <WKind K, int M = 1>
struct Pipes {
  // More tokens: their accumulators take the registers. One token: refills in pairs (measured +4 / +8
  // points on the MXFP4 / NVFP4 lm_head against single refills, bench/NOTES.md).
  using Linear = RegPipe<K, M == 1 ? 4 : M == 2 ? 3 : 2, M == 1 ? 2 : 1>;
  using Fc1 = RegPipe<K, 3>;  // the GLU epilogue's registers
  using Fc2 = RegPipe<K, 2>;
};

template <WKind K, int M, class Pipe>
bool linear_for(const DevWeight& w, const float* x, int m, const float* bias, float* y, cudaStream_t s) {
  using F = Fp4Fmt<K>;
  auto kernel = fp4_linear_kernel<K, M, Pipe>;
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

template <WKind K, int M>
bool linear_pipe(const DevWeight& w, const float* x, int m, const float* bias, float* y, cudaStream_t s) {
  return linear_for<K, M, typename Pipes<K, M>::Linear>(w, x, m, bias, y, s);
}

template <WKind K>
bool linear_kind(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, cudaStream_t s) {
  const int mm = static_cast<int>(m);
  if (m == 1) return linear_pipe<K, 1>(w, x, mm, bias, y, s);
  if (m == 2) return linear_pipe<K, 2>(w, x, mm, bias, y, s);
  if (m <= 4) return linear_pipe<K, 4>(w, x, mm, bias, y, s);
  return linear_pipe<K, 8>(w, x, mm, bias, y, s);
}

// NIBBLE_FP4_MMA=0 turns these kernels off (the CUDA-core kernels of gemv.cu run instead): a measurement
// knob for the benchmarks.
bool enabled() {
  static const bool on = knob_on("NIBBLE_FP4_MMA");
  return on;
}

bool fp4_ok(WKind kind) { return enabled() && (kind == WKind::kMXFP4 || kind == WKind::kNVFP4); }

template <WKind K, class Pipe>
bool moe_fc1_for(const ExpertTable& t, const int32_t* ids, int n_pairs, int top_k, const float* x, Glu glu,
                 float limit, float* act, cudaStream_t s) {
  using F = Fp4Fmt<K>;
  auto kernel = fp4_moe_fc1_kernel<K, Pipe>;
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

template <WKind K, class Pipe>
bool moe_fc2_for(const ExpertTable& t, const int32_t* ids, const float* weights, int n_tokens, int top_k,
                 const float* act, float* y, cudaStream_t s) {
  using F = Fp4Fmt<K>;
  auto kernel = fp4_moe_fc2_kernel<K, Pipe>;
  // Choices per round: all top_k when they fit the warps and shared memory, else fewer.
  int per_round = std::min({top_k, kFc2Warps, kMaxTokens});
  auto bytes = [&](int pr) { return stage_bytes(pr, t.d_expert, F::kBs); };
  while (per_round > 1 && bytes(per_round) + 4096 > static_cast<size_t>(limits().smem_optin)) per_round /= 2;
  const size_t smem = bytes(per_round);
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

template <WKind K>
bool moe_fc1_kind(const ExpertTable& t, const int32_t* ids, int n_pairs, int top_k, const float* x, Glu glu,
                  float limit, float* act, cudaStream_t s) {
  return moe_fc1_for<K, typename Pipes<K>::Fc1>(t, ids, n_pairs, top_k, x, glu, limit, act, s);
}
template <WKind K>
bool moe_fc2_kind(const ExpertTable& t, const int32_t* ids, const float* weights, int n_tokens, int top_k,
                  const float* act, float* y, cudaStream_t s) {
  return moe_fc2_for<K, typename Pipes<K>::Fc2>(t, ids, weights, n_tokens, top_k, act, y, s);
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
  // The row loads need every expert 16-byte aligned (ExpertTable::vec_ok); otherwise the CUDA-core kernels.
  if (!fp4_ok(t.kind) || !t.vec_ok || t.d_model % 16 != 0 || n_pairs < 1) return false;
  const int np = static_cast<int>(std::min<int64_t>(n_pairs, 1 << 30));
  return t.kind == WKind::kMXFP4 ? moe_fc1_kind<WKind::kMXFP4>(t, ids, np, top_k, x, glu, limit, act, s)
                                 : moe_fc1_kind<WKind::kNVFP4>(t, ids, np, top_k, x, glu, limit, act, s);
}

bool launch_moe_fc2_fp4(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                        const float* act, float* y, cudaStream_t s) {
  if (!fp4_ok(t.kind) || !t.vec_ok || t.d_expert % 16 != 0 || n_tokens < 1 || top_k > 64) return false;
  const int nt = static_cast<int>(std::min<int64_t>(n_tokens, 1 << 30));
  return t.kind == WKind::kMXFP4 ? moe_fc2_kind<WKind::kMXFP4>(t, ids, weights, nt, top_k, act, y, s)
                                 : moe_fc2_kind<WKind::kNVFP4>(t, ids, weights, nt, top_k, act, y, s);
}

}  // namespace nb::cuda
