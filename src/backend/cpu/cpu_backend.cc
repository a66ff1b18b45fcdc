// CPU reference ops in fp32. Weights are decoded row by row through model/dequantize_row (formats/
// codecs), so the matmul is "dequantize, then dot", exactly as the references define it.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <span>

#include "runtime/sampler.h"

namespace nb {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  // Four partial sums: independent chains vectorise and are no less accurate than one.
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

Tensor CpuBackend::alloc(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.device = Device::kCpu;
  const int64_t bytes = std::max<int64_t>(1, t.numel() * dtype_bits(dtype) / 8);
  t.storage = std::shared_ptr<uint8_t[]>(new uint8_t[bytes]());
  return t;
}

Tensor CpuBackend::upload(const TensorView& host) {
  Tensor t = alloc(DType::kF32, host.shape);
  float* out = t.data<float>();
  const int64_t n = host.numel();
  if (host.dtype == DType::kF32) {
    std::memcpy(out, host.data, n * sizeof(float));
  } else if (host.dtype == DType::kBF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = fmt::bf16_to_float(host.as<uint16_t>()[i]);
  } else {
    NB_CHECK(host.dtype == DType::kF16, "upload of a non-float tensor");
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_float(host.as<uint16_t>()[i]);
  }
  return t;
}

std::vector<float> CpuBackend::to_host(const Tensor& t) {
  NB_CHECK(t.dtype == DType::kF32);
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

std::unique_ptr<KvCache> CpuBackend::new_kv_cache(int n_layers, int n_blocks, int n_kv_heads, int head_dim) {
  auto cache = std::make_unique<KvCache>();
  cache->n_blocks = n_blocks;
  for (int l = 0; l < n_layers; ++l) {
    cache->k.push_back(alloc(DType::kF32, {n_blocks, kKvBlock, n_kv_heads, head_dim}));
    cache->v.push_back(alloc(DType::kF32, {n_blocks, kKvBlock, n_kv_heads, head_dim}));
  }
  return cache;
}

Tensor CpuBackend::embedding(const Weight& table, const BatchInfo& b) {
  Tensor out = alloc(DType::kF32, {b.n_tokens(), table.k});  // [n_tokens, d_model]
  float* o = out.data<float>();
  for (int64_t t = 0; t < b.n_tokens(); ++t) dequantize_row(table, token_at(b, t), o + t * table.k);
  return out;
}

Tensor CpuBackend::rms_norm(const Tensor& x, const Tensor& w, float eps) {
  const int64_t d = x.dim(-1), rows = x.numel() / d;
  NB_CHECK(w.numel() == d, "rms_norm weight " + shape_string(w.shape) + " for rows of " + std::to_string(d));
  Tensor out = alloc(DType::kF32, x.shape);
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) op[r * d + i] = wp[i] * (xr[i] * inv);
  }
  return out;
}

Tensor CpuBackend::add_rms_norm(Tensor& x, const Tensor& y, const Tensor& w, float eps) {
  add(x, y);
  return rms_norm(x, w, eps);
}

void CpuBackend::matmul(const float* x, int64_t n_rows, const Weight& w, const float* bias, float* out) {
  const int64_t k = w.k, n = w.n;
  // With fp8_emulation_ the FP4 products take the FP8 GEMMs' roundings: token rows to E4M3, weights to E4M3
  // at their row's fold, the NVFP4 global factor applied to the sum (as the GPU's epilogue does; g * dot is
  // exact for g = 1, so the default path's results are unchanged).
  const bool fp8 = fp8_emulation_ && (w.format == WeightFormat::kMXFP4 || w.format == WeightFormat::kNVFP4);
  std::vector<float> xq;
  if (fp8) {
    xq.resize(n_rows * k);
    for (int64_t t = 0; t < n_rows; ++t) fp8_round_row(x + t * k, k, xq.data() + t * k);
    x = xq.data();
  }
  pool_.parallel_for(
      n,
      [&](int64_t begin, int64_t end) {
        std::vector<float> row(k);  // one decoded weight row, reused for every token
        for (int64_t j = begin; j < end; ++j) {
          float g = 1.0f;  // (FP8: the NVFP4 global factor, applied to the sum)
          if (fp8) {
            int fold;
            g = fp8_weight_row(w, j, row.data(), &fold);
          } else {
            dequantize_row(w, j, row.data());
          }
          const float b = bias ? bias[j] : 0.0f;
          for (int64_t t = 0; t < n_rows; ++t) out[t * n + j] = g * dot(x + t * k, row.data(), k) + b;
        }
      },
      16);
}

