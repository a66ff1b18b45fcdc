// GEMV kernels. Layout of the work: a block of kWarps warps; each warp owns kRows weight rows at a time
// and its lanes stride over the row in 16-byte chunks (MXFP4: one 32-element block per chunk; NVFP4: two
// 16-element blocks; FP8: 16 elements; BF16: 8). kUnroll chunks of every row are loaded before any math
// so each lane has several 16-byte loads in flight. Per block of elements the unscaled products are summed
// first and the block factor applied once. Weights that are not 16-byte aligned take a per-element path.
// Activations: a lane's chunk needs a contiguous run of x (128 bytes for FP4), so read straight from
// global memory 32 lanes touch 32 different cache lines per load. The block therefore stages x in shared
// memory "chunk-transposed" (float4 q of chunk c at [c / 32][q][c % 32]): for a fixed q the 32 lanes read
// 512 consecutive bytes. Blocks loop over row groups so the staging is paid once per block.
#include "kernels/gemv.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace nb::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxStage = 48 * 1024;  // shared memory for staged activations without an opt-in
constexpr int kRows = 2;     // weight rows per warp: the activation loads are shared by them
constexpr int kFc2Rows = 1;  // MoE fc2 rows per warp: its warps loop over the choices, so more warps
constexpr int kUnroll = 2;   // 16-byte chunks per row per loop iteration
static_assert(kThreads <= 1024 && kRows >= 1 && kFc2Rows >= 1 && kUnroll >= 1);

// Per format: elements per 16-byte chunk, factor blocks per chunk, decoding and block factors.
template <WKind K>
struct Chunk;

template <>
struct Chunk<WKind::kBF16> {
  static constexpr int kElems = 8, kBlocks = 1;
  __device__ static void decode(uint4 r, float (&o)[kElems]) {
    const uint32_t v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = __uint_as_float(v[i] << 16);
      o[2 * i + 1] = __uint_as_float(v[i] & 0xffff0000u);
    }
  }
  __device__ static float factor(const DevPart&, int, int, int, int) { return 1.0f; }
};

template <>
struct Chunk<WKind::kF16> {
  static constexpr int kElems = 8, kBlocks = 1;
  __device__ static void decode(uint4 r, float (&o)[kElems]) {
    const uint32_t v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      half2_bits_to_float2(v[i], o[2 * i], o[2 * i + 1]);
    }
  }
  __device__ static float factor(const DevPart&, int, int, int, int) { return 1.0f; }
};

template <>
struct Chunk<WKind::kF32> {
  static constexpr int kElems = 4, kBlocks = 1;
  __device__ static void decode(uint4 r, float (&o)[kElems]) {
    o[0] = __uint_as_float(r.x), o[1] = __uint_as_float(r.y), o[2] = __uint_as_float(r.z), o[3] = __uint_as_float(r.w);
  }
  __device__ static float factor(const DevPart&, int, int, int, int) { return 1.0f; }
};

// E4M3 in software: a code's 7 magnitude bits placed at fp16 bits 7..13 (and its sign at 15) make an
// fp16 equal to e4m3 * 2^-8, subnormals included; 2^8 is folded into the factor. The NaN code (never in
// a valid FP8 weight) decodes as a finite value here.
template <>
struct Chunk<WKind::kFP8> {
  static constexpr int kElems = 16, kBlocks = 1;
  __device__ static void decode(uint4 r, float (&o)[kElems]) {
    const uint32_t v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t even = ((v[i] << 7) & 0x3F803F80u) | ((v[i] << 8) & 0x80008000u);  // bytes 0 and 2
      const uint32_t odd = ((v[i] >> 1) & 0x3F803F80u) | (v[i] & 0x80008000u);         // bytes 1 and 3
      half2_bits_to_float2(even, o[4 * i], o[4 * i + 2]);
      half2_bits_to_float2(odd, o[4 * i + 1], o[4 * i + 3]);
    }
  }
  __device__ static float factor(const DevPart& p, int row, int, int, int) {
    return __ldg(reinterpret_cast<const float*>(p.scales) + row) * 256.0f;  // per output channel
  }
};

template <>
struct Chunk<WKind::kMXFP4> {
  static constexpr int kElems = 32, kBlocks = 1;
  __device__ static void decode(uint4 r, float (&o)[kElems]) {
    const uint32_t v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float e[8];
      e2m1x8_scaled(v[i], e);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[8 * i + j] = e[j];
    }
  }
  __device__ static float factor(const DevPart& p, int row, int k, int chunk, int) {
    return fmt::e8m0_to_float(__ldg(p.scales + static_cast<int64_t>(row) * (k / 32) + chunk)) * kE2m1Unscale;
  }
};

