// End-to-end decode benchmark: a model built from configs/<name>/config.json with --dummy-weights on the
// GPU, at each --dense-format; tg128 at batch 1 (one prompt token, then 128 decode steps through
// Model::forward_sampled, greedy ids sampled on the GPU and copied to the host, as the engine does). Prints ready time, tok/s,
// the variant's bytes per token and % of the roofline (measured read bandwidth / bytes per token).
// Usage: nibble_e2e_bench CONFIG_DIR... (e.g. configs/gpt-oss-20b configs/gpt-oss-120b)
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/device.h"
#include "kernels/bandwidth.cuh"
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

int run(int argc, char** argv) {
  auto info = cuda_device_info(0);
  if (!info.ok()) {
    std::fprintf(stderr, "nibble_e2e_bench: %s\n", info.status().message().c_str());
    return 1;
  }
  const double bw = cuda::measure_read_bandwidth(size_t{2} << 30, 10);
  std::printf("GPU: %s\nmeasured read bandwidth: %.0f GB/s\n\n", describe(*info).c_str(), bw);
  std::printf("| model | dense format | ready s | GB/token (ctx 64) | tg128 tok/s | roofline tok/s | %% of roofline |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  constexpr int kSteps = 128;
  for (int a = 1; a < argc; ++a) {
    const std::string dir = argv[a];
    for (DenseFormat dense : {DenseFormat::kKeep, DenseFormat::kFP8, DenseFormat::kMXFP4, DenseFormat::kNVFP4}) {
      ModelOptions o;
      o.device = Device::kCuda;
      o.dummy_weights = true;
      o.dense_format = dense;
      const auto t0 = std::chrono::steady_clock::now();
      auto m = Model::load(dir, o);
      if (!m.ok()) {
        std::printf("| %s | %s | load failed: %s |\n", dir.c_str(), dense_format_name(dense), m.status().message().c_str());
        continue;
      }
      Model& model = **m;
      auto cache = model.new_kv_cache((kSteps + 16) / 16 + 1);
      std::vector<int32_t> table;
      for (int i = 0; i < (kSteps + 16) / 16 + 1; ++i) table.push_back(i);
      Batch b{{1}, {{table, 0, 1, false}}};
      auto out = model.forward(b, *cache);  // prompt: one token
      const double ready = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!out.ok()) {
        std::printf("| %s | %s | forward failed: %s |\n", dir.c_str(), dense_format_name(dense), out.status().message().c_str());
        continue;
      }
      std::chrono::steady_clock::time_point start;
      for (int step = 0; step < kSteps + 2; ++step) {
        if (step == 2) start = std::chrono::steady_clock::now();  // two warm-up steps: eager, capture
        b = Batch{{static_cast<int32_t>(1 + step % 100)}, {{table, step + 1, 1, false}}};
        if (!model.forward_sampled(b, *cache, {SampleSpec{}}).ok()) break;  // greedy on the GPU, as the engine
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double tps = kSteps / secs, bpt = bytes_per_token(model.config(), dense, 64);
      const double roof = bw * 1e9 / bpt;
      std::printf("| %s | %s | %.2f | %.3f | %.1f | %.0f | %.1f%% |\n", dir.c_str(), dense_format_name(dense), ready,
                  bpt / 1e9, tps, roof, 100 * tps / roof);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace nb

int main(int argc, char** argv) { return nb::run(argc, argv); }
