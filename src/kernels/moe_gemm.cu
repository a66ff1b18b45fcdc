// MoE grouped GEMM (see moe_gemm.cuh). Grouping: one block counts the pairs per expert in shared memory,
// lays the experts' rows out back to back (offsets) and lists their 64-row token tiles; each pair then
// takes a slot of its expert. Slots within an expert are claimed with shared-memory atomics, so their
// order varies from run to run, but every output row is computed from its own A row alone (MMA rows are
// independent and k is summed in a fixed order), and the combine reads rows by pair: the result is
// bitwise deterministic. Token tiles are 64 rows, or 128 when the experts average enough rows
// (launch_moe_gemm): with 32-128 experts a prefill chunk gives each expert tens to hundreds of rows; empty
// m16 tiles cost no MMAs (gemm_fp4_tile.cuh), and 128-row tiles read a third fewer shared-memory bytes per
// MMA (bench/NOTES.md). Off sm_90a, one fp16 from 128 rows per expert: the portable warp-specialized tile
// (gemm_fp4_wsp.cuh) over (token tile, weight tile) items (moe_wsp). On sm_90a, one fp16 from 192 rows per
// expert: the register-fragment tile (gemm_fp4_wsr.cuh) over such items with 256-token tiles and 8-row-aligned
// expert slots (wsrm, moe_wsr).
#include "kernels/moe_gemm.cuh"

#include "backend/cuda/cuda_check.h"
#include "kernels/gemm_fp4_tile.cuh"
#include "kernels/gemm_fp4_wgmma.cuh"
#include "kernels/gemm_fp4_wsp.cuh"
#include "kernels/gemm_fp4_wsr.cuh"
#include "kernels/gemm_fp4_wsr8.cuh"

#include <cstdlib>

namespace nb::cuda {
namespace {

using gemm::kBN;
constexpr int kMinBM = 64;  // the smaller token-tile height; the scratch's tile list is sized for it
constexpr int kMaxExperts = 4096;

// align > 1 (the sm_90a register-fragment tile, whose token tiles are bulk copies of whole 8-row core-matrix
// groups): each expert's first slot a multiple of align; the pad slots, and those up to max_slots, get pair -1
// (launch_gemm_activations skips them), and counts_out [n_experts] keeps the true counts.
__global__ void group_kernel(const int32_t* __restrict__ ids, int n_pairs, int n_experts, int bm, int align,
                             int max_slots, int32_t* __restrict__ offsets, int32_t* __restrict__ slot_of,
                             int32_t* __restrict__ pair_of, int2* __restrict__ tiles, int32_t* __restrict__ n_tiles,
                             int32_t* __restrict__ counts_out) {
  extern __shared__ int32_t counts[];  // [n_experts] counts, then [n_experts] cursors
  int32_t* cursor = counts + n_experts;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e < 0 || e >= n_experts) __trap();  // the router only writes ids < n_experts
    atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0, nt = 0;
    for (int e = 0; e < n_experts; ++e) {
      offsets[e] = cursor[e] = off;
      for (int m0 = 0; m0 < counts[e]; m0 += bm) tiles[nt++] = make_int2(e, m0);
      off += (counts[e] + align - 1) / align * align;
    }
    offsets[n_experts] = off;
    *n_tiles = nt;
  }
  __syncthreads();
  if (align > 1) {  // (before the slots are claimed: the cursors still hold the offsets)
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
      counts_out[e] = counts[e];
      const int end = e + 1 < n_experts ? cursor[e + 1] : max_slots;
      for (int slot = cursor[e] + counts[e]; slot < end; ++slot) pair_of[slot] = -1;
    }
    __syncthreads();
  }
  for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
    const int slot = atomicAdd(&cursor[ids[p]], 1);
    slot_of[p] = slot;
    pair_of[slot] = p;
  }
}

// Which tile this block runs: (expert, its first slot, rows), or false past the listed tiles.
template <int kBM>
__device__ __forceinline__ bool tile_of(const int2* tiles, const int32_t* n_tiles, const int32_t* offsets, int& e,
                                        int& base, int& rows) {
  if (static_cast<int>(blockIdx.y) >= *n_tiles) return false;
  const int2 t = tiles[blockIdx.y];
  e = t.x;
  base = offsets[e] + t.y;
  rows = min(kBM, offsets[e + 1] - base);
  return true;
}

// FC1 + bias + GLU: block x covers outputs j in [64 x, 64 x + 64); its 128 weight rows are gate/up pairs
// (tile column 2i = gate of j0 + i, 2i + 1 = up), whichever layout the checkpoint uses.
template <WKind K, bool kSplit, int kBM, bool kPf, int kW>
__global__ void __launch_bounds__(gemm::Tile<kBM, kSplit, kPf, kW>::kThreadsT, gemm::Tile<kBM, kSplit, kPf, kW>::kLaunchMinBlocks) fc1_kernel(ExpertTable tab, const int2* __restrict__ tiles,
                                                         const int32_t* __restrict__ n_tiles,
                                                         const int32_t* __restrict__ offsets, GemmActivations a,
                                                         Glu glu, float limit, float* __restrict__ act) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ gemm::ColInfo ci;
  int e, base, rows;
  if (!tile_of<kBM>(tiles, n_tiles, offsets, e, base, rows)) return;
  const DevWeight& w = tab.fc1[e];
  const int d = tab.d_expert, j0 = blockIdx.x * (kBN / 2), tid = threadIdx.x;
  const bool interleaved = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  auto row_of = [&](int c) {
    const int j = j0 + c / 2;
    return j >= d ? -1 : interleaved ? 2 * j + (c & 1) : (c & 1) ? d + j : j;
  };
  if (tid < kBN) gemm::set_col(ci, tid, w, row_of(tid));
  using T = gemm::Tile<kBM, kSplit, kPf, kW>;
  const gemm::BRow br = gemm::brow_of(w, row_of(tid / T::kRowThreads), w.k, K == WKind::kMXFP4 ? 32 : 16);
  typename T::Acc acc = {};
  const int64_t a_off = static_cast<int64_t>(base) * w.k;
  gemm::mainloop<K, T, true>(smem, a.hi + a_off, a.lo + a_off, rows, w.k, br, acc);
  const bool gpt_oss = glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves;
  const float* bias = tab.fc1_bias ? tab.fc1_bias + static_cast<int64_t>(e) * 2 * d : nullptr;
  gemm::epilogue<K, T>(acc, ci, a.unscale + base, rows, [&](int row, int col, float g, float u) {
    const int j = j0 + col / 2;
    if (j >= d) return;
    if (bias) g += bias[ci.row[col]], u += bias[ci.row[col + 1]];
    act[static_cast<int64_t>(base + row) * d + j] = glu_value(g, u, gpt_oss, limit);
  });
}

// FC2 + bias, times the pair's routing weight, into the pair's slot row.
template <WKind K, bool kSplit, int kBM, bool kPf, int kW>
__global__ void __launch_bounds__(gemm::Tile<kBM, kSplit, kPf, kW>::kThreadsT, gemm::Tile<kBM, kSplit, kPf, kW>::kLaunchMinBlocks) fc2_kernel(ExpertTable tab, const int2* __restrict__ tiles,
                                                         const int32_t* __restrict__ n_tiles,
                                                         const int32_t* __restrict__ offsets,
                                                         const int32_t* __restrict__ pair_of,
                                                         const float* __restrict__ weights, GemmActivations a,
                                                         float* __restrict__ y_slot) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ gemm::ColInfo ci;
  int e, base, rows;
  if (!tile_of<kBM>(tiles, n_tiles, offsets, e, base, rows)) return;
  const DevWeight& w = tab.fc2[e];
  const int n = tab.d_model, n0 = blockIdx.x * kBN, tid = threadIdx.x;
  if (tid < kBN) gemm::set_col(ci, tid, w, n0 + tid < n ? n0 + tid : -1);
  using T = gemm::Tile<kBM, kSplit, kPf, kW>;
  const int my_row = n0 + tid / T::kRowThreads;
  const gemm::BRow br = gemm::brow_of(w, my_row < n ? my_row : -1, w.k, K == WKind::kMXFP4 ? 32 : 16);
  typename T::Acc acc = {};
  const int64_t a_off = static_cast<int64_t>(base) * w.k;
  gemm::mainloop<K, T, true>(smem, a.hi + a_off, a.lo + a_off, rows, w.k, br, acc);
  const float* bias = tab.fc2_bias ? tab.fc2_bias + static_cast<int64_t>(e) * n : nullptr;
  gemm::epilogue<K, T>(acc, ci, a.unscale + base, rows, [&](int row, int col, float v0, float v1) {
    const int c = n0 + col;
    const float wt = weights[pair_of[base + row]];
    float* dst = y_slot + static_cast<int64_t>(base + row) * n + c;
    // The weight multiplies after the bias (formats.md §2.4), as the CPU reference does.
    if (c < n) dst[0] = wt * (v0 + (bias ? bias[c] : 0.0f));
    if (c + 1 < n) dst[1] = wt * (v1 + (bias ? bias[c + 1] : 0.0f));
  });
}

