// See sample.cuh. One block of kThreads per row; every pass re-reads the row (vocab x 4 bytes, from L2).
// A prefix of the sorted order (logit descending, ties by lower id) of length n is kept as (theta, m):
// every token whose key is above theta, plus the m lowest ids whose key equals theta.
#include "kernels/sample.cuh"

#include <algorithm>
#include <cfloat>

#include "backend/cuda/cuda_check.h"
#include "kernels/common.cuh"

namespace nb::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// Order-preserving float -> uint32 (a larger float gives a larger key).
__device__ __forceinline__ uint32_t key_of(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float float_of(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <class T>
__device__ T block_sum(T v, T* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  T total = 0;
  for (int i = 0; i < kWarps; ++i) total += scratch[i];  // the same order in every thread: deterministic
  return total;
}

// Exclusive prefix sum over threads in thread order; *total gets the sum.
template <class T>
__device__ T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  T before = 0, all = 0;
  for (int i = 0; i < kWarps; ++i) {
    if (i < warp) before += scratch[i];
    all += scratch[i];
  }
  *total = all;
  return before + incl - v;
}

struct Shared {
  int hist[256];
  float mass[256];
  int iscratch[kWarps];
  float fscratch[kWarps];
  uint32_t prefix, mask;
  int remaining;
  float rem_mass;
  int above;  // tokens in bins above the chosen ones so far
  int result;
};

// The n-th largest key (n >= 1): sets theta and the number of ties at theta inside the prefix.
__device__ void select_nth(const float* l, int vocab, int n, Shared& sh, uint32_t* theta, int* ties) {
  if (threadIdx.x == 0) sh.prefix = 0, sh.mask = 0, sh.remaining = n;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = sh.prefix, mask = sh.mask;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t k = key_of(l[i]);
      if ((k & mask) == prefix) atomicAdd(&sh.hist[(k >> shift) & 255], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int b = 255;
      for (; b > 0 && sh.hist[b] < sh.remaining; --b) sh.remaining -= sh.hist[b];
      sh.prefix |= static_cast<uint32_t>(b) << shift;
      sh.mask |= 255u << shift;
    }
    __syncthreads();
  }
  *theta = sh.prefix;
  *ties = sh.remaining;
  __syncthreads();
}

__device__ __forceinline__ bool is_greedy(const DevSampleSpec& s) { return s.temperature <= 0.0f || s.top_k == 1; }

// (best, best_i) <- the better of it and (v, i): the larger value, the lower id on ties.
__device__ __forceinline__ void better(float& best, int& best_i, float v, int i) {
  if (v > best || (v == best && i < best_i)) best = v, best_i = i;
}

