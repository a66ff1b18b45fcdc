// Loading a Tokenizer from an HF tokenizer.json (byte-level BPE only) or a tiktoken .tiktoken rank
// file. Every rejection names the file and the field or line at fault.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "text/hf_json.h"
#include "text/regex.h"
#include "text/tokenizer.h"

namespace nb {
namespace {

using json = nlohmann::json;

// Ids beyond this are taken as a corrupt file rather than a vocabulary to allocate.
constexpr int64_t kMaxVocab = 1 << 24;
// o200k_base.tiktoken holds ranks 0..199997; its specials come from tiktoken's openai_public.py.
constexpr size_t kO200kBaseRanks = 199998;

Result<std::string> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return error(path + ": read failed");
  return std::move(ss).str();
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// GPT-2's byte <-> unicode table: printable bytes stand for themselves, the other 68 bytes map to
// U+0100 upwards in byte order. Returns the byte for a code point, or -1.
struct ByteLevelTable {
  int16_t byte_of[324];
  ByteLevelTable() {
    std::fill(std::begin(byte_of), std::end(byte_of), int16_t{-1});
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte_of[printable ? b : next++] = static_cast<int16_t>(b);
    }
  }
};

// Maps a byte-level vocab string ("Ġhello") to its raw bytes (" hello").
bool byte_level_decode(std::string_view s, const ByteLevelTable& table, std::string* out) {
  out->clear();
  for (size_t i = 0; i < s.size();) {
    auto b0 = static_cast<unsigned char>(s[i]);
    uint32_t cp;
    if (b0 < 0x80) {
      cp = b0;
      i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < s.size()) {
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
      i += 2;
    } else {
      return false;  // every byte-level code point is below U+0800
    }
    if (cp >= 324 || table.byte_of[cp] < 0) return false;
    out->push_back(static_cast<char>(table.byte_of[cp]));
  }
  return true;
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view in, std::string* out) {
  out->clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  size_t pad = in.back() == '=' ? (in[in.size() - 2] == '=' ? 2 : 1) : 0;
  uint32_t acc = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    int v = i >= in.size() - pad ? 0 : base64_value(in[i]);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    if (i % 4 == 3) {
      out->push_back(static_cast<char>(acc >> 16));
      out->push_back(static_cast<char>((acc >> 8) & 0xFF));
      out->push_back(static_cast<char>(acc & 0xFF));
      acc = 0;
    }
  }
  out->resize(out->size() - pad);
  return true;
}

bool is_null_or(const json& j, const char* key, auto pred) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() || pred(*it);
}

}  // namespace

class TokenizerLoader {
 public:
  static Result<std::unique_ptr<Tokenizer>> from_tiktoken(const std::string& path, const std::string& data);
  static Result<std::unique_ptr<Tokenizer>> from_hf_json(const std::string& path, const std::string& data);

 private:
  static Status add_pre_tokenizer(Tokenizer* t, const json& pre, bool* byte_level);
};