// The same two projections on the sm_90a tile (gemm_fp4_wgmma.cuh). A thread holds weight rows g and g + 8
// of its warp's 16 (tile rows), so FC1 maps tile row c to gate (c % 16 < 8) or up of output
// j0 + 8 (c / 16) + c % 8: the GLU meets both in one thread.
template <WKind K, bool kSplit, int kBM>
__global__ void __launch_bounds__(wg::kThreads, wg::Tile<kBM, kSplit>::kMinBlocks) fc1_wgmma_kernel(ExpertTable tab, const int2* __restrict__ tiles,
                                                                    const int32_t* __restrict__ n_tiles,
                                                                    const int32_t* __restrict__ offsets,
                                                                    GemmActivations a, Glu glu, float limit,
                                                                    float* __restrict__ act, GemmActivations out) {
  using T = wg::Tile<kBM, kSplit>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ gemm::ColInfo ci;
  int e, base, rows;
  if (!tile_of<kBM>(tiles, n_tiles, offsets, e, base, rows)) return;
  const DevWeight& w = tab.fc1[e];
  const int d = tab.d_expert, j0 = blockIdx.x * (wg::kBN / 2), tid = threadIdx.x;
  const bool interleaved = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  auto j_of = [&](int c) { return j0 + 8 * (c >> 4) + (c & 7); };
  auto row_of = [&](int c) {
    const int j = j_of(c);
    const bool up = (c & 15) >= 8;
    return j >= d ? -1 : interleaved ? 2 * j + up : up ? d + j : j;
  };
  if (tid < wg::kBN) gemm::set_col(ci, tid, w, row_of(tid));
  const gemm::BRow br = gemm::brow_of(w, row_of(tid >> 1), w.k, K == WKind::kMXFP4 ? 32 : 16);
  float acc[T::kAcc] = {};
  wg::mainloop_rows<K, T, kSplit>(smem, a.hi + base * a.ld, a.lo + base * a.ld, a.ld, rows, w.k, br, acc);
  const bool gpt_oss = glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves;
  const float* bias = tab.fc1_bias ? tab.fc1_bias + static_cast<int64_t>(e) * 2 * d : nullptr;
  // out.hi non-null: write FC2's fp16 activations directly, scaled by 2^10, in the stored order
  // (projections_wgmma decides when that is exact enough).
  if (out.hi && blockIdx.x == 0) {
    for (int r = tid; r < rows; r += blockDim.x) out.unscale[base + r] = 1.0f / 1024.0f;
  }
  wg::epilogue<T>(acc, ci, a.unscale + base, rows, [&](int row, int ra, int rb, float g, float u) {
    const int j = j_of(ra);
    if (j >= d) return;
    if (bias) g += bias[ci.row[ra]], u += bias[ci.row[rb]];
    const float v = glu_value(g, u, gpt_oss, limit);
    if (!out.hi) {
      act[static_cast<int64_t>(base + row) * d + j] = v;
      return;
    }
    const int64_t at = static_cast<int64_t>(base + row) * out.ld + (j & ~63) + wg::position_of(j & 63);
    const __half h = __float2half_rn(v * 1024.0f);
    out.hi[at] = h;
    if constexpr (kSplit) out.lo[at] = __float2half_rn(v * 1024.0f - __half2float(h));
  });
}

template <WKind K, bool kSplit, int kBM>
__global__ void __launch_bounds__(wg::kThreads, wg::Tile<kBM, kSplit>::kMinBlocks) fc2_wgmma_kernel(ExpertTable tab, const int2* __restrict__ tiles,
                                                                    const int32_t* __restrict__ n_tiles,
                                                                    const int32_t* __restrict__ offsets,
                                                                    const int32_t* __restrict__ pair_of,
                                                                    const float* __restrict__ weights,
                                                                    GemmActivations a, float* __restrict__ y_slot) {
  using T = wg::Tile<kBM, kSplit>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ gemm::ColInfo ci;
  int e, base, rows;
  if (!tile_of<kBM>(tiles, n_tiles, offsets, e, base, rows)) return;
  const DevWeight& w = tab.fc2[e];
  const int n = tab.d_model, n0 = blockIdx.x * wg::kBN, tid = threadIdx.x;
  if (tid < wg::kBN) gemm::set_col(ci, tid, w, n0 + tid < n ? n0 + tid : -1);
  const int my_row = n0 + (tid >> 1);
  const gemm::BRow br = gemm::brow_of(w, my_row < n ? my_row : -1, w.k, K == WKind::kMXFP4 ? 32 : 16);
  float acc[T::kAcc] = {};
  wg::mainloop_rows<K, T, kSplit>(smem, a.hi + base * a.ld, a.lo + base * a.ld, a.ld, rows, w.k, br, acc);
  const float* bias = tab.fc2_bias ? tab.fc2_bias + static_cast<int64_t>(e) * n : nullptr;
  wg::epilogue<T>(acc, ci, a.unscale + base, rows, [&](int row, int ra, int rb, float va, float vb) {
    const float wt = weights[pair_of[base + row]];
    float* dst = y_slot + static_cast<int64_t>(base + row) * n + n0;
    // The weight multiplies after the bias (formats.md §2.4), as the CPU reference does.
    if (n0 + ra < n) dst[ra] = wt * (va + (bias ? bias[n0 + ra] : 0.0f));
    if (n0 + rb < n) dst[rb] = wt * (vb + (bias ? bias[n0 + rb] : 0.0f));
  });
}

// y[t, c] = sum over i in choice order of w_i * y_slot[slot_of[t * top_k + i], c], w_i = weights[t * top_k + i]
// (null: 1, the FP4 tiles' FC2 epilogue has applied it); float4 per thread.
__global__ void combine_kernel(const float* __restrict__ y_slot, const int32_t* __restrict__ slot_of,
                               const float* __restrict__ weights, int n_tokens, int top_k, int n,
                               float* __restrict__ y) {
  const int q = n / 4;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(n_tokens) * q) return;
  const int t = static_cast<int>(i / q), c = static_cast<int>(i % q);
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int k = 0; k < top_k; ++k) {
    const float4 v = reinterpret_cast<const float4*>(y_slot + static_cast<int64_t>(slot_of[t * top_k + k]) * n)[c];
    const float w = weights ? weights[t * top_k + k] : 1.0f;
    s.x += w * v.x, s.y += w * v.y, s.z += w * v.z, s.w += w * v.w;
  }
  reinterpret_cast<float4*>(y + static_cast<int64_t>(t) * n)[c] = s;
}

// act[r, j] = glu(gate, up) of row r of h [rows, 2 d] in the checkpoint's layout (interleaved: gate 2j, up
// 2j + 1; halves: gate j, up d + j): the BF16 experts' FC1 outputs (cuBLASLt adds the bias).
__global__ void moe_glu_kernel(const float* __restrict__ h, int64_t rows, int d, Glu glu, float limit,
                               float* __restrict__ act) {
  const bool inter = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  const bool gpt_oss = glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * d; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / d;
    const int j = static_cast<int>(i % d);
    const float* hr = h + r * 2 * d;
    act[i] = glu_value(inter ? hr[2 * j] : hr[j], inter ? hr[2 * j + 1] : hr[d + j], gpt_oss, limit);
  }
}

