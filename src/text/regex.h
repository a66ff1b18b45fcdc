// Pre-tokenizer regexes on PCRE2 (UTF + UCP, JIT compiled when the platform allows it), the o200k and
// GPT-2 patterns, and the UTF-8 helpers the tokenizer needs (validation with U+FFFD repair).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"

namespace nb::text {

// tiktoken's o200k_base pattern (also o200k_harmony's and the gpt-oss tokenizer.json Split regex).
extern const char* const kO200kPattern;
// The GPT-2 pattern that HF's ByteLevel pre-tokenizer applies when use_regex is true.
extern const char* const kGpt2Pattern;

// A compiled pattern. Immutable after compile(), so one instance serves many threads: each call
// creates its own match data.
class Regex {
 public:
  // `literal` compiles the pattern as a plain string (HF Split with a "String" pattern).
  static Result<std::unique_ptr<Regex>> compile(std::string_view pattern, bool literal = false);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Splits `text` (valid UTF-8) into matches and the gaps between them, in order, calling
  // emit(std::string_view) for each non-empty piece: HF's Split with behavior Isolated.
  template <class F>
  void split(std::string_view text, F&& emit) const {
    size_t pos = 0;
    while (pos < text.size()) {
      size_t begin = 0, end = 0;
      if (!find(text, pos, &begin, &end)) {
        emit(text.substr(pos));
        return;
      }
      if (begin > pos) emit(text.substr(pos, begin - pos));
      if (end > begin) emit(text.substr(begin, end - begin));
      // An empty match would not advance; step over one character and let it join the next gap.
      pos = end > begin ? end : end + utf8_length_at(text, end);
    }
  }

  bool jit() const { return jit_; }

 private:
  Regex() = default;
  // First match at or after `start`; false when there is none.
  bool find(std::string_view text, size_t start, size_t* begin, size_t* end) const;
  static size_t utf8_length_at(std::string_view text, size_t pos);

  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// Rewrites \s and \S so they mean Unicode White_Space (as in Rust's regex, which tiktoken uses, and
// Oniguruma); PCRE2 10.42 also counts U+180E as space. Exposed for tests.
std::string rewrite_space_classes(std::string_view pattern);

// Returns `text` unchanged when it is valid UTF-8, else a copy where each maximal invalid subsequence
// became U+FFFD (the WHATWG / Python "replace" rule). `storage` holds the copy when one is made.
std::string_view repair_utf8(std::string_view text, std::string* storage);

}  // namespace nb::text
