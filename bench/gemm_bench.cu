// Prefill GEMM benchmark: every GEMM shape of gpt-oss-20b / gpt-oss-120b (QKV, O, expert FC1 and FC2 as
// dense FP4 GEMMs; the MoE layer as grouped GEMMs over 32 / 128 experts, top-4 random routes) at M = 512,
// 2048, 8192 tokens, through the CudaBackend ops the model calls (activation conversion included), in
// both activation modes (hi + lo, one fp16), each against cuBLASLt BF16 (bf16 in, fp32 accumulate, bf16
// out) on the same shape in the same run. Then the crossover against the GEMV path at small M (which
// sets the thresholds in cuda_backend.cu). Each timing replays a CUDA graph of several calls.
// Usage: nibble_gemm_bench [--quick | --m M[,M...]]   (--quick: M = 2048 only; --m: those token counts)
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "graph_time.h"  // (bench/)
#include "kernels/gemm_fp4.cuh"

namespace nb {
namespace {

#define LT_CHECK(x) NB_CHECK((x) == CUBLAS_STATUS_SUCCESS, std::string("cuBLASLt: ") + #x)

// Average microseconds of one body(i) over `calls` calls captured in a graph (best of 3 replays).
template <class F>
double time_us(cudaStream_t s, int calls, F&& body) {
  return graph_time_us(s, calls, 3, body);
}

// The portable path's own ceiling: mma.sync m16n8k16 (fp16 in, fp32 accumulate, the instruction every
// portable tile issues) with nothing else in the loop -- 8 independent accumulator chains per warp, operands
// in registers, 8 warps per block, 4 blocks per SM. FLOP/s of the tensor pipe through the sm_80 path; on
// Hopper cuBLASLt's BF16 kernels use wgmma, which this instruction does not reach.
__global__ void __launch_bounds__(256) mma_peak_kernel(int iters, float* out) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u ^ (threadIdx.x << i);  // fp16 pairs near 1 (no overflow)
  b[0] = 0x3c003c00u, b[1] = 0x38003800u;
  float c[8][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};"
          : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  float sum = 0.0f;
  for (int j = 0; j < 8; ++j) sum += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (sum == 1234.5f) out[threadIdx.x] = sum;  // (keeps the loop; never true)
}

// blocks_per_sm 4: 8 warps per scheduler; 1: 2 per scheduler, as the warp-specialized portable tile's
// multipliers (gemm_fp4_wsp.cuh).
double mma_peak_tflops(cudaStream_t s, int sms, int blocks_per_sm) {
  float* out = nullptr;
  CUDA_CHECK(cudaMalloc(&out, 256 * sizeof(float)));
  const int blocks = blocks_per_sm * sms, iters = 4096;
  mma_peak_kernel<<<blocks, 256, 0, s>>>(16, out);  // warm
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int r = 0; r < 3; ++r) {
    CUDA_CHECK(cudaEventRecord(e0, s));
    mma_peak_kernel<<<blocks, 256, 0, s>>>(iters, out);
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  CUDA_CHECK(cudaFree(out));
  const double flops = 2.0 * 16 * 8 * 16 * 8.0 * iters * 8 * blocks;  // per HMMA x chains x iters x warps
  return flops / (best * 1e-3) * 1e-12;
}

int calls_for(double flops) { return flops > 2e11 ? 4 : flops > 2e10 ? 16 : 64; }

// cuBLASLt BF16 GEMM D[m, n] = A[m, k] B[n, k]^T (row-major), the heuristic's first algorithm.
class LtBf16 {
 public:
  explicit LtBf16(cudaStream_t s) : s_(s) {
    LT_CHECK(cublasLtCreate(&h_));
    CUDA_CHECK(cudaMalloc(&ws_, kWs));
  }
  ~LtBf16() {
    cudaFree(ws_);
    cudaFree(buf_);
    cublasLtDestroy(h_);
  }
  double time(int64_t m, int64_t n, int64_t k) {
    const size_t need = 2 * (m * k + n * k + m * n);
    if (need > cap_) {
      cudaFree(buf_);
      CUDA_CHECK(cudaMalloc(&buf_, need));
      CUDA_CHECK(cudaMemset(buf_, 0x3c, need));  // bf16 0x3c3c = 0.0115: finite, no denormals
      cap_ = need;
    }
    uint8_t* a = static_cast<uint8_t*>(buf_);
    uint8_t* b = a + 2 * m * k;
    uint8_t* d = b + 2 * n * k;
    // Column-major view: D^T [n, m] = B [n, k] (op T of a k x n matrix) x A^T [k, m].
    cublasLtMatmulDesc_t op;
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
    cublasLtMatrixLayout_t la, lb, ld;
    LT_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWs, sizeof(kWs)));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(h_, op, la, lb, ld, ld, pref, 1, &res, &found));
    NB_CHECK(found == 1, "cuBLASLt: no algorithm");
    const float alpha = 1.0f, beta = 0.0f;
    const double us = time_us(s_, calls_for(2.0 * m * n * k), [&](int) {
      LT_CHECK(cublasLtMatmul(h_, op, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &res.algo, ws_, kWs, s_));
    });
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    return us;
  }

 private:
  static constexpr size_t kWs = size_t{64} << 20;
  cudaStream_t s_;
  cublasLtHandle_t h_ = nullptr;
  void* ws_ = nullptr;
  void* buf_ = nullptr;
  size_t cap_ = 0;
};

