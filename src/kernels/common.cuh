// What every kernel family shares: the device-side weight descriptor (DevWeight, built by the backend
// from a model Weight whose bytes are on the device), exact software decoding of its elements, warp
// reductions and the KV-cache element codecs. Activations are fp32 everywhere (see cuda_backend.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <utility>

#include "backend/cuda/cuda_check.h"
#include "formats/blocks.h"

namespace nb::cuda {

// Storage kinds a kernel can read. Dense weights keep their checkpoint dtype.
enum class WKind : uint8_t { kBF16, kF16, kF32, kFP8, kMXFP4, kNVFP4 };

// One checkpoint tensor's rows of a weight (see model/weight.h WeightPart), device pointers.
struct DevPart {
  const uint8_t* data = nullptr;    // dense [rows, k] elements; FP8 [rows, k]; FP4 [rows, k/2] codes
  const uint8_t* scales = nullptr;  // MXFP4 [rows, k/32] E8M0; NVFP4 [rows, k/16] UE4M3; FP8 [rows] F32
  float global = 1.0f;              // NVFP4 global scale, in the part's own convention
  int32_t rows = 0;
  bool divide = false;  // NVFP4 compressed-tensors: value = e2m1 * ue4m3 / global
};

inline constexpr int kMaxParts = 4;

// A benchmark knob of the kernel launchers: NAME=0 in the environment turns a path off (read once per
// process by the caller's static; Model::load rejects values other than 0 and 1).
inline bool knob_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e && e[0] == '0');
}

// A weight [n, k] on the device; passed to kernels by value (or read from global for expert tables).
struct DevWeight {
  WKind kind = WKind::kBF16;
  int32_t n = 0, k = 0;
  int32_t n_parts = 0;
  bool vec_ok = false;  // every row starts 16-byte aligned and k fills whole 16-byte chunks
  DevPart part[kMaxParts];
};

// Which part holds `row`, and the row inside it.
__device__ __forceinline__ const DevPart& find_part(const DevWeight& w, int& row) {
  int p = 0;
  while (p + 1 < w.n_parts && row >= w.part[p].rows) row -= w.part[p++].rows;
  return w.part[p];
}

__device__ __forceinline__ float nvfp4_factor(const DevPart& p, uint8_t scale) {
  return fmt::nvfp4_block_factor(scale, p.global, p.divide ? fmt::GlobalScale::kDivide : fmt::GlobalScale::kMultiply);
}

// Element (row, j) of w decoded to fp32 exactly, through formats/ codecs. The slow path: embeddings,
// unaligned weights and re-quantization read it; GEMV kernels decode 16-byte chunks instead.
__device__ __forceinline__ float weight_at(const DevWeight& w, int row, int j) {
  const DevPart& p = find_part(w, row);
  const int64_t k = w.k;
  switch (w.kind) {
    case WKind::kBF16:
      return fmt::bf16_to_float(reinterpret_cast<const uint16_t*>(p.data)[row * k + j]);
    case WKind::kF16:
      return __half2float(reinterpret_cast<const __half*>(p.data)[row * k + j]);
    case WKind::kF32:
      return reinterpret_cast<const float*>(p.data)[row * k + j];
    case WKind::kFP8:
      return fmt::e4m3_to_float(p.data[row * k + j]) * reinterpret_cast<const float*>(p.scales)[row];
    case WKind::kMXFP4: {
      const uint8_t b = p.data[row * (k / 2) + j / 2];
      return fmt::e2m1_to_float(j & 1 ? fmt::e2m1_high(b) : fmt::e2m1_low(b)) *
             fmt::e8m0_to_float(p.scales[row * (k / 32) + j / 32]);
    }
    case WKind::kNVFP4: {
      const uint8_t b = p.data[row * (k / 2) + j / 2];
      return fmt::e2m1_to_float(j & 1 ? fmt::e2m1_high(b) : fmt::e2m1_low(b)) *
             nvfp4_factor(p, p.scales[row * (k / 16) + j / 16]);
    }
  }
  return 0.0f;
}

// Eight E2M1 codes (one little-endian word, element i in nibble i) to fp32, in software: each code's
// 3 magnitude bits go to an fp16's exponent/mantissa (bits 9..11) and its sign to bit 15, which makes
// the fp16 exactly e2m1 * 2^-14 (code 1 lands on the fp16 subnormal 2^-15). Callers multiply 2^14 back
// into the block factor. Output order: out[i] = element i.
__device__ __forceinline__ void half2_bits_to_float2(uint32_t h, float& lo, float& hi) {
  // Straight register conversions (a reinterpret through memory can land in local memory).
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
}

