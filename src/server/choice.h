// Choice: one output of a request (n of them per request) as the HTTP thread assembles it from the
// engine's tokens: incremental text with stop strings (TextStream), harmony channels and tool calls
// for gpt-oss (HarmonyParser), logprobs. The same object feeds streaming deltas and the final
// non-streaming message, so both paths produce the same text.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/request_stream.h"
#include "server/harmony_parser.h"
#include "server/openai_request.h"
#include "server/text_stream.h"

namespace nb {

struct ToolCallOut {
  std::string id, name, arguments;
};

// What one token (or the end) adds to a choice.
struct ChoiceDelta {
  std::string content, reasoning;
  nlohmann::json tool_calls = nlohmann::json::array();  // streaming tool_calls entries
  std::vector<GeneratedToken> logprob_tokens;           // tokens whose logprobs this delta reports
  bool empty() const {
    return content.empty() && reasoning.empty() && tool_calls.empty() && logprob_tokens.empty();
  }
};

class Choice {
 public:
  Choice(const ParsedRequest& request, const Tokenizer& tokenizer);

  ChoiceDelta add(const GeneratedToken& token);
  // Whether the engine has produced this choice's first token (set by the response writer's pump).
  bool started() const { return started_; }
  void mark_started() { started_ = true; }
  // The engine's end (or an abort); flushes held-back text.
  ChoiceDelta finish(const StreamUpdate& end);
  // Ends early because a stop string was found (the engine request is then cancelled).
  bool stopped() const { return text_.stopped(); }
  bool finished() const { return !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }
  std::string error() const { return error_; }

  int32_t n_generated() const { return n_generated_; }
  const std::string& content() const { return content_; }
  const std::string& reasoning() const { return reasoning_; }
  const std::vector<ToolCallOut>& tool_calls() const { return tools_; }
  const std::vector<GeneratedToken>& tokens() const { return all_tokens_; }
  bool harmony() const { return harmony_ != nullptr; }

 private:
  void route(ChoiceDelta& d, const std::vector<HarmonyEvent>& events);

  const ParsedRequest& request_;
  const Tokenizer& tokenizer_;
  TextStream text_;                         // content (with the stop strings)
  std::unique_ptr<HarmonyParser> harmony_;  // gpt-oss chat only
  std::unique_ptr<TextStream> reasoning_text_;
  std::vector<std::unique_ptr<TextStream>> tool_text_;
  std::string content_, reasoning_, finish_reason_, error_;
  std::vector<ToolCallOut> tools_;
  std::vector<GeneratedToken> all_tokens_;
  int32_t n_generated_ = 0;
  bool started_ = false;
  std::vector<HarmonyEvent> prefix_events_;  // from the prefilled assistant header, not yet sent
};

// OpenAI logprobs objects. Chat: {"content": [{token, logprob, bytes, top_logprobs}]}.
nlohmann::json chat_logprobs(const Tokenizer& tokenizer, const std::vector<GeneratedToken>& tokens);
// Completions: {tokens, token_logprobs, top_logprobs, text_offset}; offsets start at `offset`.
nlohmann::json completion_logprobs(const Tokenizer& tokenizer, const std::vector<GeneratedToken>& tokens,
                                   size_t offset);

}  // namespace nb
