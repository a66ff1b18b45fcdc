// The prefill tensor-core GEMMs (kernels/gemm_fp4.cu, moe_gemm.cu) against the CPU reference backend,
// through CudaBackend with the GEMM thresholds forced to 1 token, in both activation modes, on fresh
// random inputs (seed printed) with every GPU buffer poisoned. Weights are decoded exactly on both sides
// (gemm_fp4_tile.cuh), so the error is the activations' fp16 rounding, relative eps = 2^-11 per element
// (one fp16) or 2^-22 (hi + lo), plus fp32 summation: |gpu - cpu| <= (eps + k 2^-23) sum_j |w_ij x_j|.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "kernels/gemm_fp4.cuh"
#include "support/random_inputs.h"

namespace nb {
namespace {

using test::HostBytes;
using test::randn;
using test::rng;

// A random FP4 (or BF16) weight [n, k] in `parts` row parts. NVFP4 parts get their own global scale and alternate
// conventions (multiply, divide). extreme: MXFP4 block exponents spread over the range the GEMM folds
// exactly into fp16 (2^-23 .. 2^13, gemm_fp4_tile.cuh).
Weight make_fp4(HostBytes& hb, WeightFormat format, int64_t n, int64_t k, int parts, bool extreme = false) {
  Weight w;
  w.format = format;
  w.n = n;
  w.k = k;
  for (int pi = 0; pi < parts; ++pi) {
    WeightPart p;
    p.rows = n / parts + (pi == parts - 1 ? n % parts : 0);
    const int64_t rows = p.rows;
    const std::vector<float> x = randn(rows * k, 0.05f);
    if (format == WeightFormat::kBF16) {  // (MoE experts kept in BF16: the grouped cuBLASLt path)
      std::vector<uint8_t> b(rows * k * 2);
      for (int64_t i = 0; i < rows * k; ++i) {
        const uint16_t h = fmt::float_to_bf16(x[i]);
        std::memcpy(&b[i * 2], &h, 2);
      }
      p.data = hb.add(std::move(b), DType::kBF16, {rows, k});
    } else if (format == WeightFormat::kMXFP4) {
      std::vector<uint8_t> codes(rows * k / 2), scales(rows * k / 32);
      for (int64_t b = 0; b < rows * k / 32; ++b) {
        scales[b] = fmt::mxfp4_encode_block(&x[b * 32], &codes[b * 16]);
        if (extreme) scales[b] = static_cast<uint8_t>(127 - 23 + (b * 7) % 37);  // 2^-23 .. 2^13
      }
      p.data = hb.add(std::move(codes), DType::kU8, {rows, k / 2});
      p.scales = hb.add(std::move(scales), DType::kU8, {rows, k / 32});
    } else {
      std::vector<uint8_t> codes(rows * k / 2), scales(rows * k / 16);
      const float s2 = fmt::nvfp4_global_scale(0.25f * (pi + 1));
      for (int64_t b = 0; b < rows * k / 16; ++b) scales[b] = fmt::nvfp4_encode_block(&x[b * 16], s2, &codes[b * 8]);
      p.data = hb.add(std::move(codes), DType::kU8, {rows, k / 2});
      p.scales = hb.add(std::move(scales), DType::kF8_E4M3, {rows, k / 16});
      p.convention = pi % 2 ? fmt::GlobalScale::kDivide : fmt::GlobalScale::kMultiply;
      p.global_scale = pi % 2 ? 1.0f / s2 : s2;
    }
    p.name = "w" + std::to_string(pi);
    w.parts.push_back(std::move(p));
  }
  return w;
}

class PrefillGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int mode = 0; mode < 2; ++mode) {
      CudaBackendOptions o;
      o.poison = true;
      o.kv_cache_dtype = DType::kF32;
      o.gemm_min_tokens = 1;
      o.moe_gemm_min_tokens = 1;
      o.gemm_fp16_activations = mode == 1;
      // One-fp16 dense GEMMs of >= 256 tokens take the warp-specialized sm_90a tile wherever it exists;
      // NIBBLE_GEMM_WS=0 (the ctest entry gemm_cuda_test_wgmma_tile) keeps them on the wgmma tile, =auto
      // (gemm_cuda_test_auto_tiles) lets the backend's default policy choose (on sm_90a, small grids of
      // 256-511 tokens then take the portable warp-specialized tile).
      const char* ws = std::getenv("NIBBLE_GEMM_WS");
      const std::string wss = ws ? ws : "";
      o.gemm_ws = ws_policy_ = wss == "0" ? 0 : wss == "auto" ? -1 : 1;
      auto g = CudaBackend::create(o);
      if (!g.ok()) GTEST_SKIP() << g.status().message();
      gpu_[mode] = std::move(g.value());
    }
  }
  // Relative activation rounding of mode 0 (hi + lo) and mode 1 (one fp16).
  static double eps(int mode) { return mode == 0 ? std::ldexp(1.0, -22) : std::ldexp(1.0, -11); }
  Tensor cpu_t(const std::vector<float>& v, std::vector<int64_t> shape) {
    Tensor t = cpu_.alloc(DType::kF32, std::move(shape));
    std::copy(v.begin(), v.end(), t.data<float>());
    return t;
  }
  void upload(const Weight& w) {
    std::vector<TensorView> views;
    for (const WeightPart& p : w.parts) views.push_back(p.data), views.push_back(p.scales);
    for (auto& g : gpu_) {
      const auto st = g->upload_views(views);
      NB_CHECK(st.ok(), "upload_views: " + st.status().message());
    }
  }
  static void expect_close(const std::vector<float>& want, const std::vector<float>& got, const std::vector<float>& tol,
                           int64_t row_len, const std::string& what) {
    ASSERT_EQ(want.size(), got.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      const float t = tol.size() == 1 ? tol[0] : tol[i];
      if (!(std::abs(want[i] - got[i]) <= t)) {
        ADD_FAILURE() << what << ": first mismatch at [" << i / row_len << ", " << i % row_len << "]: cpu " << want[i]
                      << " gpu " << got[i] << " tol " << t;
        return;
      }
    }
  }

  CpuBackend cpu_{4};
  std::unique_ptr<CudaBackend> gpu_[2];
  int ws_policy_ = 1;
  HostBytes hb_;
};

