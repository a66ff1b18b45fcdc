#include "server/server.h"

#include <httplib.h>

#include <chrono>
#include <functional>
#include <random>

#include "base/log.h"
#include "server/choice.h"
#include "server/metrics.h"

namespace nb {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Invalid UTF-8 (a token cut inside a character, a broken model) becomes U+FFFD instead of a throw.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}
void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.status, e.to_json()); }

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string request_id(const char* prefix) {
  std::random_device rd;
  std::mt19937_64 rng((static_cast<uint64_t>(rd()) << 32) ^ rd());
  static const char kHex[] = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 32; ++i) id += kHex[rng() % 16];
  return id;
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned diff = a.size() != b.size();
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i % (b.size() + 1)]);
  return diff == 0;
}

}  // namespace

// One request's generation: its engine streams (one per choice) and the choices being assembled.
// Destroying it cancels whatever is still running, on every exit path (a client gone mid-stream,
// a provider never called).
struct Job {
  Engine* engine = nullptr;
  ParsedRequest req;
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<std::unique_ptr<Choice>> choices;
  std::string id, model;
  int64_t created = 0;
  int32_t n_cached = 0;

  ~Job() { cancel_all(); }
  void cancel_all() {
    for (auto& s : streams) engine->cancel(*s);
  }
  int32_t completion_tokens() const {
    int32_t n = 0;
    for (auto& c : choices) n += c->n_generated();
    return n;
  }
  json usage() const {
    const auto n_prompt = static_cast<int32_t>(req.gen.prompt.size());
    const int32_t n_out = completion_tokens();
    return {{"prompt_tokens", n_prompt},
            {"completion_tokens", n_out},
            {"total_tokens", n_prompt + n_out},
            {"prompt_tokens_details", {{"cached_tokens", n_cached}}}};
  }
};

namespace {

// Feeds engine tokens into the choices until all are finished. on_delta(i, delta, final) sends a
// delta (final: choice i just finished); on_tick() runs every pass (at most ~20 ms apart) so the
// caller can write keepalives. Both return false when the client is gone; pump then returns false.
bool pump(Job& job, const std::function<bool(size_t, const ChoiceDelta&, bool)>& on_delta,
          const std::function<bool()>& on_tick) {
  for (;;) {
    size_t first = job.choices.size();
    for (size_t i = 0; i < job.choices.size(); ++i)
      if (!job.choices[i]->finished()) {
        first = i;
        break;
      }
    if (first == job.choices.size()) return true;
    for (size_t i = first; i < job.choices.size(); ++i) {
      Choice& c = *job.choices[i];
      if (c.finished()) continue;
      StreamUpdate u = job.streams[i]->wait(i == first ? 20ms : 0ms);
      // The first token exists: an empty delta lets the streaming writer open the choice now.
      if (!u.tokens.empty() && !c.started()) {
        c.mark_started();
        if (!on_delta(i, ChoiceDelta{}, false)) return false;
      }
      for (const GeneratedToken& t : u.tokens) {
        ChoiceDelta d = c.add(t);
        if (!d.empty() && !on_delta(i, d, false)) return false;
        if (c.stopped()) {  // a stop string: end the choice here and free its engine sequence
          job.engine->cancel(*job.streams[i]);
          StreamUpdate end;
          end.finish = FinishReason::kStop;
          if (!on_delta(i, c.finish(end), true)) return false;
          break;
        }
      }
      if (u.done() && !c.finished()) {
        job.n_cached = std::max(job.n_cached, u.n_cached);
        if (!on_delta(i, c.finish(u), true)) return false;
      }
    }
    if (!on_tick()) return false;
  }
}

// Calls fn when `period` has passed since the last call (or since construction).
class Every {
 public:
  explicit Every(Clock::duration period) : period_(period), last_(Clock::now()) {}
  bool due() {
    const auto now = Clock::now();
    if (now - last_ < period_) return false;
    last_ = now;
    return true;
  }
  void reset() { last_ = Clock::now(); }

 private:
  Clock::duration period_;
  Clock::time_point last_;
};

json delta_json(const ChoiceDelta& d) {
  json delta = json::object();
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.tool_calls.empty()) delta["tool_calls"] = d.tool_calls;
  return delta;
}

}  // namespace

