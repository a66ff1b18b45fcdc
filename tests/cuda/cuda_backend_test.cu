// Every CudaBackend op against the CPU reference backend, on fresh random inputs (seed printed), with
// every new GPU buffer poisoned with NaN bytes so an unwritten output fails. Weights are decoded exactly
// by both backends, so the bound is fp32 summation: |gpu - cpu| <= k * 2^-23 * sum|w x| (+ a tiny
// absolute term); KV caches in BF16/FP8 add their rounding (2^-8 / 2^-3 relative to the values' scale).
// Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <span>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "kernels/gemv.cuh"
#include "kernels/moe.cuh"
#include "formats/scalar.h"
#include "model/rope.h"
#include "runtime/sampler.h"
#include "support/random_inputs.h"

namespace nb {
namespace {

using test::HostBytes;
using test::randn;
using test::rng;

// A random weight [n, k] in `format` (values ~ N(0, spread^2)), n split into `parts` parts (NVFP4 parts get
// their own global scale and alternate conventions).
Weight make_weight(HostBytes& hb, WeightFormat format, int64_t n, int64_t k, int parts = 1, DType dense = DType::kBF16,
                   float spread = 0.05f) {
  Weight w;
  w.format = format;
  w.n = n;
  w.k = k;
  for (int pi = 0; pi < parts; ++pi) {
    WeightPart p;
    p.rows = n / parts + (pi == parts - 1 ? n % parts : 0);
    const int64_t rows = p.rows;
    const std::vector<float> x = randn(rows * k, spread);
    switch (format) {
      case WeightFormat::kBF16: {
        const int bytes = dtype_bits(dense) / 8;
        std::vector<uint8_t> b(rows * k * bytes);
        for (int64_t i = 0; i < rows * k; ++i) {
          if (dense == DType::kF32) std::memcpy(&b[i * 4], &x[i], 4);
          else {
            const uint16_t h = fmt::float_to_bf16(x[i]);
            std::memcpy(&b[i * 2], &h, 2);
          }
        }
        p.data = hb.add(std::move(b), dense, {rows, k});
        break;
      }
      case WeightFormat::kFP8E4M3: {
        std::vector<uint8_t> codes(rows * k), scales(rows * 4);
        for (int64_t i = 0; i < rows * k; ++i) codes[i] = fmt::float_to_e4m3(x[i] * 448 / 0.2f);
        for (int64_t r = 0; r < rows; ++r) {
          const float s = 0.2f / 448 * (1 + 0.1f * (r % 3));
          std::memcpy(&scales[r * 4], &s, 4);
        }
        p.data = hb.add(std::move(codes), DType::kU8, {rows, k});
        p.scales = hb.add(std::move(scales), DType::kF32, {rows});
        break;
      }
      case WeightFormat::kMXFP4: {
        std::vector<uint8_t> codes(rows * k / 2), scales(rows * k / 32);
        for (int64_t b = 0; b < rows * k / 32; ++b) scales[b] = fmt::mxfp4_encode_block(&x[b * 32], &codes[b * 16]);
        p.data = hb.add(std::move(codes), DType::kU8, {rows, k / 2});
        p.scales = hb.add(std::move(scales), DType::kU8, {rows, k / 32});
        break;
      }
      case WeightFormat::kNVFP4: {
        std::vector<uint8_t> codes(rows * k / 2), scales(rows * k / 16);
        const float s2 = fmt::nvfp4_global_scale(0.25f * (pi + 1));
        for (int64_t b = 0; b < rows * k / 16; ++b) scales[b] = fmt::nvfp4_encode_block(&x[b * 16], s2, &codes[b * 8]);
        p.data = hb.add(std::move(codes), DType::kU8, {rows, k / 2});
        p.scales = hb.add(std::move(scales), DType::kF8_E4M3, {rows, k / 16});
        p.convention = pi % 2 ? fmt::GlobalScale::kDivide : fmt::GlobalScale::kMultiply;
        p.global_scale = pi % 2 ? 1.0f / s2 : s2;
        break;
      }
    }
    p.name = "w" + std::to_string(pi);
    w.parts.push_back(std::move(p));
  }
  return w;
}

// A copy of a device weight whose bytes live in host memory (for the CPU reference), kept in `keep`.
Weight host_copy(const Weight& w, std::vector<std::vector<uint8_t>>& keep) {
  Weight host = w;
  cudaDeviceSynchronize();  // the backend works on its own non-blocking stream
  for (WeightPart& p : host.parts) {
    for (TensorView* v : {&p.data, &p.scales}) {
      if (!v->data) continue;
      keep.emplace_back(v->nbytes());
      cudaMemcpy(keep.back().data(), v->data, v->nbytes(), cudaMemcpyDeviceToHost);
      v->data = keep.back().data();
      v->device = Device::kCpu;
    }
  }
  return host;
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!make_gpu(false)) GTEST_SKIP() << "no usable GPU";
  }
  // The backend under test, with hi + lo activations in the FP4 tensor-core kernels (the bounds below are
  // fp32 summation's) or, for the tests of the one-token kernels' second mode, one fp16 per activation
  // (CudaBackendOptions::gemm_fp16_activations, the default in use). Weights are uploaded per backend.
  bool make_gpu(bool fp16_acts, DType kv_cache = DType::kF32) {
    CudaBackendOptions o;
    o.poison = true;
    o.kv_cache_dtype = kv_cache;
    o.gemm_fp16_activations = fp16_acts;
    o.l2_prefetch = true;  // (off by default: on here, so that the kernels' prefetch hints stay tested)
    auto g = CudaBackend::create(o);
    if (!g.ok()) return false;
    gpu_ = std::move(g.value());
    return true;
  }
  Tensor cpu_t(const std::vector<float>& v, std::vector<int64_t> shape) {
    Tensor t = cpu_.alloc(DType::kF32, std::move(shape));
    std::copy(v.begin(), v.end(), t.data<float>());
    return t;
  }
  Tensor gpu_t(const std::vector<float>& v, std::vector<int64_t> shape) {
    return gpu_->upload(TensorView{v.data(), DType::kF32, std::move(shape)});
  }
  void upload(const Weight& w) {
    std::vector<TensorView> views;
    for (const WeightPart& p : w.parts) views.push_back(p.data), views.push_back(p.scales);
    const auto st = gpu_->upload_views(views);
    NB_CHECK(st.ok(), "upload_views: " + st.status().message());
  }

 public:
  // Compares elementwise with |a - b| <= tol[i] (or a scalar tol); prints the first bad index.
  static void expect_close(const std::vector<float>& want, const std::vector<float>& got,
                           const std::vector<float>& tol, const std::string& what) {
    ASSERT_EQ(want.size(), got.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      const float t = tol.size() == 1 ? tol[0] : tol[i];
      if (!(std::abs(want[i] - got[i]) <= t)) {
        ADD_FAILURE() << what << ": first mismatch at " << i << ": cpu " << want[i] << " gpu " << got[i] << " tol " << t;
        return;
      }
    }
  }

 protected:
  CpuBackend cpu_{2};
  std::unique_ptr<CudaBackend> gpu_;
  HostBytes hb_;
};

// Summation bound for x [m, k] @ w^T: (eps + k * 2^-23) * sum_j |w_ij x_j| + 1e-6, eps the activations'
// relative rounding (0: exact products; one fp16: 2^-11).
std::vector<float> linear_tol(const std::vector<float>& x, const Weight& w, int64_t m, double eps = 0.0) {
  std::vector<float> tol(m * w.n), row(w.k);
  for (int64_t j = 0; j < w.n; ++j) {
    dequantize_row(w, j, row.data());
    for (int64_t t = 0; t < m; ++t) {
      double s = 0;
      for (int64_t i = 0; i < w.k; ++i) s += std::abs(row[i] * x[t * w.k + i]);
      tol[t * w.n + j] = static_cast<float>((eps + w.k * 1.2e-7) * s + 1e-6);
    }
  }
  return tol;
}

TEST_F(CudaOps, LinearEveryFormat) {
  struct Case {
    WeightFormat f;
    int64_t n, k;
    int parts;
    DType dense;
  };
  const Case cases[] = {
      {WeightFormat::kBF16, 67, 128, 1, DType::kBF16},  {WeightFormat::kBF16, 33, 72, 2, DType::kBF16},
      {WeightFormat::kBF16, 9, 36, 1, DType::kF32},     {WeightFormat::kFP8E4M3, 40, 96, 1, DType::kBF16},
      {WeightFormat::kFP8E4M3, 12, 40, 1, DType::kBF16}, {WeightFormat::kMXFP4, 70, 2880, 1, DType::kBF16},
      {WeightFormat::kMXFP4, 21, 96, 1, DType::kBF16},  {WeightFormat::kNVFP4, 64, 256, 2, DType::kBF16},
      {WeightFormat::kNVFP4, 19, 48, 3, DType::kBF16},
      // Few rows, long k: the split-K path at m = 1.
      {WeightFormat::kBF16, 40, 2048, 1, DType::kBF16},  {WeightFormat::kFP8E4M3, 24, 4096, 1, DType::kBF16},
      {WeightFormat::kMXFP4, 10, 4096, 1, DType::kBF16},
  };
  for (const Case& c : cases) {
    const Weight w = make_weight(hb_, c.f, c.n, c.k, c.parts, c.dense);
    upload(w);
    const std::vector<float> bias = randn(c.n);
    for (int64_t m : {1, 3, 9}) {
      const std::vector<float> x = randn(m * c.k);
      Tensor cb = cpu_t(bias, {c.n}), gb = gpu_t(bias, {c.n});
      const std::vector<float> want = cpu_.to_host(cpu_.linear(cpu_t(x, {m, c.k}), w, &cb));
      const std::vector<float> got = gpu_->to_host(gpu_->linear(gpu_t(x, {m, c.k}), w, &gb));
      std::vector<float> tol = linear_tol(x, w, m);
      for (float& t : tol) t += 1e-6f;
      expect_close(want, got, tol,
                   std::string(weight_format_name(c.f)) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) +
                       " parts " + std::to_string(c.parts) + " m " + std::to_string(m));
    }
  }
}

