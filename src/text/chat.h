// Chat formatting: OpenAI-style messages -> one prompt string for harmony (gpt-oss), ChatML (Qwen3) or
// Llama 3. Special tokens appear as their text, so the prompt is encoded with allow_special = true.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace nb {

enum class ChatFormat { kHarmony, kChatml, kLlama3 };

struct ToolCall {
  std::string id, name, arguments_json;  // arguments as the JSON text the model produced
};

// One OpenAI chat message. role: system, developer, user, assistant or tool. reasoning is the
// assistant's chain of thought (OpenAI `reasoning` / `reasoning_content`). A tool message names its
// function by tool_call_id (matched against earlier tool_calls) or by name.
struct ChatMessage {
  std::string role, content, name, reasoning, tool_call_id;
  std::vector<ToolCall> tool_calls;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  std::string reasoning_effort = "medium";  // harmony: low | medium | high
  bool enable_thinking = true;              // chatml: false appends an empty <think></think> block
  std::string tools_json;                   // OpenAI tools array, or empty
  std::string current_date;                 // harmony: "Current date: ..." when set
};

// Errors name the message index and field ("messages[2]: unknown role 'bot'", "tools[0].function:
// missing name").
Result<std::string> render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                                const ChatOptions& options);

// gpt_oss -> harmony; qwen3, qwen3_moe (any qwen*) -> chatml; llama -> llama3. Other model types get
// chatml, the most common open format; parse_chat_format() lets a flag override it.
ChatFormat chat_format_for(std::string_view model_type);
std::optional<ChatFormat> parse_chat_format(std::string_view name);  // "harmony" | "chatml" | "llama3"
const char* chat_format_name(ChatFormat format);

// Special-token texts that end an assistant turn (look them up with Tokenizer::token_id).
std::vector<std::string> chat_stop_tokens(ChatFormat format);

}  // namespace nb
