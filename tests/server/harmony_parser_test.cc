// HarmonyParser on token sequences built with the gpt-oss tokenizer (formats.md §7.2): analysis ->
// reasoning, final -> content, commentary to=functions.X -> a tool call with the JSON arguments
// (recipient before or after the channel), headers never leak, <|return|>/<|call|> end the turn.
#include "server/harmony_parser.h"

#include <gtest/gtest.h>

namespace nb {
namespace {

struct Parsed {
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> tools;  // name, arguments
  bool done = false;
};

Parsed parse(const std::string& output) {
  auto t = Tokenizer::load(std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/gpt_oss_mxfp4");
  NB_CHECK(t.ok(), t.status().message());
  HarmonyParser p(*t.value());
  Parsed out;
  for (int32_t id : t.value()->encode(output, /*allow_special=*/true)) {
    for (const HarmonyEvent& e : p.add(id)) {
      switch (e.kind) {
        case HarmonyEvent::Kind::kReasoning:
          out.reasoning += e.text;
          break;
        case HarmonyEvent::Kind::kContent:
          out.content += e.text;
          break;
        case HarmonyEvent::Kind::kToolCallStart:
          out.tools.push_back({e.text, ""});
          break;
        case HarmonyEvent::Kind::kToolArguments:
          out.tools.at(e.tool_index).second += e.text;
          break;
      }
    }
  }
  out.done = p.done();
  return out;
}

TEST(HarmonyParser, AnalysisThenFinal) {
  Parsed p = parse(
      "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello "
      "there!<|return|>");
  EXPECT_EQ(p.reasoning, "User says hi.");
  EXPECT_EQ(p.content, "Hello there!");
  EXPECT_TRUE(p.tools.empty());
  EXPECT_TRUE(p.done);
}

TEST(HarmonyParser, ToolCallRecipientAfterChannel) {
  Parsed p = parse(
      "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
      "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>");
  EXPECT_EQ(p.reasoning, "Need weather.");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.tools.size(), 1u);
  EXPECT_EQ(p.tools[0].first, "get_weather");
  EXPECT_EQ(p.tools[0].second, "{\"city\": \"Paris\"}");
  EXPECT_TRUE(p.done);
}

TEST(HarmonyParser, ToolCallRecipientInRole) {
  Parsed p = parse(" to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>");
  ASSERT_EQ(p.tools.size(), 1u);
  EXPECT_EQ(p.tools[0].first, "lookup");
  EXPECT_EQ(p.tools[0].second, "{}");
}

TEST(HarmonyParser, PreambleIsContentAndBuiltinsAreReasoning) {
  Parsed p = parse(
      "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant "
      "to=browser.search<|channel|>analysis"
      "<|message|>{\"q\":1}<|end|><|start|>assistant<|channel|>final<|message|>Done<|return|>");
  EXPECT_EQ(p.content, "Let me check.Done");
  EXPECT_EQ(p.reasoning, "{\"q\":1}");
}

TEST(HarmonyParser, GarbageNeverLeaksHeaders) {
  Parsed p = parse("<|channel|>final junk<|start|><|message|>ok<|end|>stray text<|channel|>x");
  EXPECT_EQ(p.content, "ok");
  EXPECT_FALSE(p.done);
}

}  // namespace
}  // namespace nb
