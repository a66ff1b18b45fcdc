// The portable warp-specialized, persistent tile of the prefill FP4 GEMMs (dense, and the MoE's grouped ones
// in moe_gemm.cu): y[tokens, weight rows] = A x W^T with W in MXFP4/NVFP4 as the checkpoint stores it, on
// mma.sync m16n8k16 with both operands read from shared memory by ldmatrix. sm_80-era instructions (cp.async,
// ldmatrix, mma.sync, mbarrier) plus mbarrier.try_wait (every arch this project builds: sm_90a, sm_120a,
// sm_121a), so GB10 runs it.
//
// Why a second portable tile. The block tile (gemm_fp4_tile.cuh) has every warp decode a share of the next
// weight tile between its MMAs and meet a block barrier per k-step: with 4 warps per scheduler, each waiting
// on its ldmatrix results and on the barrier, its issue slots were 37 % busy and a scheduler issued one HMMA
// per ~18 cycles where mma.sync's peak is one per ~7 (bench/NOTES.md, fourteenth session). Here the roles are
// split, as in the sm_90a warp-specialized tile (gemm_fp4_ws.cuh, whose decoder and activation layout this
// tile shares):
//   the decoder (warps 8-11): a thread owns one of the block's 128 weight rows; per k-tile it waits until the
//     stage is free (`empty`), starts its eighth of the stage's activation tile (128 tokens x 64 fp16,
//     16 KiB, contiguous in the tiled layout) with cp.async, whose completion arrives on `full`, decodes its
//     row's 64 codes (copied into a shared-memory ring R k-tiles ahead, ws::fetch_raw) into the stage's fp16
//     weight tile and arrives on `full` again;
//   eight multiplier warps (0-7), 2 x 4 of 64 weight rows x 32 tokens: per k-tile they wait on `full`, run
//     4 k16 slices of 16 mma.sync each from ldmatrix fragments (the next slice's fragments read during the
//     current slice's MMAs) and release the stage (`empty`). No block barrier in the loop.
//   Persistent: one block per SM walks its tiles; the rings run on across them, so the decoder fills the next
//   tile's stages while the multipliers store the last one.
// 12 warps, three per scheduler (two multipliers and a decoder), 152 registers at most: the registers are
// allocated per scheduler, so a 13th warp (say, a separate activation copier) would leave 128. Four
// multiplier warps of 64 x 64 (half the ldmatrix per MMA, 222 registers, one multiplier per scheduler)
// measured within 1 % on the H200 (bench/NOTES.md, twenty-second session): with one multiplier per scheduler
// its HMMAs mostly waited on their fixed issue latency (ncu: stall `wait`).
// Shared memory: both operands in the core-matrix layout of gemm_fp4_ws.cuh (row r, 16-byte chunk c at
// (r / 8) * 1024 + c * 128 + (r % 8) * 16), which ldmatrix reads without bank conflicts (each 8 x 8 matrix is
// 128 contiguous bytes). The k order inside a chunk is 0 4 1 5 2 6 3 7 on both operands, so the sums are the
// same. One block per SM: 4 stages of 32 KiB on sm_90 (228 KiB per SM), 2 on sm_12x (GB10: 99 KiB per block).
#pragma once

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "kernels/gemm_fp4.cuh"
#include "kernels/gemm_fp4_ws.cuh"

namespace nb::cuda::wsp {

constexpr int kBN = 128;  // weight rows per block (== ws::kBN: the decoder's rows)
constexpr int kBM = 128;  // tokens per block
constexpr int kBK = 64;   // k per stage (== ws::kBK)
// Multiplier warps: a 2 x kWarpsN grid of 64 weight rows (kMT = 4 m16 tiles) x kWarpTokens tokens (kNT n8
// tiles, kNP pairs of them).
constexpr int kMulWarps = 8;
constexpr int kWarpsN = kMulWarps / 2, kWarpTokens = kBM / kWarpsN;
constexpr int kMT = 4, kNT = kWarpTokens / 8, kNP = kNT / 2;
constexpr int kMulThreads = kMulWarps * 32, kDecThreads = 128;
constexpr int kThreads = kMulThreads + kDecThreads;
using Acc = float[kMT][kNT][4];         // mma C fragments: [m16 tile][n8 tile][4]
constexpr int kABytes = kBM * kBK * 2;  // 16 KiB of fp16 activations per stage
constexpr int kWBytes = kBN * kBK * 2;  // 16 KiB of decoded fp16 weights per stage
constexpr int kStageBytes = kABytes + kWBytes;
static_assert(kBN == ws::kBN && kBK == ws::kBK, "the decoder and its ring are the sm_90a tile's");

// Dynamic shared memory for S stages and a code ring of R slots.
constexpr int smem_bytes(int stages, int ring) { return stages * kStageBytes + ring * ws::kRawBytes; }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t b) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared.b64 st, [%0];\n}\n" ::"r"(b) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) { mbar_arrive(smem_u32(b)); }
// One arrival, triggered when every cp.async this thread issued before it has completed.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
// try_wait (not sm_80's test_wait): the waiting warp is suspended in hardware, so a decoder waiting for a
// free stage leaves the issue slots to the multipliers.
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}

