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

}  // namespace nb::cuda