std::unique_ptr<CudaBackend> backend(int min_tokens, bool fp16, bool fp8 = false) {
  CudaBackendOptions o;
  o.gemm_min_tokens = o.moe_gemm_min_tokens = min_tokens;
  o.gemm_fp16_activations = fp16;
  o.gemm_fp8_activations = fp8;
  if (const char* e = std::getenv("NIBBLE_GEMM_WS")) o.gemm_ws = std::string(e) == "0" ? 0 : 1;  // A/B runs
  auto be = CudaBackend::create(o);
  NB_CHECK(be.ok(), be.status().message());
  return std::move(be.value());
}

Routes random_routes(CudaBackend& g, int64_t T, int E, int top_k, uint64_t seed) {
  std::mt19937 r(static_cast<unsigned>(seed));
  std::vector<int32_t> ids(T * top_k), pool(E);
  std::vector<float> w(T * top_k, 1.0f / top_k);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) pool[e] = e;
    for (int i = 0; i < top_k; ++i) {
      std::swap(pool[i], pool[i + r() % (E - i)]);
      ids[t * top_k + i] = pool[i];
    }
  }
  Routes out{g.alloc(DType::kI32, {T, top_k}), g.upload(TensorView{w.data(), DType::kF32, {T, top_k}})};
  CUDA_CHECK(cudaDeviceSynchronize());  // the allocation's poison / upload run on the backend's own stream
  CUDA_CHECK(cudaMemcpy(out.ids.data<int32_t>(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  return out;
}

constexpr int64_t kD = 2880, kQDim = 64 * 64, kKvDim = 8 * 64, kFf = 2880;
constexpr int kTopK = 4;

int run(const std::vector<int64_t>& ms) {
  auto split = backend(1, false), fp16 = backend(1, true), gemv = backend(1 << 30, false);
  cudaStream_t s = static_cast<cudaStream_t>(split->stream());
  LtBf16 lt(s);
  auto info = cuda_device_info(0);
  std::printf("GPU: %s\n\n", describe(*info).c_str());

  // The tensor-pipe ceilings the ratios below are read against (bench/NOTES.md: the portable tiles issue
  // mma.sync; the sm_90a tiles and cuBLASLt issue wgmma).
  {
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const double peak = mma_peak_tflops(s, sms, 4), peak2 = mma_peak_tflops(s, sms, 1);
    const int64_t big = 8192;
    const double lt_big = 2.0 * big * big * big / (lt.time(big, big, big) * 1e-6) * 1e-12;
    std::printf("## Tensor-pipe ceilings\n\n| measure | TFLOP/s |\n|---|---|\n");
    std::printf("| mma.sync m16n8k16 fp16 -> fp32, operands in registers (the portable tiles' instruction) | %.0f |\n", peak);
    std::printf("| the same with 2 warps per scheduler (the warp-specialized portable tile's multipliers) | %.0f |\n", peak2);
    std::printf("| cuBLASLt BF16 [8192, 8192, 8192] | %.0f |\n\n", lt_big);
    std::printf("The portable mma.sync tiles cannot exceed %.0f %% of cuBLASLt BF16 at 8192^3 on this GPU.\n\n",
                100.0 * peak / lt_big);
  }

  std::printf("## Dense FP4 GEMM (gpt-oss-20b and -120b share these shapes)\n\n");
  std::printf("| projection | format | [n, k] | M | hi+lo us | TFLOP/s | fp16 us | TFLOP/s | cuBLASLt BF16 us | TFLOP/s | "
              "hi+lo / BF16 | fp16 / BF16 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Proj {
    const char* name;
    int64_t n, k;
  };
  const Proj projs[] = {{"qkv", kQDim + 2 * kKvDim, kD}, {"o", kD, kQDim}, {"expert fc1", 2 * kFf, kD}, {"expert fc2", kD, kFf}};
  uint64_t seed = 1;
  for (WeightFormat f : {WeightFormat::kMXFP4, WeightFormat::kNVFP4}) {
    for (const Proj& p : projs) {
      const Weight w = split->random_weight(f, p.n, p.k, 0.02f, seed++, p.name);
      for (int64_t m : ms) {
        const double flops = 2.0 * m * p.n * p.k;
        Tensor x = split->random_floats({m, p.k}, 0.0f, 1.0f, seed++);
        Tensor x16 = fp16->random_floats({m, p.k}, 0.0f, 1.0f, seed++);
        const double a = time_us(s, calls_for(flops), [&](int) { split->linear(x, w, nullptr); });
        const double b = time_us(static_cast<cudaStream_t>(fp16->stream()), calls_for(flops), [&](int) { fp16->linear(x16, w, nullptr); });
        const double c = lt.time(m, p.n, p.k);
        std::printf("| %s | %s | %s | %lld | %.1f | %.0f | %.1f | %.0f | %.1f | %.0f | %.0f%% | %.0f%% |\n", p.name,
                    weight_format_name(f), shape_string({p.n, p.k}).c_str(), static_cast<long long>(m), a,
                    flops / a * 1e-6, b, flops / b * 1e-6, c, flops / c * 1e-6, 100 * c / a, 100 * c / b);
        std::fflush(stdout);
      }
    }
  }

  // The W4A8 tile (CudaBackendOptions::gemm_fp8_activations: E4M3 activations on the FP8 tensor cores; opt-in,
  // sm_90a only), its E4M3 conversion included, against the same cuBLASLt BF16 GEMM.
  if (cuda::gemm_fp8_supported()) {
    auto fp8 = backend(1, true, true);
    cudaStream_t s8 = static_cast<cudaStream_t>(fp8->stream());
    std::printf("\n## Dense FP4 GEMM with FP8 activations (sm_90a W4A8 tile, opt-in: NIBBLE_GEMM_FP8=1)\n\n");
    std::printf("| projection | format | [n, k] | M | fp8 us | TFLOP/s | cuBLASLt BF16 us | TFLOP/s | fp8 / BF16 |\n"
                "|---|---|---|---|---|---|---|---|---|\n");
    for (WeightFormat f : {WeightFormat::kMXFP4, WeightFormat::kNVFP4}) {
      for (const Proj& p : projs) {
        const Weight w = fp8->random_weight(f, p.n, p.k, 0.02f, seed++, p.name);
        for (int64_t m : ms) {
          const double flops = 2.0 * m * p.n * p.k;
          Tensor x8 = fp8->random_floats({m, p.k}, 0.0f, 1.0f, seed++);
          const double a = time_us(s8, calls_for(flops), [&](int) { fp8->linear(x8, w, nullptr); });
          const double c = lt.time(m, p.n, p.k);
          std::printf("| %s | %s | %s | %lld | %.1f | %.0f | %.1f | %.0f | %.0f%% |\n", p.name, weight_format_name(f),
                      shape_string({p.n, p.k}).c_str(), static_cast<long long>(m), a, flops / a * 1e-6, c,
                      flops / c * 1e-6, 100 * c / a);
          std::fflush(stdout);
        }
      }
    }
  }

  std::printf("\n## MoE layer as grouped GEMMs (MXFP4, top-4 random routes; FC1 + GLU, FC2, combine, with the "
              "grouping and conversions)\n\nBF16 reference: cuBLASLt FC1 [M*4, 5760, 2880] + FC2 [M*4, 2880, 2880] "
              "as two dense GEMMs (no grouping: an upper bound).\n\n");
  std::printf("| model | experts | M tokens | hi+lo us | TFLOP/s | fp16 us | TFLOP/s | cuBLASLt BF16 us | TFLOP/s | "
              "hi+lo / BF16 | fp16 / BF16 |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Model {
    const char* name;
    int n_experts;
  };
  std::vector<std::pair<Model, MoeExperts>> layers;
  for (const Model md : {Model{"gpt-oss-20b", 32}, Model{"gpt-oss-120b", 128}}) {
    MoeExperts ex;
    ex.n_experts = md.n_experts;
    ex.d_expert = static_cast<int>(kFf);
    ex.layout = GluLayout::kInterleaved;
    for (int e = 0; e < md.n_experts; ++e) {
      ex.fc1.push_back(split->random_weight(WeightFormat::kMXFP4, 2 * kFf, kD, 0.02f, seed++, "fc1"));
      ex.fc2.push_back(split->random_weight(WeightFormat::kMXFP4, kD, kFf, 0.02f, seed++, "fc2"));
    }
    const GluParams glu{Activation::kGptOssClamped, 7.0f};
    for (int64_t m : ms) {
      const double flops = 2.0 * m * kTopK * (2 * kFf * kD + kD * kFf);
      Tensor x = split->random_floats({m, kD}, 0.0f, 1.0f, seed++);
      const Routes r = random_routes(*split, m, md.n_experts, kTopK, seed++);
      const double a = time_us(s, calls_for(flops), [&](int) { split->moe_experts(x, r, ex, glu); });
      Tensor x16 = fp16->random_floats({m, kD}, 0.0f, 1.0f, seed++);
      const Routes r16 = random_routes(*fp16, m, md.n_experts, kTopK, seed++);
      const double b = time_us(static_cast<cudaStream_t>(fp16->stream()), calls_for(flops),
                               [&](int) { fp16->moe_experts(x16, r16, ex, glu); });
      const double c = lt.time(m * kTopK, 2 * kFf, kD) + lt.time(m * kTopK, kD, kFf);
      std::printf("| %s | %d | %lld | %.1f | %.0f | %.1f | %.0f | %.1f | %.0f | %.0f%% | %.0f%% |\n", md.name,
                  md.n_experts, static_cast<long long>(m), a, flops / a * 1e-6, b, flops / b * 1e-6, c,
                  flops / c * 1e-6, 100 * c / a, 100 * c / b);
      std::fflush(stdout);
    }
    layers.emplace_back(md, std::move(ex));
  }

  // The same MoE layers on the FP8 tiles (gemm_fp8_activations, sm_90a, opt-in).
  if (cuda::gemm_fp8_supported()) {
    auto fp8 = backend(1, true, true);
    cudaStream_t s8 = static_cast<cudaStream_t>(fp8->stream());
    std::printf("\n## MoE layer with FP8 activations (sm_90a W4A8 tiles, opt-in: NIBBLE_GEMM_FP8=1)\n\n");
    std::printf("| model | experts | M tokens | fp8 us | TFLOP/s | cuBLASLt BF16 us | TFLOP/s | fp8 / BF16 |\n"
                "|---|---|---|---|---|---|---|---|\n");
    const GluParams glu{Activation::kGptOssClamped, 7.0f};
    for (const auto& [md, ex] : layers) {
      for (int64_t m : ms) {
        const double flops = 2.0 * m * kTopK * (2 * kFf * kD + kD * kFf);
        Tensor x8 = fp8->random_floats({m, kD}, 0.0f, 1.0f, seed++);
        const Routes r8 = random_routes(*fp8, m, md.n_experts, kTopK, seed++);
        const double a = time_us(s8, calls_for(flops), [&](int) { fp8->moe_experts(x8, r8, ex, glu); });
        const double c = lt.time(m * kTopK, 2 * kFf, kD) + lt.time(m * kTopK, kD, kFf);
        std::printf("| %s | %d | %lld | %.1f | %.0f | %.1f | %.0f | %.0f%% |\n", md.name, md.n_experts,
                    static_cast<long long>(m), a, flops / a * 1e-6, c, flops / c * 1e-6, 100 * c / a);
        std::fflush(stdout);
      }
    }
  }

  std::printf("\n## Crossover: GEMV path (token chunks of 4 / per-pair experts) vs the GEMMs (hi+lo), small M\n\n");
  std::printf("| op | M | GEMV path us | GEMM us | GEMM speedup |\n|---|---|---|---|---|\n");
  const Weight qkv = split->random_weight(WeightFormat::kMXFP4, kQDim + 2 * kKvDim, kD, 0.02f, seed++, "qkv");
  const Weight qkv_nv = split->random_weight(WeightFormat::kNVFP4, kQDim + 2 * kKvDim, kD, 0.02f, seed++, "qkv");
  cudaStream_t sg = static_cast<cudaStream_t>(gemv->stream());
  for (int64_t m : {8, 16, 32, 64, 128, 256}) {
    for (const Weight* w : {&qkv, &qkv_nv}) {
      Tensor x = split->random_floats({m, kD}, 0.0f, 1.0f, seed++);
      Tensor xg = gemv->random_floats({m, kD}, 0.0f, 1.0f, seed++);
      const double a = time_us(sg, 16, [&](int) { gemv->linear(xg, *w, nullptr); });
      const double b = time_us(s, 16, [&](int) { split->linear(x, *w, nullptr); });
      std::printf("| qkv %s | %lld | %.1f | %.1f | %.2fx |\n", weight_format_name(w->format), static_cast<long long>(m), a,
                  b, a / b);
    }
    const MoeExperts& ex = layers[0].second;
    const GluParams glu{Activation::kGptOssClamped, 7.0f};
    Tensor x = split->random_floats({m, kD}, 0.0f, 1.0f, seed++);
    Tensor xg = gemv->random_floats({m, kD}, 0.0f, 1.0f, seed++);
    const Routes r = random_routes(*split, m, 32, kTopK, seed);
    const Routes rg = random_routes(*gemv, m, 32, kTopK, seed++);
    const double a = time_us(sg, 8, [&](int) { gemv->moe_experts(xg, rg, ex, glu); });
    const double b = time_us(s, 8, [&](int) { split->moe_experts(x, r, ex, glu); });
    std::printf("| moe gpt-oss-20b | %lld | %.1f | %.1f | %.2fx |\n", static_cast<long long>(m), a, b, a / b);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace nb

int main(int argc, char** argv) {
  std::vector<int64_t> ms{512, 2048, 8192};
  const std::string a1 = argc > 1 ? argv[1] : "";
  if (a1 == "--quick" && argc == 2) {
    ms = {2048};
  } else if (a1 == "--m" && argc == 3) {
    ms.clear();
    for (const char* p = argv[2];; ) {
      char* end = nullptr;
      const long v = std::strtol(p, &end, 10);
      if (end == p || v < 1 || v > (1 << 20) || (*end != ',' && *end != '\0')) {
        std::fprintf(stderr, "nibble_gemm_bench: --m %s: expected token counts like 128,256\n", argv[2]);
        return 2;
      }
      ms.push_back(v);
      if (*end == '\0') break;
      p = end + 1;
    }
  } else if (argc > 1) {
    std::fprintf(stderr, "nibble_gemm_bench: arguments '%s%s': expected none, --quick or --m M[,M...]\n", a1.c_str(),
                 argc > 2 ? " ..." : "");
    return 2;
  }
  return nb::run(ms);
}
