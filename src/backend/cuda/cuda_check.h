// CUDA error handling. CUDA_CHECK is for invariants (a failing call after setup is a bug or a dead
// device: abort with the call, file and line). Setup paths that users can hit (no GPU, unsupported
// GPU, out of memory) go through cuda_status(), which turns the error into a one-line Status.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "base/status.h"

namespace nb {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  return error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace nb

#define CUDA_CHECK(call)                                                                            \
  do {                                                                                              \
    cudaError_t nb_err_ = (call);                                                                   \
    if (nb_err_ != cudaSuccess)                                                                     \
      ::nb::check_failed(#call, __FILE__, __LINE__, cudaGetErrorString(nb_err_));                   \
  } while (0)
