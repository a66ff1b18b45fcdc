// nibble eval: teacher-forced next-token NLL over a token or text file. The sequence is fed in
// chunks of --chunk tokens over one KV cache; nll[i] = -log p(token[i+1] | token[0..i]) in float64.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "app/model_commands.h"
#include "app/model_session.h"

namespace nb {
namespace {

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<std::vector<int32_t>> read_tokens(const std::string& path, int vocab) {
  NB_ASSIGN_OR_RETURN(std::string text, read_file(path));
  std::vector<int32_t> ids;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    const long v = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v >= vocab)
      return error(path + ": token " + std::to_string(ids.size()) + " ('" + word + "') is not an id in [0, " +
                   std::to_string(vocab) + ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

}  // namespace

int cmd_eval(const EvalArgs& args) {
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "nibble: error: %s\n", st.message().c_str());
    return 1;
  };
  auto session = open_model_session(args.model, args.device, args.threads, !args.text_file.empty());
  if (!session.ok()) return fail(session.status());
  ModelSession& s = session.value();
  const ModelConfig& cfg = s.model->config();

  std::vector<int32_t> tokens;
  if (!args.tokens_file.empty()) {
    auto ids = read_tokens(args.tokens_file, cfg.vocab_size);
    if (!ids.ok()) return fail(ids.status());
    tokens = std::move(ids.value());
  } else {
    auto text = read_file(args.text_file);
    if (!text.ok()) return fail(text.status());
    if (cfg.arch == Arch::kLlama && cfg.bos_token_id >= 0) tokens.push_back(cfg.bos_token_id);
    const auto ids = s.tokenizer->encode(text.value(), /*allow_special=*/false);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
  }
  const int n = static_cast<int>(tokens.size());
  if (n < 2) return fail(error("eval needs at least 2 tokens, got " + std::to_string(n)));
  if (cfg.max_position_embeddings > 0 && n > cfg.max_position_embeddings)
    return fail(error(std::to_string(n) + " tokens exceed the model's context of " +
                      std::to_string(cfg.max_position_embeddings)));

  const int n_blocks = (n + kKvBlock - 1) / kKvBlock;
  std::unique_ptr<KvCache> cache = s.model->new_kv_cache(n_blocks);
  SeqSlice seq;
  for (int b = 0; b < n_blocks; ++b) seq.block_table.push_back(b);
  seq.all_logits = true;

  std::vector<double> nll;
  nll.reserve(n - 1);
  const int vocab = cfg.vocab_size;
  for (int start = 0; start < n - 1; start += args.chunk) {
    const int len = std::min(args.chunk, n - 1 - start);  // the last token predicts nothing
    Batch batch;
    batch.tokens.assign(tokens.begin() + start, tokens.begin() + start + len);
    seq.n_new = len;
    batch.seqs = {seq};
    auto logits = s.model->forward(batch, *cache);
    if (!logits.ok()) return fail(logits.status());
    seq.n_past += len;
    for (int i = 0; i < len; ++i) {
      const float* row = logits.value().data() + static_cast<size_t>(i) * vocab;
      double mx = row[0];
      for (int v = 1; v < vocab; ++v) mx = std::max(mx, static_cast<double>(row[v]));
      double sum = 0;
      for (int v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
      nll.push_back(mx + std::log(sum) - row[tokens[start + i + 1]]);
    }
  }
  double mean = 0;
  for (double v : nll) mean += v;
  mean /= nll.size();

  if (args.json) {
    nlohmann::json out;
    out["n_tokens"] = n;
    out["nll"] = nll;
    out["mean_nll"] = mean;
    out["ppl"] = std::exp(mean);
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("n_tokens %d  predicted %zu  mean_nll %.6f  ppl %.4f\n", n, nll.size(), mean, std::exp(mean));
  }
  return 0;
}

}  // namespace nb