// BF16 weights at prefill sizes go through cuBLASLt with bf16 hi + lo activations (kernels/gemm_dense.cu):
// several parts (fused QKV), bias, m not a multiple of anything; a weight whose parts break 16-byte
// alignment of y (n = 70, part rows 35) takes the GEMV path and must agree too.
TEST_F(CudaOps, LinearBf16PrefillGemm) {
  struct Case {
    int64_t n, k;
    int parts;
  };
  for (const Case& c : {Case{96, 256, 3}, Case{512, 2880, 1}, Case{70, 128, 2}}) {
    const Weight w = make_weight(hb_, WeightFormat::kBF16, c.n, c.k, c.parts, DType::kBF16);
    upload(w);
    const std::vector<float> bias = randn(c.n);
    for (int64_t m : {33, 130}) {
      const std::vector<float> x = randn(m * c.k, 3.0f);
      Tensor cb = cpu_t(bias, {c.n}), gb = gpu_t(bias, {c.n});
      for (bool with_bias : {false, true}) {
        const std::vector<float> want = cpu_.to_host(cpu_.linear(cpu_t(x, {m, c.k}), w, with_bias ? &cb : nullptr));
        const std::vector<float> got = gpu_->to_host(gpu_->linear(gpu_t(x, {m, c.k}), w, with_bias ? &gb : nullptr));
        std::vector<float> tol = linear_tol(x, w, m);  // fp32 sums; the hi + lo split adds ~2^-17 relative
        for (float& t : tol) t = 2 * t + 1e-5f;
        expect_close(want, got, tol,
                     "bf16 prefill n " + std::to_string(c.n) + " k " + std::to_string(c.k) + " parts " +
                         std::to_string(c.parts) + " m " + std::to_string(m) + (with_bias ? " bias" : ""));
      }
    }
  }
}

// Route every FP4 weight the tensor-core kernels can take through them (the default, unless the
// environment turned them off), before the first launch reads the switch. One token goes through the
// row-streaming kernels (gemv_fp4_stream.cu) unless NIBBLE_FP4_STREAM=0: ctest runs the FP4 tests a second
// time that way (cuda_backend_test_fp4_mma), so gemv_fp4.cu's one-token paths stay covered too.
const bool kForceFp4Mma = setenv("NIBBLE_FP4_MMA", "1", 1) == 0;

// Whether one token takes the row-streaming kernels, the only ones that read the producers' staged copies
// (cuda::StagedActs, norm_route's staged h): the poisoned-input checks below apply to them alone.
bool fp4_stream_on() {
  const char* v = std::getenv("NIBBLE_FP4_STREAM");
  return v == nullptr || std::string(v) != "0";
}

// The tensor-core FP4 path (kernels/gemv_fp4.cu) takes MXFP4/NVFP4 at m = 1..8: every m, k that does not
// fill whole 128-element spans (2880 = 22.5 spans, 96, 160), row counts that are not a multiple of the
// 16-row tile, several parts, a weight wide enough for split-K (few rows, k 4096) and one tall enough for
// several tiles per block. Fresh random inputs per m; outputs are poisoned by the backend.
TEST_F(CudaOps, LinearFp4TensorCorePath) {
  ASSERT_TRUE(kForceFp4Mma);
  struct Case {
    WeightFormat f;
    int64_t n, k;
    int parts;
  };
  const Case cases[] = {
      {WeightFormat::kMXFP4, 70, 2880, 1}, {WeightFormat::kMXFP4, 33, 96, 2},  {WeightFormat::kMXFP4, 19, 160, 3},
      {WeightFormat::kMXFP4, 24, 4096, 1}, {WeightFormat::kMXFP4, 1000, 256, 1}, {WeightFormat::kMXFP4, 5, 32, 1},
      {WeightFormat::kNVFP4, 70, 2880, 1}, {WeightFormat::kNVFP4, 33, 96, 2},  {WeightFormat::kNVFP4, 19, 160, 3},
      {WeightFormat::kNVFP4, 24, 4096, 1}, {WeightFormat::kNVFP4, 1000, 256, 1}, {WeightFormat::kNVFP4, 5, 32, 1},
  };
  for (const Case& c : cases) {
    const Weight w = make_weight(hb_, c.f, c.n, c.k, c.parts, DType::kBF16);
    upload(w);
    const std::vector<float> bias = randn(c.n);
    for (int64_t m = 1; m <= 8; ++m) {
      std::vector<float> x = randn(m * c.k);
      if (m == 5) for (float& v : x) v *= 3e4f;    // beyond fp16 range: the kernel's power-of-two prescale
      if (m == 6) for (float& v : x) v *= 1e-6f;   // far below it
      Tensor cb = cpu_t(bias, {c.n}), gb = gpu_t(bias, {c.n});
      const bool with_bias = m % 2 == 1;
      const std::vector<float> want = cpu_.to_host(cpu_.linear(cpu_t(x, {m, c.k}), w, with_bias ? &cb : nullptr));
      const std::vector<float> got = gpu_->to_host(gpu_->linear(gpu_t(x, {m, c.k}), w, with_bias ? &gb : nullptr));
      std::vector<float> tol = linear_tol(x, w, m);
      for (float& t : tol) t += 1e-6f;
      expect_close(want, got, tol,
                   std::string("tensor-core ") + weight_format_name(c.f) + " n " + std::to_string(c.n) + " k " +
                       std::to_string(c.k) + " parts " + std::to_string(c.parts) + " m " + std::to_string(m));
    }
  }
}

TEST_F(CudaOps, EmbeddingNormRopeElementwise) {
  const Weight table = make_weight(hb_, WeightFormat::kBF16, 50, 64);
  upload(table);
  BatchInfo b;
  b.tokens = {3, 49, 0, 7};
  b.positions = {0, 1, 2, 900};
  b.seq_of = {0, 0, 0, 0};
  b.seqs = {SeqInfo{0, 4, 0, {0}}};
  expect_close(cpu_.to_host(cpu_.embedding(table, b)), gpu_->to_host(gpu_->embedding(table, b)), {0.0f}, "embedding");

  const std::vector<float> x = randn(4 * 3 * 64, 3.0f), w = randn(64);
  expect_close(cpu_.to_host(cpu_.rms_norm(cpu_t(x, {4, 3, 64}), cpu_t(w, {64}), 1e-5f)),
               gpu_->to_host(gpu_->rms_norm(gpu_t(x, {4, 3, 64}), gpu_t(w, {64}), 1e-5f)), {2e-5f}, "rms_norm");

  RopeConfig rc;
  rc.type = RopeType::kYarn;
  rc.theta = 150000, rc.factor = 32, rc.truncate = false, rc.original_max_position_embeddings = 4096;
  const RopeTable rope = make_rope_table(rc, 64);
  Tensor cx = cpu_t(x, {4, 3, 64}), gx = gpu_t(x, {4, 3, 64});
  cpu_.rope(cx, b, rope);
  gpu_->rope(gx, b, rope);
  expect_close(cpu_.to_host(cx), gpu_->to_host(gx), {1e-4f}, "rope");

  const std::vector<float> y = randn(x.size());
  expect_close(cpu_.to_host(cpu_.swiglu(cpu_t(x, {768}), cpu_t(y, {768}))),
               gpu_->to_host(gpu_->swiglu(gpu_t(x, {768}), gpu_t(y, {768}))), {1e-5f}, "swiglu");
  Tensor ca = cpu_t(x, {768}), ga = gpu_t(x, {768});
  cpu_.add(ca, cpu_t(y, {768}));
  gpu_->add(ga, gpu_t(y, {768}));
  expect_close(cpu_.to_host(ca), gpu_->to_host(ga), {0.0f}, "add");
  expect_close(cpu_.to_host(cpu_.gather_rows(cpu_t(x, {12, 64}), {11, 0, 5})),
               gpu_->to_host(gpu_->gather_rows(gpu_t(x, {12, 64}), {11, 0, 5})), {0.0f}, "gather_rows");
  // Rows of 3 floats (12 bytes: the byte-wise copy), and more rows than a grid's y dimension holds (the BF16
  // MoE path gathers n_tokens * top_k rows: 65536 at pp8192 top 8).
  std::vector<int32_t> many(70001);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<int32_t>((i * 7) % 256);
  expect_close(cpu_.to_host(cpu_.gather_rows(cpu_t(x, {256, 3}), many)),
               gpu_->to_host(gpu_->gather_rows(gpu_t(x, {256, 3}), many)), {0.0f}, "gather_rows, 12-byte rows");
  expect_close(cpu_.to_host(cpu_.gather_rows(cpu_t(x, {192, 4}), {191, 3, 100})),
               gpu_->to_host(gpu_->gather_rows(gpu_t(x, {192, 4}), {191, 3, 100})), {0.0f}, "gather_rows, 16-byte rows");
  std::vector<int32_t> many4(70001);
  for (size_t i = 0; i < many4.size(); ++i) many4[i] = static_cast<int32_t>((i * 13) % 192);
  expect_close(cpu_.to_host(cpu_.gather_rows(cpu_t(x, {192, 4}), many4)),
               gpu_->to_host(gpu_->gather_rows(gpu_t(x, {192, 4}), many4)), {0.0f}, "gather_rows, 70001 rows");
}