Tensor CpuBackend::linear(const Tensor& x, const Weight& w, const Tensor* bias) {
  NB_CHECK(x.dim(-1) == w.k, "linear: input " + shape_string(x.shape) + " for weight " + w.shape_string());
  NB_CHECK(!bias || bias->numel() == w.n, "linear: bias size");
  std::vector<int64_t> shape = x.shape;
  shape.back() = w.n;
  Tensor out = alloc(DType::kF32, shape);
  matmul(x.data<float>(), x.numel() / w.k, w, bias ? bias->data<float>() : nullptr, out.data<float>());
  return out;
}

void CpuBackend::rope(Tensor& x, const BatchInfo& b, const RopeTable& rope) {
  const int64_t n_heads = x.dim(1), head_dim = x.dim(2), half = head_dim / 2;
  NB_CHECK(x.dim(0) == b.n_tokens() && static_cast<int64_t>(rope.inv_freq.size()) == half, "rope shapes");
  float* xp = x.data<float>();  // [n_tokens, n_heads, head_dim]
  std::vector<float> cos_t(half), sin_t(half);
  for (int64_t t = 0; t < b.n_tokens(); ++t) {
    for (int64_t i = 0; i < half; ++i) {
      // The angle is an fp32 product, as in the references (position * inv_freq in float32).
      const float angle = static_cast<float>(b.positions[t]) * rope.inv_freq[i];
      cos_t[i] = std::cos(angle) * rope.attention_scale;
      sin_t[i] = std::sin(angle) * rope.attention_scale;
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = xp + (t * n_heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cos_t[i] - x2 * sin_t[i];
        v[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
      }
    }
  }
}

void CpuBackend::kv_write(KvCache& cache, int layer, const Tensor& k, const Tensor& v, const BatchInfo& b) {
  const int64_t row = k.dim(1) * k.dim(2);   // n_kv_heads * head_dim floats per token
  float* kc = cache.k[layer].data<float>();  // [n_blocks, kKvBlock, n_kv_heads, head_dim]
  float* vc = cache.v[layer].data<float>();
  for (int64_t t = 0; t < b.n_tokens(); ++t) {
    const int32_t p = b.positions[t];
    const int64_t slot = int64_t{b.seqs[b.seq_of[t]].block_table[p / kKvBlock]} * kKvBlock + p % kKvBlock;
    std::memcpy(kc + slot * row, k.data<float>() + t * row, row * sizeof(float));
    std::memcpy(vc + slot * row, v.data<float>() + t * row, row * sizeof(float));
  }
}

Tensor CpuBackend::qkv_rope_kv_write(const Tensor& qkv, const QkvParams& p, KvCache& cache, int layer,
                                     const BatchInfo& b) {
  const int64_t T = qkv.dim(0), hd = p.head_dim, nh = p.n_heads, nkv = p.n_kv_heads;
  NB_CHECK(qkv.numel() == T * (nh + 2 * nkv) * hd && T == b.n_tokens() && p.rope,
           "qkv_rope_kv_write: qkv " + shape_string(qkv.shape) + " for " + std::to_string(nh) + " + 2 x " +
               std::to_string(nkv) + " heads of " + std::to_string(hd));
  // Split the rows into q, k, v, then the separate ops in the order the models ran them.
  Tensor q = alloc(DType::kF32, {T, nh, hd}), k = alloc(DType::kF32, {T, nkv, hd}), v = alloc(DType::kF32, {T, nkv, hd});
  const int64_t row = (nh + 2 * nkv) * hd;
  for (int64_t t = 0; t < T; ++t) {
    const float* src = qkv.data<float>() + t * row;
    std::copy_n(src, nh * hd, q.data<float>() + t * nh * hd);
    std::copy_n(src + nh * hd, nkv * hd, k.data<float>() + t * nkv * hd);
    std::copy_n(src + (nh + nkv) * hd, nkv * hd, v.data<float>() + t * nkv * hd);
  }
  if (p.q_norm) q = rms_norm(q, *p.q_norm, p.eps);
  if (p.k_norm) k = rms_norm(k, *p.k_norm, p.eps);
  rope(q, b, *p.rope);
  rope(k, b, *p.rope);
  kv_write(cache, layer, k, v, b);
  return q;
}

Tensor CpuBackend::attention(const Tensor& q, const KvCache& cache, int layer, const BatchInfo& b,
                             const AttentionParams& p) {
  const int64_t n_tokens = q.dim(0), n_heads = q.dim(1), head_dim = q.dim(2);
  const int64_t n_kv_heads = cache.k[layer].dim(2), group = n_heads / n_kv_heads;
  NB_CHECK(cache.k[layer].dim(3) == head_dim && n_heads % n_kv_heads == 0, "attention shapes");
  Tensor out = alloc(DType::kF32, q.shape);        // [n_tokens, n_heads, head_dim]
  const float* kc = cache.k[layer].data<float>();  // [n_blocks, kKvBlock, n_kv_heads, head_dim]
  const float* vc = cache.v[layer].data<float>();
  const float* sinks = p.sinks ? p.sinks->data<float>() : nullptr;  // [n_heads]
  pool_.parallel_for(n_tokens * n_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> logits;
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / n_heads, h = th % n_heads, kvh = h / group;  // HF repeat_kv order
      const SeqInfo& seq = b.seqs[b.seq_of[t]];
      const int32_t pos = b.positions[t];
      const int32_t first = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;  // keys (pos - window, pos]
      const float* qv = q.data<float>() + th * head_dim;
      auto slot = [&](int32_t kp) {
        return (int64_t{seq.block_table[kp / kKvBlock]} * kKvBlock + kp % kKvBlock) * n_kv_heads + kvh;
      };
      logits.resize(pos - first + 1);
      float max_logit = sinks ? sinks[h] : -INFINITY;
      for (int32_t kp = first; kp <= pos; ++kp) {
        const float l = dot(qv, kc + slot(kp) * head_dim, head_dim) * p.scale;
        logits[kp - first] = l;
        max_logit = std::max(max_logit, l);
      }
      // Softmax over [keys..., sink]; the sink only adds to the denominator.
      float denom = sinks ? std::exp(sinks[h] - max_logit) : 0.0f;
      for (float& l : logits) denom += (l = std::exp(l - max_logit));
      float* o = out.data<float>() + th * head_dim;
      std::fill(o, o + head_dim, 0.0f);
      for (int32_t kp = first; kp <= pos; ++kp) {
        const float w = logits[kp - first] / denom;
        const float* vv = vc + slot(kp) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += w * vv[d];
      }
    }
  });
  return out;
}

