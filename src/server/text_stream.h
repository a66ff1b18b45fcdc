// TextStream: incremental detokenization of one choice's output with stop strings. Text is released
// only up to a complete UTF-8 character, and a tail that could still grow into a stop string is held
// back; when a stop string completes, the text before it is released and the stop itself never is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace nb {

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stops, bool skip_special);

  // Appends the token's bytes (nothing for a special token when skip_special); returns the text
  // that became safe to send. After a stop string is found, stopped() is true and add() returns "".
  std::string add(int32_t id);
  // Appends raw text (harmony message content already decoded); same rules as add().
  std::string add_text(const std::string& bytes);
  // End of generation: everything still held back (a partial stop, or a truncated character).
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }  // everything released so far

 private:
  std::string release();

  const Tokenizer& tokenizer_;
  std::vector<std::string> stops_;
  bool skip_special_;
  std::string bytes_;  // everything decoded, released or not
  std::string text_;   // the released prefix of bytes_
  bool stopped_ = false;
};

// Length of the longest prefix of s that does not end inside a UTF-8 character.
size_t utf8_safe_length(const std::string& s);

}  // namespace nb