// Two sequences over scrambled blocks, long enough to split the context; sinks and a sliding window.
// head_dim 64 and 128 take the lanes-over-keys decode kernel when the splits merge in one launch, others
// (80) the key-by-key one.
void run_attention(CudaOps* t, CpuBackend& cpu, CudaBackend& gpu, int window, bool sinks, float tol,
                   const std::function<Tensor(const std::vector<float>&, std::vector<int64_t>)>& cpu_t,
                   const std::function<Tensor(const std::vector<float>&, std::vector<int64_t>)>& gpu_t, int hd = 64) {
  (void)t;
  const int nh = 8, nkv = 2, n_blocks = 80;
  BatchInfo b;
  // Sequence 0: 700 new tokens at positions 0..699 written first (prefill), then attention on all of them
  // is too slow on the CPU; instead seq 0 decodes 2 tokens after 698 cached, seq 1 prefills 37.
  std::vector<int32_t> t0(44), t1(3);
  for (int i = 0; i < 44; ++i) t0[i] = (i * 37) % n_blocks;
  for (int i = 0; i < 3; ++i) t1[i] = 44 + i * 5;
  const int past0 = 698, new0 = 2, new1 = 37;
  BatchInfo fill;  // writes seq 0's history
  for (int p = 0; p < past0; ++p) fill.tokens.push_back(0), fill.positions.push_back(p), fill.seq_of.push_back(0);
  fill.seqs = {SeqInfo{0, past0, 0, t0}};
  const std::vector<float> hk = randn(past0 * nkv * hd), hv = randn(past0 * nkv * hd);
  auto cc = cpu.new_kv_cache(1, n_blocks, nkv, hd);
  auto gc = gpu.new_kv_cache(1, n_blocks, nkv, hd);
  cpu.kv_write(*cc, 0, cpu_t(hk, {past0, nkv, hd}), cpu_t(hv, {past0, nkv, hd}), fill);
  gpu.kv_write(*gc, 0, gpu_t(hk, {past0, nkv, hd}), gpu_t(hv, {past0, nkv, hd}), fill);
  for (int i = 0; i < new0; ++i) b.tokens.push_back(0), b.positions.push_back(past0 + i), b.seq_of.push_back(0);
  for (int i = 0; i < new1; ++i) b.tokens.push_back(0), b.positions.push_back(i), b.seq_of.push_back(1);
  b.seqs = {SeqInfo{0, new0, past0, t0}, SeqInfo{new0, new1, 0, t1}};
  const int64_t T = new0 + new1;
  const std::vector<float> k = randn(T * nkv * hd), v = randn(T * nkv * hd), q = randn(T * nh * hd), s = randn(nh);
  cpu.kv_write(*cc, 0, cpu_t(k, {T, nkv, hd}), cpu_t(v, {T, nkv, hd}), b);
  gpu.kv_write(*gc, 0, gpu_t(k, {T, nkv, hd}), gpu_t(v, {T, nkv, hd}), b);
  Tensor cs = cpu_t(s, {nh}), gs = gpu_t(s, {nh});
  const AttentionParams cp{0.125f, window, sinks ? &cs : nullptr}, gp{0.125f, window, sinks ? &gs : nullptr};
  const std::vector<float> want = cpu.to_host(cpu.attention(cpu_t(q, {T, nh, hd}), *cc, 0, b, cp));
  const std::vector<float> got = gpu.to_host(gpu.attention(gpu_t(q, {T, nh, hd}), *gc, 0, b, gp));
  CudaOps::expect_close(want, got, {tol},
                        "attention window " + std::to_string(window) + (sinks ? " sinks" : "") + " kv " +
                            std::string(dtype_name(gc->k[0].dtype)) + " head_dim " + std::to_string(hd));
  // A step of one token (batch-1 decode: the lanes-over-keys kernel loads the cached keys before its PDL
  // wait then): sequence 0's last token again, alone.
  BatchInfo one;
  one.tokens = {0}, one.positions = {past0 + new0 - 1}, one.seq_of = {0};
  one.seqs = {SeqInfo{0, 1, past0 + new0 - 1, t0}};
  const std::vector<float> q1(q.begin() + (new0 - 1) * nh * hd, q.begin() + new0 * nh * hd);
  const std::vector<float> want1 = cpu.to_host(cpu.attention(cpu_t(q1, {1, nh, hd}), *cc, 0, one, cp));
  const std::vector<float> got1 = gpu.to_host(gpu.attention(gpu_t(q1, {1, nh, hd}), *gc, 0, one, gp));
  CudaOps::expect_close(want1, got1, {tol}, "one-token attention window " + std::to_string(window) + " head_dim " +
                                                std::to_string(hd));
}

// The split-context kernel (kernels/attention.cu) alone: the 37-token prefill would otherwise take the
// tiled kernel, whose operand rounding has its own bound (tests/cuda/flash_attention_test.cu).
TEST_F(CudaOps, Attention) {
  auto ct = [&](const std::vector<float>& v, std::vector<int64_t> s) { return cpu_t(v, std::move(s)); };
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF8_E4M3}) {
    CudaBackendOptions o;
    o.poison = true;
    o.kv_cache_dtype = dt;
    o.prefill_attention_min_tokens = std::numeric_limits<int>::max();
    auto g = CudaBackend::create(o);
    ASSERT_TRUE(g.ok());
    auto gt2 = [&](const std::vector<float>& v, std::vector<int64_t> s) {
      return (*g)->upload(TensorView{v.data(), DType::kF32, std::move(s)});
    };
    if (dt == DType::kF32) {  // exact fp32: summation order only
      for (int hd : {64, 128, 80})
        for (int window : {0, 128})
          for (bool sinks : {false, true}) run_attention(this, cpu_, **g, window, sinks, 2e-5f, ct, gt2, hd);
      // The splits merged by a second kernel instead of their last block.
      o.decode_fusion = false;
      auto g2 = CudaBackend::create(o);
      ASSERT_TRUE(g2.ok());
      auto gt3 = [&](const std::vector<float>& v, std::vector<int64_t> s) {
        return (*g2)->upload(TensorView{v.data(), DType::kF32, std::move(s)});
      };
      run_attention(this, cpu_, **g2, 128, true, 2e-5f, ct, gt3);
      continue;
    }
    // Rounded caches: outputs are convex combinations of V (|v| ~ 1..4), logits shift by ~|q||k| * rounding.
    for (int hd : {64, 128})
      for (int window : {0, 128}) run_attention(this, cpu_, **g, window, true, dt == DType::kBF16 ? 0.05f : 0.6f, ct, gt2, hd);
  }
}

// One token through the row-streaming FP4 kernels (kernels/gemv_fp4_stream.cu): k that fills whole
// 1024-element chunks, ends inside one (4096 + 32: one lane of the last chunk live) or is shorter than one,
// odd and single-row weights (the second row of the last pair is a copy, never written), fused parts, and
// MXFP4 weights whose block scales would overflow fp16 at the default window (values ~N(0, 40^2): E8M0
// exponents up to ~8; N(0, 3^2): at the window's edge), which move their rows' exponent window; NVFP4 at
// every part convention. x beyond and below fp16's range.
TEST_F(CudaOps, LinearFp4OneTokenStream) {
  struct Case {
    WeightFormat f;
    int64_t n, k;
    int parts;
    float spread;
  };
  const Case cases[] = {
      {WeightFormat::kMXFP4, 70, 2880, 1, 0.05f}, {WeightFormat::kMXFP4, 33, 4128, 2, 0.05f},
      {WeightFormat::kMXFP4, 1, 64, 1, 0.05f},    {WeightFormat::kMXFP4, 3000, 1024, 3, 0.05f},
      {WeightFormat::kMXFP4, 21, 2048, 1, 40.0f}, {WeightFormat::kMXFP4, 9, 96, 1, 3.0f},
      {WeightFormat::kNVFP4, 70, 2880, 2, 0.05f}, {WeightFormat::kNVFP4, 33, 4128, 3, 0.05f},
      {WeightFormat::kNVFP4, 1, 32, 1, 0.05f},    {WeightFormat::kNVFP4, 3000, 1024, 2, 40.0f},
      // Qwen3-30B-A3B's QKV (2560 row pairs): the one-round grid on a 132-SM GPU (stream_linear_kernel).
      {WeightFormat::kMXFP4, 5120, 2048, 1, 0.05f}, {WeightFormat::kNVFP4, 5120, 2048, 3, 0.05f},
      // One part, an even row count (LinearOp::flat: a pair's rows from pair 0's by one multiply-add), pairs past
      // one round of the grid (more under NIBBLE_STREAM_SMS, ctest cuda_backend_test_few_sms).
      {WeightFormat::kMXFP4, 4354, 1024, 1, 0.05f}, {WeightFormat::kNVFP4, 4354, 1024, 1, 0.05f},
  };
  // Both activation modes: hi + lo (exact products: the summation bound) and one fp16 (its rounding,
  // <= 2^-11 relative per element, added to the bound).
  for (bool fp16 : {false, true}) {
    ASSERT_TRUE(make_gpu(fp16));
    for (const Case& c : cases) {
      const Weight w = make_weight(hb_, c.f, c.n, c.k, c.parts, DType::kBF16, c.spread);
      upload(w);
      const std::vector<float> bias = randn(c.n);
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<float> x = randn(c.k);
        if (rep == 1) for (float& v : x) v *= 3e4f;
        if (rep == 2) for (float& v : x) v *= 1e-6f;
        Tensor cb = cpu_t(bias, {c.n}), gb = gpu_t(bias, {c.n});
        const bool with_bias = rep != 1;
        const std::vector<float> want = cpu_.to_host(cpu_.linear(cpu_t(x, {1, c.k}), w, with_bias ? &cb : nullptr));
        const std::vector<float> got = gpu_->to_host(gpu_->linear(gpu_t(x, {1, c.k}), w, with_bias ? &gb : nullptr));
        std::vector<float> tol = linear_tol(x, w, 1, fp16 ? 0x1p-11 : 0.0);
        for (float& t : tol) t += 1e-6f;
        expect_close(want, got, tol,
                     std::string("stream ") + weight_format_name(c.f) + " n " + std::to_string(c.n) + " k " +
                         std::to_string(c.k) + " parts " + std::to_string(c.parts) + " spread " +
                         std::to_string(c.spread) + " rep " + std::to_string(rep) + (fp16 ? " one fp16" : " hi+lo"));
      }
    }
  }
}

