#include "app/cli_util.h"

#include <climits>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace nb {

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<std::vector<int32_t>> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while ((pos = text.find_first_not_of(" \t\r\n,", pos)) != std::string::npos) {
    const size_t end = text.find_first_of(" \t\r\n,", pos);
    const std::string word = text.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end;
    char* stop = nullptr;
    const long long v = std::strtoll(word.c_str(), &stop, 10);
    if (*stop != '\0' || v < INT32_MIN || v > INT32_MAX) return error("'" + word + "' is not a token id");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

}  // namespace nb
