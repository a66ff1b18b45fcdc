#include "server/openai_request.h"

#include <algorithm>
#include <cmath>

namespace nb {
namespace {

using json = nlohmann::json;

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "boolean";
    case json::value_t::string:
      return "string";
    case json::value_t::array:
      return "array";
    case json::value_t::object:
      return "object";
    case json::value_t::number_float:
      return "number";
    default:
      return "integer";
  }
}

// Typed, range-checked access to optional body fields; the first problem is kept as a 400.
class Fields {
 public:
  explicit Fields(const json& body) : b_(body) {}
  bool has(const char* key) const { return b_.contains(key) && !b_[key].is_null(); }
  const json& at(const char* key) const { return b_[key]; }
  std::optional<ApiError> error;

  void fail(const std::string& param, const std::string& message) {
    if (!error) error = bad_request(message, param);
  }
  void wrong_type(const char* key, const char* want) {
    fail(key, std::string("'") + key + "' must be " + want + ", got " + type_name(b_[key]));
  }
  void number(const char* key, float* out, double lo, double hi) {
    if (!has(key)) return;
    if (!b_[key].is_number()) return wrong_type(key, "a number");
    const double v = b_[key].get<double>();
    if (!(v >= lo && v <= hi))
      return fail(key,
                  std::string("'") + key + "' must be in [" + fmt(lo) + ", " + fmt(hi) + "], got " + fmt(v));
    *out = static_cast<float>(v);
  }
  void integer(const char* key, int64_t* out, int64_t lo, int64_t hi) {
    if (!has(key)) return;
    const json& v = b_[key];
    if (!v.is_number_integer() && !(v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()))
      return wrong_type(key, "an integer");
    const double d = v.get<double>();
    if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi)))
      return fail(key, std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got " + v.dump());
    *out = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(d);
  }
  void boolean(const char* key, bool* out) {
    if (!has(key)) return;
    if (!b_[key].is_boolean()) return wrong_type(key, "a boolean");
    *out = b_[key].get<bool>();
  }
  void string(const char* key, std::string* out) {
    if (!has(key)) return;
    if (!b_[key].is_string()) return wrong_type(key, "a string");
    *out = b_[key].get<std::string>();
  }

 private:
  static std::string fmt(double v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", v);
    return buf;
  }
  const json& b_;
};

std::optional<ApiError> message_text(const json& content, const std::string& where, std::string* out) {
  if (content.is_null()) return std::nullopt;
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array())
    return bad_request(where + ".content must be a string or an array of parts", where + ".content");
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string p = where + ".content[" + std::to_string(i) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      return bad_request(p + " must be an object with a 'type'", p);
    if (part["type"] != "text" || !part.contains("text") || !part["text"].is_string())
      return bad_request(p + ": only text parts ({\"type\": \"text\", \"text\": ...}) are supported", p);
    *out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

std::optional<ApiError> parse_messages(const json& body, std::vector<ChatMessage>* out) {
  if (!body.contains("messages")) return bad_request("'messages' is required", "messages");
  const json& msgs = body["messages"];
  if (!msgs.is_array())
    return bad_request(std::string("'messages' must be an array, got ") + type_name(msgs), "messages");
  if (msgs.empty()) return bad_request("'messages' must not be empty", "messages");
  for (size_t i = 0; i < msgs.size(); ++i) {
    const json& m = msgs[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return bad_request(where + " must be an object", where);
    if (!m.contains("role") || !m["role"].is_string())
      return bad_request(where + ".role must be a string", where + ".role");
    ChatMessage cm;
    cm.role = m["role"].get<std::string>();
    static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
    if (std::find(std::begin(kRoles), std::end(kRoles), cm.role) == std::end(kRoles))
      return bad_request(where + ": unknown role '" + cm.role + "'", where + ".role");
    if (m.contains("content")) {
      if (auto e = message_text(m["content"], where, &cm.content)) return e;
    } else if (cm.role != "assistant") {
      return bad_request(where + ".content is required", where + ".content");
    }
    for (const char* key : {"name", "tool_call_id", "reasoning_content", "reasoning"}) {
      if (!m.contains(key) || m[key].is_null()) continue;
      if (!m[key].is_string()) return bad_request(where + "." + key + " must be a string", where + "." + key);
      const std::string v = m[key].get<std::string>();
      if (std::string(key) == "name")
        cm.name = v;
      else if (std::string(key) == "tool_call_id")
        cm.tool_call_id = v;
      else
        cm.reasoning = v;
    }
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      const json& calls = m["tool_calls"];
      if (!calls.is_array())
        return bad_request(where + ".tool_calls must be an array", where + ".tool_calls");
      for (size_t j = 0; j < calls.size(); ++j) {
        const std::string w = where + ".tool_calls[" + std::to_string(j) + "]";
        const json& c = calls[j];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
          return bad_request(w + " must be an object with a 'function'", w);
        const json& f = c["function"];
        if (!f.contains("name") || !f["name"].is_string())
          return bad_request(w + ".function.name must be a string", w);
        ToolCall tc;
        tc.name = f["name"].get<std::string>();
        if (c.contains("id") && c["id"].is_string()) tc.id = c["id"].get<std::string>();
        if (f.contains("arguments")) {
          if (f["arguments"].is_string())
            tc.arguments_json = f["arguments"].get<std::string>();
          else if (f["arguments"].is_object())
            tc.arguments_json = f["arguments"].dump();
          else
            return bad_request(w + ".function.arguments must be a JSON string", w);
        }
        cm.tool_calls.push_back(std::move(tc));
      }
    }
    out->push_back(std::move(cm));
  }
  return std::nullopt;
}

