#include "backend/cuda/device.h"

#include <cstdio>

#include "backend/cuda/cuda_check.h"

namespace nb {
namespace {

// Has this binary machine code (or PTX) for the device? Launching a trivial kernel tells for sure.
__global__ void probe_kernel(int* out) { *out = 42; }

}  // namespace

Result<CudaDeviceInfo> cuda_device_info(int index) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return cuda_status(err, "no usable CUDA device (cudaGetDeviceCount)");
  if (count == 0) return error("no CUDA device found");
  if (index < 0 || index >= count)
    return error("CUDA device " + std::to_string(index) + " does not exist (found " + std::to_string(count) + ")");
  cudaDeviceProp prop{};
  NB_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties"));
  NB_RETURN_IF_ERROR(cuda_status(cudaSetDevice(index), "cudaSetDevice"));
  CudaDeviceInfo info;
  info.index = index;
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.smem_per_block_optin = prop.sharedMemPerBlockOptin;
  NB_RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo"));

  int* d_out = nullptr;
  NB_RETURN_IF_ERROR(cuda_status(cudaMalloc(&d_out, sizeof(int)), "cudaMalloc"));
  probe_kernel<<<1, 1>>>(d_out);
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  cudaFree(d_out);
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorUnsupportedPtxVersion)
    return error("unsupported GPU " + info.name + " (compute capability " + std::to_string(prop.major) + "." +
                 std::to_string(prop.minor) + "): nibble was not built for it; rebuild with NIBBLE_CUDA_ARCHS=" +
                 std::to_string(prop.major) + std::to_string(prop.minor) + "a");
  NB_RETURN_IF_ERROR(cuda_status(err, "probe kernel"));
  return info;
}

std::string describe(const CudaDeviceInfo& info) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %d SMs, %.1f GiB, %.1f GiB free)", info.name.c_str(), info.cc_major,
                info.cc_minor, info.sm_count, info.total_bytes / 1073741824.0, info.free_bytes / 1073741824.0);
  return buf;
}

}  // namespace nb
