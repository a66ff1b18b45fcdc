// RoPE frequency tables from the config: default, YaRN (gpt-oss, formats.md §2.6) and llama3 (§6.1).
// Computed once at load in double precision and stored as fp32, as HF does (its inv_freq is float32).
#pragma once

#include "backend/backend.h"
#include "io/config.h"

namespace nb {

RopeTable make_rope_table(const RopeConfig& rope, int head_dim);

// YaRN correction range [low, high] over the rotary dims (unrounded when truncate is false).
struct YarnRange {
  double low = 0, high = 0;
};
YarnRange yarn_correction_range(const RopeConfig& rope, int head_dim);

}  // namespace nb
