// Small helpers the commands share: whole-file reads and token-id lists typed by users.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace nb {

// The file's bytes, or "PATH: cannot open".
Result<std::string> read_file(const std::string& path);

// Decimal ids separated by whitespace or commas; the error names the first word that is not an
// integer in the int32 range. Range checks against a vocabulary are the caller's.
Result<std::vector<int32_t>> parse_token_ids(const std::string& text);

}  // namespace nb
