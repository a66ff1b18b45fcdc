// The benchmarks' timer: `calls` calls of body(i) captured in one CUDA graph, replayed `reps` times; the
// average microseconds of one call in the best replay. Two eager calls first warm what the body builds lazily
// (tables, pool sizes) so that the capture holds only the work itself.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace nb {

template <class F>
double graph_time_us(cudaStream_t s, int calls, int reps, F&& body) {
  for (int i = 0; i < 2; ++i) body(i);
  CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t e;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < calls; ++i) body(i);
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaGraphLaunch(e, s));  // (a first replay, untimed)
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(e0, s));
    CUDA_CHECK(cudaGraphLaunch(e, s));
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  CUDA_CHECK(cudaGraphExecDestroy(e));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return best * 1e3 / calls;
}

}  // namespace nb
