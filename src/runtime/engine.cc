#include "runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/log.h"

namespace nb {

using Clock = std::chrono::steady_clock;

static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

Engine::Engine(Model& model, const EngineConfig& config)
    : model_(model),
      config_(config),
      cache_(model.new_kv_cache(config.n_blocks)),
      blocks_(config.n_blocks, config.enable_prefix_caching),
      scheduler_(config.scheduler, blocks_) {
  NB_CHECK(static_cast<int64_t>(config.n_blocks) * kKvBlock >= config.max_model_len,
           "the KV cache must hold one max_model_len sequence");
  NB_CHECK(config.scheduler.max_num_batched_tokens >= config.scheduler.max_num_seqs);
  stats_.n_blocks = config.n_blocks;
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(std::chrono::milliseconds(0)); }

SubmitError Engine::submit(std::vector<GenerationRequest> requests,
                           std::vector<std::shared_ptr<RequestStream>>* out) {
  const auto now = Clock::now();
  {
    std::lock_guard lock(mu_);
    if (!accepting_) return SubmitError::kShuttingDown;
    const auto n = static_cast<int32_t>(requests.size());
    if (n_unadmitted_ + n > config_.max_queue) {
      ++stats_.rejected_queue_full;
      return SubmitError::kQueueFull;
    }
    for (GenerationRequest& r : requests) {
      auto a = std::make_unique<Active>();
      a->seq.id = next_id_++;
      a->seq.tokens = r.prompt;
      a->seq.n_prompt = static_cast<int32_t>(r.prompt.size());
      a->sampler = std::make_unique<Sampler>(r.sampling);
      a->req = std::move(r);
      a->stream = std::make_shared<RequestStream>(a->seq.id);
      a->arrival = now;
      out->push_back(a->stream);
      inbox_.push_back(std::move(a));
    }
    n_unadmitted_ += n;
    n_live_ += n;
    wake_ = true;
  }
  cv_.notify_all();
  return SubmitError::kNone;
}

void Engine::cancel(RequestStream& stream) {
  stream.cancel();
  {
    std::lock_guard lock(mu_);
    wake_ = true;
  }
  cv_.notify_all();
}

bool Engine::accepting() const {
  std::lock_guard lock(mu_);
  return accepting_;
}

void Engine::shutdown(std::chrono::milliseconds drain) {
  std::unique_lock lock(mu_);
  if (stop_) return;
  accepting_ = false;
  cv_idle_.wait_for(lock, drain, [&] { return n_live_ == 0; });
  abort_all_ = stop_ = true;
  lock.unlock();
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Engine::loop() {
  for (;;) {
    bool abort_all = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return wake_ || stop_ || !active_.empty(); });
      wake_ = false;
      abort_all = abort_all_;
    }
    take_inbox();
    if (abort_all) {
      for (auto& [id, a] : active_) finish(*a, FinishReason::kAbort, -1);
      if (inflight_) collect();  // (every sequence finished: the ids are read and dropped)
      active_.clear();
      publish_stats();
      return;
    }
    drop_cancelled();
    if (!active_.empty()) step();
    if (active_.empty() && inflight_) collect();  // all cancelled: nothing else will read these ids
    publish_stats();
  }
}

void Engine::take_inbox() {
  std::vector<std::unique_ptr<Active>> inbox;
  {
    std::lock_guard lock(mu_);
    inbox.swap(inbox_);
  }
  for (auto& a : inbox) {
    scheduler_.add(&a->seq);
    active_[a->seq.id] = std::move(a);
  }
}

void Engine::drop_cancelled() {
  for (auto& [id, a] : active_)
    if (a->stream->cancelled()) finish(*a, FinishReason::kAbort, -1);
  for (uint64_t id : finished_) active_.erase(id);
  finished_.clear();
}