std::optional<ApiError> check_tools(const json& body, ChatOptions* options) {
  const bool has_tools = body.contains("tools") && !body["tools"].is_null();
  std::vector<std::string> names;
  if (has_tools) {
    const json& tools = body["tools"];
    if (!tools.is_array()) return bad_request("'tools' must be an array", "tools");
    if (tools.empty()) return bad_request("'tools' must not be empty (omit it instead)", "tools");
    for (size_t i = 0; i < tools.size(); ++i) {
      const json& t = tools[i];
      const std::string w = "tools[" + std::to_string(i) + "]";
      if (!t.is_object() || !t.contains("type") || t["type"] != "function")
        return bad_request(w + " must be an object with type 'function'", w);
      if (!t.contains("function") || !t["function"].is_object())
        return bad_request(w + ".function must be an object", w + ".function");
      const json& f = t["function"];
      if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty())
        return bad_request(w + ".function.name must be a non-empty string", w + ".function.name");
      if (f.contains("description") && !f["description"].is_null() && !f["description"].is_string())
        return bad_request(w + ".function.description must be a string", w + ".function.description");
      if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object())
        return bad_request(w + ".function.parameters must be a JSON Schema object",
                           w + ".function.parameters");
      names.push_back(f["name"].get<std::string>());
    }
  }
  std::string choice = has_tools ? "auto" : "none";
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const json& tc = body["tool_choice"];
    if (tc.is_string()) {
      choice = tc.get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required")
        return bad_request("'tool_choice' must be none, auto, required or a named function", "tool_choice");
    } else if (tc.is_object() && tc.contains("function") && tc["function"].is_object() &&
               tc["function"].contains("name") && tc["function"]["name"].is_string()) {
      const std::string name = tc["function"]["name"].get<std::string>();
      if (std::find(names.begin(), names.end(), name) == names.end())
        return bad_request("'tool_choice' names function '" + name + "', which is not in 'tools'",
                           "tool_choice");
      choice = "named";
    } else {
      return bad_request(
          "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
          "{\"name\": ...}}",
          "tool_choice");
    }
    if (!has_tools && choice != "none") return bad_request("'tool_choice' needs 'tools'", "tool_choice");
  }
  if (has_tools && choice != "none") options->tools_json = body["tools"].dump();
  return std::nullopt;
}

std::optional<ApiError> chat_options(const json& body, ChatOptions* options) {
  Fields f(body);
  f.string("reasoning_effort", &options->reasoning_effort);
  if (f.has("chat_template_kwargs")) {
    const json& kw = body["chat_template_kwargs"];
    if (!kw.is_object())
      f.fail("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    else {
      Fields k(kw);
      k.boolean("enable_thinking", &options->enable_thinking);
      k.string("reasoning_effort", &options->reasoning_effort);
      k.boolean("add_generation_prompt", &options->add_generation_prompt);
      if (k.error)
        f.fail("chat_template_kwargs." + k.error->param, "chat_template_kwargs: " + k.error->message);
    }
  }
  f.boolean("add_generation_prompt", &options->add_generation_prompt);
  if (f.error) return f.error;
  const std::string& e = options->reasoning_effort;
  if (e != "low" && e != "medium" && e != "high")
    return bad_request("'reasoning_effort' must be low, medium or high, got '" + e + "'", "reasoning_effort");
  return check_tools(body, options);
}

