// Chat formats. harmony follows openai/harmony's renderer; chatml follows the Qwen3 chat template;
// llama3 the Llama 3 one. tests/text/chat_test.cc holds goldens rendered by those references.
#include "text/chat.h"

#include <nlohmann/json.hpp>

#include "text/harmony_tools.h"

namespace nb {
namespace {

using ojson = nlohmann::ordered_json;

std::string at(size_t i) { return "messages[" + std::to_string(i) + "]"; }

// The OpenAI tools array, validated. Keeps key order: both harmony and Qwen print tools as given.
Result<ojson> parse_tools(const std::string& tools_json) {
  if (tools_json.empty()) return ojson::array();
  ojson tools = ojson::parse(tools_json, nullptr, false);
  if (tools.is_discarded()) return error("tools: invalid JSON");
  if (tools.is_null()) return ojson::array();
  if (!tools.is_array()) return error("tools: expected an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    std::string where = "tools[" + std::to_string(i) + "]";
    const ojson& t = tools[i];
    if (!t.is_object()) return error(where + ": expected an object");
    if (auto type = t.find("type"); type != t.end() && *type != "function") {
      return error(where + ": type " + type->dump() + " is not supported (only \"function\")");
    }
    auto fn = t.find("function");
    if (fn == t.end() || !fn->is_object()) return error(where + ": missing the \"function\" object");
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty()) {
      return error(where + ".function: missing name");
    }
    if (auto d = fn->find("description"); d != fn->end() && !d->is_string() && !d->is_null()) {
      return error(where + ".function.description: expected a string");
    }
    if (auto p = fn->find("parameters"); p != fn->end() && !p->is_null()) {
      if (!p->is_object()) return error(where + ".function.parameters: expected a JSON-schema object");
      if (auto props = p->find("properties"); props != p->end() && !props->is_object()) {
        return error(where + ".function.parameters.properties: expected an object");
      }
      if (auto req = p->find("required"); req != p->end() && !req->is_array()) {
        return error(where + ".function.parameters.required: expected an array");
      }
    }
  }
  return tools;
}

Status check_roles(const std::vector<ChatMessage>& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "developer" && r != "user" && r != "assistant" && r != "tool") {
      return error(at(i) + ": unknown role '" + r +
                   "' (expected system, developer, user, assistant or tool)");
    }
    if (!messages[i].tool_calls.empty() && r != "assistant") {
      return error(at(i) + ": only assistant messages carry tool_calls");
    }
    for (size_t k = 0; k < messages[i].tool_calls.size(); ++k) {
      if (messages[i].tool_calls[k].name.empty()) {
        return error(at(i) + ".tool_calls[" + std::to_string(k) + "]: missing function name");
      }
    }
  }
  return Status();
}

// The function a tool message answers: its tool_call_id's call, else its name.
Result<std::string> tool_name(const std::vector<ChatMessage>& messages, size_t i) {
  const ChatMessage& m = messages[i];
  if (!m.tool_call_id.empty()) {
    for (size_t j = i; j-- > 0;) {
      for (const ToolCall& c : messages[j].tool_calls) {
        if (c.id == m.tool_call_id) return c.name;
      }
    }
  }
  if (!m.name.empty()) return m.name;
  return error(at(i) + ": tool message needs a name or a tool_call_id of an earlier tool call" +
               (m.tool_call_id.empty() ? "" : " (no call has id '" + m.tool_call_id + "')"));
}

// Rust's str::lines(): split on \n, drop one trailing \r per line and a final empty line.
std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t eol = s.find('\n', pos);
    if (eol == std::string::npos) eol = s.size();
    std::string line = s.substr(pos, eol - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    out.push_back(std::move(line));
    pos = eol + 1;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// harmony (formats.md 7.2)

std::string harmony_functions_namespace(const ojson& tools) {
  std::vector<std::string> parts = {"## functions\n", "namespace functions {\n"};
  for (const ojson& t : tools) {
    const ojson& fn = t["function"];
    if (auto d = fn.find("description"); d != fn.end() && d->is_string()) {
      for (const std::string& line : lines(d->get<std::string>())) parts.push_back("// " + line);
    }
    const std::string& name = fn["name"].get_ref<const std::string&>();
    auto params = fn.find("parameters");
    if (params != fn.end() && !params->is_null()) {
      parts.push_back("type " + name + " = (_: " + text::json_schema_to_typescript(*params, "") +
                      ") => any;\n");
    } else {
      parts.push_back("type " + name + " = () => any;\n");
    }
  }
  parts.push_back("} // namespace functions");
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "\n" : "") + parts[i];
  return out;
}

void harmony_message(std::string* out, const std::string& header, const std::string& content,
                     const char* end = "<|end|>") {
  *out += "<|start|>" + header + "<|message|>" + content + end;
}

