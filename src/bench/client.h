// HTTP/SSE client of `nibble bench`: the requests llama-benchy 0.2.1 sends (client.py), timed on one
// steady clock. Every failure (connect, HTTP status, timeout, malformed or error chunk) comes back as
// RequestTiming::error, never as an exception, so a bad server cannot crash or skew a run. Thread-safe:
// each call opens its own connection (one thread per concurrent request).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "bench/metrics.h"

namespace nb::bench {

// Seconds on the steady clock; every RequestTiming field is on this clock.
double now_s();

struct ClientOptions {
  std::string base_url;       // includes /v1, e.g. http://127.0.0.1:8000/v1
  std::string api_key = "EMPTY";
  std::string model;          // the served model name sent in requests
  double timeout_s = 3600;    // whole-request limit (llama-benchy's aiohttp total timeout)
};

class Client {
 public:
  // Fails on a base URL that is not http(s)://host[:port][/path].
  static Result<Client> create(const ClientOptions& options);

  // One streamed chat completion: POST {base}/chat/completions with stream_options.include_usage.
  RequestTiming stream_chat(const nlohmann::json& messages, int max_tokens, bool no_cache) const;
  // Non-streaming chat completion with max_tokens 1: usage.prompt_tokens (the warm-up).
  Result<int> prompt_tokens(const nlohmann::json& messages) const;
  // One latency probe in seconds: "api" times GET {base}/models to the end of the body; "generation"
  // times a streamed one-token request to its first line.
  Result<double> latency_probe(const std::string& mode) const;

 private:
  ClientOptions options_;
  std::string scheme_host_port_;  // http://host:port
  std::string path_prefix_;       // /v1
};

}  // namespace nb::bench