// The block's shared state: S stages, each [activations 16 KiB][decoded weights 16 KiB], with a `full`
// barrier (128 decoder arrivals after the decode + 128 when each decoder thread's activation copies land) and
// an `empty` one (256 multiplier arrivals); the decoder's code ring (R slots after the stages); and the token
// scales of the block's last S + 1 items (written by the decoder before its first `full` arrival of an item,
// read by the multipliers' epilogue: the decoder runs at most S k-tiles ahead of the releases, so it cannot
// reach an item S + 1 items later before that epilogue is done).
template <int S>
struct Pipe {
  static constexpr int kFullCount = 2 * kDecThreads, kEmptyCount = kMulThreads;
  uint8_t* smem;
  uint64_t* full;
  uint64_t* empty;
  float* unscale;  // [S + 1][kBM]
  __device__ uint8_t* act(int s) const { return smem + s * kStageBytes; }
  __device__ uint8_t* wts(int s) const { return smem + s * kStageBytes + kABytes; }
  __device__ uint8_t* raw(int j) const { return smem + S * kStageBytes + j * ws::kRawBytes; }
  __device__ float* tile_unscale(int it) const { return unscale + (it % (S + 1)) * kBM; }
};

// Stage and phase of the block's k-tile g (S a power of two: masks and shifts).
template <int S>
__device__ __forceinline__ int stage_of(int g) {
  return static_cast<int>(static_cast<unsigned>(g) % S);
}
template <int S>
__device__ __forceinline__ uint32_t phase_of(int g) {
  return (static_cast<unsigned>(g) / S) & 1u;
}

// A block's unit of work: a weight tile of kBN rows of *w (which rows: the job's weight_row) times the token
// rows [row0, row0 + rows) (rows <= kBM) of the tiled activations. A Job (the dense GEMM below, the MoE
// projections in moe_gemm.cu) says what the persistent blocks walk: block b takes items b, b + gridDim.x, ...
//   int k() const                                   every item's k
//   int n_items() const
//   Item item(int i) const
//   int weight_row(const Item&, int c) const        the weight row tile row c decodes (-1: none, zeros)
//   void store(const Acc&, const Item&, const float* us) const   a multiplier's epilogue (us: token scales)
struct Item {
  const DevWeight* w = nullptr;  // null: past the schedule
  int n0 = 0;                    // the job's column coordinate (the dense GEMM: the first weight row)
  int64_t row0 = 0;
  int rows = 0;
  int e = 0;  // the expert (MoE)
};

// The i-th item of this block's walk, or an empty one past the job's items.
template <class Job>
__device__ __forceinline__ Item item_at(const Job& job, int n_items, int it) {
  const int i = blockIdx.x + it * gridDim.x;
  return i < n_items ? job.item(i) : Item{};
}