Server::Server(Engine& engine, const ServeContext& context, const ServerOptions& options)
    : engine_(engine), ctx_(context), options_(options), http_(std::make_unique<httplib::Server>()) {
  const int n_threads = options_.http_threads;
  http_->new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<size_t>(n_threads)); };
  http_->set_payload_max_length(options_.max_request_bytes);
  // Idle keep-alive connections hold a worker thread; a short timeout lets shutdown finish quickly.
  http_->set_keep_alive_timeout(2);
  install_routes();
}

Server::~Server() = default;

Status Server::bind() {
  if (options_.port == 0)
    port_ = http_->bind_to_any_port(options_.host);
  else
    port_ = http_->bind_to_port(options_.host, options_.port) ? options_.port : -1;
  if (port_ <= 0) return error("cannot listen on " + options_.host + ":" + std::to_string(options_.port));
  return Status();
}

void Server::listen() { http_->listen_after_bind(); }
void Server::stop() { http_->stop(); }

void Server::install_routes() {
  httplib::Server& h = *http_;

  // Unknown routes, oversized bodies (413) and other library-made errors get the OpenAI shape.
  h.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message = "Not Found: " + req.path;
    if (res.status == 413)
      message = "the request body is larger than --max-request-bytes";
    else if (res.status != 404)
      message = "HTTP error " + std::to_string(res.status);
    send_error(res, ApiError{res.status, message, ""});
  });

  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!options_.allowed_origins.empty() && req.has_header("Origin")) {
      const std::string origin = req.get_header_value("Origin");
      for (const std::string& o : options_.allowed_origins) {
        if (o != "*" && o != origin) continue;
        res.set_header("Access-Control-Allow-Origin", o == "*" ? "*" : origin);
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
        break;
      }
    }
    if (req.method == "OPTIONS") {
      res.status = options_.allowed_origins.empty() ? 405 : 204;
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!options_.api_key.empty() && req.path.rfind("/v1", 0) == 0 &&
        !constant_time_equal(req.get_header_value("Authorization"), "Bearer " + options_.api_key)) {
      send_error(res, ApiError{401, "Invalid API key: pass it as 'Authorization: Bearer <key>'", ""});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  h.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (engine_.accepting())
      res.status = 200;
    else
      send_error(res, ApiError{503, "the server is shutting down", ""});
  });

  h.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json model = {{"id", ctx_.served_model_name},
                  {"object", "model"},
                  {"created", unix_now()},
                  {"owned_by", "nibble"},
                  {"root", ctx_.served_model_name},
                  {"parent", nullptr},
                  {"max_model_len", ctx_.max_model_len}};
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
  });

  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(render_metrics(engine_.stats(), ctx_.served_model_name), "text/plain; version=0.0.4");
  });

  h.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    auto parsed = parse_json_object(req.body);
    if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
    const json& body = std::get<json>(parsed);
    if (body.contains("model") && body["model"] != ctx_.served_model_name)
      return send_error(res,
                        ApiError{404, "The model `" + dump(body["model"]) + "` does not exist.", "model"});
    std::vector<int32_t> ids;
    if (body.contains("messages")) {
      auto prompt = render_messages(body, ctx_);
      if (auto* e = std::get_if<ApiError>(&prompt)) return send_error(res, *e);
      ids = ctx_.tokenizer->encode(std::get<std::string>(prompt), /*allow_special=*/true);
    } else if (body.contains("prompt") && body["prompt"].is_string()) {
      bool add_special = true;
      if (body.contains("add_special_tokens")) {
        if (!body["add_special_tokens"].is_boolean())
          return send_error(res, bad_request("'add_special_tokens' must be a boolean", "add_special_tokens"));
        add_special = body["add_special_tokens"].get<bool>();
      }
      if (add_special && ctx_.config->arch == Arch::kLlama && ctx_.config->bos_token_id >= 0)
        ids.push_back(ctx_.config->bos_token_id);
      const auto text = ctx_.tokenizer->encode(body["prompt"].get<std::string>(), /*allow_special=*/false);
      ids.insert(ids.end(), text.begin(), text.end());
    } else {
      return send_error(res, bad_request("'prompt' (a string) or 'messages' is required", "prompt"));
    }
    send_json(res, 200, {{"count", ids.size()}, {"max_model_len", ctx_.max_model_len}, {"tokens", ids}});
  });

  h.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    auto parsed = parse_json_object(req.body);
    if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
    const json& body = std::get<json>(parsed);
    if (!body.contains("tokens") || !body["tokens"].is_array())
      return send_error(res, bad_request("'tokens' (an array of token ids) is required", "tokens"));
    std::vector<int32_t> ids;
    for (const json& t : body["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
        return send_error(res, bad_request("'tokens' must hold token ids, got " + dump(t), "tokens"));
      ids.push_back(t.get<int32_t>());
    }
    Result<std::string> text = ctx_.tokenizer->decode_checked(ids);
    if (!text.ok()) return send_error(res, bad_request(text.status().message(), "tokens"));
    send_json(res, 200, {{"prompt", text.value()}});
  });

  auto generate = [this](Endpoint endpoint) {
    return [this, endpoint](const httplib::Request& req, httplib::Response& res) {
      auto parsed = parse_json_object(req.body);
      if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
      auto request = parse_request(endpoint, std::get<json>(parsed), ctx_);
      if (auto* e = std::get_if<ApiError>(&request)) return send_error(res, *e);

      auto job = std::make_shared<Job>();
      job->engine = &engine_;
      job->req = std::move(std::get<ParsedRequest>(request));
      job->id = request_id(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
      job->model = ctx_.served_model_name;
      job->created = unix_now();
      std::vector<GenerationRequest> gens(job->req.n, job->req.gen);
      switch (engine_.submit(std::move(gens), &job->streams)) {
        case SubmitError::kQueueFull:
          return send_error(
              res,
              ApiError{429, "The server is busy: the request queue is full (--max-queue); retry later.", ""});
        case SubmitError::kShuttingDown:
          return send_error(res, ApiError{503, "The server is shutting down.", ""});
        case SubmitError::kNone:
          break;
      }
      for (int i = 0; i < job->req.n; ++i)
        job->choices.push_back(std::make_unique<Choice>(job->req, *ctx_.tokenizer));
      if (job->req.stream)
        stream_response(job, res);
      else
        full_response(job, res);
    };
  };
  h.Post("/v1/chat/completions", generate(Endpoint::kChat));
  h.Post("/v1/completions", generate(Endpoint::kCompletion));
}

