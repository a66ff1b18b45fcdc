// The nibble subcommands: one Args struct and one entry point per command. main.cc parses the flags
// (CLI11) into the struct and calls the function, which returns the process exit code.
#pragma once

#include <string>

namespace nb {

// nibble tokenize -m PATH [--special] [--decode] [--jsonl]
struct TokenizeArgs {
  std::string model;     // tokenizer.json, *.tiktoken, or a model directory
  bool special = false;  // encode: special-token text becomes special tokens (decode keeps them always)
  bool decode = false;   // ids -> text instead of text -> ids
  bool jsonl = false;    // one JSON string / JSON id array per line, for batch use by tests
};
int cmd_tokenize(const TokenizeArgs& args);

}  // namespace nb
