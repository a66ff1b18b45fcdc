// nibble serve: load the model, size the paged KV cache, start the engine thread and the HTTP server,
// log the resolved configuration and `ready`, then wait for SIGTERM/SIGINT: stop taking requests,
// drain the running ones for --shutdown-timeout seconds, abort the rest, exit.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "app/model_session.h"
#include "app/serve_args.h"
#include "runtime/engine.h"
#include "server/server.h"

namespace nb {
namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "nibble: error: %s\n", message.c_str());
  return 1;
}

// generation_config.json: extra end-of-sequence ids and the model's default sampling (vLLM applies
// them unless the request sets the field).
void read_generation_config(const std::string& dir, std::vector<int32_t>* eos, SamplingParams* sampling) {
  std::ifstream in(dir + "/generation_config.json");
  if (!in) return;
  const nlohmann::json g = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!g.is_object()) return;
  if (g.contains("eos_token_id")) {
    const auto& e = g["eos_token_id"];
    if (e.is_number_integer()) eos->push_back(e.get<int32_t>());
    if (e.is_array())
      for (const auto& v : e)
        if (v.is_number_integer()) eos->push_back(v.get<int32_t>());
  }
  auto number = [&](const char* key, float* out) {
    if (g.contains(key) && g[key].is_number()) *out = g[key].get<float>();
  };
  number("temperature", &sampling->temperature);
  number("top_p", &sampling->top_p);
  number("min_p", &sampling->min_p);
  number("repetition_penalty", &sampling->repetition_penalty);
  if (g.contains("top_k") && g["top_k"].is_number_integer()) sampling->top_k = g["top_k"].get<int>();
}

}  // namespace

int cmd_serve(const ServeArgs& args) {
  // Block the stop signals before any thread starts, so every thread inherits the mask and this one
  // takes them with sigwait (no handler, no global flag).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto session = open_model_session(args.model, args.device, args.threads, /*need_tokenizer=*/true,
                                    args.dense_format, args.kv_cache_dtype, args.dummy_weights);
  if (!session.ok()) return fail(session.status().message());
  ModelSession& s = session.value();
  const ModelConfig& cfg = s.model->config();

  ServeContext ctx;
  ctx.config = &cfg;
  ctx.tokenizer = s.tokenizer.get();
  ctx.served_model_name = args.served_model_name.empty() ? args.model : args.served_model_name;
  ctx.max_model_len = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 4096;
  if (args.max_model_len > 0) {
    if (cfg.max_position_embeddings > 0 && args.max_model_len > cfg.max_position_embeddings)
      return fail("--max-model-len " + std::to_string(args.max_model_len) + " is larger than the model's " +
                  "max_position_embeddings (" + std::to_string(cfg.max_position_embeddings) + ")");
    ctx.max_model_len = args.max_model_len;
  }
  ctx.chat_format = chat_format_for(cfg.model_type);
  if (!args.chat_format.empty()) {
    auto f = parse_chat_format(args.chat_format);
    if (!f) return fail("--chat-format must be harmony, chatml or llama3, got '" + args.chat_format + "'");
    ctx.chat_format = *f;
  }
  ctx.eos_ids.assign(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
  read_generation_config(args.model, &ctx.eos_ids, &ctx.default_sampling);
  std::sort(ctx.eos_ids.begin(), ctx.eos_ids.end());
  ctx.eos_ids.erase(std::unique(ctx.eos_ids.begin(), ctx.eos_ids.end()), ctx.eos_ids.end());
  for (const std::string& t : chat_stop_tokens(ctx.chat_format))
    if (auto id = s.tokenizer->token_id(t)) ctx.chat_stop_ids.push_back(*id);
  ctx.test_forced_output = args.test_forced_output;

  // KV cache: the override, or what fits the memory budget (at least one full-length sequence).
  EngineConfig ec;
  ec.max_model_len = ctx.max_model_len;
  ec.max_queue = args.max_queue;
  ec.enable_prefix_caching = args.enable_prefix_caching;
  ec.async_scheduling = args.async_scheduling;
  ec.scheduler.max_num_seqs = args.max_num_seqs;
  ec.scheduler.max_num_batched_tokens =
      args.max_num_batched_tokens > 0 ? args.max_num_batched_tokens : std::max(2048, args.max_num_seqs);
  if (ec.scheduler.max_num_batched_tokens < ec.scheduler.max_num_seqs)
    return fail("--max-num-batched-tokens must be at least --max-num-seqs");
  const int64_t block_bytes = s.model->kv_block_bytes();  // K + V of every layer, in the cache's dtype
  const int32_t min_blocks = blocks_for(ctx.max_model_len);
  int64_t n_blocks = args.num_gpu_blocks_override;
  if (n_blocks == 0) {
    n_blocks = std::min<int64_t>(static_cast<int64_t>(args.kv_cache_memory_bytes) / block_bytes,
                                 int64_t{args.max_num_seqs} * min_blocks);
    n_blocks = std::max<int64_t>(n_blocks, min_blocks);
  } else if (n_blocks < min_blocks) {
    return fail("--num-gpu-blocks-override " + std::to_string(n_blocks) +
                " cannot hold one --max-model-len " + std::to_string(ctx.max_model_len) +
                " sequence (needs " + std::to_string(min_blocks) + " blocks)");
  }
  ec.n_blocks = static_cast<int32_t>(std::min<int64_t>(n_blocks, INT32_MAX));

  Engine engine(*s.model, ec);
  ServerOptions so;
  so.host = args.host;
  so.port = args.port;
  so.api_key = args.api_key;
  so.allowed_origins = args.allowed_origins;
  so.max_request_bytes = args.max_request_bytes;
  // Every running or queued request holds one HTTP thread while it streams.
  so.http_threads = std::clamp(args.max_num_seqs + args.max_queue + 8, 16, 1024);
  Server server(engine, ctx, so);
  if (Status st = server.bind(); !st.ok()) return fail(st.message());

  std::fprintf(
      stderr,
      "nibble serve: model=%s arch=%s served_model_name=%s device=%s host=%s port=%d max_model_len=%d "
      "max_num_seqs=%d max_num_batched_tokens=%d max_queue=%d kv_blocks=%d (%d tokens, %.1f MiB) "
      "block_size=%d prefix_caching=%s async_scheduling=%s chat_format=%s api_key=%s shutdown_timeout=%gs\n",
      args.model.c_str(), cfg.model_type.c_str(), ctx.served_model_name.c_str(), s.model->device_name(), args.host.c_str(),
      server.port(), ctx.max_model_len, ec.scheduler.max_num_seqs, ec.scheduler.max_num_batched_tokens,
      ec.max_queue, ec.n_blocks, ec.n_blocks * kKvBlock, ec.n_blocks * block_bytes / 1048576.0, kKvBlock,
      ec.enable_prefix_caching ? "on" : "off", ec.async_scheduling ? "on" : "off", chat_format_name(ctx.chat_format),
      args.api_key.empty() ? "off" : "on", args.shutdown_timeout);
  std::thread http([&] { server.listen(); });
  std::fprintf(stderr, "nibble serve: ready on http://%s:%d\n", args.host.c_str(), server.port());
  std::fflush(stderr);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::fprintf(stderr, "nibble serve: %s: draining for up to %gs\n", sig == SIGTERM ? "SIGTERM" : "SIGINT",
               args.shutdown_timeout);
  engine.shutdown(std::chrono::milliseconds(static_cast<int64_t>(args.shutdown_timeout * 1000)));
  server.stop();
  http.join();
  std::fprintf(stderr, "nibble serve: stopped\n");
  return 0;
}

}  // namespace nb
