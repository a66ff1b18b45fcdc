#include "server/choice.h"

#include <random>

namespace nb {

using json = nlohmann::json;

static std::string random_id(const char* prefix) {
  std::random_device rd;
  std::mt19937_64 rng((static_cast<uint64_t>(rd()) << 32) ^ rd());
  static const char kHex[] = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kHex[rng() % 16];
  return id;
}

Choice::Choice(const ParsedRequest& request, const Tokenizer& tokenizer)
    : request_(request), tokenizer_(tokenizer), text_(tokenizer, request.stop, request.skip_special_tokens) {
  if (request.harmony && HarmonyParser::supported(tokenizer)) {
    harmony_ = std::make_unique<HarmonyParser>(tokenizer);
    reasoning_text_ = std::make_unique<TextStream>(tokenizer, std::vector<std::string>{}, true);
    // The prompt already holds the start of the assistant's header (tool_choice): parse it first; its
    // events (a named tool call's start) go out with the first delta.
    for (int32_t id : request.assistant_prefix) {
      auto events = harmony_->add(id);
      prefix_events_.insert(prefix_events_.end(), events.begin(), events.end());
    }
  }
}

void Choice::route(ChoiceDelta& d, const std::vector<HarmonyEvent>& events) {
  for (const HarmonyEvent& e : events) {
    switch (e.kind) {
      case HarmonyEvent::Kind::kContent:
        d.content += text_.add_text(e.text);
        break;
      case HarmonyEvent::Kind::kReasoning:
        d.reasoning += reasoning_text_->add_text(e.text);
        break;
      case HarmonyEvent::Kind::kToolCallStart: {
        tools_.push_back({random_id("call_"), e.text, ""});
        tool_text_.push_back(std::make_unique<TextStream>(tokenizer_, std::vector<std::string>{}, true));
        d.tool_calls.push_back({{"index", e.tool_index},
                                {"id", tools_.back().id},
                                {"type", "function"},
                                {"function", {{"name", e.text}, {"arguments", ""}}}});
        break;
      }
      case HarmonyEvent::Kind::kToolArguments: {
        const std::string args = tool_text_[e.tool_index]->add_text(e.text);
        if (args.empty()) break;
        tools_[e.tool_index].arguments += args;
        d.tool_calls.push_back({{"index", e.tool_index}, {"function", {{"arguments", args}}}});
        break;
      }
    }
  }
}

ChoiceDelta Choice::add(const GeneratedToken& token) {
  ChoiceDelta d;
  if (finished() || text_.stopped()) return d;
  ++n_generated_;
  if (request_.logprobs) {
    d.logprob_tokens.push_back(token);
    all_tokens_.push_back(token);
  } else {
    all_tokens_.push_back({token.id, 0.0f, {}});
  }
  if (!prefix_events_.empty()) {
    route(d, prefix_events_);
    prefix_events_.clear();
  }
  if (harmony_)
    route(d, harmony_->add(token.id));
  else
    d.content = text_.add(token.id);
  content_ += d.content;
  reasoning_ += d.reasoning;
  return d;
}

ChoiceDelta Choice::finish(const StreamUpdate& end) {
  ChoiceDelta d;
  if (finished()) return d;
  if (!prefix_events_.empty()) {
    route(d, prefix_events_);
    prefix_events_.clear();
  }
  if (end.stop_token >= 0) {
    ++n_generated_;
    if (harmony_) route(d, harmony_->add(end.stop_token));
  }
  d.content += text_.flush();
  if (reasoning_text_) d.reasoning += reasoning_text_->flush();
  for (size_t i = 0; i < tool_text_.size(); ++i) {
    const std::string rest = tool_text_[i]->flush();
    if (rest.empty()) continue;
    tools_[i].arguments += rest;
    d.tool_calls.push_back({{"index", i}, {"function", {{"arguments", rest}}}});
  }
  content_ += d.content;
  reasoning_ += d.reasoning;
  error_ = end.error;
  finish_reason_ =
      !tools_.empty() && end.finish == FinishReason::kStop ? "tool_calls" : finish_reason_name(end.finish);
  return d;
}

static json token_bytes_json(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json chat_logprobs(const Tokenizer& tokenizer, const std::vector<GeneratedToken>& tokens) {
  json content = json::array();
  for (const GeneratedToken& t : tokens) {
    const std::string text = tokenizer.token_bytes(t.id);
    json top = json::array();
    for (auto [id, lp] : t.top) {
      const std::string s = tokenizer.token_bytes(id);
      top.push_back({{"token", s}, {"logprob", lp}, {"bytes", token_bytes_json(s)}});
    }
    content.push_back(
        {{"token", text}, {"logprob", t.logprob}, {"bytes", token_bytes_json(text)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json completion_logprobs(const Tokenizer& tokenizer, const std::vector<GeneratedToken>& tokens,
                         size_t offset) {
  json out = {{"tokens", json::array()},
              {"token_logprobs", json::array()},
              {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  for (const GeneratedToken& t : tokens) {
    const std::string text = tokenizer.token_bytes(t.id);
    out["tokens"].push_back(text);
    out["token_logprobs"].push_back(t.logprob);
    json top = json::object();
    for (auto [id, lp] : t.top) top[tokenizer.token_bytes(id)] = lp;
    out["top_logprobs"].push_back(top);
    out["text_offset"].push_back(offset);
    offset += text.size();
  }
  return out;
}

}  // namespace nb
