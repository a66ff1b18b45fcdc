// Engine statistics for /metrics (vLLM names in server/metrics.cc): gauges read at snapshot time,
// monotonic counters, and latency histograms with Prometheus-style cumulative buckets.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace nb {

struct Histogram {
  std::vector<double> bounds;    // upper bounds, ascending (+Inf implied)
  std::vector<uint64_t> counts;  // [bounds.size() + 1], per bucket (not cumulative)
  double sum = 0;
  uint64_t count = 0;

  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v) {
    size_t i = 0;
    while (i < bounds.size() && v > bounds[i]) ++i;
    ++counts[i];
    sum += v;
    ++count;
  }
};

struct EngineStats {
  // Gauges.
  int32_t n_running = 0, n_waiting = 0;
  int32_t n_blocks = 0, n_blocks_used = 0;
  // Counters.
  int64_t prompt_tokens = 0, generation_tokens = 0, preemptions = 0;
  int64_t prefix_queries = 0, prefix_hits = 0;
  int64_t rejected_queue_full = 0;
  std::map<std::string, int64_t> finished;  // by finish reason
  // Histograms, seconds.
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                  1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}};
  Histogram itl{{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0}};
  Histogram e2e{{0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}};
  Histogram queue_time{{0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                        30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}};
};

}  // namespace nb
