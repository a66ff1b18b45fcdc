// RequestStream: the queue between the engine thread (producer: sampled tokens, then one finish) and
// the HTTP thread serving the request (consumer). The consumer may cancel; the engine then drops the
// sequence and frees its blocks at its next step.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace nb {

enum class FinishReason : uint8_t { kNone, kStop, kLength, kAbort, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", "error"

struct GeneratedToken {
  int32_t id = 0;
  float logprob = 0.0f;                        // when logprobs were asked for
  std::vector<std::pair<int32_t, float>> top;  // top_logprobs, best first
};

// What the consumer takes in one wait: new tokens, and the end when it has come.
struct StreamUpdate {
  std::vector<GeneratedToken> tokens;
  FinishReason finish = FinishReason::kNone;
  std::string error;  // kError: what went wrong
  int32_t n_prompt = 0, n_cached = 0;
  int32_t stop_token = -1;  // kStop on a stop token id: that id (not in tokens; counts as generated)
  bool done() const { return finish != FinishReason::kNone; }
};

class RequestStream {
 public:
  explicit RequestStream(uint64_t id) : id_(id) {}
  uint64_t id() const { return id_; }

  // Engine side.
  void push(GeneratedToken token);
  void finish(FinishReason reason, int32_t n_prompt, int32_t n_cached, int32_t stop_token = -1,
              std::string error = "");
  // Consumer side: waits up to `timeout` for news; returns what arrived since the last call.
  StreamUpdate wait(std::chrono::milliseconds timeout);
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  const uint64_t id_;
  std::mutex mu_;
  std::condition_variable cv_;
  StreamUpdate pending_;
  bool finished_ = false, delivered_end_ = false;
  std::atomic<bool> cancelled_{false};
};

}  // namespace nb
