// Tensor-core decode GEMV for FP4 weights (MXFP4, NVFP4) at batch 1..8, on the checkpoint layout as it
// is (row-major codes [n, k/2], scales [n, k/blk]): no repacking.
//
// Why: the CUDA-core kernel in gemv.cu converts every element fp16 -> fp32 (cvt, 16/clk/SM), which caps
// MXFP4 at ~41 % of the read bandwidth (bench/NOTES.md). Here the decoded fp16 values go straight into
// mma.sync.m16n8k16 (fp16 x fp16, fp32 accumulate) and the decode is ~5 integer ops per 2 elements.
// Status (bench/NOTES.md, RESULTS.md): it reached only ~42 % of the read bandwidth on lm_head too, the
// same as gemv.cu for MXFP4 and better for NVFP4 (41 % vs 34 %), slower on 6-8 MB weights; so by
// default launch_linear_fp4_mma takes only NVFP4 weights >= 16 MB at m = 1. The limit is inside the SM
// (deeper memory pipelines did not help), most likely instruction issue; see NOTES.md for next steps.
//
// Work split. A warp owns a tile of 16 rows; lane (g = lane / 4, t = lane % 4) loads, per "span" of 4
// chunks (a chunk = 16 bytes = 32 codes of one row), chunk t of rows g and g + 8 (one 16-byte load each).
// E2M1 -> fp16 by bit operations (common.cuh e2m1x8_scaled): code c gives fp16 bits
// (c & 8) << 12 | (c & 7) << 9 = e2m1(c) * 2^-14 exactly; word w of a chunk yields half2 pairs
// (8w + i, 8w + i + 4), i = 0..3. MMA j (0..7) of a span takes pairs (j/2, 2(j%2)) and (j/2, 2(j%2)+1) as
// the lane's A registers, i.e. the lane's own chunk; the reduction order inside k is a permutation, which
// the B operand follows.
// Block scales: one MMA sums over the 4 lanes' chunks, which are 4 different scale blocks. So column n of
// the MMA receives only the activations of block n % 4 (other lanes give zeros there): C[row][n] is the
// unscaled partial sum of block n % 4, hi half of x for n < 4, lo half for n >= 4. After the MMAs of one
// scale block (8 for MXFP4, 4 for NVFP4) each lane scales its 4 C values by their block factors in fp32.
// Activations: x * 2^s (power of two, so that max |x| lands in [2^14, 2^15)) split into fp16 hi + lo
// (~22 bits), staged in shared memory in B-fragment order; the 2^-s and the weights' 2^-14 come back at
// the end. Products fp16 x fp16 are exact in fp32, so the error is the fp32 accumulation plus x's split.
// One MMA per token per k16 step (the column trick spends the 8 columns on 4 blocks x hi/lo).
// Short-and-wide weights split K over up to 8 warps of a block; partials meet in shared memory in a
// fixed order (deterministic).
#include <algorithm>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "kernels/gemv.cuh"

namespace nb::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSmem = 200 * 1024;  // staged activations (+ the cp.async ring), opt-in above 48 KiB

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight codes of one word -> 4 half2 (pairs (i, i + 4)), each e2m1 * 2^-14.
__device__ __forceinline__ void e2m1x8_half2(uint32_t w, uint32_t (&h)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = w >> (4 * i);
    h[i] = ((s << 9) & 0x0E000E00u) | ((s << 12) & 0x80008000u);
  }
}

