#include "runtime/scheduler.h"

#include <algorithm>

#include "base/status.h"

namespace nb {

void Scheduler::add(Sequence* seq) {
  seq->status = SeqStatus::kWaiting;
  waiting_.push_back(seq);
}

void Scheduler::remove(Sequence* seq) {
  std::erase(waiting_, seq);
  std::erase(running_, seq);
  blocks_.release(*seq);
  seq->status = SeqStatus::kFinished;
}

void Scheduler::preempt(Sequence* seq) {
  blocks_.release(*seq);  // its full blocks stay in the prefix cache, so the recompute may find them
  seq->status = SeqStatus::kWaiting;
  waiting_.push_front(seq);
  ++n_preemptions_;
}

Schedule Scheduler::schedule() {
  Schedule out;
  int32_t budget = config_.max_num_batched_tokens;

  // Running sequences, oldest first; preempt from the newest end when blocks run out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* seq = running_[i];
    const int32_t n = std::min(seq->n_pending(), budget);
    NB_CHECK(n > 0, "running sequence with nothing to compute");
    while (!blocks_.can_grow(*seq, seq->n_computed + n) && running_.back() != seq) {
      Sequence* victim = running_.back();
      running_.pop_back();
      preempt(victim);
      out.preempted.push_back(victim);
    }
    if (!blocks_.grow(*seq, seq->n_computed + n)) {  // alone and still short: wait for blocks
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
      preempt(seq);
      out.preempted.push_back(seq);
      continue;
    }
    out.seqs.push_back({seq, n});
    budget -= n;
    ++i;
  }

  // Waiting sequences, in order, unless this step already had to preempt.
  while (out.preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    const std::vector<int32_t> matched = blocks_.match_prefix(*seq);
    const int32_t n = std::min(seq->size() - static_cast<int32_t>(matched.size()) * kKvBlock, budget);
    if (!blocks_.admit(*seq, matched, n)) break;
    if (!seq->admitted_once) seq->n_cached_prompt = seq->n_computed;
    seq->admitted_once = true;
    waiting_.pop_front();
    seq->status = SeqStatus::kRunning;
    running_.push_back(seq);
    out.seqs.push_back({seq, n});
    budget -= n;
  }
  out.n_tokens = config_.max_num_batched_tokens - budget;
  return out;
}

void Scheduler::on_step_done(const Schedule& schedule) {
  for (const ScheduledSeq& s : schedule.seqs) {
    s.seq->n_computed += s.n_new;
    blocks_.commit(*s.seq);
  }
}

}  // namespace nb
