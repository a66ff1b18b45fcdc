// End-to-end benchmark: a model built from configs/<name>/config.json with --dummy-weights on the GPU.
// Decode: at each --dense-format, tg128 at batch 1 (one prompt token, then 128 decode steps, greedy ids sampled
// on the GPU and copied to the host, as the engine does: each step queued before the previous step's id is read,
// its token that id on the device (Model::enqueue_sampled; --sync-decode: Model::forward_sampled, each id read
// before the next step is queued, the engine's --no-async-scheduling)); prints
// ready time, tok/s, the variant's bytes per token and % of the roofline (measured read bandwidth / bytes
// per token).
// Prefill: with the checkpoint's own dense format, ppN at batch 1: the time to process an N-token prompt
// (Model::forward, last token's logits to the host) in chunks of --chunk tokens (default: the whole prompt
// in one step), after one warm-up prompt; sizes whose projected time exceeds --max-seconds are skipped.
// Usage: nibble_e2e_bench [--pp 512,2048,8192 | --no-pp] [--chunk N] [--max-seconds S] [--no-tg] [--gemm-acts fp16|hi-lo]
//                         [--dense-formats keep,fp8,mxfp4,nvfp4] [--pp-dense-format F] [--depth N] [--sync-decode]
//   --pp-dense-format F: the prefill runs at --dense-format F (default keep: the checkpoint's own). Like
//   --dense-format it re-quantizes the attention projections and lm_head only; for every linear in FP4 take a
//   config with a quantization_config (configs/Llama-3.1-8B-NVFP4, configs/Qwen3-30B-A3B-NVFP4)
//   --depth N: the decode runs after an N-token prompt (one prefill step) instead of one token: tg128 at
//   context depth N (llama-benchy's "tg128 @ dN")
//        CONFIG_DIR...
//   --gemm-acts: the FP4 tensor-core paths' activations (prefill GEMMs and one-token decode GEMVs): one fp16
//   (the default) or hi + lo
//   (e.g. configs/gpt-oss-20b configs/gpt-oss-120b)
//   NIBBLE_BENCH_HOST_TIMES=1: also the host's mean time per decode step in enqueue_sampled and wait_sampled
//   (stderr; the default async loop): whether the host keeps ahead of the GPU
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/device.h"
#include "kernels/bandwidth.cuh"
#include "stamps.h"  // (bench/)
#include "model/model.h"

