// llama-benchy 0.2.1 metric definitions (results.py), one function each; see metrics.h.
#include "bench/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>

namespace nb::bench {

std::optional<Metric> summarize(const std::vector<double>& values, double scale) {
  if (values.empty()) return std::nullopt;
  Metric m;
  double sum = 0;
  for (double v : values) sum += v;
  const double mean = sum / static_cast<double>(values.size());
  double ss = 0;
  for (double v : values) ss += (v - mean) * (v - mean);
  m.mean = mean * scale;
  m.std = std::sqrt(ss / static_cast<double>(values.size())) * scale;  // population (numpy ddof=0)
  m.values.reserve(values.size());
  for (double v : values) m.values.push_back(v * scale);
  return m;
}

double peak_throughput(std::vector<double> ts, double window) {
  if (ts.empty()) return 0.0;
  std::sort(ts.begin(), ts.end());
  const double span = ts.back() - ts.front();
  if (span < window && span > 0) return static_cast<double>(ts.size()) / span;
  size_t max_tokens = 0, start = 0;
  for (size_t end = 0; end < ts.size(); ++end) {
    while (start < end && ts[start] <= ts[end] - window) ++start;
    max_tokens = std::max(max_tokens, end - start + 1);
  }
  return static_cast<double>(max_tokens) / window;
}

std::optional<double> percentile(std::vector<double> values, double p) {
  if (values.empty()) return std::nullopt;
  std::sort(values.begin(), values.end());
  const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (values[hi] - values[lo]) * (rank - static_cast<double>(lo));
}

int prompt_tokens_used(const RequestTiming& r, int expected) {
  if (r.usage_prompt_tokens > 0 && std::abs(r.usage_prompt_tokens - expected) < expected * 0.2)
    return r.usage_prompt_tokens;
  return expected;
}

void add_batch(const std::vector<RequestTiming>& batch, int expected, double latency, TestSamples* s) {
  s->n_requests += static_cast<int>(batch.size());
  std::vector<const RequestTiming*> valid;
  for (const RequestTiming& r : batch) {
    if (r.ok()) valid.push_back(&r);
    else ++s->n_failed;
  }
  if (valid.empty()) return;

  long batch_prompt = 0, batch_gen = 0;
  double min_start = valid.front()->start, max_end = valid.front()->end;
  std::vector<double> first_tokens, last_tokens, all_tokens;
  for (const RequestTiming* r : valid) {
    min_start = std::min(min_start, r->start);
    max_end = std::max(max_end, r->end);
    all_tokens.insert(all_tokens.end(), r->token_times.begin(), r->token_times.end());
    if (!r->token_times.empty()) last_tokens.push_back(r->token_times.back());
    else last_tokens.push_back(r->end);
    const int prompt = prompt_tokens_used(*r, expected);
    batch_prompt += prompt;
    batch_gen += r->n_tokens();

    double ttfr = 0, est_ppt = 0;
    if (r->first_response) {
      ttfr = *r->first_response - r->start;
      s->ttfr.push_back(ttfr);
    }
    if (r->first_token) {
      first_tokens.push_back(*r->first_token);
      s->e2e_ttft.push_back(*r->first_token - r->start);
      est_ppt = std::max(0.0, ttfr - latency);
      s->est_ppt.push_back(est_ppt);
    }
    if (est_ppt > 0) s->pp_req.push_back(prompt / est_ppt);
    if (r->n_tokens() > 1 && r->first_token) {
      const double decode = r->end - *r->first_token;
      if (decode > 0) {
        s->tg_req.push_back((r->n_tokens() - 1) / decode);
        s->tpot.push_back(decode / (r->n_tokens() - 1));
      }
    }
    for (size_t i = 1; i < r->token_times.size(); ++i) s->itl.push_back(r->token_times[i] - r->token_times[i - 1]);
  }

  if (!first_tokens.empty()) {
    const double max_first = *std::max_element(first_tokens.begin(), first_tokens.end());
    const double min_first = *std::min_element(first_tokens.begin(), first_tokens.end());
    const double pp_duration = max_first - min_start;
    if (pp_duration > 0) s->pp_total.push_back(batch_prompt / pp_duration);
    const double max_last = last_tokens.empty() ? max_end : *std::max_element(last_tokens.begin(), last_tokens.end());
    const double tg_duration = max_last - min_first;
    const long n_valid = static_cast<long>(valid.size());
    if (tg_duration > 0 && batch_gen > n_valid) s->tg_total.push_back((batch_gen - n_valid) / tg_duration);
  }
  if (!all_tokens.empty()) s->peak.push_back(peak_throughput(std::move(all_tokens)));
}

TestResult make_test_result(int pp, int tg, int depth, int concurrency, bool context_phase, TestSamples s) {
  TestResult r;
  r.concurrency = concurrency;
  r.context_size = depth;
  r.prompt_size = pp;
  r.response_size = tg;
  r.is_context_prefill_phase = context_phase;
  // c = 1: the request speeds are the throughput; c > 1: batch totals, request speeds separately.
  r.pp_throughput = summarize(concurrency > 1 ? s.pp_total : s.pp_req);
  r.pp_req_throughput = concurrency == 1 ? r.pp_throughput : summarize(s.pp_req);
  r.tg_throughput = summarize(concurrency > 1 ? s.tg_total : s.tg_req);
  r.tg_req_throughput = concurrency == 1 ? r.tg_throughput : summarize(s.tg_req);
  r.peak_throughput = summarize(s.peak);
  r.ttfr = summarize(s.ttfr, 1000);
  r.est_ppt = summarize(s.est_ppt, 1000);
  r.e2e_ttft = summarize(s.e2e_ttft, 1000);
  r.samples = std::move(s);
  return r;
}

namespace {
std::optional<double> mean_of(const std::vector<double>& v, double scale = 1.0) {
  if (v.empty()) return std::nullopt;
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()) * scale;
}
std::optional<double> scaled(std::optional<double> v, double scale) {
  if (v) return *v * scale;
  return v;
}
}  // namespace

SweepPoint make_sweep_point(const std::string& test, const TestResult& r) {
  const TestSamples& s = r.samples;
  SweepPoint p;
  p.test = test;
  p.concurrency = r.concurrency;
  p.n_requests = s.n_requests;
  p.n_failed = s.n_failed;
  // Aggregate t/s is the batch total even at c = 1 (there it equals the request's own rate but for
  // the first token's gap), so the curve is one definition across levels.
  p.tg_total = mean_of(s.tg_total);
  p.pp_total = mean_of(s.pp_total);
  p.tg_req = mean_of(s.tg_req);
  p.ttft_mean = mean_of(s.e2e_ttft, 1000);
  p.ttft_median = scaled(percentile(s.e2e_ttft, 50), 1000);
  p.ttft_p99 = scaled(percentile(s.e2e_ttft, 99), 1000);
  p.tpot_mean = mean_of(s.tpot, 1000);
  p.tpot_median = scaled(percentile(s.tpot, 50), 1000);
  p.tpot_p99 = scaled(percentile(s.tpot, 99), 1000);
  p.itl_mean = mean_of(s.itl, 1000);
  p.itl_median = scaled(percentile(s.itl, 50), 1000);
  p.itl_p99 = scaled(percentile(s.itl, 99), 1000);
  return p;
}

}  // namespace nb::bench
