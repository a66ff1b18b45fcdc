// RoPE tables, following transformers modeling_rope_utils (_compute_default/yarn/llama3_parameters).
#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace nb {

YarnRange yarn_correction_range(const RopeConfig& rope, int head_dim) {
  // The dimension index at which a frequency completes `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return head_dim * std::log(rope.original_max_position_embeddings / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(rope.theta));
  };
  YarnRange r{correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)};
  if (rope.truncate) r.low = std::floor(r.low), r.high = std::ceil(r.high);
  r.low = std::max(r.low, 0.0);
  r.high = std::min(r.high, static_cast<double>(head_dim - 1));
  return r;
}

RopeTable make_rope_table(const RopeConfig& rope, int head_dim) {
  const int half = head_dim / 2;
  RopeTable t;
  t.inv_freq.resize(half);
  // HF computes pos_freq = base ** (2i / d) in float32 and inv_freq = 1 / pos_freq; so do we.
  std::vector<float> pos_freq(half), base_inv(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    pos_freq[i] = static_cast<float>(std::pow(rope.theta, static_cast<double>(exponent)));
    base_inv[i] = 1.0f / pos_freq[i];
  }
  switch (rope.type) {
    case RopeType::kDefault:
      t.inv_freq = base_inv;
      break;
    case RopeType::kYarn: {
      const YarnRange r = yarn_correction_range(rope, head_dim);
      const double high = r.low == r.high ? r.high + 0.001 : r.high;  // HF's guard against a zero range
      for (int i = 0; i < half; ++i) {
        const float ramp = static_cast<float>(std::clamp((i - r.low) / (high - r.low), 0.0, 1.0));
        const float extrapolation = base_inv[i];
        const float interpolation = 1.0f / (static_cast<float>(rope.factor) * pos_freq[i]);
        t.inv_freq[i] = interpolation * ramp + extrapolation * (1.0f - ramp);
      }
      t.attention_scale = rope.attention_factor > 0 ? static_cast<float>(rope.attention_factor)
                          : rope.factor <= 1        ? 1.0f
                                                    : static_cast<float>(0.1 * std::log(rope.factor) + 1.0);
      break;
    }
    case RopeType::kLlama3: {
      const double old_ctx = rope.original_max_position_embeddings;
      const double low_wavelen = old_ctx / rope.low_freq_factor,
                   high_wavelen = old_ctx / rope.high_freq_factor;
      for (int i = 0; i < half; ++i) {
        const double f = base_inv[i], wavelen = 2 * std::numbers::pi / f;
        double out = wavelen > low_wavelen ? f / rope.factor : f;
        if (wavelen >= high_wavelen && wavelen <= low_wavelen) {
          const double smooth =
              (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
          out = (1 - smooth) * out / rope.factor + smooth * out;
        }
        t.inv_freq[i] = static_cast<float>(out);
      }
      break;
    }
  }
  return t;
}

}  // namespace nb
