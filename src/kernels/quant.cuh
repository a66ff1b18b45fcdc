// Load-time weight producers on the device: re-quantization of any weight to FP8 (per-row scale),
// MXFP4 or NVFP4 through the formats/ encoders (--dense-format), and random weights with realistic
// scales (--dummy-weights). Outputs are fresh device buffers laid out as the checkpoint formats are.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace nb::cuda {

// codes: FP8 [n, k] / FP4 [n, k/2]; scales: FP8 [n] F32, MXFP4 [n, k/32] E8M0, NVFP4 [n, k/16] UE4M3.
// NVFP4 encodes with the global multiplier `global` (ModelOpt recipe: amax / 2688, see launch_amax).
void launch_quantize(const DevWeight& src, WKind to, float global, uint8_t* codes, uint8_t* scales, cudaStream_t s);
// *amax = max |w| over the whole weight.
void launch_amax(const DevWeight& src, float* amax, cudaStream_t s);
// Random bytes for a weight of kind `kind` whose values have standard deviation about `std`.
// For FP4 kinds codes are uniform over the 16 codes and scales chosen so the values have that spread.
void launch_random_weight(WKind kind, int64_t n, int64_t k, float std, uint64_t seed, uint8_t* data,
                          uint8_t* scales, cudaStream_t s);
// out[i] = mean + std * u, u uniform with unit variance.
void launch_random_floats(float* out, int64_t n, float mean, float std, uint64_t seed, cudaStream_t s);

}  // namespace nb::cuda