TEST_F(PrefillGemm, DenseMatchesCpu) {
  struct Case {
    WeightFormat f;
    int64_t n, k;
    int parts;
    bool extreme;
    std::vector<int64_t> ms;
  };
  const Case cases[] = {
      {WeightFormat::kMXFP4, 200, 2880, 1, false, {1, 70, 129}},       // k not a multiple of 64 (tail half tile)
      {WeightFormat::kMXFP4, 130, 96, 2, true, {5, 64, 200, 300}},     // exponents at both ends of the exact range
      {WeightFormat::kNVFP4, 77, 160, 3, false, {3, 127, 130, 260}},   // 3 parts: multiply, divide, multiply
      {WeightFormat::kNVFP4, 300, 2912, 2, false, {513}},              // 256-token tiles: a partial one, a half k-tile
      {WeightFormat::kNVFP4, 256, 512, 2, false, {64, 65}},
      {WeightFormat::kMXFP4, 1040, 512, 1, false, {4111}},             // enough tiles for the 128-row tile
      {WeightFormat::kMXFP4, 1040, 96, 1, true, {4111}},               // and its steps with blocks above 2^1
      {WeightFormat::kMXFP4, 4096, 64, 1, false, {4111}},              // one k-tile, ~4 tiles per block (ws ring)
      {WeightFormat::kNVFP4, 4096, 64, 1, false, {300}},               // 96 items: the portable tile (sm_90a auto)
      // The activation conversions: k = 4096 is the largest the one-read kernels take (tiled at m = 300 one fp16,
      // stored wgmma order at m = 70 and hi + lo); k = 4160 goes to the generic two-read kernel.
      {WeightFormat::kNVFP4, 136, 4096, 1, false, {70, 300}},
      {WeightFormat::kMXFP4, 136, 4160, 1, false, {70, 300}},
  };
  const cuda::TiledTile tile300 = cuda::gemm_tiled_tile(300, 4096, cuda::GemmActs::kFp16, ws_policy_);
  std::printf("a one-fp16 GEMM of 300 tokens x 4096 rows on: %s\n",
              tile300 == cuda::TiledTile::kWs    ? "the sm_90a warp-specialized tile"
              : tile300 == cuda::TiledTile::kWsp ? "the portable warp-specialized tile"
                                                 : "the wgmma or block tile");
  for (const Case& c : cases) {
    const Weight w = make_fp4(hb_, c.f, c.n, c.k, c.parts, c.extreme);
    upload(w);
    const std::vector<float> bias = randn(c.n);
    std::vector<float> row(c.k);
    for (int64_t m : c.ms) {
      const std::vector<float> x = randn(m * c.k);
      // sum_j |w_ij x_tj| per output, from the exactly decoded weight.
      std::vector<double> mag(m * c.n);
      for (int64_t j = 0; j < c.n; ++j) {
        dequantize_row(w, j, row.data());
        for (int64_t t = 0; t < m; ++t) {
          double s = 0;
          for (int64_t i = 0; i < c.k; ++i) s += std::abs(static_cast<double>(row[i]) * x[t * c.k + i]);
          mag[t * c.n + j] = s;
        }
      }
      const bool with_bias = m % 2 == 1;
      Tensor cb = cpu_t(bias, {c.n});
      const std::vector<float> want = cpu_.to_host(cpu_.linear(cpu_t(x, {m, c.k}), w, with_bias ? &cb : nullptr));
      for (int mode = 0; mode < 2; ++mode) {
        CudaBackend& g = *gpu_[mode];
        Tensor gb = g.upload(TensorView{bias.data(), DType::kF32, {c.n}});
        const std::vector<float> got =
            g.to_host(g.linear(g.upload(TensorView{x.data(), DType::kF32, {m, c.k}}), w, with_bias ? &gb : nullptr));
        std::vector<float> tol(m * c.n);
        for (size_t i = 0; i < tol.size(); ++i) {
          tol[i] = static_cast<float>((eps(mode) + c.k * 1.2e-7) * mag[i] + 1e-6 + 1e-6 * std::abs(want[i]));
        }
        expect_close(want, got, tol, c.n,
                     std::string(weight_format_name(c.f)) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) +
                         " parts " + std::to_string(c.parts) + " m " + std::to_string(m) + " mode " +
                         (mode ? "fp16" : "hi+lo"));
      }
    }
  }
}

