// The staged activation layout of the one-token FP4 kernels (gemv_fp4_stream.cu), in shared memory and,
// where a producer stages a consumer's input for it (StagedActs, norm_route's staged x), in global memory.
#pragma once

#include <cuda_fp16.h>

#include <cstddef>

#include "kernels/common.cuh"

namespace nb::cuda {

inline constexpr int kChunk = 1024;  // elements of a row per warp load: 32 lanes x 32

// Staged activations of one row: per chunk c, 4 octet planes j of 32 lanes x 16 bytes (plane j of lane l =
// elements 32 l + 8 j .. + 8 of the chunk in the octet order 0 4 1 5 2 6 3 7, common.cuh), hi planes of
// every chunk, then lo planes (one fp16 per activation: hi planes only). A lane's loads are consecutive
// 16-byte words across the warp: no conflicts.
__host__ __device__ constexpr int n_chunks(int k) { return (k + kChunk - 1) / kChunk; }
__host__ __device__ constexpr int hi_words(int k) { return n_chunks(k) * 4 * 32; }  // uint4: a row's hi planes
__host__ __device__ constexpr int row_words(int k) { return 2 * hi_words(k); }      // uint4 per staged row
__host__ __device__ constexpr size_t stage_bytes(int rows, int k) { return size_t{16} * rows * row_words(k); }

// Octet f of the staged rows: its row i, first element e (>= k: padding), plane word index.
__device__ __forceinline__ void octet_at(int f, int k, int& i, int& e, int& word) {
  const int octets = n_chunks(k) * kChunk / 8, o = f % octets;
  const int c = o / 128, l = (o / 4) % 32, j = o % 4;
  i = f / octets, e = c * kChunk + l * 32 + j * 8, word = (c * 4 + j) * 32 + l;
}
// Where element e of row i lies in StagedActs' planes (rows of hi planes only, back to back), in fp16s:
// octet_at's word, then the octet order 0 4 1 5 2 6 3 7 (split_octet).
// (Unsigned: FC1 computes this for every unit, and signed divisions cost ~25 instructions there.)
__device__ __forceinline__ int staged_half(int i, int e, int k) {
  const unsigned u = static_cast<unsigned>(e), c = u / kChunk, l = u % kChunk / 32, j = u % 32 / 8, q = u % 8;
  const unsigned word = static_cast<unsigned>(i * hi_words(k)) + (c * 4 + j) * 32 + l;
  return static_cast<int>(word * 8 + (q < 4 ? 2 * q : 2 * q - 7));
}

// One row of k activations (shared memory: a block's copy of the row) times pre (a power of two) into its
// hi planes at `hi` (global memory, hi_words(k) words, the padding past k as zeros), by the block's threads.
// (stage_store's values: the same products, the same fp16 roundings.)
__device__ inline void stage_row_hi(const float* row, int k, float pre, uint4* hi) {
  for (int f = threadIdx.x; f < n_chunks(k) * kChunk / 8; f += blockDim.x) {
    int i, e, word;
    octet_at(f, k, i, e, word);
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = e < k ? row[e + q] * pre : 0.0f;
    uint4 h, l;
    split_octet(v, h, l);
    hi[word] = h;
  }
}

}  // namespace nb::cuda