constexpr int kStages = 6;  // cp.async ring depth (spans per warp)
struct alignas(16) Slot {   // one lane's span: chunk of rows g and g + 8, and their scale-code words
  uint4 w0, w1;
  uint32_t s0, s1, pad0, pad1;
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, unsigned src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, unsigned src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ uint32_t pack_half2(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) | (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}

// Scale codes: each lane loads its own chunk's codes of rows g and g + 8 with its weights (MXFP4: one
// E8M0 byte per row, NVFP4: two UE4M3 bytes), packed row g in bits 0..15, row g + 8 in bits 16..31; the
// lanes that need them for their C columns get them by shuffle. A chunk past k has code 0, whose factor
// (2^-127 or 0) multiplies a zero partial sum.
template <WKind K>
struct Fp4;
template <>
struct Fp4<WKind::kMXFP4> {
  static constexpr int kSub = 1;  // scale blocks per 32-code chunk
  __device__ static uint32_t load(const uint8_t* s0, const uint8_t* s1, int chunk) {
    return static_cast<uint32_t>(__ldg(s0 + chunk)) | (static_cast<uint32_t>(__ldg(s1 + chunk)) << 16);
  }
  __device__ static const uint8_t* code_ptr(const uint8_t* srow, int chunk) { return srow + chunk; }
  // The codes from the aligned words that contain them (cp.async path).
  __device__ static uint32_t extract(uint32_t w0, uint32_t w1, const uint8_t* s0, const uint8_t* s1, int chunk) {
    const int b0 = static_cast<int>(reinterpret_cast<uintptr_t>(s0 + chunk) & 3);
    const int b1 = static_cast<int>(reinterpret_cast<uintptr_t>(s1 + chunk) & 3);
    return ((w0 >> (8 * b0)) & 0xffu) | (((w1 >> (8 * b1)) & 0xffu) << 16);
  }
  // Factors of rows g (f[0]) and g + 8 (f[1]) for scale block sb of the chunk whose codes are v.
  __device__ static void factors(uint32_t v, int, const DevPart&, const DevPart&, float (&f)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t c = (v >> (16 * r)) & 0xffu;
      f[r] = c == 0 ? __uint_as_float(0x00400000u) : c == 0xffu ? __uint_as_float(0x7fc00000u) : __uint_as_float(c << 23);
    }
  }
  __device__ static int64_t scale_stride(int k) { return k / 32; }
};
template <>
struct Fp4<WKind::kNVFP4> {
  static constexpr int kSub = 2;
  __device__ static uint32_t load(const uint8_t* s0, const uint8_t* s1, int chunk) {
    // Row strides are k / 16 bytes with k % 32 == 0: 2-byte aligned.
    return static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(s0) + chunk)) |
           (static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(s1) + chunk)) << 16);
  }
  __device__ static const uint8_t* code_ptr(const uint8_t* srow, int chunk) { return srow + 2 * chunk; }
  __device__ static uint32_t extract(uint32_t w0, uint32_t w1, const uint8_t* s0, const uint8_t* s1, int chunk) {
    const int b0 = static_cast<int>(reinterpret_cast<uintptr_t>(s0 + 2 * chunk) & 3);
    const int b1 = static_cast<int>(reinterpret_cast<uintptr_t>(s1 + 2 * chunk) & 3);
    return ((w0 >> (8 * b0)) & 0xffffu) | (((w1 >> (8 * b1)) & 0xffffu) << 16);
  }
  // UE4M3 in software: the 7 code bits at fp16 bits 7..13 make ue4m3 * 2^-8 exactly (as the FP8 GEMV);
  // times 256 is exact, then the global scale in the part's own convention (same rounding as formats/).
  // The NaN code 0x7F decodes as a finite value (never in a valid weight).
  __device__ static void factors(uint32_t v, int sb, const DevPart& p0, const DevPart& p1, float (&f)[2]) {
    const uint32_t h = ((v >> (8 * sb)) & 0x007f007fu) << 7;  // row g in the low half, row g + 8 high
    float u[2];
    half2_bits_to_float2(h, u[0], u[1]);
    const DevPart* p[2] = {&p0, &p1};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float a = u[r] * 256.0f;
      f[r] = p[r]->divide ? a / p[r]->global : a * p[r]->global;
    }
  }
  __device__ static int64_t scale_stride(int k) { return k / 16; }
};

