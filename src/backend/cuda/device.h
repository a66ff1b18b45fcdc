// The GPU nibble runs on: what it is, and whether nibble's kernels were built for it.
#pragma once

#include <string>

#include "base/status.h"

namespace nb {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_bytes = 0, free_bytes = 0;
  size_t l2_bytes = 0;
  size_t smem_per_block_optin = 0;
};

// Errors: no CUDA device, driver too old, or a compute capability nibble was not compiled for.
Result<CudaDeviceInfo> cuda_device_info(int index = 0);
std::string describe(const CudaDeviceInfo& info);

}  // namespace nb