std::string harmony_developer(const std::string& instructions, const ojson& tools) {
  std::vector<std::string> sections;
  if (!instructions.empty()) {
    sections.push_back("# Instructions");
    sections.push_back(instructions);
  }
  if (!tools.empty()) sections.push_back("# Tools\n\n" + harmony_functions_namespace(tools));
  std::string out;
  for (size_t i = 0; i < sections.size(); ++i) out += (i ? "\n\n" : "") + sections[i];
  return out;
}

Result<std::string> render_harmony(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                   const ojson& tools) {
  std::string effort = options.reasoning_effort.empty() ? "medium" : options.reasoning_effort;
  if (effort != "low" && effort != "medium" && effort != "high") {
    return error("reasoning_effort: '" + effort + "' is not one of low, medium, high");
  }
  std::string out;
  std::string system =
      "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06";
  if (!options.current_date.empty()) system += "\nCurrent date: " + options.current_date;
  system += "\n\nReasoning: " + effort;
  system += "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.";
  if (!tools.empty()) system += "\nCalls to these tools must go to the commentary channel: 'functions'.";
  harmony_message(&out, "system", system);

  // Leading system/developer messages become the developer message's instructions.
  size_t first = 0;
  std::string instructions;
  for (; first < messages.size() && (messages[first].role == "system" || messages[first].role == "developer");
       ++first) {
    if (!instructions.empty()) instructions += "\n\n";
    instructions += messages[first].content;
  }
  if (!instructions.empty() || !tools.empty())
    harmony_message(&out, "developer", harmony_developer(instructions, tools));

  // History rule: chain of thought before the last final answer is dropped; after it (a turn still
  // in progress, e.g. a tool-call loop) it is kept.
  size_t last_final = 0;
  bool has_final = false;
  for (size_t i = first; i < messages.size(); ++i) {
    if (messages[i].role == "assistant" && messages[i].tool_calls.empty()) {
      last_final = i;
      has_final = true;
    }
  }

  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system" || m.role == "developer") {
      harmony_message(&out, "developer", harmony_developer(m.content, ojson::array()));
    } else if (m.role == "user") {
      harmony_message(&out, "user", m.content);
    } else if (m.role == "tool") {
      NB_ASSIGN_OR_RETURN(std::string name, tool_name(messages, i));
      harmony_message(&out, "functions." + name + " to=assistant<|channel|>commentary", m.content);
    } else {  // assistant
      if (!m.reasoning.empty() && !(has_final && i <= last_final)) {
        harmony_message(&out, "assistant<|channel|>analysis", m.reasoning);
      }
      if (m.tool_calls.empty()) {
        harmony_message(&out, "assistant<|channel|>final", m.content);
        continue;
      }
      if (!m.content.empty()) harmony_message(&out, "assistant<|channel|>commentary", m.content);
      for (const ToolCall& c : m.tool_calls) {
        // Recipient in the role part, as openai_harmony renders history; the model may put it
        // after the channel when it generates, and the parser accepts both.
        harmony_message(&out, "assistant to=functions." + c.name + "<|channel|>commentary <|constrain|>json",
                        c.arguments_json, "<|call|>");
      }
    }
  }
  if (options.add_generation_prompt) out += "<|start|>assistant";
  return out;
}

// ---------------------------------------------------------------------------------------------
// chatml (Qwen3 chat template)

// Python json.dumps(x, ensure_ascii=False): ", " and ": " separators, key order kept.
std::string python_json(const ojson& j) {
  if (j.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, v] : j.items()) {
      out += (first ? "" : ", ") + ojson(k).dump(-1, ' ', false, ojson::error_handler_t::replace) + ": " +
             python_json(v);
      first = false;
    }
    return out + "}";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + python_json(j[i]);
    return out + "]";
  }
  if (j.is_boolean()) return j.get<bool>() ? "true" : "false";
  return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

std::string strip(const std::string& s, const char* chars, bool left, bool right) {
  size_t b = left ? s.find_first_not_of(chars) : 0;
  if (b == std::string::npos) return "";
  size_t e = right ? s.find_last_not_of(chars) : s.size() - 1;
  return s.substr(b, e - b + 1);
}

bool is_tool_response(const std::string& s) {
  const std::string open = "<tool_response>", close = "</tool_response>";
  return s.size() >= open.size() && s.compare(0, open.size(), open) == 0 && s.size() >= close.size() &&
         s.compare(s.size() - close.size(), close.size(), close) == 0;
}