std::optional<ApiError> token_ids(const json& v, const ServeContext& ctx, const std::string& param,
                                  std::vector<int32_t>* out) {
  const int64_t vocab = std::max<int64_t>(ctx.config->vocab_size, ctx.tokenizer->vocab_size());
  for (const json& t : v) {
    if (!t.is_number_integer()) return bad_request("'" + param + "' token ids must be integers", param);
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= vocab)
      return bad_request("token id " + std::to_string(id) + " in '" + param +
                             "' is outside the vocabulary (size " + std::to_string(vocab) + ")",
                         param);
    out->push_back(static_cast<int32_t>(id));
  }
  return std::nullopt;
}

std::optional<ApiError> completion_prompt(const json& body, const ServeContext& ctx, ParsedRequest* r) {
  if (!body.contains("prompt") || body["prompt"].is_null())
    return bad_request("'prompt' is required", "prompt");
  json p = body["prompt"];
  if (p.is_array() && p.size() == 1 && (p[0].is_string() || p[0].is_array())) p = p[0];  // one-prompt batch
  if (p.is_string()) {
    r->prompt_text = p.get<std::string>();
    if (ctx.config->arch == Arch::kLlama && ctx.config->bos_token_id >= 0)
      r->gen.prompt.push_back(ctx.config->bos_token_id);
    const auto ids = ctx.tokenizer->encode(r->prompt_text, /*allow_special=*/false);
    r->gen.prompt.insert(r->gen.prompt.end(), ids.begin(), ids.end());
  } else if (p.is_array() && std::all_of(p.begin(), p.end(), [](const json& t) { return t.is_number(); })) {
    if (auto e = token_ids(p, ctx, "prompt", &r->gen.prompt)) return e;
    r->prompt_text = ctx.tokenizer->decode(r->gen.prompt);
  } else if (p.is_array()) {
    return bad_request("'prompt' with several prompts is not supported; send one request per prompt",
                       "prompt");
  } else {
    return bad_request(std::string("'prompt' must be a string or an array of token ids, got ") + type_name(p),
                       "prompt");
  }
  if (r->gen.prompt.empty()) return bad_request("'prompt' is empty after tokenization", "prompt");
  return std::nullopt;
}

}  // namespace

std::variant<json, ApiError> parse_json_object(const std::string& body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad_request("the request body is not valid JSON");
  if (!j.is_object())
    return bad_request(std::string("the request body must be a JSON object, got ") + type_name(j));
  return j;
}

std::variant<std::string, ApiError> render_messages(const json& body, const ServeContext& ctx) {
  std::vector<ChatMessage> messages;
  if (auto e = parse_messages(body, &messages)) return *e;
  ChatOptions options;
  if (auto e = chat_options(body, &options)) return *e;
  Result<std::string> prompt = render_chat(ctx.chat_format, messages, options);
  if (!prompt.ok()) return bad_request(prompt.status().message(), "messages");
  return prompt.value();
}

// tool_choice enforced for harmony by prefilling the assistant's header: a named function fixes the
// recipient and opens the JSON arguments; "required" fixes the commentary channel and `functions.` and
// lets the model pick the name. (check_tools has validated the field already.)
static std::string harmony_tool_prefix(const json& body) {
  if (!body.contains("tool_choice") || body["tool_choice"].is_null()) return "";
  const json& tc = body["tool_choice"];
  if (tc.is_string()) return tc.get<std::string>() == "required" ? "<|channel|>commentary to=functions." : "";
  return "<|channel|>commentary to=functions." + tc["function"]["name"].get<std::string>() +
         " <|constrain|>json<|message|>";
}

