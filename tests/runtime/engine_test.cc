// Engine over a tiny committed checkpoint on the CPU backend: greedy requests run together (batched,
// chunked, preempted for lack of blocks, sharing prefix blocks) give the same tokens as each run
// alone; cancellation frees every block; the waiting queue is bounded; shutdown aborts the rest.
#include "runtime/engine.h"

#include <gtest/gtest.h>

#include <numeric>
#include <thread>

namespace nb {
namespace {

using namespace std::chrono_literals;

const std::string kModel = std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/qwen3_nvfp4_ct";

std::unique_ptr<Model> load() {
  ModelOptions o;
  o.n_threads = 2;
  auto m = Model::load(kModel, o);
  NB_CHECK(m.ok(), m.status().message());
  return std::move(m.value());
}

GenerationRequest greedy(int n_prompt, int first, int max_tokens) {
  GenerationRequest r;
  r.prompt.resize(n_prompt);
  for (int i = 0; i < n_prompt; ++i) r.prompt[i] = (first + 7 * i) % 470;
  r.sampling.temperature = 0;
  r.max_tokens = max_tokens;
  return r;
}

// Collects a stream until it ends.
std::pair<std::vector<int32_t>, StreamUpdate> drain(RequestStream& s) {
  std::vector<int32_t> ids;
  for (;;) {
    StreamUpdate u = s.wait(1000ms);
    for (auto& t : u.tokens) ids.push_back(t.id);
    if (u.done()) return {ids, u};
  }
}

std::vector<std::vector<int32_t>> run(Model& model, const EngineConfig& c,
                                      const std::vector<GenerationRequest>& reqs,
                                      EngineStats* stats = nullptr) {
  Engine engine(model, c);
  std::vector<std::shared_ptr<RequestStream>> streams;
  EXPECT_EQ(engine.submit(reqs, &streams), SubmitError::kNone);
  std::vector<std::vector<int32_t>> out;
  for (auto& s : streams) {
    auto [ids, end] = drain(*s);
    EXPECT_EQ(end.finish, FinishReason::kLength);
    out.push_back(ids);
  }
  engine.shutdown(1000ms);
  if (stats) *stats = engine.stats();
  EXPECT_EQ(engine.stats().n_blocks_used, 0);
  return out;
}

EngineConfig config(int n_blocks, int max_len, int budget, bool prefix) {
  EngineConfig c;
  c.n_blocks = n_blocks;
  c.max_model_len = max_len;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_num_seqs = 8;
  c.enable_prefix_caching = prefix;
  return c;
}

TEST(Engine, BatchedChunkedPreemptedEqualsAlone) {
  auto model = load();
  std::vector<GenerationRequest> reqs = {greedy(40, 1, 24), greedy(23, 50, 30), greedy(5, 9, 40),
                                         greedy(40, 1, 20)};
  std::vector<std::vector<int32_t>> alone;
  for (auto& r : reqs) alone.push_back(run(*model, config(64, 128, 2048, false), {r})[0]);
  for (auto& ids : alone) ASSERT_FALSE(ids.empty());

  EngineStats stats;
  // Big pool, big budget: plain continuous batching with prefix sharing (reqs 0 and 3 share 40 tokens).
  EXPECT_EQ(run(*model, config(64, 128, 2048, true), reqs, &stats), alone);
  // Small budget: prefill in chunks of 16 next to decodes.
  EXPECT_EQ(run(*model, config(64, 128, 16, true), reqs), alone);
  // 8 blocks (128 tokens) for ~250 tokens of demand: preemption by recompute.
  EXPECT_EQ(run(*model, config(8, 128, 64, false), reqs, &stats), alone);
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_EQ(stats.finished["length"], 4);
}

TEST(Engine, StopTokenAndMinTokens) {
  auto model = load();
  GenerationRequest r = greedy(10, 3, 12);
  auto ids = run(*model, config(64, 128, 2048, true), {r})[0];
  ASSERT_GE(ids.size(), 4u);
  Engine engine(*model, config(64, 128, 2048, true));
  r.stop_token_ids = {ids[3]};
  std::vector<std::shared_ptr<RequestStream>> s;
  ASSERT_EQ(engine.submit({r}, &s), SubmitError::kNone);
  auto [got, end] = drain(*s[0]);
  EXPECT_EQ(end.finish, FinishReason::kStop);
  EXPECT_EQ(end.stop_token, ids[3]);
  EXPECT_LE(got.size(), 3u);
}

TEST(Engine, CancelFreesBlocksAndQueueIsBounded) {
  auto model = load();
  EngineConfig c = config(64, 512, 2048, true);
  c.scheduler.max_num_seqs = 1;
  c.max_queue = 2;
  Engine engine(*model, c);
  std::vector<std::shared_ptr<RequestStream>> s;
  // Long enough (~2000 tokens, no stop ids) to still be running when the checks below look at it,
  // however slow a loaded CI machine is.
  ASSERT_EQ(engine.submit({greedy(40, 1, 2000)}, &s), SubmitError::kNone);
  // Wait until it runs, then fill the queue: one running + 2 waiting; a 4th is refused.
  while (s[0]->wait(1000ms).tokens.empty()) {
  }
  ASSERT_EQ(engine.submit({greedy(8, 2, 400), greedy(8, 3, 400)}, &s), SubmitError::kNone);
  EXPECT_EQ(engine.submit({greedy(8, 4, 4)}, &s), SubmitError::kQueueFull);
  EXPECT_EQ(engine.stats().rejected_queue_full, 1);
  // Stats are published after each engine step, so the first token can arrive just before them.
  for (int i = 0; i < 200 && engine.stats().n_blocks_used == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_GT(engine.stats().n_blocks_used, 0);
  for (auto& st : s) engine.cancel(*st);
  for (auto& st : s) EXPECT_EQ(drain(*st).second.finish, FinishReason::kAbort);
  for (int i = 0; i < 100 && engine.stats().n_blocks_used != 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(engine.stats().n_blocks_used, 0);
  engine.shutdown(0ms);
  EXPECT_EQ(engine.submit({greedy(8, 4, 4)}, &s), SubmitError::kShuttingDown);
}

// Async scheduling (each step queued before the previous step's ids are read, its pending tokens named by
// their rows on the backend) emits what the synchronous loop emits, token for token, across everything that
// moves a sequence between steps: stops mid-batch (their next step already queued and voided), lengths,
// seeded sampling, a request whose logits come to the host (logprobs: those steps run synchronously),
// min_tokens, chunked prefill, prefix sharing and preemption; every block is free at the end.
TEST(Engine, AsyncSchedulingEmitsWhatTheSyncLoopEmits) {
  auto model = load();
  std::vector<GenerationRequest> reqs = {greedy(40, 1, 24), greedy(23, 50, 30), greedy(5, 9, 40), greedy(40, 1, 20),
                                         greedy(12, 77, 25), greedy(9, 5, 18)};
  reqs[1].sampling.temperature = 0.9f, reqs[1].sampling.seed = 7, reqs[1].sampling.has_seed = true;
  reqs[4].sampling.temperature = 1.2f, reqs[4].sampling.top_k = 40, reqs[4].sampling.seed = 3;
  reqs[4].sampling.has_seed = true;
  reqs[5].logprobs = 2;
  reqs[3].min_tokens = 4;
  // Stop ids taken from a first run, so that some sequences stop part-way while others go on.
  const std::vector<std::vector<int32_t>> free_run = run(*model, config(64, 128, 2048, false), reqs);
  reqs[0].stop_token_ids = {free_run[0][6]};
  reqs[2].stop_token_ids = {free_run[2][11]};
  reqs[3].stop_token_ids = {free_run[3][2], free_run[3][9]};  // the first masked (min_tokens): the host path

  struct Out {
    std::vector<int32_t> ids;
    FinishReason finish;
    int32_t stop_token;
    std::vector<float> logprobs;
    bool operator==(const Out&) const = default;
  };
  auto outputs = [&](EngineConfig c, bool async, int64_t* preemptions) {
    c.async_scheduling = async;
    Engine engine(*model, c);
    std::vector<std::shared_ptr<RequestStream>> streams;
    EXPECT_EQ(engine.submit(reqs, &streams), SubmitError::kNone);
    std::vector<Out> out;
    for (auto& s : streams) {
      Out o;
      for (;;) {
        StreamUpdate u = s->wait(1000ms);
        for (auto& t : u.tokens) o.ids.push_back(t.id), o.logprobs.push_back(t.logprob);
        if (u.done()) {
          o.finish = u.finish, o.stop_token = u.stop_token;
          break;
        }
      }
      out.push_back(o);
    }
    engine.shutdown(1000ms);
    EXPECT_EQ(engine.stats().n_blocks_used, 0);
    if (preemptions) *preemptions = engine.stats().preemptions;
    return out;
  };
  for (const EngineConfig& c : {config(64, 128, 2048, true), config(64, 128, 16, true), config(8, 128, 64, false)}) {
    int64_t preempted_async = 0;
    const std::vector<Out> sync = outputs(c, false, nullptr);
    EXPECT_EQ(sync[0].finish, FinishReason::kStop);
    EXPECT_LE(sync[0].ids.size(), 6u);
    EXPECT_TRUE(sync[3].finish != FinishReason::kStop || sync[3].ids.size() >= 4u);  // min_tokens
    EXPECT_EQ(sync[1].finish, FinishReason::kLength);
    EXPECT_EQ(outputs(c, true, &preempted_async), sync) << "budget " << c.scheduler.max_num_batched_tokens;
    if (c.n_blocks == 8) {
      EXPECT_GT(preempted_async, 0);
    }
  }
}

TEST(Engine, ShutdownAbortsAfterTheDrain) {
  auto model = load();
  Engine engine(*model, config(64, 1024, 2048, true));
  std::vector<std::shared_ptr<RequestStream>> s;
  ASSERT_EQ(engine.submit({greedy(8, 1, 1000)}, &s), SubmitError::kNone);
  engine.shutdown(50ms);
  EXPECT_EQ(drain(*s[0]).second.finish, FinishReason::kAbort);
  EXPECT_EQ(engine.stats().n_blocks_used, 0);
}

}  // namespace
}  // namespace nb
