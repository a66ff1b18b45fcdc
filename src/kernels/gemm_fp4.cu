// Dense FP4 GEMM (see gemm_fp4.cuh; the tiles in gemm_fp4_tile.cuh, gemm_fp4_wgmma.cuh, gemm_fp4_wsr.cuh,
// gemm_fp4_wsr8.cuh, gemm_fp4_ws.cuh, gemm_fp4_wsp.cuh) and the fp32 -> fp16 (or E4M3) activation conversion that
// every tensor-core GEMM here reads. Grid: x over 128-column weight tiles, y over BM-row token tiles (the
// warp-specialized tiles: one persistent block per SM). The heuristics: the tile height (pick_bm, pick_ws_bm) and
// where a warp-specialized tile runs (gemm_tiled_tile).
#include "kernels/gemm_fp4.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "kernels/gemm_fp4_tile.cuh"
#include "kernels/gemm_fp4_wgmma.cuh"
#include "kernels/gemm_fp4_ws.cuh"
#include "kernels/gemm_fp4_wsp.cuh"
#include "kernels/gemm_fp4_wsr.cuh"
#include "kernels/gemm_fp4_wsr8.cuh"

namespace nb::cuda {
namespace {

using gemm::kBN;
using gemm::kThreads;

__device__ __forceinline__ float octet_absmax(const float4& a, const float4& b) {
  return fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
               fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
}
// The row's power-of-two prescale from each lane's max |x| (fp16_prescale_shift); lane 0 stores its inverse.
__device__ __forceinline__ float row_prescale(float lane_max, int lane, float* unscale) {
  const int sh = fp16_prescale_shift(warp_max(lane_max));
  if (lane == 0) *unscale = ldexpf(1.0f, -sh);
  return ldexpf(1.0f, sh);
}

// One warp per output row: max |x| over the row, then the row scaled by 2^s and split into fp16 hi (+ lo),
// in the consuming tile's k order (GemmActivations).
constexpr int kPrepWarps = 8;
__global__ void __launch_bounds__(kPrepWarps * 32) activations_kernel(const float* __restrict__ x,
                                                                      const int32_t* __restrict__ gather,
                                                                      int gather_div, int rows, int k, bool split,
                                                                      bool wgmma_order, int64_t tiled_mp,
                                                                      __half* __restrict__ hi,
                                                                      __half* __restrict__ lo,
                                                                      float* __restrict__ unscale) {
  const int r = blockIdx.x * kPrepWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= rows || (gather && gather[r] < 0)) return;  // (gather -1: a MoE pad slot, moe_gemm.cu)
  const float* row = x + static_cast<int64_t>(gather ? gather[r] / gather_div : r) * k;
  const float4* src = reinterpret_cast<const float4*>(row);
  const int groups = k / 8;
  float mx = 0.0f;
  for (int q = lane; q < groups; q += 32) {
    const float4 a = __ldg(src + 2 * q), b = __ldg(src + 2 * q + 1);
    mx = fmaxf(mx, octet_absmax(a, b));
  }
  const float pre = row_prescale(mx, lane, unscale + r);
  if (tiled_mp > 0 && !wgmma_order) {
    // One 16-byte chunk (8 elements, order 0 4 1 5 2 6 3 7) per lane and step, at its core-matrix place;
    // the k pad up to whole k-tiles as zeros.
    uint4* dst = reinterpret_cast<uint4*>(hi);
    for (int q = lane; q < wg::padded_k(k) / 8; q += 32) {
      float v[8] = {};
      if (8 * q < k) {
        const float4 a = __ldg(src + 2 * q), b = __ldg(src + 2 * q + 1);
        const float u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        for (int i = 0; i < 8; ++i) v[i] = u[i] * pre;
      }
      uint4 h, l;
      split_octet(v, h, l);
      dst[ws::chunk_of(r, q / 8, q % 8, tiled_mp)] = h;
    }
    return;
  }
  if (wgmma_order) {
    // Lane l writes stored positions 2l, 2l + 1 of each k-tile (one 32-bit store), which hold physical
    // elements j and j + 4; the pad past k as zeros. Tiled (GemmActivations::rs): at word l % 4 of the
    // k-tile's core-matrix chunk l / 4.
    const int kp = wg::padded_k(k), j = wg::stored_of(2 * lane);
    uint32_t* dh = reinterpret_cast<uint32_t*>(hi + static_cast<int64_t>(r) * kp);
    uint32_t* dl = reinterpret_cast<uint32_t*>(lo + static_cast<int64_t>(r) * kp);
    for (int k0 = 0; k0 < kp; k0 += wg::kBK) {
      const float v0 = k0 + j < k ? __ldg(row + k0 + j) * pre : 0.0f;
      const float v1 = k0 + j + 4 < k ? __ldg(row + k0 + j + 4) * pre : 0.0f;
      const __half h0 = __float2half_rn(v0), h1 = __float2half_rn(v1);
      if (tiled_mp > 0) {
        reinterpret_cast<uint32_t*>(hi)[ws::chunk_of(r, k0 / wg::kBK, lane >> 2, tiled_mp) * 4 + (lane & 3)] = pack_half2(h0, h1);
        continue;
      }
      dh[(k0 >> 1) + lane] = pack_half2(h0, h1);
      if (split) dl[(k0 >> 1) + lane] = pack_half2(__float2half_rn(v0 - __half2float(h0)), __float2half_rn(v1 - __half2float(h1)));
    }
    return;
  }
  uint4* dh = reinterpret_cast<uint4*>(hi + static_cast<int64_t>(r) * k);
  uint4* dl = reinterpret_cast<uint4*>(lo + static_cast<int64_t>(r) * k);
  for (int q = lane; q < groups; q += 32) {
    const float4 a = __ldg(src + 2 * q), b = __ldg(src + 2 * q + 1);
    const float v[8] = {a.x * pre, a.y * pre, a.z * pre, a.w * pre, b.x * pre, b.y * pre, b.z * pre, b.w * pre};
    uint4 h, l;
    split_octet(v, h, l);  // pair i holds elements i and i + 4: the order the weight decode yields
    dh[q] = h;
    if (split) dl[q] = l;
  }
}

// The warp-specialized tile's activations (GemmActivations::tiled, one fp16 each) or the portable tile's
// (row-major, hi and with `split` lo), one warp per row as above but in one read: the lane's G octets of the
// row stay in registers between the max and the stores (the kernel above reads the row twice, the second
// time from L2). gather: the MoE FC1's pair -> token rows. k <= 256 G.
template <int G, bool kTiled>
__global__ void __launch_bounds__(kPrepWarps * 32) octet_activations_kernel(const float* __restrict__ x,
                                                                            const int32_t* __restrict__ gather,
                                                                            int gather_div, int rows, int k, bool split,
                                                                            int64_t tiled_mp, __half* __restrict__ hi,
                                                                            __half* __restrict__ lo,
                                                                            float* __restrict__ unscale) {
  const int r = blockIdx.x * kPrepWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= rows || (gather && gather[r] < 0)) return;  // (gather -1: a MoE pad slot, moe_gemm.cu)
  const float4* src = reinterpret_cast<const float4*>(x + static_cast<int64_t>(gather ? gather[r] / gather_div : r) * k);
  const int groups = k / 8;
  float4 v[G][2];
  float mx = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int q = lane + 32 * g;
    v[g][0] = v[g][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (q < groups) v[g][0] = __ldg(src + 2 * q), v[g][1] = __ldg(src + 2 * q + 1);
    mx = fmaxf(mx, octet_absmax(v[g][0], v[g][1]));
  }
  const float pre = row_prescale(mx, lane, unscale + r);
  // Tiled: octets up to whole k-tiles (past k zeros), at their core-matrix places; else the row's octets.
  const int n_out = kTiled ? wg::padded_k(k) / 8 : groups;
  uint4* dh = reinterpret_cast<uint4*>(hi) + (kTiled ? 0 : static_cast<int64_t>(r) * groups);
  uint4* dl = reinterpret_cast<uint4*>(lo) + static_cast<int64_t>(r) * groups;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int q = lane + 32 * g;
    if (q >= n_out) break;
    const float4 a = v[g][0], b = v[g][1];
    const float u[8] = {a.x * pre, a.y * pre, a.z * pre, a.w * pre, b.x * pre, b.y * pre, b.z * pre, b.w * pre};
    uint4 h, l;
    split_octet(u, h, l);  // pair i holds elements i and i + 4: the order the weight decode yields
    if (kTiled) {
      dh[ws::chunk_of(r, q / 8, q % 8, tiled_mp)] = h;
    } else {
      dh[q] = h;
      if (split) dl[q] = l;
    }
  }
}

