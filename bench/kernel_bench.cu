// Kernel benchmark: every decode projection of gpt-oss-20b and gpt-oss-120b at batch 1 (QKV, O, router,
// expert FC1 and FC2 for 4 selected experts with their biases, lm_head) in every weight format, through the CudaBackend
// ops the model uses. Prints time, achieved GB/s and % of the read bandwidth measured in the same run.
// Each timing replays a CUDA graph of many calls (no host overhead in the number) and rotates over
// enough weight copies / expert sets that the working set exceeds the L2 cache three times.
// Usage: nibble_kernel_bench [--quick]
//   NIBBLE_BENCH_FILTER=text runs only the rows whose "model projection format" contains it (for profilers).
//   NIBBLE_GEMM_ACTIVATIONS=hi-lo measures the FP4 rows with hi + lo activations (default: one fp16).
//   NIBBLE_BENCH_WARM=1 uses one weight copy / one expert set: weights that fit stay in L2 between calls,
//     the bound for weights prefetched into L2 ahead of the kernel (a measurement, not the decode case).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "kernels/bandwidth.cuh"
#include "graph_time.h"  // (bench/)
#include "stamps.h"      // (bench/)

namespace nb {
namespace {

constexpr int kCalls = 64;  // per graph
constexpr int kTopK = 4;

struct Timer {
  cudaStream_t s;
  // Average microseconds of one call of `body(i)` over kCalls calls captured in a graph (best of 5 replays).
  template <class F>
  double time(F&& body) {
    return graph_time_us(s, kCalls, 5, body);
  }
};

const WeightFormat kFormats[] = {WeightFormat::kBF16, WeightFormat::kFP8E4M3, WeightFormat::kMXFP4,
                                 WeightFormat::kNVFP4};

void row(const char* model, const char* proj, WeightFormat f, const std::string& shape, double bytes, double us,
         double bw) {
  const double gbs = bytes / (us * 1e-6) / 1e9;
  std::printf("| %s | %s | %s | %s | %.2f | %.2f | %.0f | %.1f%% |\n", model, proj, weight_format_name(f),
              shape.c_str(), bytes / 1e6, us, gbs, 100 * gbs / bw);
  std::fflush(stdout);
}

// Whether a row's "model projection format" matches NIBBLE_BENCH_FILTER (unset: every row).
bool wanted(const char* model, const char* proj, WeightFormat f) {
  static const char* filter = std::getenv("NIBBLE_BENCH_FILTER");
  if (!filter) return true;
  const std::string key = std::string(model) + " " + proj + " " + weight_format_name(f);
  return key.find(filter) != std::string::npos;
}

int run(bool quick) {
  CudaBackendOptions o;  // NIBBLE_GEMM_ACTIVATIONS=hi-lo: the one-token FP4 kernels with hi + lo activations
  const char* acts = std::getenv("NIBBLE_GEMM_ACTIVATIONS");
  if (acts && std::string(acts) != "fp16" && std::string(acts) != "hi-lo") {
    std::fprintf(stderr, "nibble_kernel_bench: error: NIBBLE_GEMM_ACTIVATIONS=%s: expected fp16 or hi-lo\n", acts);
    return 2;
  }
  o.gemm_fp16_activations = !(acts && std::string(acts) == "hi-lo");
  const char* warm_env = std::getenv("NIBBLE_BENCH_WARM");
  if (warm_env && std::string(warm_env) != "0" && std::string(warm_env) != "1") {
    std::fprintf(stderr, "nibble_kernel_bench: error: NIBBLE_BENCH_WARM=%s: expected 0 or 1\n", warm_env);
    return 2;
  }
  const bool warm = warm_env && std::string(warm_env) == "1";
  auto be = CudaBackend::create(o);
  if (!be.ok()) {
    std::fprintf(stderr, "nibble_kernel_bench: %s\n", be.status().message().c_str());
    return 1;
  }
  CudaBackend& gpu = **be;
  auto info = cuda_device_info(0);
  const double bw = cuda::measure_read_bandwidth(size_t{2} << 30, 10);
  std::printf("GPU: %s\nmeasured read bandwidth (2 GiB read-only reduction, best of 10): %.0f GB/s\n\n",
              describe(*info).c_str(), bw);
  std::printf("| model | projection | format | shape [n, k] | MB read | us | GB/s | %% of read BW |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  Timer timer{static_cast<cudaStream_t>(gpu.stream())};
  const int64_t l2 = info->l2_bytes;
  const int64_t d = 2880, q_dim = 64 * 64, kv_dim = 8 * 64, vocab = 201088, d_ff = 2880;
  struct Model {
    const char* name;
    int n_experts;
  };
  uint64_t seed = 1;
  for (const Model m : {Model{"gpt-oss-20b", 32}, Model{"gpt-oss-120b", 128}}) {
    for (WeightFormat f : kFormats) {
      struct Proj {
        const char* name;
        int64_t n, k;
      };
      const Proj projs[] = {{"qkv", q_dim + 2 * kv_dim, d}, {"o", d, q_dim}, {"router", m.n_experts, d},
                            {"lm_head", vocab, d}};
      for (const Proj& p : projs) {
        if (quick && std::strcmp(m.name, "gpt-oss-120b") == 0 && std::strcmp(p.name, "router") != 0) continue;
        if (!wanted(m.name, p.name, f)) continue;
        std::vector<Weight> copies;
        const Weight first = gpu.random_weight(f, p.n, p.k, 0.02f, seed++, p.name);
        const int64_t bytes = first.bytes();
        const int n_copies =
            warm ? 1 : static_cast<int>(std::min<int64_t>(64, std::max<int64_t>(1, 3 * l2 / bytes + 1)));
        copies.push_back(first);
        for (int c = 1; c < n_copies; ++c) copies.push_back(gpu.random_weight(f, p.n, p.k, 0.02f, seed++, p.name));
        const std::vector<float> xh(p.k, 0.5f);
        Tensor x = gpu.upload(TensorView{xh.data(), DType::kF32, {1, p.k}});
        const double us = timer.time([&](int i) { gpu.linear(x, copies[i % n_copies], nullptr); });
        row(m.name, p.name, f, shape_string({p.n, p.k}), static_cast<double>(bytes), us, bw);
      }
      if (quick && std::strcmp(m.name, "gpt-oss-120b") == 0) continue;
      if (!wanted(m.name, "expert fc1 x4 (+SwiGLU)", f) && !wanted(m.name, "expert fc2 x4 (+combine)", f)) continue;
      // Experts: all n_experts allocated, 4 selected per call, the selection rotating over the experts.
      MoeExperts ex;
      ex.n_experts = m.n_experts;
      ex.d_expert = static_cast<int>(d_ff);
      ex.layout = GluLayout::kInterleaved;
      for (int e = 0; e < m.n_experts; ++e) {
        ex.fc1.push_back(gpu.random_weight(f, 2 * d_ff, d, 0.02f, seed++, "fc1"));
        ex.fc2.push_back(gpu.random_weight(f, d, d_ff, 0.02f, seed++, "fc2"));
      }
      // Biases, as gpt-oss has (their loads are part of each unit's epilogue).
      const std::vector<float> bias1(static_cast<size_t>(m.n_experts) * 2 * d_ff, 0.01f), bias2(static_cast<size_t>(m.n_experts) * d, 0.01f);
      ex.fc1_bias = gpu.upload(TensorView{bias1.data(), DType::kF32, {m.n_experts, 2 * d_ff}});
      ex.fc2_bias = gpu.upload(TensorView{bias2.data(), DType::kF32, {m.n_experts, d}});
      const int n_sets = warm ? 1 : m.n_experts / kTopK;
      std::vector<Routes> routes;
      for (int s = 0; s < n_sets; ++s) {
        std::vector<float> ids_f(kTopK);
        std::vector<int32_t> ids(kTopK);
        for (int i = 0; i < kTopK; ++i) ids[i] = s * kTopK + i;
        const std::vector<float> w(kTopK, 0.25f);
        Routes r{gpu.alloc(DType::kI32, {1, kTopK}), gpu.upload(TensorView{w.data(), DType::kF32, {1, kTopK}})};
        CUDA_CHECK(cudaMemcpy(r.ids.data<int32_t>(), ids.data(), sizeof(int32_t) * kTopK, cudaMemcpyHostToDevice));
        routes.push_back(std::move(r));
      }
      const std::vector<float> xh(d, 0.5f), ah(kTopK * d_ff, 0.5f);
      Tensor x = gpu.upload(TensorView{xh.data(), DType::kF32, {1, d}});
      Tensor act = gpu.upload(TensorView{ah.data(), DType::kF32, {kTopK, d_ff}});
      const GluParams glu{Activation::kGptOssClamped, 7.0f};
      const double b1 = static_cast<double>(kTopK * ex.fc1[0].bytes()), b2 = static_cast<double>(kTopK * ex.fc2[0].bytes());
      const double us1 = timer.time([&](int i) { gpu.moe_fc1(x, routes[i % n_sets], ex, glu); });
      row(m.name, "expert fc1 x4 (+SwiGLU)", f, "4 x " + shape_string({2 * d_ff, d}), b1, us1, bw);
      const double us2 = timer.time([&](int i) { gpu.moe_fc2(act, routes[i % n_sets], ex); });
      row(m.name, "expert fc2 x4 (+combine)", f, "4 x " + shape_string({d, d_ff}), b2, us2, bw);
      // FC2 on an act FC1 staged for it (the one-token FP4 kernels, gpt-oss's bounded GLU: the decode path).
      if (f == WeightFormat::kMXFP4 || f == WeightFormat::kNVFP4) {
        const Tensor staged = gpu.moe_fc1(x, routes[0], ex, glu);
        const double us3 = timer.time([&](int i) { gpu.moe_fc2(staged, routes[i % n_sets], ex); });
        row(m.name, "expert fc2 x4 (+combine, act staged by fc1)", f, "4 x " + shape_string({d, d_ff}), b2, us3, bw);
      }
      if (cuda::stream_stamps(true, nullptr)) {  // measurement builds: one FC1 then FC2 (after the timings)
        gpu.moe_fc1(x, routes[0], ex, glu);
        gpu.moe_fc2(act, routes[0], ex);
        if (gpu.synchronize().ok()) print_stream_stamps((std::string(m.name) + " " + weight_format_name(f)).c_str());
      }
    }
  }
  return gpu.synchronize().ok() ? 0 : 1;
}

}  // namespace
}  // namespace nb

int main(int argc, char** argv) { return nb::run(argc > 1 && std::strcmp(argv[1], "--quick") == 0); }
