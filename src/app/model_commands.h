// Args and entry points of the commands that load a model: run, eval, inspect. main.cc fills the
// structs from the flags (one CLI11 table) and calls the function, which returns the exit code.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/sampler.h"

namespace nb {

// nibble run -m DIR [-p TEXT | --chat TEXT | --prompt-tokens "ID ID ..."] [-n N] [--temperature T]
//   [--top-p P] [--top-k K] [--min-p P] [--seed S] [--print-tokens] [--device auto|cpu|cuda]
struct RunArgs {
  std::string model;
  std::string prompt, chat, prompt_tokens;
  int n_predict = 64;
  SamplingParams sampling;
  bool print_tokens = false;
  bool ignore_eos = false;
  std::string reasoning_effort = "low";  // harmony chats
  int max_num_batched_tokens = 0;        // > 0: prefill the prompt in chunks of this many tokens
  bool dummy_weights = false;            // random weights from config.json (benchmarking shapes)
  std::string dense_format = "keep";     // CUDA: re-quantize BF16 dense layers at load
  std::string kv_cache_dtype = "auto";   // CUDA: bf16 (auto) or fp8
  std::string device = "auto";
  int threads = 0;
};
int cmd_run(const RunArgs& args);

// nibble eval -m DIR (--tokens-file F | --text-file F) [--ref-model DIR] [--seq-len N] [--json]
//   [--dense-format F] [--kv-cache-dtype D] [--device ...]
struct EvalArgs {
  std::string model;
  std::string tokens_file, text_file;
  std::string ref_model;  // KL(ref || model), top-1 agreement when set
  bool json = false;
  int chunk = 512;    // tokens per forward pass
  int seq_len = 0;    // > 0: independent sequences of this many tokens; 0: one sequence
  std::string dense_format = "keep";
  std::string kv_cache_dtype = "auto";
  bool dummy_weights = false;
  std::string device = "auto";
  int threads = 0;
};
int cmd_eval(const EvalArgs& args);

// nibble quantize -m BF16_DIR -o OUT_DIR --format mxfp4|nvfp4|fp8 [--layers experts,attn,mlp,lm_head,embed]
struct QuantizeArgs {
  std::string model, output, format;
  std::string layers;  // comma-separated; empty: the format's default
};
int cmd_quantize(const QuantizeArgs& args);

// nibble inspect -m DIR
struct InspectArgs {
  std::string model;
};
int cmd_inspect(const InspectArgs& args);

}  // namespace nb