void Engine::finish(Active& a, FinishReason reason, int32_t stop_token, const std::string& error) {
  if (a.seq.status == SeqStatus::kFinished) return;
  scheduler_.remove(&a.seq);
  a.stream->finish(reason, a.seq.n_prompt, a.seq.n_cached_prompt, stop_token, error);
  finished_.push_back(a.seq.id);
  {
    std::lock_guard lock(mu_);
    if (!a.started) --n_unadmitted_;
    --n_live_;
    ++stats_.finished[finish_reason_name(reason)];
    stats_.e2e.observe(seconds(Clock::now() - a.arrival));
  }
  cv_idle_.notify_all();
}

void Engine::emit_token(Active& a, std::span<const float> row, const SampleSpec& spec) {
  Sequence& seq = a.seq;
  const GenerationRequest& req = a.req;
  std::vector<float> logits(row.begin(), row.end());
  if (has_penalties(req.sampling)) {
    apply_penalties(logits, req.sampling, std::span(seq.tokens).first(seq.n_prompt),
                    std::span(seq.tokens).subspan(seq.n_prompt));
  }
  if (seq.n_output() < req.min_tokens) {
    for (int32_t id : req.stop_token_ids)
      if (id >= 0 && id < static_cast<int32_t>(logits.size()))
        logits[id] = -std::numeric_limits<float>::infinity();
  }
  const int32_t id =
      a.forced_pos < req.forced_output.size() ? req.forced_output[a.forced_pos++] : sample_row(logits, spec);
  emit_id(a, id, row);
}

bool Engine::needs_host_logits(const Active& a) const {
  const GenerationRequest& req = a.req;
  return has_penalties(req.sampling) || req.logprobs >= 0 || a.forced_pos < req.forced_output.size() ||
         (a.seq.n_output() < req.min_tokens && !req.stop_token_ids.empty());
}

void Engine::emit_id(Active& a, int32_t id, std::span<const float> row) {
  Sequence& seq = a.seq;
  const GenerationRequest& req = a.req;
  const auto now = Clock::now();
  {
    std::lock_guard lock(mu_);
    ++stats_.generation_tokens;
    if (!a.first_token_seen)
      stats_.ttft.observe(seconds(now - a.arrival));
    else
      stats_.itl.observe(seconds(now - a.last_token));
  }
  a.first_token_seen = true;
  a.last_token = now;
  seq.tokens.push_back(id);

  const bool is_stop =
      std::find(req.stop_token_ids.begin(), req.stop_token_ids.end(), id) != req.stop_token_ids.end();
  if (is_stop) {
    finish(a, FinishReason::kStop, id);
    return;
  }
  GeneratedToken t;
  t.id = id;
  if (req.logprobs >= 0) {
    TokenLogprobs lp = token_logprobs(row, id, req.logprobs);
    t.logprob = lp.logprob;
    t.top = std::move(lp.top);
  }
  a.stream->push(std::move(t));
  if (seq.n_output() >= req.max_tokens || seq.size() >= config_.max_model_len)
    finish(a, FinishReason::kLength, -1);
}

bool Engine::can_overlap() const {
  for (const uint64_t id : inflight_->seq_ids) {
    auto it = active_.find(id);
    if (it == active_.end()) continue;
    const Active& a = *it->second;
    if (a.seq.status != SeqStatus::kFinished &&
        (a.seq.n_output() >= a.req.max_tokens || a.seq.size() >= config_.max_model_len))
      return false;
  }
  return true;
}

void Engine::collect() {
  const InFlight f = std::move(*inflight_);
  inflight_.reset();
  const std::vector<int32_t> ids = model_.wait_sampled();
  for (size_t i = 0; i < f.seq_ids.size(); ++i) {
    if (!f.emits[i]) continue;
    auto it = active_.find(f.seq_ids[i]);
    if (it == active_.end() || it->second->seq.status == SeqStatus::kFinished) continue;
    Active& a = *it->second;
    NB_CHECK(!a.seq.tokens.empty() && a.seq.tokens.back() == -1 - static_cast<int32_t>(i), "placeholder token");
    a.seq.tokens.pop_back();
    emit_id(a, ids[i], {});
  }
}