// The FP8-activation tile (CudaBackendOptions::gemm_fp8_activations, kernels/gemm_fp4_wsr8.cuh) against an
// emulation of its rounding on the host: each token row scaled by 2^s (max |x| * 2^s in [2^7, 2^8)) and rounded
// to E4M3; each weight as e2m1 * block scale * 2^c rounded to E4M3, c the row's fold (2^c times its largest
// block scale at most 64); products summed exactly. Both operands are then exact E4M3 values and the GPU differs
// by the tensor cores' arithmetic only, bounded here as follows. Hopper's FP8 MMA aligns a k32 group's products
// to the largest and keeps ~13-14 bits (the DeepSeek-V3 report; measured here: an outlier row of k = 64 off by
// ~2^-11 of sum |w x|): <= 32 * 2^-13 of each group's largest |product| plus 2^-13 of the running sum per
// group, so (2^-8 + k/32 * 2^-13) sum |w x|. Whether it flushes E4M3 subnormals is not documented: allowed for,
// 2^-6 (the smallest normal) times the other operand per element, in each operand's scaled units. sm_90a only.
// The emulation is model/weight.h's fp8_round_row and fp8_weight_row (the CPU backend's NIBBLE_GEMM_FP8=1).

TEST_F(PrefillGemm, Fp8ActivationsMatchTheirEmulation) {
  CudaBackendOptions o;
  o.poison = true;
  o.kv_cache_dtype = DType::kF32;
  o.gemm_min_tokens = 1;
  o.gemm_fp8_activations = true;
  auto made = CudaBackend::create(o);
  if (!made.ok()) GTEST_SKIP() << made.status().message();
  if (!cuda::gemm_fp8_supported()) GTEST_SKIP() << "the FP8 tile needs an sm_90a GPU and build";
  CudaBackend& g = *made.value();
  struct Case {
    WeightFormat f;
    int64_t n, k;
    int parts;
    bool extreme;
    std::vector<int64_t> ms;
  };
  const Case cases[] = {
      {WeightFormat::kMXFP4, 200, 2880, 1, false, {1, 70, 300}},   // k = 22.5 k-tiles of 128; 128-token tiles
      {WeightFormat::kMXFP4, 130, 96, 2, true, {5, 300}},          // block exponents over 37 binades: folds clamp
      {WeightFormat::kNVFP4, 77, 160, 3, false, {3, 260}},         // 3 parts: multiply, divide, multiply
      {WeightFormat::kNVFP4, 300, 2912, 2, false, {513}},          // 256-token tiles, a partial one
      {WeightFormat::kMXFP4, 1040, 512, 1, false, {4111}},         // several tiles per block
      {WeightFormat::kMXFP4, 136, 4160, 1, false, {70}},           // 33 k-tiles: the two-read conversion
      // The golden models' small shapes: k of half a k-tile or one, few rows.
      {WeightFormat::kNVFP4, 128, 64, 1, false, {1, 10, 53}},
      {WeightFormat::kNVFP4, 32, 64, 2, false, {10, 53}},
      {WeightFormat::kNVFP4, 64, 128, 1, false, {53}},
      {WeightFormat::kMXFP4, 64, 64, 1, false, {10, 53}},
  };
  for (const Case& c : cases) {
    const Weight w = make_fp4(hb_, c.f, c.n, c.k, c.parts, c.extreme);
    std::vector<TensorView> views;
    for (const WeightPart& p : w.parts) views.push_back(p.data), views.push_back(p.scales);
    NB_CHECK(g.upload_views(views).ok(), "upload_views");
    std::vector<float> wq(c.n * c.k), gscale(c.n);
    std::vector<int> fold(c.n);
    for (int64_t j = 0; j < c.n; ++j) gscale[j] = fp8_weight_row(w, j, &wq[j * c.k], &fold[j]);
    const std::vector<float> bias = randn(c.n);
    Tensor gb = g.upload(TensorView{bias.data(), DType::kF32, {c.n}});
    for (int64_t m : c.ms) {
      std::vector<float> x = randn(m * c.k);
      if (m > 2) x[c.k + 7] = 300.0f;  // one row with a large entry: its other entries go subnormal in E4M3
      std::vector<float> xq(x.size());
      std::vector<int> shift(m);
      for (int64_t t = 0; t < m; ++t) shift[t] = fp8_round_row(&x[t * c.k], c.k, &xq[t * c.k]);
      const bool with_bias = m % 2 == 1;
      const std::vector<float> got =
          g.to_host(g.linear(g.upload(TensorView{x.data(), DType::kF32, {m, c.k}}), w, with_bias ? &gb : nullptr));
      std::vector<float> want(m * c.n), tol(m * c.n);
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < c.n; ++j) {
          double sum = 0, mag = 0, wsum = 0, xsum = 0;
          for (int64_t i = 0; i < c.k; ++i) {
            const double p = static_cast<double>(wq[j * c.k + i]) * xq[t * c.k + i];
            sum += p, mag += std::abs(p);
            wsum += std::abs(wq[j * c.k + i]), xsum += std::abs(xq[t * c.k + i]);
          }
          const double gs = std::abs(gscale[j]);
          want[t * c.n + j] = static_cast<float>(sum * gscale[j] + (with_bias ? bias[j] : 0.0));
          const double acc = (std::ldexp(1.0, -8) + c.k / 32.0 * std::ldexp(1.0, -13) + c.k * 1.2e-7) * mag;
          const double flush = std::ldexp(wsum, -6 - shift[t]) + std::ldexp(xsum, -6 - fold[j]);
          tol[t * c.n + j] = static_cast<float>((acc + flush) * gs + 1e-6 + 1e-6 * std::abs(want[t * c.n + j]));
        }
      }
      expect_close(want, got, tol, c.n,
                   std::string("fp8 ") + weight_format_name(c.f) + " n " + std::to_string(c.n) + " k " +
                       std::to_string(c.k) + " parts " + std::to_string(c.parts) + " m " + std::to_string(m));
    }
  }
}