// One token's attention output staged by the attention kernel for the FP4 O projection
// (CudaBackendOptions::stage_o_input): the projection of the staged planes equals the projection of the same
// output copied elsewhere, which the linear kernel stages itself -- the same fp16 products (each head's
// prescale brought to the row's is a power of two), so to the fp32 summation bound. The output's fp32
// values are poisoned before the staged projection: it must read only the planes. Heads of V scaled apart
// (2^3 per KV head: different prescales); gpt-oss's 64 x 64 and 8 x 64 heads (k = 512: a padded chunk, after
// 4096 in the same backend) and 32 x 128 (Qwen3); contexts of one split and of several merged.
TEST_F(CudaOps, AttentionStagesTheOneTokenProjection) {
  CudaBackendOptions o;
  o.poison = true;
  o.kv_cache_dtype = DType::kBF16;
  o.stage_o_input = true;
  auto g = CudaBackend::create(o);
  if (!g.ok()) GTEST_SKIP() << "no usable GPU";
  CudaBackend& gpu = **g;
  auto gt = [&](const std::vector<float>& v, std::vector<int64_t> sh) {
    return gpu.upload(TensorView{v.data(), DType::kF32, std::move(sh)});
  };
  struct Case {
    int nh, nkv, hd;
  };
  for (const Case c : {Case{64, 8, 64}, Case{8, 2, 64}, Case{32, 4, 128}}) {
    const int k = c.nh * c.hd, n_blocks = 48;
    std::vector<int32_t> table(n_blocks);
    for (int i = 0; i < n_blocks; ++i) table[i] = (i * 7) % n_blocks;
    for (WeightFormat f : {WeightFormat::kMXFP4, WeightFormat::kNVFP4}) {
      const Weight w = make_weight(hb_, f, 200, k, f == WeightFormat::kNVFP4 ? 2 : 1);
      {
        std::vector<TensorView> views;
        for (const WeightPart& p : w.parts) views.push_back(p.data), views.push_back(p.scales);
        ASSERT_TRUE(gpu.upload_views(views).ok());
      }
      for (const int past : {90, 600}) {
        auto cache = gpu.new_kv_cache(1, n_blocks, c.nkv, c.hd);
        BatchInfo fill;
        for (int p = 0; p <= past; ++p) fill.tokens.push_back(0), fill.positions.push_back(p), fill.seq_of.push_back(0);
        fill.seqs = {SeqInfo{0, past + 1, 0, table}};
        std::vector<float> kv = randn((past + 1) * c.nkv * c.hd), vv = randn((past + 1) * c.nkv * c.hd);
        for (size_t i = 0; i < vv.size(); ++i) vv[i] *= std::ldexp(1.0f, 3 * static_cast<int>(i / c.hd % c.nkv));
        gpu.kv_write(*cache, 0, gt(kv, {past + 1, c.nkv, c.hd}), gt(vv, {past + 1, c.nkv, c.hd}), fill);
        BatchInfo one;
        one.tokens = {0}, one.positions = {past}, one.seq_of = {0};
        one.seqs = {SeqInfo{0, 1, past, table}};
        const std::vector<float> s = randn(c.nh);
        Tensor sinks = gt(s, {c.nh});
        const AttentionParams ap{0.125f, 0, &sinks};
        Tensor a = gpu.attention(gt(randn(c.nh * c.hd), {1, c.nh, c.hd}), *cache, 0, one, ap).view({1, k});
        const std::vector<float> x = gpu.to_host(a);
        cudaDeviceSynchronize();  // (the backend's own stream)
        ASSERT_EQ(cudaMemset(a.data<float>(), 0xff, a.numel() * sizeof(float)), cudaSuccess);
        cudaDeviceSynchronize();
        const std::vector<float> got = gpu.to_host(gpu.linear(a, w, nullptr));
        const std::vector<float> want = gpu.to_host(gpu.linear(gt(x, {1, k}), w, nullptr));
        expect_close(want, got, linear_tol(x, w, 1),
                     std::string("staged O ") + weight_format_name(f) + " heads " + std::to_string(c.nh) + " x " +
                         std::to_string(c.hd) + " context " + std::to_string(past + 1));
      }
    }
  }
}

