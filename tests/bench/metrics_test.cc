// nibble bench metric math against values computed by hand from llama-benchy 0.2.1's definitions
// (results.py), and the report's number/table formats against Python's repr and tabulate.
#include <gtest/gtest.h>

#include <cmath>

#include "bench/metrics.h"
#include "bench/report.h"

namespace nb::bench {
namespace {

RequestTiming request(double start, double first_response, std::vector<double> tokens, double end, int usage) {
  RequestTiming r;
  r.start = start;
  r.first_response = first_response;
  if (!tokens.empty()) r.first_token = tokens.front();
  r.token_times = std::move(tokens);
  r.end = end;
  r.usage_prompt_tokens = usage;
  return r;
}

TEST(BenchMetrics, PeakShortSpanIsCountOverSpan) {
  EXPECT_DOUBLE_EQ(peak_throughput({0.5, 0.0, 0.25}), 3 / 0.5);
}

TEST(BenchMetrics, PeakLongSpanCountsTokensInTheBusiestWindow) {
  // Window (t - 1, t]: at t = 1.0 it holds 0.5 and 1.0; at 1.2 it holds 0.5, 1.0, 1.1, 1.2.
  EXPECT_DOUBLE_EQ(peak_throughput({0.0, 0.5, 1.0, 1.1, 1.2, 2.5}), 4.0);
  EXPECT_DOUBLE_EQ(peak_throughput({1.0, 1.0}), 2.0);  // zero span: the sliding count
  EXPECT_DOUBLE_EQ(peak_throughput({}), 0.0);
}

TEST(BenchMetrics, SummarizeUsesPopulationStd) {
  auto m = summarize({1, 2, 3, 4}, 1000);
  ASSERT_TRUE(m);
  EXPECT_DOUBLE_EQ(m->mean, 2500);
  EXPECT_NEAR(m->std, 1000 * std::sqrt(1.25), 1e-9);
  EXPECT_EQ(m->values, (std::vector<double>{1000, 2000, 3000, 4000}));
  EXPECT_FALSE(summarize({}));
}

TEST(BenchMetrics, PercentileInterpolatesLikeNumpy) {
  EXPECT_DOUBLE_EQ(*percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_NEAR(*percentile({1, 2, 3, 4}, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(*percentile({7}, 99), 7);
  EXPECT_FALSE(percentile({}, 50));
}

TEST(BenchMetrics, PromptTokensTrustUsageWithinTwentyPercent) {
  RequestTiming r;
  r.usage_prompt_tokens = 119;
  EXPECT_EQ(prompt_tokens_used(r, 100), 119);
  r.usage_prompt_tokens = 120;
  EXPECT_EQ(prompt_tokens_used(r, 100), 100);
  r.usage_prompt_tokens = 0;
  EXPECT_EQ(prompt_tokens_used(r, 100), 100);
}

TEST(BenchMetrics, SingleRequestByHand) {
  // start 10.0, first choices chunk 10.3, tokens 10.5 .. 10.8, stream closed 10.85, latency 0.1 s.
  TestSamples s;
  add_batch({request(10.0, 10.3, {10.5, 10.6, 10.7, 10.8}, 10.85, 100)}, 95, 0.1, &s);
  ASSERT_EQ(s.ttfr.size(), 1u);
  EXPECT_NEAR(s.ttfr[0], 0.3, 1e-12);
  EXPECT_NEAR(s.e2e_ttft[0], 0.5, 1e-12);
  EXPECT_NEAR(s.est_ppt[0], 0.2, 1e-12);
  EXPECT_NEAR(s.pp_req[0], 100 / 0.2, 1e-9);        // usage 100 is within 20% of 95
  EXPECT_NEAR(s.tg_req[0], 3 / 0.35, 1e-9);         // (N - 1) / (end - first token)
  EXPECT_NEAR(s.pp_total[0], 100 / 0.5, 1e-9);      // no latency subtracted
  EXPECT_NEAR(s.tg_total[0], 3 / 0.3, 1e-9);        // to the last token, not the end
  EXPECT_NEAR(s.peak[0], 4 / 0.3, 1e-9);
  EXPECT_NEAR(s.tpot[0], 0.35 / 3, 1e-12);
  ASSERT_EQ(s.itl.size(), 3u);
  EXPECT_NEAR(s.itl[2], 0.1, 1e-12);

  TestResult t = make_test_result(512, 4, 0, 1, false, s);
  EXPECT_NEAR(t.pp_throughput->mean, 500, 1e-9);  // c = 1: the request's own rate
  EXPECT_NEAR(t.tg_throughput->mean, 3 / 0.35, 1e-9);
  EXPECT_NEAR(t.ttfr->mean, 300, 1e-9);
  EXPECT_NEAR(t.est_ppt->mean, 200, 1e-9);
  EXPECT_NEAR(t.e2e_ttft->mean, 500, 1e-9);
}

TEST(BenchMetrics, EstPptClampsAtZeroAndThenGivesNoPpSpeed) {
  TestSamples s;
  add_batch({request(0, 0.05, {0.05, 0.1}, 0.1, 10)}, 10, 0.2, &s);
  EXPECT_EQ(s.est_ppt, (std::vector<double>{0.0}));
  EXPECT_TRUE(s.pp_req.empty());
}

TEST(BenchMetrics, BatchOfTwoWithAFailureByHand) {
  RequestTiming failed;
  failed.error = "HTTP 500";
  TestSamples s;
  add_batch({request(0.0, 0.2, {0.2, 0.3, 0.4}, 0.45, 50), request(0.01, 0.3, {0.3, 0.4, 0.5, 0.6}, 0.6, 50), failed},
            50, 0.0, &s);
  EXPECT_EQ(s.n_requests, 3);
  EXPECT_EQ(s.n_failed, 1);
  EXPECT_NEAR(s.pp_total[0], 100 / 0.3, 1e-9);          // (50 + 50) / (max first token - min start)
  EXPECT_NEAR(s.tg_total[0], (7 - 2) / (0.6 - 0.2), 1e-9);
  EXPECT_NEAR(s.peak[0], 7 / 0.4, 1e-9);                 // union of both requests' tokens
  EXPECT_NEAR(s.pp_req[0], 50 / 0.2, 1e-9);
  EXPECT_NEAR(s.pp_req[1], 50 / 0.29, 1e-9);
  EXPECT_NEAR(s.tg_req[0], 2 / 0.25, 1e-9);
  EXPECT_NEAR(s.tg_req[1], 3 / 0.3, 1e-9);

  TestResult t = make_test_result(50, 4, 0, 2, false, s);
  EXPECT_NEAR(t.pp_throughput->mean, 100 / 0.3, 1e-9);  // c > 1: batch totals
  EXPECT_NEAR(t.pp_req_throughput->mean, (250 + 50 / 0.29) / 2, 1e-9);
  EXPECT_NEAR(t.pp_req_throughput->std, std::abs(250 - 50 / 0.29) / 2, 1e-9);
  EXPECT_NEAR(t.tg_req_throughput->mean, 9, 1e-9);

  SweepPoint p = make_sweep_point("pp50/tg4", t);
  EXPECT_EQ(p.n_failed, 1);
  EXPECT_NEAR(*p.ttft_median, (200 + 290) / 2.0, 1e-9);
  EXPECT_NEAR(*p.itl_mean, 100, 1e-9);
  EXPECT_NEAR(*p.tpot_p99, 125 - 0.01 * 25, 1e-9);  // TPOTs 100 and 125 ms: 100 + 0.99 * 25
}

TEST(BenchMetrics, AllFailedGivesNoMetric) {
  RequestTiming failed;
  failed.error = "timeout";
  TestSamples s;
  add_batch({failed}, 10, 0, &s);
  TestResult t = make_test_result(10, 4, 0, 1, false, s);
  EXPECT_FALSE(t.pp_throughput);
  EXPECT_FALSE(t.tg_throughput);
  EXPECT_TRUE(make_rows({t}, 1).empty());
}

TEST(BenchReport, PythonFloatRepr) {
  EXPECT_EQ(python_float(1.0), "1.0");
  EXPECT_EQ(python_float(0.1), "0.1");
  EXPECT_EQ(python_float(100.0), "100.0");
  EXPECT_EQ(python_float(1e-5), "1e-05");
  EXPECT_EQ(python_float(0.0001), "0.0001");
  EXPECT_EQ(python_float(1e16), "1e+16");
  EXPECT_EQ(python_float(123456.789), "123456.789");
  EXPECT_EQ(python_float(-2.5), "-2.5");
  EXPECT_EQ(python_float(1.0 / 3), "0.3333333333333333");
}

TEST(BenchReport, PipeTableMatchesTabulate) {
  // tabulate([["m", "pp2048", "4923.39 ± 37.21", ""]], headers=["model","test","t/s","peak t/s"],
  //          tablefmt="pipe", colalign=("left","right","right","right"))
  const std::string want =
      "| model   |   test |             t/s |   peak t/s |\n"
      "|:--------|-------:|----------------:|-----------:|\n"
      "| m       | pp2048 | 4923.39 \u00b1 37.21 |            |";
  EXPECT_EQ(pipe_table({"model", "test", "t/s", "peak t/s"}, {{"m", "pp2048", "4923.39 \u00b1 37.21", ""}}, "lrrr"),
            want);
}

TEST(BenchReport, RowNames) {
  TestResult a = make_test_result(2048, 32, 4096, 2, false, {});
  a.pp_throughput = Metric{1, 0, {1}};
  a.tg_throughput = Metric{1, 0, {1}};
  TestResult b = a;
  b.is_context_prefill_phase = true;
  auto rows = make_rows({b, a}, 2);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0].test_name, "ctx_pp @ d4096 (c2)");
  EXPECT_EQ(rows[1].test_name, "ctx_tg @ d4096 (c2)");
  EXPECT_EQ(rows[2].test_name, "pp2048 @ d4096 (c2)");
  EXPECT_EQ(rows[3].test_name, "tg32 @ d4096 (c2)");
  a.context_size = 0;
  EXPECT_EQ(make_rows({a}, 1)[0].test_name, "pp2048");
}

}  // namespace
}  // namespace nb::bench
