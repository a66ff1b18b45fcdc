// `nibble serve`: the OpenAI-compatible server. main.cc fills ServeArgs from the flags (named as vLLM
// names them); cmd_serve() loads the model, starts the engine and the HTTP server, and serves until
// SIGTERM/SIGINT, then drains for --shutdown-timeout seconds.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace nb {

struct ServeArgs {
  std::string model;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string device = "auto";
  int threads = 0;
  std::string served_model_name;  // default: the -m argument
  int max_model_len = 0;          // 0: the checkpoint's max_position_embeddings
  int max_num_seqs = 256;
  int max_num_batched_tokens = 0;  // 0: max(2048, max_num_seqs)
  int max_queue = 256;
  int num_gpu_blocks_override = 0;  // KV cache blocks; 0: sized by --kv-cache-memory-bytes
  size_t kv_cache_memory_bytes = size_t{1} << 30;
  std::string api_key;
  std::vector<std::string> allowed_origins;
  std::string kv_cache_dtype = "auto";
  std::string dense_format = "keep";
  bool dummy_weights = false;  // random weights from config.json alone
  bool enable_prefix_caching = true;
  bool async_scheduling = true;
  size_t max_request_bytes = 4 << 20;
  double shutdown_timeout = 30.0;   // seconds of drain after SIGTERM before in-flight requests abort
  std::string chat_format;          // override: harmony | chatml | llama3
  bool test_forced_output = false;  // hidden: honour the nibble_forced_output request field (tests)
};

int cmd_serve(const ServeArgs& args);

}  // namespace nb