// Variants 0-2: small shapes (k not filling whole 4-block groups). 3-4: the FP4 tensor-core MoE kernels
// at shapes with several groups per row, split k and several tokens (NVFP4 with two parts per expert).
TEST_F(CudaOps, MoeRouteAndExperts) {
  // Variants 0, 5 and 6 route one token (the row-streaming kernels: MXFP4 small, NVFP4 in two parts with
  // biases in the halves layout, and MXFP4 with k that ends inside a 1024-element chunk); the others several (tensor-core decode kernels, grouped GEMMs). The
  // one-token variants run again with one fp16 per activation (x, then the GLU output): two roundings of
  // <= 2^-11 relative entering sums of random-sign terms, bounded as gemm_cuda_test bounds them, by 64 of
  // those at the output's scale (the GLU slopes stay below ~4 here).
  // Under NIBBLE_STREAM_SMS=n (ctest cuda_backend_test_few_sms) the one-token kernels' grids take at most n
  // SMs, so that the deferred finishes' flush every 32 units runs: the switch must have taken effect.
  if (const char* e = std::getenv("NIBBLE_STREAM_SMS"))
    ASSERT_LE(cuda::stream_grid_sms(), std::atoi(e)) << "NIBBLE_STREAM_SMS=" << e << " not applied";
  for (int run = 0; run < 10; ++run) {
    const bool fp16 = run >= 7;
    const int variant = fp16 ? std::array{0, 5, 6}[run - 7] : run;
    if (run == 0 || run == 7) ASSERT_TRUE(make_gpu(fp16));
    const int E = 8, top_k = variant >= 3 ? 4 : 3;
    // Variant 6 has gpt-oss's expert width: FC2 stages 4 x 2880 activations (48 KiB of shared memory).
    const int d_model = variant == 6 ? 1088 : variant >= 3 ? 640 : 64, d_ff = variant == 6 ? 2880 : variant >= 3 ? 352 : 96;
    const int64_t T = variant == 2 ? 5 : variant >= 5 ? 1 : variant >= 3 ? 3 : 1 + variant;
    std::vector<float> logits = randn(T * E);
    // Variant 2: logits in steps of 0.5, so that tokens have tied experts (ties go to the lower id).
    if (variant == 2)
      for (float& v : logits) v = std::round(v * 2.0f) / 2.0f;
    const RouterKind kind = variant % 3 == 0 ? RouterKind::kTopKThenSoftmax : RouterKind::kSoftmaxThenTopK;
    const Routes cr = cpu_.moe_route(cpu_t(logits, {T, E}), top_k, kind, variant == 1);
    const Routes gr = gpu_->moe_route(gpu_t(logits, {T, E}), top_k, kind, variant == 1);
    const std::vector<float> gw = gpu_->to_host(gr.weights);
    expect_close(cpu_.to_host(cr.weights), gw, {1e-6f}, "route weights");
    std::vector<int32_t> gids(T * top_k);
    cudaDeviceSynchronize();  // the backend works on its own non-blocking stream
    cudaMemcpy(gids.data(), gr.ids.data<int32_t>(), gids.size() * 4, cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < T * top_k; ++i) ASSERT_EQ(cr.ids.data<int32_t>()[i], gids[i]) << "route id " << i;

    MoeExperts ex;
    ex.n_experts = E;
    ex.d_expert = d_ff;
    ex.layout = variant % 3 == 0 ? GluLayout::kInterleaved : GluLayout::kHalves;
    const WeightFormat f = variant == 5                            ? WeightFormat::kNVFP4
                           : variant % 3 == 0                      ? WeightFormat::kMXFP4
                           : variant % 3 == 1                      ? WeightFormat::kNVFP4
                                                                   : WeightFormat::kBF16;
    for (int e = 0; e < E; ++e) {
      ex.fc1.push_back(make_weight(hb_, f, 2 * d_ff, d_model, f == WeightFormat::kNVFP4 ? 2 : 1));
      ex.fc2.push_back(make_weight(hb_, f, d_model, d_ff));
      upload(ex.fc1.back());
      upload(ex.fc2.back());
    }
    MoeExperts gex = ex;
    if (variant % 3 == 0 || variant == 5) {  // (5: the halves layout's up biases start d_ff into each row)
      const std::vector<float> b1 = randn(E * 2 * d_ff), b2 = randn(E * d_model);
      ex.fc1_bias = cpu_t(b1, {E, 2 * d_ff}), ex.fc2_bias = cpu_t(b2, {E, d_model});
      gex.fc1_bias = gpu_t(b1, {E, 2 * d_ff}), gex.fc2_bias = gpu_t(b2, {E, d_model});
    }
    const GluParams glu = variant % 3 == 0 ? GluParams{Activation::kGptOssClamped, 7.0f} : GluParams{};
    const std::vector<float> x = randn(T * d_model, 4.0f);
    const std::vector<float> want = cpu_.to_host(cpu_.moe_experts(cpu_t(x, {T, d_model}), cr, ex, glu));
    const std::vector<float> got = gpu_->to_host(gpu_->moe_experts(gpu_t(x, {T, d_model}), gr, gex, glu));
    std::vector<float> tol(want.size());  // fp32 sums of ~k products: an absolute floor plus relative
    float scale = 0.0f;
    for (float v : want) scale = std::max(scale, std::abs(v));
    for (size_t i = 0; i < want.size(); ++i)
      tol[i] = 2e-4f + 2e-5f * std::abs(want[i]) + (fp16 ? 64 * 0x1p-11f * scale : 0.0f);
    expect_close(want, got, tol, "moe_experts variant " + std::to_string(variant) + (fp16 ? " one fp16" : ""));
    // One token, FP4, gpt-oss's bounded GLU, one fp16: FC2 copies act as FC1 staged it (cuda::StagedActs, what
    // `got` took). The same act copied elsewhere is not staged: FC2 takes its maxima and converts it itself,
    // a per-row prescale instead of the fixed shift -- the same fp16 products, so the same sums up to values
    // below fp16's normal range (a wrong plane layout is off by the output's scale).
    if (T == 1 && fp16 && f != WeightFormat::kBF16 && glu.activation == Activation::kGptOssClamped) {
      const Tensor act = gpu_->moe_fc1(gpu_t(x, {T, d_model}), gr, gex, glu);
      const Tensor copy = gpu_t(gpu_->to_host(act), act.shape);
      // act's fp32 values poisoned (NaN): FC2 must read only the staged copy, or the output is NaN.
      // (Without the streaming kernels nothing reads the staged copy: FC2 reads act, so no poison.)
      if (fp4_stream_on()) cudaMemset(act.data<float>(), 0xff, act.numel() * sizeof(float));
      cudaDeviceSynchronize();
      const std::vector<float> staged = gpu_->to_host(gpu_->moe_fc2(act, gr, gex));
      const std::string what = "act staged by FC1, variant " + std::to_string(variant);
      expect_close(got, staged, {0.0f}, what);
      expect_close(gpu_->to_host(gpu_->moe_fc2(copy, gr, gex)), staged, {1e-6f * scale}, what + " vs not staged");
    }
    // With L2 prefetch hints for later weights (one token: issued by the FC2 kernel; else a launch after):
    // hints only, the same bits; and the plain call right after still gives them (the FC2 kernel's prefetch
    // argument shifts its others: a wrong layout there changes or breaks the output).
    {
      const std::vector<const Weight*> next = {&gex.fc1[0], &gex.fc2[E - 1]};
      const std::string what = "prefetching, variant " + std::to_string(variant) + (fp16 ? " one fp16" : "");
      expect_close(got, gpu_->to_host(gpu_->moe_experts_then_prefetch(gpu_t(x, {T, d_model}), gr, gex, glu, next)),
                   {0.0f}, what);
      expect_close(got, gpu_->to_host(gpu_->moe_experts(gpu_t(x, {T, d_model}), gr, gex, glu)), {0.0f},
                   "after " + what);
    }
    // One token, FP4 experts: the same routes deferred (Routes::logits; each FC1 and FC2 block selects them,
    // FC1's block 0 writes ids and weights): the same selection code on the same logits, so the same bits.
    if (T == 1 && f != WeightFormat::kBF16) {
      const Routes dr{gpu_->alloc(DType::kI32, {1, top_k}), gpu_->alloc(DType::kF32, {1, top_k}),
                      gpu_t(logits, {1, E}), kind, variant == 1};
      const std::vector<float> got_d = gpu_->to_host(gpu_->moe_experts(gpu_t(x, {T, d_model}), dr, gex, glu));
      const std::string what = "deferred routes, variant " + std::to_string(variant) + (fp16 ? " one fp16" : "");
      expect_close(got, got_d, {0.0f}, what);
      // With prefetch hints: the FC1 kernel issues them before its wait (deferred routes) -- hints only, the
      // same bits (a wrong layout of its new kernel argument would shift the others and change or break the
      // output), and the plain call right after still gives them. (That the hints are cleared is not visible
      // in any output: nothing here can check it.)
      const std::vector<const Weight*> next = {&gex.fc1[0], &gex.fc2[E - 1]};
      expect_close(got, gpu_->to_host(gpu_->moe_experts_then_prefetch(gpu_t(x, {T, d_model}), dr, gex, glu, next)),
                   {0.0f}, "prefetching, " + what);
      expect_close(got, gpu_->to_host(gpu_->moe_experts(gpu_t(x, {T, d_model}), dr, gex, glu)), {0.0f},
                   "after prefetching, " + what);
      expect_close(gw, gpu_->to_host(dr.weights), {0.0f}, "weights written by FC1, " + what);
      std::vector<int32_t> dids(top_k);
      cudaDeviceSynchronize();
      cudaMemcpy(dids.data(), dr.ids.data<int32_t>(), dids.size() * 4, cudaMemcpyDeviceToHost);
      for (int i = 0; i < top_k; ++i) ASSERT_EQ(gids[i], dids[i]) << "id " << i << " written by FC1, " << what;
      // One fp16 per activation: norm_route's deferred mode also stages h for FC1 (launch_norm_route's
      // staged_h), which FC1 copies; the same h copied elsewhere FC1 stages itself -- the same bits.
      if (fp16) {
        const Weight router = make_weight(hb_, WeightFormat::kBF16, E, d_model, 1, DType::kBF16, 0.1f);
        upload(router);
        const std::vector<float> nw = randn(d_model);
        Tensor gx = gpu_t(x, {1, d_model});
        const NormRoutes nr = gpu_->add_rms_norm_route(gx, Tensor(), gpu_t(nw, {d_model}), 1e-5f, router, nullptr,
                                                       top_k, kind, variant == 1);
        ASSERT_FALSE(nr.routes.logits.empty()) << what;
        const Tensor h_copy = gpu_t(gpu_->to_host(nr.h), nr.h.shape);
        // h's fp32 values poisoned (NaN): FC1 must read only the staged copy, or the output is NaN
        // (streaming kernels only, as above).
        if (fp4_stream_on()) cudaMemset(nr.h.data<float>(), 0xff, nr.h.numel() * sizeof(float));
        cudaDeviceSynchronize();
        const std::vector<float> staged = gpu_->to_host(gpu_->moe_experts(nr.h, nr.routes, gex, glu));
        expect_close(gpu_->to_host(gpu_->moe_experts(h_copy, nr.routes, gex, glu)), staged, {0.0f},
                     "x staged by norm_route, " + what);
      }
      if (kind == RouterKind::kSoftmaxThenTopK) {  // qwen3_moe's renormalized routes, deferred and not
        const Routes rr = gpu_->moe_route(gpu_t(logits, {1, E}), top_k, kind, true);
        const Routes dr2{gpu_->alloc(DType::kI32, {1, top_k}), gpu_->alloc(DType::kF32, {1, top_k}),
                         gpu_t(logits, {1, E}), kind, true};
        expect_close(gpu_->to_host(gpu_->moe_experts(gpu_t(x, {T, d_model}), rr, gex, glu)),
                     gpu_->to_host(gpu_->moe_experts(gpu_t(x, {T, d_model}), dr2, gex, glu)), {0.0f},
                     "renormalized, " + what);
        expect_close(gpu_->to_host(rr.weights), gpu_->to_host(dr2.weights), {0.0f}, "renormalized weights, " + what);
      }
    }
  }
}

// The block-per-row RMSNorm (rows of 512 and more) against the CPU, with and without the residual add (x
// written back): rows held in registers with one float4 per thread (gpt-oss's 2880) and two (6000), rows
// too long to hold (16388: the loop), and rows that are not whole float4s (1030: the scalar path).
TEST_F(CudaOps, RmsNormLongRows) {
  for (const int64_t d : {2880, 6000, 16388, 1030}) {
    for (const int64_t rows : {1, 3}) {
      const std::string what = "d " + std::to_string(d) + ", rows " + std::to_string(rows);
      const std::vector<float> x = randn(rows * d, 3.0f), y = randn(rows * d), w = randn(d);
      expect_close(cpu_.to_host(cpu_.rms_norm(cpu_t(x, {rows, d}), cpu_t(w, {d}), 1e-5f)),
                   gpu_->to_host(gpu_->rms_norm(gpu_t(x, {rows, d}), gpu_t(w, {d}), 1e-5f)), {2e-5f},
                   "rms_norm " + what);
      Tensor cx = cpu_t(x, {rows, d}), gx = gpu_t(x, {rows, d});
      const Tensor ch = cpu_.add_rms_norm(cx, cpu_t(y, {rows, d}), cpu_t(w, {d}), 1e-5f);
      const Tensor gh = gpu_->add_rms_norm(gx, gpu_t(y, {rows, d}), gpu_t(w, {d}), 1e-5f);
      expect_close(cpu_.to_host(ch), gpu_->to_host(gh), {2e-5f}, "add_rms_norm " + what);
      expect_close(cpu_.to_host(cx), gpu_->to_host(gx), {0.0f}, "add_rms_norm x += y, " + what);
    }
  }
}

// add_rms_norm_route against the CPU's add_rms_norm, linear and moe_route in turn: the one-kernel decode
// path (BF16 router, up to 16 tokens; gpt-oss-120b's and Qwen3-30B-A3B's shapes, no residual, run twice so
// the arrival counters must have been reset) and the fallbacks (17 tokens; an fp32 router). The one-token
// case defers its routes (Routes::logits, the residual sum in a new buffer); resolve_routes selects them.
// Logits with no maximum left (all NaN, all -inf, finite ones fewer than top_k): the GPU's ids equal the
// CPU's (NaN ranks as -inf, ties to the lower id), so they are in range and distinct -- an id past the
// expert table made the expert kernels read out of bounds. 8 experts: route_warp's register path; 300: its
// shared-memory path.
TEST_F(CudaOps, MoeRouteNonFiniteLogits) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const int E : {8, 300}) {
    const int T = 4, top_k = 4;
    std::vector<float> logits = randn(T * E);
    for (int e = 0; e < E; ++e) {
      logits[0 * E + e] = nan;                              // token 0: all NaN
      logits[1 * E + e] = -inf;                             // token 1: all -inf
      if (e % 3 != 1) logits[2 * E + e] = e % 2 ? -inf : nan;  // token 2: a few finite, the rest not
    }
    // token 3: finite (the ordinary path in the same launch)
    for (const RouterKind kind : {RouterKind::kTopKThenSoftmax, RouterKind::kSoftmaxThenTopK}) {
      const Routes cr = cpu_.moe_route(cpu_t(logits, {T, E}), top_k, kind, false);
      const Routes gr = gpu_->moe_route(gpu_t(logits, {T, E}), top_k, kind, false);
      std::vector<int32_t> gids(T * top_k);
      cudaDeviceSynchronize();  // the backend works on its own non-blocking stream
      ASSERT_EQ(cudaMemcpy(gids.data(), gr.ids.data<int32_t>(), gids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < top_k; ++i) {
          const int32_t id = gids[t * top_k + i];
          ASSERT_TRUE(id >= 0 && id < E) << "E " << E << " token " << t << " id " << id;
          for (int j = 0; j < i; ++j) ASSERT_NE(gids[t * top_k + j], id) << "E " << E << " token " << t;
          EXPECT_EQ(cr.ids.data<int32_t>()[t * top_k + i], id) << "E " << E << " token " << t << " rank " << i;
        }
      }
      // The finite token's weights as usual.
      const std::vector<float> gw = gpu_->to_host(gr.weights), cw = cpu_.to_host(cr.weights);
      for (int i = 0; i < top_k; ++i) EXPECT_NEAR(cw[3 * top_k + i], gw[3 * top_k + i], 1e-6f) << "E " << E;
    }
  }
}