// Routes from host ids: ids [T, top_k] (distinct per token), weights random positive.
Routes routes_on(Backend& be, const std::vector<int32_t>& ids, const std::vector<float>& wts, int64_t T, int top_k) {
  Routes r{be.alloc(DType::kI32, {T, top_k}), be.alloc(DType::kF32, {T, top_k})};
  if (dynamic_cast<CudaBackend*>(&be)) {
    // The backend poisons new buffers on its own (non-blocking) stream: let that finish before the copies on
    // the legacy stream, or the poison may land after the ids (a flaky trap in the grouping kernel).
    cudaDeviceSynchronize();
    cudaMemcpy(r.ids.data<int32_t>(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(r.weights.data<float>(), wts.data(), wts.size() * 4, cudaMemcpyHostToDevice);
  } else {
    std::copy(ids.begin(), ids.end(), r.ids.data<int32_t>());
    std::copy(wts.begin(), wts.end(), r.weights.data<float>());
  }
  return r;
}

TEST_F(PrefillGemm, MoeGroupedMatchesCpu) {
  struct Case {
    const char* name;
    WeightFormat f;
    int E, top_k, T, d_model, d_ff;
    GluLayout layout;
    bool gpt_oss, bias;
    int used;  // tokens pick among experts [0, used) only; -1: all tokens pick expert 2 first
  };
  const Case cases[] = {
      {"mxfp4 interleaved gpt-oss, experts 5.. idle", WeightFormat::kMXFP4, 8, 2, 37, 64, 96, GluLayout::kInterleaved,
       true, true, 5},
      {"nvfp4 halves silu, all tokens on expert 2", WeightFormat::kNVFP4, 4, 1, 70, 64, 64, GluLayout::kHalves, false,
       false, -1},
      {"mxfp4 halves gpt-oss, d_ff 160, 32 experts", WeightFormat::kMXFP4, 32, 4, 150, 128, 160, GluLayout::kHalves,
       true, true, 32},
      {"nvfp4 interleaved, 200 tokens on 3 experts", WeightFormat::kNVFP4, 16, 3, 200, 96, 128,
       GluLayout::kInterleaved, true, false, 3},
      // >= 128 rows per expert on average: 128-row token tiles (a full one and a partial one per expert).
      {"mxfp4 interleaved gpt-oss, 300 tokens on 2 experts", WeightFormat::kMXFP4, 2, 1, 300, 64, 96,
       GluLayout::kInterleaved, true, true, 2},
      {"nvfp4 halves silu, 300 tokens x 2 on 3 experts", WeightFormat::kNVFP4, 3, 2, 300, 96, 64, GluLayout::kHalves,
       false, false, 3},
      // One expert with 2 full 128-row tiles and a partial one of 8 / 50 rows: on sm_90a wgmma N = 16 / 64
      // inside a 128-row tile in the fp16 mode (only N rows loaded), 64-row tiles with N 16 / 64 in hi + lo.
      {"mxfp4 interleaved gpt-oss, 264 tokens all on expert 2", WeightFormat::kMXFP4, 3, 1, 264, 64, 64,
       GluLayout::kInterleaved, true, true, -1},
      {"nvfp4 halves silu, 306 tokens all on expert 2", WeightFormat::kNVFP4, 3, 1, 306, 64, 64, GluLayout::kHalves,
       false, false, -1},
      // gpt-oss GLU with d_ff % 64 == 0: on sm_90a FC1 writes FC2's fp16 activations itself (moe_gemm.cu).
      {"mxfp4 halves gpt-oss, d_ff 128, 300 tokens x 2 on 4 experts", WeightFormat::kMXFP4, 4, 2, 300, 128, 128,
       GluLayout::kHalves, true, true, 4},
      // BF16 experts (Qwen3-MoE's unquantized checkpoints): grouped on the host, each expert through cuBLASLt.
      // FC1 as two parts (gate, up) in the halves layout, as qwen3_moe's loader fuses them.
      {"bf16 halves silu, 16 experts top 4, 150 tokens", WeightFormat::kBF16, 16, 4, 150, 128, 96, GluLayout::kHalves,
       false, false, 16},
      {"bf16 interleaved gpt-oss, experts 5.. idle", WeightFormat::kBF16, 8, 2, 70, 64, 96, GluLayout::kInterleaved,
       true, true, 5},
      {"bf16 halves silu, all tokens on expert 2", WeightFormat::kBF16, 4, 1, 70, 64, 64, GluLayout::kHalves, false,
       true, -1},
  };
  for (const Case& c : cases) {
    MoeExperts ex;
    ex.n_experts = c.E;
    ex.d_expert = c.d_ff;
    ex.layout = c.layout;
    for (int e = 0; e < c.E; ++e) {
      const bool two = c.f == WeightFormat::kNVFP4 || (c.f == WeightFormat::kBF16 && c.layout == GluLayout::kHalves);
      ex.fc1.push_back(make_fp4(hb_, c.f, 2 * c.d_ff, c.d_model, two ? 2 : 1));
      ex.fc2.push_back(make_fp4(hb_, c.f, c.d_model, c.d_ff, 1));
      upload(ex.fc1.back());
      upload(ex.fc2.back());
    }
    std::vector<int32_t> ids(c.T * c.top_k);
    std::vector<float> wts(c.T * c.top_k);
    std::uniform_real_distribution<float> u01(0.1f, 1.0f);
    for (int t = 0; t < c.T; ++t) {
      std::vector<int32_t> pool(c.used > 0 ? c.used : c.E);
      for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<int32_t>(i);
      std::shuffle(pool.begin(), pool.end(), rng());
      if (c.used < 0) std::iter_swap(pool.begin(), std::find(pool.begin(), pool.end(), 2));
      for (int i = 0; i < c.top_k; ++i) ids[t * c.top_k + i] = pool[i], wts[t * c.top_k + i] = u01(rng());
    }
    const std::vector<float> b1 = randn(c.E * 2 * c.d_ff), b2 = randn(c.E * c.d_model);
    if (c.bias) ex.fc1_bias = cpu_t(b1, {c.E, 2 * c.d_ff}), ex.fc2_bias = cpu_t(b2, {c.E, c.d_model});
    const GluParams glu = c.gpt_oss ? GluParams{Activation::kGptOssClamped, 7.0f} : GluParams{};
    const std::vector<float> x = randn(c.T * c.d_model, 2.0f);
    const std::vector<float> want = cpu_.to_host(
        cpu_.moe_experts(cpu_t(x, {c.T, c.d_model}), routes_on(cpu_, ids, wts, c.T, c.top_k), ex, glu));
    float scale = 0;
    for (float v : want) scale = std::max(scale, std::abs(v));
    for (int mode = 0; mode < 2; ++mode) {
      CudaBackend& g = *gpu_[mode];
      MoeExperts gex = ex;
      if (c.bias) {
        gex.fc1_bias = g.upload(TensorView{b1.data(), DType::kF32, {c.E, 2 * c.d_ff}});
        gex.fc2_bias = g.upload(TensorView{b2.data(), DType::kF32, {c.E, c.d_model}});
      }
      const std::vector<float> got = g.to_host(g.moe_experts(g.upload(TensorView{x.data(), DType::kF32, {c.T, c.d_model}}),
                                                             routes_on(g, ids, wts, c.T, c.top_k), gex, glu));
      // Two fp16 roundings (x, then the GLU output), each <= eps relative per element, enter sums of
      // random-sign terms; 64 eps of the output's scale bounds them (GLU slopes stay below ~4 here),
      // plus fp32 order (k 2^-23 relative, k <= 320).
      // BF16 experts take bf16 hi + lo activations (~16 bits) in either mode.
      const double e = c.f == WeightFormat::kBF16 ? std::ldexp(1.0, -16) : eps(mode);
      const float tol = static_cast<float>(scale * (64 * e + 4e-5) + 1e-6);
      expect_close(want, got, {tol}, c.d_model, std::string(c.name) + (mode ? " fp16" : " hi+lo"));
    }
  }
}

// BF16 experts inside a CUDA graph capture (a decode graph when the GEMMs are forced from one token): the
// cuBLASLt path's host sync cannot be captured, so the backend keeps the per-token expert kernels there. The
// graph's result against the CPU reference, after one eager call (the expert tables, as run_graphed warms up).
TEST_F(PrefillGemm, MoeBf16ExpertsUnderGraphCapture) {
  const int E = 4, top_k = 2, T = 8, d_model = 64, d_ff = 64;
  MoeExperts ex;
  ex.n_experts = E;
  ex.d_expert = d_ff;
  ex.layout = GluLayout::kHalves;
  for (int e = 0; e < E; ++e) {
    ex.fc1.push_back(make_fp4(hb_, WeightFormat::kBF16, 2 * d_ff, d_model, 2));
    ex.fc2.push_back(make_fp4(hb_, WeightFormat::kBF16, d_model, d_ff, 1));
    upload(ex.fc1.back());
    upload(ex.fc2.back());
  }
  std::vector<int32_t> ids(T * top_k);
  std::vector<float> wts(T * top_k);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < top_k; ++i) ids[t * top_k + i] = (t + 3 * i) % E, wts[t * top_k + i] = 0.25f + 0.1f * i;
  const std::vector<float> x = randn(T * d_model, 2.0f);
  const std::vector<float> want =
      cpu_.to_host(cpu_.moe_experts(cpu_t(x, {T, d_model}), routes_on(cpu_, ids, wts, T, top_k), ex, GluParams{}));
  CudaBackend& g = *gpu_[0];
  const Tensor gx = g.upload(TensorView{x.data(), DType::kF32, {T, d_model}});
  const Routes r = routes_on(g, ids, wts, T, top_k);
  const std::vector<float> eager = g.to_host(g.moe_experts(gx, r, ex, GluParams{}));  // the cuBLASLt path
  ASSERT_TRUE(g.synchronize().ok());
  auto st = static_cast<cudaStream_t>(g.stream());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), cudaSuccess);
  const Tensor y = g.moe_experts(gx, r, ex, GluParams{});
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  const std::vector<float> got = g.to_host(y);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  float scale = 0;
  for (float v : want) scale = std::max(scale, std::abs(v));
  const float tol = static_cast<float>(scale * (64 * std::ldexp(1.0, -16) + 4e-5) + 1e-6);
  expect_close(want, eager, {tol}, d_model, "bf16 experts, eager");
  expect_close(want, got, {tol}, d_model, "bf16 experts, captured");
}