std::variant<ParsedRequest, ApiError> parse_request(Endpoint endpoint, const json& body,
                                                    const ServeContext& ctx) {
  ParsedRequest r;
  r.endpoint = endpoint;
  Fields f(body);
  if (f.has("model")) {
    if (!body["model"].is_string()) return bad_request("'model' must be a string", "model");
    const std::string model = body["model"].get<std::string>();
    if (model != ctx.served_model_name)
      return ApiError{404, "The model `" + model + "` does not exist.", "model"};
  }

  // Prompt.
  if (endpoint == Endpoint::kChat) {
    auto prompt = render_messages(body, ctx);
    if (auto* e = std::get_if<ApiError>(&prompt)) return *e;
    r.gen.prompt = ctx.tokenizer->encode(std::get<std::string>(prompt), /*allow_special=*/true);
    r.harmony = ctx.chat_format == ChatFormat::kHarmony;
    if (r.harmony) {
      const std::string prefix = harmony_tool_prefix(body);
      r.assistant_prefix = ctx.tokenizer->encode(prefix, /*allow_special=*/true);
      r.gen.prompt.insert(r.gen.prompt.end(), r.assistant_prefix.begin(), r.assistant_prefix.end());
    }
  } else {
    if (auto e = completion_prompt(body, ctx, &r)) return *e;
  }

  // Sampling.
  SamplingParams& s = r.gen.sampling;
  s = ctx.default_sampling;
  f.number("temperature", &s.temperature, 0.0, 2.0);
  f.number("top_p", &s.top_p, 0.0, 1.0);
  if (f.has("top_p") && !f.error && s.top_p <= 0.0f) f.fail("top_p", "'top_p' must be in (0, 1]");
  int64_t top_k = 0, seed = 0, n = 1, max_tokens = -1, min_tokens = 0;
  f.integer("top_k", &top_k, -1, 1 << 30);
  s.top_k = static_cast<int>(top_k);
  f.number("min_p", &s.min_p, 0.0, 1.0);
  f.number("presence_penalty", &s.presence_penalty, -2.0, 2.0);
  f.number("frequency_penalty", &s.frequency_penalty, -2.0, 2.0);
  f.number("repetition_penalty", &s.repetition_penalty, 1e-6, 1e6);
  if (f.has("seed")) {
    f.integer("seed", &seed, INT64_MIN, INT64_MAX);
    s.seed = static_cast<uint64_t>(seed);
    s.has_seed = true;
  }
  f.integer("n", &n, 1, ctx.max_n);
  r.n = static_cast<int>(n);
  // max_completion_tokens wins over the deprecated max_tokens.
  const char* max_key = f.has("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  f.integer(max_key, &max_tokens, 1, INT32_MAX);
  f.integer("min_tokens", &min_tokens, 0, INT32_MAX);
  r.gen.min_tokens = static_cast<int32_t>(min_tokens);
  bool ignore_eos = false;
  f.boolean("ignore_eos", &ignore_eos);
  f.boolean("skip_special_tokens", &r.skip_special_tokens);
  f.boolean("stream", &r.stream);
  if (endpoint == Endpoint::kCompletion) f.boolean("echo", &r.echo);
  if (f.error) return *f.error;
  if (Status st = s.validate(); !st.ok()) return bad_request(st.message());

  // stream_options.
  if (f.has("stream_options")) {
    const json& so = body["stream_options"];
    if (!so.is_object()) return bad_request("'stream_options' must be an object", "stream_options");
    if (!r.stream)
      return bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
    Fields o(so);
    o.boolean("include_usage", &r.include_usage);
    o.boolean("continuous_usage_stats", &r.continuous_usage);
    if (o.error)
      return bad_request("stream_options: " + o.error->message, "stream_options." + o.error->param);
  }

  // Stops: strings, and token ids (in stop or stop_token_ids).
  std::vector<int32_t> stop_ids;
  auto add_stop = [&](const json& v, const char* param) -> std::optional<ApiError> {
    if (v.is_string())
      r.stop.push_back(v.get<std::string>());
    else if (v.is_number_integer())
      return token_ids(json::array({v}), ctx, param, &stop_ids);
    else
      return bad_request(std::string("'") + param + "' entries must be strings or token ids", param);
    return std::nullopt;
  };
  if (f.has("stop")) {
    const json& st = body["stop"];
    if (st.is_array()) {
      for (const json& v : st)
        if (auto e = add_stop(v, "stop")) return *e;
    } else if (auto e = add_stop(st, "stop")) {
      return *e;
    }
  }
  if (f.has("stop_token_ids")) {
    if (!body["stop_token_ids"].is_array())
      return bad_request("'stop_token_ids' must be an array", "stop_token_ids");
    if (auto e = token_ids(body["stop_token_ids"], ctx, "stop_token_ids", &stop_ids)) return *e;
  }
  if (!ignore_eos) {
    const auto& ends = endpoint == Endpoint::kChat ? ctx.chat_stop_ids : ctx.eos_ids;
    stop_ids.insert(stop_ids.end(), ends.begin(), ends.end());
    stop_ids.insert(stop_ids.end(), ctx.eos_ids.begin(), ctx.eos_ids.end());
  } else if (r.harmony) {  // harmony's <|return|> / <|call|> end the turn even with ignore_eos
    stop_ids.insert(stop_ids.end(), ctx.chat_stop_ids.begin(), ctx.chat_stop_ids.end());
  }
  std::sort(stop_ids.begin(), stop_ids.end());
  stop_ids.erase(std::unique(stop_ids.begin(), stop_ids.end()), stop_ids.end());
  r.gen.stop_token_ids = std::move(stop_ids);

  // Logprobs: chat takes logprobs (bool) + top_logprobs; completions take logprobs (int).
  if (endpoint == Endpoint::kChat) {
    Fields g(body);
    int64_t top = 0;
    g.boolean("logprobs", &r.logprobs);
    g.integer("top_logprobs", &top, 0, INT32_MAX);
    if (g.error) return *g.error;
    if (g.has("top_logprobs") && !r.logprobs)
      return bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    r.top_logprobs = static_cast<int>(top);
  } else if (f.has("logprobs")) {
    int64_t top = 0;
    f.integer("logprobs", &top, 0, INT32_MAX);
    if (f.error) return *f.error;
    r.logprobs = true;
    r.top_logprobs = static_cast<int>(top);
  }
  if (r.top_logprobs > ctx.max_logprobs)
    return bad_request("Requested sample logprobs of " + std::to_string(r.top_logprobs) +
                           ", which is greater than max allowed: " + std::to_string(ctx.max_logprobs),
                       endpoint == Endpoint::kChat ? "top_logprobs" : "logprobs");
  r.gen.logprobs = r.logprobs ? r.top_logprobs : -1;

  if (f.has("response_format")) {
    const json& rf = body["response_format"];
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      return bad_request("'response_format' must be an object with a 'type'", "response_format");
    if (rf["type"] != "text")
      return bad_request("response_format type '" + rf["type"].get<std::string>() + "' is not supported",
                         "response_format");
  }

  // Test hook: a scripted output (text with special tokens, or ids) replaces sampling.
  if (ctx.test_forced_output && f.has("nibble_forced_output")) {
    const json& fo = body["nibble_forced_output"];
    if (fo.is_string())
      r.gen.forced_output = ctx.tokenizer->encode(fo.get<std::string>(), /*allow_special=*/true);
    else if (fo.is_array()) {
      if (auto e = token_ids(fo, ctx, "nibble_forced_output", &r.gen.forced_output)) return *e;
    } else
      return bad_request("'nibble_forced_output' must be a string or token ids", "nibble_forced_output");
  }

  // Context length, worded as vLLM words it (clients match "maximum context length").
  const auto n_prompt = static_cast<int64_t>(r.gen.prompt.size());
  const int64_t ctx_len = ctx.max_model_len;
  if (n_prompt >= ctx_len) {
    return bad_request("This model's maximum context length is " + std::to_string(ctx_len) +
                           " tokens. However, your request has " + std::to_string(n_prompt) +
                           " input tokens. Please reduce the length of the input " +
                           (endpoint == Endpoint::kChat ? "messages." : "prompt."),
                       endpoint == Endpoint::kChat ? "messages" : "prompt");
  }
  if (max_tokens > ctx_len - n_prompt) {
    return bad_request("'max_tokens' or 'max_completion_tokens' is too large: " + std::to_string(max_tokens) +
                           ". This model's maximum context length is " + std::to_string(ctx_len) +
                           " tokens and your request has " + std::to_string(n_prompt) + " input tokens (" +
                           std::to_string(max_tokens) + " > " + std::to_string(ctx_len) + " - " +
                           std::to_string(n_prompt) + ").",
                       max_key);
  }
  if (max_tokens < 0)
    max_tokens = endpoint == Endpoint::kChat ? ctx_len - n_prompt : std::min<int64_t>(16, ctx_len - n_prompt);
  r.gen.max_tokens = static_cast<int32_t>(max_tokens);
  return r;
}

}  // namespace nb