TEST_F(CudaOps, AddRmsNormRoute) {
  struct Case {
    int64_t T, d;
    int E, top_k;
    RouterKind kind;
    bool renormalize, bias, residual;
    DType dense;
  };
  const Case cases[] = {
      {1, 2880, 128, 4, RouterKind::kTopKThenSoftmax, false, true, true, DType::kBF16},
      {3, 2048, 128, 8, RouterKind::kSoftmaxThenTopK, true, false, true, DType::kBF16},
      {16, 64, 32, 4, RouterKind::kTopKThenSoftmax, false, true, false, DType::kBF16},
      {17, 640, 8, 2, RouterKind::kSoftmaxThenTopK, false, false, true, DType::kBF16},
      {2, 640, 8, 2, RouterKind::kTopKThenSoftmax, false, true, true, DType::kF32},
  };
  for (size_t ci = 0; ci < std::size(cases); ++ci) {
    const Case& c = cases[ci];
    const std::string what = "T " + std::to_string(c.T) + ", d " + std::to_string(c.d) + ", E " + std::to_string(c.E);
    // The first three cases are the one-kernel path, the last two the fallbacks (as the comment says).
    cuda::DevWeight shape;
    shape.kind = c.dense == DType::kF32 ? cuda::WKind::kF32 : cuda::WKind::kBF16;
    shape.n = c.E, shape.k = static_cast<int32_t>(c.d), shape.n_parts = 1, shape.vec_ok = true;
    ASSERT_EQ(cuda::norm_route_supports(shape, c.T, c.top_k), ci < 3) << what;
    const Weight router = make_weight(hb_, WeightFormat::kBF16, c.E, c.d, 1, c.dense, 0.1f);
    upload(router);
    const std::vector<float> x = randn(c.T * c.d, 3.0f), y = randn(c.T * c.d), w = randn(c.d), bias = randn(c.E);
    const Tensor cb = cpu_t(bias, {c.E}), gb = gpu_t(bias, {c.E});
    const Tensor cy = c.residual ? cpu_t(y, {c.T, c.d}) : Tensor(), gy = c.residual ? gpu_t(y, {c.T, c.d}) : Tensor();
    Tensor cx = cpu_t(x, {c.T, c.d});
    const NormRoutes want = cpu_.add_rms_norm_route(cx, cy, cpu_t(w, {c.d}), 1e-5f, router, c.bias ? &cb : nullptr,
                                                    c.top_k, c.kind, c.renormalize);
    for (int run = 0; run < 2; ++run) {
      Tensor gx = gpu_t(x, {c.T, c.d});
      const NormRoutes got = gpu_->add_rms_norm_route(gx, gy, gpu_t(w, {c.d}), 1e-5f, router, c.bias ? &gb : nullptr,
                                                      c.top_k, c.kind, c.renormalize);
      expect_close(cpu_.to_host(cx), gpu_->to_host(gx), {0.0f}, "residual sum, " + what);
      expect_close(cpu_.to_host(want.h), gpu_->to_host(got.h), {2e-5f * 4}, "h, " + what);
      ASSERT_EQ(!got.routes.logits.empty(), c.T == 1) << "deferred routes, " << what;
      const Routes gr = gpu_->resolve_routes(got.routes);
      ASSERT_TRUE(gr.logits.empty()) << what;
      // Softmaxes of logits summed in another order.
      expect_close(cpu_.to_host(want.routes.weights), gpu_->to_host(gr.weights), {1e-4f}, "weights, " + what);
      std::vector<int32_t> gids(c.T * c.top_k);
      cudaDeviceSynchronize();  // the backend works on its own non-blocking stream
      cudaMemcpy(gids.data(), gr.ids.data<int32_t>(), gids.size() * 4, cudaMemcpyDeviceToHost);
      for (int64_t i = 0; i < c.T * c.top_k; ++i)
        ASSERT_EQ(want.routes.ids.data<int32_t>()[i], gids[i]) << "id " << i << ", " << what << ", run " << run;
    }
  }
}

TEST_F(CudaOps, RequantizeMatchesHostEncoders) {
  const Weight w = make_weight(hb_, WeightFormat::kBF16, 24, 128);
  upload(w);
  std::vector<float> row(128);
  for (WeightFormat f : {WeightFormat::kFP8E4M3, WeightFormat::kMXFP4, WeightFormat::kNVFP4}) {
    auto q = gpu_->requantize(w, f);
    ASSERT_TRUE(q.ok()) << q.status().message();
    const WeightPart& p = q->parts[0];
    std::vector<uint8_t> codes(p.data.nbytes()), scales(p.scales.nbytes());
    cudaDeviceSynchronize();  // the backend works on its own non-blocking stream
    cudaMemcpy(codes.data(), p.data.data, codes.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(scales.data(), p.scales.data, scales.size(), cudaMemcpyDeviceToHost);
    float amax = 0;
    for (int64_t r = 0; r < 24; ++r) {
      dequantize_row(w, r, row.data());
      for (float v : row) amax = std::max(amax, std::abs(v));
    }
    for (int64_t r = 0; r < 24; ++r) {
      dequantize_row(w, r, row.data());
      if (f == WeightFormat::kMXFP4) {
        for (int b = 0; b < 4; ++b) {
          uint8_t c[16];
          ASSERT_EQ(fmt::mxfp4_encode_block(&row[32 * b], c), scales[r * 4 + b]);
          ASSERT_EQ(0, std::memcmp(c, &codes[r * 64 + b * 16], 16)) << "mxfp4 row " << r;
        }
      } else if (f == WeightFormat::kNVFP4) {
        ASSERT_EQ(p.global_scale, fmt::nvfp4_global_scale(amax));
        for (int b = 0; b < 8; ++b) {
          uint8_t c[8];
          ASSERT_EQ(fmt::nvfp4_encode_block(&row[16 * b], p.global_scale, c), scales[r * 8 + b]);
          ASSERT_EQ(0, std::memcmp(c, &codes[r * 64 + b * 8], 8)) << "nvfp4 row " << r;
        }
      } else {
        float m = 0, s;
        for (float v : row) m = std::max(m, std::abs(v));
        std::memcpy(&s, &scales[r * 4], 4);
        ASSERT_EQ(s, m / 448.0f);
        for (int i = 0; i < 128; ++i) ASSERT_EQ(codes[r * 128 + i], fmt::float_to_e4m3(row[i] / s)) << r << " " << i;
      }
    }
    // The re-quantized weight runs through linear like any other.
    std::vector<std::vector<uint8_t>> keep;
    const Weight hq = host_copy(*q, keep);
    const std::vector<float> x = randn(128);
    const std::vector<float> want = cpu_.to_host(cpu_.linear(cpu_t(x, {1, 128}), hq, nullptr));
    const std::vector<float> got = gpu_->to_host(gpu_->linear(gpu_t(x, {1, 128}), *q, nullptr));
    std::vector<float> tol = linear_tol(x, hq, 1);
    expect_close(want, got, tol, std::string("requantized ") + weight_format_name(f));
  }
}

TEST_F(CudaOps, RandomWeightsHaveTheRequestedSpread) {
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kFP8E4M3, WeightFormat::kMXFP4, WeightFormat::kNVFP4}) {
    const Weight w = gpu_->random_weight(f, 64, 256, 0.02f, 7, "r");
    ASSERT_TRUE(gpu_->synchronize().ok());
    std::vector<std::vector<uint8_t>> keep;
    const Weight host = host_copy(w, keep);
    std::vector<float> row(256);
    double ss = 0;
    for (int r = 0; r < 64; ++r) {
      dequantize_row(host, r, row.data());
      for (float v : row) {
        ASSERT_TRUE(std::isfinite(v));
        ss += v * v;
      }
    }
    const double rms = std::sqrt(ss / (64 * 256));
    EXPECT_GT(rms, 0.005) << weight_format_name(f);
    EXPECT_LT(rms, 0.08) << weight_format_name(f);
  }
}

}  // namespace
}  // namespace nb