// Shared memory per token: [4 quads][nchp chunks][hi, lo] uint4; quad q of chunk c holds the half2 pairs
// (x[32c + 8q + i], x[32c + 8q + i + 4]), i = 0..3 -- exactly the B registers of MMAs 2q and 2q + 1.
template <WKind K, int M, bool kPipe>
__global__ void __launch_bounds__(kThreads, 2) fp4_mma_kernel(const __grid_constant__ DevWeight w,
                                                           const float* __restrict__ x, int m,
                                                           const float* __restrict__ bias,
                                                           float* __restrict__ y, int ksplit, int pf) {
  extern __shared__ uint4 xs[];
  __shared__ float red[kWarps][M][16];
  __shared__ float wmax[kWarps][M];
  __shared__ float unscale[M];
  __shared__ float prescale[M];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int k = w.k, n = w.n;
  const int n_chunks = k / 32, spans = (n_chunks + 3) / 4, nchp = spans * 4;
  using F = Fp4<K>;
  // Spans whose loads are issued together (2 x 16 B per lane each, double-buffered); fewer for many
  // tokens, whose accumulators take the registers.
  constexpr int kUnroll = M == 1 ? 3 : M <= 4 ? 2 : 1;
  const int tpb = kWarps / ksplit, part = warp % ksplit;
  const int n_tiles = (n + 15) / 16, groups = (n_tiles + tpb - 1) / tpb;
  const int spp = (spans + ksplit - 1) / ksplit, s_begin = part * spp, s_end = min(spans, s_begin + spp);
  const int64_t sstride = F::scale_stride(k);
  // The weights do not come from the previous kernel: start pulling this block's first spans into L2
  // while it finishes (a hint only, so no ordering question against a kernel that writes weights).
  if (blockIdx.x < groups) {
    const int tile = blockIdx.x * tpb + warp / ksplit;
    if (tile < n_tiles) {
      int r0 = min(tile * 16 + g, n - 1), r1 = min(tile * 16 + g + 8, n - 1);
      const DevPart& p0 = find_part(w, r0);
      const DevPart& p1 = find_part(w, r1);
      for (int u = 0; u < 2 * kUnroll; ++u) {
        const int c = (s_begin + u) * 4 + tq;
        if (s_begin + u >= s_end || c >= n_chunks) break;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p0.data + static_cast<int64_t>(r0) * (k / 2) + 16 * c));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p1.data + static_cast<int64_t>(r1) * (k / 2) + 16 * c));
      }
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p0.scales + r0 * sstride + s_begin * 4 * F::kSub));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p1.scales + r1 * sstride + s_begin * 4 * F::kSub));
    }
  }
  pdl_wait();  // inputs (x) come from the previous kernel on the stream (see launch_pdl)

  // 1. Per-token power-of-two scale from max |x|: one pass over x, the first kCache items of each thread
  //    kept in registers for step 2 (all of x for m * k <= 4096). Item = 8 floats (token, chunk, quad).
  constexpr int kCache = 2;
  const int items = m * nchp * 4;
  float4 cache[kCache][2];
  {
    float mx[M];
#pragma unroll
    for (int t = 0; t < M; ++t) mx[t] = 0.0f;
    auto item_max = [&](int f, float4& a, float4& b) {
      const int t = f / (nchp * 4), r = f % (nchp * 4), c = r >> 2, q = r & 3;
      a = b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (c < n_chunks) {
        const float4* src = reinterpret_cast<const float4*>(x + static_cast<int64_t>(t) * k + 32 * c + 8 * q);
        a = __ldg(src), b = __ldg(src + 1);
      }
      const float v = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                            fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
#pragma unroll
      for (int tt = 0; tt < M; ++tt)
        if (tt == t) mx[tt] = fmaxf(mx[tt], v);
    };
#pragma unroll
    for (int i = 0; i < kCache; ++i) {
      const int f = threadIdx.x + i * kThreads;
      if (f < items) item_max(f, cache[i][0], cache[i][1]);
    }
    for (int f = threadIdx.x + kCache * kThreads; f < items; f += kThreads) {
      float4 a, b;
      item_max(f, a, b);
    }
#pragma unroll
    for (int t = 0; t < M; ++t) {
      const float v = warp_max(mx[t]);
      if (lane == 0) wmax[warp][t] = v;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      float v = 0.0f;
      for (int q = 0; q < kWarps; ++q) v = fmaxf(v, wmax[q][threadIdx.x]);
      int e = 0;
      if (v > 0.0f && v <= 3.4e38f) frexpf(v, &e);  // v in [2^(e-1), 2^e)
      const int sh = max(-120, min(120, 15 - e));
      prescale[threadIdx.x] = ldexpf(1.0f, sh);
      unscale[threadIdx.x] = ldexpf(1.0f, -sh) * 16384.0f;  // also undoes the weights' 2^-14
    }
    __syncthreads();
  }
  // 2. Stage x as fp16 hi + lo in B-fragment order; chunks past k are zero.
  auto stage = [&](int f, const float4& a, const float4& b) {
    const int t = f / (nchp * 4), r = f % (nchp * 4), c = r >> 2, q = r & 3;
    const float sc = prescale[t];
    const float v[8] = {a.x * sc, a.y * sc, a.z * sc, a.w * sc, b.x * sc, b.y * sc, b.z * sc, b.w * sc};
    uint32_t h[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half h0 = __float2half_rn(v[i]), h1 = __float2half_rn(v[i + 4]);
      h[i] = pack_half2(h0, h1);
      l[i] = pack_half2(__float2half_rn(v[i] - __half2float(h0)), __float2half_rn(v[i + 4] - __half2float(h1)));
    }
    uint4* dst = xs + static_cast<int64_t>(t) * nchp * 8 + (q * nchp + c) * 2;
    dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
    dst[1] = make_uint4(l[0], l[1], l[2], l[3]);
  };
