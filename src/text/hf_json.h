// Streaming parse of an HF tokenizer.json: model.vocab and model.merges (hundreds of thousands of
// entries) go straight into flat vectors; everything else becomes a small nlohmann DOM. A DOM of the
// whole o200k_harmony file costs ~0.7 s, the stream ~0.12 s.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace nb::text {

struct HfTokenizerJson {
  nlohmann::json rest;                                 // the document without model.vocab and model.merges
  std::vector<std::pair<std::string, int64_t>> vocab;  // byte-level string, id; in file order
  std::vector<std::pair<std::string, std::string>> merges;
  bool has_vocab = false, has_merges = false;
};

// Errors name `path` and say what is wrong (invalid JSON with its byte offset, a non-integer id, a
// merge that is neither "A B" nor [A, B]).
Result<HfTokenizerJson> parse_hf_tokenizer_json(const std::string& path, const std::string& data);

}  // namespace nb::text
