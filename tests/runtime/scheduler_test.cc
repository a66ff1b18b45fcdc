// Scheduler: running sequences go before waiting ones, prefill is chunked under the token budget,
// admission is in arrival order and bounded by max_num_seqs, and when blocks run out the newest
// running sequence is preempted (blocks released, back at the front of the queue) and later resumes.
#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <numeric>

namespace nb {
namespace {

struct Fixture {
  Fixture(int n_blocks, SchedulerConfig c, bool prefix = false)
      : blocks(n_blocks, prefix), sched(c, blocks) {}
  Sequence* add(int n_tokens, int first = 0) {
    auto s = std::make_unique<Sequence>();
    s->id = seqs.size() + 1;
    s->tokens.resize(n_tokens);
    std::iota(s->tokens.begin(), s->tokens.end(), first);
    s->n_prompt = n_tokens;
    seqs.push_back(std::move(s));
    sched.add(seqs.back().get());
    return seqs.back().get();
  }
  // Runs one step: schedule, "compute", and append a sampled token to every finished prefill.
  Schedule step() {
    Schedule s = sched.schedule();
    sched.on_step_done(s);
    for (auto& ss : s.seqs)
      if (ss.seq->n_pending() == 0) ss.seq->tokens.push_back(7);
    return s;
  }
  BlockManager blocks;
  Scheduler sched;
  std::vector<std::unique_ptr<Sequence>> seqs;
};

TEST(Scheduler, ChunksPrefillUnderTheTokenBudget) {
  Fixture f(64, {.max_num_seqs = 8, .max_num_batched_tokens = 32});
  Sequence* a = f.add(80);
  Schedule s = f.step();
  ASSERT_EQ(s.seqs.size(), 1u);
  EXPECT_EQ(s.seqs[0].n_new, 32);
  EXPECT_EQ(f.step().seqs[0].n_new, 32);
  EXPECT_EQ(f.step().seqs[0].n_new, 16);  // the rest, then a token is sampled
  EXPECT_EQ(a->size(), 81);
  EXPECT_EQ(f.step().seqs[0].n_new, 1);  // decode
}

TEST(Scheduler, RunningFirstThenWaitingInArrivalOrder) {
  Fixture f(64, {.max_num_seqs = 8, .max_num_batched_tokens = 20});
  Sequence* a = f.add(10);
  f.step();  // a prefilled
  Sequence* b = f.add(15);
  Sequence* c = f.add(3);
  Schedule s = f.step();
  ASSERT_EQ(s.seqs.size(), 3u);
  EXPECT_EQ(s.seqs[0].seq, a);  // decode first
  EXPECT_EQ(s.seqs[0].n_new, 1);
  EXPECT_EQ(s.seqs[1].seq, b);  // then arrivals in order
  EXPECT_EQ(s.seqs[1].n_new, 15);
  EXPECT_EQ(s.seqs[2].seq, c);  // c: 3 of the 4 tokens left
  Sequence* d = f.add(10);
  s = f.step();  // 3 decodes, then d chunked to the 17 left... all of it
  EXPECT_EQ(s.seqs.back().seq, d);
  Fixture g(64, {.max_num_seqs = 8, .max_num_batched_tokens = 5});
  g.add(3);
  Sequence* e = g.add(10);
  s = g.step();
  EXPECT_EQ(s.seqs[1].seq, e);
  EXPECT_EQ(s.seqs[1].n_new, 2);  // chunked to the budget left
}

TEST(Scheduler, HonoursMaxNumSeqs) {
  Fixture f(64, {.max_num_seqs = 2, .max_num_batched_tokens = 100});
  f.add(4);
  f.add(4);
  f.add(4);
  EXPECT_EQ(f.step().seqs.size(), 2u);
  EXPECT_EQ(f.sched.n_running(), 2);
  EXPECT_EQ(f.sched.n_waiting(), 1);
}

TEST(Scheduler, NoSkippingAheadWhenTheHeadDoesNotFit) {
  Fixture f(4, {.max_num_seqs = 8, .max_num_batched_tokens = 200});
  f.add(40);                  // 3 blocks
  Sequence* big = f.add(40);  // needs 3, only 1 left
  f.add(4);                   // would fit, but must wait behind big (fairness)
  Schedule s = f.step();
  EXPECT_EQ(s.seqs.size(), 1u);
  EXPECT_EQ(f.sched.n_waiting(), 2);
  (void)big;
}

TEST(Scheduler, PreemptsTheNewestAndResumesIt) {
  // 4 blocks; two prompts of 32 tokens take 2 blocks each; computing token 33 needs a 5th block.
  Fixture f(4, {.max_num_seqs = 8, .max_num_batched_tokens = 100});
  Sequence* a = f.add(32);
  Sequence* b = f.add(32);
  f.step();  // both prefilled, each now 33 tokens (one sampled)
  EXPECT_EQ(f.blocks.n_used(), 4);
  Schedule s = f.step();  // a needs block 3: b (newest) is preempted
  ASSERT_EQ(s.preempted.size(), 1u);
  EXPECT_EQ(s.preempted[0], b);
  EXPECT_EQ(b->n_computed, 0);
  EXPECT_TRUE(b->block_table.empty());
  EXPECT_EQ(b->size(), 33);  // keeps its output token for the recompute
  EXPECT_EQ(f.sched.n_preemptions(), 1);
  f.sched.remove(a);  // a finishes: b is admitted again and recomputes all 33 tokens
  s = f.step();
  ASSERT_EQ(s.seqs.size(), 1u);
  EXPECT_EQ(s.seqs[0].seq, b);
  EXPECT_EQ(s.seqs[0].n_new, 33);
  f.sched.remove(b);
  EXPECT_EQ(f.blocks.n_used(), 0);
}

TEST(Scheduler, RecomputeAfterPreemptionHitsThePrefixCache) {
  Fixture f(4, {.max_num_seqs = 8, .max_num_batched_tokens = 100}, /*prefix=*/true);
  Sequence* a = f.add(32);
  Sequence* b = f.add(32, 1000);
  f.step();
  f.step();  // b preempted; its 2 full blocks stay cached, a takes one of them (block 1 goes first)
  f.sched.remove(a);
  Schedule s = f.step();
  ASSERT_EQ(s.seqs.size(), 1u);
  EXPECT_EQ(s.seqs[0].n_new, 17);  // block 0 found again
  f.sched.remove(b);
  EXPECT_EQ(f.blocks.n_used(), 0);
}

TEST(Scheduler, RemoveFreesWaitingAndRunning) {
  Fixture f(16, {.max_num_seqs = 1, .max_num_batched_tokens = 100});
  Sequence* a = f.add(20);
  Sequence* b = f.add(20);
  f.step();
  f.sched.remove(b);  // waiting
  f.sched.remove(a);  // running
  EXPECT_EQ(f.sched.n_waiting() + f.sched.n_running(), 0);
  EXPECT_EQ(f.blocks.n_used(), 0);
  EXPECT_TRUE(f.step().empty());
}

}  // namespace
}  // namespace nb