namespace nb {
namespace {

// Residual add + RMSNorm: the sum is fp32 on both sides (exact); the norm has rms_norm's bound. Both
// kernel shapes: a block per long row (d >= 512) and a warp per short row.
TEST_F(CudaOps, AddRmsNorm) {
  for (auto [rows, d] : {std::pair<int64_t, int64_t>{3, 2880}, {5, 64}}) {
    const std::vector<float> x = randn(rows * d, 3.0f), y = randn(rows * d), w = randn(d);
    Tensor cx = cpu_t(x, {rows, d}), gx = gpu_t(x, {rows, d});
    const std::vector<float> want = cpu_.to_host(cpu_.add_rms_norm(cx, cpu_t(y, {rows, d}), cpu_t(w, {d}), 1e-5f));
    const std::vector<float> got = gpu_->to_host(gpu_->add_rms_norm(gx, gpu_t(y, {rows, d}), gpu_t(w, {d}), 1e-5f));
    expect_close(cpu_.to_host(cx), gpu_->to_host(gx), {0.0f}, "add_rms_norm sum, d " + std::to_string(d));
    expect_close(want, got, {2e-5f * 4}, "add_rms_norm, d " + std::to_string(d));
  }
}

// The cache of `layer` as floats, whatever its element type.
std::vector<float> cache_floats(const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<uint8_t> raw(n * dtype_bits(t.dtype) / 8);
  cudaDeviceSynchronize();  // the backend works on its own non-blocking stream
  cudaMemcpy(raw.data(), t.data<uint8_t>(), raw.size(), cudaMemcpyDeviceToHost);
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    if (t.dtype == DType::kF32) out[i] = reinterpret_cast<const float*>(raw.data())[i];
    else if (t.dtype == DType::kBF16) out[i] = fmt::bf16_to_float(reinterpret_cast<const uint16_t*>(raw.data())[i]);
    else out[i] = fmt::e4m3_to_float(raw[i]);
  }
  return out;
}

// Fused QKV epilogue vs the CPU ops (split, q/k norm, rope, kv_write) for every RoPE variant, with and
// without q/k norms, into fp32, BF16 and FP8 caches; two sequences over scrambled blocks.
TEST_F(CudaOps, QkvRopeKvWrite) {
  const int nh = 8, nkv = 2, hd = 64, n_blocks = 12;
  BatchInfo b;
  const std::vector<int32_t> t0 = {7, 2, 9}, t1 = {4, 11};
  for (int i = 0; i < 3; ++i) b.tokens.push_back(1), b.positions.push_back(30 + i), b.seq_of.push_back(0);
  for (int i = 0; i < 2; ++i) b.tokens.push_back(1), b.positions.push_back(17 + i), b.seq_of.push_back(1);
  b.seqs = {SeqInfo{0, 3, 30, t0}, SeqInfo{3, 2, 17, t1}};
  const int64_t T = b.n_tokens();
  RopeConfig yarn;
  yarn.type = RopeType::kYarn;
  yarn.theta = 150000, yarn.factor = 32, yarn.truncate = false, yarn.original_max_position_embeddings = 4096;
  RopeConfig llama3;
  llama3.type = RopeType::kLlama3;
  llama3.theta = 500000, llama3.factor = 8, llama3.low_freq_factor = 1, llama3.high_freq_factor = 4;
  llama3.original_max_position_embeddings = 8192;
  RopeConfig plain;
  plain.theta = 1000000;
  const std::vector<RopeTable> ropes = {make_rope_table(yarn, hd), make_rope_table(llama3, hd), make_rope_table(plain, hd)};
  for (DType kv : {DType::kF32, DType::kBF16, DType::kF8_E4M3}) {
    CudaBackendOptions o;
    o.poison = true;
    o.kv_cache_dtype = kv;
    auto g = CudaBackend::create(o);
    ASSERT_TRUE(g.ok());
    CudaBackend& gpu = **g;
    for (int ri = 0; ri < 3; ++ri) {
      for (bool norms : {false, true}) {
        const RopeTable& rope = ropes[ri];
        const std::vector<float> qkv = randn(T * (nh + 2 * nkv) * hd, 2.0f), qn = randn(hd), kn = randn(hd);
        Tensor cqn = cpu_t(qn, {hd}), ckn = cpu_t(kn, {hd});
        Tensor gqn = gpu.upload(TensorView{qn.data(), DType::kF32, {hd}});
        Tensor gkn = gpu.upload(TensorView{kn.data(), DType::kF32, {hd}});
        const QkvParams cp{nh, nkv, hd, norms ? &cqn : nullptr, norms ? &ckn : nullptr, 1e-6f, &rope};
        const QkvParams gp{nh, nkv, hd, norms ? &gqn : nullptr, norms ? &gkn : nullptr, 1e-6f, &rope};
        auto cc = cpu_.new_kv_cache(1, n_blocks, nkv, hd);
        auto gc = gpu.new_kv_cache(1, n_blocks, nkv, hd);
        const std::vector<float> want =
            cpu_.to_host(cpu_.qkv_rope_kv_write(cpu_t(qkv, {T, (nh + 2 * nkv) * hd}), cp, *cc, 0, b));
        const std::vector<float> got = gpu.to_host(
            gpu.qkv_rope_kv_write(gpu.upload(TensorView{qkv.data(), DType::kF32, {T, (nh + 2 * nkv) * hd}}), gp, *gc, 0, b));
        // |values| up to ~10 (|x| ~ 2 x 4 sigma, norm weights ~ 3); rope and norm are a few fp32 ops each, and
        // the angle p * inv_freq is the same fp32 product on both sides.
        const std::string what = "qkv_rope_kv_write kv " + std::string(dtype_name(kv)) + " rope " +
                                 std::to_string(ri) + (norms ? " norms" : "");
        expect_close(want, got, {1e-4f}, what + " q");
        // The cache: fp32 the same bound; BF16 and FP8 the element rounding (2^-8 and 2^-4 relative, half
        // an ulp) of the CPU's fp32 value on top, plus FP8's smallest subnormal step.
        for (int kv_i = 0; kv_i < 2; ++kv_i) {
          const std::vector<float> cw = cpu_.to_host(kv_i ? cc->v[0] : cc->k[0]);
          const std::vector<float> gw = cache_floats(kv_i ? gc->v[0] : gc->k[0]);
          std::vector<float> tol(cw.size());
          const float rel = kv == DType::kF32 ? 0.0f : kv == DType::kBF16 ? 1.0f / 256 : 1.0f / 16;
          const float abs_floor = kv == DType::kF8_E4M3 ? 1.0f / 512 : 0.0f;
          for (size_t i = 0; i < cw.size(); ++i) tol[i] = 1e-4f + rel * std::abs(cw[i]) + abs_floor;
          expect_close(cw, gw, tol, what + (kv_i ? " v cache" : " k cache"));
        }
      }
    }
  }
}

// The attention head in one kernel at one token (norm_qkv_rope_kv_write: add + RMSNorm, the FP4 QKV
// projection with its bias, RoPE, the K/V write; gemv_fp4_stream.cu) against the CPU's ops in turn: MXFP4
// (one part) and NVFP4 (q, k, v parts), with and without the residual add, F32 / BF16 / FP8 caches; gpt-oss's
// head shape (head_dim 64, d 2880: three 1024-element chunks, the last partial) and Llama's (head_dim 128,
// d 4096: four chunks).
TEST_F(CudaOps, NormQkvRopeOneToken) {
  struct Shape {
    int nh, nkv, hd, d;
  };
  // gpt-oss's head (2560 row pairs) and Llama-3.1-8B's (3072, k = 4096) take the one-round grid where 16
  // warps per SM need two rounds (H100 / H200: 132 SMs x 20 and x 24 warps); the small ones the round-robin grid.
  for (const Shape sh : {Shape{8, 2, 64, 2880}, Shape{4, 2, 128, 4096}, Shape{64, 8, 64, 2880}, Shape{32, 8, 128, 4096}})
  for (DType kv : {DType::kF32, DType::kBF16, DType::kF8_E4M3}) {
    const int nh = sh.nh, nkv = sh.nkv, hd = sh.hd, d = sh.d, n_blocks = 4, n = (nh + 2 * nkv) * hd;
    RopeConfig yarn;
    yarn.type = RopeType::kYarn;
    yarn.theta = 150000, yarn.factor = 32, yarn.truncate = false, yarn.original_max_position_embeddings = 4096;
    const RopeTable rope = make_rope_table(yarn, hd);
    BatchInfo b;  // position 37: block 2 of the sequence's table, physical block 3
    b.tokens = {1}, b.positions = {37}, b.seq_of = {0};
    b.seqs = {SeqInfo{0, 1, 37, {1, 0, 3}}};
    ASSERT_TRUE(make_gpu(true, kv));  // (one fp16 per activation: the fused kernel's only mode)
    for (WeightFormat f : {WeightFormat::kMXFP4, WeightFormat::kNVFP4}) {
      for (bool residual : {false, true}) {
        const std::string what = "hd " + std::to_string(hd) + ", kv " + std::string(dtype_name(kv)) + " " +
                                 std::string(weight_format_name(f)) + (residual ? " residual" : "");
        const Weight w = make_weight(hb_, f, n, d, f == WeightFormat::kNVFP4 ? 3 : 1);
        upload(w);
        const std::vector<float> x = randn(d, 3.0f), y = randn(d), nw = randn(d), bias = randn(n);
        const Tensor cb = cpu_t(bias, {n}), gb = gpu_t(bias, {n});
        const QkvParams qp{nh, nkv, hd, nullptr, nullptr, 1e-5f, &rope};
        auto cc = cpu_.new_kv_cache(1, n_blocks, nkv, hd);
        auto gc = gpu_->new_kv_cache(1, n_blocks, nkv, hd);
        Tensor cx = cpu_t(x, {1, d}), gx = gpu_t(x, {1, d});
        const Tensor cy = residual ? cpu_t(y, {1, d}) : Tensor(), gy = residual ? gpu_t(y, {1, d}) : Tensor();
        const std::vector<float> want =
            cpu_.to_host(cpu_.norm_qkv_rope_kv_write(cx, cy, cpu_t(nw, {d}), 1e-5f, w, &cb, qp, *cc, 0, b));
        const std::vector<float> got =
            gpu_->to_host(gpu_->norm_qkv_rope_kv_write(gx, gy, gpu_t(nw, {d}), 1e-5f, w, &gb, qp, *gc, 0, b));
        expect_close(cpu_.to_host(cx), gpu_->to_host(gx), {0.0f}, "x + y, " + what);
        // Bounds: the linear's (one fp16 per activation: 2^-11 relative, as the stream GEMV tests) on the qkv
        // rows, through RoPE (|cos|, |sin| <= the attention scale) onto each output pair.
        Tensor h = residual ? cpu_t(x, {1, d}) : Tensor();
        const Tensor hn = residual ? cpu_.add_rms_norm(h, cy, cpu_t(nw, {d}), 1e-5f)
                                   : cpu_.rms_norm(cpu_t(x, {1, d}), cpu_t(nw, {d}), 1e-5f);
        const std::vector<float> lt = linear_tol(cpu_.to_host(hn), w, 1, 0x1p-11);
        const float as = rope.attention_scale;
        auto pair_tol = [&](int row) {  // row of qkv -> the bound of its rotated value
          const int head = row / hd, i = row % hd, a = head * hd + i % (hd / 2);
          return as * (lt[a] + lt[a + hd / 2]) + 1e-4f;
        };
        std::vector<float> qtol(nh * hd);
        for (int r = 0; r < nh * hd; ++r) qtol[r] = pair_tol(r);
        expect_close(want, got, qtol, "q, " + what);
        const float rel = kv == DType::kF32 ? 0.0f : kv == DType::kBF16 ? 1.0f / 256 : 1.0f / 16;
        const float floor = kv == DType::kF8_E4M3 ? 1.0f / 512 : 0.0f;
        for (int kv_i = 0; kv_i < 2; ++kv_i) {
          const std::vector<float> cw = cpu_.to_host(kv_i ? cc->v[0] : cc->k[0]);
          const std::vector<float> gw = cache_floats(kv_i ? gc->v[0] : gc->k[0]);
          std::vector<float> tol(cw.size());
          for (size_t i = 0; i < cw.size(); ++i) {
            const int row = static_cast<int>(i % (nkv * hd)) + (nh + kv_i * nkv) * hd;  // the slot's qkv row
            tol[i] = (kv_i ? lt[row] + 1e-4f : pair_tol(row)) + rel * std::abs(cw[i]) + floor;
          }
          expect_close(cw, gw, tol, what + (kv_i ? " v cache" : " k cache"));
        }
      }
    }
  }
}

// Logits [rows, vocab] on both backends, every row the same.
std::vector<float> repeat_rows(const std::vector<float>& row, int64_t rows) {
  std::vector<float> out;
  for (int64_t r = 0; r < rows; ++r) out.insert(out.end(), row.begin(), row.end());
  return out;
}

// Greedy: the host's argmax exactly, ties to the lowest id, on a gpt-oss sized vocabulary; top-k 1,
// a tiny top-p and min-p 1 reduce to it too.
TEST_F(CudaOps, SampleGreedyIsHostArgmax) {
  const int64_t vocab = 201088, rows = 6;
  std::vector<float> l = randn(rows * vocab, 3.0f);
  l[1 * vocab + 5000] = l[1 * vocab + 9000] = 50.0f;  // a tie: id 5000 wins
  l[2 * vocab + vocab - 1] = 60.0f;                   // the last id
  l[3 * vocab + 0] = 60.0f;                           // the first id
  for (int64_t i = 0; i < vocab; ++i) l[4 * vocab + i] = -1.0f;  // all equal: id 0
  Tensor g = gpu_t(l, {rows, vocab});
  std::vector<int32_t> want(rows);
  for (int64_t r = 0; r < rows; ++r) want[r] = argmax(std::span<const float>(l.data() + r * vocab, vocab));
  EXPECT_EQ(want[1], 5000);
  std::vector<SampleSpec> greedy(rows);
  EXPECT_EQ(gpu_->sample(g, greedy), want);
  EXPECT_EQ(cpu_.sample(cpu_t(l, {rows, vocab}), greedy), want);
  for (double u : {0.0, 0.5, 0.999999}) {
    std::vector<SampleSpec> k1(rows, SampleSpec{0.8f, 1.0f, 1, 0.0f, u});
    EXPECT_EQ(gpu_->sample(g, k1), want) << "top_k 1, u " << u;
    std::vector<SampleSpec> p0(rows, SampleSpec{0.8f, 1e-6f, 0, 0.0f, u});
    std::vector<int32_t> w2 = want;
    w2[4] = 0;
    EXPECT_EQ(gpu_->sample(g, p0), w2) << "top_p 1e-6, u " << u;
  }
  // min_p 1 keeps the top probability only (no ties in rows 0, 2, 3, 5).
  std::vector<SampleSpec> m1(rows, SampleSpec{1.0f, 1.0f, 0, 1.0f, 0.7});
  const std::vector<int32_t> got = gpu_->sample(g, m1);
  for (int r : {0, 2, 3, 5}) EXPECT_EQ(got[r], want[r]) << "min_p 1, row " << r;
  // Greedy and sampled rows in one call (two kernels, each skipping the other's rows), twice (the split
  // argmax's arrival counters must be left at zero).
  std::vector<SampleSpec> mixed(rows);
  for (int64_t r = 1; r < rows; r += 2) mixed[r] = SampleSpec{0.8f, 1e-6f, 0, 0.0f, 0.5};
  EXPECT_EQ(gpu_->sample(g, mixed), want);
  EXPECT_EQ(gpu_->sample(g, mixed), want);
  // Vocabularies with fewer elements than the argmax has slices (empty slices) or a few per slice; ties.
  for (int64_t v : {1, 5, 40, 97}) {
    std::vector<float> sl = randn(3 * v, 2.0f);
    if (v > 3) sl[v + 1] = sl[v + v - 1] = 30.0f;  // row 1: a tie between ids 1 and v - 1
    std::vector<int32_t> sw(3);
    for (int64_t r = 0; r < 3; ++r) sw[r] = argmax(std::span<const float>(sl.data() + r * v, v));
    EXPECT_EQ(gpu_->sample(gpu_t(sl, {3, v}), std::vector<SampleSpec>(3)), sw) << "vocab " << v;
  }
  // More rows than one launch's grid holds (65535): the split argmax in two launches.
  const int64_t many = 65537, v = 8;
  const std::vector<float> ml = randn(many * v, 2.0f);
  std::vector<int32_t> mw(many);
  for (int64_t r = 0; r < many; ++r) mw[r] = argmax(std::span<const float>(ml.data() + r * v, v));
  EXPECT_EQ(gpu_->sample(gpu_t(ml, {many, v}), std::vector<SampleSpec>(many)), mw) << "65537 rows";
}

// Stratified draws: row i gets u = (i + 0.5) / N, so each token's count is N times its probability to
// within one or two, on the host (sorted order) and the GPU (id order) alike; counts must agree to +-2.
// Also the same specs twice give the same ids (the draw is the host's, so a seed reproduces a stream).
void expect_same_distribution(CudaOps* t, CpuBackend& cpu, CudaBackend& gpu, const std::vector<float>& row,
                              SampleSpec spec, int64_t n, const std::string& what) {
  (void)t;
  const int64_t vocab = static_cast<int64_t>(row.size());
  const std::vector<float> l = repeat_rows(row, n);
  std::vector<SampleSpec> specs(n, spec);
  for (int64_t i = 0; i < n; ++i) specs[i].u = (i + 0.5) / n;
  Tensor ct = cpu.alloc(DType::kF32, {n, vocab});
  std::copy(l.begin(), l.end(), ct.data<float>());
  Tensor gt = gpu.upload(TensorView{l.data(), DType::kF32, {n, vocab}});
  const std::vector<int32_t> want = cpu.sample(ct, specs), got = gpu.sample(gt, specs);
  EXPECT_EQ(gpu.sample(gt, specs), got) << what << ": not reproducible";
  std::map<int32_t, int> cw, cg;
  for (int32_t id : want) ++cw[id];
  for (int32_t id : got) ++cg[id];
  for (auto& [id, c] : cw) EXPECT_NEAR(cg[id], c, 2) << what << ": token " << id;
  for (auto& [id, c] : cg) EXPECT_NEAR(cw[id], c, 2) << what << ": token " << id;
}

TEST_F(CudaOps, SampleMatchesHostDistribution) {
  // A small vocabulary with a tie, and a 4096-token one with realistic spread (the host sorts every row).
  std::vector<float> small = {1.0f, 2.5f, 0.3f, 2.5f, -1.0f, 1.7f, 0.0f, 2.2f};
  const std::vector<float> big = randn(4096, 2.5f);
  const SampleSpec specs[] = {
      {1.0f, 1.0f, 0, 0.0f, 0},   {0.7f, 1.0f, 0, 0.0f, 0},  {1.3f, 1.0f, 5, 0.0f, 0},
      {1.0f, 0.8f, 0, 0.0f, 0},   {0.9f, 0.9f, 4, 0.0f, 0},  {1.0f, 1.0f, 0, 0.2f, 0},
      {1.1f, 0.95f, 6, 0.05f, 0}, {1.0f, 1.0f, 2, 0.0f, 0},  {1.0f, 0.5f, 3, 0.0f, 0},
  };
  for (const SampleSpec& s : specs) {
    const std::string what = "T " + std::to_string(s.temperature) + " top_p " + std::to_string(s.top_p) +
                             " top_k " + std::to_string(s.top_k) + " min_p " + std::to_string(s.min_p);
    expect_same_distribution(this, cpu_, *gpu_, small, s, 4000, "vocab 8, " + what);
    SampleSpec sb = s;
    if (sb.top_k > 0) sb.top_k *= 10;
    expect_same_distribution(this, cpu_, *gpu_, big, sb, 1000, "vocab 4096, " + what);
  }
}

}  // namespace
}  // namespace nb

namespace nb {
namespace {

// A KV cache larger than the GPU is one line naming it and exit status 1, not an abort. (threadsafe
// death tests re-run the binary, so the child has a fresh CUDA context.)
TEST_F(CudaOps, KvCacheTooLargeIsOneLineError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(gpu_->new_kv_cache(64, 4'000'000, 8, 128), ::testing::ExitedWithCode(1),
              "^nibble: error: out of GPU memory allocating [0-9.]+ GiB for the KV cache \\(4000000 blocks of 16 "
              "tokens, 64 layers\\) \\(free [0-9.]+ GiB of [0-9.]+ GiB\\); lower --max-model-len");
}

}  // namespace
}  // namespace nb
