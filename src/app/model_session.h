// What run and eval share: resolve --device, load the model and (when present) its tokenizer.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace nb {

struct ModelSession {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the directory has no tokenizer
};

// device: auto | cpu | cuda. need_tokenizer: a missing tokenizer.json is an error. dense_format
// (keep|fp8|mxfp4|nvfp4) and kv_cache_dtype (auto|bf16|fp8|fp8_e4m3) need the CUDA backend.
// dummy_weights: random weights from config.json alone (no safetensors read).
Result<ModelSession> open_model_session(const std::string& dir, const std::string& device, int threads,
                                        bool need_tokenizer, const std::string& dense_format = "keep",
                                        const std::string& kv_cache_dtype = "auto", bool dummy_weights = false);


}  // namespace nb
