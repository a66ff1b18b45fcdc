// Streaming chat client over cpp-httplib; see client.h. The SSE parser mirrors llama-benchy 0.2.1's
// run_generation: lines split on '\n', each line stamped with the time its bytes arrived, one content
// chunk = one token. Unlike llama-benchy it fails the request on a malformed line or an error chunk
// instead of skipping it, so a broken stream is counted, not averaged in.
#include "bench/client.h"

#include <httplib.h>

#include <chrono>
#include <regex>

namespace nb::bench {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Result<Client> Client::create(const ClientOptions& options) {
  static const std::regex kUrl(R"(^(https?://[^/]+)(/.*)?$)");
  std::smatch m;
  if (!std::regex_match(options.base_url, m, kUrl))
    return error("--base-url '" + options.base_url + "': expected http://host[:port]/v1");
  Client c;
  c.options_ = options;
  c.scheme_host_port_ = m[1].str();
  c.path_prefix_ = m[2].str();
  while (!c.path_prefix_.empty() && c.path_prefix_.back() == '/') c.path_prefix_.pop_back();
  return c;
}

namespace {

std::unique_ptr<httplib::Client> make_http(const std::string& scheme_host_port, double timeout_s) {
  auto http = std::make_unique<httplib::Client>(scheme_host_port);
  const auto limit = std::chrono::duration<double>(timeout_s);
  http->set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(limit));
  http->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(limit));
  http->set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(limit));
  http->set_tcp_nodelay(true);
  return http;
}

bool non_empty_text(const nlohmann::json& delta, const char* key) {
  auto it = delta.find(key);
  return it != delta.end() && it->is_string() && !it->get_ref<const std::string&>().empty();
}

// Feeds one SSE line into `r`; returns false (and sets r->error) on a malformed or error chunk.
bool take_line(std::string line, double t, RequestTiming* r) {
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
  size_t b = 0;
  while (b < line.size() && line[b] == ' ') ++b;
  line.erase(0, b);
  if (line.empty() || line[0] == ':') return true;  // blank separator or SSE comment
  if (line == "data: [DONE]" || line == "data:[DONE]") return true;
  if (line.rfind("data:", 0) != 0) return true;  // other SSE fields (event:, id:) carry no tokens
  nlohmann::json chunk = nlohmann::json::parse(line.substr(5), nullptr, /*allow_exceptions=*/false);
  if (chunk.is_discarded() || !chunk.is_object()) {
    r->error = "malformed chunk: " + line.substr(0, 80);
    return false;
  }
  if (chunk.contains("error")) {
    r->error = "error chunk: " + chunk["error"].dump().substr(0, 200);
    return false;
  }
  if (auto u = chunk.find("usage"); u != chunk.end() && u->is_object()) {
    if (auto p = u->find("prompt_tokens"); p != u->end() && p->is_number_integer()) r->usage_prompt_tokens = p->get<int>();
  }
  auto choices = chunk.find("choices");
  if (choices == chunk.end() || !choices->is_array() || choices->empty()) return true;
  if (!r->first_response) r->first_response = t;
  const nlohmann::json& c0 = (*choices)[0];
  if (!c0.is_object()) return true;
  auto delta = c0.find("delta");
  if (delta == c0.end() || !delta->is_object()) return true;
  if (non_empty_text(*delta, "content") || non_empty_text(*delta, "reasoning_content") ||
      non_empty_text(*delta, "reasoning")) {
    if (!r->first_token) r->first_token = t;
    r->token_times.push_back(t);
  }
  return true;
}

}  // namespace