Result<std::string> render_chatml(const std::vector<ChatMessage>& in, const ChatOptions& options,
                                  const ojson& tools) {
  // The Qwen3 template knows no developer role; OpenAI's developer messages are system messages.
  std::vector<ChatMessage> messages = in;
  for (ChatMessage& m : messages) {
    if (m.role == "developer") m.role = "system";
  }
  std::string out;
  bool first_is_system = !messages.empty() && messages[0].role == "system";
  if (!tools.empty()) {
    out += "<|im_start|>system\n";
    if (first_is_system) out += messages[0].content + "\n\n";
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
        "with "
        "function signatures within <tools></tools> XML tags:\n<tools>";
    for (const ojson& t : tools) out += "\n" + python_json(t);
    out +=
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n";
  } else if (first_is_system) {
    out += "<|im_start|>system\n" + messages[0].content + "<|im_end|>\n";
  }
  // Thinking is shown only for assistant turns after the last real user query.
  size_t last_query = messages.empty() ? 0 : messages.size() - 1;
  for (size_t i = messages.size(); i-- > 0;) {
    if (messages[i].role == "user" && !is_tool_response(messages[i].content)) {
      last_query = i;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    bool last = i + 1 == messages.size();
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    } else if (m.role == "assistant") {
      std::string content = m.content, reasoning = m.reasoning;
      size_t close = content.find("</think>");
      if (reasoning.empty() && close != std::string::npos) {
        std::string before = strip(content.substr(0, close), "\n", false, true);
        size_t open = before.rfind("<think>");
        reasoning = strip(open == std::string::npos ? before : before.substr(open + 7), "\n", true, false);
        content = strip(content.substr(content.rfind("</think>") + 8), "\n", true, false);
      }
      if (i > last_query && (last || !reasoning.empty())) {
        out += "<|im_start|>assistant\n<think>\n" + strip(reasoning, "\n", true, true) + "\n</think>\n\n" +
               strip(content, "\n", true, false);
      } else {
        out += "<|im_start|>assistant\n" + content;
      }
      for (size_t k = 0; k < m.tool_calls.size(); ++k) {
        if (k > 0 || !content.empty()) out += "\n";
        out += "<tool_call>\n{\"name\": \"" + m.tool_calls[k].name +
               "\", \"arguments\": " + m.tool_calls[k].arguments_json + "}\n</tool_call>";
      }
      out += "<|im_end|>\n";
    } else if (m.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
      if (last || messages[i + 1].role != "tool") out += "<|im_end|>\n";
    }
  }
  if (options.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (!options.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// llama3 (Llama 3 chat template: content trimmed, BOS as text)

Result<std::string> render_llama3(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                  const ojson& tools) {
  if (!tools.empty()) return error("tools: not supported by the llama3 chat format");
  std::string out = "<|begin_of_text|>";
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "tool" || !m.tool_calls.empty()) {
      return error(at(i) + ": tool calls and tool results are not supported by the llama3 chat format");
    }
    std::string role = m.role == "developer" ? "system" : m.role;
    out += "<|start_header_id|>" + role + "<|end_header_id|>\n\n" +
           strip(m.content, " \t\n\r\f\v", true, true) + "<|eot_id|>";
  }
  if (options.add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

}  // namespace

Result<std::string> render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                                const ChatOptions& options) {
  NB_RETURN_IF_ERROR(check_roles(messages));
  NB_ASSIGN_OR_RETURN(ojson tools, parse_tools(options.tools_json));
  switch (format) {
    case ChatFormat::kHarmony:
      return render_harmony(messages, options, tools);
    case ChatFormat::kChatml:
      return render_chatml(messages, options, tools);
    case ChatFormat::kLlama3:
      return render_llama3(messages, options, tools);
  }
  return error("unknown chat format");
}

ChatFormat chat_format_for(std::string_view model_type) {
  if (model_type == "gpt_oss") return ChatFormat::kHarmony;
  if (model_type == "llama") return ChatFormat::kLlama3;
  return ChatFormat::kChatml;
}

std::optional<ChatFormat> parse_chat_format(std::string_view name) {
  if (name == "harmony") return ChatFormat::kHarmony;
  if (name == "chatml") return ChatFormat::kChatml;
  if (name == "llama3") return ChatFormat::kLlama3;
  return std::nullopt;
}

const char* chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::kHarmony:
      return "harmony";
    case ChatFormat::kChatml:
      return "chatml";
    case ChatFormat::kLlama3:
      return "llama3";
  }
  return "?";
}

std::vector<std::string> chat_stop_tokens(ChatFormat format) {
  switch (format) {
    case ChatFormat::kHarmony:
      return {"<|return|>", "<|call|>"};
    case ChatFormat::kChatml:
      return {"<|im_end|>", "<|endoftext|>"};
    case ChatFormat::kLlama3:
      return {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"};
  }
  return {};
}

}  // namespace nb
