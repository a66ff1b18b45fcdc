// See prefetch.cuh. One prefetch.global.L2 per 128-byte line, spread over the launch's threads (the bulk
// cp.async.bulk.prefetch.L2 of sm_90 went through one SM's copy engine per block: 5.9 MB took ~26 us).
#include "kernels/prefetch.cuh"

#include "backend/cuda/cuda_check.h"
#include "kernels/common.cuh"

namespace nb::cuda {
namespace {

constexpr int kThreads = 256, kBlocks = 16;

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const __grid_constant__ PrefetchRanges r) {
  issue_l2_prefetch(r, blockIdx.x * blockDim.x + threadIdx.x, kThreads * kBlocks);
  pdl_wait();  // (nothing to read: keeps the stream order for the kernels after this one)
}

}  // namespace

void launch_l2_prefetch(const PrefetchRanges& r, cudaStream_t s) {
  if (r.n == 0) return;
  launch_pdl(l2_prefetch_kernel, kBlocks, kThreads, 0, s, r);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
