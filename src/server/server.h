// The OpenAI-compatible HTTP server (cpp-httplib): routes, API key, CORS, body limit, and the
// per-request work of the HTTP threads: parse and validate, render and tokenize, submit to the
// Engine, then turn the engine's tokens into a JSON response or an SSE stream. HTTP threads never
// touch the model; a client that goes away cancels its requests in the engine.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/engine.h"
#include "server/openai_request.h"

namespace httplib {
class Server;
struct Response;
}  // namespace httplib

namespace nb {

struct Job;  // one request's generation (server.cc)

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;                       // non-empty: /v1 needs "Authorization: Bearer KEY"
  std::vector<std::string> allowed_origins;  // empty: no CORS headers; "*": any origin
  size_t max_request_bytes = 4 << 20;        // larger bodies get 413
  int http_threads = 64;
};

class Server {
 public:
  Server(Engine& engine, const ServeContext& context, const ServerOptions& options);
  ~Server();
  // Binds host:port; the port actually bound is port() (0 asks the kernel for a free one).
  Status bind();
  int port() const { return port_; }
  // Serves until stop(); blocks.
  void listen();
  void stop();

 private:
  void install_routes();
  void stream_response(const std::shared_ptr<Job>& job, httplib::Response& res);
  void full_response(const std::shared_ptr<Job>& job, httplib::Response& res);

  Engine& engine_;
  ServeContext ctx_;
  ServerOptions options_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
};

}  // namespace nb
