// PCRE2 wrapper for the pre-tokenizer regexes, the two known patterns, and UTF-8 repair.
#include "text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace nb::text {

const char* const kO200kPattern =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const char* const kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

namespace {
// Unicode White_Space, as a class body.
constexpr std::string_view kWhiteSpace =
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

pcre2_code* as_code(void* p) { return static_cast<pcre2_code*>(p); }
}  // namespace

std::string rewrite_space_classes(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  size_t class_start = 0;  // index in `pattern` of the first body character of the current class
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char n = pattern[i + 1];
      ++i;
      if (n == 's') {
        if (in_class) {
          out += kWhiteSpace;
        } else {
          out += '[';
          out += kWhiteSpace;
          out += ']';
        }
      } else if (n == 'S' && !in_class) {
        out += "[^";
        out += kWhiteSpace;
        out += ']';
      } else {
        out += c;
        out += n;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      class_start = i + 1;
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      size_t close = pattern.find(":]", i + 2);  // POSIX class such as [:alpha:]
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']' && i != class_start) in_class = false;
    out += c;
  }
  return out;
}

Result<std::unique_ptr<Regex>> Regex::compile(std::string_view pattern, bool literal) {
  std::string rewritten = literal ? std::string(pattern) : rewrite_space_classes(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(), options,
                                   &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(error_code, buf, sizeof(buf));
    return error("regex '" + std::string(pattern) + "' does not compile at offset " +
                 std::to_string(error_offset) + ": " + reinterpret_cast<const char*>(buf));
  }
  std::unique_ptr<Regex> regex(new Regex());
  regex->code_ = code;
  // JIT is an optimisation: without it (unsupported CPU, hardened kernels) the interpreter gives
  // the same matches.
  regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return regex;
}

Regex::~Regex() { pcre2_code_free(as_code(code_)); }

bool Regex::find(std::string_view text, size_t start, size_t* begin, size_t* end) const {
  pcre2_code* code = as_code(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  NB_CHECK(md != nullptr, "out of memory creating PCRE2 match data");
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  int rc = PCRE2_ERROR_JIT_STACKLIMIT;
  if (jit_) rc = pcre2_jit_match(code, subject, text.size(), start, 0, md, nullptr);
  // The interpreter keeps its backtracking state on the heap, so it also covers the rare input that
  // overflows the JIT's small default stack. The caller has validated the UTF-8 already.
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
  }
  bool found = rc >= 0;
  if (found) {
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    *begin = ov[0];
    *end = ov[1];
  }
  pcre2_match_data_free(md);
  NB_CHECK(found || rc == PCRE2_ERROR_NOMATCH, "PCRE2 match failed with code " + std::to_string(rc));
  return found;
}

size_t Regex::utf8_length_at(std::string_view text, size_t pos) {
  if (pos >= text.size()) return 1;
  auto b = static_cast<unsigned char>(text[pos]);
  size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  return std::min(n, text.size() - pos);
}

namespace {
// Length of the valid UTF-8 sequence at `i`, or 0 with *bad set to the length of the maximal
// invalid subpart (at least 1).
size_t utf8_valid_length(std::string_view s, size_t i, size_t* bad) {
  auto at = [&](size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0u; };
  unsigned b0 = at(i);
  if (b0 < 0x80) return 1;
  size_t need = 0;
  unsigned lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    unsigned b = i + k < s.size() ? at(i + k) : 0x100;
    unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      *bad = k;
      return 0;
    }
  }
  return need + 1;
}
}  // namespace

std::string_view repair_utf8(std::string_view text, std::string* storage) {
  size_t i = 0, bad = 0;
  while (i < text.size()) {
    size_t n = utf8_valid_length(text, i, &bad);
    if (n == 0) break;
    i += n;
  }
  if (i == text.size()) return text;
  storage->assign(text.substr(0, i));
  while (i < text.size()) {
    size_t n = utf8_valid_length(text, i, &bad);
    if (n == 0) {
      *storage += "\xEF\xBF\xBD";
      i += bad;
    } else {
      storage->append(text.substr(i, n));
      i += n;
    }
  }
  return *storage;
}

}  // namespace nb::text
