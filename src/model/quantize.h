// `nibble quantize`: a BF16 checkpoint directory -> the same model in a standard quantized on-disk layout
// that nibble and the HF / vLLM ecosystem load (formats.md §2.3, §3.3, §3.4):
//   mxfp4  gpt-oss experts only: P.gate_up_proj_blocks/_scales U8 + config.json quantization_config
//          {"quant_method": "mxfp4", "modules_to_not_convert": [...]} (the layout of the gpt-oss releases).
//   nvfp4  other architectures' linear layers: ModelOpt W4A16_NVFP4, P.weight U8 [n, k/2], P.weight_scale
//          F8_E4M3 [n, k/16], P.weight_scale_2 F32 0-d, and hf_quant_config.json with exclude_modules.
//   fp8    other architectures' linear layers: compressed-tensors "float-quantized", per output channel:
//          P.weight F8_E4M3 [n, k], P.weight_scale F32 [n, 1]; config.json quantization_config.
// Scale selection (each format's codec is formats/; nothing is re-derived here):
//   MXFP4  OCP MX rule per 32 elements: scale 2^(floor(log2 amax) - 2), elements E2M1 round-to-nearest-
//          even, saturating at 6 (the block maximum may clip, as in the spec: fmt::mxfp4_encode_block).
//   NVFP4  ModelOpt's two levels: s2 = amax(tensor) / (6 * 448) (F32); per 16 elements
//          sb = UE4M3_RNE_sat(amax(block) / (6 * s2)) (a zero scale becomes 1); codes E2M1_RNE_sat(x / (sb
//          s2)).
//   FP8    per output row: s = amax(row) / 448 (1 for an all-zero row); codes E4M3_RNE_sat(x / s).
// Activations are not calibrated: the outputs are weight-only (no input_scale tensors).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace nb {

enum class QuantFormat : uint8_t { kMXFP4, kNVFP4, kFP8 };

struct QuantizeOptions {
  std::string input_dir, output_dir;
  QuantFormat format = QuantFormat::kNVFP4;
  // Layer classes to quantize: experts, attn, mlp, lm_head, embed. Empty: the format's default
  // (gpt-oss: experts; others: attn, mlp, experts).
  std::vector<std::string> layers;
};

struct QuantizeReport {
  std::string layout;                // e.g. "gpt-oss mxfp4 (_blocks/_scales)"
  std::vector<std::string> classes;  // the layer classes quantized
  int64_t tensors_quantized = 0, tensors_copied = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
};

Result<QuantizeReport> quantize_checkpoint(const QuantizeOptions& options);

// Row codecs over a row-major fp32 matrix [n, k] (k a multiple of the block), shared with the tests.
// codes: [n, k/2] packed E2M1 (element 2i in the low nibble); scales: [n, k/32] E8M0 codes.
void quantize_mxfp4(const float* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales);
// codes: [n, k/2]; scales: [n, k/16] UE4M3 codes; returns the global multiplier s2 (weight_scale_2).
float quantize_nvfp4(const float* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales);
// codes: [n, k] E4M3; scales: [n] F32 multipliers.
void quantize_fp8(const float* w, int64_t n, int64_t k, uint8_t* codes, float* scales);

}  // namespace nb