void Server::stream_response(const std::shared_ptr<Job>& job, httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  const Tokenizer* tok = ctx_.tokenizer;
  // Exactly "text/event-stream": httplib never compresses it, so every event leaves at once.
  res.set_chunked_content_provider(
      "text/event-stream",
      [job, tok](size_t, httplib::DataSink& sink) {
        const bool chat = job->req.endpoint == Endpoint::kChat;
        Every keepalive(1s);
        auto send = [&](const json& j) {
          const std::string s = "data: " + dump(j) + "\n\n";
          keepalive.reset();
          return sink.write(s.data(), s.size());
        };
        auto chunk = [&](json choice) {
          json j = {{"id", job->id},
                    {"object", chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", job->created},
                    {"model", job->model},
                    {"choices", json::array({std::move(choice)})}};
          if (job->req.continuous_usage) j["usage"] = job->usage();
          return send(j);
        };
        // A chat choice opens with a role chunk, sent once its first token exists (not at once), so a
        // client's time to first response measures prefill, as with vLLM (benchmarking.md §2.14).
        std::vector<bool> opened(job->choices.size(), !chat);
        size_t text_offset = 0;
        auto on_delta = [&](size_t i, const ChoiceDelta& d, bool final) {
          const Choice& c = *job->choices[i];
          if (!opened[i]) {
            opened[i] = true;
            json first = {{"index", i},
                          {"delta", {{"role", "assistant"}, {"content", ""}}},
                          {"logprobs", nullptr},
                          {"finish_reason", nullptr}};
            if (!chunk(first)) return false;
          }
          if (!d.empty()) {
            json lp = nullptr;
            if (job->req.logprobs && !d.logprob_tokens.empty())
              lp = chat ? chat_logprobs(*tok, d.logprob_tokens)
                        : completion_logprobs(*tok, d.logprob_tokens, text_offset);
            json choice =
                chat ? json{{"index", i},
                            {"delta", delta_json(d)},
                            {"logprobs", lp},
                            {"finish_reason", nullptr}}
                     : json{{"index", i}, {"text", d.content}, {"logprobs", lp}, {"finish_reason", nullptr}};
            text_offset += d.content.size();
            if (!chunk(choice)) return false;
          }
          if (!final) return true;
          if (c.finish_reason() == "error") {
            return send(ApiError{500, "generation failed: " + c.error(), ""}.to_json());
          }
          json choice = chat ? json{{"index", i},
                                    {"delta", json::object()},
                                    {"logprobs", nullptr},
                                    {"finish_reason", c.finish_reason()}}
                             : json{{"index", i},
                                    {"text", ""},
                                    {"logprobs", nullptr},
                                    {"finish_reason", c.finish_reason()}};
          return chunk(choice);
        };
        if (chat == false && job->req.echo) {
          if (!chunk(json{{"index", 0},
                          {"text", job->req.prompt_text},
                          {"logprobs", nullptr},
                          {"finish_reason", nullptr}}))
            return false;
        }
        const bool ok = pump(*job, on_delta, [&] {
          static const char kPing[] = ": ping\n\n";  // an SSE comment: clients skip it
          return !keepalive.due() || sink.write(kPing, sizeof(kPing) - 1);
        });
        if (!ok) {
          job->cancel_all();
          return false;
        }
        if (job->req.include_usage) {
          json u = {{"id", job->id},
                    {"object", chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", job->created},
                    {"model", job->model},
                    {"choices", json::array()},
                    {"usage", job->usage()}};
          if (!send(u)) return false;
        }
        static const char kDone[] = "data: [DONE]\n\n";
        if (!sink.write(kDone, sizeof(kDone) - 1)) return false;
        sink.done();
        return true;
      },
      [job](bool success) {
        if (!success) job->cancel_all();
      });
}

void Server::full_response(const std::shared_ptr<Job>& job, httplib::Response& res) {
  const Tokenizer* tok = ctx_.tokenizer;
  // Chunked, so a client that goes away is noticed while waiting: a space (valid JSON whitespace)
  // is written after each quiet second and fails once the peer is gone. The charset parameter keeps
  // httplib from compressing (and so buffering) the body.
  res.set_chunked_content_provider(
      "application/json; charset=utf-8",
      [job, tok](size_t, httplib::DataSink& sink) {
        Every probe(1s);
        const bool ok = pump(
            *job, [](size_t, const ChoiceDelta&, bool) { return true; },
            [&] { return !probe.due() || sink.write(" ", 1); });
        if (!ok) {
          job->cancel_all();
          return false;
        }
        const bool chat = job->req.endpoint == Endpoint::kChat;
        json choices = json::array();
        for (size_t i = 0; i < job->choices.size(); ++i) {
          const Choice& c = *job->choices[i];
          if (c.finish_reason() == "error") {
            const std::string s = dump(ApiError{500, "generation failed: " + c.error(), ""}.to_json());
            sink.write(s.data(), s.size());
            sink.done();
            return true;
          }
          json lp = nullptr;
          if (job->req.logprobs) {
            lp = chat
                     ? chat_logprobs(*tok, c.tokens())
                     : completion_logprobs(*tok, c.tokens(), job->req.echo ? job->req.prompt_text.size() : 0);
          }
          if (chat) {
            json message = {{"role", "assistant"}};
            message["content"] =
                c.content().empty() && !c.tool_calls().empty() ? json(nullptr) : json(c.content());
            if (c.harmony())
              message["reasoning_content"] = c.reasoning().empty() ? json(nullptr) : json(c.reasoning());
            json calls = json::array();
            for (const ToolCallOut& t : c.tool_calls())
              calls.push_back({{"id", t.id},
                               {"type", "function"},
                               {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
            message["tool_calls"] = calls;
            choices.push_back({{"index", i},
                               {"message", message},
                               {"logprobs", lp},
                               {"finish_reason", c.finish_reason()},
                               {"stop_reason", nullptr}});
          } else {
            const std::string text = (job->req.echo ? job->req.prompt_text : "") + c.content();
            choices.push_back({{"index", i},
                               {"text", text},
                               {"logprobs", lp},
                               {"finish_reason", c.finish_reason()},
                               {"stop_reason", nullptr}});
          }
        }
        json body = {{"id", job->id},           {"object", chat ? "chat.completion" : "text_completion"},
                     {"created", job->created}, {"model", job->model},
                     {"choices", choices},      {"usage", job->usage()}};
        const std::string s = dump(body);
        if (!sink.write(s.data(), s.size())) return false;
        sink.done();
        return true;
      },
      [job](bool success) {
        if (!success) job->cancel_all();
      });
}

}  // namespace nb
