// Weight decoding: the one place that turns any stored format into fp32 rows, through formats/ codecs.
#include "model/weight.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/status.h"

namespace nb {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBF16:
      return "dense";
    case WeightFormat::kFP8E4M3:
      return "fp8_e4m3";
    case WeightFormat::kMXFP4:
      return "mxfp4";
    case WeightFormat::kNVFP4:
      return "nvfp4";
  }
  return "?";
}

int64_t Weight::bytes() const {
  int64_t b = 0;
  for (const WeightPart& p : parts)
    b += view_bytes(p.data) + view_bytes(p.scales) + (format == WeightFormat::kNVFP4 ? 4 : 0);
  return b;
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    const float v = static_cast<float>(m) * fmt::bits_float(0x33800000u);  // m * 2^-24, exact
    return fmt::bits_float(fmt::float_bits(v) | sign);
  }
  if (e == 31) return fmt::bits_float(sign | 0x7f800000u | (m << 13));
  return fmt::bits_float(sign | ((e - 15 + 127) << 23) | (m << 13));
}

void dequantize_row(const Weight& w, int64_t row, float* out) {
  NB_CHECK(row >= 0 && row < w.n, "row out of range");
  const WeightPart* part = nullptr;
  for (const WeightPart& p : w.parts) {
    if (row < p.rows) {
      part = &p;
      break;
    }
    row -= p.rows;
  }
  NB_CHECK(part != nullptr, "weight parts do not cover its rows");
  const int64_t k = w.k;
  switch (w.format) {
    case WeightFormat::kBF16: {
      if (part->data.dtype == DType::kF32) {
        std::memcpy(out, part->data.as<float>() + row * k, k * sizeof(float));
      } else if (part->data.dtype == DType::kBF16) {
        const uint16_t* src = part->data.as<uint16_t>() + row * k;
        for (int64_t i = 0; i < k; ++i) out[i] = fmt::bf16_to_float(src[i]);
      } else {
        NB_CHECK(part->data.dtype == DType::kF16, "dense weight of unexpected dtype");
        const uint16_t* src = part->data.as<uint16_t>() + row * k;
        for (int64_t i = 0; i < k; ++i) out[i] = f16_to_float(src[i]);
      }
      return;
    }
    case WeightFormat::kFP8E4M3: {
      const uint8_t* src = part->data.as<uint8_t>() + row * k;
      const float s = part->scales.as<float>()[row];
      for (int64_t i = 0; i < k; ++i) out[i] = fmt::e4m3_to_float(src[i]) * s;
      return;
    }
    case WeightFormat::kMXFP4: {
      const int64_t n_blocks = k / fmt::kMxfp4Block;
      const uint8_t* codes = part->data.as<uint8_t>() + row * (k / 2);
      const uint8_t* scales = part->scales.as<uint8_t>() + row * n_blocks;
      for (int64_t b = 0; b < n_blocks; ++b)
        fmt::mxfp4_decode_block(codes + b * (fmt::kMxfp4Block / 2), scales[b], out + b * fmt::kMxfp4Block);
      return;
    }
    case WeightFormat::kNVFP4: {
      const int64_t n_blocks = k / fmt::kNvfp4Block;
      const uint8_t* codes = part->data.as<uint8_t>() + row * (k / 2);
      const uint8_t* scales = part->scales.as<uint8_t>() + row * n_blocks;
      for (int64_t b = 0; b < n_blocks; ++b)
        fmt::nvfp4_decode_block(codes + b * (fmt::kNvfp4Block / 2), scales[b], part->global_scale,
                                part->convention, out + b * fmt::kNvfp4Block);
      return;
    }
  }
}

int fp8_round_row(const float* x, int64_t k, float* q) {
  float mx = 0.0f;
  for (int64_t i = 0; i < k; ++i) mx = std::max(mx, std::fabs(x[i]));
  int e = 0;
  if (mx > 0.0f && mx <= 3.4e38f) std::frexp(mx, &e);  // mx in [2^(e-1), 2^e)
  const int s = std::max(-120, std::min(120, 8 - e));
  for (int64_t i = 0; i < k; ++i) q[i] = std::ldexp(fmt::e4m3_to_float(fmt::float_to_e4m3(std::ldexp(x[i], s))), -s);
  return s;
}

float fp8_weight_row(const Weight& w, int64_t row, float* out, int* fold) {
  NB_CHECK(w.format == WeightFormat::kMXFP4 || w.format == WeightFormat::kNVFP4, "fp8_weight_row: an FP4 weight");
  NB_CHECK(row >= 0 && row < w.n, "row out of range");
  size_t pi = 0;
  while (row >= w.parts[pi].rows) row -= w.parts[pi++].rows;
  const WeightPart& p = w.parts[pi];
  const bool mx = w.format == WeightFormat::kMXFP4;
  const int64_t k = w.k, blk = mx ? fmt::kMxfp4Block : fmt::kNvfp4Block;
  const uint8_t* codes = p.data.as<uint8_t>() + row * (k / 2);
  const uint8_t* sc = p.scales.as<uint8_t>() + row * (k / blk);
  int c = 0;
  if (mx) {
    int emax = 0;
    for (int64_t b = 0; b < k / blk; ++b) emax = sc[b] == 0xff ? emax : std::max<int>(emax, sc[b]);
    c = 133 - emax;  // 2^(emax - 127 + c) = 64
  } else {
    float smax = 0.0f;
    for (int64_t b = 0; b < k / blk; ++b) smax = std::max(smax, fmt::ue4m3_to_float(sc[b]));
    c = 6 - (smax > 0.0f ? static_cast<int>(std::ceil(std::log2(static_cast<double>(smax)))) : -9);
  }
  *fold = c;
  for (int64_t i = 0; i < k; ++i) {
    const uint8_t b = codes[i / 2];
    const float v = fmt::e2m1_to_float(i & 1 ? fmt::e2m1_high(b) : fmt::e2m1_low(b));
    const float scale = mx ? std::ldexp(1.0f, sc[i / blk] - 127) : fmt::ue4m3_to_float(sc[i / blk]);
    const float q = fmt::e4m3_to_float(fmt::float_to_e4m3(static_cast<float>(std::ldexp(static_cast<double>(v) * scale, c))));
    out[i] = static_cast<float>(std::ldexp(static_cast<double>(q), -c));
  }
  if (mx) return 1.0f;
  return p.convention == fmt::GlobalScale::kDivide ? 1.0f / p.global_scale : p.global_scale;
}

}  // namespace nb
