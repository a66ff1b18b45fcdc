// HarmonyParser: gpt-oss output tokens -> OpenAI chat fields (formats.md §7.2). The prompt ends with
// `<|start|>assistant`, so parsing starts inside a header. Messages on the analysis channel (and to
// built-in tools) become reasoning_content, commentary messages to=functions.NAME become tool calls
// (their content is the JSON arguments), everything else (final, commentary preambles) is content.
// The recipient is found in the role part or after the channel. Header text never leaks into output.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace nb {

struct HarmonyEvent {
  enum class Kind : uint8_t { kReasoning, kContent, kToolCallStart, kToolArguments };
  Kind kind = Kind::kContent;
  std::string text;     // bytes of content (may end inside a UTF-8 character); tool name for a start
  int tool_index = -1;  // kToolCallStart / kToolArguments
};

class HarmonyParser {
 public:
  // The tokenizer must define the harmony special tokens (<|start|>, <|message|>, <|end|> ...).
  explicit HarmonyParser(const Tokenizer& tokenizer);
  static bool supported(const Tokenizer& tokenizer);

  std::vector<HarmonyEvent> add(int32_t id);
  int n_tool_calls() const { return n_tool_calls_; }
  bool done() const { return done_; }  // <|return|> or <|call|> seen

 private:
  enum class State : uint8_t { kOutside, kHeader, kContent };
  void open_message();

  const Tokenizer& tokenizer_;
  int32_t start_, message_, end_, return_, call_;
  State state_ = State::kHeader;
  std::string header_;
  HarmonyEvent::Kind kind_ = HarmonyEvent::Kind::kContent;
  int tool_index_ = -1, n_tool_calls_ = 0;
  std::vector<HarmonyEvent> pending_;  // events of the current add()
  bool done_ = false;
};

}  // namespace nb