Routes CpuBackend::moe_route(const Tensor& logits, int top_k, RouterKind kind, bool renormalize) {
  const int64_t n_tokens = logits.dim(0), n_experts = logits.dim(1);
  NB_CHECK(top_k >= 1 && top_k <= n_experts, "top_k out of range");
  Routes r{alloc(DType::kI32, {n_tokens, top_k}), alloc(DType::kF32, {n_tokens, top_k})};
  std::vector<float> s(n_experts);
  std::vector<int32_t> order(n_experts);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* l = logits.data<float>() + t * n_experts;
    std::copy(l, l + n_experts, s.begin());
    if (kind == RouterKind::kSoftmaxThenTopK) {
      const float m = *std::max_element(s.begin(), s.end());
      float sum = 0;
      for (float& v : s) sum += (v = std::exp(v - m));
      for (float& v : s) v /= sum;
    }
    // Top-k by value, ties to the lower expert id (torch.topk on distinct values is unambiguous). NaN
    // ranks as -inf (a strict weak order, and the CUDA kernels' choice): a broken router gives garbage
    // weights, with ids in range.
    auto key = [&](int32_t e) { return std::isnan(s[e]) ? -INFINITY : s[e]; };
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    int32_t* ids = r.ids.data<int32_t>() + t * top_k;
    float* w = r.weights.data<float>() + t * top_k;
    for (int i = 0; i < top_k; ++i) ids[i] = order[i], w[i] = s[order[i]];
    if (kind == RouterKind::kTopKThenSoftmax) {
      const float m = w[0];
      float sum = 0;
      for (int i = 0; i < top_k; ++i) sum += (w[i] = std::exp(w[i] - m));
      for (int i = 0; i < top_k; ++i) w[i] /= sum;
    } else if (renormalize) {
      float sum = 0;
      for (int i = 0; i < top_k; ++i) sum += w[i];
      for (int i = 0; i < top_k; ++i) w[i] /= sum;
    }
  }
  return r;
}

