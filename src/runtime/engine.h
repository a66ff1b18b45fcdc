// Engine: the one thread that owns the model and its KV cache. HTTP threads submit requests (token
// ids in, a RequestStream back) and may cancel them; the engine loop takes new requests, drops
// cancelled ones (freeing their blocks at once), asks the Scheduler for a step, runs Model::forward
// over the step's batch, samples each sequence whose pending tokens are all computed, and pushes the
// token to its stream. Stop strings are the HTTP side's business (it cancels when it finds one).
// Async scheduling (the default): a step whose tokens are sampled on the backend is queued without waiting
// for its ids; the next step is scheduled and queued first, naming each pending token by its row in the
// queued step's ids (Model::enqueue_sampled), and only then are the ids read and emitted. The device runs
// step after step while the host reads ids; a sequence that stops at step n has run step n + 1 for nothing
// (its output is dropped; the KV it wrote lies past its end, in blocks it no longer owns).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "model/model.h"
#include "runtime/block_manager.h"
#include "runtime/engine_stats.h"
#include "runtime/request_stream.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"

namespace nb {

struct EngineConfig {
  SchedulerConfig scheduler;
  int32_t max_model_len = 4096;  // prompt + output tokens of one sequence
  int32_t n_blocks = 0;          // KV cache blocks; must hold at least one max_model_len sequence
  bool enable_prefix_caching = true;
  int32_t max_queue = 256;  // waiting requests beyond this are refused (HTTP 429)
  bool async_scheduling = true;  // see above; false: each step's ids are read before the next is scheduled
};

struct GenerationRequest {
  std::vector<int32_t> prompt;  // [n_prompt], validated by the caller (ids < vocab, fits the context)
  SamplingParams sampling;
  int32_t max_tokens = 16;              // output tokens; the sequence also ends at max_model_len
  int32_t min_tokens = 0;               // stop tokens are masked until this many were generated
  std::vector<int32_t> stop_token_ids;  // end-of-sequence ids included by the caller unless ignore_eos
  int32_t logprobs = -1;                // -1: none; n >= 0: the chosen token's and the top n
  std::vector<int32_t> forced_output;   // test hook (--test-forced-output): emitted instead of sampling
};

enum class SubmitError { kNone, kQueueFull, kShuttingDown };

class Engine {
 public:
  Engine(Model& model, const EngineConfig& config);
  ~Engine();  // shutdown(0) if still running
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // All or none of the requests (one per choice of an n > 1 request) are queued.
  SubmitError submit(std::vector<GenerationRequest> requests,
                     std::vector<std::shared_ptr<RequestStream>>* out);
  void cancel(RequestStream& stream);
  // Stops taking requests, lets running ones finish for up to `drain`, aborts the rest, joins.
  void shutdown(std::chrono::milliseconds drain);
  bool accepting() const;
  EngineStats stats() const;
  const EngineConfig& config() const { return config_; }

 private:
  struct Active {
    Sequence seq;
    GenerationRequest req;
    std::shared_ptr<RequestStream> stream;
    std::unique_ptr<Sampler> sampler;
    size_t forced_pos = 0;
    std::chrono::steady_clock::time_point arrival, last_token;
    bool first_token_seen = false;
    bool started = false;  // scheduled at least once (no longer counts against --max-queue)
  };

  // A queued step whose ids have not been read: per logits row, the sequence and whether the row is a
  // token (an unfinished prefill chunk's row is not). Its sequences hold a placeholder as their last token
  // (-1 - row: the batch token that names the row on the backend) until collect() writes the id.
  struct InFlight {
    std::vector<uint64_t> seq_ids;
    std::vector<bool> emits;
  };

  void loop();
  void step();
  // Reads the in-flight step's ids and emits them (sequences finished since it was queued are skipped).
  void collect();
  // Whether the next step may be scheduled before the in-flight one is collected: not when one of its
  // sequences is sure to end on its pending token (length), which would run a step for nothing.
  bool can_overlap() const;
  void take_inbox();
  void drop_cancelled();
  void finish(Active& a, FinishReason reason, int32_t stop_token, const std::string& error = "");
  void emit_token(Active& a, std::span<const float> logits, const SampleSpec& spec);
  // After the token id is known (sampled on the host or the device): stats, stop, push, length.
  void emit_id(Active& a, int32_t id, std::span<const float> logits);
  // Whether this request's next token needs the logits on the host (penalties, stop-id masking,
  // logprobs, forced output); otherwise the backend samples it and only the id comes back.
  bool needs_host_logits(const Active& a) const;
  void publish_stats();

  Model& model_;
  const EngineConfig config_;
  std::unique_ptr<KvCache> cache_;
  BlockManager blocks_;
  Scheduler scheduler_;
  std::unordered_map<uint64_t, std::unique_ptr<Active>> active_;  // engine thread only
  std::vector<uint64_t> finished_;                                // this step's, erased after it
  std::optional<InFlight> inflight_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_, cv_idle_;
  std::vector<std::unique_ptr<Active>> inbox_;
  uint64_t next_id_ = 1;
  int32_t n_unadmitted_ = 0;  // queued requests not yet running (the --max-queue bound)
  int32_t n_live_ = 0;        // requests submitted and not yet finished
  bool accepting_ = true, abort_all_ = false, stop_ = false, wake_ = false;
  EngineStats stats_;
  std::thread thread_;
};

}  // namespace nb
