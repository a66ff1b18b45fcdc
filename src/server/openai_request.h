// OpenAI request bodies -> a validated ParsedRequest: JSON fields type-checked one by one (a wrong
// type is a 400 naming the field), chat messages rendered with the model's chat format, prompts
// tokenized, lengths checked against the context with vLLM's wording. Runs on the HTTP thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "io/config.h"
#include "runtime/engine.h"
#include "server/api_error.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace nb {

// What the server knows when it parses a request (read-only, shared by all HTTP threads).
struct ServeContext {
  const ModelConfig* config = nullptr;
  const Tokenizer* tokenizer = nullptr;
  std::string served_model_name;
  int32_t max_model_len = 0;
  ChatFormat chat_format = ChatFormat::kChatml;
  std::vector<int32_t> eos_ids;        // end of a raw completion
  std::vector<int32_t> chat_stop_ids;  // end of an assistant turn
  SamplingParams default_sampling;     // generation_config.json's, for fields the request leaves out
  int max_logprobs = 20;
  int max_n = 128;
  bool test_forced_output = false;  // honour the nibble_forced_output request field (tests only)
};

enum class Endpoint : uint8_t { kChat, kCompletion };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChat;
  GenerationRequest gen;  // prompt, sampling, max_tokens, stop ids, logprobs (shared by the n choices)
  int n = 1;
  bool stream = false, include_usage = false, continuous_usage = false;
  std::vector<std::string> stop;  // stop strings
  bool logprobs = false;          // chat: logprobs:true; completions: logprobs:N
  int top_logprobs = 0;
  bool harmony = false;  // chat with a gpt-oss model: parse the harmony channels
  // Harmony tool_choice "required" / named: the header the prompt already holds for the assistant
  // (`<|channel|>commentary to=functions.[NAME <|constrain|>json<|message|>]`), which the output parser
  // must read before the generated tokens.
  std::vector<int32_t> assistant_prefix;
  bool skip_special_tokens = true;
  bool echo = false;  // completions: prompt text before the output
  std::string prompt_text;
};

std::variant<ParsedRequest, ApiError> parse_request(Endpoint endpoint, const nlohmann::json& body,
                                                    const ServeContext& ctx);
// Body -> JSON object, or a 400 naming the problem.
std::variant<nlohmann::json, ApiError> parse_json_object(const std::string& body);
// Renders messages (OpenAI chat format) to a prompt string; for /tokenize as well.
std::variant<std::string, ApiError> render_messages(const nlohmann::json& body, const ServeContext& ctx);

}  // namespace nb