// Greedy rows: block (s, row) takes the s-th slice of the row, as sample_kernel's argmax (a thread's ids rise,
// so strict > keeps its first; merges prefer lower ids); the last block of the row to finish merges the
// slices' results in slice order.
constexpr int kSplitThreads = 256;
__global__ void __launch_bounds__(kSplitThreads) argmax_split_kernel(const float* __restrict__ logits, int vocab,
                                                                     const DevSampleSpec* __restrict__ specs,
                                                                     int32_t* __restrict__ ids,
                                                                     int32_t* __restrict__ host_ids, ArgmaxScratch sc) {
  const int64_t row = blockIdx.y;
  // The spec before the wait: the host wrote it before the launch (it may be mapped host memory: a PCIe round
  // trip that overlaps the previous kernel; from device memory a copy that precedes this kernel in the stream).
  const bool greedy = is_greedy(specs[row]);
  pdl_wait();
  if (!greedy) return;  // (sample_kernel's row)
  const float* l = logits + row * vocab;
  const int chunk = (vocab + kArgmaxSplit - 1) / kArgmaxSplit, begin = blockIdx.x * chunk;
  const int end = min(vocab, begin + chunk);
  float best = -INFINITY;
  int best_i = vocab;
  for (int i = begin + threadIdx.x; i < end; i += kSplitThreads)
    if (l[i] > best || best_i == vocab) best = l[i], best_i = i;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    better(best, best_i, ob, oi);
  }
  __shared__ float wv[kSplitThreads / 32];
  __shared__ int wi[kSplitThreads / 32];
  __shared__ bool last;
  if ((threadIdx.x & 31) == 0) wv[threadIdx.x >> 5] = best, wi[threadIdx.x >> 5] = best_i;
  __syncthreads();
  if (threadIdx.x == 0) {
    best = wv[0], best_i = wi[0];
    for (int w = 1; w < kSplitThreads / 32; ++w) better(best, best_i, wv[w], wi[w]);
    sc.value[row * kArgmaxSplit + blockIdx.x] = best;
    sc.id[row * kArgmaxSplit + blockIdx.x] = best_i;
    __threadfence();
    last = atomicAdd(sc.count + row, 1u) == kArgmaxSplit - 1;
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  __threadfence();
  best = __ldcg(sc.value + row * kArgmaxSplit), best_i = __ldcg(sc.id + row * kArgmaxSplit);
  for (int b = 1; b < kArgmaxSplit; ++b)
    better(best, best_i, __ldcg(sc.value + row * kArgmaxSplit + b), __ldcg(sc.id + row * kArgmaxSplit + b));
  ids[row] = best_i < vocab ? best_i : 0;  // (an empty slice reports vocab; a row has >= 1 element)
  if (host_ids) host_ids[row] = ids[row];
  sc.count[row] = 0;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ logits, int vocab,
                                                          const DevSampleSpec* __restrict__ specs,
                                                          int32_t* __restrict__ ids, int32_t* __restrict__ host_ids) {
  const int64_t row = blockIdx.x;
  const DevSampleSpec s = specs[row];  // (before the wait, as argmax_split_kernel)
  pdl_wait();  // inputs come from the previous kernel on the stream (see launch_pdl)
  __shared__ Shared sh;
  const float* l = logits + row * vocab;
  if (is_greedy(s)) return;  // (argmax_split_kernel's row)

  // Argmax, lowest id on ties (a thread's ids rise, so strict > keeps its first; merges prefer lower ids).
  float best = -INFINITY;
  int best_i = vocab;
  for (int i = threadIdx.x; i < vocab; i += kThreads)
    if (l[i] > best || best_i == vocab) best = l[i], best_i = i;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
  }
  __shared__ float wbest[kWarps];
  __shared__ int wbest_i[kWarps];
  if ((threadIdx.x & 31) == 0) wbest[threadIdx.x >> 5] = best, wbest_i[threadIdx.x >> 5] = best_i;
  __syncthreads();
  best = wbest[0], best_i = wbest_i[0];
  for (int w = 1; w < kWarps; ++w)
    if (wbest[w] > best || (wbest[w] == best && wbest_i[w] < best_i)) best = wbest[w], best_i = wbest_i[w];
  const float max_logit = best, temp = s.temperature;
  auto weight = [&](float x) { return expf((x - max_logit) / temp); };  // unnormalized probability

  // Top-k prefix: (theta_k, ties_k); its mass z_k.
  const int n_k = s.top_k > 0 && s.top_k < vocab ? s.top_k : vocab;
  uint32_t theta_k = 0;
  int ties_k = 0;
  if (n_k < vocab) {
    select_nth(l, vocab, n_k, sh, &theta_k, &ties_k);
  } else {
    // The whole vocabulary: theta = the smallest key, every tie at it kept.
    uint32_t lo = 0xffffffffu;
    for (int i = threadIdx.x; i < vocab; i += kThreads) lo = min(lo, key_of(l[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    __shared__ uint32_t wlo[kWarps];
    if ((threadIdx.x & 31) == 0) wlo[threadIdx.x >> 5] = lo;
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) lo = min(lo, wlo[w]);
    theta_k = lo;
    int eq = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) eq += key_of(l[i]) == lo;
    ties_k = block_sum(eq, sh.iscratch);
  }
  float m_gt = 0.0f;
  int c_gt = 0;
  for (int i = threadIdx.x; i < vocab; i += kThreads)
    if (key_of(l[i]) > theta_k) m_gt += weight(l[i]), ++c_gt;
  m_gt = block_sum(m_gt, sh.fscratch);
  c_gt = block_sum(c_gt, sh.iscratch);
  const float w_k = weight(float_of(theta_k));
  const float z_k = m_gt + ties_k * w_k;
  int n = n_k;

  // Top-p: the smallest prefix of mass >= top_p * z_k.
  if (s.top_p < 1.0f) {
    const float target = s.top_p * z_k;
    if (m_gt < target) {
      n = c_gt + min(ties_k, max(1, static_cast<int>(ceilf((target - m_gt) / w_k))));
    } else {
      // Radix selection by mass among the keys above theta_k.
      if (threadIdx.x == 0) sh.prefix = 0, sh.mask = 0, sh.rem_mass = target, sh.above = 0;
      for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += kThreads) sh.hist[i] = 0, sh.mass[i] = 0.0f;
        __syncthreads();
        const uint32_t prefix = sh.prefix, mask = sh.mask;
        for (int i = threadIdx.x; i < vocab; i += kThreads) {
          const uint32_t k = key_of(l[i]);
          if (k > theta_k && (k & mask) == prefix) {
            atomicAdd(&sh.hist[(k >> shift) & 255], 1);
            atomicAdd(&sh.mass[(k >> shift) & 255], weight(l[i]));
          }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          // The bin where the running mass reaches the target; if rounding leaves it short, the lowest
          // non-empty bin.
          int chosen = -1, lowest = -1;
          for (int b = 255; b >= 0; --b) {
            if (sh.hist[b] == 0) continue;
            lowest = b;
            if (sh.mass[b] >= sh.rem_mass) {
              chosen = b;
              break;
            }
            sh.rem_mass -= sh.mass[b];
            sh.above += sh.hist[b];
          }
          if (chosen < 0) {  // undo the lowest bin's subtraction and take it
            chosen = lowest;
            sh.rem_mass += sh.mass[lowest];
            sh.above -= sh.hist[lowest];
          }
          sh.prefix |= static_cast<uint32_t>(chosen) << shift;
          sh.mask |= 255u << shift;
          sh.result = sh.hist[chosen];
        }
        __syncthreads();
      }
      const float w_p = weight(float_of(sh.prefix));
      n = sh.above + min(sh.result, max(1, static_cast<int>(ceilf(sh.rem_mass / w_p))));
      n = min(n, n_k);
      __syncthreads();
    }
  }
  // Min-p: tokens with probability >= min_p times the top one (weight 1).
  if (s.min_p > 0.0f) {
    int c = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) c += weight(l[i]) >= s.min_p;
    n = min(n, max(1, block_sum(c, sh.iscratch)));
  }

  uint32_t theta = theta_k;
  int ties = ties_k;
  if (n != n_k) select_nth(l, vocab, n, sh, &theta, &ties);

  // Inverse CDF in id order over the kept tokens: each thread owns a contiguous chunk.
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, static_cast<int>(threadIdx.x) * chunk), end = min(vocab, begin + chunk);
  int eq = 0;
  for (int i = begin; i < end; ++i) eq += key_of(l[i]) == theta;
  int eq_total = 0;
  const int eq_before = block_exclusive_scan(eq, sh.iscratch, &eq_total);
  auto kept = [&](int i, int& rank) {
    const uint32_t k = key_of(l[i]);
    if (k > theta) return true;
    return k == theta && rank++ < ties;
  };
  float mass = 0.0f;
  int rank = eq_before;
  for (int i = begin; i < end; ++i)
    if (kept(i, rank)) mass += weight(l[i]);
  float total = 0.0f;
  const float before = block_exclusive_scan(mass, sh.fscratch, &total);
  const float target = static_cast<float>(s.u * total);
  if (threadIdx.x == 0) sh.result = -1;
  __syncthreads();
  if (target >= before && target < before + mass) {
    float cum = before;
    rank = eq_before;
    int last = -1;
    for (int i = begin; i < end; ++i) {
      if (!kept(i, rank)) continue;
      last = i;
      cum += weight(l[i]);
      if (target < cum) break;
    }
    sh.result = last;  // one thread at most: the ranges do not overlap
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ids[row] = sh.result >= 0 ? sh.result : best_i;  // rounding past the end: the top token
    if (host_ids) host_ids[row] = ids[row];
  }
}

}  // namespace