// The MoE grouped GEMMs with FP8 activations (gemm_fp8_activations: moe_gemm.cu moe_wsr8_kernel) against an
// emulation: per pair, FC1 from the E4M3-rounded token row and weights (as Fp8ActivationsMatchTheirEmulation),
// bias, the GLU, the GLU row rounded to E4M3 at its own power-of-two scale, FC2, bias, times the routing weight,
// summed over top_k. The GPU's FC1 differs from the emulation's by the FP8 MMA's arithmetic (the bound above);
// pushed through the GLU (its change over that box, sampled on a 3 x 3 grid, x 1.25), that may move a GLU value
// across an E4M3 rounding boundary: where the box straddles one, FC2 is allowed that element's gap between the
// two roundings; a row whose largest value could change binade is allowed any rounding (2^-3 relative). sm_90a.
TEST_F(PrefillGemm, MoeFp8MatchesItsEmulation) {
  CudaBackendOptions o;
  o.poison = true;
  o.kv_cache_dtype = DType::kF32;
  o.gemm_min_tokens = o.moe_gemm_min_tokens = 1;
  o.gemm_fp8_activations = true;
  auto made = CudaBackend::create(o);
  if (!made.ok()) GTEST_SKIP() << made.status().message();
  if (!cuda::gemm_fp8_supported()) GTEST_SKIP() << "the FP8 tiles need an sm_90a GPU and build";
  CudaBackend& g = *made.value();
  struct Case {
    const char* name;
    WeightFormat f;
    int E, top_k, T, d_model, d_ff;
    GluLayout layout;
    bool gpt_oss, bias;
  };
  const Case cases[] = {
      {"mxfp4 interleaved gpt-oss, 8 experts", WeightFormat::kMXFP4, 8, 2, 37, 64, 96, GluLayout::kInterleaved, true, true},
      {"nvfp4 halves silu, 4 experts", WeightFormat::kNVFP4, 4, 1, 70, 160, 64, GluLayout::kHalves, false, false},
      {"mxfp4 halves gpt-oss, 300 tokens on 2 experts (256-row tiles)", WeightFormat::kMXFP4, 2, 1, 600, 128, 160,
       GluLayout::kHalves, true, true},
      {"nvfp4 interleaved gpt-oss, 3 experts, top 2", WeightFormat::kNVFP4, 3, 2, 200, 96, 128,
       GluLayout::kInterleaved, true, false},
  };
  auto glu_of = [](float gv, float uv, bool gpt_oss) {
    if (!gpt_oss) return gv / (1.0f + std::exp(-gv)) * uv;
    gv = std::min(gv, 7.0f);
    uv = std::clamp(uv, -7.0f, 7.0f);
    return gv / (1.0f + std::exp(-1.702f * gv)) * (uv + 1.0f);
  };
  const double kAcc = std::ldexp(1.0, -8), kStep = std::ldexp(1.0, -13);
  for (const Case& c : cases) {
    MoeExperts ex;
    ex.n_experts = c.E;
    ex.d_expert = c.d_ff;
    ex.layout = c.layout;
    std::vector<std::vector<float>> w1(c.E), w2(c.E);
    std::vector<std::vector<float>> gs1(c.E), gs2(c.E);
    std::vector<std::vector<int>> f1(c.E), f2(c.E);
    for (int e = 0; e < c.E; ++e) {
      ex.fc1.push_back(make_fp4(hb_, c.f, 2 * c.d_ff, c.d_model, c.f == WeightFormat::kNVFP4 ? 2 : 1));
      ex.fc2.push_back(make_fp4(hb_, c.f, c.d_model, c.d_ff, 1));
      for (const Weight* w : {&ex.fc1.back(), &ex.fc2.back()}) {
        std::vector<TensorView> views;
        for (const WeightPart& p : w->parts) views.push_back(p.data), views.push_back(p.scales);
        NB_CHECK(g.upload_views(views).ok(), "upload_views");
      }
      w1[e].resize(2 * c.d_ff * c.d_model), gs1[e].resize(2 * c.d_ff), f1[e].resize(2 * c.d_ff);
      for (int r = 0; r < 2 * c.d_ff; ++r) gs1[e][r] = fp8_weight_row(ex.fc1[e], r, &w1[e][r * c.d_model], &f1[e][r]);
      w2[e].resize(c.d_model * c.d_ff), gs2[e].resize(c.d_model), f2[e].resize(c.d_model);
      for (int r = 0; r < c.d_model; ++r) gs2[e][r] = fp8_weight_row(ex.fc2[e], r, &w2[e][r * c.d_ff], &f2[e][r]);
    }
    std::vector<int32_t> ids(c.T * c.top_k);
    std::vector<float> wts(c.T * c.top_k);
    std::uniform_real_distribution<float> u01(0.1f, 1.0f);
    for (int t = 0; t < c.T; ++t) {
      std::vector<int32_t> pool(c.E);
      for (int i = 0; i < c.E; ++i) pool[i] = i;
      std::shuffle(pool.begin(), pool.end(), rng());
      for (int i = 0; i < c.top_k; ++i) ids[t * c.top_k + i] = pool[i], wts[t * c.top_k + i] = u01(rng());
    }
    const std::vector<float> b1 = randn(c.E * 2 * c.d_ff), b2 = randn(c.E * c.d_model);
    const std::vector<float> x = randn(c.T * c.d_model, 2.0f);
    std::vector<float> xq(x.size());
    std::vector<int> xs(c.T);
    for (int t = 0; t < c.T; ++t) xs[t] = fp8_round_row(&x[t * c.d_model], c.d_model, &xq[t * c.d_model]);
    std::vector<double> want(c.T * c.d_model, 0.0), tol(c.T * c.d_model, 1e-6);
    std::vector<float> h(2 * c.d_ff), a(c.d_ff), aq(c.d_ff);
    std::vector<double> eh(2 * c.d_ff), ea(c.d_ff), gap(c.d_ff);
    for (int t = 0; t < c.T; ++t) {
      for (int i = 0; i < c.top_k; ++i) {
        const int e = ids[t * c.top_k + i];
        const double wt = wts[t * c.top_k + i];
        const float* xr = &xq[t * c.d_model];
        for (int r = 0; r < 2 * c.d_ff; ++r) {
          double sum = 0, mag = 0, wsum = 0, xsum = 0;
          for (int j = 0; j < c.d_model; ++j) {
            const double p = static_cast<double>(w1[e][r * c.d_model + j]) * xr[j];
            sum += p, mag += std::abs(p), wsum += std::abs(w1[e][r * c.d_model + j]), xsum += std::abs(xr[j]);
          }
          const double gsa = std::abs(gs1[e][r]);
          h[r] = static_cast<float>(sum * gs1[e][r] + (c.bias ? b1[e * 2 * c.d_ff + r] : 0.0));
          eh[r] = ((kAcc + c.d_model / 32.0 * kStep + c.d_model * 1.2e-7) * mag + std::ldexp(wsum, -6 - xs[t]) +
                   std::ldexp(xsum, -6 - f1[e][r])) * gsa + 1e-6 * (1 + std::abs(h[r]));
        }
        float amax = 0, emax = 0;
        for (int j = 0; j < c.d_ff; ++j) {
          const int rg = c.layout == GluLayout::kInterleaved ? 2 * j : j;
          const int ru = c.layout == GluLayout::kInterleaved ? 2 * j + 1 : c.d_ff + j;
          a[j] = glu_of(h[rg], h[ru], c.gpt_oss);
          double dev = 0;
          for (int dg = -1; dg <= 1; ++dg)
            for (int du = -1; du <= 1; ++du)
              dev = std::max(dev, std::abs(static_cast<double>(glu_of(static_cast<float>(h[rg] + dg * eh[rg]),
                                                                      static_cast<float>(h[ru] + du * eh[ru]), c.gpt_oss)) - a[j]));
          ea[j] = 1.25 * dev + 1e-7 * (1 + std::abs(a[j]));
          amax = std::max(amax, std::abs(a[j]));
          emax = std::max(emax, static_cast<float>(ea[j]));
        }
        const int sh = fp8_round_row(a.data(), c.d_ff, aq.data());
        int elo = 0, ehi = 0;
        if (amax - emax > 0) std::frexp(amax - emax, &elo);
        std::frexp(amax + emax, &ehi);
        const bool loose = amax - emax <= 0 || elo != ehi;  // the GPU's row scale may differ
        for (int j = 0; j < c.d_ff; ++j) {
          auto q = [&](double v) { return std::ldexp(fmt::e4m3_to_float(fmt::float_to_e4m3(static_cast<float>(std::ldexp(v, sh)))), -sh); };
          gap[j] = loose ? std::ldexp(std::abs(a[j]), -3) + ea[j] + std::ldexp(1.0, -9 - sh)
                         : std::abs(q(a[j] + ea[j]) - q(a[j] - ea[j]));
        }
        for (int cc = 0; cc < c.d_model; ++cc) {
          double sum = 0, mag = 0, wsum = 0, asum = 0, flip = 0;
          for (int j = 0; j < c.d_ff; ++j) {
            const double w = w2[e][cc * c.d_ff + j];
            sum += w * aq[j], mag += std::abs(w * aq[j]), wsum += std::abs(w), asum += std::abs(aq[j]);
            flip += std::abs(w) * gap[j];
          }
          const double gsa = std::abs(gs2[e][cc]);
          const double y = sum * gs2[e][cc] + (c.bias ? b2[e * c.d_model + cc] : 0.0);
          want[t * c.d_model + cc] += wt * y;
          tol[t * c.d_model + cc] += wt * (((kAcc + c.d_ff / 32.0 * kStep + c.d_ff * 1.2e-7) * mag + flip +
                                            std::ldexp(wsum, -6 - sh) + std::ldexp(asum, -6 - f2[e][cc])) * gsa +
                                           1e-6 * (1 + std::abs(y)));
        }
      }
    }
    MoeExperts gex = ex;
    if (c.bias) {
      gex.fc1_bias = g.upload(TensorView{b1.data(), DType::kF32, {c.E, 2 * c.d_ff}});
      gex.fc2_bias = g.upload(TensorView{b2.data(), DType::kF32, {c.E, c.d_model}});
    }
    const GluParams glu = c.gpt_oss ? GluParams{Activation::kGptOssClamped, 7.0f} : GluParams{};
    const std::vector<float> got = g.to_host(g.moe_experts(g.upload(TensorView{x.data(), DType::kF32, {c.T, c.d_model}}),
                                                           routes_on(g, ids, wts, c.T, c.top_k), gex, glu));
    std::vector<float> wantf(want.begin(), want.end()), tolf(tol.begin(), tol.end());
    expect_close(wantf, got, tolf, c.d_model, std::string("fp8 moe ") + c.name);
  }
}

}  // namespace
}  // namespace nb