// The wgmma tile's activations (GemmActivations::wgmma: the stored k order, hi and with `split` lo), in one
// read like octet_activations_kernel: lane l loads exactly the two elements of each k-tile it stores
// (stored positions 2 l, 2 l + 1: physical j and j + 4) and keeps them in registers between the max and the
// stores. gather: the MoE FC1's pair -> token rows. k <= 64 NT.
template <int NT>
__global__ void __launch_bounds__(kPrepWarps * 32) wgmma_activations_kernel(const float* __restrict__ x,
                                                                            const int32_t* __restrict__ gather,
                                                                            int gather_div, int rows, int k, bool split,
                                                                            int64_t tiled_mp, __half* __restrict__ hi,
                                                                            __half* __restrict__ lo, float* __restrict__ unscale) {
  const int r = blockIdx.x * kPrepWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= rows || (gather && gather[r] < 0)) return;  // (gather -1: a MoE pad slot, moe_gemm.cu)
  const float* row = x + static_cast<int64_t>(gather ? gather[r] / gather_div : r) * k;
  const int kp = wg::padded_k(k), j = wg::stored_of(2 * lane);
  float v[NT][2];
  float mx = 0.0f;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int k0 = t * wg::kBK;
    v[t][0] = k0 + j < k ? __ldg(row + k0 + j) : 0.0f;
    v[t][1] = k0 + j + 4 < k ? __ldg(row + k0 + j + 4) : 0.0f;
    mx = fmaxf(mx, fmaxf(fabsf(v[t][0]), fabsf(v[t][1])));
  }
  const float pre = row_prescale(mx, lane, unscale + r);
  uint32_t* dh = reinterpret_cast<uint32_t*>(hi + static_cast<int64_t>(r) * kp);
  uint32_t* dl = reinterpret_cast<uint32_t*>(lo + static_cast<int64_t>(r) * kp);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int k0 = t * wg::kBK;
    if (k0 >= kp) break;
    const float v0 = v[t][0] * pre, v1 = v[t][1] * pre;
    const __half h0 = __float2half_rn(v0), h1 = __float2half_rn(v1);
    if (tiled_mp > 0) {  // GemmActivations::rs: word l % 4 of the k-tile's core-matrix chunk l / 4
      reinterpret_cast<uint32_t*>(hi)[ws::chunk_of(r, t, lane >> 2, tiled_mp) * 4 + (lane & 3)] = pack_half2(h0, h1);
      continue;
    }
    dh[(k0 >> 1) + lane] = pack_half2(h0, h1);
    if (split) dl[(k0 >> 1) + lane] = pack_half2(__float2half_rn(v0 - __half2float(h0)), __float2half_rn(v1 - __half2float(h1)));
  }
}