#pragma unroll
  for (int i = 0; i < kCache; ++i) {
    const int f = threadIdx.x + i * kThreads;
    if (f < items) stage(f, cache[i][0], cache[i][1]);
  }
  for (int f = threadIdx.x + kCache * kThreads; f < items; f += kThreads) {
    const int t = f / (nchp * 4), r = f % (nchp * 4), c = r >> 2, q = r & 3;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
    if (c < n_chunks) {
      const float4* src = reinterpret_cast<const float4*>(x + static_cast<int64_t>(t) * k + 32 * c + 8 * q);
      a = __ldg(src), b = __ldg(src + 1);
    }
    stage(f, a, b);
  }
  __syncthreads();

  const bool b_lane = (g & 3) == tq;  // this lane feeds MMA column g (block g % 4 = its own chunk)
  const int hl = g >> 2;              // column g < 4: hi half, else lo half

  for (int grp = blockIdx.x; grp < groups; grp += gridDim.x) {  // uniform over the block: it synchronizes
    const int tile = grp * tpb + warp / ksplit;
    float acc[M][4];
#pragma unroll
    for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    if (tile < n_tiles) {
      int r0 = min(tile * 16 + g, n - 1), r1 = min(tile * 16 + g + 8, n - 1);
      const DevPart& p0 = find_part(w, r0);
      const DevPart& p1 = find_part(w, r1);
      const uint4* d0 = reinterpret_cast<const uint4*>(p0.data + static_cast<int64_t>(r0) * (k / 2));
      const uint4* d1 = reinterpret_cast<const uint4*>(p1.data + static_cast<int64_t>(r1) * (k / 2));
      const uint8_t* s0 = p0.scales + r0 * sstride;
      const uint8_t* s1 = p1.scales + r1 * sstride;
      // One span: 8 MMAs per token on the lane's chunk of rows g, g + 8 (codes w0, w1; scale codes sc).
      auto compute_span = [&](int span, const uint4& w0, const uint4& w1, uint32_t sc) {
        uint32_t a0[4][4], a1[4][4];  // [word][pair] for rows g and g + 8
        e2m1x8_half2(w0.x, a0[0]), e2m1x8_half2(w0.y, a0[1]), e2m1x8_half2(w0.z, a0[2]), e2m1x8_half2(w0.w, a0[3]);
        e2m1x8_half2(w1.x, a1[0]), e2m1x8_half2(w1.y, a1[1]), e2m1x8_half2(w1.z, a1[2]), e2m1x8_half2(w1.w, a1[3]);
        // C columns 2tq + e hold block (chunk) 2(tq & 1) + e of this span: its codes from that lane.
        const uint32_t v0 = __shfl_sync(0xffffffffu, sc, (lane & ~3) | (2 * (tq & 1)));
        const uint32_t v1 = __shfl_sync(0xffffffffu, sc, (lane & ~3) | (2 * (tq & 1) + 1));
#pragma unroll
        for (int sb = 0; sb < F::kSub; ++sb) {
          float ct[M][4];
#pragma unroll
          for (int t = 0; t < M; ++t) ct[t][0] = ct[t][1] = ct[t][2] = ct[t][3] = 0.0f;
#pragma unroll
          for (int j = sb * 8 / F::kSub; j < (sb + 1) * 8 / F::kSub; ++j) {
            const int wd = j >> 1, i0 = 2 * (j & 1);
#pragma unroll
            for (int t = 0; t < M; ++t) {
              if (t >= m) break;
              // B: the lane's own chunk of token t (zeros on lanes that do not feed their column).
              const uint4 bq = b_lane ? xs[static_cast<int64_t>(t) * nchp * 8 + (wd * nchp + span * 4 + tq) * 2 + hl]
                                      : make_uint4(0, 0, 0, 0);
              mma16816(ct[t], a0[wd][i0], a1[wd][i0], a0[wd][i0 + 1], a1[wd][i0 + 1], (j & 1) ? bq.z : bq.x,
                       (j & 1) ? bq.w : bq.y);
            }
          }
          float fa[2], fb[2];
          F::factors(v0, sb, p0, p1, fa);
          F::factors(v1, sb, p0, p1, fb);
          const float f[4] = {fa[0], fb[0], fa[1], fb[1]};
#pragma unroll
          for (int t = 0; t < M; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[t][q] = fmaf(ct[t][q], f[q], acc[t][q]);
        }
      };
      if constexpr (kPipe) {
        // cp.async ring of kStages spans per warp in shared memory: each lane copies and later reads only
        // its own slot (so no barrier), kStages - 1 spans in flight without holding registers. Scale codes
        // travel as the aligned 4-byte word that contains them (cudaMalloc granularity keeps it in bounds).
        Slot* ring = reinterpret_cast<Slot*>(xs + static_cast<int64_t>(M) * nchp * 8) + (warp * kStages) * 32 + lane;
        auto issue = [&](int span) {
          Slot* sl = ring + ((span - s_begin) % kStages) * 32;
          const int c = span * 4 + tq;
          const bool ok = span < s_end && c < n_chunks;
          const unsigned sz = ok ? 16u : 0u;
          const uint8_t* a0p = ok ? F::code_ptr(s0, c) : s0;
          const uint8_t* a1p = ok ? F::code_ptr(s1, c) : s1;
          cp_async16(&sl->w0, ok ? d0 + c : d0, sz);
          cp_async16(&sl->w1, ok ? d1 + c : d1, sz);
          cp_async4(&sl->s0, reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(a0p) & ~uintptr_t{3}), ok ? 4u : 0u);
          cp_async4(&sl->s1, reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(a1p) & ~uintptr_t{3}), ok ? 4u : 0u);
          asm volatile("cp.async.commit_group;\n" ::);
        };
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) issue(s_begin + i);
        for (int span = s_begin; span < s_end; ++span) {
          issue(span + kStages - 1);
          asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1) : "memory");
          const Slot* sl = ring + ((span - s_begin) % kStages) * 32;
          const int c = span * 4 + tq;
          const uint32_t sc = F::extract(sl->s0, sl->s1, s0, s1, c);
          compute_span(span, sl->w0, sl->w1, c < n_chunks ? sc : 0u);
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      } else {
        // Double-buffered: the next kUnroll spans' weights and scale codes are in flight while these compute.
        uint4 raw[kUnroll][2];
        uint32_t sc[kUnroll];
        auto load = [&](int s, uint4 (&rw)[kUnroll][2], uint32_t (&scc)[kUnroll]) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int c = (s + u) * 4 + tq;
            const bool ok = s + u < s_end && c < n_chunks;
            rw[u][0] = ok ? __ldg(d0 + c) : make_uint4(0, 0, 0, 0);
            rw[u][1] = ok ? __ldg(d1 + c) : make_uint4(0, 0, 0, 0);
            scc[u] = ok ? F::load(s0, s1, c) : 0u;
          }
        };
        load(s_begin, raw, sc);
        for (int s = s_begin; s < s_end; s += kUnroll) {
          uint4 nraw[kUnroll][2];
          uint32_t nsc[kUnroll];
          load(s + kUnroll, nraw, nsc);
          // Deeper than the registers allow: pull the spans pf ahead into L2 (no registers held).
          if (pf > 0) {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int c = (s + pf + u) * 4 + tq;
              if (s + pf + u < s_end && c < n_chunks) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(d0 + c));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(d1 + c));
              }
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (s + u >= s_end) break;
            compute_span(s + u, raw[u][0], raw[u][1], sc[u]);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) raw[u][0] = nraw[u][0], raw[u][1] = nraw[u][1], sc[u] = nsc[u];
        }
      }
    }
    // Rows g and g + 8: sum the lane's two columns, then the 4 lanes of the group.