Tensor CpuBackend::moe_experts(const Tensor& x, const Routes& routes, const MoeExperts& ex,
                               const GluParams& glu) {
  const int64_t n_tokens = x.dim(0), d_model = x.dim(1), top_k = routes.ids.dim(1), d_ff = ex.d_expert;
  // y[t, i] = expert output for token t's i-th choice, before weighting; summed in choice order at the
  // end so the result does not depend on thread timing.
  std::vector<float> y(n_tokens * top_k * d_model);
  std::vector<std::vector<int64_t>> assigned(ex.n_experts);  // flat (t * top_k + i) per expert
  for (int64_t ti = 0; ti < n_tokens * top_k; ++ti) {
    const int32_t e = routes.ids.data<int32_t>()[ti];
    NB_CHECK(e >= 0 && e < ex.n_experts, "expert id out of range");
    assigned[e].push_back(ti);
  }
  for (int e = 0; e < ex.n_experts; ++e) {
    const std::vector<int64_t>& rows = assigned[e];
    if (rows.empty()) continue;
    const int64_t m = static_cast<int64_t>(rows.size());
    std::vector<float> xe(m * d_model), h(m * 2 * d_ff), a(m * d_ff), ye(m * d_model);
    for (int64_t r = 0; r < m; ++r)
      std::copy_n(x.data<float>() + rows[r] / top_k * d_model, d_model, xe.data() + r * d_model);
    matmul(xe.data(), m, ex.fc1[e], ex.fc1_bias.empty() ? nullptr : ex.fc1_bias.data<float>() + e * 2 * d_ff,
           h.data());
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < d_ff; ++j) {
        const float* hr = h.data() + r * 2 * d_ff;
        float g = ex.layout == GluLayout::kInterleaved ? hr[2 * j] : hr[j];
        float u = ex.layout == GluLayout::kInterleaved ? hr[2 * j + 1] : hr[d_ff + j];
        if (glu.activation == Activation::kGptOssClamped) {
          g = std::min(g, glu.limit);
          u = std::clamp(u, -glu.limit, glu.limit);
          a[r * d_ff + j] = g * sigmoid(1.702f * g) * (u + 1.0f);  // alpha 1.702 (formats.md §2.4)
        } else {
          a[r * d_ff + j] = g * sigmoid(g) * u;
        }
      }
    }
    matmul(a.data(), m, ex.fc2[e], ex.fc2_bias.empty() ? nullptr : ex.fc2_bias.data<float>() + e * d_model,
           ye.data());
    for (int64_t r = 0; r < m; ++r)
      std::copy_n(ye.data() + r * d_model, d_model, y.data() + rows[r] * d_model);
  }
  Tensor out = alloc(DType::kF32, {n_tokens, d_model});
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* o = out.data<float>() + t * d_model;
    for (int64_t i = 0; i < top_k; ++i) {
      const float w = routes.weights.data<float>()[t * top_k + i];  // applied after the fc2 bias (§2.4)
      const float* yi = y.data() + (t * top_k + i) * d_model;
      for (int64_t d = 0; d < d_model; ++d) o[d] += w * yi[d];
    }
  }
  return out;
}

Tensor CpuBackend::swiglu(const Tensor& gate, const Tensor& up) {
  NB_CHECK(gate.shape == up.shape, "swiglu shapes");
  Tensor out = alloc(DType::kF32, gate.shape);
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < gate.numel(); ++i) o[i] = g[i] * sigmoid(g[i]) * u[i];
  return out;
}

void CpuBackend::add(Tensor& x, const Tensor& y) {
  NB_CHECK(x.numel() == y.numel(), "add shapes");
  float* xp = x.data<float>();
  const float* yp = y.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] += yp[i];
}

Tensor CpuBackend::gather_rows(const Tensor& x, const std::vector<int32_t>& rows) {
  const int64_t row = x.numel() / x.dim(0);
  std::vector<int64_t> shape = x.shape;
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor out = alloc(x.dtype, shape);
  const int64_t bytes = row * dtype_bits(x.dtype) / 8;
  for (size_t r = 0; r < rows.size(); ++r)
    std::memcpy(out.data<uint8_t>() + r * bytes, x.data<uint8_t>() + rows[r] * bytes, bytes);
  return out;
}