// The FC1 weight row of tile row c for outputs from n0 (the portable and the sm_90a warp-specialized tiles): the
// gate (c % 16 < 8) or up row of output n0 + 8 (c / 16) + c % 8, whichever layout the checkpoint uses; -1 past d.
__device__ __forceinline__ int fc1_tile_row(int d, Glu glu, int n0, int c) {
  const int j = n0 + 8 * (c >> 4) + (c & 7);
  const bool up = (c & 15) >= 8, interleaved = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  return j >= d ? -1 : interleaved ? 2 * j + up : up ? d + j : j;
}

// The two projections on the portable warp-specialized tile (gemm_fp4_wsp.cuh; one fp16, off sm_90a): items
// are (listed token tile, weight tile) pairs, token tile i / n_col, weight tile i % n_col; a token tile's
// rows are its expert's slots from any row (the tiled activations' copy handles the alignment), and the
// listed tiles' count is read on the device.
struct WspTiles {
  const int2* tiles;
  const int32_t* n_tiles;
  const int32_t* offsets;
  __device__ wsp::Item item(const DevWeight* experts, int n_col, int cols_per_tile, int i) const {
    const int2 t = tiles[i / n_col];
    const int base = offsets[t.x] + t.y;
    return wsp::Item{experts + t.x, i % n_col * cols_per_tile, base, min(wsp::kBM, offsets[t.x + 1] - base),
                     t.x};
  }
};

// FC1 + bias + GLU into act: an item covers outputs j in [n0, n0 + 64). Tile row c is the gate (c % 16 < 8)
// or up row of output n0 + 8 (c / 16) + c % 8, as on the sm_90a tile: a multiplier thread holds rows g and
// g + 8 of each m16 tile, so the GLU meets both in one thread.
template <WKind K>
struct WspFc1Job {
  ExpertTable tab;
  WspTiles tl;
  Glu glu;
  float limit;
  float* act;
  __device__ int k() const { return tab.d_model; }
  __device__ int n_col() const { return (tab.d_expert + wsp::kBN / 2 - 1) / (wsp::kBN / 2); }
  __device__ int n_items() const { return *tl.n_tiles * n_col(); }
  __device__ wsp::Item item(int i) const { return tl.item(tab.fc1, n_col(), wsp::kBN / 2, i); }
  __device__ int weight_row(const wsp::Item& t, int c) const {
    return fc1_tile_row(tab.d_expert, glu, t.n0, c);
  }
  __device__ void store(const wsp::Acc& acc, const wsp::Item& t, const float* us) const {
    const int d = tab.d_expert;
    const bool gpt_oss = glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves;
    const float* bias = tab.fc1_bias ? tab.fc1_bias + static_cast<int64_t>(t.e) * 2 * d : nullptr;
#pragma unroll
    for (int i = 0; i < wsp::kMT; ++i) {
      const int c = wsp::row_of(i, 0), j = t.n0 + 8 * (c >> 4) + (c & 7);
      if (j >= d) continue;
      const int rg = weight_row(t, c), ru = weight_row(t, c + 8);
      const float sg = wsp::row_scale<K>(*t.w, rg), su = wsp::row_scale<K>(*t.w, ru);
      const float bg = bias ? bias[rg] : 0.0f, bu = bias ? bias[ru] : 0.0f;
#pragma unroll
      for (int jn = 0; jn < wsp::kNT; ++jn) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = wsp::token_of(jn, e);
          if (token >= t.rows) continue;
          const float u = us[token];
          act[(t.row0 + token) * d + j] =
              glu_value(acc[i][jn][e] * u * sg + bg, acc[i][jn][2 + e] * u * su + bu, gpt_oss, limit);
        }
      }
    }
  }
};

// FC2 + bias, times the pair's routing weight, into the pair's slot row: an item covers outputs
// [n0, n0 + 128).
template <WKind K>
struct WspFc2Job {
  ExpertTable tab;
  WspTiles tl;
  const int32_t* pair_of;
  const float* weights;
  float* y_slot;
  __device__ int k() const { return tab.d_expert; }
  __device__ int n_col() const { return (tab.d_model + wsp::kBN - 1) / wsp::kBN; }
  __device__ int n_items() const { return *tl.n_tiles * n_col(); }
  __device__ wsp::Item item(int i) const { return tl.item(tab.fc2, n_col(), wsp::kBN, i); }
  __device__ int weight_row(const wsp::Item& t, int c) const {
    return t.n0 + c < tab.d_model ? t.n0 + c : -1;
  }
  __device__ void store(const wsp::Acc& acc, const wsp::Item& t, const float* us) const {
    const int n = tab.d_model;
    const float* bias = tab.fc2_bias ? tab.fc2_bias + static_cast<int64_t>(t.e) * n : nullptr;
    float wt[wsp::kNT][2];  // the routing weight times the token scale, per token
#pragma unroll
    for (int jn = 0; jn < wsp::kNT; ++jn) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = wsp::token_of(jn, e);
        wt[jn][e] = token < t.rows ? weights[pair_of[t.row0 + token]] : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < wsp::kMT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = t.n0 + wsp::row_of(i, h);
        if (col >= n) continue;
        const float sr = wsp::row_scale<K>(*t.w, col), bc = bias ? bias[col] : 0.0f;
#pragma unroll
        for (int jn = 0; jn < wsp::kNT; ++jn) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int token = wsp::token_of(jn, e);
            // The weight multiplies after the bias (formats.md §2.4), as the CPU reference does.
            if (token < t.rows)
              y_slot[(t.row0 + token) * n + col] = wt[jn][e] * (acc[i][jn][2 * h + e] * us[token] * sr + bc);
          }
        }
      }
    }
  }
};