// The decoder (d = threadIdx.x - kMulThreads: tile row d): for every k-tile of the block's walk, wait until
// its stage is free, copy chunks d + 128 i of the stage's activation tile (the tiled activations a_tiles, mp
// rows), decode the row's 64 codes into the stage and arrive on `full`; at an item's first k-tile also write
// its token scales (unscale: the activations' row scales). Each k-tile's codes were copied R k-tiles earlier
// (R divides n_kt, so slot kt % R of an item is slot kt % R of the next one and every slot index is a
// compile-time constant). The activation copies' arrival also waits for the ring refills this thread issued
// before them (a cp.async arrival covers all of its earlier copies): one k-tile's refill, long landed by the
// time the multipliers, S k-tiles behind, reach the stage.
// Tile row r, chunk c of the stage is ws::chunk_of(row0 + r, kt, c, mp): this thread's chunks d + 128 i are
// rows R0 + 16 i (R0 = row0 + 8 (d / 64) + d % 8) at chunk (d / 8) % 8, i.e. 2048 i bytes after the first,
// whatever row0's alignment (the MoE's experts start at any row; rows up to row0 + 127 must exist: mp covers
// them).
template <WKind K, int R, int S, class Job>
__device__ __forceinline__ void decoder(const Pipe<S>& p, const Job& job, const uint8_t* a_tiles, int64_t mp,
                                        const float* __restrict__ unscale) {
  static_assert(R <= ws::kMaxRing);
  constexpr int kBlk = K == WKind::kMXFP4 ? 32 : 16;
  const int d = threadIdx.x - kMulThreads, k = job.k(), n_kt = (k + kBK - 1) / kBK, n_items = job.n_items();
  auto brow = [&](const Item& t) {
    const int row = t.w ? job.weight_row(t, d) : -1;
    return row >= 0 ? gemm::brow_of(*t.w, row, k, kBlk) : gemm::BRow{};
  };
  const int slot = (d >> 3) * 1024 + (d & 7) * 16;  // this row's first chunk in a weight tile
  Item cur = item_at(job, n_items, 0), next = item_at(job, n_items, 1);
  gemm::BRow br = brow(cur), br_next = brow(next);
#pragma unroll
  for (int j = 0; j < R; ++j) {
    ws::fetch_raw<K>(br, j, k, d, p.raw(j), a_tiles);
    gemm::cp_async_commit();
  }
  for (int it = 0, g = 0; cur.w; ++it) {
    const int64_t r0 = cur.row0 + (d >> 6) * 8 + (d & 7);
    const uint8_t* a_tile =
        a_tiles + ((r0 >> 3) * 64 + ((d >> 3) & 7) * 8 + (r0 & 7)) * 16;  // + kt * mp * 128
    for (int kt0 = 0; kt0 < n_kt; kt0 += R) {
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int kt = kt0 + j, s = stage_of<S>(g);
        if (g >= S) mbar_wait(p.empty + s, phase_of<S>(g) ^ 1u);  // the multipliers released it
        const uint8_t* src = a_tile + kt * mp * 128;
#pragma unroll
        for (int i = 0; i < kABytes / (16 * kDecThreads); ++i) {
          gemm::cp_async16(p.act(s) + d * 16 + i * 16 * kDecThreads, src + i * 16 * kDecThreads, true);
        }
        mbar_arrive_cp_async(p.full + s);
        if (kt == 0) p.tile_unscale(it)[d] = d < cur.rows ? unscale[cur.row0 + d] : 0.0f;
        // This thread's copies of k-tile kt have landed (the R - 1 later groups may still be in flight).
        gemm::cp_async_wait<R - 1>();
        ws::decode_k_tile<K>(p.raw(j), d, br, kt, k, p.wts(s) + slot);
        mbar_arrive(p.full + s);  // (release: the multipliers' ldmatrix after their wait sees the stores)
        // Refill the slot R k-tiles ahead: this item's k-tile kt + R, or the next item's kt + R - n_kt.
        if (kt + R < n_kt)
          ws::fetch_raw<K>(br, kt + R, k, d, p.raw(j), a_tiles);
        else
          ws::fetch_raw<K>(br_next, kt + R - n_kt, k, d, p.raw(j), a_tiles);
        gemm::cp_async_commit();
        ++g;
      }
    }
    cur = next;
    br = br_next;
    next = item_at(job, n_items, it + 2);
    br_next = brow(next);
  }
  gemm::cp_async_wait<0>();
}

// A multiplier warp's fragments of one k16 slice: A (its 64 weight rows: 4 m16 tiles) and B (its 32 tokens:
// 4 n8 tiles, two per ldmatrix.x4).
struct Frags {
  uint32_t a[kMT][4];
  uint32_t b[kNP][4];  // [n8 pair][b0, b1 of tile 2 jj, b0, b1 of tile 2 jj + 1]
};

// off_a / off_b: this lane's ldmatrix row address in a stage's weight / activation tile for slice 0; slice kk
// is 256 bytes further (two chunks), m16 tile i 2048 (two row blocks), n8 pair jj 2048.
__device__ __forceinline__ void load_frags(Frags& f, const uint8_t* wts, const uint8_t* act, int off_a,
                                           int off_b, int kk) {
#pragma unroll
  for (int i = 0; i < kMT; ++i) gemm::ldmatrix_x4(f.a[i], wts + off_a + i * 2048 + kk * 256);
#pragma unroll
  for (int jj = 0; jj < kNP; ++jj) gemm::ldmatrix_x4(f.b[jj], act + off_b + jj * 2048 + kk * 256);
}

__device__ __forceinline__ void mma_slice(Acc& acc, const Frags& f) {
#pragma unroll
  for (int i = 0; i < kMT; ++i) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
      mma_f16_16816(acc[i][j], f.a[i], f.b[j >> 1][2 * (j & 1)], f.b[j >> 1][2 * (j & 1) + 1]);
  }
}

