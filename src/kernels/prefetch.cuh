// L2 prefetch of a weight's bytes ahead of the kernel that reads them, issued where the decode step
// leaves DRAM idle (attention, the MoE kernels' latency-bound rounds): the small one-token GEMVs that
// follow then find their first units in L2 instead of waiting for DRAM after their blocks start.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace nb::cuda {

constexpr int kMaxPrefetchRanges = 16;
struct PrefetchRanges {
  const uint8_t* begin[kMaxPrefetchRanges];
  uint32_t bytes[kMaxPrefetchRanges];
  int n = 0;
};

// One small launch in stream order: it issues the prefetches, then waits for the previous kernel like
// every other (launch_pdl), so the stream's order is kept.
void launch_l2_prefetch(const PrefetchRanges& r, cudaStream_t s);

#ifdef __CUDACC__
// Thread tid of n_threads: its share of r, one prefetch.global.L2 per 128-byte line (what the launch above
// runs; kernels that have DRAM to spare call it themselves: the one-token MoE FC1 before its wait, or FC2,
// gemv_fp4_stream.cu).
__device__ __forceinline__ void issue_l2_prefetch(const PrefetchRanges& r, uint32_t tid, uint32_t n_threads) {
  for (int i = 0; i < r.n; ++i)
    for (uint32_t off = tid * 128u; off < r.bytes[i]; off += n_threads * 128u)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(r.begin[i] + off));
}
#endif

}  // namespace nb::cuda