// The two projections on the sm_90a register-fragment tile (gemm_fp4_wsr.cuh): persistent blocks over (listed
// token tile, weight tile) items as on the portable tile above, a producer warpgroup that copies each item's
// weight codes and its token tile's activations into the stage ring, two multiplier warpgroups that decode
// their A fragments and issue wgmma with the activations from shared memory. A token tile is one bulk copy of
// whole 8-row core-matrix groups of the tiled activations, so every expert's first slot is a multiple of 8
// (group_kernel's align; the pad slots are never converted, multiplied into outputs that are kept, or read);
// wgmma's N is the narrowest of 16, 32, 64, 96, 128 (and 256 on 256-row tiles) that covers the tile's rows (an
// expert's last tile is usually partial), and only those N rows are copied.
namespace wsrm {

// Token rows per listed tile: 128, or 256 where the experts average >= kBigRows rows (bm_for):
// a 256-token k-tile costs ~1.35x a 128-token one on the dense tile, not 2x (bench/NOTES.md, twenty-seventh session).
constexpr int kMaxBM = 256;
constexpr int kBigRows = 192;
constexpr int kAlign = 8;  // an 8-row core-matrix group

// The slots (rows) the grouping may use: each expert's rows rounded up to kAlign.
inline int64_t slots_for(int64_t n_pairs, int n_experts) { return n_pairs + (kAlign - 1) * static_cast<int64_t>(n_experts); }
// The token-tile height for n_pairs rows over n_experts: 256 from kBigRows per expert on average (NIBBLE_MOE_WSR_BM
// = 128 or 256 forces one: measurements).
inline int bm_for(int64_t n_pairs, int n_experts) {
  static const int forced = [] {
    const char* e = std::getenv("NIBBLE_MOE_WSR_BM");
    return e ? std::atoi(e) : 0;
  }();
  if (forced == 128 || forced == 256) return forced;
  return n_pairs >= kBigRows * static_cast<int64_t>(n_experts) ? 256 : 128;
}

// The narrowest wgmma N that covers `rows` tokens (N = 256 only for 256-row tiles).
__host__ __device__ constexpr int n_of(int rows) {
  return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : rows <= 96 ? 96 : rows <= 128 ? 128 : 256;
}

struct Item {
  const DevWeight* w;  // the expert's projection
  int n0;              // the item's first output (FC1: of d_expert; FC2: of d_model)
  int row0, rows;      // its token tile: first slot (a multiple of kAlign) and rows (<= BM)
  int e;               // the expert
};

template <int BM>
struct Tiles {
  const int2* tiles;
  const int32_t* n_tiles;
  const int32_t* offsets;
  const int32_t* counts;
  __device__ Item item(const DevWeight* experts, int n_col, int cols_per_tile, int i) const {
    const int2 t = tiles[i / n_col];
    return Item{experts + t.x, i % n_col * cols_per_tile, offsets[t.x] + t.y, min(BM, counts[t.x] - t.y), t.x};
  }
};

// FC1 + bias + GLU: an item covers outputs j in [n0, n0 + 64); tile row c is the gate (c % 16 < 8) or up row of
// output n0 + 8 (c / 16) + c % 8, so a multiplier lane's rows a and a + 8 are one output's gate and up. The
// result goes to act (fp32) or, out.hi set, straight into FC2's tiled fp16 activations at 2^10 (gpt-oss's
// bounded GLU; projections_wsr says when).
template <WKind K, int BM>
struct Fc1Job {
  static constexpr int kBM = BM;
  ExpertTable tab;
  Tiles<BM> tl;
  Glu glu;
  float limit;
  float* act;
  GemmActivations out;
  __device__ int k() const { return tab.d_model; }
  __device__ int n_col() const { return (tab.d_expert + ws::kBN / 2 - 1) / (ws::kBN / 2); }
  __device__ int n_items() const { return *tl.n_tiles * n_col(); }
  __device__ Item item(int i) const { return tl.item(tab.fc1, n_col(), ws::kBN / 2, i); }
  __device__ int weight_row(const Item& t, int c) const {
    return fc1_tile_row(tab.d_expert, glu, t.n0, c);
  }
  __device__ float token_weight(const Item&, int) const { return 1.0f; }
  // acc: D [the lane's rows ra (gate), rb (up)][tokens 8 jj + 2 (lane % 4) + i]; us: token scales; xa, xb: the
  // rows' further factors (the FP8 tile's folds; 1 on the fp16 tile).
  __device__ void store(const float (&acc)[kBM / 2], const Item& t, int ra, int rb, const float* us, const float*,
                        float xa, float xb) const {
    const int d = tab.d_expert, j = t.n0 + 8 * (ra >> 4) + (ra & 7), tq = threadIdx.x & 3;
    if (out.hi && t.n0 == 0 && static_cast<int>(threadIdx.x) < t.rows) out.unscale[t.row0 + threadIdx.x] = 1.0f / 1024.0f;
    if (j >= d) return;
    const int rg = weight_row(t, ra), ru = weight_row(t, rb);
    const float sg = wsp::row_scale<K>(*t.w, rg) * xa, su = wsp::row_scale<K>(*t.w, ru) * xb;
    const float* bias = tab.fc1_bias ? tab.fc1_bias + static_cast<int64_t>(t.e) * 2 * d : nullptr;
    const float bg = bias ? bias[rg] : 0.0f, bu = bias ? bias[ru] : 0.0f;
    const bool gpt_oss = glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves;
    const int pos = wg::position_of(j & 63);  // FC2's input: stored position of element j in its k-tile
#pragma unroll
    for (int jj = 0; jj < kBM / 8; ++jj) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int token = 8 * jj + 2 * tq + i;
        if (token >= t.rows) continue;
        const float u = us[token];
        const float v = glu_value(acc[4 * jj + i] * u * sg + bg, acc[4 * jj + 2 + i] * u * su + bu, gpt_oss, limit);
        const int64_t slot = t.row0 + token;
        if (out.hi) out.hi[ws::chunk_of(slot, j >> 6, pos >> 3, out.mp) * 8 + (pos & 7)] = __float2half_rn(v * 1024.0f);
        else act[slot * d + j] = v;
      }
    }
  }
};

// FC2 + bias, times the pair's routing weight (wt, per token), into the pair's slot row: an item covers outputs
// [n0, n0 + 128).
template <WKind K, int BM>
struct Fc2Job {
  static constexpr int kBM = BM;
  ExpertTable tab;
  Tiles<BM> tl;
  const int32_t* pair_of;
  const float* weights;
  float* y_slot;
  __device__ int k() const { return tab.d_expert; }
  __device__ int n_col() const { return (tab.d_model + ws::kBN - 1) / ws::kBN; }
  __device__ int n_items() const { return *tl.n_tiles * n_col(); }
  __device__ Item item(int i) const { return tl.item(tab.fc2, n_col(), ws::kBN, i); }
  __device__ int weight_row(const Item& t, int c) const { return t.n0 + c < tab.d_model ? t.n0 + c : -1; }
  __device__ float token_weight(const Item& t, int token) const { return weights[pair_of[t.row0 + token]]; }
  __device__ void store(const float (&acc)[kBM / 2], const Item& t, int ra, int rb, const float* us,
                        const float* wt, float xa, float xb) const {
    const int n = tab.d_model, ca = t.n0 + ra, cb = t.n0 + rb, tq = threadIdx.x & 3;
    const float sa = wsp::row_scale<K>(*t.w, ca < n ? ca : 0) * xa, sb = wsp::row_scale<K>(*t.w, cb < n ? cb : 0) * xb;
    const float* bias = tab.fc2_bias ? tab.fc2_bias + static_cast<int64_t>(t.e) * n : nullptr;
    const float ba = bias && ca < n ? bias[ca] : 0.0f, bb = bias && cb < n ? bias[cb] : 0.0f;
#pragma unroll
    for (int jj = 0; jj < kBM / 8; ++jj) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int token = 8 * jj + 2 * tq + i;
        if (token >= t.rows) continue;
        const float u = us[token], w = wt[token];
        float* y = y_slot + (t.row0 + token) * static_cast<int64_t>(n);
        // The weight multiplies after the bias (formats.md §2.4), as the CPU reference does.
        if (ca < n) y[ca] = w * (acc[4 * jj + i] * u * sa + ba);
        if (cb < n) y[cb] = w * (acc[4 * jj + 2 + i] * u * sb + bb);
      }
    }
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A multiplier warpgroup's k-tiles of one item at wgmma N (gemm_fp4_wsr.cuh k_step). One fragment set: each
// k-tile waits for its own previous wgmmas before decoding; two (kTwoSets): a set per k-tile parity, the
// decode of k-tile kt overlapping the wgmmas of kt - 1 -- with narrow N the wgmmas are short and the decode's
// latency is the larger part of a k-tile.
template <WKind K, int BM, int N, bool kTwoSets>
__device__ __forceinline__ void k_loop(const wsr::Pipe<BM>& p, int& g, int n_kt, int k, int ra, int rb, int oa,
                                       int ob, uint32_t (&f0)[4][4], uint32_t (&f1)[4][4], float (&acc)[BM / 2]) {
  constexpr int S = wsr::Geo<BM>::kStages;
  const int lane = threadIdx.x & 31;
  if constexpr (kTwoSets) {
    for (int kt = 0; kt < n_kt; kt += 2) {
      wsr::k_step<K, BM, N>(p, g, kt, k, ra, rb, oa, ob, false, f0, acc);
      ws::wgmma_wait1();  // k-tile kt - 1's wgmmas are done: f1 and its stage are free
      if (kt > 0 && lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);
      ++g;
      if (kt + 1 >= n_kt) break;  // (a break, not a condition around the odd step: gemm_fp4.cu says why)
      wsr::k_step<K, BM, N>(p, g, kt + 1, k, ra, rb, oa, ob, false, f1, acc);
      ws::wgmma_wait1();
      if (lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);
      ++g;
    }
  } else {
    for (int kt = 0; kt < n_kt; ++kt, ++g) wsr::k_step<K, BM, N>(p, g, kt, k, ra, rb, oa, ob, true, f0, acc);
  }
}
#endif

