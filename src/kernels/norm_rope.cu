// Row-wise and element-wise kernels; see norm_rope.cuh. Norms: a block per long row, a warp per short
// row; one thread per element elsewhere.
#include "kernels/norm_rope.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace nb::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

__global__ void embedding_kernel(const __grid_constant__ DevWeight table, const int32_t* __restrict__ tokens,
                                 const int32_t* __restrict__ last_ids, int64_t n_tokens, float* __restrict__ out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t t = blockIdx.y;
  int row = tokens[t];
  if (row < 0) row = last_ids[-1 - row];  // a token sampled by the previous step, still on the device
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < table.k; j += gridDim.x * blockDim.x)
    out[t * table.k + j] = weight_at(table, row, j);
}

// One block per row: rows are d_model (or head_dim for the q/k norms) long, and a single warp walking a
// 2880-wide row is bound by load latency, not bandwidth. When the row fits kNormHeld float4s per thread
// (d <= 16384, d % 4 == 0; the block has up to 1024 threads) every load of x, the residual and the weight
// is issued at once and the values stay in registers: one memory round trip after the wait (decode runs
// this between two GEMVs, on the critical path), and the weight's loads go out before it (they do not
// depend on the previous kernel). Other rows loop.
constexpr int kNormMaxThreads = 1024, kNormHeld = 4;
__global__ void __launch_bounds__(kNormMaxThreads) rms_norm_kernel(float* __restrict__ x, const float* __restrict__ residual,
                                                                   const float* __restrict__ w, int d, float eps,
                                                                   float* __restrict__ out) {
  __shared__ float partial[kNormMaxThreads / 32];
  const int64_t r = blockIdx.x;
  float* xr = x + r * d;
  const int d4 = d / 4, n = blockDim.x;
  const bool held = d % 4 == 0 && d4 <= kNormHeld * n;
  float4 g[kNormHeld], v[kNormHeld];
  if (held) {
#pragma unroll
    for (int j = 0; j < kNormHeld; ++j)
      if (threadIdx.x + j * n < d4) g[j] = reinterpret_cast<const float4*>(w)[threadIdx.x + j * n];
  }
  pdl_wait();  // x and the residual come from the previous kernels on the stream (see launch_pdl)
  float ss = 0.0f;
  if (held) {
    float4 y[kNormHeld];
#pragma unroll
    for (int j = 0; j < kNormHeld; ++j) {
      const int i = threadIdx.x + j * n;
      if (i >= d4) continue;
      v[j] = reinterpret_cast<const float4*>(xr)[i];
      if (residual) y[j] = reinterpret_cast<const float4*>(residual + r * d)[i];
    }
#pragma unroll
    for (int j = 0; j < kNormHeld; ++j) {
      const int i = threadIdx.x + j * n;
      if (i >= d4) continue;
      if (residual) {
        v[j].x += y[j].x, v[j].y += y[j].y, v[j].z += y[j].z, v[j].w += y[j].w;
        reinterpret_cast<float4*>(xr)[i] = v[j];
      }
      ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
  } else {
    for (int i = threadIdx.x; i < d; i += n) {
      float e = xr[i];
      if (residual) xr[i] = e = e + residual[r * d + i];
      ss += e * e;
    }
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const float total = warp_sum(lane < n / 32 ? partial[lane] : 0.0f);
  const float inv = rsqrtf(total / static_cast<float>(d) + eps);
  if (held) {
#pragma unroll
    for (int j = 0; j < kNormHeld; ++j) {
      const int i = threadIdx.x + j * n;
      if (i < d4)
        reinterpret_cast<float4*>(out + r * d)[i] =
            make_float4(g[j].x * (v[j].x * inv), g[j].y * (v[j].y * inv), g[j].z * (v[j].z * inv), g[j].w * (v[j].w * inv));
    }
  } else {
    for (int i = threadIdx.x; i < d; i += n) out[r * d + i] = w[i] * (xr[i] * inv);
  }
}

// Short rows (the q/k norms over head_dim, many rows): one warp per row.
__global__ void rms_norm_rows_kernel(float* __restrict__ x, const float* __restrict__ residual,
                                     const float* __restrict__ w, int64_t rows, int d, float eps,
                                     float* __restrict__ out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  float* xr = x + r * d;
  float ss = 0.0f;
  for (int i = lane; i < d; i += 32) {
    float v = xr[i];
    if (residual) xr[i] = v = v + residual[r * d + i];
    ss += v * v;
  }
  const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
  for (int i = lane; i < d; i += 32) out[r * d + i] = w[i] * (xr[i] * inv);
}

__global__ void rope_kernel(float* __restrict__ x, const int32_t* __restrict__ positions,
                            const float* __restrict__ inv_freq, float scale, int64_t n_tokens, int n_heads,
                            int head_dim) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int half = head_dim / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // over [t, h, half]
  if (i >= n_tokens * n_heads * half) return;
  const int d = static_cast<int>(i % half);
  const int64_t th = i / half, t = th / n_heads;
  // The angle is an fp32 product, as in the references; sincosf (no fast math) reduces it accurately.
  const float angle = static_cast<float>(positions[t]) * inv_freq[d];
  float sn, cs;
  sincosf(angle, &sn, &cs);
  cs *= scale;
  sn *= scale;
  float* v = x + th * head_dim;
  const float x1 = v[d], x2 = v[d + half];
  v[d] = x1 * cs - x2 * sn;
  v[d + half] = x2 * cs + x1 * sn;
}

__global__ void swiglu_kernel(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ o,
                              int64_t n) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

__global__ void add_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__global__ void gather_kernel(const uint8_t* __restrict__ x, const int32_t* __restrict__ rows, int64_t n_rows,
                              int64_t row_bytes, uint8_t* __restrict__ out) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  // 16 bytes per copy where rows and buffers allow (every fp32 row of a multiple of 4 values in pool memory).
  const bool wide = row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out)) % 16 == 0;
  const int64_t words = wide ? row_bytes / 16 : row_bytes;
  for (int64_t r = blockIdx.y; r < n_rows; r += gridDim.y) {  // (more rows than grid.y's 65535: MoE pairs)
    const uint8_t* src = x + rows[r] * row_bytes;
    uint8_t* dst = out + r * row_bytes;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < words;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (wide) reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
      else dst[j] = src[j];
    }
  }
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

