// Bit-exact tests of formats/: every E2M1, E4M3 and E8M0 code, rounding ties, saturation, NaN,
// nibble order, and MXFP4 / NVFP4 block round trips. The reference for rounding is a brute-force
// search over the decoded code table (nearest value, ties to the even code), independent of the
// threshold logic in formats/scalar.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "formats/blocks.h"
#include "formats/scalar.h"

namespace nb::fmt {
namespace {

float bits(uint32_t u) { return bits_float(u); }

// Nearest representable magnitude among codes [0, n_codes) by brute force; ties go to the code
// with an even mantissa LSB (bit 0). Codes whose value is NaN are skipped.
template <class Decode>
uint8_t brute_nearest(float a, int n_codes, Decode decode) {
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < n_codes; ++c) {
    const float v = decode(static_cast<uint8_t>(c));
    if (std::isnan(v)) continue;
    const double d = std::fabs(static_cast<double>(a) - v);
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(E2M1, AllSixteenCodes) {
  const float expect[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(float_bits(v), float_bits(expect[c])) << "code " << c;
    EXPECT_EQ(float_to_e2m1(v), c) << "round trip of code " << c;
  }
}

TEST(E2M1, TiesGoToEvenAndSaturate) {
  struct Case { float x; uint8_t code; };
  const Case cases[] = {{0.25f, 0x0}, {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4}, {2.5f, 0x4},
                        {3.5f, 0x6},  {5.0f, 0x6},  {5.01f, 0x7}, {7.0f, 0x7},  {1e30f, 0x7},
                        {-0.25f, 0x8}, {-5.0f, 0xE}, {-100.0f, 0xF}, {0.26f, 0x1}, {-0.0f, 0x8}};
  for (const auto& c : cases) EXPECT_EQ(float_to_e2m1(c.x), c.code) << "x = " << c.x;
  EXPECT_EQ(float_to_e2m1(std::numeric_limits<float>::infinity()), 0x7);
  EXPECT_EQ(float_to_e2m1(-std::numeric_limits<float>::infinity()), 0xF);
  EXPECT_EQ(float_to_e2m1(std::nanf("")), 0x7);  // documented: NaN saturates to +6
}

TEST(E2M1, MatchesBruteForceOnRandomAndGridValues) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-8.0f, 8.0f);
  auto check = [](float x) {
    const float a = std::fabs(x);
    uint8_t ref = brute_nearest(std::min(a, 6.0f), 8, e2m1_to_float);
    if (std::signbit(x)) ref |= 0x8;
    ASSERT_EQ(float_to_e2m1(x), ref) << "x = " << x;
  };
  for (int i = 0; i < 200000; ++i) check(dist(rng));
  for (int i = -2000; i <= 2000; ++i) check(i / 256.0f);  // hits every tie exactly
}

TEST(Nibbles, EvenElementInLowNibble) {
  EXPECT_EQ(pack_e2m1(0x2, 0x7), 0x72);
  EXPECT_EQ(e2m1_low(0x72), 0x2);
  EXPECT_EQ(e2m1_high(0x72), 0x7);
}

TEST(E8M0, All256Codes) {
  for (int c = 0; c < 256; ++c) {
    const float v = e8m0_to_float(static_cast<uint8_t>(c));
    if (c == 0xff) {
      EXPECT_TRUE(std::isnan(v));
      continue;
    }
    EXPECT_EQ(v, std::ldexp(1.0f, c - 127)) << "code " << c;  // 0x00 is 2^-127, not zero
    EXPECT_EQ(e8m0_from_exponent(c - 127), c);
  }
  EXPECT_GT(e8m0_to_float(0), 0.0f);
  EXPECT_EQ(e8m0_to_float(0x7f), 1.0f);
  EXPECT_EQ(e8m0_from_exponent(128), kE8M0Nan);
  EXPECT_EQ(e8m0_from_exponent(-128), kE8M0Nan);
}

double e4m3_reference_value(int c) {  // from the spec's formula, in double
  const int s = c >> 7, e = (c >> 3) & 0xf, m = c & 7;
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

TEST(E4M3, All256Codes) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
      EXPECT_EQ(float_to_e4m3(v) & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), e4m3_reference_value(c)) << "code " << c;
    EXPECT_EQ(float_to_e4m3(v), c) << "round trip of code " << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(E4M3, RoundNearestEvenAndSatfinite) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(460.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1e9f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  // 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): ties to even -> 0x38.
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  // 1.1875 is halfway between 1.125 (0x39) and 1.25 (0x3a): -> 0x3a.
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);
  // Subnormal tie: 1.5 * 2^-9 between 0x01 and 0x02 -> 0x02; 0.5 * 2^-9 -> 0.
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -9)), 0x02);
  EXPECT_EQ(float_to_e4m3(std::ldexp(0.5f, -9)), 0x00);
  EXPECT_EQ(float_to_e4m3(std::ldexp(7.5f, -9)), 0x08);  // rounds up into the smallest normal
  EXPECT_EQ(float_to_e4m3(bits(0x00000001u)), 0x00);     // float subnormal
}

