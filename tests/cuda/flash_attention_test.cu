// The tiled prefill attention (kernels/flash_attention.cu) against the CPU backend's attention, forced for
// every sequence and mixed with the split kernel in one step (chunks beside decodes), on fresh random
// q/k/v (seed printed), outputs poisoned: every cache kind, GQA ratios 1..64 (and 3, which does not divide
// a tile), head dims 16..128, sinks, windows smaller and larger than the context, n_past > 0, several
// sequences of odd lengths in one batch over scrambled blocks. K and V are rounded to the cache kind on
// the host first, so the CPU sees exactly the cached values and the bound covers only the kernel's
// operand rounding (Q and P to bf16 / fp16, or the fp32 cache's hi+lo split) and summation order.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "formats/blocks.h"
#include "support/random_inputs.h"

namespace nb {
namespace {

using test::HostBytes;
using test::randn;
using test::rng;

// The value a cache of `dt` stores for x.
float cached(DType dt, float x) {
  if (dt == DType::kBF16) return fmt::bf16_to_float(fmt::float_to_bf16(x));
  if (dt == DType::kF8_E4M3) return fmt::e4m3_to_float(fmt::float_to_e4m3(x));
  return x;
}

// Relative rounding of one product q k (or p v) in the kernel: bf16 operands 2^-9 each side (Q rounded,
// K exact), fp16 2^-12, the fp32 cache's hi+lo split ~3 * 2^-18; doubled for margin.
double operand_eps(DType dt) {
  if (dt == DType::kBF16) return std::ldexp(1.0, -8);
  if (dt == DType::kF8_E4M3) return std::ldexp(1.0, -11);
  return std::ldexp(1.0, -15);
}

struct Case {
  int n_heads, n_kv_heads, head_dim, window;
  bool sinks;
  std::vector<std::pair<int, int>> seqs;  // (n_past, n_new)
};

std::string describe(const Case& c, DType dt) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s heads %d/%d head_dim %d window %d%s seqs",
                std::string(dtype_name(dt)).c_str(), c.n_heads, c.n_kv_heads, c.head_dim, c.window,
                c.sinks ? " sinks" : "");
  std::string s = buf;
  for (auto [p, n] : c.seqs) s += " " + std::to_string(p) + "+" + std::to_string(n);
  return s;
}

class FlashAttention : public ::testing::Test {
 protected:
  std::unique_ptr<CudaBackend> gpu(DType kv) {
    CudaBackendOptions o;
    o.poison = true;
    o.kv_cache_dtype = kv;
    o.prefill_attention_min_tokens = min_tokens_;
    auto g = CudaBackend::create(o);
    if (!g.ok()) return nullptr;
    return std::move(g.value());
  }