void launch_embedding(const DevWeight& table, const int32_t* tokens, const int32_t* last_ids, int64_t n_tokens,
                      float* out, cudaStream_t s) {
  NB_CHECK(n_tokens >= 1 && n_tokens <= 65535, "embedding: token count");
  launch_pdl(embedding_kernel, dim3(std::min(ceil_div(table.k, kThreads), 64), n_tokens), kThreads, 0, s, table, tokens,
             last_ids, n_tokens, out);
  CUDA_CHECK(cudaGetLastError());
}

void launch_rms_norm(float* x, const float* residual, const float* w, int64_t rows, int d, float eps, float* out,
                     cudaStream_t s) {
  NB_CHECK(rows >= 1 && d >= 1, "rms_norm: shapes");
  if (d >= 512 && rows <= 65535) {
    // Enough threads for one float4 each up to 1024, so that most rows are one load per thread.
    const int threads = static_cast<int>(std::clamp<int64_t>((d / 4 + 31) / 32 * 32, kThreads, kNormMaxThreads));
    launch_pdl(rms_norm_kernel, static_cast<unsigned>(rows), threads, 0, s, x, residual, w, d, eps, out);
  } else {
    launch_pdl(rms_norm_rows_kernel, ceil_div(rows, kRowsPerBlock), kThreads, 0, s, x, residual, w, rows, d, eps, out);
  }
  CUDA_CHECK(cudaGetLastError());
}

void launch_rope(float* x, const int32_t* positions, const float* inv_freq, float attention_scale, int64_t n_tokens,
                 int n_heads, int head_dim, cudaStream_t s) {
  NB_CHECK(head_dim % 2 == 0 && n_tokens >= 1, "rope: shapes");
  launch_pdl(rope_kernel, blocks_for(n_tokens * n_heads * (head_dim / 2)), kThreads, 0, s, x, positions, inv_freq, attention_scale, n_tokens, n_heads, head_dim);
  CUDA_CHECK(cudaGetLastError());
}

void launch_swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t s) {
  launch_pdl(swiglu_kernel, blocks_for(n), kThreads, 0, s, gate, up, out, n);
  CUDA_CHECK(cudaGetLastError());
}

void launch_add(float* x, const float* y, int64_t n, cudaStream_t s) {
  launch_pdl(add_kernel, blocks_for(n), kThreads, 0, s, x, y, n);
  CUDA_CHECK(cudaGetLastError());
}

void launch_gather_rows(const uint8_t* x, const int32_t* rows, int64_t n_rows, int64_t row_bytes, uint8_t* out,
                        cudaStream_t s) {
  NB_CHECK(n_rows >= 1 && row_bytes >= 1, "gather_rows: shapes");
  const int64_t words = row_bytes % 16 == 0 ? row_bytes / 16 : row_bytes;
  launch_pdl(gather_kernel, dim3(std::min<int64_t>(blocks_for(words), 64), std::min<int64_t>(n_rows, 65535)), kThreads,
             0, s, x, rows, n_rows, row_bytes, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