RequestTiming Client::stream_chat(const nlohmann::json& messages, int max_tokens, bool no_cache) const {
  nlohmann::json body = {{"model", options_.model},
                         {"messages", messages},
                         {"max_tokens", max_tokens},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
  if (no_cache) body["cache_prompt"] = false;
  // Corpus slices may end inside a UTF-8 sequence: replace, as HF's decode does.
  const std::string payload = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);

  auto http = make_http(scheme_host_port_, options_.timeout_s);
  RequestTiming r;
  int status = 0;
  std::string buffer, error_body;
  bool aborted = false;

  httplib::Request req;
  req.method = "POST";
  req.path = path_prefix_ + "/chat/completions";
  req.headers = {{"Authorization", "Bearer " + options_.api_key}, {"Accept", "text/event-stream"}};
  req.set_header("Content-Type", "application/json");
  req.body = payload;
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const double t = now_s();
    if (status != 200) {
      if (error_body.size() < 300) error_body.append(data, std::min<size_t>(n, 300));
      return true;
    }
    if (t - r.start > options_.timeout_s) {
      r.error = "timeout after " + std::to_string(options_.timeout_s) + " s";
      aborted = true;
      return false;
    }
    buffer.append(data, n);
    size_t pos;
    while ((pos = buffer.find('\n')) != std::string::npos) {
      std::string line = buffer.substr(0, pos);
      buffer.erase(0, pos + 1);
      if (!take_line(std::move(line), t, &r)) {
        aborted = true;
        return false;
      }
    }
    return true;
  };

  r.start = now_s();
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = http->send(req, res, err);
  r.end = now_s();
  if (aborted) return r;
  if (!sent) {
    r.error = err == httplib::Error::Read && r.end - r.start >= options_.timeout_s * 0.99
                  ? "timeout after " + std::to_string(options_.timeout_s) + " s"
                  : "transport error: " + httplib::to_string(err);
    return r;
  }
  if (status != 200) {
    r.error = "HTTP " + std::to_string(status) + ": " + error_body;
    return r;
  }
  if (!buffer.empty() && !take_line(buffer, r.end, &r)) return r;
  return r;
}

Result<int> Client::prompt_tokens(const nlohmann::json& messages) const {
  nlohmann::json body = {{"model", options_.model}, {"messages", messages}, {"max_tokens", 1}};
  auto http = make_http(scheme_host_port_, options_.timeout_s);
  httplib::Headers headers = {{"Authorization", "Bearer " + options_.api_key}};
  auto res = http->Post(path_prefix_ + "/chat/completions", headers, body.dump(), "application/json");
  if (!res) return error("warm-up request: " + httplib::to_string(res.error()));
  if (res->status != 200) return error("warm-up request: HTTP " + std::to_string(res->status) + ": " + res->body.substr(0, 200));
  nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return error("warm-up request: response is not JSON");
  if (!j.contains("usage") || !j["usage"].is_object() || !j["usage"].contains("prompt_tokens") ||
      !j["usage"]["prompt_tokens"].is_number_integer())
    return error("warm-up request: no usage.prompt_tokens");
  return j["usage"]["prompt_tokens"].get<int>();
}

Result<double> Client::latency_probe(const std::string& mode) const {
  auto http = make_http(scheme_host_port_, options_.timeout_s);
  httplib::Headers headers = {{"Authorization", "Bearer " + options_.api_key}};
  if (mode == "api") {
    const double start = now_s();
    auto res = http->Get(path_prefix_ + "/models", headers);
    const double t = now_s() - start;
    if (!res) return error("latency probe: " + httplib::to_string(res.error()));
    if (res->status != 200) return error("latency probe: HTTP " + std::to_string(res->status));
    return t;
  }
  nlohmann::json body = {{"model", options_.model},
                         {"messages", {{{"role", "user"}, {"content", "hello"}}}},
                         {"max_tokens", 1},
                         {"stream", true}};
  double first_line = -1;
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = path_prefix_ + "/chat/completions";
  req.headers = headers;
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  const double start = now_s();
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    if (first_line < 0 && buffer.find('\n') != std::string::npos) first_line = now_s() - start;
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!http->send(req, res, err)) return error("latency probe: " + httplib::to_string(err));
  if (res.status != 200) return error("latency probe: HTTP " + std::to_string(res.status));
  if (first_line < 0) return error("latency probe: empty stream");
  return first_line;
}

}  // namespace nb::bench