// ---- WeightFactory: the CUDA backend's recipe (quant.cu), on the host with std::mt19937_64.

Weight CpuBackend::random_weight(WeightFormat format, int64_t n, int64_t k, float std, uint64_t seed,
                                 const std::string& name) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> pm1(-1.0f, 1.0f);
  auto bytes = [](int64_t size) { return std::shared_ptr<uint8_t[]>(new uint8_t[std::max<int64_t>(size, 1)]()); };
  Weight w;
  w.format = format;
  w.n = n;
  w.k = k;
  WeightPart p;
  p.rows = n;
  p.name = name;
  std::shared_ptr<uint8_t[]> data, scales;
  const float fp4_scale = std / 2.93f;  // E2M1 codes uniform over all 16 have RMS 2.93
  switch (format) {
    case WeightFormat::kBF16: {
      data = bytes(n * k * 2);
      auto* d = reinterpret_cast<uint16_t*>(data.get());
      for (int64_t i = 0; i < n * k; ++i) d[i] = fmt::float_to_bf16(std * 1.7320508f * pm1(g));
      p.data = TensorView{data.get(), DType::kBF16, {n, k}};
      break;
    }
    case WeightFormat::kFP8E4M3: {
      data = bytes(n * k), scales = bytes(n * 4);
      const float scale = 4 * std / 448.0f;
      for (int64_t i = 0; i < n * k; ++i) data[i] = fmt::float_to_e4m3(std * 1.7320508f * pm1(g) / scale);
      for (int64_t r = 0; r < n; ++r) reinterpret_cast<float*>(scales.get())[r] = scale;
      p.data = TensorView{data.get(), DType::kU8, {n, k}};
      p.scales = TensorView{scales.get(), DType::kF32, {n}};
      break;
    }
    case WeightFormat::kMXFP4:
    case WeightFormat::kNVFP4: {
      const bool nv = format == WeightFormat::kNVFP4;
      const int64_t block = nv ? 16 : 32;
      data = bytes(n * k / 2), scales = bytes(n * k / block);
      for (int64_t i = 0; i < n * k / 2; ++i) data[i] = static_cast<uint8_t>(g());
      const int center = 127 + static_cast<int>(std::floor(std::log2(fp4_scale)));
      for (int64_t i = 0; i < n * k / block; ++i)
        scales[i] = nv ? fmt::float_to_ue4m3(fp4_scale * 448.0f * (0.75f + 0.5f * (pm1(g) + 1) / 2))
                       : static_cast<uint8_t>(center + static_cast<int>(g() % 2));
      p.data = TensorView{data.get(), DType::kU8, {n, k / 2}};
      p.scales = TensorView{scales.get(), nv ? DType::kF8_E4M3 : DType::kU8, {n, k / block}};
      if (nv) p.global_scale = 1.0f / 448.0f;
      break;
    }
  }
  p.owner = std::make_shared<std::pair<std::shared_ptr<uint8_t[]>, std::shared_ptr<uint8_t[]>>>(data, scales);
  w.parts.push_back(std::move(p));
  return w;
}

Tensor CpuBackend::random_floats(const std::vector<int64_t>& shape, float mean, float std, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> pm1(-1.0f, 1.0f);
  Tensor t = alloc(DType::kF32, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = mean + std * 1.7320508f * pm1(g);
  return t;
}

Result<Weight> CpuBackend::requantize(const Weight& w, WeightFormat) {
  return error((w.parts.empty() ? std::string("--dense-format") : "--dense-format (" + w.parts[0].name + ")") +
               ": re-quantization needs the CUDA backend");
}

std::vector<int32_t> CpuBackend::sample(const Tensor& logits, const std::vector<SampleSpec>& specs) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(-1);
  NB_CHECK(static_cast<int64_t>(specs.size()) == rows, "sample: " + std::to_string(specs.size()) +
                                                           " specs for " + std::to_string(rows) + " rows");
  std::vector<int32_t> ids(rows);
  for (int64_t r = 0; r < rows; ++r)
    ids[r] = sample_row(std::span<const float>(logits.data<float>() + r * vocab, vocab), specs[r]);
  return ids;
}

}  // namespace nb
