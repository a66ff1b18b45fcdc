#include "base/thread_pool.h"

#include <algorithm>

namespace nb {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 0; i < n_threads - 1; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  int64_t chunk = std::max<int64_t>(min_chunk, (n + size() * 4 - 1) / (size() * 4));
  if (workers_.empty() || chunk >= n) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  job_n_ = n;
  chunk_ = chunk;
  next_ = 0;
  ++generation_;
  cv_work_.notify_all();
  // The caller takes chunks too.
  while (next_ < job_n_) {
    int64_t b = next_;
    next_ = std::min(job_n_, b + chunk_);
    int64_t e = next_;
    ++active_;
    lock.unlock();
    fn(b, e);
    lock.lock();
    --active_;
  }
  cv_done_.wait(lock, [&] { return active_ == 0 && next_ >= job_n_; });
  job_ = nullptr;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stop_ || (job_ != nullptr && generation_ != seen && next_ < job_n_); });
    if (stop_) return;
    seen = generation_;
    while (job_ != nullptr && next_ < job_n_) {
      int64_t b = next_;
      next_ = std::min(job_n_, b + chunk_);
      int64_t e = next_;
      const auto* fn = job_;
      ++active_;
      lock.unlock();
      (*fn)(b, e);
      lock.lock();
      --active_;
    }
    if (active_ == 0) cv_done_.notify_all();
  }
}

}  // namespace nb