template <>
struct Chunk<WKind::kNVFP4> {
  static constexpr int kElems = 32, kBlocks = 2;
  __device__ static void decode(uint4 r, float (&o)[kElems]) { Chunk<WKind::kMXFP4>::decode(r, o); }
  __device__ static float factor(const DevPart& p, int row, int k, int chunk, int b) {
    return nvfp4_factor(p, __ldg(p.scales + static_cast<int64_t>(row) * (k / 16) + 2 * chunk + b)) * kE2m1Unscale;
  }
};

template <WKind K>
constexpr int kBytesPerElem2 = K == WKind::kF32 ? 8 : (K == WKind::kBF16 || K == WKind::kF16) ? 4 : K == WKind::kFP8 ? 2 : 1;
// Row bytes = k * kBytesPerElem2 / 2.

// One token's activations as a warp reads them: plain global memory, or staged chunk-transposed.
struct XView {
  const float* g = nullptr;     // [k] in global memory, always valid (the per-element path reads it)
  const float4* s = nullptr;    // staged copy in shared memory, or null
  int q = 0;                    // float4s per chunk
  __device__ float4 load(int c, int i) const {
    return s ? s[(c >> 5) * 32 * q + i * 32 + (c & 31)] : __ldg(reinterpret_cast<const float4*>(g + c * 4 * q) + i);
  }
};

// Floats of shared memory one staged token takes for k inputs in chunks of `elems`.
__host__ __device__ constexpr int staged_floats(int k, int elems) { return (k / elems + 31) / 32 * 32 * elems; }

// All threads of the block: stage x [k] into s (chunk-transposed). The caller synchronizes.
__device__ void stage_x(const float* __restrict__ x, int k, int elems, float4* s) {
  const int q = elems / 4, n = k / 4;
  for (int f = threadIdx.x; f < n; f += blockDim.x) {
    const int c = f / q, i = f % q;
    s[(c >> 5) * 32 * q + i * 32 + (c & 31)] = __ldg(reinterpret_cast<const float4*>(x) + f);
  }
}

// acc[r][t] += lane's share of w[rows[r], :] . xs[t][:]. Rows must be valid. m <= M tokens are live.
template <WKind K, int M, int R>
__device__ __forceinline__ void warp_dot(const DevWeight& w, const int (&rows)[R], const XView (&xs)[M], int m,
                                         float (&acc)[R][M], int k_part = 0, int k_parts = 1) {
  // Split-K: k_parts warps share the rows; warp k_part takes every k_parts-th group of 32 chunks.
  const int lane = (threadIdx.x & 31) + 32 * k_part, stride = 32 * k_parts;
  const int k = w.k;
  if (!w.vec_ok) {
    for (int j = lane; j < k; j += stride) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float wv = weight_at(w, rows[r], j);
#pragma unroll
        for (int t = 0; t < M; ++t)
          if (t < m) acc[r][t] += wv * xs[t].g[j];
      }
    }
    return;
  }
  using C = Chunk<K>;
  const int n_chunks = k / C::kElems;
  const uint8_t* base[R];
  const DevPart* part[R];
  int prow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    prow[r] = rows[r];
    part[r] = &find_part(w, prow[r]);
    base[r] = part[r]->data + static_cast<int64_t>(prow[r]) * k * kBytesPerElem2<K> / 2;
  }
  // kUnroll chunks per row per iteration: R * kUnroll 16-byte loads in flight per lane before any math.
  for (int c0 = lane; c0 < n_chunks; c0 += stride * kUnroll) {
    uint4 raw[kUnroll][R];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        raw[u][r] = c0 + stride * u < n_chunks ? __ldg(reinterpret_cast<const uint4*>(base[r]) + c0 + stride * u)
                                               : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + stride * u;
      if (c >= n_chunks) break;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float e[C::kElems];
        C::decode(raw[u][r], e);
        constexpr int kPer = C::kElems / C::kBlocks;
#pragma unroll
        for (int b = 0; b < C::kBlocks; ++b) {
          const float f = C::factor(*part[r], prow[r], k, c, b);
#pragma unroll
          for (int t = 0; t < M; ++t) {
            if (t >= m) break;
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < kPer / 4; ++q) {
              const float4 xq = xs[t].load(c, b * (kPer / 4) + q);
              s = fmaf(e[b * kPer + 4 * q], xq.x, s);
              s = fmaf(e[b * kPer + 4 * q + 1], xq.y, s);
              s = fmaf(e[b * kPer + 4 * q + 2], xq.z, s);
              s = fmaf(e[b * kPer + 4 * q + 3], xq.w, s);
            }
            acc[r][t] = fmaf(s, f, acc[r][t]);
          }
        }
      }
    }
  }
}