namespace nb {
namespace {

double bytes_per_param(WeightFormat f, int64_t k) {
  switch (f) {
    case WeightFormat::kBF16:
      return 2;
    case WeightFormat::kFP8E4M3:
      return 1 + 4.0 / k;
    case WeightFormat::kMXFP4:
      return 0.5 + 1.0 / 32;
    case WeightFormat::kNVFP4:
      return 0.5 + 1.0 / 16;
  }
  return 2;
}

// Weight and KV bytes one decode token reads at context `ctx` (gpt-oss / qwen3 / llama layouts).
double bytes_per_token(const ModelConfig& c, DenseFormat dense, int ctx) {
  const WeightFormat df = dense == DenseFormat::kFP8     ? WeightFormat::kFP8E4M3
                          : dense == DenseFormat::kMXFP4 ? WeightFormat::kMXFP4
                          : dense == DenseFormat::kNVFP4 ? WeightFormat::kNVFP4
                                                         : WeightFormat::kBF16;
  const double d = c.d_model, q = double(c.n_heads) * c.head_dim, kv = double(c.n_kv_heads) * c.head_dim;
  const double attn = (d * q * 2 + d * kv * 2) * bytes_per_param(df, c.d_model);
  WeightFormat ff = WeightFormat::kBF16;
  if (c.quant.method == QuantMethod::kMxfp4) ff = WeightFormat::kMXFP4;
  if (c.quant.method == QuantMethod::kModeloptNvfp4 || c.quant.method == QuantMethod::kCompressedTensorsNvfp4)
    ff = WeightFormat::kNVFP4;
  const double mlp = c.n_experts > 0 ? c.top_k * 3.0 * c.d_expert * d * bytes_per_param(ff, c.d_model) +
                                           c.n_experts * d * 2.0  // router, BF16
                                     : 3.0 * c.d_ff * d * bytes_per_param(ff, c.d_model);
  double kv_bytes = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const bool sliding = !c.layer_sliding.empty() && c.layer_sliding[l];
    kv_bytes += 2.0 * kv * 2 * (sliding ? std::min(ctx, c.sliding_window) : ctx);
  }
  return c.n_layers * (attn + mlp) + kv_bytes + double(c.vocab_size) * d * bytes_per_param(df, c.d_model) + d * 2;
}

struct Args {
  std::vector<int> pp = {512, 2048, 8192};
  int chunk = 0;  // 0: the whole prompt in one step
  double max_seconds = 20;
  bool tg = true;
  int gemm_acts = -1;  // FP4 tensor-core activations: -1 the default, 0 hi + lo, 1 one fp16
  int depth = 0;       // decode context before tg128 (0: a one-token prompt)
  bool sync_decode = false;
  bool host_times = false;  // NIBBLE_BENCH_HOST_TIMES=1
  std::vector<DenseFormat> dense = {DenseFormat::kKeep, DenseFormat::kFP8, DenseFormat::kMXFP4, DenseFormat::kNVFP4};
  DenseFormat pp_dense = DenseFormat::kKeep;
  std::vector<std::string> dirs;
};

// The dense format named `name` (dense_format_name's spelling), or false.
bool dense_format_of(const std::string& name, DenseFormat& out) {
  for (DenseFormat f : {DenseFormat::kKeep, DenseFormat::kFP8, DenseFormat::kMXFP4, DenseFormat::kNVFP4})
    if (name == dense_format_name(f)) return out = f, true;
  return false;
}

Args parse(int argc, char** argv) {
  Args a;
  if (const char* e = std::getenv("NIBBLE_BENCH_HOST_TIMES")) {
    if (std::string(e) != "0" && std::string(e) != "1") {
      std::fprintf(stderr, "nibble_e2e_bench: error: NIBBLE_BENCH_HOST_TIMES=%s: expected 0 or 1\n", e);
      std::exit(2);
    }
    a.host_times = std::string(e) == "1";
  }
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--pp" && i + 1 < argc) {
      a.pp.clear();
      for (const char* p = argv[++i]; *p;) {  // "" (or --no-pp): no prompt processing runs
        char* end = nullptr;
        const long v = std::strtol(p, &end, 10);
        if (end == p || (*end != ',' && *end != '\0') || v < 1 || v > (1 << 20)) {
          std::fprintf(stderr, "nibble_e2e_bench: error: --pp %s: expected token counts 1..1048576, comma-separated\n",
                       argv[i]);
          std::exit(2);
        }
        a.pp.push_back(static_cast<int>(v));
        p = *end == ',' ? end + 1 : end;
      }
    } else if (s == "--no-pp") {
      a.pp.clear();
    } else if (s == "--chunk" && i + 1 < argc) {
      a.chunk = std::atoi(argv[++i]);
    } else if (s == "--max-seconds" && i + 1 < argc) {
      a.max_seconds = std::atof(argv[++i]);
    } else if (s == "--gemm-acts" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "fp16" && v != "hi-lo") {
        std::fprintf(stderr, "nibble_e2e_bench: error: --gemm-acts %s: expected fp16 or hi-lo\n", v.c_str());
        std::exit(2);
      }
      a.gemm_acts = v == "fp16" ? 1 : 0;
    } else if (s == "--dense-formats" && i + 1 < argc) {
      a.dense.clear();
      std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t e = std::min(list.find(',', p), list.size());
        const std::string name = list.substr(p, e - p);
        DenseFormat f;
        if (dense_format_of(name, f)) {
          a.dense.push_back(f);
        } else {
          std::fprintf(stderr, "nibble_e2e_bench: error: --dense-formats: unknown format '%s' (keep, fp8, mxfp4, nvfp4)\n",
                       name.c_str());
          std::exit(2);
        }
        p = e + 1;
      }
    } else if (s == "--pp-dense-format" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (!dense_format_of(v, a.pp_dense)) {
        std::fprintf(stderr, "nibble_e2e_bench: error: --pp-dense-format %s: expected keep, fp8, mxfp4 or nvfp4\n", v.c_str());
        std::exit(2);
      }
    } else if (s == "--depth" && i + 1 < argc) {
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v < 0 || v > (1 << 20)) {
        std::fprintf(stderr, "nibble_e2e_bench: error: --depth %s: expected a token count 0..1048576\n", argv[i]);
        std::exit(2);
      }
      a.depth = static_cast<int>(v);
    } else if (s == "--no-tg") {
      a.tg = false;
    } else if (s == "--sync-decode") {
      a.sync_decode = true;
    } else {
      a.dirs.push_back(s);
    }
  }
  return a;
}