// A multiplier warp (w = 0..7: weight rows 64 (w & 1), tokens 32 (w >> 1) of the tile), one tile: acc (D [its
// 64 rows: 4 m16][its 32 tokens: 4 n8][4]) = the tile's product. g: the block's k-tile counter (stage and
// phase). ldmatrix x4 lane roles: A -- lanes 0-15 rows 0-15 of the m16 tile at chunk 2 kk, lanes 16-31 the
// same rows at chunk 2 kk + 1 (a0..a3); B -- lanes 0-7 tokens 0-7 of the pair's first n8 tile at chunk 2 kk,
// 8-15 the same at 2 kk + 1, 16-31 the second n8 tile (b0, b1 of each).
template <int S>
__device__ __forceinline__ void multiply_tile(const Pipe<S>& p, int n_kt, int& g, Acc& acc) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ra = 64 * (w & 1) + (lane & 15), ca = lane >> 4;
  const int off_a = (ra >> 3) * 1024 + ca * 128 + (ra & 7) * 16;
  const int rb = kWarpTokens * (w >> 1) + (lane & 7) + ((lane >> 4) << 3), cb = (lane >> 3) & 1;
  const int off_b = (rb >> 3) * 1024 + cb * 128 + (rb & 7) * 16;
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
  const uint32_t empty = smem_u32(p.empty);
  Frags f[2];
  mbar_wait(p.full + stage_of<S>(g), phase_of<S>(g));
  load_frags(f[0], p.wts(stage_of<S>(g)), p.act(stage_of<S>(g)), off_a, off_b, 0);
  for (int kt = 0; kt < n_kt; ++kt, ++g) {
    const int s = stage_of<S>(g);
    // The release's address, made here: computed after the next stage's ldmatrix (where ptxas puts it), it
    // took one of their address registers and waited for them to read it (short scoreboard; ncu, H200).
    uint32_t release = empty + 8 * s;
    asm volatile("" : "+r"(release));
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      if (kk + 1 < kBK / 16) {
        load_frags(f[(kk + 1) & 1], p.wts(s), p.act(s), off_a, off_b, kk + 1);
      } else if (kt + 1 < n_kt) {  // the next k-tile's first slice, once its stage is full
        const int s1 = stage_of<S>(g + 1);
        mbar_wait(p.full + s1, phase_of<S>(g + 1));
        load_frags(f[0], p.wts(s1), p.act(s1), off_a, off_b, 0);
      }
      mma_slice(acc, f[kk & 1]);
    }
    // Every ldmatrix of stage s has been consumed by an MMA issued above: the stage can be refilled.
    mbar_arrive(release);
  }
}

// A multiplier thread's place in the tile: its 8 weight (tile) rows are row_of(i, h) = 64 (w % 2) + 16 i + 8
// h + g (m16 tile i, h = 0 for D's c0 / c1, 1 for c2 / c3), its 2 kNT tokens token_of(j, e) = kWarpTokens (w
// / 2) + 8 j
// + 2 t + e (n8 tile j, e = 0 / 1), g = lane / 4, t = lane % 4.
__device__ __forceinline__ int row_of(int i, int h) {
  return 64 * ((threadIdx.x >> 5) & 1) + 16 * i + 8 * h + ((threadIdx.x & 31) >> 2);
}
__device__ __forceinline__ int token_of(int j, int e) {
  return kWarpTokens * (threadIdx.x >> 6) + 8 * j + 2 * (threadIdx.x & 3) + e;
}

// The multiplier of weight row `row`'s products: 1 for MXFP4; for NVFP4 its part's global scale (as a
// multiplier; a divide-convention part's reciprocal, within an ulp of dividing) times 2^8 (decode_half's
// NVFP4 fold).
template <WKind K>
__device__ __forceinline__ float row_scale(const DevWeight& w, int row) {
  if (K != WKind::kNVFP4) return 1.0f;
  const DevPart& part = find_part(w, row);
  return 256.0f * (part.divide ? 1.0f / part.global : part.global);
}