// Plain linear: grid (blocks looping over row groups, token chunks of M). Dynamic shared memory holds
// the chunk's M tokens staged, or nothing (then x is read from global memory).
template <WKind K, int M>
__global__ void __launch_bounds__(kThreads) linear_kernel(const __grid_constant__ DevWeight w,
                                                          const float* __restrict__ x, int m_total,
                                                          const float* __restrict__ bias, float* __restrict__ y,
                                                          bool staged) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  extern __shared__ float4 smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t0 = blockIdx.y * M, m = min(M, m_total - t0);
  constexpr int kE = Chunk<K>::kElems;
  XView xs[M];
#pragma unroll
  for (int t = 0; t < M; ++t) {
    xs[t].g = x + static_cast<int64_t>(t0 + min(t, m - 1)) * w.k;
    xs[t].q = kE / 4;
    if (staged) xs[t].s = smem + t * staged_floats(w.k, kE) / 4;
  }
  if (staged) {
    for (int t = 0; t < m; ++t) stage_x(xs[t].g, w.k, kE, smem + t * staged_floats(w.k, kE) / 4);
    __syncthreads();
  }
  const int groups = (w.n + kWarps * kRows - 1) / (kWarps * kRows);
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    const int row0 = (g * kWarps + warp) * kRows;
    if (row0 >= w.n) break;
    int rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows[r] = min(row0 + r, w.n - 1);
    float acc[kRows][M] = {};
    warp_dot<K, M, kRows>(w, rows, xs, m, acc);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int t = 0; t < M; ++t) {
        const float v = warp_sum(acc[r][t]);
        if (lane == 0 && t < m && row0 + r < w.n)
          y[static_cast<int64_t>(t0 + t) * w.n + row0 + r] = v + (bias ? bias[row0 + r] : 0.0f);
      }
    }
  }
}

// Split-K linear for weights with few rows (k and v projections, routers) at M = 1: kSplitK warps share
// each row pair, their partial sums meet in shared memory and are added in a fixed order. Rows alone
// would leave most of the GPU idle.
constexpr int kSplitK = 4;
static_assert(kWarps % kSplitK == 0);

template <WKind K>
__global__ void __launch_bounds__(kThreads) linear_split_kernel(const __grid_constant__ DevWeight w,
                                                                const float* __restrict__ x,
                                                                const float* __restrict__ bias,
                                                                float* __restrict__ y, bool staged) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  extern __shared__ float4 smem[];
  __shared__ float red[kWarps][kRows];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = warp % kSplitK;
  constexpr int kE = Chunk<K>::kElems, kPerBlock = kWarps / kSplitK;
  XView xs[1];
  xs[0].g = x;
  xs[0].q = kE / 4;
  if (staged) {
    xs[0].s = smem;
    stage_x(x, w.k, kE, smem);
    __syncthreads();
  }
  const int groups = (w.n + kPerBlock * kRows - 1) / (kPerBlock * kRows);
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform over the block: it synchronizes
    const int row0 = (g * kPerBlock + warp / kSplitK) * kRows;
    int rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows[r] = min(row0 + r, w.n - 1);
    float acc[kRows][1] = {};
    warp_dot<K, 1, kRows>(w, rows, xs, 1, acc, part, kSplitK);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float v = warp_sum(acc[r][0]);
      if (lane == 0) red[warp][r] = v;
    }
    __syncthreads();
    if (part == 0 && lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float v = red[warp][r];
        for (int q = 1; q < kSplitK; ++q) v += red[warp + q][r];
        if (row0 + r < w.n) y[row0 + r] = v + (bias ? bias[row0 + r] : 0.0f);
      }
    }
    __syncthreads();
  }
}

