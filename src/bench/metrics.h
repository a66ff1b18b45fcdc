// Metric math of `nibble bench`, pure and clock-free: per-request timings in, llama-benchy 0.2.1
// numbers out (results.py: _process_batch, _calculate_peak_throughput, add), plus the concurrency
// sweep statistics (TTFT / TPOT / ITL mean, median, p99). Times are seconds on one monotonic clock;
// the report turns them into ms.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace nb::bench {

// One streamed request as the client saw it. A failed request (HTTP error, timeout, malformed or
// error chunk) keeps its error text and is left out of every metric, as llama-benchy drops it.
struct RequestTiming {
  double start = 0;                         // just before the POST
  double end = 0;                           // after the stream closed
  std::optional<double> first_response;     // first chunk with non-empty choices
  std::optional<double> first_token;        // first chunk with non-empty content/reasoning
  std::vector<double> token_times;          // one per content chunk (a chunk counts as one token)
  int usage_prompt_tokens = 0;              // usage.prompt_tokens from the stream (0: none)
  std::string error;                        // empty: succeeded
  bool ok() const { return error.empty(); }
  int n_tokens() const { return static_cast<int>(token_times.size()); }
};

// {mean, population std, values}, values already scaled (x1000 for times in ms).
struct Metric {
  double mean = 0;
  double std = 0;
  std::vector<double> values;
};
// nullopt for no values, as llama-benchy reports a missing metric.
std::optional<Metric> summarize(const std::vector<double>& values, double scale = 1.0);

// Tokens per second in the busiest `window` seconds: N / (t_last - t_first) when the span is shorter
// than the window, else the largest count of tokens in any (t - window, t] divided by the window.
double peak_throughput(std::vector<double> timestamps, double window = 1.0);

// Linear-interpolated percentile (numpy's default), p in [0, 100]; nullopt for no values.
std::optional<double> percentile(std::vector<double> values, double p);

// Prompt tokens credited to a request: the server's usage when within 20% of `expected`, else expected.
int prompt_tokens_used(const RequestTiming& r, int expected);

// Values collected over the runs of one test (one call of add_batch per run).
struct TestSamples {
  std::vector<double> pp_req, tg_req;                   // per-request t/s
  std::vector<double> ttfr, est_ppt, e2e_ttft;          // per-request, seconds
  std::vector<double> pp_total, tg_total, peak;         // per batch (run)
  std::vector<double> tpot, itl;                        // per request / per token gap, seconds (sweep)
  int n_requests = 0;
  int n_failed = 0;
};
// One run of `concurrency` parallel requests; latency (s) is subtracted from ttfr for est_ppt.
void add_batch(const std::vector<RequestTiming>& batch, int expected_prompt_tokens, double latency,
               TestSamples* samples);

// One test (pp, tg, depth, concurrency[, context phase]) as llama-benchy's BenchmarkRun.
struct TestResult {
  int concurrency = 1;
  int context_size = 0;  // depth
  int prompt_size = 0;   // configured pp
  int response_size = 0; // configured tg
  bool is_context_prefill_phase = false;
  std::optional<Metric> pp_throughput, pp_req_throughput, tg_throughput, tg_req_throughput,
      peak_throughput, ttfr, est_ppt, e2e_ttft;  // t/s; ttfr, est_ppt, e2e_ttft in ms
  TestSamples samples;                          // kept for the sweep and --save-requests
};
TestResult make_test_result(int pp, int tg, int depth, int concurrency, bool context_phase,
                            TestSamples samples);

// One concurrency level of the sweep: throughput and latency distribution over every request.
struct SweepPoint {
  std::string test;  // row label without the (cN) suffix, e.g. "pp512/tg32"
  int concurrency = 1;
  int n_requests = 0, n_failed = 0;
  std::optional<double> tg_total, tg_req, pp_total;      // mean t/s
  std::optional<double> ttft_mean, ttft_median, ttft_p99;  // ms (e2e_ttft)
  std::optional<double> tpot_mean, tpot_median, tpot_p99;  // ms
  std::optional<double> itl_mean, itl_median, itl_p99;     // ms
};
SweepPoint make_sweep_point(const std::string& test, const TestResult& r);

}  // namespace nb::bench
