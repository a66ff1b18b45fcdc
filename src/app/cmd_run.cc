// nibble run: one prompt, one continuation. Prefill the prompt in one forward pass (or in chunks of
// --max-num-batched-tokens), then decode one token per pass over the paged KV cache, sampling on the
// host; text is printed as it is generated, never splitting a UTF-8 character.
#include <cstdio>
#include <sstream>
#include <unordered_set>

#include "app/cli_util.h"
#include "app/model_commands.h"
#include "app/model_session.h"
#include "base/log.h"
#include "server/text_stream.h"
#include "text/chat.h"
#include "text/regex.h"

namespace nb {
namespace {

Result<std::vector<int32_t>> prompt_ids(const RunArgs& args, const ModelSession& s) {
  if (!args.prompt_tokens.empty()) {
    auto ids = parse_token_ids(args.prompt_tokens);
    if (!ids.ok()) return ids.status().with_context("--prompt-tokens");
    return ids;
  }
  const ModelConfig& cfg = s.model->config();
  if (!args.chat.empty()) {
    ChatOptions options;
    options.reasoning_effort = args.reasoning_effort;
    std::vector<ChatMessage> messages(1);
    messages[0].role = "user";
    messages[0].content = args.chat;
    NB_ASSIGN_OR_RETURN(std::string prompt, render_chat(chat_format_for(cfg.model_type), messages, options));
    return s.tokenizer->encode(prompt, /*allow_special=*/true);
  }
  std::vector<int32_t> ids;
  // Raw completion: Llama tokenizers add <|begin_of_text|>; gpt-oss and Qwen3 add nothing.
  if (cfg.arch == Arch::kLlama && cfg.bos_token_id >= 0) ids.push_back(cfg.bos_token_id);
  const auto text = s.tokenizer->encode(args.prompt, /*allow_special=*/false);
  ids.insert(ids.end(), text.begin(), text.end());
  return ids;
}

// Valid UTF-8 for the terminal even when a model emits byte tokens that form no character.
std::string repaired(const std::string& bytes) {
  std::string storage;
  return std::string(text::repair_utf8(bytes, &storage));
}

}  // namespace

int cmd_run(const RunArgs& args) {
  if (Status st = args.sampling.validate(); !st.ok()) {
    std::fprintf(stderr, "nibble: error: %s\n", st.message().c_str());
    return 2;
  }
  const bool need_tokenizer = args.prompt_tokens.empty() || !args.print_tokens;
  auto session = open_model_session(args.model, args.device, args.threads, need_tokenizer, args.dense_format,
                                    args.kv_cache_dtype, args.dummy_weights);
  if (!session.ok()) {
    std::fprintf(stderr, "nibble: error: %s\n", session.status().message().c_str());
    return 1;
  }
  ModelSession& s = session.value();
  const ModelConfig& cfg = s.model->config();

  auto ids = prompt_ids(args, s);
  if (!ids.ok()) {
    std::fprintf(stderr, "nibble: error: %s\n", ids.status().message().c_str());
    return 2;
  }
  std::vector<int32_t> prompt = std::move(ids.value());
  if (prompt.empty()) {
    std::fprintf(stderr, "nibble: error: the prompt is empty after tokenization\n");
    return 2;
  }
  for (int32_t id : prompt) {
    if (id < 0 || id >= cfg.vocab_size) {
      std::fprintf(stderr, "nibble: error: prompt token %d is outside the vocabulary (size %d)\n", id, cfg.vocab_size);
      return 2;
    }
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + args.n_predict;
  if (cfg.max_position_embeddings > 0 && total > cfg.max_position_embeddings) {
    std::fprintf(stderr, "nibble: error: prompt (%zu tokens) + -n %d exceeds the model's context of %d tokens\n",
                 prompt.size(), args.n_predict, cfg.max_position_embeddings);
    return 2;
  }

  // Stop at the model's end-of-sequence ids, and at the chat format's stop tokens in chat mode.
  std::unordered_set<int32_t> stop(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
  if (!args.chat.empty() && s.tokenizer) {
    for (const std::string& t : chat_stop_tokens(chat_format_for(cfg.model_type)))
      if (auto id = s.tokenizer->token_id(t)) stop.insert(*id);
  }

  const int n_blocks = static_cast<int>((total + kKvBlock - 1) / kKvBlock);
  std::unique_ptr<KvCache> cache = s.model->new_kv_cache(n_blocks);
  SeqSlice seq;
  for (int b = 0; b < n_blocks; ++b) seq.block_table.push_back(b);

  Sampler sampler(args.sampling);
  std::vector<int32_t> generated;
  std::unique_ptr<TextStream> text;  // releases whole UTF-8 characters only
  if (!args.print_tokens) text = std::make_unique<TextStream>(*s.tokenizer, std::vector<std::string>{}, false);
  // Chunked prefill: every prompt chunk but the last is one forward step over the cached prefix; the last
  // goes through the loop below, whose logits pick the first token.
  std::vector<int32_t> next = prompt;
  const size_t chunk = args.max_num_batched_tokens > 0 ? args.max_num_batched_tokens : next.size();
  while (next.size() > chunk) {
    Batch batch;
    seq.n_new = static_cast<int32_t>(chunk);
    batch.tokens.assign(next.begin(), next.begin() + chunk);
    batch.seqs = {seq};
    if (auto logits = s.model->forward(batch, *cache); !logits.ok()) {
      std::fprintf(stderr, "nibble: error: %s\n", logits.status().message().c_str());
      return 1;
    }
    seq.n_past += seq.n_new;
    next.erase(next.begin(), next.begin() + chunk);
  }
  // Each step is queued before the previous step's id is read, its token that id on the backend
  // (Model::enqueue_sampled, as the server's async scheduling): the GPU does not wait for the host between
  // steps. A stop id ends the loop; the step already queued behind it is read and dropped.
  auto enqueue = [&](std::vector<int32_t> tokens) {
    Batch batch;
    seq.n_new = static_cast<int32_t>(tokens.size());
    batch.tokens = std::move(tokens);
    batch.seqs = {seq};
    // Sampled on the backend: only the id comes back (run has no penalties or logprobs).
    const Status st = s.model->enqueue_sampled(batch, *cache, {sampler.next()});
    if (!st.ok()) {
      std::fprintf(stderr, "\nnibble: error: %s\n", st.message().c_str());
      return false;
    }
    seq.n_past += seq.n_new;
    return true;
  };
  if (args.n_predict > 0 && !enqueue(next)) return 1;
  for (int step = 0; step < args.n_predict; ++step) {
    const bool more = step + 1 < args.n_predict;
    if (more && !enqueue({-1})) return 1;  // (-1: the id the step before samples)
    const int32_t id = s.model->wait_sampled()[0];
    if (!args.ignore_eos && stop.count(id)) {
      if (more) s.model->wait_sampled();
      break;
    }
    generated.push_back(id);
    if (args.print_tokens) {
      std::printf(generated.size() == 1 ? "%d" : " %d", id);
    } else {
      std::fputs(repaired(text->add(id)).c_str(), stdout);
    }
    std::fflush(stdout);
  }
  if (text) std::fputs(repaired(text->flush()).c_str(), stdout);
  std::printf("\n");
  return 0;
}

}  // namespace nb
