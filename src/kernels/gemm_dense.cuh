// Prefill GEMM for BF16 dense weights (attention projections and lm_head kept in the checkpoint's BF16)
// through cuBLASLt: y[m, n] = x[m, k] @ w^T + bias, with fp32 x split into bf16 hi + lo (x - hi) so
// the result keeps ~16 bits of x (bf16 x bf16 products are exact in the fp32 accumulator). Two GEMMs
// instead of one cost 2x the tensor FLOPs, which at prefill sizes is still far cheaper than the GEMV
// path's weight re-reads (the weight read once per 4 tokens).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/common.cuh"

namespace nb::cuda {

class DenseGemm {
 public:
  DenseGemm();
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;

  // BF16 rows 16-byte aligned, and every part's first row at a multiple of 4 rows with n too (so each
  // part's slice of y and of the bias is 16-byte aligned, as cuBLASLt's kernels want).
  static bool supports(const DevWeight& w) {
    if (w.kind != WKind::kBF16 || !w.vec_ok || w.n % 4 != 0) return false;
    int64_t r0 = 0;
    for (int p = 0; p < w.n_parts; ++p) {
      if (r0 % 4 != 0) return false;
      r0 += w.part[p].rows;
    }
    return true;
  }
  // Bytes of scratch `run` needs for m rows (the bf16 hi + lo activations).
  static int64_t scratch_bytes(int64_t m, int64_t k) { return 2 * m * k * 2; }
  // Enqueues y = x w^T (+ bias) on `s`. x [m, k] fp32, y [m, n] fp32, bias [n] or null.
  void run(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, void* scratch, cudaStream_t s);
  // run's two steps, for slices of one activation matrix multiplied by different weights (the MoE experts'
  // rows): split x [m, k] into scratch (scratch_bytes(m, k)) once, then y = rows [r0, r0 + rows) of it times
  // w^T (+ bias), y [rows, n].
  void split(const float* x, int64_t m, int64_t k, void* scratch, cudaStream_t s);
  void run_split(const DevWeight& w, const void* scratch, int64_t m, int64_t r0, int64_t rows, const float* bias,
                 float* y, cudaStream_t s);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nb::cuda
