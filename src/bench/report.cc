// Report formatting; see report.h. The markdown table reproduces tabulate's "pipe" layout byte for
// byte (column width = max(cell widths, header width + 2), one space of padding, ':' on the aligned
// side of the rule) so that nibble and llama-benchy tables diff cleanly.
#include "bench/report.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>

namespace nb::bench {

namespace {

std::string fixed2(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

std::string cell(const std::optional<Metric>* m) {
  if (!m || !*m) return "";
  return fixed2((*m)->mean) + " \u00b1 " + fixed2((*m)->std);
}

size_t display_width(const std::string& s) {  // UTF-8 code points; every cell we write is narrow
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

nlohmann::ordered_json metric_json(const std::optional<Metric>& m) {
  if (!m) return nullptr;
  nlohmann::ordered_json j;
  j["mean"] = m->mean;
  j["std"] = m->std;
  j["values"] = m->values;
  return j;
}

std::string suffix_c(const TestResult& t, int max_concurrency) {
  return max_concurrency > 1 ? " (c" + std::to_string(t.concurrency) + ")" : "";
}

}  // namespace

std::string python_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string s(buf, end);  // [-]d[.ddd]e±XX, shortest round-trip digits
  const size_t e = s.find('e');
  const int exp10 = std::stoi(s.substr(e + 1));
  if (exp10 < -4 || exp10 >= 16) return s;
  std::string sign, digits;
  for (size_t i = 0; i < e; ++i) {
    if (s[i] == '-') sign = "-";
    else if (s[i] != '.') digits += s[i];
  }
  std::string out;
  if (exp10 < 0) {
    out = "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
  } else {
    const size_t int_len = static_cast<size_t>(exp10) + 1;
    if (digits.size() <= int_len) out = digits + std::string(int_len - digits.size(), '0') + ".0";
    else out = digits.substr(0, int_len) + "." + digits.substr(int_len);
  }
  return sign + out;
}

std::string pipe_table(const std::vector<std::string>& headers, const std::vector<std::vector<std::string>>& rows,
                       const std::string& align) {
  std::vector<size_t> width(headers.size());
  for (size_t c = 0; c < headers.size(); ++c) {
    width[c] = display_width(headers[c]) + 2;
    for (const auto& r : rows) width[c] = std::max(width[c], display_width(r[c]));
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out = "|";
    for (size_t c = 0; c < cells.size(); ++c) {
      const std::string pad(width[c] - display_width(cells[c]), ' ');
      out += " " + (align[c] == 'l' ? cells[c] + pad : pad + cells[c]) + " |";
    }
    return out + "\n";
  };
  std::string out = line(headers) + "|";
  for (size_t c = 0; c < headers.size(); ++c)
    out += align[c] == 'l' ? ":" + std::string(width[c] + 1, '-') + "|" : std::string(width[c] + 1, '-') + ":|";
  out += "\n";
  for (const auto& r : rows) out += line(r);
  out.pop_back();  // tabulate returns no trailing newline
  return out;
}

std::vector<Row> make_rows(const std::vector<TestResult>& tests, int max_concurrency) {
  std::vector<Row> rows;
  for (const TestResult& t : tests) {
    const std::string c = suffix_c(t, max_concurrency);
    const std::string d = t.context_size > 0 ? " @ d" + std::to_string(t.context_size) : "";
    const std::string pp_name = t.is_context_prefill_phase ? "ctx_pp @ d" + std::to_string(t.context_size) + c
                                                           : "pp" + std::to_string(t.prompt_size) + d + c;
    const std::string tg_name = t.is_context_prefill_phase ? "ctx_tg @ d" + std::to_string(t.context_size) + c
                                                           : "tg" + std::to_string(t.response_size) + d + c;
    if (t.pp_throughput)
      rows.push_back({pp_name, &t.pp_throughput, &t.pp_req_throughput, nullptr, &t.ttfr, &t.est_ppt, &t.e2e_ttft});
    if (t.tg_throughput)
      rows.push_back({tg_name, &t.tg_throughput, &t.tg_req_throughput, &t.peak_throughput, nullptr, nullptr, nullptr});
  }
  return rows;
}

std::string sweep_label(const TestResult& t) {
  std::string s = "pp" + std::to_string(t.prompt_size) + "/tg" + std::to_string(t.response_size);
  if (t.context_size > 0) s += " @ d" + std::to_string(t.context_size);
  if (t.is_context_prefill_phase) s = "ctx" + s;
  return s;
}

std::string format_markdown(const Metadata& meta, const std::vector<TestResult>& tests) {
  const std::vector<Row> rows = make_rows(tests, meta.max_concurrency);
  if (rows.empty()) return "No results collected. Check if the model is generating tokens.";
  std::vector<std::vector<std::string>> data;
  const bool multi = meta.max_concurrency > 1;
  for (const Row& r : rows) {
    if (multi)
      data.push_back({meta.model, r.test_name, cell(r.t_s), cell(r.t_s_req), cell(r.peak_ts), cell(r.ttfr),
                      cell(r.est_ppt), cell(r.e2e_ttft)});
    else
      data.push_back({meta.model, r.test_name, cell(r.t_s), cell(r.peak_ts), cell(r.ttfr), cell(r.est_ppt),
                      cell(r.e2e_ttft)});
  }
  if (multi)
    return pipe_table({"model", "test", "t/s (total)", "t/s (req)", "peak t/s", "ttfr (ms)", "est_ppt (ms)",
                       "e2e_ttft (ms)"}, data, "lrrrrrrr");
  return pipe_table({"model", "test", "t/s", "peak t/s", "ttfr (ms)", "est_ppt (ms)", "e2e_ttft (ms)"}, data,
                    "lrrrrrr");
}

nlohmann::ordered_json format_json(const Metadata& meta, const std::vector<TestResult>& tests,
                                   const std::vector<SweepPoint>& sweep) {
  nlohmann::ordered_json j;
  j["version"] = meta.version;
  j["timestamp"] = meta.timestamp;
  j["latency_mode"] = meta.latency_mode;
  j["latency_ms"] = meta.latency_ms;
  j["model"] = meta.model;
  j["prefix_caching_enabled"] = meta.prefix_caching_enabled;
  j["max_concurrency"] = meta.max_concurrency;
  j["benchmarks"] = nlohmann::ordered_json::array();
  for (const TestResult& t : tests) {
    nlohmann::ordered_json b;
    b["concurrency"] = t.concurrency;
    b["context_size"] = t.context_size;
    b["prompt_size"] = t.prompt_size;
    b["response_size"] = t.response_size;
    b["is_context_prefill_phase"] = t.is_context_prefill_phase;
    b["pp_throughput"] = metric_json(t.pp_throughput);
    b["pp_req_throughput"] = metric_json(t.pp_req_throughput);
    b["tg_throughput"] = metric_json(t.tg_throughput);
    b["tg_req_throughput"] = metric_json(t.tg_req_throughput);
    b["peak_throughput"] = metric_json(t.peak_throughput);
    b["ttfr"] = metric_json(t.ttfr);
    b["est_ppt"] = metric_json(t.est_ppt);
    b["e2e_ttft"] = metric_json(t.e2e_ttft);
    j["benchmarks"].push_back(std::move(b));
  }
  // nibble's addition (llama-benchy has no such key): the concurrency sweep, one entry per test and level.
  j["concurrency_sweep"] = nlohmann::ordered_json::array();
  for (const SweepPoint& p : sweep) {
    nlohmann::ordered_json s;
    auto opt = [](const std::optional<double>& v) { return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(); };
    s["test"] = p.test;
    s["concurrency"] = p.concurrency;
    s["requests"] = p.n_requests;
    s["failed_requests"] = p.n_failed;
    s["tg_total_throughput"] = opt(p.tg_total);
    s["tg_req_throughput"] = opt(p.tg_req);
    s["pp_total_throughput"] = opt(p.pp_total);
    s["ttft_ms"] = {{"mean", opt(p.ttft_mean)}, {"median", opt(p.ttft_median)}, {"p99", opt(p.ttft_p99)}};
    s["tpot_ms"] = {{"mean", opt(p.tpot_mean)}, {"median", opt(p.tpot_median)}, {"p99", opt(p.tpot_p99)}};
    s["itl_ms"] = {{"mean", opt(p.itl_mean)}, {"median", opt(p.itl_median)}, {"p99", opt(p.itl_p99)}};
    j["concurrency_sweep"].push_back(std::move(s));
  }
  return j;
}

std::string format_csv(const Metadata& meta, const std::vector<TestResult>& tests) {
  // Python's csv module: "\r\n" line ends, None as an empty field; quoting only when needed.
  auto quote = [](const std::string& s) {
    if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  };
  std::string out =
      "model,test_name,t_s_mean,t_s_std,t_s_req_mean,t_s_req_std,peak_ts_mean,peak_ts_std,ttfr_mean,ttfr_std,"
      "est_ppt_mean,est_ppt_std,e2e_ttft_mean,e2e_ttft_std\r\n";
  for (const Row& r : make_rows(tests, meta.max_concurrency)) {
    out += quote(meta.model) + "," + quote(r.test_name);
    for (const std::optional<Metric>* m : {r.t_s, r.t_s_req, r.peak_ts, r.ttfr, r.est_ppt, r.e2e_ttft}) {
      if (m && *m) out += "," + python_float((*m)->mean) + "," + python_float((*m)->std);
      else out += ",,";
    }
    out += "\r\n";
  }
  return out;
}

std::string format_sweep_markdown(const std::vector<SweepPoint>& sweep) {
  auto f = [](const std::optional<double>& v) { return v ? fixed2(*v) : std::string(); };
  std::vector<std::vector<std::string>> data;
  for (const SweepPoint& p : sweep)
    data.push_back({p.test, std::to_string(p.concurrency), std::to_string(p.n_requests), std::to_string(p.n_failed),
                    f(p.tg_total), f(p.tg_req), f(p.ttft_mean), f(p.ttft_median), f(p.ttft_p99), f(p.tpot_mean),
                    f(p.tpot_median), f(p.tpot_p99), f(p.itl_mean), f(p.itl_median), f(p.itl_p99)});
  return pipe_table({"test", "c", "requests", "failed", "tg t/s (total)", "tg t/s (req)", "ttft mean (ms)",
                     "ttft p50 (ms)", "ttft p99 (ms)", "tpot mean (ms)", "tpot p50 (ms)", "tpot p99 (ms)",
                     "itl mean (ms)", "itl p50 (ms)", "itl p99 (ms)"},
                    data, "lrrrrrrrrrrrrrr");
}

std::string format_sweep_svg(const std::vector<SweepPoint>& sweep, const std::string& title) {
  // Two panels over the same x axis (concurrency levels, evenly spaced): throughput on the left
  // (aggregate tg t/s solid, per-request dashed), latency on the right (TTFT p50 solid, TPOT p50
  // dashed, ITL p99 dotted); one colour per test.
  std::vector<int> levels;
  std::map<std::string, std::vector<const SweepPoint*>> series;
  std::vector<std::string> order;
  for (const SweepPoint& p : sweep) {
    if (std::find(levels.begin(), levels.end(), p.concurrency) == levels.end()) levels.push_back(p.concurrency);
    if (!series.count(p.test)) order.push_back(p.test);
    series[p.test].push_back(&p);
  }
  std::sort(levels.begin(), levels.end());
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  const double W = 960, H = 420, pw = 380, ph = 260, top = 60;
  const double lefts[2] = {70, 550};
  auto esc = [](const std::string& s) {
    std::string o;
    for (char c : s) o += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
    return o;
  };
  auto num = [](double v) { char b[32]; std::snprintf(b, sizeof b, "%.1f", v); return std::string(b); };
  auto label = [](double v) { char b[32]; std::snprintf(b, sizeof b, v >= 100 ? "%.0f" : "%.3g", v); return std::string(b); };
  auto xpos = [&](int panel, int level) {
    const size_t i = std::find(levels.begin(), levels.end(), level) - levels.begin();
    return lefts[panel] + (levels.size() == 1 ? pw / 2 : pw * static_cast<double>(i) / static_cast<double>(levels.size() - 1));
  };
  using Get = std::optional<double> (*)(const SweepPoint&);
  const Get getters[2][3] = {
      {[](const SweepPoint& p) { return p.tg_total; }, [](const SweepPoint& p) { return p.tg_req; }, nullptr},
      {[](const SweepPoint& p) { return p.ttft_median; }, [](const SweepPoint& p) { return p.tpot_median; },
       [](const SweepPoint& p) { return p.itl_p99; }}};
  const char* dashes[3] = {"", " stroke-dasharray=\"6,4\"", " stroke-dasharray=\"2,3\""};
  const char* ylabels[2] = {"tokens/s", "ms"};
  const char* titles[2] = {"throughput: tg total (solid), tg per request (dashed)",
                           "latency: TTFT p50 (solid), TPOT p50 (dashed), ITL p99 (dotted)"};

  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(W) + "\" height=\"" + num(H) +
                    "\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg += "<text x=\"" + num(W / 2) + "\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">" + esc(title) + "</text>\n";
  for (int panel = 0; panel < 2; ++panel) {
    double ymax = 0;
    for (const SweepPoint& p : sweep)
      for (Get g : getters[panel])
        if (g && g(p)) ymax = std::max(ymax, *g(p));
    ymax = ymax > 0 ? ymax * 1.1 : 1;
    const double x0 = lefts[panel], y0 = top + ph;
    svg += "<text x=\"" + num(x0 + pw / 2) + "\" y=\"" + num(top - 12) + "\" text-anchor=\"middle\">" +
           titles[panel] + "</text>\n";
    svg += "<rect x=\"" + num(x0) + "\" y=\"" + num(top) + "\" width=\"" + num(pw) + "\" height=\"" + num(ph) +
           "\" fill=\"none\" stroke=\"#444\"/>\n";
    for (int k = 0; k <= 4; ++k) {
      const double v = ymax * k / 4, y = y0 - ph * k / 4;
      svg += "<line x1=\"" + num(x0) + "\" x2=\"" + num(x0 + pw) + "\" y1=\"" + num(y) + "\" y2=\"" + num(y) +
             "\" stroke=\"#ddd\"/>\n<text x=\"" + num(x0 - 4) + "\" y=\"" + num(y + 4) + "\" text-anchor=\"end\">" +
             label(v) + "</text>\n";
    }
    for (int level : levels)
      svg += "<text x=\"" + num(xpos(panel, level)) + "\" y=\"" + num(y0 + 16) + "\" text-anchor=\"middle\">" +
             std::to_string(level) + "</text>\n";
    svg += "<text x=\"" + num(x0 + pw / 2) + "\" y=\"" + num(y0 + 34) + "\" text-anchor=\"middle\">concurrency</text>\n";
    svg += "<text transform=\"translate(" + num(x0 - 48) + "," + num(top + ph / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
           ylabels[panel] + "</text>\n";
    for (size_t s = 0; s < order.size(); ++s) {
      const char* color = colors[s % 6];
      for (int g = 0; g < 3; ++g) {
        if (!getters[panel][g]) continue;
        std::string pts;
        for (const SweepPoint* p : series[order[s]]) {
          auto v = getters[panel][g](*p);
          if (!v) continue;
          const double x = xpos(panel, p->concurrency), y = y0 - ph * *v / ymax;
          pts += num(x) + "," + num(y) + " ";
          svg += "<circle cx=\"" + num(x) + "\" cy=\"" + num(y) + "\" r=\"3\" fill=\"" + color + "\"/>\n";
        }
        if (!pts.empty())
          svg += "<polyline points=\"" + pts + "\" fill=\"none\" stroke=\"" + color + "\" stroke-width=\"2\"" +
                 dashes[g] + "/>\n";
      }
    }
  }
  for (size_t s = 0; s < order.size(); ++s) {
    const double x = 70 + 200 * static_cast<double>(s % 4), y = H - 40 + 16 * static_cast<double>(s / 4);
    svg += "<rect x=\"" + num(x) + "\" y=\"" + num(y - 9) + "\" width=\"12\" height=\"10\" fill=\"" + colors[s % 6] +
           "\"/>\n<text x=\"" + num(x + 18) + "\" y=\"" + num(y) + "\">" + esc(order[s]) + "</text>\n";
  }
  return svg + "</svg>\n";
}

}  // namespace nb::bench
