// `nibble bench`: the llama-benchy 0.2.1 suite (runner.py) in C++: corpus, warm-up and prompt
// adaptation, latency probe, then depth x pp x tg x concurrency tests of `runs` batches each. Progress
// goes to stderr, results to stdout (or --save-result); the metric math is bench/metrics.h.
#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "app/bench_args.h"
#include "app/cli_util.h"
#include "bench/client.h"
#include "bench/metrics.h"
#include "bench/report.h"
#include "text/tokenizer.h"

namespace nb {

namespace {

using bench::RequestTiming;
namespace fs = std::filesystem;

constexpr const char* kCorpusName = "tinyshakespeare.txt";

// The bundled corpus: data/ of the source tree the binary was built in (build*/src/nibble) or an
// installed share/nibble/, else ./data.
std::string default_corpus() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> candidates;
  if (!ec) {
    const fs::path dir = exe.parent_path();
    candidates = {dir / "../../data" / kCorpusName, dir / "../data" / kCorpusName,
                  dir / "../share/nibble" / kCorpusName};
  }
  candidates.push_back(fs::path("data") / kCorpusName);
  for (const fs::path& p : candidates)
    if (fs::is_regular_file(p, ec)) return fs::weakly_canonical(p, ec).string();
  return "";
}

std::string random_suffix(std::mt19937_64& rng) {  // " " + a uuid4-shaped string
  static const char* kHex = "0123456789abcdef";
  std::string s = " ";
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) s += '-';
    s += kHex[rng() & 15];
  }
  return s;
}

struct PromptPair {
  std::string context, prompt;
};

// prompts.py generate(): a random window of the corpus, the first `context_tokens` as the system
// message and the rest as the user message (plus a unique suffix with --no-cache).
PromptPair make_prompt(const Tokenizer& tok, const std::vector<int32_t>& corpus, int prompt_tokens,
                       int context_tokens, bool no_cache, std::mt19937_64& rng) {
  std::string suffix;
  int suffix_len = 0;
  if (no_cache) {
    suffix = random_suffix(rng);
    suffix_len = static_cast<int>(tok.encode(suffix, false).size());
  }
  const size_t text_prompt = static_cast<size_t>(std::max(0, prompt_tokens - suffix_len));
  const size_t total = text_prompt + static_cast<size_t>(context_tokens);
  std::vector<int32_t> pool = corpus;
  if (pool.size() < total) {
    const size_t reps = total / corpus.size() + 2;
    pool.clear();
    for (size_t i = 0; i < reps; ++i) pool.insert(pool.end(), corpus.begin(), corpus.end());
  }
  const size_t max_start = std::max<size_t>(1, pool.size() - total);
  const size_t start = std::uniform_int_distribution<size_t>(0, max_start - 1)(rng);
  const std::span<const int32_t> sel(pool.data() + start, total);
  PromptPair p;
  if (context_tokens > 0) p.context = tok.decode(sel.first(static_cast<size_t>(context_tokens)));
  p.prompt = tok.decode(sel.subspan(static_cast<size_t>(context_tokens))) + suffix;
  return p;
}

nlohmann::json messages(const std::string& context, const std::string& prompt) {
  nlohmann::json m = nlohmann::json::array();
  if (!context.empty()) m.push_back({{"role", "system"}, {"content", context}});
  m.push_back({{"role", "user"}, {"content", prompt}});
  return m;
}

// Runs the batch's requests in parallel, one thread each.
std::vector<RequestTiming> run_batch(const bench::Client& client, const std::vector<nlohmann::json>& batch,
                                     int max_tokens, bool no_cache) {
  std::vector<RequestTiming> out(batch.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < batch.size(); ++i)
    threads.emplace_back([&, i] { out[i] = client.stream_chat(batch[i], max_tokens, no_cache); });
  for (auto& t : threads) t.join();
  return out;
}

std::string utc_timestamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%SZ", &tm);
  return buf;
}

Status write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) return error("cannot write '" + path + "'");
  return Status();
}

}  // namespace