// Nibbles 0 and 4 of s (elements 0 and 4 of its word) as an fp16 pair (low, high half), each e2m1 * 2^-14.
__device__ __forceinline__ uint32_t e2m1_pair_scaled(uint32_t s) {
  return ((s << 9) & 0x0E000E00u) | ((s << 12) & 0x80008000u);
}

__device__ __forceinline__ void e2m1x8_scaled(uint32_t w, float (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) half2_bits_to_float2(e2m1_pair_scaled(w >> (4 * i)), out[i], out[i + 4]);
}
inline constexpr float kE2m1Unscale = 16384.0f;  // 2^14, undoes e2m1x8_scaled's factor

// A code word's 8 E2M1 codes (nibble i = element i) as 4 fp16 pairs h[i] = (element i, element i + 4),
// each equal to e2m1 * 2^-14: the sign bit goes to fp16 bit 15 and the 3 magnitude bits to 9..11
// (exponent 0..3, mantissa top bit), so code 1 lands on the subnormal 2^-15. 11 integer ops for 8 codes:
// one shift + LOP3 gives, per byte, the even nibble's magnitude at bits 0..2 and its sign at bit 6
// (`ev`), another the odd nibble's magnitude at 1..3 and sign at 7 (`od`); then each pair is one shift
// and mask (or just the mask) away. Bits outside the mask are don't-cares throughout.
// The selects are inline PTX: written in C++ the compiler pushes each output's mask back through the
// shifts and ends with ~14 ops per word instead of 11.
__device__ __forceinline__ uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {  // (a & mask) | (b & ~mask)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
  return r;
}
__device__ __forceinline__ void e2m1_word(uint32_t q, uint32_t (&h)[4]) {
  constexpr uint32_t kMask = 0x8E008E00u;  // fp16 sign + bits 9..11, both halves
  const uint32_t ev = select_bits(0x07070707u, q, q << 3);  // even nibble: magnitude 0..2, sign at 6
  const uint32_t od = select_bits(0x0F0F0F0Fu, q >> 3, q);  // odd nibble: magnitude 1..3, sign at 7
  h[0] = (ev << 9) & kMask;  // bytes 0, 2: elements 0, 4
  h[1] = (od << 8) & kMask;  // elements 1, 5
  h[2] = (ev << 1) & kMask;  // bytes 1, 3: elements 2, 6
  h[3] = od & kMask;         // elements 3, 7
}

// --- fp16 activations for the tensor-core kernels (decode GEMV, prefill GEMMs) -----------------------
// A row of x is scaled by 2^s so that max |x| lands in [2^14, 2^15) (no fp16 overflow, the lo parts stay
// normal) and split into fp16 hi + lo (x - hi): ~22 bits, and fp16 x fp16 products are exact in fp32.
// Inside each octet of 8 elements the order is 0 4 1 5 2 6 3 7: the pairs the E2M1 word decodes yield.

// The power-of-two shift s (|s| <= 120) that puts a row's max |x| = mx in [2^(top - 1), 2^top) (NaN/inf rows
// keep scale 1): top 15 for fp16 (fp16_prescale_shift), 8 for E4M3 (the FP8 GEMM tile's activations).
__device__ __forceinline__ int pow2_prescale_shift(float mx, int top) {
  int e = 0;
  if (mx > 0.0f && mx <= 3.4e38f) frexpf(mx, &e);  // mx in [2^(e-1), 2^e)
  return max(-120, min(120, top - e));
}
// s for a row whose max |x| is mx.
__device__ __forceinline__ int fp16_prescale_shift(float mx) { return pow2_prescale_shift(mx, 15); }

// 2^s for |s| <= 126 (fp16_prescale_shift's range), from its bits: ldexpf's special cases are ~20
// instructions on a path the one-token kernels run once per launch, cold, with the block waiting.
__device__ __forceinline__ float pow2f(int s) { return __int_as_float((127 + s) << 23); }

__device__ __forceinline__ uint32_t pack_half2(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) | (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}

// a * b on fp16x2 bit patterns, round to nearest.
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// One octet v (already scaled) -> its hi and lo halves in the octet order above.
__device__ __forceinline__ void split_octet(const float (&v)[8], uint4& hi, uint4& lo) {
  uint32_t h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half h0 = __float2half_rn(v[i]), h1 = __float2half_rn(v[i + 4]);
    h[i] = pack_half2(h0, h1);
    l[i] = pack_half2(__float2half_rn(v[i] - __half2float(h0)), __float2half_rn(v[i + 4] - __half2float(h1)));
  }
  hi = make_uint4(h[0], h[1], h[2], h[3]);
  lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// 16 bytes global -> shared without registers (sm_80 and later), through L2 only (.cg: never a stale L1 line