void launch_sample(const float* logits, int64_t rows, int64_t vocab, const DevSampleSpec* specs, int32_t* ids,
                   int32_t* host_ids, bool greedy, bool sampled, const ArgmaxScratch& scratch, cudaStream_t s) {
  NB_CHECK(rows >= 1 && vocab >= 1 && vocab < (int64_t{1} << 31), "sample: shapes");
  // (Rows in launches of at most 65535, the grid's y limit; each launch's counters are back at zero before the
  // next one's blocks pass their pdl_wait.)
  for (int64_t r0 = 0; greedy && r0 < rows; r0 += 65535) {
    const int64_t n = std::min<int64_t>(65535, rows - r0);
    const ArgmaxScratch sc{scratch.value + r0 * kArgmaxSplit, scratch.id + r0 * kArgmaxSplit, scratch.count};
    launch_pdl(argmax_split_kernel, dim3(kArgmaxSplit, static_cast<unsigned>(n)), dim3(kSplitThreads), 0, s,
               logits + r0 * vocab, static_cast<int>(vocab), specs + r0, ids + r0, host_ids ? host_ids + r0 : nullptr, sc);
  }
  if (sampled)
    launch_pdl(sample_kernel, static_cast<unsigned>(rows), kThreads, 0, s, logits, static_cast<int>(vocab), specs, ids,
               host_ids);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace nb::cuda
