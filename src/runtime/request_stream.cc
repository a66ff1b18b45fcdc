#include "runtime/request_stream.h"

namespace nb {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "";
}

void RequestStream::push(GeneratedToken token) {
  {
    std::lock_guard lock(mu_);
    pending_.tokens.push_back(std::move(token));
  }
  cv_.notify_all();
}

void RequestStream::finish(FinishReason reason, int32_t n_prompt, int32_t n_cached, int32_t stop_token,
                           std::string error) {
  {
    std::lock_guard lock(mu_);
    if (finished_) return;
    finished_ = true;
    pending_.finish = reason;
    pending_.n_prompt = n_prompt;
    pending_.n_cached = n_cached;
    pending_.stop_token = stop_token;
    pending_.error = std::move(error);
  }
  cv_.notify_all();
}

StreamUpdate RequestStream::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !pending_.tokens.empty() || (finished_ && !delivered_end_); });
  StreamUpdate out = std::move(pending_);
  pending_ = StreamUpdate();
  if (out.done()) delivered_end_ = true;
  return out;
}

}  // namespace nb