int cmd_bench(const BenchArgs& a) {
  const double t0 = bench::now_s();
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "nibble: error: bench: %s\n", msg.c_str());
    return 1;
  };
  const std::string served = a.served_model_name.empty() ? a.model : a.served_model_name;
  const std::string tok_path = a.tokenizer.empty() ? a.model : a.tokenizer;
  auto tok = Tokenizer::load(tok_path);
  if (!tok.ok()) return fail("tokenizer '" + tok_path + "': " + tok.status().message() + " (pass --tokenizer DIR)");
  const std::string corpus_path = a.text_file.empty() ? default_corpus() : a.text_file;
  if (corpus_path.empty()) return fail("bundled corpus data/tinyshakespeare.txt not found; pass --text-file F");
  auto text = read_file(corpus_path);
  if (!text.ok()) return fail(text.status().with_context("--text-file").message());
  const std::vector<int32_t> corpus = (*tok)->encode(*text, false);
  if (corpus.empty()) return fail("--text-file '" + corpus_path + "' has no tokens");
  std::fprintf(stderr, "nibble bench (llama-benchy 0.2.1 compatible): %s at %s\n", a.model.c_str(), a.base_url.c_str());
  std::fprintf(stderr, "Total tokens available in text corpus: %zu (%s)\n", corpus.size(), corpus_path.c_str());

  bench::ClientOptions opts;
  opts.base_url = a.base_url;
  opts.api_key = a.api_key;
  opts.model = served;
  opts.timeout_s = a.timeout;
  auto client = bench::Client::create(opts);
  if (!client.ok()) return fail(client.status().message());

  // Warm-up (runner.py: always when adapting): the server's prompt-token overhead for a user-only
  // and a system+empty-user chat, subtracted from pp (depth 0) or depth later.
  int delta_user = 0, delta_context = 0;
  if (!a.no_warmup || a.adapt_prompt) {
    const std::string warm = [] { std::string s; for (int i = 0; i < 10; ++i) s += "Warmup "; return s; }();
    const int local = static_cast<int>((*tok)->encode(warm, false).size());
    auto user = client->prompt_tokens(messages("", warm));
    if (!user.ok()) {
      std::fprintf(stderr, "Warmup failed: %s\n", user.status().message().c_str());
    } else if (a.adapt_prompt) {
      delta_user = *user - local;
      std::fprintf(stderr, "Warmup (User only) complete. Delta: %d tokens (Server: %d, Local: %d)\n", delta_user, *user, local);
      nlohmann::json sys = nlohmann::json::array({{{"role", "system"}, {"content", warm}}, {{"role", "user"}, {"content", ""}}});
      auto ctx = client->prompt_tokens(sys);
      if (ctx.ok()) {
        delta_context = *ctx - local;
        std::fprintf(stderr, "Warmup (System+Empty) complete. Delta: %d tokens (Server: %d, Local: %d)\n", delta_context, *ctx, local);
      } else {
        delta_context = delta_user;
        std::fprintf(stderr, "Warmup (System+Empty): %s; using the user delta\n", ctx.status().message().c_str());
      }
    } else {
      std::fprintf(stderr, "Warmup complete.\n");
    }
  }

  double latency = 0;
  if (a.latency_mode != "none") {
    std::vector<double> probes;
    for (int i = 0; i < 3; ++i) {
      auto l = client->latency_probe(a.latency_mode);
      if (l.ok()) probes.push_back(*l);
      else std::fprintf(stderr, "Error measuring latency: %s\n", l.status().message().c_str());
    }
    if (!probes.empty()) latency = bench::summarize(probes)->mean;
    std::fprintf(stderr, "Average latency (%s): %.2f ms\n", a.latency_mode.c_str(), latency * 1000);
  }

  std::mt19937_64 rng(std::random_device{}());
  std::vector<bench::TestResult> tests;
  std::vector<bench::SweepPoint> sweep;
  nlohmann::json request_log = nlohmann::json::array();
  int total_failed = 0, total_requests = 0;
  std::string first_error;
  auto log_batch = [&](const std::vector<RequestTiming>& batch, const bench::TestResult& proto, int run,
                       const char* phase, int expected) {
    for (const RequestTiming& r : batch) {
      total_requests++;
      if (!r.ok()) {
        total_failed++;
        if (first_error.empty()) first_error = r.error;
      }
      if (a.save_requests.empty()) continue;
      nlohmann::json j = {{"pp", proto.prompt_size}, {"tg", proto.response_size}, {"depth", proto.context_size},
                          {"concurrency", proto.concurrency}, {"run", run}, {"phase", phase},
                          {"expected_prompt_tokens", expected}, {"latency", latency}, {"start", r.start},
                          {"end", r.end}, {"token_times", r.token_times}, {"usage_prompt_tokens", r.usage_prompt_tokens},
                          {"error", r.error}};
      j["first_response"] = r.first_response ? nlohmann::json(*r.first_response) : nlohmann::json();
      j["first_token"] = r.first_token ? nlohmann::json(*r.first_token) : nlohmann::json();
      request_log.push_back(std::move(j));
    }
  };

  for (int depth : a.depth) {
    for (int pp : a.pp) {
      for (int tg : a.tg) {
        for (int c : a.concurrency) {
          std::fprintf(stderr, "Running test: pp=%d, tg=%d, depth=%d, concurrency=%d\n", pp, tg, depth, c);
          const bool two_phase = a.enable_prefix_caching && depth > 0;
          bench::TestSamples std_samples, ctx_samples;
          int expected_pp = pp, expected_ctx = depth;
          bench::TestResult proto;
          proto.prompt_size = pp;
          proto.response_size = tg;
          proto.context_size = depth;
          proto.concurrency = c;
          for (int run = 0; run < a.runs; ++run) {
            expected_pp = pp;
            expected_ctx = depth;
            if (a.adapt_prompt) {
              if (depth == 0) expected_pp = std::max(1, pp - delta_user);
              else expected_ctx = std::max(1, depth - delta_context);
            }
            std::vector<PromptPair> prompts;
            for (int i = 0; i < c; ++i)
              prompts.push_back(make_prompt(**tok, corpus, expected_pp, expected_ctx, a.no_cache, rng));
            if (two_phase) {
              std::fprintf(stderr, "  Run %d/%d (Context Load, batch size %d)... [%.1f s]\n", run + 1, a.runs, c,
                           bench::now_s() - t0);
              std::vector<nlohmann::json> load;
              for (const PromptPair& p : prompts) load.push_back(messages(p.context, ""));
              auto res = run_batch(*client, load, tg, a.no_cache);
              bench::add_batch(res, expected_ctx, latency, &ctx_samples);
              log_batch(res, proto, run, "context", expected_ctx);
              std::fprintf(stderr, "  Run %d/%d (Inference, batch size %d)... [%.1f s]\n", run + 1, a.runs, c,
                           bench::now_s() - t0);
            } else {
              std::fprintf(stderr, "  Run %d/%d (batch size %d)... [%.1f s]\n", run + 1, a.runs, c, bench::now_s() - t0);
            }
            std::vector<nlohmann::json> batch;
            for (const PromptPair& p : prompts) batch.push_back(messages(p.context, p.prompt));
            auto res = run_batch(*client, batch, tg, a.no_cache);
            const int expected = two_phase ? expected_pp : expected_pp + expected_ctx;
            bench::add_batch(res, expected, latency, &std_samples);
            log_batch(res, proto, run, two_phase ? "inference" : "standard", expected);
          }
          if (two_phase) {
            tests.push_back(bench::make_test_result(pp, tg, depth, c, true, std::move(ctx_samples)));
            sweep.push_back(bench::make_sweep_point(bench::sweep_label(tests.back()), tests.back()));
          }
          tests.push_back(bench::make_test_result(pp, tg, depth, c, false, std::move(std_samples)));
          sweep.push_back(bench::make_sweep_point(bench::sweep_label(tests.back()), tests.back()));
          if (sweep.back().n_failed > 0)
            std::fprintf(stderr, "  %d of %d requests failed\n", sweep.back().n_failed, sweep.back().n_requests);
        }
      }
    }
  }

  bench::Metadata meta;
  meta.version = "nibble bench (llama-benchy 0.2.1 compatible)";
  meta.timestamp = utc_timestamp();
  meta.latency_mode = a.latency_mode;
  meta.latency_ms = latency * 1000;
  meta.model = a.model;
  meta.prefix_caching_enabled = a.enable_prefix_caching;
  meta.max_concurrency = *std::max_element(a.concurrency.begin(), a.concurrency.end());

  std::string out;
  if (a.format == "json") {
    out = bench::format_json(meta, tests, sweep).dump(2) + "\n";
  } else if (a.format == "csv") {
    out = bench::format_csv(meta, tests);
  } else {
    out = bench::format_markdown(meta, tests) + "\n";
    if (a.concurrency.size() > 1 || total_failed > 0) out += "\n" + bench::format_sweep_markdown(sweep) + "\n";
  }
  if (!a.save_result.empty()) {
    Status s = write_text(a.save_result, out);
    if (!s.ok()) return fail("--save-result: " + s.message());
    std::fprintf(stderr, "Saved results to %s in %s format\n", a.save_result.c_str(), a.format.c_str());
  } else {
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }
  if (!a.plot.empty()) {
    Status s = write_text(a.plot, bench::format_sweep_svg(sweep, a.model + " at " + a.base_url));
    if (!s.ok()) return fail("--plot: " + s.message());
  }
  if (!a.save_requests.empty()) {
    std::string lines;
    for (const auto& j : request_log) lines += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    Status s = write_text(a.save_requests, lines);
    if (!s.ok()) return fail("--save-requests: " + s.message());
  }
  std::fprintf(stderr, "Done in %.1f s: %d requests, %d failed%s%s\n", bench::now_s() - t0, total_requests,
               total_failed, first_error.empty() ? "" : "; first error: ", first_error.c_str());
  if (total_requests > 0 && total_failed == total_requests) return fail("every request failed: " + first_error);
  return 0;
}

}  // namespace nb
