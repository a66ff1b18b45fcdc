// Dense FP4 GEMM for many tokens (prefill): y[m, n] = x[m, k] @ w^T (+ bias) with w in MXFP4 or NVFP4,
// on the tensor cores (mma.sync, fp16 x fp16 -> fp32) from the checkpoint's codes and scales as they are.
// The fp32 activations are first converted to fp16 once per row (launch_gemm_activations); the weights
// are decoded in shared memory per tile (gemm_fp4_tile.cuh). The MoE grouped GEMM (moe_gemm.cuh) shares
// both. Decode sizes keep the GEMV kernels (gemv.cuh); the backend picks by token count.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace nb::cuda {

// How the fp32 activations meet the fp16 tensor cores. Each row is first scaled by a power of two
// (exact) so that its largest |x| lies in [2^14, 2^15), then rounded to fp16 (11 significant bits);
// kSplit also keeps the rounding remainder as a second fp16 (~22 bits together) and runs a second MMA
// on it: half the speed, about fp32 accuracy for the sums (the products fp16 x fp16 are exact in fp32).
// kFp8 (sm_90a only, dense GEMMs: gemm_fp8_supported): each row scaled by a power of two so that its largest
// |x| lies in [2^7, 2^8) and rounded to E4M3 (4 significant bits), the weights decoded to E4M3 too, on the
// FP8 tensor cores (gemm_fp4_wsr8.cuh): a W4A8 product, faster and coarser.
enum class GemmActs : uint8_t { kSplit, kFp16, kFp8 };

// What launch_gemm_fp4 takes: MXFP4/NVFP4 weights with 16-byte aligned rows and k % 32 == 0.
bool gemm_fp4_supports(const DevWeight& w);

// Whether the prefill GEMMs run the sm_90a wgmma tile (gemm_fp4_wgmma.cuh): a compute capability 9.0 GPU
// and a binary built for sm_90a; NIBBLE_WGMMA=0 turns it off (the portable mma.sync tile then runs).
bool gemm_wgmma();

// The fp16 form of activations: hi, lo [rows, ld] (lo unused for kFp16), unscale [rows] = the power of two
// that undoes the row's scaling. The k order is the tile's: for the portable tile every 8 elements as
// 0,4,1,5,2,6,3,7 with ld = k; for the wgmma tile its stored order (gemm_fp4_wgmma.cuh stored_of) with k
// padded to whole 64-wide k-tiles (zeros), ld = padded k. tiled (the warp-specialized tiles, sm_90a's
// gemm_fp4_wsr.cuh / gemm_fp4_ws.cuh and the portable gemm_fp4_wsp.cuh; one fp16 only): hi holds 8 x 8 core
// matrices per (k-tile, 8 rows), rows padded to mp (ws::chunk_of), ld unused.
struct GemmActivations {
  __half* hi = nullptr;
  __half* lo = nullptr;
  float* unscale = nullptr;
  int64_t ld = 0;
  bool wgmma = false;
  bool tiled = false;
  int64_t mp = 0;    // tiled: rows padded to whole token tiles
  bool wsp = false;  // tiled: the portable warp-specialized tile even where the sm_90a one exists
  // tiled, the sm_90a tile: 0 the ws tile (gemm_fp4_ws.cuh), 1 or 2 the register-fragment one (gemm_fp4_wsr.cuh,
  // gemm_ws_rs), whose activations hold the wgmma tile's k order inside each k-tile.
  int rs = 0;
  // kFp8: hi holds E4M3 bytes, tiled like the one-fp16 form but 128 k per k-tile (a k-tile's 128 bytes per row
  // in gemm_fp4_wsr8.cuh's stored order, k padded to whole k-tiles); the sm_90a FP8 tile runs.
  bool fp8 = false;
};

// Whether kFp8 activations can run here: the sm_90a tiles (gemm_wgmma()).
bool gemm_fp8_supported();

// Which sm_90a warp-specialized tile dense prefill GEMMs run (GemmActivations::rs): NIBBLE_WS_RS = 0 (the
// decoder-warpgroup tile), 1 (the register-fragment tile, one fragment set: the default) or 2 (two sets).
int gemm_ws_rs();

// Which warp-specialized tile, if any, launch_gemm_fp4 runs an [m, k] x [n, k]^T GEMM in `mode` on; each
// needs its activations tiled (one fp16 only), and kWsp on an sm_90a GPU also GemmActivations::wsp. With the
// wgmma tiles (gemm_wgmma()): the sm_90a tile (gemm_fp4_wsr.cuh, gemm_ws_rs) at policy -1 when its grid fills
// the GPU or, from m >= 512, a third of it, else from m >= 256 the portable one (gemm_fp4_wsp.cuh) where its
// grid fills half the SMs to one round; at policy 1 the sm_90a tile whenever it can (m >= 256). Otherwise the
// portable tile: policy -1 or 1 from m >= 128. Policy 0: none (the wgmma or block tiles). kFp8: always the sm_90a
// FP8 tile (gemm_fp4_wsr8.cuh), whatever the policy. CudaBackendOptions::gemm_ws.
enum class TiledTile : uint8_t { kNone, kWs, kWsp };
TiledTile gemm_tiled_tile(int64_t m, int n, GemmActs mode, int policy);

// The current device's SM count (the prefill GEMMs' grids are sized by it).
int gemm_sm_count();

// Scratch for `rows` rows of k: its size in bytes, and the pieces laid out in `buf` (16-byte aligned).
int64_t gemm_activations_bytes(int64_t rows, int k, GemmActs mode, bool tiled = false);
GemmActivations gemm_activations_in(void* buf, int64_t rows, int k, GemmActs mode, bool tiled = false);

// Row r of the output converts row gather[r] / gather_div of x [.., k] (or row r when gather is null); rows with
// gather[r] < 0 are left as they are (the MoE tiles' pad slots).
void launch_gemm_activations(const float* x, const int32_t* gather, int gather_div, int64_t rows, int k, GemmActs mode,
                             const GemmActivations& out, cudaStream_t s);

// y [m, w.n] = a @ w^T (+ bias [w.n]) for a [m, w.k] prepared by launch_gemm_activations.
void launch_gemm_fp4(const DevWeight& w, const GemmActivations& a, int64_t m, const float* bias, float* y,
                     GemmActs mode, cudaStream_t s);

}  // namespace nb::cuda
