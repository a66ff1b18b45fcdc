// CUDA error handling. Setup paths that users can hit (no GPU, unsupported GPU, out of memory) go through
// cuda_status(), which turns the error into a one-line Status. CUDA_CHECK is for calls inside a step (a
// failure there is a dead device, an out-of-memory or a bug): one line naming the call, the error, file
// and line, then exit 1 (fatal_error), never an abort with a core dump.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "base/status.h"

namespace nb {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  return error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

[[noreturn]] inline void cuda_fatal(const char* call, const char* file, int line, cudaError_t err) {
  const bool oom = err == cudaErrorMemoryAllocation;
  fatal_error(std::string(oom ? "out of GPU memory" : "CUDA error") + ": " + cudaGetErrorName(err) + " (" +
              cudaGetErrorString(err) + ") in " + call + " at " + file + ":" + std::to_string(line));
}

// "3.20 GiB"
inline std::string gib(size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  return s;
}

// Out of device memory while allocating `bytes` for `what`: one line with the free and total memory.
[[noreturn]] inline void cuda_oom(size_t bytes, const std::string& what, const std::string& hint) {
  size_t free_b = 0, total_b = 0;
  (void)cudaGetLastError();
  (void)cudaMemGetInfo(&free_b, &total_b);
  fatal_error("out of GPU memory allocating " + gib(bytes) + " for " + what + " (free " + gib(free_b) + " of " +
              gib(total_b) + ")" + (hint.empty() ? "" : "; " + hint));
}

}  // namespace nb

#define CUDA_CHECK(call)                                                                            \
  do {                                                                                              \
    cudaError_t nb_err_ = (call);                                                                   \
    if (nb_err_ != cudaSuccess)                                                                     \
      ::nb::cuda_fatal(#call, __FILE__, __LINE__, nb_err_);                                         \
  } while (0)
