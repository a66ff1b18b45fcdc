// Quantization and random-weight kernels; see quant.cuh. One thread per scale block (MXFP4 32, NVFP4 16
// elements) reads the source through weight_at and encodes with formats/ (the same code as the host
// tests check bit for bit); FP8 rows take one warp each for the row amax.
#include "kernels/quant.cuh"

#include "backend/cuda/cuda_check.h"

namespace nb::cuda {
namespace {

__device__ __forceinline__ uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ float uniform_pm1(uint64_t h) {  // uniform in [-1, 1)
  return static_cast<float>(static_cast<uint32_t>(h >> 40)) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void amax_kernel(const __grid_constant__ DevWeight w, float* amax) {
  const int64_t total = static_cast<int64_t>(w.n) * w.k;
  float m = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(weight_at(w, static_cast<int>(i / w.k), static_cast<int>(i % w.k))));
  m = warp_max(m);
  // Non-negative floats order like their bit patterns.
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

__global__ void quantize_fp4_kernel(const __grid_constant__ DevWeight w, bool nv, float global, uint8_t* codes, uint8_t* scales) {
  const int block = nv ? 16 : 32;
  const int64_t per_row = w.k / block, total = static_cast<int64_t>(w.n) * per_row;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int row = static_cast<int>(i / per_row), b = static_cast<int>(i % per_row);
  float x[32];
  for (int j = 0; j < block; ++j) x[j] = weight_at(w, row, b * block + j);
  uint8_t* out = codes + static_cast<int64_t>(row) * (w.k / 2) + b * block / 2;
  scales[i] = nv ? fmt::nvfp4_encode_block(x, global, out) : fmt::mxfp4_encode_block(x, out);
}

__global__ void quantize_fp8_kernel(const __grid_constant__ DevWeight w, uint8_t* codes, float* scales) {
  const int row = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= w.n) return;
  float m = 0.0f;
  for (int j = lane; j < w.k; j += 32) m = fmaxf(m, fabsf(weight_at(w, row, j)));
  m = warp_max(m);
  const float scale = m > 0.0f ? m / fmt::kE4M3Max : 1.0f;
  for (int j = lane; j < w.k; j += 32)
    codes[static_cast<int64_t>(row) * w.k + j] = fmt::float_to_e4m3(weight_at(w, row, j) / scale);
  if (lane == 0) scales[row] = scale;
}

__global__ void random_bytes_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = static_cast<uint8_t>(mix(seed ^ (i * 0x100000001b3ull)) >> 24);
}

// Scales: MXFP4 E8M0 codes near `center`; NVFP4 UE4M3 codes of values near `center_value`.
__global__ void random_scales_kernel(uint8_t* p, int64_t n, uint64_t seed, bool nv, int center, float center_value) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float u = uniform_pm1(mix(seed + i));
  p[i] = nv ? fmt::float_to_ue4m3(center_value * (1.0f + 0.5f * u)) : static_cast<uint8_t>(center + (u > 0 ? 1 : 0));
}

__global__ void random_dense_kernel(uint8_t* p, int64_t n, uint64_t seed, float std, WKind kind) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = uniform_pm1(mix(seed + i)) * std * 1.7320508f;  // uniform with standard deviation std
  if (kind == WKind::kBF16) reinterpret_cast<uint16_t*>(p)[i] = fmt::float_to_bf16(v);
  else if (kind == WKind::kF32) reinterpret_cast<float*>(p)[i] = v;
  else p[i] = fmt::float_to_e4m3(v * 448.0f / (4 * std));  // FP8 with row scale 4 std / 448
}

__global__ void fill_kernel(float* p, int64_t n, float v) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}

__global__ void random_floats_kernel(float* p, int64_t n, float mean, float std, uint64_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = mean + std * 1.7320508f * uniform_pm1(mix(seed + i));
}

unsigned blocks(int64_t n, int threads = 256) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

void launch_amax(const DevWeight& src, float* amax, cudaStream_t s) {
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), s));
  amax_kernel<<<1024, 256, 0, s>>>(src, amax);
  CUDA_CHECK(cudaGetLastError());
}

void launch_quantize(const DevWeight& src, WKind to, float global, uint8_t* codes, uint8_t* scales, cudaStream_t s) {
  switch (to) {
    case WKind::kFP8:
      quantize_fp8_kernel<<<ceil_div(src.n, 8), 256, 0, s>>>(src, codes, reinterpret_cast<float*>(scales));
      break;
    case WKind::kMXFP4:
    case WKind::kNVFP4: {
      const bool nv = to == WKind::kNVFP4;
      NB_CHECK(src.k % (nv ? 16 : 32) == 0, "quantize: k must be a multiple of the block");
      quantize_fp4_kernel<<<blocks(int64_t{src.n} * (src.k / (nv ? 16 : 32))), 256, 0, s>>>(src, nv, global, codes,
                                                                                            scales);
      break;
    }
    default:
      NB_CHECK(false, "quantize: target must be FP8, MXFP4 or NVFP4");
  }
  CUDA_CHECK(cudaGetLastError());
}

void launch_random_weight(WKind kind, int64_t n, int64_t k, float std, uint64_t seed, uint8_t* data, uint8_t* scales,
                          cudaStream_t s) {
  // E2M1 codes uniform over all 16 have RMS 2.93; scale so that the values have RMS `std`.
  const float fp4_scale = std / 2.93f;
  switch (kind) {
    case WKind::kMXFP4:
    case WKind::kNVFP4: {
      const bool nv = kind == WKind::kNVFP4;
      random_bytes_kernel<<<blocks(n * k / 2), 256, 0, s>>>(data, n * k / 2, seed);
      const int64_t n_scales = n * k / (nv ? 16 : 32);
      const int center = 127 + static_cast<int>(floorf(log2f(fp4_scale)));
      // NVFP4 (global multiplier 1/448 set by the caller): block scale value near fp4_scale * 448.
      random_scales_kernel<<<blocks(n_scales), 256, 0, s>>>(scales, n_scales, seed * 31 + 7, nv, center,
                                                            fp4_scale * 448.0f);
      break;
    }
    case WKind::kFP8:
      random_dense_kernel<<<blocks(n * k), 256, 0, s>>>(data, n * k, seed, std, kind);
      fill_kernel<<<blocks(n), 256, 0, s>>>(reinterpret_cast<float*>(scales), n, 4 * std / 448.0f);
      break;
    default:
      random_dense_kernel<<<blocks(n * k), 256, 0, s>>>(data, n * k, seed, std, kind);
  }
  CUDA_CHECK(cudaGetLastError());
}

void launch_random_floats(float* out, int64_t n, float mean, float std, uint64_t seed, cudaStream_t s) {
  random_floats_kernel<<<blocks(n), 256, 0, s>>>(out, n, mean, std, seed);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