// The FP8 tile's activations (GemmActivations::fp8): one warp per row; lane l writes word l of each 128-wide
// k-tile (stored bytes 4 l .. 4 l + 3: 4 consecutive physical elements, wsr8::phys8) at its core-matrix place,
// zeros past k. The row is scaled by 2^s with max |x| * 2^s in [2^7, 2^8) and rounded to E4M3 (satfinite).
// NT: k-tiles held in registers between the max and the stores (NT * 128 >= padded k), or 0: the row read twice.
template <int NT>
__global__ void __launch_bounds__(kPrepWarps * 32) fp8_activations_kernel(const float* __restrict__ x,
                                                                          const int32_t* __restrict__ gather,
                                                                          int gather_div, int rows, int k, int64_t mp,
                                                                          uint32_t* __restrict__ out,
                                                                          float* __restrict__ unscale) {
  const int r = blockIdx.x * kPrepWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= rows || (gather && gather[r] < 0)) return;  // (gather -1: a MoE pad slot, moe_gemm.cu)
  const float* row = x + static_cast<int64_t>(gather ? gather[r] / gather_div : r) * k;
  const int n_kt = wsr8::padded_k(k) / wsr8::kBK, p0 = wsr8::phys8(4 * lane);
  auto load = [&](int t) {
    const int j = t * wsr8::kBK + p0;  // (k % 32 == 0: a lane's 4 elements are all in k or all past it)
    return j < k ? __ldg(reinterpret_cast<const float4*>(row + j)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  };
  auto amax = [](float4 v) { return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))); };
  float4 v[NT > 0 ? NT : 1];
  float mx = 0.0f;
  if constexpr (NT > 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      v[t] = t < n_kt ? load(t) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      mx = fmaxf(mx, amax(v[t]));
    }
  } else {
    for (int t = 0; t < n_kt; ++t) mx = fmaxf(mx, amax(load(t)));
  }
  const int sh = pow2_prescale_shift(warp_max(mx), 8);
  if (lane == 0) unscale[r] = pow2f(-sh);
  const float pre = pow2f(sh);
  auto store = [&](int t, float4 a) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * pre, a.y * pre), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(a.z * pre, a.w * pre), __NV_SATFINITE, __NV_E4M3);
    out[ws::chunk_of(r, t, lane >> 2, mp) * 4 + (lane & 3)] = lo | (static_cast<uint32_t>(hi) << 16);
  };
  if constexpr (NT > 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n_kt) store(t, v[t]);
    }
  } else {
    for (int t = 0; t < n_kt; ++t) store(t, load(t));
  }
}

// The sm_90a tile (gemm_fp4_wgmma.cuh): block x over 128 weight rows, y over BM tokens, two warpgroups.
template <WKind K, int BM, bool kSplit>
__global__ void __launch_bounds__(wg::kThreads, wg::Tile<BM, kSplit>::kMinBlocks) gemm_fp4_wgmma_kernel(const __grid_constant__ DevWeight w,
                                                                         const __half* __restrict__ hi,
                                                                         const __half* __restrict__ lo,
                                                                         const float* __restrict__ unscale, int64_t lda,
                                                                         int m, const float* __restrict__ bias,
                                                                         float* __restrict__ y) {
  using T = wg::Tile<BM, kSplit>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ gemm::ColInfo ci;
  const int n0 = blockIdx.x * wg::kBN, m0 = blockIdx.y * BM, k = w.k, n = w.n, tid = threadIdx.x;
  const int a_rows = min(BM, m - m0);
  if (tid < wg::kBN) gemm::set_col(ci, tid, w, n0 + tid < n ? n0 + tid : -1);
  const int my_row = n0 + (tid >> 1);
  const gemm::BRow br = gemm::brow_of(w, my_row < n ? my_row : -1, k, K == WKind::kMXFP4 ? 32 : 16);
  float acc[T::kAcc] = {};
  wg::mainloop<K, T, kSplit>(smem, hi + m0 * lda, lo + m0 * lda, lda, a_rows, k, br, acc);
  wg::epilogue<T>(acc, ci, unscale + m0, a_rows, [&](int token, int ra, int rb, float va, float vb) {
    float* dst = y + static_cast<int64_t>(m0 + token) * n + n0;
    if (n0 + ra < n) dst[ra] = va + (bias ? bias[n0 + ra] : 0.0f);
    if (n0 + rb < n) dst[rb] = vb + (bias ? bias[n0 + rb] : 0.0f);
  });
}

// The warp-specialized sm_90a tile (gemm_fp4_ws.cuh), persistent: one block per SM walks tiles of 128 weight
// rows x 256 tokens; warpgroup 2 decodes the weights (R: its code ring's depth, ws::ring_for) and
// starts the activation copies, warpgroups 0 and 1 run the wgmmas and the epilogue. a_tiles: tiled fp16
// activations of mp rows (GemmActivations::tiled).
template <WKind K, int R>
__global__ void __launch_bounds__(ws::kThreads, 1) gemm_fp4_ws_kernel(const __grid_constant__ DevWeight w,
                                                                      const uint8_t* __restrict__ a_tiles,
                                                                      const float* __restrict__ unscale, int64_t mp,
                                                                      int m, const float* __restrict__ bias,
                                                                      float* __restrict__ y) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t bars[2 * ws::kStages];
  __shared__ float us[(ws::kStages + 1) * ws::kBM];
  const int tid = threadIdx.x;
  const ws::Pipe p{smem, bars, bars + ws::kStages, us};
  const int col_tiles = (w.n + ws::kBN - 1) / ws::kBN;
  const ws::Sched sc{col_tiles, col_tiles * ((m + ws::kBM - 1) / ws::kBM), (w.k + ws::kBK - 1) / ws::kBK};
  if (tid < ws::kStages) {
    ws::mbar_init(p.full + tid, 129);  // 128 decoder threads + decoder thread 0's byte count
    ws::mbar_init(p.empty + tid, 8);   // one per multiplier warp
  }
  ws::mbar_fence_init();
  __syncthreads();
  if (tid >= 256) return ws::decoder<K, R>(p, sc, w, a_tiles, mp, unscale, m);
  float acc[128];
  for (int it = 0, g = 0; it < sc.my_tiles(); ++it) {
    ws::multiply_tile(p, sc, g, acc);
    const int tile = sc.tile(it), m0 = sc.m0(tile);
    // (FAKE_EPI: stores only for an accumulator value no run produces, so the wgmmas are not optimized away.)
    if (!NIBBLE_WS_FAKE_EPI || acc[0] == 12345.0f) ws::epilogue<K>(acc, w, p.tile_unscale(it), bias, y, sc.n0(tile), m0, min(ws::kBM, m - m0));
  }