// a_tiles: the projection's tiled fp16 input (GemmActivations::rs, mp rows), unscale its row scales.
template <WKind K, class Job, bool kTwoSets>
__global__ void __launch_bounds__(wsr::kThreads, 1) moe_wsr_kernel(const __grid_constant__ Job job,
                                                                   const uint8_t* __restrict__ a_tiles,
                                                                   const float* __restrict__ unscale, int64_t mp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Job::kBM, S = wsr::Geo<BM>::kStages, kBlk = K == WKind::kMXFP4 ? 32 : 16;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[2 * S];
  __shared__ float us[2][BM], wt[2][BM];  // the token scales and weights of the current and the previous item
  const int tid = threadIdx.x, k = job.k(), n_kt = (k + ws::kBK - 1) / ws::kBK, n_items = job.n_items();
  const wsr::Pipe<BM> p{smem, bars, bars + S};
  if (tid < S) {
    ws::mbar_init(p.full + tid, 129);  // 128 producer threads' copies + thread 0's byte count
    ws::mbar_init(p.empty + tid, 8);   // one per multiplier warp
  }
  ws::mbar_fence_init();
  __syncthreads();
  if (tid >= 256) {  // the producer: tile row d's codes and scale words, thread 0 the token tile's N rows
    wsr::setmaxnreg_dec<40>();
    const int d = tid - 256;
    for (int i = blockIdx.x, g = 0; i < n_items; i += gridDim.x) {
      const Item t = job.item(i);
      const uint32_t bytes = n_of(t.rows) * ws::kBK * 2;
      const gemm::BRow br = gemm::brow_of(*t.w, job.weight_row(t, d), k, kBlk);
      for (int kt = 0; kt < n_kt; ++kt, ++g) {
        const int s = g % S;
        if (g >= S) ws::mbar_wait(p.empty + s, ((g / S) - 1) & 1);  // the multipliers released it
        ws::fetch_raw<K>(br, kt, k, d, p.raw(s), a_tiles);
        wsr::mbar_arrive_cp_async(p.full + s);
        if (d == 0) {
          ws::mbar_arrive_tx(p.full + s, bytes);
          ws::bulk_copy(p.act(s), a_tiles + (kt * (mp / 8) + t.row0 / 8) * 1024, bytes, p.full + s);
        }
      }
    }
    gemm::cp_async_wait<0>();
    return;
  }
  wsr::setmaxnreg_inc<232>();
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int row_a = wgi * 64 + warp * 16 + (lane >> 2), row_b = row_a + 8;  // tile rows of the lane's fragments
  float acc[BM / 2];
  uint32_t f0[4][4], f1[4][4];
  for (int i = blockIdx.x, it = 0, g = 0; i < n_items; i += gridDim.x, ++it) {
    const Item t = job.item(i);
    // (stored for the epilogue after the k loop)
    const float u = tid < t.rows ? unscale[t.row0 + tid] : 0.0f, w = tid < t.rows ? job.token_weight(t, tid) : 0.0f;
    auto scale_off = [&](int r) {  // the low address bits of a row's scale bytes (fetch_raw copies whole words)
      const gemm::BRow b = gemm::brow_of(*t.w, job.weight_row(t, r), k, kBlk);
      return b.codes ? static_cast<int>(reinterpret_cast<uintptr_t>(b.scales) & 3) : 0;
    };
    const int off_a = scale_off(row_a), off_b = scale_off(row_b);
#pragma unroll
    for (int q = 0; q < BM / 2; ++q) acc[q] = 0.0f;
    switch (n_of(t.rows)) {
      case 16: k_loop<K, BM, 16, kTwoSets>(p, g, n_kt, k, row_a, row_b, off_a, off_b, f0, f1, acc); break;
      case 32: k_loop<K, BM, 32, kTwoSets>(p, g, n_kt, k, row_a, row_b, off_a, off_b, f0, f1, acc); break;
      case 64: k_loop<K, BM, 64, kTwoSets>(p, g, n_kt, k, row_a, row_b, off_a, off_b, f0, f1, acc); break;
      case 96: k_loop<K, BM, 96, kTwoSets>(p, g, n_kt, k, row_a, row_b, off_a, off_b, f0, f1, acc); break;
      case 128: k_loop<K, BM, 128, kTwoSets>(p, g, n_kt, k, row_a, row_b, off_a, off_b, f0, f1, acc); break;
      default:
        if constexpr (BM == 256) k_loop<K, BM, 256, kTwoSets>(p, g, n_kt, k, row_a, row_b, off_a, off_b, f0, f1, acc);
    }
    wg::wgmma_wait0();
    if (lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);  // the item's last stage
    if (tid < BM) us[it & 1][tid] = u, wt[it & 1][tid] = w;
    wsr::multipliers_sync();
    job.store(acc, t, row_a, row_b, us[it & 1], wt[it & 1], 1.0f, 1.0f);
  }
#else
  __trap();  // only the sm_90a build has this tile (moe_wsr says when it runs)
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <WKind K, int BM, int N>
__device__ __forceinline__ void k_loop8(const wsr8::Pipe<BM>& p, int& g, int n_kt, int k, const wsr8::LaneRows& lr,
                                        uint32_t (&frag)[4][4], float (&acc)[BM / 2]) {
  for (int kt = 0; kt < n_kt; ++kt, ++g) wsr8::k_step<K, BM, N>(p, g, kt, k, lr, frag, acc);
}
#endif

// moe_wsr_kernel with E4M3 activations (GemmActivations::fp8) and weights decoded to E4M3 (gemm_fp4_wsr8.cuh):
// 128-wide k-tiles, each row's fold undone in the job's store.
template <WKind K, class Job>
__global__ void __launch_bounds__(wsr8::kThreads, 1) moe_wsr8_kernel(const __grid_constant__ Job job,
                                                                     const uint8_t* __restrict__ a_tiles,
                                                                     const float* __restrict__ unscale, int64_t mp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Job::kBM, S = wsr8::Geo<BM>::kStages, kBlk = K == WKind::kMXFP4 ? 32 : 16;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[2 * S];
  __shared__ float us[2][BM], wt[2][BM];  // the token scales and weights of the current and the previous item
  const int tid = threadIdx.x, k = job.k(), n_kt = (k + wsr8::kBK - 1) / wsr8::kBK, n_items = job.n_items();
  const wsr8::Pipe<BM> p{smem, bars, bars + S};
  if (tid < S) {
    ws::mbar_init(p.full + tid, 129);  // 128 producer threads' copies + thread 0's byte count
    ws::mbar_init(p.empty + tid, 8);   // one per multiplier warp
  }
  ws::mbar_fence_init();
  __syncthreads();
  if (tid >= 256) {  // the producer: tile row d's codes and scale words (two 64-wide halves), thread 0 the N rows
    wsr::setmaxnreg_dec<40>();
    const int d = tid - 256;
    for (int i = blockIdx.x, g = 0; i < n_items; i += gridDim.x) {
      const Item t = job.item(i);
      const uint32_t bytes = n_of(t.rows) * wsr8::kBK;
      const gemm::BRow br = gemm::brow_of(*t.w, job.weight_row(t, d), k, kBlk);
      for (int kt = 0; kt < n_kt; ++kt, ++g) {
        const int s = g % S;
        if (g >= S) ws::mbar_wait(p.empty + s, ((g / S) - 1) & 1);  // the multipliers released it
        ws::fetch_raw<K>(br, 2 * kt, k, d, p.raw(s, 0), a_tiles);
        ws::fetch_raw<K>(br, 2 * kt + 1, k, d, p.raw(s, 1), a_tiles);
        wsr::mbar_arrive_cp_async(p.full + s);
        if (d == 0) {
          ws::mbar_arrive_tx(p.full + s, bytes);
          ws::bulk_copy(p.act(s), a_tiles + (kt * (mp / 8) + t.row0 / 8) * 1024, bytes, p.full + s);
        }
      }
    }
    gemm::cp_async_wait<0>();
    return;
  }
  wsr::setmaxnreg_inc<232>();
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  wsr8::LaneRows lr;
  lr.row_a = wgi * 64 + warp * 16 + (lane >> 2), lr.row_b = lr.row_a + 8;
  float acc[BM / 2];
  uint32_t frag[4][4];
  for (int i = blockIdx.x, it = 0, g = 0; i < n_items; i += gridDim.x, ++it) {
    const Item t = job.item(i);
    // (stored for the epilogue after the k loop)
    const float u = tid < t.rows ? unscale[t.row0 + tid] : 0.0f, w = tid < t.rows ? job.token_weight(t, tid) : 0.0f;
    const gemm::BRow ba = gemm::brow_of(*t.w, job.weight_row(t, lr.row_a), k, kBlk);
    const gemm::BRow bb = gemm::brow_of(*t.w, job.weight_row(t, lr.row_b), k, kBlk);
    lr.off_a = ba.codes ? static_cast<int>(reinterpret_cast<uintptr_t>(ba.scales) & 3) : 0;
    lr.off_b = bb.codes ? static_cast<int>(reinterpret_cast<uintptr_t>(bb.scales) & 3) : 0;
    lr.c_a = wsr8::row_fold<K>(ba.scales, k / kBlk, lane & 3);
    lr.c_b = wsr8::row_fold<K>(bb.scales, k / kBlk, lane & 3);
#pragma unroll
    for (int q = 0; q < BM / 2; ++q) acc[q] = 0.0f;
    switch (n_of(t.rows)) {
      case 16: k_loop8<K, BM, 16>(p, g, n_kt, k, lr, frag, acc); break;
      case 32: k_loop8<K, BM, 32>(p, g, n_kt, k, lr, frag, acc); break;
      case 64: k_loop8<K, BM, 64>(p, g, n_kt, k, lr, frag, acc); break;
      case 96: k_loop8<K, BM, 96>(p, g, n_kt, k, lr, frag, acc); break;
      case 128: k_loop8<K, BM, 128>(p, g, n_kt, k, lr, frag, acc); break;
      default:
        if constexpr (BM == 256) k_loop8<K, BM, 256>(p, g, n_kt, k, lr, frag, acc);
    }
    wg::wgmma_wait0();
    if (lane == 0) ws::mbar_arrive(p.empty + (g - 1) % S);  // the item's last stage
    if (tid < BM) us[it & 1][tid] = u, wt[it & 1][tid] = w;
    wsr::multipliers_sync();
    // The rows' folds undone (NVFP4: row_scale's 2^8 is decode_half's, not this tile's).
    const int extra = K == WKind::kNVFP4 ? 8 : 0;
    job.store(acc, t, lr.row_a, lr.row_b, us[it & 1], wt[it & 1], ldexpf(1.0f, -lr.c_a - extra),
              ldexpf(1.0f, -lr.c_b - extra));
  }
#else
  __trap();  // only the sm_90a build has this tile (moe_wsr says when it runs)
#endif
}

template <WKind K, class Job>
void launch8(const Job& job, int64_t max_items, const GemmActivations& a, cudaStream_t s) {
  auto kernel = moe_wsr8_kernel<K, Job>;
  constexpr int smem = wsr8::Geo<Job::kBM>::kSmem;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int blocks = static_cast<int>(std::min<int64_t>(max_items, gemm_sm_count()));
  kernel<<<blocks, wsr8::kThreads, smem, s>>>(job, reinterpret_cast<const uint8_t*>(a.hi), a.unscale, a.mp);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K, class Job>
void launch(const Job& job, int64_t max_items, const GemmActivations& a, cudaStream_t s) {
  // NIBBLE_MOE_WSR=2: two fragment sets (measurement; see k_loop).
  static const bool two_sets = [] {
    const char* e = std::getenv("NIBBLE_MOE_WSR");
    return e && e[0] == '2';
  }();
  auto kernel = two_sets ? moe_wsr_kernel<K, Job, true> : moe_wsr_kernel<K, Job, false>;
  constexpr int smem = wsr::Geo<Job::kBM>::kSmem;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int blocks = static_cast<int>(std::min<int64_t>(max_items, gemm_sm_count()));
  kernel<<<blocks, wsr::kThreads, smem, s>>>(job, reinterpret_cast<const uint8_t*>(a.hi), a.unscale, a.mp);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace wsrm

// gpt-oss's clamped SwiGLU is bounded (|glu| <= limit (limit + 1) = 56), so its output can go to fp16 at a
// fixed 2^10 straight from the FC1 epilogue instead of through fp32 and launch_gemm_activations' per-row
// prescale: 56 * 2^10 fits fp16, and every value above 2^-24 (fp16's normal range 2^-14, over 2^10) keeps
// all 11 significant bits, as with the per-row prescale. d_expert whole k-tiles: FC2's input has no k pad.
bool fc1_writes_fp16(const ExpertTable& t, Glu glu, float limit) {
  return (glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves) && limit > 0.0f &&
         limit * (limit + 1.0f) * 1024.0f < 65504.0f && t.d_expert % wg::kBK == 0;
}

template <WKind K, int BM>
void projections_wsr(const ExpertTable& t, const float* weights, int64_t n_pairs, Glu glu, float limit,
                     const MoeGemmScratch& ws, cudaStream_t s) {
  const int64_t max_tiles = moe_gemm_max_tiles(n_pairs, t.n_experts);
  const wsrm::Tiles<BM> tl{ws.tiles, ws.n_tiles, ws.offsets, ws.counts};
  const bool direct = fc1_writes_fp16(t, glu, limit);
  wsrm::launch<K>(wsrm::Fc1Job<K, BM>{t, tl, glu, limit, ws.act, direct ? ws.a : GemmActivations{}},
                  max_tiles * ceil_div(t.d_expert, ws::kBN / 2), ws.x, s);
  if (!direct) {
    launch_gemm_activations(ws.act, nullptr, 1, wsrm::slots_for(n_pairs, t.n_experts), t.d_expert, GemmActs::kFp16,
                            ws.a, s);
  }
  wsrm::launch<K>(wsrm::Fc2Job<K, BM>{t, tl, ws.pair_of, weights, ws.y_slot}, max_tiles * ceil_div(t.d_model, ws::kBN),
                  ws.a, s);
}

// The FP8 form: FC1 (+ bias + GLU) into fp32, FC2's input rounded to E4M3 per row, FC2.
template <WKind K, int BM>
void projections_wsr8(const ExpertTable& t, const float* weights, int64_t n_pairs, Glu glu, float limit,
                      const MoeGemmScratch& ws, cudaStream_t s) {
  const int64_t max_tiles = moe_gemm_max_tiles(n_pairs, t.n_experts);
  const wsrm::Tiles<BM> tl{ws.tiles, ws.n_tiles, ws.offsets, ws.counts};
  wsrm::launch8<K>(wsrm::Fc1Job<K, BM>{t, tl, glu, limit, ws.act, GemmActivations{}},
                   max_tiles * ceil_div(t.d_expert, ws::kBN / 2), ws.x, s);
  launch_gemm_activations(ws.act, nullptr, 1, wsrm::slots_for(n_pairs, t.n_experts), t.d_expert, GemmActs::kFp8,
                          ws.a, s);
  wsrm::launch8<K>(wsrm::Fc2Job<K, BM>{t, tl, ws.pair_of, weights, ws.y_slot},
                   max_tiles * ceil_div(t.d_model, ws::kBN), ws.a, s);
}

template <WKind K>
void projections_wsp(const ExpertTable& t, const float* weights, int64_t n_pairs, Glu glu, float limit,
                     const MoeGemmScratch& ws, cudaStream_t s) {
  const int64_t max_tiles = moe_gemm_max_tiles(n_pairs, t.n_experts);
  const WspTiles tl{ws.tiles, ws.n_tiles, ws.offsets};
  wsp::launch<K>(WspFc1Job<K>{t, tl, glu, limit, ws.act}, t.d_model,
                 max_tiles * ceil_div(t.d_expert, wsp::kBN / 2), ws.x, s);
  launch_gemm_activations(ws.act, nullptr, 1, n_pairs, t.d_expert, GemmActs::kFp16, ws.a, s);
  wsp::launch<K>(WspFc2Job<K>{t, tl, ws.pair_of, weights, ws.y_slot}, t.d_expert,
                 max_tiles * ceil_div(t.d_model, wsp::kBN), ws.a, s);
}

template <WKind K, bool kSplit, int kBM>
void projections_wgmma(const ExpertTable& t, const float* weights, int64_t n_pairs, Glu glu, float limit,
                       const MoeGemmScratch& ws, cudaStream_t s) {
  constexpr int smem = wg::Tile<kBM, kSplit>::kSmem;
  const unsigned max_tiles = static_cast<unsigned>(moe_gemm_max_tiles(n_pairs, t.n_experts));
  const bool direct = fc1_writes_fp16(t, glu, limit);
  auto fc1 = fc1_wgmma_kernel<K, kSplit, kBM>;
  CUDA_CHECK(cudaFuncSetAttribute(fc1, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  fc1<<<dim3(ceil_div(t.d_expert, wg::kBN / 2), max_tiles), wg::kThreads, smem, s>>>(
      t, ws.tiles, ws.n_tiles, ws.offsets, ws.x, glu, limit, ws.act, direct ? ws.a : GemmActivations{});
  CUDA_CHECK(cudaGetLastError());
  const GemmActs mode = kSplit ? GemmActs::kSplit : GemmActs::kFp16;
  if (!direct) launch_gemm_activations(ws.act, nullptr, 1, n_pairs, t.d_expert, mode, ws.a, s);
  auto fc2 = fc2_wgmma_kernel<K, kSplit, kBM>;
  CUDA_CHECK(cudaFuncSetAttribute(fc2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  fc2<<<dim3(ceil_div(t.d_model, wg::kBN), max_tiles), wg::kThreads, smem, s>>>(t, ws.tiles, ws.n_tiles, ws.offsets,
                                                                               ws.pair_of, weights, ws.a, ws.y_slot);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K, bool kSplit, int kBM, bool kPf = false, int kW = gemm::kWarps>
void projections(const ExpertTable& t, const float* weights, int64_t n_pairs, Glu glu, float limit,
                 const MoeGemmScratch& ws, cudaStream_t s) {
  using T = gemm::Tile<kBM, kSplit, kPf, kW>;
  constexpr int smem = T::kSmem;
  const unsigned max_tiles = static_cast<unsigned>(moe_gemm_max_tiles(n_pairs, t.n_experts));
  auto fc1 = fc1_kernel<K, kSplit, kBM, kPf, kW>;
  CUDA_CHECK(cudaFuncSetAttribute(fc1, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CUDA_CHECK(cudaFuncSetAttribute(fc1, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  fc1<<<dim3(ceil_div(t.d_expert, kBN / 2), max_tiles), T::kThreadsT, smem, s>>>(t, ws.tiles, ws.n_tiles, ws.offsets,
                                                                                ws.x, glu, limit, ws.act);
  CUDA_CHECK(cudaGetLastError());
  const GemmActs mode = kSplit ? GemmActs::kSplit : GemmActs::kFp16;
  launch_gemm_activations(ws.act, nullptr, 1, n_pairs, t.d_expert, mode, ws.a, s);
  auto fc2 = fc2_kernel<K, kSplit, kBM, kPf, kW>;
  CUDA_CHECK(cudaFuncSetAttribute(fc2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CUDA_CHECK(cudaFuncSetAttribute(fc2, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  fc2<<<dim3(ceil_div(t.d_model, kBN), max_tiles), T::kThreadsT, smem, s>>>(t, ws.tiles, ws.n_tiles, ws.offsets,
                                                                           ws.pair_of, weights, ws.a, ws.y_slot);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool moe_gemm_supports(const ExpertTable& t) {
  return (t.kind == WKind::kMXFP4 || t.kind == WKind::kNVFP4) && t.d_model % 32 == 0 && t.d_expert % 32 == 0 &&
         t.n_experts >= 1 && t.n_experts <= kMaxExperts;
}

int64_t moe_gemm_max_tiles(int64_t n_pairs, int n_experts) { return (n_pairs + kMinBM - 1) / kMinBM + n_experts; }

namespace {

// NIBBLE_MOE_VARIANT (measurement knob; unset: -1, the choice below) forces the portable block tiles: 0 =
// 64-row tiles, 1 = 128-row tiles, 2 = 64 + fragment prefetch, 3 = 128 with 4 warps of 64 x 64.
int moe_variant() {
  static const int variant = [] {
    const char* v = std::getenv("NIBBLE_MOE_VARIANT");
    return v ? std::atoi(v) : -1;
  }();
  return variant;
}

// Whether the projections run on the portable warp-specialized tile: one fp16 off sm_90a, from 128 rows per
// expert on average (a full token tile each), unless NIBBLE_MOE_VARIANT picks a block tile. Fewer rows keep
// the block tile, which skips a tile's empty m16 rows. H200 with NIBBLE_WGMMA=0 (bench/NOTES.md,
// twenty-second session): 256 and more rows per expert 1-5 % faster; 64 mixed (gpt-oss-20b at 512 tokens
// -2 %, 120b at 2048 neutral, its pp2048 -1 %); 16 (120b at 512 tokens) 2085 us on 64-row block tiles, 2749 on
// this one. Its activations are tiled, with rows to spare for a token tile that starts at the last slot.
bool moe_wsp(GemmActs mode, int64_t n_pairs, int n_experts) {
  return mode == GemmActs::kFp16 && !gemm_wgmma() && moe_variant() < 0 &&
         n_pairs >= wsp::kBM * static_cast<int64_t>(n_experts);
}
int64_t tiled_rows(int64_t n_pairs) { return n_pairs + wsp::kBM - 1; }

// Whether the projections run on the sm_90a register-fragment tile (wsrm): one fp16 on an sm_90a GPU, by default
// where the experts average >= 192 rows (its 256-token tiles); NIBBLE_MOE_WSR=0 never, 1 always (2: always, two
// fragment sets), unless NIBBLE_MOE_VARIANT picks a block tile. H200, MXFP4 gpt-oss layers, one call (bench/NOTES.md,
// twenty-eighth session): 256-token tiles 12-20 % faster than the wgmma block tiles (20b M = 2048 1477 -> 1304 us,
// 8192 5155 -> 4104; 120b 8192 5634 -> 4921), 128-token tiles up to 42 % slower (120b M = 512 and 2048).
bool moe_wsr(GemmActs mode, int64_t n_pairs, int n_experts) {
  static const int setting = [] {
    const char* e = std::getenv("NIBBLE_MOE_WSR");
    return e && e[0] >= '0' && e[0] <= '2' ? e[0] - '0' : -1;
  }();
  if (mode == GemmActs::kFp8) return true;  // (its only tile)
  if (setting == 0 || mode != GemmActs::kFp16 || !gemm_wgmma() || moe_variant() >= 0) return false;
  return setting > 0 || n_pairs >= wsrm::kBigRows * static_cast<int64_t>(n_experts);
}

}  // namespace

// One layout for both functions: `take` hands out consecutive 256-byte aligned pieces.
template <class Take>
MoeGemmScratch moe_scratch_layout(const ExpertTable& t, int64_t n_pairs, GemmActs mode, Take&& take) {
  MoeGemmScratch ws;
  const bool rs = moe_wsr(mode, n_pairs, t.n_experts), tiled = rs || moe_wsp(mode, n_pairs, t.n_experts);
  // Slots: one per pair, or with the register-fragment tile each expert's rounded up to whole 8-row groups;
  // the tiled activations hold a token tile more (a tile's copy may start at the last slot).
  const int64_t slots = rs ? wsrm::slots_for(n_pairs, t.n_experts) : n_pairs;
  const int64_t rows = rs ? slots + wsrm::kMaxBM : tiled ? tiled_rows(n_pairs) : n_pairs;
  ws.tiles = static_cast<int2*>(take(moe_gemm_max_tiles(n_pairs, t.n_experts) * 8));
  ws.offsets = static_cast<int32_t*>(take((t.n_experts + 1) * 4));
  ws.counts = static_cast<int32_t*>(take(t.n_experts * 4));
  ws.n_tiles = static_cast<int32_t*>(take(4));
  ws.slot_of = static_cast<int32_t*>(take(n_pairs * 4));
  ws.pair_of = static_cast<int32_t*>(take(slots * 4));
  ws.x = gemm_activations_in(take(gemm_activations_bytes(rows, t.d_model, mode, tiled)), rows, t.d_model,
                             mode, tiled);
  ws.act = static_cast<float*>(take(slots * t.d_expert * 4));
  ws.a = gemm_activations_in(take(gemm_activations_bytes(rows, t.d_expert, mode, tiled)), rows, t.d_expert,
                             mode, tiled);
  ws.x.rs = ws.a.rs = rs ? 1 : 0;  // the wgmma tile's k order inside each k-tile
  ws.y_slot = static_cast<float*>(take(slots * t.d_model * 4));
  return ws;
}

int64_t moe_gemm_scratch_bytes(const ExpertTable& t, int64_t n_pairs, GemmActs mode) {
  int64_t total = 0;
  moe_scratch_layout(t, n_pairs, mode, [&](int64_t bytes) -> void* {
    total += (bytes + 255) / 256 * 256;
    return nullptr;
  });
  return total;
}

MoeGemmScratch moe_gemm_scratch_in(void* buf, const ExpertTable& t, int64_t n_pairs, GemmActs mode) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  return moe_scratch_layout(t, n_pairs, mode, [&](int64_t bytes) -> void* {
    void* q = p;
    p += (bytes + 255) / 256 * 256;
    return q;
  });
}

void launch_moe_gemm(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                     const float* x, Glu glu, float limit, GemmActs mode, const MoeGemmScratch& ws, float* y,
                     cudaStream_t s) {
  NB_CHECK(moe_gemm_supports(t), "moe_gemm: needs MXFP4/NVFP4 experts with d_model, d_expert % 32 == 0");
  const int64_t n_pairs = n_tokens * top_k;
  NB_CHECK(n_tokens >= 1 && top_k >= 1 && moe_gemm_max_tiles(n_pairs, t.n_experts) <= 65535,
           "moe_gemm: " + std::to_string(n_tokens) + " tokens x top_k " + std::to_string(top_k));
  // Tile rows per expert block (portable block tiles): 128 when the experts average >= 128 rows (hi + lo) or
  // >= 64 (one fp16), else 64 (measured, NOTES.md: hi + lo at M = 2048 went 125 -> 138 TFLOP/s on
  // gpt-oss-20b). NIBBLE_MOE_VARIANT 2 and 3 measured slower (114 / 112 TFLOP/s on 20b). The warp-specialized
  // tile: 128.
  const bool split = mode == GemmActs::kSplit, wsr_tile = moe_wsr(mode, n_pairs, t.n_experts),
             wsp_tile = !wsr_tile && moe_wsp(mode, n_pairs, t.n_experts);
  int var = moe_variant();
  // (2 and 3 exist for hi + lo MXFP4 only; elsewhere the knob picks the tile height: 1 or 3 = 128 rows.)
  // One fp16: 128-row tiles from 64 rows per expert on average, as the wgmma tile (most experts then take one
  // tile instead of a full one and a nearly empty one that decodes the whole weight again: 120b M = 2048 on an
  // H100, 3170 -> 2937 us); hi + lo from 128 (its 128-row tiles hold twice the MMAs per decode: measured slower
  // at 64 rows per expert, 3660 -> 3917 us).
  const int64_t per_expert = split ? 128 : 64;
  if (var < 0) var = n_pairs >= per_expert * static_cast<int64_t>(t.n_experts) ? 1 : 0;
  // wgmma: 128-row tiles from 64 rows per expert on average (the tile's wgmmas are as wide as its rows, so
  // an expert with fewer costs no extra MMAs, and most experts then take one tile instead of two).
  const int bm = wsr_tile ? wsrm::bm_for(n_pairs, t.n_experts)
                 : ws.x.wgmma ? (!split && n_pairs >= 64 * static_cast<int64_t>(t.n_experts) ? 128 : 64)
                 : wsp_tile ? wsp::kBM
                 : var == 1 || var == 3 ? 128
                                        : 64;
  const int64_t slots = wsr_tile ? wsrm::slots_for(n_pairs, t.n_experts) : n_pairs;
  group_kernel<<<1, 1024, 2 * t.n_experts * sizeof(int32_t), s>>>(
      ids, static_cast<int>(n_pairs), t.n_experts, bm, wsr_tile ? wsrm::kAlign : 1, static_cast<int>(slots),
      ws.offsets, ws.slot_of, ws.pair_of, ws.tiles, ws.n_tiles, ws.counts);
  CUDA_CHECK(cudaGetLastError());
  // The tokens' rows gathered into slot order as fp16: slot s reads token pair_of[s] / top_k (pad slots none).
  launch_gemm_activations(x, ws.pair_of, top_k, slots, t.d_model, mode, ws.x, s);
  if (mode == GemmActs::kFp8) {
    const bool mx = t.kind == WKind::kMXFP4;
    if (bm == 256) {
      mx ? projections_wsr8<WKind::kMXFP4, 256>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wsr8<WKind::kNVFP4, 256>(t, weights, n_pairs, glu, limit, ws, s);
    } else {
      mx ? projections_wsr8<WKind::kMXFP4, 128>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wsr8<WKind::kNVFP4, 128>(t, weights, n_pairs, glu, limit, ws, s);
    }
  } else if (wsr_tile) {
    const bool mx = t.kind == WKind::kMXFP4;
    if (bm == 256) {
      mx ? projections_wsr<WKind::kMXFP4, 256>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wsr<WKind::kNVFP4, 256>(t, weights, n_pairs, glu, limit, ws, s);
    } else {
      mx ? projections_wsr<WKind::kMXFP4, 128>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wsr<WKind::kNVFP4, 128>(t, weights, n_pairs, glu, limit, ws, s);
    }
  } else if (wsp_tile) {
    t.kind == WKind::kMXFP4 ? projections_wsp<WKind::kMXFP4>(t, weights, n_pairs, glu, limit, ws, s)
                            : projections_wsp<WKind::kNVFP4>(t, weights, n_pairs, glu, limit, ws, s);
  } else if (ws.x.wgmma) {  // sm_90a: hi + lo on 64-token tiles, one fp16 on 64 or 128 as above
    const bool mx = t.kind == WKind::kMXFP4;
    if (split) {
      mx ? projections_wgmma<WKind::kMXFP4, true, 64>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wgmma<WKind::kNVFP4, true, 64>(t, weights, n_pairs, glu, limit, ws, s);
    } else if (bm == 128) {
      mx ? projections_wgmma<WKind::kMXFP4, false, 128>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wgmma<WKind::kNVFP4, false, 128>(t, weights, n_pairs, glu, limit, ws, s);
    } else {
      mx ? projections_wgmma<WKind::kMXFP4, false, 64>(t, weights, n_pairs, glu, limit, ws, s)
         : projections_wgmma<WKind::kNVFP4, false, 64>(t, weights, n_pairs, glu, limit, ws, s);
    }
  } else if (t.kind == WKind::kMXFP4) {
    if (split) {
      switch (var) {
        case 1: projections<WKind::kMXFP4, true, 128, false>(t, weights, n_pairs, glu, limit, ws, s); break;
        case 2: projections<WKind::kMXFP4, true, 64, true>(t, weights, n_pairs, glu, limit, ws, s); break;
        case 3: projections<WKind::kMXFP4, true, 128, false, 4>(t, weights, n_pairs, glu, limit, ws, s); break;
        default: projections<WKind::kMXFP4, true, 64, false>(t, weights, n_pairs, glu, limit, ws, s);
      }
    } else {
      bm == 128 ? projections<WKind::kMXFP4, false, 128, false>(t, weights, n_pairs, glu, limit, ws, s)
                : projections<WKind::kMXFP4, false, 64, false>(t, weights, n_pairs, glu, limit, ws, s);
    }
  } else {
    if (split) {
      bm == 128 ? projections<WKind::kNVFP4, true, 128, false>(t, weights, n_pairs, glu, limit, ws, s)
                : projections<WKind::kNVFP4, true, 64, false>(t, weights, n_pairs, glu, limit, ws, s);
    } else {
      bm == 128 ? projections<WKind::kNVFP4, false, 128, false>(t, weights, n_pairs, glu, limit, ws, s)
                : projections<WKind::kNVFP4, false, 64, false>(t, weights, n_pairs, glu, limit, ws, s);
    }
  }
  launch_moe_combine(ws.y_slot, ws.slot_of, nullptr, n_tokens, top_k, t.d_model, y, s);  // (weights applied by FC2)
}

void launch_moe_glu(const float* h, int64_t rows, int d_expert, Glu glu, float limit, float* act, cudaStream_t s) {
  if (rows == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(rows * d_expert, int64_t{256}), 4096));
  moe_glu_kernel<<<blocks, 256, 0, s>>>(h, rows, d_expert, glu, limit, act);
  CUDA_CHECK(cudaGetLastError());
}

void launch_moe_combine(const float* y_slot, const int32_t* slot_of, const float* weights, int64_t n_tokens,
                        int top_k, int n, float* y, cudaStream_t s) {
  NB_CHECK(n % 4 == 0, "moe combine: n = " + std::to_string(n) + " is not a multiple of 4");
  const int64_t quads = n_tokens * (n / 4);
  if (quads == 0) return;
  combine_kernel<<<ceil_div(quads, int64_t{256}), 256, 0, s>>>(y_slot, slot_of, weights, static_cast<int>(n_tokens),
                                                                top_k, n, y);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
