// Weight: a matrix [n, k] (n output features, k input features) that carries its storage format.
// Model code passes Weights to Backend::linear and never looks at the format; backends dispatch on it
// once. Data stays where the checkpoint put it (mmapped views), so a Weight is cheap to copy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/tensor.h"
#include "formats/blocks.h"

namespace nb {

enum class WeightFormat : uint8_t {
  kBF16,     // dense, as stored: BF16, F16 or F32 (data.dtype says which)
  kFP8E4M3,  // E4M3 codes with one F32 scale per output row (for re-quantized dense layers; no loader yet)
  kMXFP4,    // E2M1 codes + one E8M0 scale per 32 elements along k (gpt-oss experts, formats.md §2.3)
  kNVFP4,    // E2M1 codes + one UE4M3 scale per 16 elements along k + one FP32 global scale (§3.3, §3.4)
};
const char* weight_format_name(WeightFormat f);

// A contiguous range of output rows stored in one checkpoint tensor. Most weights have one part; a
// weight fused from several checkpoint tensors (Qwen3-MoE expert gate + up) has one part per tensor,
// each with its own NVFP4 global scale (formats.md §3.5: the global scale is per shard, per row).
struct WeightPart {
  int64_t rows = 0;
  TensorView data;  // dense: [rows, k]; FP8: [rows, k] U8; FP4: [rows, k/2] U8, element 2i in the low nibble
  TensorView scales;  // MXFP4: [rows, k/32] U8 E8M0; NVFP4: [rows, k/16] F8_E4M3; FP8: [rows] F32
  // NVFP4 only. Kept in the producer's own convention so dequantized values equal the producer's
  // formula bit for bit: ModelOpt weight_scale_2 multiplies, compressed-tensors weight_global_scale divides.
  float global_scale = 1.0f;
  fmt::GlobalScale convention = fmt::GlobalScale::kMultiply;
  std::string name;  // checkpoint tensor prefix, for messages and `nibble inspect`
  // Set when the loader made the bytes (a transposed copy) instead of viewing the checkpoint.
  std::shared_ptr<const void> owner;
};

struct Weight {
  WeightFormat format = WeightFormat::kBF16;
  int64_t n = 0, k = 0;
  std::vector<WeightPart> parts;  // rows add up to n

  bool empty() const { return parts.empty(); }
  int64_t parameters() const { return n * k; }
  int64_t bytes() const;  // data + scales as stored
  std::string shape_string() const { return nb::shape_string({n, k}); }
};

// Bytes a view covers; 0 for an unset one (a dense weight has no scales).
inline int64_t view_bytes(const TensorView& v) { return v.data ? v.nbytes() : 0; }

// Decodes output row `row` of w into out[0..k) as fp32, exactly (the scalar reference of every format).
void dequantize_row(const Weight& w, int64_t row, float* out);

// The roundings of the sm_90a FP8-activation GEMMs (NIBBLE_GEMM_FP8=1, kernels/gemm_fp4_wsr8.cuh) on the host:
// the CPU backend's emulation of that switch and the GPU tests' reference.
// A token row x[0..k) scaled by 2^s (s puts max |x| in [2^7, 2^8), |s| <= 120; a NaN / inf or zero row takes
// 8, as the GPU's shift does), rounded to E4M3 and scaled back into q[0..k); returns s.
int fp8_round_row(const float* x, int64_t k, float* q);
// FP4 row `row` of w with each weight e2m1 * block scale * 2^c rounded to E4M3 and scaled back by 2^-c, into
// out[0..k), the NVFP4 global scale left out; c is the row's fold (2^c times its largest block scale is 64;
// NaN E8M0 blocks do not count). Returns the row's global factor (1 for MXFP4); *fold = c.
float fp8_weight_row(const Weight& w, int64_t row, float* out, int* fold);

// Half-precision (IEEE binary16) to float, exact; for F16 checkpoints.
float f16_to_float(uint16_t h);

}  // namespace nb