#else
  __trap();  // only the sm_90a build has this tile (gemm_tiled_tile says when it runs)
#endif
}

// The warp-specialized sm_90a tile with register A fragments (gemm_fp4_wsr.cuh), persistent like the one above:
// warpgroup 2 copies codes, scales and activations into the stages, warpgroups 0 and 1 decode their own A
// fragments, run the wgmmas and the epilogue. a_tiles: tiled fp16 activations of mp rows in the wgmma tile's
// k order (GemmActivations::rs). kTwoSets: a fragment set per k-tile parity (see the header); BM: tokens per
// tile (256 or 128).
template <WKind K, bool kTwoSets, int BM>
__global__ void __launch_bounds__(wsr::kThreads, 1) gemm_fp4_wsr_kernel(const __grid_constant__ DevWeight w,
                                                                        const uint8_t* __restrict__ a_tiles,
                                                                        const float* __restrict__ unscale, int64_t mp,
                                                                        int m, const float* __restrict__ bias,
                                                                        float* __restrict__ y) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int S = wsr::Geo<BM>::kStages, kBlk = K == WKind::kMXFP4 ? 32 : 16;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[2 * S];
  __shared__ float us[2][BM];  // the token scales of the current and the previous tile
  const int tid = threadIdx.x;
  const wsr::Pipe<BM> p{smem, bars, bars + S};
  const int col_tiles = (w.n + ws::kBN - 1) / ws::kBN;
  const wsr::Sched<BM> sc{{col_tiles, col_tiles * ((m + BM - 1) / BM), (w.k + ws::kBK - 1) / ws::kBK}};
  if (tid < S) {
    ws::mbar_init(p.full + tid, 129);  // 128 producer threads' copies + thread 0's byte count
    ws::mbar_init(p.empty + tid, 8);   // one per multiplier warp
  }
  ws::mbar_fence_init();
  __syncthreads();
  // The producer needs few registers, the multipliers' accumulators and fragments many.
  if (tid >= 256) {
    wsr::setmaxnreg_dec<40>();
    return wsr::producer<K, BM>(p, sc, w, a_tiles, mp);
  }
  wsr::setmaxnreg_inc<232>();
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int row_a = wgi * 64 + warp * 16 + (lane >> 2), row_b = row_a + 8;  // tile rows of the lane's fragments
  float acc[BM / 2];
  uint32_t f0[4][4], f1[4][4];
  for (int it = 0, g = 0; it < sc.my_tiles(); ++it) {
    const int tile = sc.tile(it), n0 = sc.n0(tile), m0 = sc.m0(tile);
    // (stored for the epilogue after the k loop)
    const float u = tid < BM && m0 + tid < m ? unscale[m0 + tid] : 0.0f;
    // The low address bits of each row's scale bytes (fetch_raw copies the aligned words around them).
    auto scale_off = [&](int r) {
      const gemm::BRow b = gemm::brow_of(w, n0 + r < w.n ? n0 + r : -1, w.k, kBlk);
      return b.codes ? static_cast<int>(reinterpret_cast<uintptr_t>(b.scales) & 3) : 0;
    };
    const int off_a = scale_off(row_a), off_b = scale_off(row_b);
    if constexpr (kTwoSets) {
      for (int kt = 0; kt < sc.n_kt; kt += 2) {
        wsr::k_step<K, BM>(p, g, kt, w.k, row_a, row_b, off_a, off_b, false, f0, acc);
        ws::wgmma_wait1();  // k-tile kt - 1's wgmmas are done: f1 and its stage are free
        if (kt > 0 && lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);
        ++g;
        // (A break, not a condition around the odd step: on a path that skipped it and looped back, f0 would be
        // rewritten while its wgmmas ran, and ptxas serializes every wgmma for that path, C7513.)
        if (kt + 1 >= sc.n_kt) break;
        wsr::k_step<K, BM>(p, g, kt + 1, w.k, row_a, row_b, off_a, off_b, false, f1, acc);
        ws::wgmma_wait1();
        if (lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);
        ++g;
      }
    } else {
      for (int kt = 0; kt < sc.n_kt; ++kt, ++g) wsr::k_step<K, BM>(p, g, kt, w.k, row_a, row_b, off_a, off_b, true, f0, acc);
    }
    wg::wgmma_wait0();
    if (lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);  // the tile's last stage
    if (tid < BM) us[it & 1][tid] = u;
    wsr::multipliers_sync();
    if (!NIBBLE_WS_FAKE_EPI || acc[0] == 12345.0f) ws::epilogue<K, BM>(acc, w, us[it & 1], bias, y, n0, m0, min(BM, m - m0));
  }
#else
  __trap();  // only the sm_90a build has this tile (gemm_tiled_tile says when it runs)
#endif
}