Result<std::unique_ptr<Tokenizer>> TokenizerLoader::from_tiktoken(const std::string& path,
                                                                  const std::string& data) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->path_ = path;
  t->mode_ = Tokenizer::MergeMode::kRank;
  t->whole_piece_lookup_ = true;
  t->bytes_to_id_.reset(&t->id_to_bytes_, kO200kBaseRanks);
  std::string bytes;
  size_t line_no = 0, count = 0;
  for (size_t pos = 0; pos < data.size();) {
    size_t eol = data.find('\n', pos);
    if (eol == std::string::npos) eol = data.size();
    std::string_view line(data.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    std::string where = path + ":" + std::to_string(line_no) + ": ";
    size_t space = line.find(' ');
    if (space == std::string_view::npos) return error(where + "expected 'BASE64 RANK'");
    if (!base64_decode(line.substr(0, space), &bytes)) {
      return error(where + "bad base64 '" + std::string(line.substr(0, space)) + "'");
    }
    std::string_view rank_text = line.substr(space + 1);
    int64_t rank = 0;
    if (rank_text.empty() || rank_text.size() > 9) return error(where + "bad rank");
    for (char c : rank_text) {
      if (c < '0' || c > '9') return error(where + "bad rank '" + std::string(rank_text) + "'");
      rank = rank * 10 + (c - '0');
    }
    if (rank >= kMaxVocab) return error(where + "rank " + std::to_string(rank) + " is too large");
    auto id = static_cast<int32_t>(rank);
    if (t->is_valid(id)) return error(where + "duplicate rank " + std::to_string(rank));
    t->set_token(id, bytes, Tokenizer::TokenKind::kNormal);
    if (!t->bytes_to_id_.insert(id)) return error(where + "duplicate token bytes");
    ++count;
  }
  if (count != kO200kBaseRanks || t->vocab_size() != static_cast<int32_t>(kO200kBaseRanks)) {
    return error(path + ": unrecognised .tiktoken vocabulary (" + std::to_string(count) +
                 " ranks): a rank file carries no regex or special tokens, so only o200k_base (" +
                 std::to_string(kO200kBaseRanks) + " ranks) is known; use a tokenizer.json");
  }
  for (int b = 0; b < 256; ++b) {
    if (t->bytes_to_id_.find(std::string(1, static_cast<char>(b))) < 0) {
      return error(path + ": byte " + std::to_string(b) + " has no rank");
    }
  }
  for (auto [text, id] :
       {std::pair<const char*, int32_t>{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}) {
    t->set_token(id, text, Tokenizer::TokenKind::kSpecial);
    t->added_.push_back({text, id, true});
  }
  t->finish_added_tokens();
  NB_ASSIGN_OR_RETURN(auto regex, text::Regex::compile(text::kO200kPattern));
  t->stages_.push_back({std::move(regex), false});
  return t;
}

Status TokenizerLoader::add_pre_tokenizer(Tokenizer* t, const json& pre, bool* byte_level) {
  if (pre.is_null()) return Status();
  std::string type = pre.value("type", "");
  if (type == "Sequence") {
    for (const json& p : pre.at("pretokenizers")) NB_RETURN_IF_ERROR(add_pre_tokenizer(t, p, byte_level));
    return Status();
  }
  if (type == "Split") {
    if (pre.value("behavior", "") != "Isolated") {
      return error("pre_tokenizer Split: behavior '" + pre.value("behavior", "") +
                   "' is not supported (only Isolated)");
    }
    if (pre.value("invert", false)) return error("pre_tokenizer Split: invert=true is not supported");
    const json& pattern = pre.at("pattern");
    bool literal = !pattern.contains("Regex");
    std::string text =
        literal ? pattern.at("String").get<std::string>() : pattern.at("Regex").get<std::string>();
    NB_ASSIGN_OR_RETURN(auto regex, text::Regex::compile(text, literal));
    t->stages_.push_back({std::move(regex), false});
    return Status();
  }
  if (type == "ByteLevel") {
    *byte_level = true;
    Tokenizer::PreStage stage;
    stage.add_prefix_space = pre.value("add_prefix_space", false);
    if (pre.value("use_regex", true)) {
      NB_ASSIGN_OR_RETURN(stage.regex, text::Regex::compile(text::kGpt2Pattern));
    }
    if (stage.regex || stage.add_prefix_space) t->stages_.push_back(std::move(stage));
    return Status();
  }
  return error("unsupported pre_tokenizer type '" + type + "' (supported: Sequence, Split, ByteLevel)");
}

Result<std::unique_ptr<Tokenizer>> TokenizerLoader::from_hf_json(const std::string& path,
                                                                 const std::string& data) {
  NB_ASSIGN_OR_RETURN(text::HfTokenizerJson parsed, text::parse_hf_tokenizer_json(path, data));
  const json& root = parsed.rest;
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->path_ = path;
  t->mode_ = Tokenizer::MergeMode::kMergeList;
  try {
    if (!root.is_object()) return error(path + ": not a tokenizer.json (top level is not an object)");
    const json& model = root.at("model");
    std::string type = model.value("type", "");
    if (type != "BPE")
      return error(path + ": unknown model type '" + type + "' (only byte-level BPE is supported)");
    if (model.value("byte_fallback", false))
      return error(path + ": model.byte_fallback=true is not supported");
    auto empty_string = [](const json& j) {
      return j.is_string() && j.get_ref<const std::string&>().empty();
    };
    if (!is_null_or(model, "continuing_subword_prefix", empty_string) ||
        !is_null_or(model, "end_of_word_suffix", empty_string)) {
      return error(path + ": model.continuing_subword_prefix / end_of_word_suffix are not supported");
    }
    if (!is_null_or(model, "dropout",
                    [](const json& j) { return j.is_number() && j.get<double>() == 0.0; })) {
      return error(path + ": model.dropout is not supported");
    }
    t->whole_piece_lookup_ = model.value("ignore_merges", false);

    // NFC is accepted as the identity (the known gap documented at Tokenizer::load).
    const json& normalizer = root.value("normalizer", json());
    if (!normalizer.is_null() && normalizer.value("type", "") != "NFC") {
      return error(path + ": unsupported normalizer type '" + normalizer.value("type", "") + "'");
    }
    bool byte_level = false;
    NB_RETURN_IF_ERROR(
        add_pre_tokenizer(t.get(), root.value("pre_tokenizer", json()), &byte_level).with_context(path));
    const json& decoder = root.value("decoder", json());
    if (!byte_level || decoder.is_null() || decoder.value("type", "") != "ByteLevel") {
      return error(path + ": not a byte-level BPE tokenizer (needs a ByteLevel pre_tokenizer and decoder)");
    }

    ByteLevelTable table;
    std::string bytes;
    if (!parsed.has_vocab || !parsed.has_merges)
      return error(path + ": model.vocab or model.merges is missing");
    t->bytes_to_id_.reset(&t->id_to_bytes_, parsed.vocab.size());
    for (const auto& [key, id] : parsed.vocab) {
      if (id < 0 || id >= kMaxVocab)
        return error(path + ": vocab '" + key + "' has bad id " + std::to_string(id));
      if (!byte_level_decode(key, table, &bytes)) {
        return error(path + ": vocab entry '" + key + "' is not a byte-level string");
      }
      if (t->is_valid(static_cast<int32_t>(id))) {
        return error(path + ": vocab id " + std::to_string(id) + " is used twice");
      }
      t->set_token(static_cast<int32_t>(id), std::move(bytes), Tokenizer::TokenKind::kNormal);
      if (!t->bytes_to_id_.insert(static_cast<int32_t>(id))) {
        return error(path + ": vocab entry '" + key + "' appears twice");
      }
    }
    for (int b = 0; b < 256; ++b) {
      t->byte_ids_[b] = t->bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    }

    const auto& merges = parsed.merges;
    t->merges_.reset(merges.size());
    std::string left, right;
    for (size_t i = 0; i < merges.size(); ++i) {
      const std::string& a = merges[i].first;
      const std::string& b = merges[i].second;
      std::string where = path + ": merges[" + std::to_string(i) + "]: ";
      if (!byte_level_decode(a, table, &left) || !byte_level_decode(b, table, &right)) {
        return error(where + "not byte-level strings");
      }
      int32_t ia = t->bytes_to_id_.find(left), ib = t->bytes_to_id_.find(right);
      left += right;
      int32_t ir = t->bytes_to_id_.find(left);
      if (ia < 0 || ib < 0 || ir < 0) {
        return error(where + "'" + a + "', '" + b + "' or their merge is not in the vocab");
      }
      t->merges_.insert_or_assign(text::merge_key(ia, ib), text::MergeRule{static_cast<int32_t>(i), ir});
    }

    for (const json& a : root.value("added_tokens", json::array())) {
      int64_t id = a.at("id").get<int64_t>();
      const std::string& content = a.at("content").get_ref<const std::string&>();
      if (id < 0 || id >= kMaxVocab || content.empty()) {
        return error(path + ": added token '" + content + "' with id " + std::to_string(id) + " is invalid");
      }
      bool special = a.value("special", false);
      t->set_token(static_cast<int32_t>(id), content,
                   special ? Tokenizer::TokenKind::kSpecial : Tokenizer::TokenKind::kAdded);
      t->added_.push_back({content, static_cast<int32_t>(id), special});
    }
  } catch (const json::exception& e) {
    return error(path + ": malformed tokenizer.json: " + e.what());
  }
  t->finish_added_tokens();
  return t;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& path) {
  std::string file = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) file = path + "/tokenizer.json";
  NB_ASSIGN_OR_RETURN(std::string data, read_file(file));
  if (ends_with(file, ".tiktoken")) return TokenizerLoader::from_tiktoken(file, data);
  return TokenizerLoader::from_hf_json(file, data);
}

}  // namespace nb
