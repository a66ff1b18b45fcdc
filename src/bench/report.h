// Output of `nibble bench`: llama-benchy 0.2.1's markdown table (tabulate "pipe"), JSON and CSV
// (results.py: _generate_rows, _generate_md_report, save_report), plus the concurrency sweep as a
// markdown table, JSON and an SVG plot of throughput and latency against concurrency.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/metrics.h"

namespace nb::bench {

struct Metadata {
  std::string version;    // "nibble <v> (llama-benchy 0.2.1 compatible)"
  std::string timestamp;  // UTC "%Y-%m-%d %H:%M:%SZ"
  std::string latency_mode;
  double latency_ms = 0;
  std::string model;
  bool prefix_caching_enabled = false;
  int max_concurrency = 1;
};

// One table row as llama-benchy's _generate_rows builds it (pointers into a TestResult).
struct Row {
  std::string test_name;
  const std::optional<Metric>* t_s = nullptr;
  const std::optional<Metric>* t_s_req = nullptr;
  const std::optional<Metric>* peak_ts = nullptr;
  const std::optional<Metric>* ttfr = nullptr;
  const std::optional<Metric>* est_ppt = nullptr;
  const std::optional<Metric>* e2e_ttft = nullptr;
};
std::vector<Row> make_rows(const std::vector<TestResult>& tests, int max_concurrency);

// "pp2048 @ d4096 (c2)" style row label suffixes, and the sweep label "pp2048/tg32 @ d4096".
std::string sweep_label(const TestResult& t);

std::string format_markdown(const Metadata& meta, const std::vector<TestResult>& tests);
nlohmann::ordered_json format_json(const Metadata& meta, const std::vector<TestResult>& tests,
                                   const std::vector<SweepPoint>& sweep);
std::string format_csv(const Metadata& meta, const std::vector<TestResult>& tests);
std::string format_sweep_markdown(const std::vector<SweepPoint>& sweep);
std::string format_sweep_svg(const std::vector<SweepPoint>& sweep, const std::string& title);

// Python's repr() of a float ("1.0", "0.1", "1e-05"), as the csv module writes it.
std::string python_float(double v);
// tabulate(rows, headers, tablefmt="pipe", colalign=...) for string cells; align 'l' or 'r'.
std::string pipe_table(const std::vector<std::string>& headers, const std::vector<std::vector<std::string>>& rows,
                       const std::string& align);

}  // namespace nb::bench