// The FP8 register-fragment tile (gemm_fp4_wsr8.cuh): gemm_fp4_wsr_kernel's schedule (one fragment set) with
// 128-wide k-tiles of E4M3 activations (GemmActivations::fp8) and weights decoded to E4M3.
template <WKind K, int BM>
__global__ void __launch_bounds__(wsr8::kThreads, 1) gemm_fp4_wsr8_kernel(const __grid_constant__ DevWeight w,
                                                                          const uint8_t* __restrict__ a_tiles,
                                                                          const float* __restrict__ unscale, int64_t mp,
                                                                          int m, const float* __restrict__ bias,
                                                                          float* __restrict__ y) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int S = wsr8::Geo<BM>::kStages, kBlk = K == WKind::kMXFP4 ? 32 : 16;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[2 * S];
  __shared__ float us[2][BM];  // the token scales of the current and the previous tile
  const int tid = threadIdx.x;
  const wsr8::Pipe<BM> p{smem, bars, bars + S};
  const int col_tiles = (w.n + ws::kBN - 1) / ws::kBN;
  const wsr::Sched<BM> sc{{col_tiles, col_tiles * ((m + BM - 1) / BM), (w.k + wsr8::kBK - 1) / wsr8::kBK}};
  if (tid < S) {
    ws::mbar_init(p.full + tid, 129);  // 128 producer threads' copies + thread 0's byte count
    ws::mbar_init(p.empty + tid, 8);   // one per multiplier warp
  }
  ws::mbar_fence_init();
  __syncthreads();
  if (tid >= 256) {
    wsr::setmaxnreg_dec<40>();
    return wsr8::producer<K, BM>(p, sc, w, a_tiles, mp);
  }
  wsr::setmaxnreg_inc<232>();
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  wsr8::LaneRows lr;
  lr.row_a = wgi * 64 + warp * 16 + (lane >> 2), lr.row_b = lr.row_a + 8;
  float acc[BM / 2];
  uint32_t frag[4][4];
  for (int it = 0, g = 0; it < sc.my_tiles(); ++it) {
    const int tile = sc.tile(it), n0 = sc.n0(tile), m0 = sc.m0(tile);
    const float u = tid < BM && m0 + tid < m ? unscale[m0 + tid] : 0.0f;  // (stored for the epilogue)
    const gemm::BRow ba = gemm::brow_of(w, n0 + lr.row_a < w.n ? n0 + lr.row_a : -1, w.k, kBlk);
    const gemm::BRow bb = gemm::brow_of(w, n0 + lr.row_b < w.n ? n0 + lr.row_b : -1, w.k, kBlk);
    lr.off_a = ba.codes ? static_cast<int>(reinterpret_cast<uintptr_t>(ba.scales) & 3) : 0;
    lr.off_b = bb.codes ? static_cast<int>(reinterpret_cast<uintptr_t>(bb.scales) & 3) : 0;
    lr.c_a = wsr8::row_fold<K>(ba.scales, w.k / kBlk, lane & 3);
    lr.c_b = wsr8::row_fold<K>(bb.scales, w.k / kBlk, lane & 3);
    for (int kt = 0; kt < sc.n_kt; ++kt, ++g) wsr8::k_step<K, BM>(p, g, kt, w.k, lr, frag, acc);
    wg::wgmma_wait0();
    if (lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);  // the tile's last stage
    if (tid < BM) us[it & 1][tid] = u;
    wsr::multipliers_sync();
    // The rows' folds undone (NVFP4: row_pair's 2^8 is decode_half's, not this tile's).
    const int extra = K == WKind::kNVFP4 ? 8 : 0;
    ws::epilogue<K, BM>(acc, w, us[it & 1], bias, y, n0, m0, min(BM, m - m0), ldexpf(1.0f, -lr.c_a - extra),
                        ldexpf(1.0f, -lr.c_b - extra));
  }
#else
  __trap();  // only the sm_90a build has this tile (gemm_fp8_supported says when it runs)
#endif
}

// The dense tiles: the 128-row one-fp16 NVFP4 tile reads the next k16 slice's fragments during the current
// slice's MMAs (kPrefetch: H100, M = 2048 3-7 % faster). MXFP4's does so only on sm_12x, whose one block per SM
// leaves it the registers: at two blocks per SM (128 registers) its vote branch for blocks above 2^1 spills, and
// a copy of the step per vote outcome measured no faster; at one block per SM it is 5-8 % faster (H100 with
// -DNIBBLE_TILE_ONEBLOCK, a measurement build that runs sm_12x's occupancy and choices; bench/NOTES.md,
// fourteenth session).
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200) || defined(NIBBLE_TILE_ONEBLOCK)
constexpr bool kMxfp4Prefetch = true;
#else
constexpr bool kMxfp4Prefetch = false;
#endif
template <WKind K, int BM, bool kSplit>
using DenseTile = gemm::Tile<BM, kSplit, (K == WKind::kNVFP4 || kMxfp4Prefetch) && BM == 128 && !kSplit>;

template <WKind K, int BM, bool kSplit>
__global__ void __launch_bounds__(kThreads, DenseTile<K, BM, kSplit>::kLaunchMinBlocks) gemm_fp4_kernel(const __grid_constant__ DevWeight w,
                                                              const __half* __restrict__ hi,
                                                              const __half* __restrict__ lo,
                                                              const float* __restrict__ unscale, int m,
                                                              const float* __restrict__ bias, float* __restrict__ y) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ gemm::ColInfo ci;
  const int n0 = blockIdx.x * kBN, m0 = blockIdx.y * BM, k = w.k, n = w.n, tid = threadIdx.x;
  const int a_rows = min(BM, m - m0);
  if (tid < kBN) gemm::set_col(ci, tid, w, n0 + tid < n ? n0 + tid : -1);
  const int my_row = n0 + (tid >> 1);
  const gemm::BRow br = gemm::brow_of(w, my_row < n ? my_row : -1, k, K == WKind::kMXFP4 ? 32 : 16);
  typename DenseTile<K, BM, kSplit>::Acc acc = {};
  const int64_t a_off = static_cast<int64_t>(m0) * k;
  gemm::mainloop<K, DenseTile<K, BM, kSplit>, BM == 64 || kSplit>(smem, hi + a_off, lo + a_off, a_rows, k, br, acc);
  gemm::epilogue<K, DenseTile<K, BM, kSplit>>(acc, ci, unscale + m0, a_rows, [&](int row, int col, float v0, float v1) {
    const int c = n0 + col;
    float* dst = y + static_cast<int64_t>(m0 + row) * n + c;
    if (c < n) dst[0] = v0 + (bias ? bias[c] : 0.0f);
    if (c + 1 < n) dst[1] = v1 + (bias ? bias[c + 1] : 0.0f);
  });
}

