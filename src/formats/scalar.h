// Scalar codecs for the element and scale types of nibble's formats (formats.md §1):
//   E2M1 (FP4 element), E8M0 (MX block scale), E4M3 / UE4M3 (FP8 and the NVFP4 block scale), BF16.
// Decoding is exact. Encoding rounds to nearest, ties to even, and saturates (no Inf is ever made).
// Everything here is plain bit arithmetic so the same code runs on the host and on any GPU: sm_121
// is reported to lack the hardware e2m1 conversion, so nibble never relies on it.
#pragma once

#include <cstdint>
#include <cstring>

#include "formats/hd.h"

namespace nb::fmt {

NB_HD uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
NB_HD float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
NB_HD bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// ---------------------------------------------------------------------------------------------
// E2M1: s.ee.m, bias 1, no Inf/NaN. Values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
inline constexpr float kE2M1Max = 6.0f;

NB_HD float e2m1_to_float(uint8_t code) {
  const uint32_t c = code & 0xf;
  const uint32_t e = (c >> 1) & 3, m = c & 1;
  // e == 0: subnormal m * 0.5; otherwise 2^(e-1) * (1 + m/2), built directly as float bits.
  const uint32_t mag = e == 0 ? (m ? 0x3f000000u : 0u) : (((e - 1 + 127) << 23) | (m << 22));
  return bits_float(mag | ((c & 8) << 28));
}

// Round |x| to the nearest E2M1 magnitude, ties to the even code (mantissa bit 0), saturating at 6.
// Thresholds as in ModelOpt / compressed-tensors (formats.md §1.1). NaN encodes as +6 (satfinite).
NB_HD uint8_t float_to_e2m1(float x) {
  if (is_nan(x)) return 0x7;
  const uint8_t sign = (float_bits(x) >> 31) ? 0x8 : 0x0;
  const float a = x < 0 ? -x : x;
  uint8_t mag;
  if (a <= 0.25f) mag = 0;         // 0.25 ties to 0
  else if (a < 0.75f) mag = 1;     // 0.5
  else if (a <= 1.25f) mag = 2;    // 1.0 (0.75 and 1.25 tie to it)
  else if (a < 1.75f) mag = 3;     // 1.5
  else if (a <= 2.5f) mag = 4;     // 2.0 (1.75 and 2.5 tie to it)
  else if (a < 3.5f) mag = 5;      // 3.0
  else if (a <= 5.0f) mag = 6;     // 4.0 (3.5 and 5.0 tie to it)
  else mag = 7;                    // 6.0, saturating
  return sign | mag;
}

// Two codes per byte: element 2i in the low nibble, element 2i+1 in the high nibble (formats.md rule 1).
NB_HD uint8_t pack_e2m1(uint8_t even, uint8_t odd) { return static_cast<uint8_t>((even & 0xf) | ((odd & 0xf) << 4)); }
NB_HD uint8_t e2m1_low(uint8_t byte) { return byte & 0xf; }   // element 2i
NB_HD uint8_t e2m1_high(uint8_t byte) { return byte >> 4; }   // element 2i+1

// ---------------------------------------------------------------------------------------------
// E8M0: unsigned exponent, bias 127. 0x00 = 2^-127 (not zero), 0x7F = 1, 0xFE = 2^127, 0xFF = NaN.
inline constexpr uint8_t kE8M0Nan = 0xff;

NB_HD float e8m0_to_float(uint8_t code) {
  if (code == 0xff) return bits_float(0x7fc00000u);
  if (code == 0) return bits_float(0x00400000u);  // 2^-127 is a float subnormal
  return bits_float(static_cast<uint32_t>(code) << 23);
}
// The code of 2^e, for e in [-127, 127]; NaN code outside.
NB_HD uint8_t e8m0_from_exponent(int e) { return (e < -127 || e > 127) ? kE8M0Nan : static_cast<uint8_t>(e + 127); }

// ---------------------------------------------------------------------------------------------
// E4M3 ("e4m3fn"): s.eeee.mmm, bias 7, no Inf; NaN is S.1111.111; max finite 448 (0x7E).
// UE4M3 (the NVFP4 block scale) is the same encoding with the sign bit unused.
inline constexpr float kE4M3Max = 448.0f;

NB_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t e = (code >> 3) & 0xf, m = code & 7;
  if (e == 15 && m == 7) return bits_float(sign | 0x7fc00000u);
  if (e == 0) {
    // Subnormal m * 2^-9: exact in float.
    const float v = static_cast<float>(m) * bits_float(0x3b000000u);  // 2^-9
    return bits_float(float_bits(v) | sign);
  }
  return bits_float(sign | ((e - 7 + 127) << 23) | (m << 20));
}

// Round to nearest even, saturate finite values to +-448 (satfinite); NaN -> 0x7F with its sign.
NB_HD uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  if (is_nan(x)) return sign | 0x7f;
  const uint32_t a = u & 0x7fffffffu;  // |x| bits
  if (a >= 0x43e00000u) return sign | 0x7e;  // |x| >= 448 (and Inf): saturate
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -6) {
    // Subnormal range: round |x| / 2^-9 to an integer 0..8 (8 becomes the smallest normal, code 0x08).
    const float q = bits_float(a) * 512.0f;  // exact scaling by a power of two
    uint32_t n = static_cast<uint32_t>(q);
    const float frac = q - static_cast<float>(n);
    if (frac > 0.5f || (frac == 0.5f && (n & 1))) ++n;
    return sign | static_cast<uint8_t>(n);
  }
  // Normal: keep 3 of the 23 mantissa bits with round-to-nearest-even on the dropped 20.
  uint32_t mant = a & 0x7fffffu;
  uint32_t keep = mant >> 20, rest = mant & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1))) ++keep;
  uint32_t e = static_cast<uint32_t>(exp + 7);
  if (keep == 8) {
    keep = 0;
    ++e;
  }
  uint32_t code = (e << 3) | keep;
  if (code > 0x7e) code = 0x7e;  // rounding up past 448 saturates
  return sign | static_cast<uint8_t>(code);
}

NB_HD float ue4m3_to_float(uint8_t code) { return e4m3_to_float(code & 0x7f); }
NB_HD uint8_t float_to_ue4m3(float x) { return float_to_e4m3(x < 0 ? 0.0f : x) & 0x7f; }

// ---------------------------------------------------------------------------------------------
// BF16: the high half of a float. Encoding rounds to nearest even; NaN stays a quiet NaN.
NB_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
NB_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if (is_nan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

}  // namespace nb::fmt
