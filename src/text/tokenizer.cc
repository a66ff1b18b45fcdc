// Tokenizer encode/decode. Loading (tokenizer.json, .tiktoken) lives in tokenizer_load.cc.
#include "text/tokenizer.h"

#include <algorithm>

#include "text/regex.h"

namespace nb {

Tokenizer::Tokenizer() { std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1); }
Tokenizer::~Tokenizer() = default;

void Tokenizer::set_token(int32_t id, std::string bytes, TokenKind kind) {
  if (static_cast<size_t>(id) >= id_to_bytes_.size()) {
    id_to_bytes_.resize(id + 1);
    kinds_.resize(id + 1, TokenKind::kNone);
  }
  id_to_bytes_[id] = std::move(bytes);
  kinds_[id] = kind;
}

// Orders added tokens so match_added() can try each first byte's candidates longest first.
void Tokenizer::finish_added_tokens() {
  std::stable_sort(added_.begin(), added_.end(), [](const Added& a, const Added& b) {
    if (a.text[0] != b.text[0]) return a.text[0] < b.text[0];
    return a.text.size() > b.text.size();
  });
  added_by_text_.clear();
  std::fill(std::begin(added_first_byte_), std::end(added_first_byte_), false);
  for (size_t i = 0; i < added_.size(); ++i) {
    added_by_text_.emplace(added_[i].text, static_cast<int32_t>(i));
    added_first_byte_[static_cast<unsigned char>(added_[i].text[0])] = true;
  }
  added_lengths_.clear();
  for (const Added& a : added_) {
    auto& lengths = added_lengths_[static_cast<unsigned char>(a.text[0])];
    if (lengths.empty() || lengths.back() != a.text.size()) lengths.push_back(a.text.size());
  }
}

const Tokenizer::Added* Tokenizer::match_added(std::string_view text, size_t pos, bool allow_special) const {
  auto it_lengths = added_lengths_.find(static_cast<unsigned char>(text[pos]));
  if (it_lengths == added_lengths_.end()) return nullptr;
  for (size_t len : it_lengths->second) {  // longest first
    if (pos + len > text.size()) continue;
    auto it = added_by_text_.find(text.substr(pos, len));
    if (it == added_by_text_.end()) continue;
    const Added& a = added_[it->second];
    if (!a.special || allow_special) return &a;
  }
  return nullptr;
}

std::vector<int32_t> Tokenizer::encode(std::string_view input, bool allow_special) const {
  std::string repaired;
  std::string_view text = text::repair_utf8(input, &repaired);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  size_t segment = 0;  // start of the ordinary text not yet encoded
  for (size_t pos = 0; pos < text.size();) {
    const Added* a = nullptr;
    if (added_first_byte_[static_cast<unsigned char>(text[pos])]) a = match_added(text, pos, allow_special);
    if (a == nullptr) {
      ++pos;
      continue;
    }
    encode_ordinary(text.substr(segment, pos - segment), &ids);
    ids.push_back(a->id);
    pos += a->text.size();
    segment = pos;
  }
  encode_ordinary(text.substr(segment), &ids);
  return ids;
}

void Tokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>* out) const {
  if (!text.empty()) encode_pieces(text, 0, out);
}

void Tokenizer::encode_pieces(std::string_view text, size_t stage, std::vector<int32_t>* out) const {
  if (stage == stages_.size()) {
    encode_piece(text, out);
    return;
  }
  const PreStage& s = stages_[stage];
  std::string prefixed;
  if (s.add_prefix_space && text.front() != ' ') {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  if (s.regex) {
    s.regex->split(text, [&](std::string_view piece) { encode_pieces(piece, stage + 1, out); });
  } else {
    encode_pieces(text, stage + 1, out);
  }
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  if (whole_piece_lookup_) {
    int32_t id = bytes_to_id_.find(piece);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }
  if (mode_ == MergeMode::kRank) {
    text::bpe_by_rank(piece, bytes_to_id_, out);
  } else {
    text::bpe_by_merges(piece, byte_ids_, merges_, out);
  }
}

bool Tokenizer::is_valid(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < kinds_.size() && kinds_[id] != TokenKind::kNone;
}

bool Tokenizer::is_special(int32_t id) const { return is_valid(id) && kinds_[id] == TokenKind::kSpecial; }

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(id_to_bytes_.size()); }

std::string Tokenizer::token_bytes(int32_t id) const {
  return is_valid(id) ? id_to_bytes_[id] : std::string();
}

std::optional<int32_t> Tokenizer::token_id(std::string_view token_text) const {
  if (auto it = added_by_text_.find(token_text); it != added_by_text_.end()) return added_[it->second].id;
  if (int32_t id = bytes_to_id_.find(token_text); id >= 0) return id;
  return std::nullopt;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    if (!is_valid(id) || (skip_special && kinds_[id] == TokenKind::kSpecial)) continue;
    out += id_to_bytes_[id];
  }
  return out;
}

Result<std::string> Tokenizer::decode_checked(std::span<const int32_t> ids, bool skip_special) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!is_valid(ids[i])) {
      return error("token id " + std::to_string(ids[i]) + " (position " + std::to_string(i) +
                   ") is not in the vocabulary of " + path_ + " (ids 0.." + std::to_string(vocab_size() - 1) +
                   ")");
    }
  }
  return decode(ids, skip_special);
}

}  // namespace nb