// Token-tile height: 128 rows when that still gives two blocks per SM, else 64 (more, smaller blocks).
int pick_bm(int64_t m, int n) {
  const int sms = gemm_sm_count();
  const int64_t blocks = static_cast<int64_t>(ceil_div(n, kBN)) * ceil_div(m, 128);
  return blocks >= 2 * sms ? 128 : 64;
}

// Opts `kernel` in to `smem` bytes of dynamic shared memory (the whole carveout, so that two blocks fit per
// SM where the device has room) and launches it over (128-row weight tiles, bm-token tiles).
template <class Kernel, class... Args>
void launch_tiles(Kernel kernel, int threads, int smem, int bm, const DevWeight& w, int64_t m, cudaStream_t s,
                  Args... args) {
#ifdef NIBBLE_TILE_ONEBLOCK
  smem = std::max(smem, 120 * 1024);  // measurement build: one block per SM, as GB10's shared memory holds
#endif
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  kernel<<<dim3(ceil_div(w.n, kBN), ceil_div(m, bm)), threads, smem, s>>>(w, args...);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K, int BM, bool kSplit>
void gemm_for(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, cudaStream_t s) {
  launch_tiles(gemm_fp4_kernel<K, BM, kSplit>, kThreads, DenseTile<K, BM, kSplit>::kSmem, BM, w, m, s, a.hi,
               kSplit ? a.lo : a.hi, a.unscale, static_cast<int>(m), bias, y);
}

template <WKind K, int BM, bool kSplit>
void gemm_wgmma_for(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, cudaStream_t s) {
  static_assert(wg::kBN == kBN);
  launch_tiles(gemm_fp4_wgmma_kernel<K, BM, kSplit>, wg::kThreads, wg::Tile<BM, kSplit>::kSmem, BM, w, m, s, a.hi,
               kSplit ? a.lo : a.hi, a.unscale, a.ld, static_cast<int>(m), bias, y);
}

template <WKind K, int R>
void gemm_ws_launch(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, cudaStream_t s) {
  auto kernel = gemm_fp4_ws_kernel<K, R>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ws::kSmem));
  const int sms = gemm_sm_count();
  const int64_t tiles = static_cast<int64_t>(ceil_div(w.n, ws::kBN)) * ceil_div(m, ws::kBM);
  kernel<<<static_cast<int>(std::min<int64_t>(tiles, sms)), ws::kThreads, ws::kSmem, s>>>(
      w, reinterpret_cast<const uint8_t*>(a.hi), a.unscale, a.mp, static_cast<int>(m), bias, y);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void gemm_ws_for(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, cudaStream_t s) {
  switch (ws::ring_for(ceil_div(w.k, ws::kBK))) {
    case 5: return gemm_ws_launch<K, 5>(w, a, m, bias, y, s);
    case 4: return gemm_ws_launch<K, 4>(w, a, m, bias, y, s);
    case 3: return gemm_ws_launch<K, 3>(w, a, m, bias, y, s);
    case 2: return gemm_ws_launch<K, 2>(w, a, m, bias, y, s);
    default: return gemm_ws_launch<K, 1>(w, a, m, bias, y, s);
  }
}

