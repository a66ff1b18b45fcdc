#include "server/harmony_parser.h"

#include "base/status.h"

namespace nb {

static constexpr size_t kMaxHeader = 1024;  // a runaway header (a broken model) is cut, not grown

static int32_t special_id(const Tokenizer& t, const char* text) { return t.token_id(text).value_or(-1); }

bool HarmonyParser::supported(const Tokenizer& t) {
  for (const char* s : {"<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|channel|>"})
    if (!t.token_id(s)) return false;
  return true;
}

HarmonyParser::HarmonyParser(const Tokenizer& tokenizer)
    : tokenizer_(tokenizer),
      start_(special_id(tokenizer, "<|start|>")),
      message_(special_id(tokenizer, "<|message|>")),
      end_(special_id(tokenizer, "<|end|>")),
      return_(special_id(tokenizer, "<|return|>")),
      call_(special_id(tokenizer, "<|call|>")) {
  NB_CHECK(supported(tokenizer), "HarmonyParser needs the harmony special tokens");
}

// Header examples: "<|channel|>analysis", "assistant<|channel|>final",
// " to=functions.get_weather<|channel|>commentary <|constrain|>json", "<|channel|>commentary to=functions.f
// json".
void HarmonyParser::open_message() {
  std::string channel, recipient;
  const std::string kChannel = "<|channel|>";
  if (size_t c = header_.find(kChannel); c != std::string::npos) {
    size_t b = c + kChannel.size(), e = b;
    while (e < header_.size() && header_[e] != ' ' && header_[e] != '<') ++e;
    channel = header_.substr(b, e - b);
  }
  if (size_t t = header_.find("to="); t != std::string::npos) {
    size_t b = t + 3, e = b;
    while (e < header_.size() && header_[e] != ' ' && header_[e] != '<') ++e;
    recipient = header_.substr(b, e - b);
  }
  header_.clear();
  state_ = State::kContent;
  tool_index_ = -1;
  const std::string kFunctions = "functions.";
  if (recipient.rfind(kFunctions, 0) == 0 && recipient.size() > kFunctions.size()) {
    kind_ = HarmonyEvent::Kind::kToolArguments;
    tool_index_ = n_tool_calls_++;
    pending_.push_back(
        {HarmonyEvent::Kind::kToolCallStart, recipient.substr(kFunctions.size()), tool_index_});
  } else if (channel == "analysis" || !recipient.empty()) {
    kind_ = HarmonyEvent::Kind::kReasoning;
  } else {
    kind_ = HarmonyEvent::Kind::kContent;
  }
}

std::vector<HarmonyEvent> HarmonyParser::add(int32_t id) {
  pending_.clear();
  if (done_) return {};
  const bool ends = id == end_ || id == return_ || id == call_;
  if (ends) {
    state_ = State::kOutside;
    header_.clear();
    done_ = id != end_;
  } else if (id == start_) {
    state_ = State::kHeader;
    header_.clear();
  } else if (state_ == State::kHeader) {
    if (id == message_)
      open_message();
    else if (header_.size() < kMaxHeader)
      header_ += tokenizer_.token_bytes(id);
  } else if (state_ == State::kContent && !tokenizer_.is_special(id)) {
    pending_.push_back({kind_, tokenizer_.token_bytes(id), tool_index_});
  }
  return std::move(pending_);
}

}  // namespace nb