// Seconds for one n-token prompt at batch 1 in chunks of `chunk` tokens (each chunk one forward step
// attending to the cached prefix), or a negative number on error.
double prefill_seconds(Model& model, KvCache& cache, const std::vector<int32_t>& table, int n, int chunk) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int past = 0; past < n;) {
    const int step = chunk > 0 ? std::min(chunk, n - past) : n;
    Batch b;
    for (int i = 0; i < step; ++i) b.tokens.push_back(1 + (past + i) * 7 % 1000);
    b.seqs.push_back({table, past, step, false});
    if (!model.forward(b, cache).ok()) return -1;
    past += step;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run_prefill(const Args& args) {
  const char* fp8 = std::getenv("NIBBLE_GEMM_FP8");  // (Model::load checks its value)
  std::printf("\nPrefill, batch 1, %s, dense format %s, default KV cache (BF16), GEMM activations %s%s\n\n",
              args.chunk > 0 ? ("chunks of " + std::to_string(args.chunk) + " tokens").c_str() : "whole prompt in one step",
              dense_format_name(args.pp_dense), args.gemm_acts < 0 ? "default" : args.gemm_acts ? "one fp16" : "hi + lo",
              fp8 && std::string(fp8) == "1" ? " (NIBBLE_GEMM_FP8=1: FP8 on the sm_90a dense FP4 GEMMs)" : "");
  std::printf("| model | prompt | steps | s (median of 3) | pp tok/s |\n|---|---|---|---|---|\n");
  for (const std::string& dir : args.dirs) {
    ModelOptions o;
    o.device = Device::kCuda;
    o.dummy_weights = true;
    o.dense_format = args.pp_dense;
    if (args.gemm_acts >= 0) o.gemm_fp16_activations = args.gemm_acts == 1;
    auto m = Model::load(dir, o);
    if (!m.ok()) {
      std::printf("| %s | load failed: %s |\n", dir.c_str(), m.status().message().c_str());
      continue;
    }
    Model& model = **m;
    const int most = *std::max_element(args.pp.begin(), args.pp.end());
    const int n_blocks = (most + 15) / 16 + 1;
    auto cache = model.new_kv_cache(n_blocks);
    std::vector<int32_t> table(n_blocks);
    for (int i = 0; i < n_blocks; ++i) table[i] = i;
    // Warm-up: lazily built tables, the activation pool.
    const int small = *std::min_element(args.pp.begin(), args.pp.end());
    if (prefill_seconds(model, *cache, table, small, args.chunk) < 0) {
      std::printf("| %s | forward failed |\n", dir.c_str());
      continue;
    }
    double rate = 0;  // tok/s of the last measured size, to project the next
    for (int n : args.pp) {
      const int steps = args.chunk > 0 ? (n + args.chunk - 1) / args.chunk : 1;
      if (rate > 0 && n / rate > args.max_seconds) {
        std::printf("| %s | pp%d | %d | skipped: ~%.0f s projected > --max-seconds | |\n", dir.c_str(), n, steps, n / rate);
        continue;
      }
      // The median of 3 prompts: one prompt is a single ~0.1 s measurement, which varied by +-10 % between
      // runs (clocks, the first use of a larger scratch).
      double runs[3];
      bool failed = false;
      for (double& r : runs) failed |= (r = prefill_seconds(model, *cache, table, n, args.chunk)) < 0;
      if (failed) {
        std::printf("| %s | pp%d | forward failed |\n", dir.c_str(), n);
        break;
      }
      std::sort(runs, runs + 3);
      const double secs = runs[1];
      rate = n / secs;
      std::printf("| %s | pp%d | %d | %.3f | %.0f |\n", dir.c_str(), n, steps, secs, rate);
      std::fflush(stdout);
    }
  }
}

void run_decode(const Args& args, double bw);

int run(int argc, char** argv) {
  const Args args = parse(argc, argv);
  std::string command = "nibble_e2e_bench";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  std::printf("command: %s\n", command.c_str());
  auto info = cuda_device_info(0);
  if (!info.ok()) {
    std::fprintf(stderr, "nibble_e2e_bench: %s\n", info.status().message().c_str());
    return 1;
  }
  const double bw = cuda::measure_read_bandwidth(size_t{2} << 30, 10);
  std::printf("GPU: %s\nmeasured read bandwidth: %.0f GB/s\n\n", describe(*info).c_str(), bw);
  if (args.tg) run_decode(args, bw);
  if (!args.pp.empty()) run_prefill(args);
  return 0;
}

void run_decode(const Args& args, double bw) {
  constexpr int kSteps = 128;
  const int prompt = std::max(1, args.depth), ctx = args.depth + kSteps / 2;  // ~the mean context of the steps
  std::printf("Decode, batch 1, one-token GEMV activations %s, %d-token prompt\n\n",
              args.gemm_acts < 0 ? "default (one fp16)" : args.gemm_acts ? "one fp16" : "hi + lo", prompt);
  std::printf("| model | dense format | ready s | GB/token (ctx %d) | tg128 tok/s | roofline tok/s | %% of roofline |\n", ctx);
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const std::string& dir : args.dirs) {
    for (DenseFormat dense : args.dense) {
      ModelOptions o;
      o.device = Device::kCuda;
      o.dummy_weights = true;
      o.dense_format = dense;
      if (args.gemm_acts >= 0) o.gemm_fp16_activations = args.gemm_acts == 1;
      const auto t0 = std::chrono::steady_clock::now();
      auto m = Model::load(dir, o);
      if (!m.ok()) {
        std::printf("| %s | %s | load failed: %s |\n", dir.c_str(), dense_format_name(dense), m.status().message().c_str());
        continue;
      }
      Model& model = **m;
      const int blocks = (prompt + kSteps + 16) / 16 + 1;
      auto cache = model.new_kv_cache(blocks);
      std::vector<int32_t> table;
      for (int i = 0; i < blocks; ++i) table.push_back(i);
      std::vector<int32_t> prompt_ids(prompt);
      for (int i = 0; i < prompt; ++i) prompt_ids[i] = 1 + i % 100;
      Batch b{prompt_ids, {{table, 0, prompt, false}}};
      auto out = model.forward(b, *cache);  // the prompt, one step
      const double ready = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!out.ok()) {
        std::printf("| %s | %s | forward failed: %s |\n", dir.c_str(), dense_format_name(dense), out.status().message().c_str());
        continue;
      }
      auto token = [&](int step) { return Batch{{static_cast<int32_t>(1 + step % 100)}, {{table, prompt + step, 1, false}}}; };
      bool ok = model.forward_sampled(token(0), *cache, {SampleSpec{}}).ok() &&  // two warm-up steps: eager, capture
                model.forward_sampled(token(1), *cache, {SampleSpec{}}).ok();
      const auto start = std::chrono::steady_clock::now();
      if (args.sync_decode) {
        for (int step = 2; ok && step < kSteps + 2; ++step) ok = model.forward_sampled(token(step), *cache, {SampleSpec{}}).ok();
      } else {
        using Clock = std::chrono::steady_clock;
        std::chrono::duration<double> t_enq{}, t_wait{};  // the host's time in enqueue / wait (host_times)
        ok = model.enqueue_sampled(token(2), *cache, {SampleSpec{}}).ok();
        for (int step = 3; ok && step < kSteps + 2; ++step) {
          Batch b2 = token(step);
          b2.tokens = {-1};  // the previous step's id, on the device
          const auto t0 = Clock::now();
          ok = model.enqueue_sampled(b2, *cache, {SampleSpec{}}).ok();
          const auto t1 = Clock::now();
          model.wait_sampled();  // the previous step's id
          t_enq += t1 - t0;
          t_wait += Clock::now() - t1;
        }
        if (ok) model.wait_sampled();
        if (args.host_times)
          std::fprintf(stderr, "%s host per step: enqueue %.1f us, wait %.1f us\n", dir.c_str(),
                       1e6 * t_enq.count() / (kSteps - 1), 1e6 * t_wait.count() / (kSteps - 1));
      }
      if (!ok) {
        std::printf("| %s | %s | decode step failed |\n", dir.c_str(), dense_format_name(dense));
        continue;
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double tps = kSteps / secs, bpt = bytes_per_token(model.config(), dense, ctx);
      const double roof = bw * 1e9 / bpt;
      std::printf("| %s | %s | %.2f | %.3f | %.1f | %.0f | %.1f%% |\n", dir.c_str(), dense_format_name(dense), ready,
                  bpt / 1e9, tps, roof, 100 * tps / roof);
      print_stream_stamps("tg last step");  // (measurement builds: the last layer's kernels, then lm_head)
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace nb

int main(int argc, char** argv) { return nb::run(argc, argv); }