#pragma unroll
    for (int t = 0; t < M; ++t) {
      float v0 = acc[t][0] + acc[t][1], v1 = acc[t][2] + acc[t][3];
      v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
      v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
      v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
      v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
      if (tq == 0) red[warp][t][g] = v0, red[warp][t][g + 8] = v1;
    }
    __syncthreads();
    if (part == 0 && tile < n_tiles && lane < 16) {
      const int row = tile * 16 + lane;
      if (row < n) {
        const float bv = bias ? bias[row] : 0.0f;
#pragma unroll
        for (int t = 0; t < M; ++t) {
          if (t >= m) break;
          float v = red[warp][t][lane];
          for (int q = 1; q < ksplit; ++q) v += red[warp + q][t][lane];
          y[static_cast<int64_t>(t) * n + row] = v * unscale[t] + bv;
        }
      }
    }
    __syncthreads();
  }
}

template <WKind K, int M, bool kPipe>
bool launch_for_pipe(const DevWeight& w, const float* x, int m, const float* bias, float* y, cudaStream_t s) {
  const int n_chunks = w.k / 32, spans = (n_chunks + 3) / 4;
  auto kernel = fp4_mma_kernel<K, M, kPipe>;
  const size_t smem = static_cast<size_t>(M) * spans * 4 * 8 * sizeof(uint4) +
                      (kPipe ? static_cast<size_t>(kWarps) * kStages * 32 * sizeof(Slot) : 0);
  // Opt in to more than 48 KiB once, up to what this device allows (sm_120 has ~100 KiB per block,
  // sm_90 227 KiB); larger shapes fall back.
  static const size_t limit = [&] {
    int dev = 0, optin = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    cudaFuncAttributes fa{};
    CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    const int lim = std::min(kMaxSmem, optin - static_cast<int>(fa.sharedSizeBytes));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lim));
    return static_cast<size_t>(std::max(lim, 0));
  }();
  if (smem > limit) return false;
  int device = 0, sms = 0, per_sm = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int resident = std::max(1, per_sm) * sms;
  // Split K for weights whose row tiles fit one wave of resident blocks: the most warps (largest split,
  // every part keeping >= 2 spans) that still fits one wave, since a second wave of a latency-bound
  // kernel costs a whole extra latency. Tall weights (lm_head) loop over row tiles without a split.
  const int n_tiles = ceil_div(w.n, 16);
  int ksplit = 1;
  for (int ks = kWarps; ks >= 2; ks /= 2)
    if (spans >= 2 * ks && ceil_div(n_tiles, kWarps / ks) <= resident) {
      ksplit = ks;
      break;
    }
  const int groups = ceil_div(n_tiles, kWarps / ksplit);
  const int grid = std::min(groups, resident);
  // Tuning knob for measurements: NIBBLE_FP4_PREFETCH = spans of L2 prefetch ahead (0 = off).
  static const int pf = [] {
    const char* e = std::getenv("NIBBLE_FP4_PREFETCH");
    return e ? std::atoi(e) : 2 * (M == 1 ? 3 : M <= 4 ? 2 : 1);
  }();
  launch_pdl(kernel, grid, kThreads, smem, s, w, x, m, bias, y, ksplit, pf);
  CUDA_CHECK(cudaGetLastError());
  return true;
}

