// Block formats (formats.md §2, §3): MXFP4 and NVFP4 encode and decode, one block at a time.
//   MXFP4: 32 E2M1 elements + one E8M0 scale; value = e2m1 * 2^(scale - 127).
//   NVFP4: 16 E2M1 elements + one UE4M3 scale + one FP32 global scale per tensor:
//          ModelOpt   value = e2m1 * ue4m3 * weight_scale_2        (multiply; weight_scale_2 = amax / 2688)
//          compressed value = e2m1 * ue4m3 / weight_global_scale   (divide;   weight_global_scale = 2688 / amax)
// Codes are packed two per byte, element 2i in the low nibble.
#pragma once

#include <cstdint>

#include "formats/scalar.h"

namespace nb::fmt {

inline constexpr int kMxfp4Block = 32;
inline constexpr int kNvfp4Block = 16;

// ---------------------------------------------------------------------------------------------
// MXFP4, OCP MX v1.0 scale rule: shared_exp = floor(log2(amax)) - 2 (E2M1's emax), clamped to
// [-127, 127]; an all-zero block uses the smallest normal float as amax. Elements that exceed 6
// after scaling saturate (this rule can clip the block maximum by design, as in the spec).
NB_HD int floor_log2(float a) {  // a > 0, finite
  const uint32_t u = float_bits(a);
  const int e = static_cast<int>((u >> 23) & 0xff);
  if (e != 0) return e - 127;
  int lz = 0;  // subnormal: position of the top mantissa bit
  for (uint32_t m = u & 0x7fffff; !(m & 0x400000); m <<= 1) ++lz;
  return -127 - lz;
}

// Encodes x[0..31] into 16 packed bytes and returns the E8M0 scale code.
NB_HD uint8_t mxfp4_encode_block(const float* x, uint8_t* packed) {
  float amax = 0.0f;
  for (int i = 0; i < kMxfp4Block; ++i) {
    const float a = x[i] < 0 ? -x[i] : x[i];
    if (a > amax) amax = a;
  }
  if (!(amax > 0.0f)) amax = bits_float(0x00800000u);  // smallest normal, avoids log(0)
  int e = floor_log2(amax) - 2;
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  const uint8_t scale = e8m0_from_exponent(e);
  // Divide by 2^e exactly: multiply by 2^-e, split in two steps so neither factor overflows.
  const float inv_hi = e8m0_to_float(static_cast<uint8_t>(127 - e / 2));
  const float inv_lo = e8m0_to_float(static_cast<uint8_t>(127 - (e - e / 2)));
  for (int j = 0; j < kMxfp4Block / 2; ++j) {
    const uint8_t lo = float_to_e2m1(x[2 * j] * inv_hi * inv_lo);
    const uint8_t hi = float_to_e2m1(x[2 * j + 1] * inv_hi * inv_lo);
    packed[j] = pack_e2m1(lo, hi);
  }
  return scale;
}

NB_HD void mxfp4_decode_block(const uint8_t* packed, uint8_t scale, float* out) {
  const float s = e8m0_to_float(scale);
  for (int j = 0; j < kMxfp4Block / 2; ++j) {
    out[2 * j] = e2m1_to_float(e2m1_low(packed[j])) * s;
    out[2 * j + 1] = e2m1_to_float(e2m1_high(packed[j])) * s;
  }
}

// ---------------------------------------------------------------------------------------------
// NVFP4. Global scales are handled in the multiply convention inside nibble; a compressed-tensors
// divisor g is turned into its multiplier by the caller through nvfp4_decode_block's convention flag,
// so the dequantized values match each producer's own formula bit for bit.
enum class GlobalScale : uint8_t { kMultiply, kDivide };

// ModelOpt's recipe: global multiplier s2 = amax(tensor) / (6 * 448).
NB_HD float nvfp4_global_scale(float tensor_amax) {
  return tensor_amax > 0.0f ? tensor_amax / (kE2M1Max * kE4M3Max) : 1.0f;
}

// Encodes x[0..15] with global multiplier s2 into 8 packed bytes; returns the UE4M3 scale code.
// Block scale = amax(block) / (6 * s2) rounded to UE4M3 (a zero scale becomes 1.0, as ModelOpt does);
// codes = E2M1(x / (scale * s2)).
NB_HD uint8_t nvfp4_encode_block(const float* x, float s2, uint8_t* packed) {
  float amax = 0.0f;
  for (int i = 0; i < kNvfp4Block; ++i) {
    const float a = x[i] < 0 ? -x[i] : x[i];
    if (a > amax) amax = a;
  }
  float sb = amax / (kE2M1Max * s2);
  if (sb == 0.0f) sb = 1.0f;
  const uint8_t scale = float_to_ue4m3(sb);
  const float denom = ue4m3_to_float(scale) * s2;
  for (int j = 0; j < kNvfp4Block / 2; ++j) {
    const uint8_t lo = float_to_e2m1(denom > 0 ? x[2 * j] / denom : 0.0f);
    const uint8_t hi = float_to_e2m1(denom > 0 ? x[2 * j + 1] / denom : 0.0f);
    packed[j] = pack_e2m1(lo, hi);
  }
  return scale;
}

NB_HD float nvfp4_block_factor(uint8_t scale, float global, GlobalScale convention) {
  return convention == GlobalScale::kMultiply ? ue4m3_to_float(scale) * global : ue4m3_to_float(scale) / global;
}

NB_HD void nvfp4_decode_block(const uint8_t* packed, uint8_t scale, float global, GlobalScale convention,
                              float* out) {
  const float f = nvfp4_block_factor(scale, global, convention);
  for (int j = 0; j < kNvfp4Block / 2; ++j) {
    out[2 * j] = e2m1_to_float(e2m1_low(packed[j])) * f;
    out[2 * j + 1] = e2m1_to_float(e2m1_high(packed[j])) * f;
  }
}

}  // namespace nb::fmt
