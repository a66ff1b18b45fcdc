// Chat formatting tests: renderings from the reference implementations (openai_harmony for harmony, the
// Qwen3 jinja template for chatml; tests/data/tokenizer/chat_goldens.json, made by
// tools/reference/make_chat_goldens.py), hand-written Llama 3 strings, and errors naming the culprit.
#include "text/chat.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace nb {
namespace {

using json = nlohmann::json;

json load_goldens() {
  std::ifstream f(std::string(NIBBLE_SOURCE_DIR) + "/tests/data/tokenizer/chat_goldens.json");
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

std::vector<ChatMessage> to_messages(const json& in) {
  std::vector<ChatMessage> out;
  for (const json& m : in) {
    ChatMessage msg;
    msg.role = m.at("role");
    msg.content = m.value("content", "");
    msg.reasoning = m.value("reasoning", "");
    msg.name = m.value("name", "");
    msg.tool_call_id = m.value("tool_call_id", "");
    for (const json& c : m.value("tool_calls", json::array())) {
      msg.tool_calls.push_back({c.at("id"), c.at("name"), c.at("arguments")});
    }
    out.push_back(std::move(msg));
  }
  return out;
}

ChatOptions to_options(const json& o) {
  ChatOptions opt;
  opt.add_generation_prompt = o.value("add_generation_prompt", true);
  opt.reasoning_effort = o.value("reasoning_effort", "medium");
  opt.enable_thinking = o.value("enable_thinking", true);
  opt.tools_json = o.value("tools_json", "");
  opt.current_date = o.value("current_date", "");
  return opt;
}

TEST(ChatGoldens, MatchReferenceRenderings) {
  json goldens = load_goldens();
  size_t compared = 0;
  for (const json& c : goldens["cases"]) {
    for (const auto& [format_name, expected] : c["expected"].items()) {
      auto format = parse_chat_format(format_name);
      ASSERT_TRUE(format.has_value()) << format_name;
      auto got = render_chat(*format, to_messages(c["messages"]), to_options(c["options"]));
      ASSERT_TRUE(got.ok()) << c["name"] << ": " << got.status().message();
      EXPECT_EQ(*got, expected.get<std::string>()) << c["name"] << " (" << format_name << ")";
      ++compared;
    }
  }
  EXPECT_GE(compared, 25u);
}

// The harmony layout, spelled out (formats.md 7.2); the goldens cover the rest.
TEST(ChatHarmony, ToolCallHistory) {
  std::vector<ChatMessage> m(3);
  m[0] = {.role = "user", .content = "Weather?"};
  m[1] = {.role = "assistant", .reasoning = "Call it."};
  m[1].tool_calls = {{"c1", "get_weather", "{\"city\":\"Oslo\"}"}};
  m[2] = {.role = "tool", .content = "cold", .tool_call_id = "c1"};
  ChatOptions opt;
  opt.reasoning_effort = "low";
  auto got = render_chat(ChatFormat::kHarmony, m, opt);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(
      *got,
      "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
      "Knowledge cutoff: 2024-06\n\nReasoning: low\n\n"
      "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
      "<|start|>user<|message|>Weather?<|end|>"
      "<|start|>assistant<|channel|>analysis<|message|>Call it.<|end|>"
      "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
      "{\"city\":\"Oslo\"}<|call|>"
      "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>cold<|end|>"
      "<|start|>assistant");
}

TEST(ChatHarmony, ReasoningBeforeTheLastFinalIsDropped) {
  std::vector<ChatMessage> m = {{.role = "user", .content = "a"},
                                {.role = "assistant", .content = "A1", .reasoning = "r1"},
                                {.role = "user", .content = "b"},
                                {.role = "assistant", .content = "A2", .reasoning = "r2"}};
  ChatOptions opt;
  opt.add_generation_prompt = false;
  auto got = render_chat(ChatFormat::kHarmony, m, opt);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->find("r1"), std::string::npos);
  EXPECT_EQ(got->find("r2"), std::string::npos);
  EXPECT_NE(got->find("<|start|>assistant<|channel|>final<|message|>A2<|end|>"), std::string::npos);
}

TEST(ChatChatml, ThinkingSwitch) {
  std::vector<ChatMessage> m = {{.role = "user", .content = "Hi"}};
  ChatOptions opt;
  EXPECT_EQ(*render_chat(ChatFormat::kChatml, m, opt),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  opt.enable_thinking = false;
  EXPECT_EQ(*render_chat(ChatFormat::kChatml, m, opt),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(ChatLlama3, Layout) {
  std::vector<ChatMessage> m = {{.role = "system", .content = "Be brief.\n"},
                                {.role = "user", .content = "  Hi  "},
                                {.role = "assistant", .content = "Hello."},
                                {.role = "user", .content = "Bye"}};
  ChatOptions opt;
  auto got = render_chat(ChatFormat::kLlama3, m, opt);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  opt.add_generation_prompt = false;
  EXPECT_EQ(render_chat(ChatFormat::kLlama3, {m[1]}, opt).value(),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

void expect_error(ChatFormat f, const std::vector<ChatMessage>& m, const ChatOptions& o,
                  const std::string& want) {
  auto got = render_chat(f, m, o);
  ASSERT_FALSE(got.ok()) << want;
  EXPECT_NE(got.status().message().find(want), std::string::npos) << got.status().message();
  EXPECT_EQ(got.status().message().find('\n'), std::string::npos);
}

TEST(ChatErrors, NameTheCulprit) {
  std::vector<ChatMessage> user = {{.role = "user", .content = "hi"}};
  ChatOptions opt;
  expect_error(ChatFormat::kHarmony, {{.role = "user"}, {.role = "bot"}}, opt,
               "messages[1]: unknown role 'bot'");
  expect_error(ChatFormat::kHarmony, {{.role = "tool", .content = "x", .tool_call_id = "zz"}}, opt,
               "messages[0]: tool message needs a name");
  ChatOptions bad = opt;
  bad.reasoning_effort = "extreme";
  expect_error(ChatFormat::kHarmony, user, bad, "reasoning_effort: 'extreme'");
  bad = opt;
  bad.tools_json = "[{\"type\": \"function\", \"function\": {\"description\": \"x\"}}]";
  expect_error(ChatFormat::kHarmony, user, bad, "tools[0].function: missing name");
  bad.tools_json = "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": 3}}]";
  expect_error(ChatFormat::kHarmony, user, bad, "tools[0].function.parameters");
  bad.tools_json = "[{\"type\": \"retrieval\"}]";
  expect_error(ChatFormat::kChatml, user, bad, "tools[0]: type \"retrieval\"");
  bad.tools_json = "{not json";
  expect_error(ChatFormat::kChatml, user, bad, "tools: invalid JSON");
  bad.tools_json = "[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]";
  expect_error(ChatFormat::kLlama3, user, bad, "tools: not supported by the llama3");
  std::vector<ChatMessage> call = {{.role = "user", .tool_calls = {{"1", "f", "{}"}}}};
  expect_error(ChatFormat::kHarmony, call, opt, "messages[0]: only assistant messages carry tool_calls");
}

TEST(ChatFormats, ForModelTypeAndStops) {
  EXPECT_EQ(chat_format_for("gpt_oss"), ChatFormat::kHarmony);
  EXPECT_EQ(chat_format_for("qwen3"), ChatFormat::kChatml);
  EXPECT_EQ(chat_format_for("qwen3_moe"), ChatFormat::kChatml);
  EXPECT_EQ(chat_format_for("llama"), ChatFormat::kLlama3);
  EXPECT_EQ(parse_chat_format("llama3"), ChatFormat::kLlama3);
  EXPECT_FALSE(parse_chat_format("vicuna").has_value());
  EXPECT_STREQ(chat_format_name(ChatFormat::kHarmony), "harmony");
  EXPECT_EQ(chat_stop_tokens(ChatFormat::kHarmony), (std::vector<std::string>{"<|return|>", "<|call|>"}));
  EXPECT_EQ(chat_stop_tokens(ChatFormat::kChatml), (std::vector<std::string>{"<|im_end|>", "<|endoftext|>"}));
  EXPECT_EQ(chat_stop_tokens(ChatFormat::kLlama3)[0], "<|eot_id|>");
}

}  // namespace
}  // namespace nb
