// nibble eval: teacher-forced next-token NLL over a token or text file. The sequence is fed in
// chunks of --chunk tokens over one KV cache; nll[i] = -log p(token[i+1] | token[0..i]) in float64.
// --seq-len N scores independent sequences of N tokens (each starts with an empty cache).
// With --ref-model, the reference runs over the same tokens in lockstep and each position adds
// KL(ref || model) = sum_v p_ref(v) (log p_ref(v) - log p_model(v)) (float64) and whether both argmaxes
// agree; reported as kl_mean, kl_p99 (nearest rank) and top1_agree.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "app/cli_util.h"
#include "app/model_commands.h"
#include "app/model_session.h"

namespace nb {
namespace {

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

// log-softmax of one logits row in float64.
void log_softmax(const float* row, int vocab, std::vector<double>& out) {
  double mx = row[0];
  for (int v = 1; v < vocab; ++v) mx = std::max(mx, static_cast<double>(row[v]));
  double sum = 0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
  const double lse = mx + std::log(sum);
  out.resize(vocab);
  for (int v = 0; v < vocab; ++v) out[v] = row[v] - lse;
}

int argmax(const float* row, int vocab) { return static_cast<int>(std::max_element(row, row + vocab) - row); }

}  // namespace

int cmd_eval(const EvalArgs& args) {
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "nibble: error: %s\n", st.message().c_str());
    return 1;
  };
  const bool text = !args.text_file.empty();
  auto session = open_model_session(args.model, args.device, args.threads, text, args.dense_format,
                                    args.kv_cache_dtype, args.dummy_weights);
  if (!session.ok()) return fail(session.status());
  ModelSession& s = session.value();
  const ModelConfig& cfg = s.model->config();
  ModelSession ref;
  if (!args.ref_model.empty()) {
    auto r = open_model_session(args.ref_model, args.device, args.threads, text);
    if (!r.ok()) return fail(r.status().with_context("--ref-model"));
    ref = std::move(r.value());
    const int rv = ref.model->config().vocab_size;
    if (rv != cfg.vocab_size)
      return fail(error("--ref-model " + args.ref_model + ": vocabulary of " + std::to_string(rv) +
                        " tokens, but the model's has " + std::to_string(cfg.vocab_size) +
                        "; KL needs one tokenizer"));
  }

  std::vector<int32_t> tokens;
  if (!args.tokens_file.empty()) {
    auto ids = read_tokens(args.tokens_file, cfg.vocab_size);
    if (!ids.ok()) return fail(ids.status());
    tokens = std::move(ids.value());
  } else {
    auto contents = read_file(args.text_file);
    if (!contents.ok()) return fail(contents.status());
    if (cfg.arch == Arch::kLlama && cfg.bos_token_id >= 0) tokens.push_back(cfg.bos_token_id);
    const auto ids = s.tokenizer->encode(contents.value(), /*allow_special=*/false);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    if (ref.model && ref.tokenizer->encode(contents.value(), false) != ids)
      return fail(error("--ref-model " + args.ref_model + ": its tokenizer splits the text differently; KL "
                        "needs one tokenizer"));
  }
  const int n = static_cast<int>(tokens.size());
  if (n < 2) return fail(error("eval needs at least 2 tokens, got " + std::to_string(n)));
  const int seq_len = args.seq_len > 0 ? std::min(args.seq_len, n) : n;
  if (seq_len < 2) return fail(error("--seq-len must be at least 2"));
  if (cfg.max_position_embeddings > 0 && seq_len > cfg.max_position_embeddings)
    return fail(error(std::to_string(seq_len) + " tokens exceed the model's context of " +
                      std::to_string(cfg.max_position_embeddings) + " (split them with --seq-len)"));

  const int n_blocks = (seq_len + kKvBlock - 1) / kKvBlock;
  std::unique_ptr<KvCache> cache = s.model->new_kv_cache(n_blocks);
  std::unique_ptr<KvCache> ref_cache = ref.model ? ref.model->new_kv_cache(n_blocks) : nullptr;
  SeqSlice base;
  for (int b = 0; b < n_blocks; ++b) base.block_table.push_back(b);
  base.all_logits = true;

  std::vector<double> nll, kl;
  int64_t agree = 0;
  nll.reserve(n - 1);
  const int vocab = cfg.vocab_size;
  std::vector<double> lp, lq;
  for (int seg = 0; seg + 1 < n; seg += seq_len) {
    const int seg_end = std::min(n, seg + seq_len);  // tokens [seg, seg_end) form one sequence
    SeqSlice seq = base;
    for (int start = seg; start < seg_end - 1; start += args.chunk) {
      const int len = std::min(args.chunk, seg_end - 1 - start);  // the last token predicts nothing
      Batch batch;
      batch.tokens.assign(tokens.begin() + start, tokens.begin() + start + len);
      seq.n_new = len;
      batch.seqs = {seq};
      auto logits = s.model->forward(batch, *cache);
      if (!logits.ok()) return fail(logits.status());
      Result<std::vector<float>> ref_logits = std::vector<float>();
      if (ref.model) {
        ref_logits = ref.model->forward(batch, *ref_cache);
        if (!ref_logits.ok()) return fail(ref_logits.status().with_context("--ref-model"));
      }
      seq.n_past += len;
      for (int i = 0; i < len; ++i) {
        const float* row = logits.value().data() + static_cast<size_t>(i) * vocab;
        log_softmax(row, vocab, lq);
        nll.push_back(-lq[tokens[start + i + 1]]);
        if (!ref.model) continue;
        const float* rrow = ref_logits.value().data() + static_cast<size_t>(i) * vocab;
        log_softmax(rrow, vocab, lp);
        double d = 0;
        for (int v = 0; v < vocab; ++v) d += std::exp(lp[v]) * (lp[v] - lq[v]);
        kl.push_back(std::max(d, 0.0));
        agree += argmax(row, vocab) == argmax(rrow, vocab);
      }
    }
  }
  double mean = 0;
  for (double v : nll) mean += v;
  mean /= nll.size();
  double kl_mean = 0, kl_p99 = 0, top1 = 0;
  if (!kl.empty()) {
    for (double v : kl) kl_mean += v;
    kl_mean /= kl.size();
    std::vector<double> sorted = kl;
    std::sort(sorted.begin(), sorted.end());
    const size_t rank = static_cast<size_t>(std::ceil(0.99 * sorted.size()));
    kl_p99 = sorted[std::max<size_t>(rank, 1) - 1];
    top1 = static_cast<double>(agree) / kl.size();
  }

  if (args.json) {
    nlohmann::json out;
    out["n_tokens"] = n;
    out["nll"] = nll;
    out["mean_nll"] = mean;
    out["ppl"] = std::exp(mean);
    if (ref.model) {
      out["kl_mean"] = kl_mean;
      out["kl_p99"] = kl_p99;
      out["top1_agree"] = top1;
    }
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("n_tokens %d  predicted %zu  mean_nll %.6f  ppl %.4f", n, nll.size(), mean, std::exp(mean));
    if (ref.model) std::printf("  kl_mean %.6f  kl_p99 %.6f  top1_agree %.4f", kl_mean, kl_p99, top1);
    std::printf("\n");
  }
  return 0;
}

}  // namespace nb