// of data an earlier kernel wrote); valid false writes zeros. Completed by cp_async_commit + cp_async_wait<N>
// (all but the newest N groups).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// c += a b, one mma.sync m16n8k16 with fp16 operands and fp32 accumulators (sm_80 and later).
__device__ __forceinline__ void mma_f16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// The hardware exp2 (MUFU, ~2 ulp) instead of the accurate expf (~8 instructions more on the tail of every
// one-token FC1 unit). The IEEE division stays: without its slow-path call ptxas interleaved the tail with
// the next unit and FC1 spilled 48-56 bytes (sm_90a).
__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }

// The GLU of one MoE output from its gate and up sums (biases added): gpt-oss's clamped SwiGLU or plain
// SiLU, the CPU reference's expressions (formats.md §2.4).
__device__ __forceinline__ float glu_value(float g, float u, bool gpt_oss, float limit) {
  if (!gpt_oss) return g * sigmoidf(g) * u;
  g = fminf(g, limit);
  u = fminf(fmaxf(u, -limit), limit);
  return g * sigmoidf(1.702f * g) * (u + 1.0f);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// KV-cache element codecs: fp32 (exact), BF16 (round to nearest even) and FP8 E4M3 (satfinite, scale 1).
enum class KvKind : uint8_t { kF32, kBF16, kFP8 };

template <KvKind K>
struct KvElem;
template <>
struct KvElem<KvKind::kF32> {
  using T = float;
  __device__ static T enc(float x) { return x; }
  __device__ static float dec(T v) { return v; }
};
template <>
struct KvElem<KvKind::kBF16> {
  using T = uint16_t;
  __device__ static T enc(float x) { return fmt::float_to_bf16(x); }
  __device__ static float dec(T v) { return fmt::bf16_to_float(v); }
};
template <>
struct KvElem<KvKind::kFP8> {
  using T = uint8_t;
  __device__ static T enc(float x) { return fmt::float_to_e4m3(x); }
  __device__ static float dec(T v) { return fmt::e4m3_to_float(v); }
};

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Programmatic dependent launch (sm_90 and later): a kernel started with launch_pdl may be scheduled
// while the previous kernel on the stream is still finishing, which hides most of the launch gap between
// the small dependent kernels of a decode layer. Every such kernel calls pdl_wait() before it touches
// global memory the previous kernels write: it returns once the previous grid has completed and its writes
// are visible, so the stream order is kept exactly (and transitively: the previous grid completed only
// after its own wait returned). Inside CUDA graphs the dependency becomes a programmatic edge.
// The next kernel is allowed to launch *before* the wait: it launches once every block of ours has
// started (so its blocks cannot crowd ours out) and sits in its own pdl_wait(), but its blocks are resident
// as early as resources allow and issue what does not depend on us (weights, descriptors) meanwhile. With
// the trigger after the wait, a kernel could only launch after its predecessor's predecessor had finished
// (measured: the QKV GEMV started ~0.7 us after the residual RMSNorm's wait, NOTES.md seventh session).
// Loads before the wait of data that changes between launches (routes, batch metadata, the KV cache) go
// through L2 (__ldcg, ld.global.cg): an L1 hit before the wait can return a line from before earlier
// kernels' writes (measured: decode attention loading its first cached keys before the wait broke the
// greedy goldens until those loads bypassed L1; NOTES.md eighth session). Weights, written once at load
// time, may use any path.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The wait and the trigger apart, for a kernel that lets its successor launch only after its own prologue:
// the one-token MoE FC1 with deferred routes (gemv.cuh, RouteLogits), whose block 0 writes the routes and
// fences them (__threadfence: performed at L2 before the trigger issues) so that FC2 reads them, through
// L2, before its own wait as launch_moe_fc2's contract lets it.
__device__ __forceinline__ void pdl_wait_only() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// pdl_wait with the trigger after the wait, for a kernel whose successor reads before its own wait what
// our predecessor wrote (launch_moe_fc2's contract: the MoE FC1 kernels): that successor then launches
// only once our predecessor has completed.
__device__ __forceinline__ void pdl_wait_then_launch() {
  pdl_wait_only();
  pdl_launch();
}

template <class... KernelArgs, class... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace nb::cuda
