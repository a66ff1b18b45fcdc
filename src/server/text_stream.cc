#include "server/text_stream.h"

#include <algorithm>

namespace nb {

size_t utf8_safe_length(const std::string& s) {
  // Walk back over at most 3 continuation bytes to the lead byte of the last character.
  const size_t n = s.size();
  size_t i = n;
  int cont = 0;
  while (i > 0 && cont < 3 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i, ++cont;
  if (i == 0) return n;  // only continuation bytes: invalid, nothing will complete them
  const auto lead = static_cast<unsigned char>(s[i - 1]);
  int need = 0;
  if (lead >= 0xF0)
    need = 3;
  else if (lead >= 0xE0)
    need = 2;
  else if (lead >= 0xC0)
    need = 1;
  else
    return n;
  return cont >= need ? n : i - 1;
}

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stops, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string TextStream::add(int32_t id) {
  if (stopped_ || (skip_special_ && tokenizer_.is_special(id))) return "";
  return add_text(tokenizer_.token_bytes(id));
}

std::string TextStream::add_text(const std::string& bytes) {
  if (stopped_) return "";
  bytes_ += bytes;
  return release();
}

std::string TextStream::release() {
  const size_t complete = utf8_safe_length(bytes_);
  const size_t from = text_.size();
  // A stop can only start at or after `from`: any earlier start was held back as a partial match.
  size_t stop_at = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t p = bytes_.find(s, from);
    if (p != std::string::npos && p + s.size() <= complete) stop_at = std::min(stop_at, p);
  }
  if (stop_at != std::string::npos) {
    stopped_ = true;
    std::string out = bytes_.substr(from, stop_at - from);
    text_ += out;
    bytes_.resize(stop_at);
    return out;
  }
  size_t hold = 0;  // longest tail of the complete text that is a proper prefix of a stop string
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, complete - from); k > hold; --k) {
      if (bytes_.compare(complete - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  const size_t safe = complete - hold;
  if (safe <= from) return "";
  std::string out = bytes_.substr(from, safe - from);
  text_ += out;
  return out;
}

std::string TextStream::flush() {
  if (stopped_ || bytes_.size() <= text_.size()) return "";
  std::string out = bytes_.substr(text_.size());
  text_ = bytes_;
  return out;
}

}  // namespace nb