// The dense GEMM y[m, w.n] = A W^T (+ bias): items are (128 weight rows, 128 tokens) tiles, consecutive items
// on the same token tile (its activations then come from L2 for all but the first block).
template <WKind K>
struct DenseJob {
  DevWeight w;
  int m;
  const float* bias;
  float* y;
  __device__ int k() const { return w.k; }
  __device__ int n_col_tiles() const { return (w.n + kBN - 1) / kBN; }
  __device__ int n_items() const { return n_col_tiles() * ((m + kBM - 1) / kBM); }
  __device__ Item item(int i) const {
    const int m0 = i / n_col_tiles() * kBM;
    return Item{&w, i % n_col_tiles() * kBN, m0, min(kBM, m - m0), 0};
  }
  __device__ int weight_row(const Item& t, int c) const { return t.n0 + c < w.n ? t.n0 + c : -1; }
  // y[row0 + token][n0 + row] = acc * us[token] * row_scale (+ bias), tokens < rows, rows < n.
  __device__ void store(const Acc& acc, const Item& t, const float* us) const {
    const int n = w.n;
#pragma unroll
    for (int i = 0; i < kMT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = t.n0 + row_of(i, h);
        if (row >= n) continue;
        const float sr = row_scale<K>(w, row), br = bias ? bias[row] : 0.0f;
        float* yr = y + t.row0 * n + row;
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int token = token_of(j, e);
            if (token < t.rows)
              yr[static_cast<int64_t>(token) * n] = acc[i][j][2 * h + e] * us[token] * sr + br;
          }
        }
      }
    }
  }
};

// The tile kernel: one persistent block per SM (grid: min(items, SMs)); S stages, a code ring of R slots.
template <WKind K, int R, int S, class Job>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const __grid_constant__ Job job, const uint8_t* __restrict__ a_tiles,
           const float* __restrict__ unscale, int64_t mp) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[2 * S];
  __shared__ float us[(S + 1) * kBM];
  const Pipe<S> p{smem, bars, bars + S, us};
  const int tid = threadIdx.x;
  if (tid < S) {
    mbar_init(p.full + tid, Pipe<S>::kFullCount);
    mbar_init(p.empty + tid, Pipe<S>::kEmptyCount);
  }
  __syncthreads();
  if (tid >= kMulThreads) return decoder<K, R, S>(p, job, a_tiles, mp, unscale);
  const int n_items = job.n_items(), n_kt = (job.k() + kBK - 1) / kBK;
  Acc acc;
  for (int it = 0, g = 0;; ++it) {
    const Item t = item_at(job, n_items, it);
    if (!t.w) break;
    multiply_tile<S>(p, n_kt, g, acc);
    job.store(acc, t, p.tile_unscale(it));
  }
}

// The stage count: 4 where a block may have the shared memory (sm_90: 227 KiB), else 2 (sm_12x, GB10: 99
// KiB). NIBBLE_WSP_STAGES=2 runs GB10's depth on an H200 (measurement and tests).
inline int stages() {
  static const int n = [] {
    if (const char* e = std::getenv("NIBBLE_WSP_STAGES"); e && std::string(e) == "2") return 2;
    int device = 0, optin = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const int static_bytes = 2 * 4 * 8 + 5 * kBM * 4;  // the kernel's barriers and token scales at S = 4
    return optin >= smem_bytes(4, ws::kMaxRing) + static_bytes ? 4 : 2;
  }();
  return n;
}

template <WKind K, int R, int S, class Job>
void launch_rs(const Job& job, int64_t max_items, const GemmActivations& a, cudaStream_t s) {
  auto k = kernel<K, R, S, Job>;
  const int smem = smem_bytes(S, R);
  CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k<<<static_cast<int>(std::min<int64_t>(max_items, gemm_sm_count())), kThreads, smem, s>>>(
      job, reinterpret_cast<const uint8_t*>(a.hi), a.unscale, a.mp);
  CUDA_CHECK(cudaGetLastError());
}

// Runs `job` (at most max_items items, each of k = a's row length) on the tiled one-fp16 activations a.
template <WKind K, int S, class Job>
void launch_s(const Job& job, int k, int64_t max_items, const GemmActivations& a, cudaStream_t s) {
  switch (ws::ring_for((k + kBK - 1) / kBK)) {
    case 5:
      return launch_rs<K, 5, S>(job, max_items, a, s);
    case 4:
      return launch_rs<K, 4, S>(job, max_items, a, s);
    case 3:
      return launch_rs<K, 3, S>(job, max_items, a, s);
    case 2:
      return launch_rs<K, 2, S>(job, max_items, a, s);
    default:
      return launch_rs<K, 1, S>(job, max_items, a, s);
  }
}
template <WKind K, class Job>
void launch(const Job& job, int k, int64_t max_items, const GemmActivations& a, cudaStream_t s) {
  if (stages() == 4) return launch_s<K, 4>(job, k, max_items, a, s);
  return launch_s<K, 2>(job, k, max_items, a, s);
}

}  // namespace nb::cuda::wsp