// MoE fc1 + GLU: grid (blocks looping over outputs, pairs). One output j per warp: rows gate(j), up(j).
template <WKind K>
__global__ void __launch_bounds__(kThreads) moe_fc1_kernel(ExpertTable tab, const int32_t* __restrict__ ids,
                                                           int n_pairs, int top_k, const float* __restrict__ x,
                                                           Glu glu, float limit, float* __restrict__ act,
                                                           bool staged) {
  pdl_wait_then_launch();  // inputs come from the previous kernel on the stream (see launch_pdl)
  extern __shared__ float4 smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int d = tab.d_expert;
  constexpr int kE = Chunk<K>::kElems;
  const bool interleaved = glu == Glu::kSiluInterleaved || glu == Glu::kGptOssInterleaved;
  for (int p = blockIdx.y; p < n_pairs; p += gridDim.y) {
    const int e = ids[p];
    const DevWeight& w = tab.fc1[e];
    XView xs[1];
    xs[0].g = x + static_cast<int64_t>(p / top_k) * tab.d_model;
    xs[0].q = kE / 4;
    if (staged) {
      __syncthreads();  // the previous pair's reads are done
      stage_x(xs[0].g, tab.d_model, kE, smem);
      __syncthreads();
      xs[0].s = smem;
    }
    for (int j = blockIdx.x * kWarps + warp; j < d; j += gridDim.x * kWarps) {
      const int rows[2] = {interleaved ? 2 * j : j, interleaved ? 2 * j + 1 : d + j};
      float acc[2][1] = {};
      warp_dot<K, 1, 2>(w, rows, xs, 1, acc);
      float g = warp_sum(acc[0][0]), u = warp_sum(acc[1][0]);
      if (lane == 0) {
        if (tab.fc1_bias) {
          g += tab.fc1_bias[static_cast<int64_t>(e) * 2 * d + rows[0]];
          u += tab.fc1_bias[static_cast<int64_t>(e) * 2 * d + rows[1]];
        }
        act[static_cast<int64_t>(p) * d + j] =
            glu_value(g, u, glu == Glu::kGptOssInterleaved || glu == Glu::kGptOssHalves, limit);
      }
    }
  }
}

// MoE fc2 + weighted combine: grid (blocks looping over rows, tokens). The token's top_k activation rows
// are staged together when they fit.
template <WKind K>
__global__ void __launch_bounds__(kThreads) moe_fc2_kernel(ExpertTable tab, const int32_t* __restrict__ ids,
                                                           const float* __restrict__ weights, int n_tokens,
                                                           int top_k, const float* __restrict__ act,
                                                           float* __restrict__ y, bool staged) {
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  extern __shared__ float4 smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = tab.d_model;
  constexpr int kE = Chunk<K>::kElems;
  const int per = staged_floats(tab.d_expert, kE) / 4;
  for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
    if (staged) {
      __syncthreads();
      for (int i = 0; i < top_k; ++i)
        stage_x(act + (static_cast<int64_t>(t) * top_k + i) * tab.d_expert, tab.d_expert, kE, smem + i * per);
      __syncthreads();
    }
    for (int row0 = (blockIdx.x * kWarps + warp) * kFc2Rows; row0 < n; row0 += gridDim.x * kWarps * kFc2Rows) {
      int rows[kFc2Rows];
#pragma unroll
      for (int r = 0; r < kFc2Rows; ++r) rows[r] = min(row0 + r, n - 1);
      float out[kFc2Rows] = {};
      for (int i = 0; i < top_k; ++i) {
        const int p = t * top_k + i, e = ids[p];
        const DevWeight& w = tab.fc2[e];
        XView xs[1];
        xs[0].g = act + static_cast<int64_t>(p) * tab.d_expert;
        xs[0].q = kE / 4;
        if (staged) xs[0].s = smem + i * per;
        float acc[kFc2Rows][1] = {};
        warp_dot<K, 1, kFc2Rows>(w, rows, xs, 1, acc);
        const float wt = weights[p];
#pragma unroll
        for (int r = 0; r < kFc2Rows; ++r) {
          const float v =
              warp_sum(acc[r][0]) + (tab.fc2_bias ? tab.fc2_bias[static_cast<int64_t>(e) * n + rows[r]] : 0.0f);
          out[r] += wt * v;  // weight applied after the bias (formats.md §2.4)
        }
      }
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < kFc2Rows; ++r)
          if (row0 + r < n) y[static_cast<int64_t>(t) * n + row0 + r] = out[r];
    }
  }
}

