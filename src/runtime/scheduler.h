// Scheduler: continuous batching under a token budget. Each step runs every running sequence first
// (one decode token, or the next prefill chunk), in arrival order, then admits waiting sequences in
// arrival order (no skipping ahead: fairness) while tokens, sequence slots and blocks last. When a
// running sequence needs a block and none is free, the latest arrival is preempted by recompute:
// its blocks are released and it waits again at the front of the queue with all its tokens.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "runtime/block_manager.h"
#include "runtime/sequence.h"

namespace nb {

struct SchedulerConfig {
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 2048;  // tokens per step (prefill chunks and decodes together)
};

struct ScheduledSeq {
  Sequence* seq = nullptr;
  int32_t n_new = 0;  // tokens [seq->n_computed, seq->n_computed + n_new) run this step
};

struct Schedule {
  std::vector<ScheduledSeq> seqs;
  std::vector<Sequence*> preempted;  // sent back to waiting this step
  int32_t n_tokens = 0;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockManager& blocks) : config_(config), blocks_(blocks) {}

  void add(Sequence* seq);     // to the back of the waiting queue
  void remove(Sequence* seq);  // finished or aborted: out of the queues, blocks released
  Schedule schedule();
  // After the step's forward pass: advances n_computed and registers full blocks for prefix caching.
  void on_step_done(const Schedule& schedule);

  int32_t n_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t n_running() const { return static_cast<int32_t>(running_.size()); }
  int64_t n_preemptions() const { return n_preemptions_; }

 private:
  void preempt(Sequence* seq);

  SchedulerConfig config_;
  BlockManager& blocks_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // arrival order
  int64_t n_preemptions_ = 0;
};

}  // namespace nb
