// `nibble tokenize`: text -> ids or ids -> text with a model's tokenizer, one shot or line by line
// (--jsonl) so the differential tests can push thousands of strings through one process.
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "app/cli_util.h"
#include "app/commands.h"
#include "text/tokenizer.h"

namespace nb {
namespace {

using json = nlohmann::json;

int fail(const std::string& message) {
  std::fprintf(stderr, "nibble tokenize: %s\n", message.c_str());
  return 1;
}

std::string ids_to_text(const std::vector<int32_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out += std::to_string(ids[i]);
  }
  return out;
}

// ASCII-only JSON, so no U+2028 or U+0085 in the text can split the line for a reader; invalid UTF-8
// (an id sequence that ends inside a character) becomes U+FFFD.
std::string to_json_string(const std::string& s) {
  return json(s).dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
}

int run_jsonl(const Tokenizer& tok, const TokenizeArgs& args) {
  std::string line;
  for (size_t line_no = 1; std::getline(std::cin, line); ++line_no) {
    std::string where = "stdin line " + std::to_string(line_no) + ": ";
    json in = json::parse(line, nullptr, false);
    if (in.is_discarded()) return fail(where + "invalid JSON");
    if (args.decode) {
      if (!in.is_array()) return fail(where + "expected a JSON array of token ids");
      std::vector<int32_t> ids;
      for (const json& v : in) {
        if (!v.is_number_integer()) return fail(where + "expected integer token ids, got " + v.dump());
        int64_t id = v.get<int64_t>();
        if (id < INT32_MIN || id > INT32_MAX)
          return fail(where + "token id " + v.dump() + " is out of range");
        ids.push_back(static_cast<int32_t>(id));
      }
      auto text = tok.decode_checked(ids);
      if (!text.ok()) return fail(where + text.status().message());
      std::printf("%s\n", to_json_string(*text).c_str());
    } else {
      if (!in.is_string()) return fail(where + "expected a JSON string");
      std::printf("%s\n", json(tok.encode(in.get_ref<const std::string&>(), args.special)).dump().c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int cmd_tokenize(const TokenizeArgs& args) {
  if (args.model.empty())
    return fail("-m PATH is required (tokenizer.json, *.tiktoken or a model directory)");
  auto tok = Tokenizer::load(args.model);
  if (!tok.ok()) return fail(tok.status().message());
  if (args.jsonl) return run_jsonl(**tok, args);
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (args.decode) {
    auto ids = parse_token_ids(input);
    if (!ids.ok()) return fail(ids.status().message());
    auto text = (*tok)->decode_checked(*ids);
    if (!text.ok()) return fail(text.status().message());
    std::fwrite(text->data(), 1, text->size(), stdout);
    return 0;
  }
  std::printf("%s\n", ids_to_text((*tok)->encode(input, args.special)).c_str());
  return 0;
}

}  // namespace nb
