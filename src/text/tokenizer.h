// Byte-level BPE tokenizer: loads an HF tokenizer.json or a tiktoken rank file, encodes text to ids
// (special tokens first, then the pre-tokenizer regex, then BPE) and decodes ids back to bytes.
// Immutable after load(), so one instance is shared by every thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "text/bpe.h"

namespace nb {

namespace text {
class Regex;
}

class Tokenizer {
 public:
  // path: a tokenizer.json, a *.tiktoken file, or a model directory holding tokenizer.json.
  // A .tiktoken file carries neither the regex nor the special tokens, so only o200k_base (recognised
  // by its 199998 ranks) is accepted; it gets the o200k regex, <|endoftext|> = 199999 and
  // <|endofprompt|> = 200018, as tiktoken defines them.
  // Known gap: an NFC normalizer (Qwen's tokenizer.json) is accepted but not applied, so text that is
  // not already in NFC can tokenize differently from HF. Other normalizers are rejected.
  static Result<std::unique_ptr<Tokenizer>> load(const std::string& path);
  ~Tokenizer();

  // Special tokens are recognised (longest match first) only when allow_special; otherwise their text
  // is encoded as ordinary text. Added tokens that are not special (Qwen3's <think>) always match, as
  // in HF. Invalid UTF-8 in `text` is encoded as U+FFFD. No BOS is added: chat templates carry it.
  std::vector<int32_t> encode(std::string_view text, bool allow_special) const;
  // Concatenated token bytes; may end in partial UTF-8. Ids that name no token are skipped.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  // As decode(), but an id that names no token is an error naming it.
  Result<std::string> decode_checked(std::span<const int32_t> ids, bool skip_special = false) const;
  // Raw bytes of one token (special tokens: their text); empty for an id that names no token.
  std::string token_bytes(int32_t id) const;
  // Exact lookup of a special token's text ("<|start|>") or of an ordinary token's raw bytes.
  std::optional<int32_t> token_id(std::string_view token_text) const;
  bool is_special(int32_t id) const;
  bool is_valid(int32_t id) const;
  int32_t vocab_size() const;  // max id + 1
  const std::string& path() const { return path_; }

 private:
  enum class TokenKind : uint8_t { kNone, kNormal, kSpecial, kAdded };
  enum class MergeMode { kRank, kMergeList };
  // One pre-tokenizer stage: split every piece with `regex` (when set) after optionally prefixing a
  // space (HF ByteLevel add_prefix_space).
  struct PreStage {
    std::unique_ptr<text::Regex> regex;
    bool add_prefix_space = false;
  };
  struct Added {
    std::string text;
    int32_t id;
    bool special;
  };

  struct StringHash {  // lets the map be probed with a string_view
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  Tokenizer();
  friend class TokenizerLoader;

  void set_token(int32_t id, std::string bytes, TokenKind kind);
  void finish_added_tokens();
  void encode_ordinary(std::string_view text, std::vector<int32_t>* out) const;
  void encode_pieces(std::string_view text, size_t stage, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  // Longest added token starting at `pos` that may match; nullptr if none.
  const Added* match_added(std::string_view text, size_t pos, bool allow_special) const;

  std::string path_;
  MergeMode mode_ = MergeMode::kRank;
  bool whole_piece_lookup_ = true;  // tiktoken, or HF ignore_merges
  std::vector<std::string> id_to_bytes_;
  std::vector<TokenKind> kinds_;
  text::BytesIndex bytes_to_id_;  // ordinary tokens, by raw bytes
  text::MergeRules merges_;       // HF only
  int32_t byte_ids_[256];         // HF only: id of each single-byte token, or -1
  std::vector<PreStage> stages_;
  std::vector<Added> added_;         // sorted by first byte, then longest first
  bool added_first_byte_[256] = {};  // quick filter for match_added
  std::unordered_map<unsigned char, std::vector<size_t>> added_lengths_;  // distinct, longest first
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_by_text_;  // -> added_ index
};

}  // namespace nb