template <WKind K, bool kTwoSets, int BM>
void gemm_wsr_launch(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, cudaStream_t s) {
  auto kernel = gemm_fp4_wsr_kernel<K, kTwoSets, BM>;
  const int smem = wsr::Geo<BM>::kSmem;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int sms = gemm_sm_count();
  const int64_t tiles = static_cast<int64_t>(ceil_div(w.n, ws::kBN)) * ceil_div(m, BM);
  kernel<<<static_cast<int>(std::min<int64_t>(tiles, sms)), wsr::kThreads, smem, s>>>(
      w, reinterpret_cast<const uint8_t*>(a.hi), a.unscale, a.mp, static_cast<int>(m), bias, y);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K, int BM>
void gemm_wsr8_launch(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, cudaStream_t s) {
  auto kernel = gemm_fp4_wsr8_kernel<K, BM>;
  const int smem = wsr8::Geo<BM>::kSmem;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int sms = gemm_sm_count();
  const int64_t tiles = static_cast<int64_t>(ceil_div(w.n, ws::kBN)) * ceil_div(m, BM);
  kernel<<<static_cast<int>(std::min<int64_t>(tiles, sms)), wsr8::kThreads, smem, s>>>(
      w, reinterpret_cast<const uint8_t*>(a.hi), a.unscale, a.mp, static_cast<int>(m), bias, y);
  CUDA_CHECK(cudaGetLastError());
}

// Tokens per tile of the register-fragment sm_90a tile: 128 where that takes no more rounds of the persistent grid
// than 256-token tiles do (a small M whose 256-token grid leaves most SMs idle), else 256. A 128-token round costs
// 0.65 (NVFP4) to 0.8 (MXFP4) of a 256-token one, not half: every weight is decoded for half the tokens (H200,
// gpt-oss shapes, twenty-seventh session). NIBBLE_WS_BM=128|256 forces one (measurements).
int pick_ws_bm(int64_t m, int n) {
  static const int forced = [] {
    const char* e = std::getenv("NIBBLE_WS_BM");
    return e ? std::atoi(e) : 0;
  }();
  if (forced == 128 || forced == 256) return forced;
  const int sms = gemm_sm_count();
  const int64_t cols = ceil_div(n, ws::kBN);
  return ceil_div(cols * ceil_div(m, 128), sms) <= ceil_div(cols * ceil_div(m, 256), sms) ? 128 : 256;
}

// The portable warp-specialized tile (gemm_fp4_wsp.cuh): persistent blocks over 128 weight rows x 128 tokens.
template <WKind K>
void gemm_wsp_for(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y,
                  cudaStream_t s) {
  const int64_t items = static_cast<int64_t>(ceil_div(w.n, wsp::kBN)) * ceil_div(m, wsp::kBM);
  wsp::launch<K>(wsp::DenseJob<K>{w, static_cast<int>(m), bias, y}, w.k, items, a, s);
}

template <WKind K>
void gemm_kind(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y, GemmActs mode,
               cudaStream_t s) {
  if (a.fp8) {  // (pick_ws_bm's rule: at M = 2048 / 8192, where it picks 256, forcing 128 ran 21-55 % slower)
    if (pick_ws_bm(m, w.n) == 128) return gemm_wsr8_launch<K, 128>(w, a, m, bias, y, s);
    return gemm_wsr8_launch<K, 256>(w, a, m, bias, y, s);
  }
  if (a.tiled && a.wgmma && !a.wsp) {
    if (a.rs == 2) return gemm_wsr_launch<K, true, 256>(w, a, m, bias, y, s);
    if (a.rs == 1 && pick_ws_bm(m, w.n) == 128) return gemm_wsr_launch<K, false, 128>(w, a, m, bias, y, s);
    if (a.rs == 1) return gemm_wsr_launch<K, false, 256>(w, a, m, bias, y, s);
    return gemm_ws_for<K>(w, a, m, bias, y, s);
  }
  if (a.tiled) return gemm_wsp_for<K>(w, a, m, bias, y, s);
  if (a.wgmma) {  // hi + lo: 64-token tiles (two activation tiles per stage); one fp16: 128 where the grid fills
    if (mode == GemmActs::kSplit) return gemm_wgmma_for<K, 64, true>(w, a, m, bias, y, s);
    if (pick_bm(m, w.n) == 128) return gemm_wgmma_for<K, 128, false>(w, a, m, bias, y, s);
    return gemm_wgmma_for<K, 64, false>(w, a, m, bias, y, s);
  }
  const bool split = mode == GemmActs::kSplit;
  if (pick_bm(m, w.n) == 128) {
    return split ? gemm_for<K, 128, true>(w, a, m, bias, y, s) : gemm_for<K, 128, false>(w, a, m, bias, y, s);
  }
  return split ? gemm_for<K, 64, true>(w, a, m, bias, y, s) : gemm_for<K, 64, false>(w, a, m, bias, y, s);
}

}  // namespace

bool gemm_fp4_supports(const DevWeight& w) {
  return (w.kind == WKind::kMXFP4 || w.kind == WKind::kNVFP4) && w.vec_ok && w.k % 32 == 0 && w.n > 0;
}

bool gemm_wgmma() {
  static const bool on = [] {
    if (!knob_on("NIBBLE_WGMMA")) return false;
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0) return false;
    cudaFuncAttributes fa{};  // the sm_90a machine code is in this binary (not only another arch's)
    CUDA_CHECK(cudaFuncGetAttributes(&fa, gemm_fp4_wgmma_kernel<WKind::kMXFP4, 128, false>));
    return fa.binaryVersion == 90;
  }();
  return on;
}

int gemm_ws_rs() {
  // 1 by default: the register-fragment tile ran the gpt-oss shapes 10-16 % faster than the decoder-warpgroup
  // tile, two fragment sets no faster than one (H200, bench/NOTES.md twenty-seventh session).
  static const int rs = [] {
    const char* e = std::getenv("NIBBLE_WS_RS");
    return e && (e[0] == '0' || e[0] == '2') ? e[0] - '0' : 1;
  }();
  return rs;
}

bool gemm_fp8_supported() { return gemm_wgmma(); }

TiledTile gemm_tiled_tile(int64_t m, int n, GemmActs mode, int policy) {
  if (mode == GemmActs::kFp8) return TiledTile::kWs;  // (its only tile; the caller checked gemm_fp8_supported)
  if (policy == 0 || mode != GemmActs::kFp16) return TiledTile::kNone;
  if (!gemm_wgmma()) return m >= wsp::kBM ? TiledTile::kWsp : TiledTile::kNone;  // (gemm_fp4_wsp.cuh)
  if (m < ws::kBM) return TiledTile::kNone;
  if (policy == 1) return TiledTile::kWs;
  // The sm_90a tile where its grid fills the GPU; and from two token tiles on, down to a grid of a third of
  // the SMs, where it still beats the wgmma tile (H100, M = 512: qkv 85 -> 50 us on 80 blocks, o 91 -> 68 on
  // 46; bench/NOTES.md, thirteenth session).
  const int sms = gemm_sm_count();
  const int64_t tiles = static_cast<int64_t>(ceil_div(n, ws::kBN)) * ceil_div(m, ws::kBM);
  if (tiles >= sms || (m >= 2 * ws::kBM && 3 * tiles >= sms)) return TiledTile::kWs;
  // Below that, from 256 tokens, the portable warp-specialized tile where its 128 x 128 items fill between
  // half the SMs and one round (H200, gpt-oss's dense shapes against the wgmma tile, twenty-second session:
  // at M = 256 / 384 qkv 62 -> 48 us, o at 384 87 -> 67, fc2 at 384 61 -> 48; a 46-item grid -- o and fc2 at
  // 256 -- 5-12 % slower, a 135-item one -- fc1 at 384 -- even). Else the wgmma tile.
  const int64_t items = static_cast<int64_t>(ceil_div(n, wsp::kBN)) * ceil_div(m, wsp::kBM);
  return 2 * items >= sms && items <= sms ? TiledTile::kWsp : TiledTile::kNone;
}

