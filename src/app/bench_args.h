// `nibble bench`: a llama-benchy 0.2.1 compatible benchmark client for any OpenAI-compatible server.
// main.cc fills BenchArgs (flags named as llama-benchy names them); cmd_bench() runs the suite,
// prints progress on stderr and the results (md, json or csv) on stdout or to --save-result.
#pragma once

#include <string>
#include <vector>

namespace nb {

struct BenchArgs {
  std::string base_url;           // includes /v1
  std::string api_key = "EMPTY";
  std::string model;              // row label; also the served name and tokenizer unless given
  std::string served_model_name;  // default: model
  std::string tokenizer;          // tokenizer.json or model directory; default: model
  std::vector<int> pp = {2048};
  std::vector<int> tg = {32};
  std::vector<int> depth = {0};
  int runs = 3;
  std::vector<int> concurrency = {1};
  std::string latency_mode = "api";  // api | generation | none
  bool enable_prefix_caching = false;
  bool no_cache = false;
  bool no_warmup = false;
  bool adapt_prompt = true;
  std::string text_file;             // default: data/tinyshakespeare.txt of the nibble tree
  std::string format = "md";         // md | json | csv
  std::string save_result;
  std::string plot;                  // SVG of the concurrency sweep
  std::string save_requests;         // JSONL of every request's raw timings (tests recompute from it)
  double timeout = 3600;             // seconds per request
};

int cmd_bench(const BenchArgs& args);

}  // namespace nb