// NIBBLE_FP4_PIPE=1: the cp.async ring instead of register double-buffering (measurement knob).
template <WKind K, int M>
bool launch_for(const DevWeight& w, const float* x, int m, const float* bias, float* y, cudaStream_t s) {
  static const bool pipe = [] {
    const char* e = std::getenv("NIBBLE_FP4_PIPE");
    return e && e[0] == '1';
  }();
  return pipe ? launch_for_pipe<K, M, true>(w, x, m, bias, y, s) : launch_for_pipe<K, M, false>(w, x, m, bias, y, s);
}

}  // namespace

bool launch_linear_fp4_mma(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                           cudaStream_t s) {
  // NIBBLE_FP4_MMA: "0" never, "1" every weight the kernel can take (the CUDA tests set it, so every
  // shape runs through it), unset: only where it measured faster than the CUDA-core kernels on the H200
  // (bench/RESULTS.md 2026-11-22, tensor-core entry): NVFP4 weights of >= 16 MB at m = 1 (lm_head: 41 %
  // vs 34 % of the read bandwidth; m > 1 was tested for correctness but not timed). MXFP4 measured equal on lm_head and slower on the 6-8 MB QKV/O (16 % vs 21 %),
  // NVFP4 QKV slower (16 % vs 19 %): this kernel's prologue (max |x| pass, staging, two barriers) costs
  // more latency than it saves there, so those keep the CUDA-core path until the kernel is faster.
  static const int mode = [] {
    const char* e = std::getenv("NIBBLE_FP4_MMA");
    return e ? (e[0] == '0' ? 0 : e[0] == '1' ? 1 : 2) : 2;
  }();
  if (mode == 0 || (w.kind != WKind::kMXFP4 && w.kind != WKind::kNVFP4) || !w.vec_ok || w.k % 32 != 0 || m < 1 ||
      m > 8)
    return false;
  if (mode == 2 && !(w.kind == WKind::kNVFP4 && m == 1 && static_cast<int64_t>(w.n) * w.k / 2 >= (int64_t{16} << 20)))
    return false;
  const int mm = static_cast<int>(m);
  if (w.kind == WKind::kMXFP4) {
    if (m == 1) return launch_for<WKind::kMXFP4, 1>(w, x, mm, bias, y, s);
    if (m == 2) return launch_for<WKind::kMXFP4, 2>(w, x, mm, bias, y, s);
    if (m <= 4) return launch_for<WKind::kMXFP4, 4>(w, x, mm, bias, y, s);
    return launch_for<WKind::kMXFP4, 8>(w, x, mm, bias, y, s);
  }
  if (m == 1) return launch_for<WKind::kNVFP4, 1>(w, x, mm, bias, y, s);
  if (m == 2) return launch_for<WKind::kNVFP4, 2>(w, x, mm, bias, y, s);
  if (m <= 4) return launch_for<WKind::kNVFP4, 4>(w, x, mm, bias, y, s);
  return launch_for<WKind::kNVFP4, 8>(w, x, mm, bias, y, s);
}

}  // namespace nb::cuda
