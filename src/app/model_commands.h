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
  std::string device = "auto";
  int threads = 0;
};
int cmd_run(const RunArgs& args);

// nibble eval -m DIR (--tokens-file F | --text-file F) [--json] [--device ...]
struct EvalArgs {
  std::string model;
  std::string tokens_file, text_file;
  bool json = false;
  int chunk = 512;  // tokens per forward pass
  std::string device = "auto";
  int threads = 0;
};
int cmd_eval(const EvalArgs& args);

// nibble inspect -m DIR
struct InspectArgs {
  std::string model;
};
int cmd_inspect(const InspectArgs& args);

}  // namespace nb