int gemm_sm_count() {
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// kFp8: the E4M3 tiles' bytes (rows padded to whole 256-token tiles, k to whole 128-wide k-tiles), 256-aligned;
// the row scales follow.
static int64_t fp8_tiles_bytes(int64_t rows, int k) { return (ws::padded_rows(rows) * wsr8::padded_k(k) + 255) / 256 * 256; }

int64_t gemm_activations_bytes(int64_t rows, int k, GemmActs mode, bool tiled) {
  if (mode == GemmActs::kFp8) return fp8_tiles_bytes(rows, k) + rows * 4;
  const int64_t half = ((tiled ? ws::padded_rows(rows) : rows) * wg::padded_k(k) * 2 + 255) / 256 * 256;
  return (mode == GemmActs::kSplit ? 2 : 1) * half + rows * 4;
}

GemmActivations gemm_activations_in(void* buf, int64_t rows, int k, GemmActs mode, bool tiled) {
  if (mode == GemmActs::kFp8) {
    NB_CHECK(gemm_fp8_supported(), "gemm activations: fp8 needs the sm_90a tiles");
    GemmActivations a;
    a.tiled = a.wgmma = a.fp8 = true;
    a.mp = ws::padded_rows(rows);
    a.hi = a.lo = static_cast<__half*>(buf);
    a.unscale = reinterpret_cast<float*>(static_cast<uint8_t*>(buf) + fp8_tiles_bytes(rows, k));
    return a;
  }
  NB_CHECK(!tiled || mode == GemmActs::kFp16, "gemm activations: tiled needs one fp16");
  const int64_t half = ((tiled ? ws::padded_rows(rows) : rows) * wg::padded_k(k) * 2 + 255) / 256 * 256;
  uint8_t* p = static_cast<uint8_t*>(buf);
  GemmActivations a;
  a.tiled = tiled;
  a.mp = tiled ? ws::padded_rows(rows) : 0;
  a.wgmma = gemm_wgmma();
  a.ld = a.wgmma ? wg::padded_k(k) : k;
  a.hi = reinterpret_cast<__half*>(p);
  a.lo = mode == GemmActs::kSplit ? reinterpret_cast<__half*>(p + half) : a.hi;  // kFp16: never read
  a.unscale = reinterpret_cast<float*>(p + (mode == GemmActs::kSplit ? 2 : 1) * half);
  return a;
}

void launch_gemm_activations(const float* x, const int32_t* gather, int gather_div, int64_t rows, int k, GemmActs mode,
                             const GemmActivations& out, cudaStream_t s) {
  NB_CHECK(rows >= 1 && rows <= (int64_t{1} << 30) && k % 8 == 0 && gather_div >= 1,
           "gemm activations: rows " + std::to_string(rows) + ", k " + std::to_string(k));
  if (mode == GemmActs::kFp8) {
    NB_CHECK(out.fp8 && k % 32 == 0, "gemm activations: fp8 needs fp8 scratch and k % 32 == 0");
    const int n_kt = wsr8::padded_k(k) / wsr8::kBK;
    auto kernel = n_kt <= 24 ? fp8_activations_kernel<24> : n_kt <= 32 ? fp8_activations_kernel<32> : fp8_activations_kernel<0>;
    kernel<<<ceil_div(rows, kPrepWarps), kPrepWarps * 32, 0, s>>>(x, gather, gather_div, static_cast<int>(rows), k,
                                                                  out.mp, reinterpret_cast<uint32_t*>(out.hi), out.unscale);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  const bool split = mode == GemmActs::kSplit;
  // Rows of up to 4096 elements in one read (octet_ / wgmma_activations_kernel); longer ones below.
  const int padded_groups = wg::padded_k(k) / 8;
  const bool wgmma_order = out.wgmma && (!out.tiled || out.rs);
  if (!wgmma_order && padded_groups <= 32 * 16) {
    const bool g12 = padded_groups <= 32 * 12;
    auto kernel = out.tiled ? (g12 ? octet_activations_kernel<12, true> : octet_activations_kernel<16, true>)
                            : (g12 ? octet_activations_kernel<12, false> : octet_activations_kernel<16, false>);
    kernel<<<ceil_div(rows, kPrepWarps), kPrepWarps * 32, 0, s>>>(x, gather, gather_div, static_cast<int>(rows), k, split,
                                                                  out.tiled ? out.mp : 0, out.hi, split ? out.lo : out.hi,
                                                                  out.unscale);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int n_kt = wg::padded_k(k) / wg::kBK;
  if (wgmma_order && n_kt <= 64) {
    auto kernel = n_kt <= 48 ? wgmma_activations_kernel<48> : wgmma_activations_kernel<64>;
    kernel<<<ceil_div(rows, kPrepWarps), kPrepWarps * 32, 0, s>>>(x, gather, gather_div, static_cast<int>(rows), k, split,
                                                                  out.tiled ? out.mp : 0, out.hi, split ? out.lo : out.hi,
                                                                  out.unscale);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  activations_kernel<<<ceil_div(rows, kPrepWarps), kPrepWarps * 32, 0, s>>>(
      x, gather, gather_div, static_cast<int>(rows), k, split, wgmma_order, out.tiled ? out.mp : 0, out.hi, split ? out.lo : out.hi, out.unscale);
  CUDA_CHECK(cudaGetLastError());
}

void launch_gemm_fp4(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y,
                     GemmActs mode, cudaStream_t s) {
  NB_CHECK(gemm_fp4_supports(w), "gemm_fp4: needs an MXFP4/NVFP4 weight with aligned rows and k % 32 == 0");
  NB_CHECK(m >= 1 && static_cast<int64_t>(ceil_div(m, 64)) <= 65535, "gemm_fp4: m = " + std::to_string(m));
  if (w.kind == WKind::kMXFP4) return gemm_kind<WKind::kMXFP4>(w, a, m, bias, y, mode, s);
  return gemm_kind<WKind::kNVFP4>(w, a, m, bias, y, mode, s);
}

}  // namespace nb::cuda