void Engine::step() {
  // The in-flight step's pending tokens stay placeholders in this step's batch unless it is collected first.
  if (inflight_ && !can_overlap()) collect();
  const Schedule schedule = scheduler_.schedule();
  {
    std::lock_guard lock(mu_);
    for (const ScheduledSeq& s : schedule.seqs) {
      Active& a = *active_.at(s.seq->id);
      if (a.started) continue;
      a.started = true;  // leaves the queue
      --n_unadmitted_;
      stats_.queue_time.observe(seconds(Clock::now() - a.arrival));
      stats_.prompt_tokens += s.seq->n_prompt;
    }
  }
  if (schedule.empty()) {  // everything waits for blocks that a cancellation will free
    if (inflight_) collect();
    return;
  }

  Batch batch;
  for (const ScheduledSeq& s : schedule.seqs) {
    SeqSlice slice;
    slice.block_table = s.seq->block_table;
    slice.n_past = s.seq->n_computed;
    slice.n_new = s.n_new;
    batch.tokens.insert(batch.tokens.end(), s.seq->tokens.begin() + s.seq->n_computed,
                        s.seq->tokens.begin() + s.seq->n_computed + s.n_new);
    batch.seqs.push_back(std::move(slice));
  }
  // The logits come to the host only when some request needs them; otherwise the backend samples and
  // only the ids come back (rows of unfinished prefill chunks get a greedy spec and are ignored).
  bool host = false;
  std::vector<SampleSpec> specs(schedule.seqs.size());
  InFlight next;
  for (size_t i = 0; i < schedule.seqs.size(); ++i) {
    Sequence* seq = schedule.seqs[i].seq;
    next.seq_ids.push_back(seq->id);
    next.emits.push_back(schedule.seqs[i].n_new == seq->n_pending());
    if (!next.emits.back()) continue;  // this step leaves the prefill unfinished
    Active& a = *active_.at(seq->id);
    host = host || needs_host_logits(a);
    specs[i] = a.sampler->next();
  }
  Result<std::vector<float>> logits = std::vector<float>();
  Status st;
  if (host) {
    logits = model_.forward(batch, *cache_);
    st = logits.status();
  } else {
    st = model_.enqueue_sampled(batch, *cache_, specs);
  }
  // The previous step's ids come first (its tokens precede this step's); some of its sequences may end
  // here, which makes their part of this step void.
  if (inflight_) collect();
  if (!st.ok()) {
    NB_LOG_WARN("forward failed: %s", st.message().c_str());
    for (const ScheduledSeq& s : schedule.seqs) finish(*active_.at(s.seq->id), FinishReason::kError, -1, st.message());
    return;
  }
  Schedule done = schedule;
  std::erase_if(done.seqs, [](const ScheduledSeq& s) { return s.seq->status == SeqStatus::kFinished; });
  scheduler_.on_step_done(done);
  if (!host) {
    for (size_t i = 0; i < schedule.seqs.size(); ++i) {
      Sequence* seq = schedule.seqs[i].seq;
      if (next.emits[i] && seq->status != SeqStatus::kFinished) seq->tokens.push_back(-1 - static_cast<int32_t>(i));
    }
    inflight_ = std::move(next);
    if (!config_.async_scheduling) collect();
    return;
  }
  const size_t vocab = logits.value().size() / schedule.seqs.size();
  for (size_t i = 0; i < schedule.seqs.size(); ++i) {
    Sequence* seq = schedule.seqs[i].seq;
    if (seq->status == SeqStatus::kFinished || seq->n_pending() != 0) continue;  // void, or no token yet
    // The uniform draw was already taken (specs[i]); the host sampler uses that same draw.
    emit_token(*active_.at(seq->id), std::span<const float>(logits.value()).subspan(i * vocab, vocab), specs[i]);
  }
}

void Engine::publish_stats() {
  std::lock_guard lock(mu_);
  stats_.n_running = scheduler_.n_running();
  stats_.n_waiting = scheduler_.n_waiting() + static_cast<int32_t>(inbox_.size());
  stats_.n_blocks_used = blocks_.n_used();
  stats_.preemptions = scheduler_.n_preemptions();
  stats_.prefix_queries = blocks_.prefix_queries();
  stats_.prefix_hits = blocks_.prefix_hits();
}

}  // namespace nb