// Resident blocks of `kernel` per SM times the SM count: the grid for kernels that loop over work.
template <class Kernel>
int resident_blocks(Kernel kernel, size_t smem) {
  int device = 0, sms = 0, per_sm = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  return std::max(1, per_sm) * sms;
}

template <WKind K>
void linear_for(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, cudaStream_t s) {
  constexpr int kE = Chunk<K>::kElems;
  const int groups = ceil_div(w.n, kWarps * kRows);
  // Token chunks of 4 share each weight read; more chunks re-read the weight (prefill is a separate path).
  const int mm = m == 1 ? 1 : 4;
  const size_t smem = static_cast<size_t>(mm) * staged_floats(w.k, kE) * sizeof(float);
  const bool staged = w.vec_ok && smem <= kMaxStage;
  const int64_t chunks = (m + mm - 1) / mm;
  NB_CHECK(chunks <= 65535, "linear: too many tokens for one launch");
  if (mm == 1) {
    auto kernel = linear_kernel<K, 1>;
    const int resident = resident_blocks(kernel, staged ? smem : 0);
    // Few rows (under a quarter of the resident warps busy) and enough chunks for kSplitK stripes: split K.
    if (ceil_div(w.n, kRows) * 4 < resident * kWarps && w.k / kE >= 32 * kSplitK) {
      auto split = linear_split_kernel<K>;
      const bool split_staged = staged && smem + 1024 <= 48 * 1024;
      const int split_groups = ceil_div(w.n, (kWarps / kSplitK) * kRows);
      const int grid = std::min(split_groups, resident_blocks(split, split_staged ? smem : 0));
      launch_pdl(split, grid, kThreads, split_staged ? smem : 0, s, w, x, bias, y, split_staged);
      CUDA_CHECK(cudaGetLastError());
      return;
    }
    const int grid = std::min(groups, resident);
    launch_pdl(kernel, dim3(grid, 1), kThreads, staged ? smem : 0, s, w, x, 1, bias, y, staged);
  } else {
    auto kernel = linear_kernel<K, 4>;
    const int grid = std::min(groups, resident_blocks(kernel, staged ? smem : 0));
    launch_pdl(kernel, dim3(grid, static_cast<unsigned>(chunks)), kThreads, staged ? smem : 0, s, w, x, static_cast<int>(m),
                                                                                          bias, y, staged);
  }
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void moe_fc1_for(const ExpertTable& t, const int32_t* ids, int n_pairs, int top_k, const float* x, Glu glu,
                 float limit, float* act, cudaStream_t s) {
  constexpr int kE = Chunk<K>::kElems;
  const size_t smem = static_cast<size_t>(staged_floats(t.d_model, kE)) * sizeof(float);
  // Alignment is per expert; stage only when the activations fill whole chunks (the fast path's need).
  const bool staged = t.d_model % kE == 0 && smem <= kMaxStage;
  auto kernel = moe_fc1_kernel<K>;
  const int pairs = std::min(n_pairs, 65535);
  const int per_pair = std::max(1, resident_blocks(kernel, staged ? smem : 0) / pairs);
  const dim3 grid(std::min(ceil_div(t.d_expert, kWarps), per_pair), pairs);
  launch_pdl(kernel, grid, kThreads, staged ? smem : 0, s, t, ids, n_pairs, top_k, x, glu, limit, act, staged);
  CUDA_CHECK(cudaGetLastError());
}

template <WKind K>
void moe_fc2_for(const ExpertTable& t, const int32_t* ids, const float* weights, int n_tokens, int top_k,
                 const float* act, float* y, cudaStream_t s) {
  constexpr int kE = Chunk<K>::kElems;
  const size_t smem = static_cast<size_t>(top_k) * staged_floats(t.d_expert, kE) * sizeof(float);
  const bool staged = t.d_expert % kE == 0 && smem <= kMaxStage;
  auto kernel = moe_fc2_kernel<K>;
  const int tokens = std::min(n_tokens, 65535);
  const int per_token = std::max(1, resident_blocks(kernel, staged ? smem : 0) / tokens);
  const dim3 grid(std::min(ceil_div(t.d_model, kWarps * kFc2Rows), per_token), tokens);
  launch_pdl(kernel, grid, kThreads, staged ? smem : 0, s, t, ids, weights, n_tokens, top_k, act, y, staged);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_linear(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, bool fp16_acts,
                   cudaStream_t s, const StagedRow* staged) {
  NB_CHECK(m >= 1 && w.n > 0 && w.k > 0 && w.n_parts >= 1 && w.n_parts <= kMaxParts, "linear: bad shapes");
  // FP4 at decode batch sizes: the tensor-core kernels (no per-element fp16 -> fp32 conversion, which caps
  // the kernels below at ~40 % of the read bandwidth): one token streams whole rows (gemv_fp4_stream.cu),
  // 2..8 tokens take gemv_fp4.cu. They decline unaligned rows and m > 8, which keep the CUDA-core path
  // (per-element fallback, token chunks of 4).
  if (launch_linear_fp4_stream(w, x, m, bias, y, fp16_acts, s, staged)) return;  // one token: contiguous row streaming
  if (launch_linear_fp4_mma(w, x, m, bias, y, s)) return;
  switch (w.kind) {
    case WKind::kBF16:
      return linear_for<WKind::kBF16>(w, x, m, bias, y, s);
    case WKind::kF16:
      return linear_for<WKind::kF16>(w, x, m, bias, y, s);
    case WKind::kF32:
      return linear_for<WKind::kF32>(w, x, m, bias, y, s);
    case WKind::kFP8:
      return linear_for<WKind::kFP8>(w, x, m, bias, y, s);
    case WKind::kMXFP4:
      return linear_for<WKind::kMXFP4>(w, x, m, bias, y, s);
    case WKind::kNVFP4:
      return linear_for<WKind::kNVFP4>(w, x, m, bias, y, s);
  }
}

void launch_moe_fc1(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x, Glu glu,
                    float limit, float* act, bool fp16_acts, cudaStream_t s, StagedActs* staged) {
  NB_CHECK(n_pairs >= 1 && t.d_expert > 0, "moe_fc1: bad shapes");
  if (launch_moe_fc1_fp4_stream(t, ids, n_pairs, top_k, x, glu, limit, act, fp16_acts, s, staged)) return;
  if (staged) staged->act = nullptr;  // (only the one-token kernel stages)
  if (launch_moe_fc1_fp4(t, ids, n_pairs, top_k, x, glu, limit, act, s)) return;
  const int np = static_cast<int>(n_pairs);
  switch (t.kind) {
    case WKind::kBF16: return moe_fc1_for<WKind::kBF16>(t, ids, np, top_k, x, glu, limit, act, s);
    case WKind::kF16: return moe_fc1_for<WKind::kF16>(t, ids, np, top_k, x, glu, limit, act, s);
    case WKind::kF32: return moe_fc1_for<WKind::kF32>(t, ids, np, top_k, x, glu, limit, act, s);
    case WKind::kFP8: return moe_fc1_for<WKind::kFP8>(t, ids, np, top_k, x, glu, limit, act, s);
    case WKind::kMXFP4: return moe_fc1_for<WKind::kMXFP4>(t, ids, np, top_k, x, glu, limit, act, s);
    case WKind::kNVFP4: return moe_fc1_for<WKind::kNVFP4>(t, ids, np, top_k, x, glu, limit, act, s);
  }
}

void launch_moe_fc2(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                    const float* act, float* y, bool fp16_acts, cudaStream_t s, PrefetchRanges* prefetch,
                    const StagedActs* staged) {
  NB_CHECK(n_tokens >= 1 && t.d_model > 0, "moe_fc2: bad shapes");
  if (launch_moe_fc2_fp4_stream(t, ids, weights, n_tokens, top_k, act, y, fp16_acts, s, prefetch, staged)) return;
  if (launch_moe_fc2_fp4(t, ids, weights, n_tokens, top_k, act, y, s)) return;
  const int nt = static_cast<int>(n_tokens);
  switch (t.kind) {
    case WKind::kBF16: return moe_fc2_for<WKind::kBF16>(t, ids, weights, nt, top_k, act, y, s);
    case WKind::kF16: return moe_fc2_for<WKind::kF16>(t, ids, weights, nt, top_k, act, y, s);
    case WKind::kF32: return moe_fc2_for<WKind::kF32>(t, ids, weights, nt, top_k, act, y, s);
    case WKind::kFP8: return moe_fc2_for<WKind::kFP8>(t, ids, weights, nt, top_k, act, y, s);
    case WKind::kMXFP4: return moe_fc2_for<WKind::kMXFP4>(t, ids, weights, nt, top_k, act, y, s);
    case WKind::kNVFP4: return moe_fc2_for<WKind::kNVFP4>(t, ids, weights, nt, top_k, act, y, s);
  }
}

}  // namespace nb::cuda