  void run(const Case& c, DType dt) {
    auto g = gpu(dt);
    if (!g) GTEST_SKIP() << "no usable GPU";
    const int nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim, group = nh / nkv;
    const int64_t row = int64_t{nkv} * hd;
    // Block tables: each sequence's blocks drawn from one shuffled pool.
    int n_blocks = 0;
    for (auto [p, n] : c.seqs) n_blocks += (p + n + kKvBlock - 1) / kKvBlock;
    std::vector<int32_t> pool(n_blocks + 3);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng());
    BatchInfo fill, b;
    size_t next = 0;
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      const auto [past, n] = c.seqs[s];
      std::vector<int32_t> table(pool.begin() + next,
                                 pool.begin() + next + (past + n + kKvBlock - 1) / kKvBlock);
      next += table.size();
      if (past > 0) {
        fill.seqs.push_back(SeqInfo{static_cast<int32_t>(fill.tokens.size()), past, 0, table});
        for (int i = 0; i < past; ++i)
          fill.tokens.push_back(0), fill.positions.push_back(i), fill.seq_of.push_back(fill.seqs.size() - 1);
      }
      b.seqs.push_back(SeqInfo{static_cast<int32_t>(b.tokens.size()), n, past, table});
      for (int i = 0; i < n; ++i)
        b.tokens.push_back(0), b.positions.push_back(past + i), b.seq_of.push_back(s);
    }
    auto cc = cpu_.new_kv_cache(1, static_cast<int>(pool.size()), nkv, hd);
    auto gc = g->new_kv_cache(1, static_cast<int>(pool.size()), nkv, hd);
    auto write = [&](const BatchInfo& bi) {
      const int64_t T = bi.n_tokens();
      std::vector<float> k = randn(T * row), v = randn(T * row, 2.0f);
      for (float& x : k) x = cached(dt, x);
      for (float& x : v) x = cached(dt, x);
      cpu_.kv_write(*cc, 0, host(k, {T, nkv, hd}), host(v, {T, nkv, hd}), bi);
      g->kv_write(*gc, 0, dev(*g, k, {T, nkv, hd}), dev(*g, v, {T, nkv, hd}), bi);
    };
    if (fill.n_tokens() > 0) write(fill);
    write(b);
    const int64_t T = b.n_tokens();
    const std::vector<float> q = randn(T * nh * hd), sinks = randn(nh);
    Tensor cs = host(sinks, {nh}), gs = dev(*g, sinks, {nh});
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const AttentionParams cp{scale, c.window, c.sinks ? &cs : nullptr},
        gp{scale, c.window, c.sinks ? &gs : nullptr};
    const std::vector<float> want = cpu_.to_host(cpu_.attention(host(q, {T, nh, hd}), *cc, 0, b, cp));
    const std::vector<float> got = g->to_host(g->attention(dev(*g, q, {T, nh, hd}), *gc, 0, b, gp));

    // Bound per row: logits move by at most delta = scale * max_key sum_d |q_d k_d| * eps, so each weight
    // by a factor within e^(+-2 delta), plus eps on P; the output by that times 2 max |v|.
    const float* kc = cc->k[0].data<float>();
    const float* vc = cc->v[0].data<float>();
    const double eps = operand_eps(dt);
    for (int64_t t = 0; t < T; ++t) {
      const SeqInfo& seq = b.seqs[b.seq_of[t]];
      const int pos = b.positions[t], first = c.window > 0 ? std::max(0, pos - c.window + 1) : 0;
      for (int h = 0; h < nh; ++h) {
        const int kvh = h / group;
        double qk = 0, vmax = 0;
        for (int kp = first; kp <= pos; ++kp) {
          const int64_t slot = int64_t{seq.block_table[kp / kKvBlock]} * kKvBlock + kp % kKvBlock;
          const float* kr = kc + (slot * nkv + kvh) * hd;
          const float* vr = vc + (slot * nkv + kvh) * hd;
          double s = 0;
          for (int d = 0; d < hd; ++d)
            s += std::abs(q[(t * nh + h) * hd + d] * kr[d]), vmax = std::max<double>(vmax, std::abs(vr[d]));
          qk = std::max(qk, s);
        }
        const double delta = scale * qk * eps;
        const double tol = 2 * vmax * (std::expm1(2 * delta) + eps) + 1e-5;
        for (int d = 0; d < hd; ++d) {
          const int64_t i = (t * nh + h) * hd + d;
          if (!(std::abs(want[i] - got[i]) <= tol)) {
            ADD_FAILURE() << describe(c, dt) << ": first mismatch at token " << t << " (seq " << b.seq_of[t]
                          << ", position " << pos << ") head " << h << " dim " << d << ": cpu " << want[i]
                          << " gpu " << got[i] << " tol " << tol;
            return;
          }
        }
      }
    }
  }

  Tensor host(const std::vector<float>& v, std::vector<int64_t> shape) {
    Tensor t = cpu_.alloc(DType::kF32, std::move(shape));
    std::copy(v.begin(), v.end(), t.data<float>());
    return t;
  }
  static Tensor dev(CudaBackend& g, const std::vector<float>& v, std::vector<int64_t> shape) {
    return g.upload(TensorView{v.data(), DType::kF32, std::move(shape)});
  }

  CpuBackend cpu_{4};
  int min_tokens_ = 1;  // every sequence through the tiled kernel
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      // gpt-oss-like: group 8, sinks; a prompt, a chunk after a cached prefix and a decode in one batch.
      {8, 1, 64, 0, true, {{0, 77}, {35, 20}, {130, 1}}},
      {8, 1, 64, 12, true, {{0, 77}, {35, 20}, {130, 1}}},
      // No GQA, head_dim 128, a window much smaller than the context.
      {8, 8, 128, 5, false, {{17, 50}, {0, 3}}},
      // Group 3 (a tile holds 21 tokens, 63 rows), a window larger than the context.
      {6, 2, 32, 1000, true, {{100, 33}}},
      // The tiny goldens' shape: head_dim 16, group 2, window 8.
      {4, 2, 16, 8, true, {{0, 64}, {11, 53}}},
      // Group 64: one token per tile.
      {64, 1, 64, 128, true, {{140, 9}, {0, 2}}},
      // qwen3 / llama-like: group 4, head_dim 128, full causal.
      {16, 4, 128, 0, false, {{29, 45}}},
  };
  return c;
}

TEST_F(FlashAttention, Fp32CacheMatchesCpu) {
  for (const Case& c : cases()) run(c, DType::kF32);
}
TEST_F(FlashAttention, Bf16CacheMatchesCpu) {
  for (const Case& c : cases()) run(c, DType::kBF16);
}
TEST_F(FlashAttention, Fp8CacheMatchesCpu) {
  for (const Case& c : cases()) run(c, DType::kF8_E4M3);
}
// A step where chunks share the batch with decodes (default threshold 8): sequences of >= 8 new tokens
// go through the tiled kernel, the others through the split kernel, into one output.
TEST_F(FlashAttention, MixedStepMatchesCpu) {
  min_tokens_ = 8;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    run({8, 1, 64, 0, true, {{300, 1}, {0, 40}, {17, 3}, {50, 9}, {7, 7}}}, dt);
    run({8, 2, 128, 24, false, {{0, 8}, {90, 2}}}, dt);
  }
}

// One long prompt: many key tiles per block, tiles skipped by the causal bound. The FP8 cases run the staged
// pipeline (codes two tiles ahead in two slots) through many tiles, a window that starts mid-tile and a prompt
// after a cached prefix.
TEST_F(FlashAttention, LongPromptMatchesCpu) {
  run({16, 2, 64, 0, true, {{0, 700}}}, DType::kF32);
  run({16, 2, 64, 128, true, {{300, 400}}}, DType::kBF16);
  run({16, 2, 64, 0, true, {{0, 700}}}, DType::kF8_E4M3);
  run({16, 2, 64, 128, true, {{300, 400}}}, DType::kF8_E4M3);
  run({16, 4, 128, 200, false, {{0, 600}}}, DType::kF8_E4M3);
  run({16, 4, 128, 0, false, {{90, 430}}}, DType::kF8_E4M3);
}

}  // namespace
}  // namespace nb
