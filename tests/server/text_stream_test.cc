// TextStream: UTF-8 characters split over tokens are never cut, stop strings spanning tokens are found
// and never released, and only a tail that could still become a stop is held back.
#include "server/text_stream.h"

#include <gtest/gtest.h>

namespace nb {
namespace {

struct Fixture {
  std::unique_ptr<Tokenizer> tok;
  Fixture() {
    auto t = Tokenizer::load(std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/gpt_oss_mxfp4");
    NB_CHECK(t.ok(), t.status().message());
    tok = std::move(t.value());
  }
};

TEST(TextStream, HoldsBackPartialUtf8) {
  Fixture f;
  TextStream s(*f.tok, {}, true);
  EXPECT_EQ(s.add_text("a\xC3"), "a");  // é split after its lead byte
  EXPECT_EQ(s.add_text("\xA9z"), "\xC3\xA9z");
  EXPECT_EQ(s.add_text("\xE2\x82"), "");
  EXPECT_EQ(s.flush(), "\xE2\x82");  // the end releases what is left, whole or not
}

TEST(TextStream, StopSpanningTokensIsNotLeaked) {
  Fixture f;
  TextStream s(*f.tok, {"STOP"}, true);
  EXPECT_EQ(s.add_text("Hello S"), "Hello ");  // "S" may start STOP
  EXPECT_EQ(s.add_text("T"), "");
  EXPECT_EQ(s.add_text("OP and more"), "");
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.text(), "Hello ");
  EXPECT_EQ(s.flush(), "");
  EXPECT_EQ(s.add_text("x"), "");
}

TEST(TextStream, ReleasesAFalseStart) {
  Fixture f;
  TextStream s(*f.tok, {"STOP", "END"}, true);
  EXPECT_EQ(s.add_text("ST"), "");
  EXPECT_EQ(s.add_text("Ex"), "STEx");  // "STE" cannot become a stop any more
  EXPECT_EQ(s.add_text("EN"), "");
  EXPECT_EQ(s.flush(), "EN");
  EXPECT_FALSE(s.stopped());
}

TEST(TextStream, EarliestStopWins) {
  Fixture f;
  TextStream s(*f.tok, {"b", "abc"}, true);
  EXPECT_EQ(s.add_text("xabc"), "x");  // "abc" starts before "b"
  EXPECT_TRUE(s.stopped());
}

TEST(TextStream, TokensAndSpecials) {
  Fixture f;
  const auto ids = f.tok->encode("héllo<|end|>", /*allow_special=*/true);
  TextStream skip(*f.tok, {}, true), keep(*f.tok, {}, false);
  std::string a, b;
  for (int32_t id : ids) a += skip.add(id), b += keep.add(id);
  a += skip.flush();
  b += keep.flush();
  EXPECT_EQ(a, "héllo");
  EXPECT_EQ(b, "héllo<|end|>");
}

TEST(Utf8, SafeLength) {
  EXPECT_EQ(utf8_safe_length("abc"), 3u);
  EXPECT_EQ(utf8_safe_length("a\xF0\x9F\x98"), 1u);
  EXPECT_EQ(utf8_safe_length("a\xF0\x9F\x98\x80"), 5u);
  EXPECT_EQ(utf8_safe_length("\x80"), 1u);  // a stray continuation byte: nothing will complete it
}

}  // namespace
}  // namespace nb