TEST(E4M3, MatchesBruteForce) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> expo(-14.0f, 9.5f);
  for (int i = 0; i < 200000; ++i) {
    const float a = std::exp2(expo(rng));
    const float x = (i & 1) ? -a : a;
    uint8_t ref = brute_nearest(std::min(a, 448.0f), 128, e4m3_to_float);
    if (x < 0) ref |= 0x80;
    ASSERT_EQ(float_to_e4m3(x), ref) << "x = " << x;
  }
  // Every midpoint between neighbouring codes.
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = (e4m3_to_float(c) + e4m3_to_float(c + 1)) / 2;
    const uint8_t even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(float_to_e4m3(mid), even) << "midpoint after code " << c;
  }
}

TEST(UE4M3, PositiveOnly) {
  EXPECT_EQ(float_to_ue4m3(-3.0f), 0x00);
  EXPECT_EQ(ue4m3_to_float(0xb8), 1.0f);  // sign bit ignored
}

TEST(BF16, RoundTripAndRounding) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(float_to_bf16(bits(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16(bits(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16(bits(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    ASSERT_EQ(float_to_bf16(v), h);
  }
}

TEST(Mxfp4, BlockRoundTripIsExactForRepresentableValues) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 1000; ++trial) {
    const int e = static_cast<int>(rng() % 200) - 100;
    float x[32];
    for (int i = 0; i < 32; ++i) x[i] = std::ldexp(e2m1_to_float(rng() & 0xf), e);
    x[rng() % 32] = std::ldexp(6.0f, e);  // block max 6 * 2^e gives scale 2^e exactly
    uint8_t packed[16];
    const uint8_t scale = mxfp4_encode_block(x, packed);
    EXPECT_EQ(scale, e + 127);
    float y[32];
    mxfp4_decode_block(packed, scale, y);
    for (int i = 0; i < 32; ++i) ASSERT_EQ(float_bits(y[i]), float_bits(x[i])) << "trial " << trial << " i " << i;
  }
}

TEST(Mxfp4, ScaleRuleAndSaturation) {
  float x[32] = {};
  x[0] = 7.0f;  // floor(log2 7) - 2 = 0: scale 1, 7 saturates to 6 (OCP rule clips by design)
  x[1] = -0.5f;
  x[3] = 1.25f;  // tie -> 1.0
  uint8_t packed[16];
  EXPECT_EQ(mxfp4_encode_block(x, packed), 127);
  EXPECT_EQ(packed[0], pack_e2m1(0x7, 0x9));
  EXPECT_EQ(packed[1], pack_e2m1(0x0, 0x2));
  float zeros[32] = {};
  EXPECT_EQ(mxfp4_encode_block(zeros, packed), 0);  // all-zero block: clamped to 2^-127
  for (int j = 0; j < 16; ++j) EXPECT_EQ(packed[j], 0);
}

TEST(Mxfp4, ErrorBoundOnRandomData) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int trial = 0; trial < 2000; ++trial) {
    float x[32], y[32];
    float amax = 0;
    for (auto& v : x) v = dist(rng), amax = std::max(amax, std::fabs(v));
    uint8_t packed[16];
    mxfp4_decode_block(packed, mxfp4_encode_block(x, packed), y);
    const float s = std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(amax))) - 2);
    for (int i = 0; i < 32; ++i) {
      // Within half a step of the E2M1 grid (step <= 2 * s below 6s), or clipped at 6s.
      const float a = std::fabs(x[i]);
      if (a <= 6 * s) {
        ASSERT_LE(std::fabs(x[i] - y[i]), s + 1e-6f) << x[i] << " -> " << y[i];
      } else {
        ASSERT_EQ(std::fabs(y[i]), 6 * s);
      }
    }
  }
}

TEST(Nvfp4, ModelOptRecipeAndBothConventions) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 0.05f);
  float x[16], y[16], z[16];
  for (int trial = 0; trial < 2000; ++trial) {
    float amax = 0;
    for (auto& v : x) v = dist(rng), amax = std::max(amax, std::fabs(v));
    const float s2 = nvfp4_global_scale(amax * 1.5f);  // tensor amax above this block's
    uint8_t packed[8];
    const uint8_t scale = nvfp4_encode_block(x, s2, packed);
    EXPECT_LT(scale, 0x7f);
    nvfp4_decode_block(packed, scale, s2, GlobalScale::kMultiply, y);
    // compressed-tensors stores the divisor 2688 / amax; decoding divides by it.
    nvfp4_decode_block(packed, scale, 1.0f / s2, GlobalScale::kDivide, z);
    const float step = ue4m3_to_float(scale) * s2;
    for (int i = 0; i < 16; ++i) {
      ASSERT_LE(std::fabs(x[i] - y[i]), step * 1.0001f + 1e-12f) << "i " << i;
      ASSERT_NEAR(y[i], z[i], std::fabs(y[i]) * 1e-6f + 1e-12f);
      // codes decode to e2m1 * scale * s2 exactly
      const uint8_t code = (i & 1) ? e2m1_high(packed[i / 2]) : e2m1_low(packed[i / 2]);
      ASSERT_EQ(y[i], e2m1_to_float(code) * (ue4m3_to_float(scale) * s2));
    }
  }
}

TEST(Nvfp4, ZeroBlockUsesScaleOne) {
  float x[16] = {};
  uint8_t packed[8];
  EXPECT_EQ(nvfp4_encode_block(x, 0.5f, packed), 0x38);  // 1.0 in E4M3
  for (int j = 0; j < 8; ++j) EXPECT_EQ(packed[j], 0);
}

}  // namespace
}  // namespace nb::fmt
