// Weight loading and validation against the config; see loader.h. Formats are recognised by the
// tensor names and dtypes on disk (formats.md §9) and cross-checked with config.json's quantization.
#include "model/loader.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

namespace nb {
namespace {

// "model.layers.12.mlp.experts.3.gate_proj" -> "model.layers.*.mlp.experts.*.gate_proj".
std::string class_of(const std::string& name) {
  std::string out, part;
  auto flush = [&] {
    const bool numeric =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(c); });
    out += numeric ? "*" : part;
    part.clear();
  };
  for (char c : name) {
    if (c == '.') {
      flush();
      out += '.';
    } else {
      part += c;
    }
  }
  flush();
  return out;
}

Status not_found(const std::string& name) {
  return error("tensor '" + name + "' not found in the checkpoint");
}

// A view of expert e of a stacked tensor [E, ...]: the same bytes, one leading dimension fewer.
TensorView expert_slice(const TensorView& t, int64_t e) {
  TensorView v = t;
  v.shape.erase(v.shape.begin());
  v.data = static_cast<const uint8_t*>(t.data) + e * v.nbytes();
  return v;
}

uint64_t seed_of(const std::string& name) { return std::hash<std::string>{}(name); }

// Dense layers --dense-format applies to: attention projections and lm_head.
bool is_dense_target(const std::string& prefix) {
  const bool proj = prefix.find(".self_attn.") != std::string::npos && prefix.size() > 5 &&
                    prefix.compare(prefix.size() - 5, 5, "_proj") == 0;
  return proj || prefix == "lm_head";
}

WeightFormat weight_format_of(DenseFormat f) {
  switch (f) {
    case DenseFormat::kFP8:
      return WeightFormat::kFP8E4M3;
    case DenseFormat::kMXFP4:
      return WeightFormat::kMXFP4;
    case DenseFormat::kNVFP4:
      return WeightFormat::kNVFP4;
    case DenseFormat::kKeep:
      break;
  }
  return WeightFormat::kBF16;
}

}  // namespace

const char* dense_format_name(DenseFormat f) {
  static const char* kNames[] = {"keep", "fp8", "mxfp4", "nvfp4"};
  return kNames[static_cast<int>(f)];
}

Result<Weight> WeightLoader::dummy_linear(const std::string& prefix, int64_t n, int64_t k, WeightFormat format) {
  Weight w = factory_->random_weight(format, n, k, 0.02f, seed_of(prefix), prefix);
  record(prefix, std::string("dummy ") + weight_format_name(format), {n, k}, n * k, w.bytes());
  return maybe_requantize(prefix, std::move(w));
}

Result<Weight> WeightLoader::maybe_requantize(const std::string& prefix, Weight w) {
  if (dense_ == DenseFormat::kKeep || w.format != WeightFormat::kBF16 || !is_dense_target(prefix)) return w;
  if (!factory_) return error("--dense-format " + std::string(dense_format_name(dense_)) + " needs the CUDA backend");
  NB_ASSIGN_OR_RETURN(Weight q, factory_->requantize(w, weight_format_of(dense_)));
  record(prefix + " (as " + dense_format_name(dense_) + ")", weight_format_name(q.format), {w.n, w.k}, 0, q.bytes());
  return q;
}

void WeightLoader::record(const std::string& name, const std::string& format,
                          const std::vector<int64_t>& shape, int64_t params, int64_t bytes) {
  WeightClass& c = catalog_[class_of(name)];
  if (c.count == 0) {
    c.format = format;
    c.shape = shape_string(shape);
  } else if (c.format != format) {
    c.format = "mixed";
  }
  c.count += 1;
  c.parameters += params;
  c.bytes += bytes;
}

Status WeightLoader::check_method(const std::string& tensor, QuantMethod found) const {
  if (config_.quant.method == found) return Status();
  return error("tensor '" + tensor + "' is stored as " + quant_method_name(found) +
               " but config quantization is " + quant_method_name(config_.quant.method));
}

Result<TensorView> WeightLoader::get_float(const std::string& name, const std::vector<int64_t>& shape) {
  const Checkpoint::Entry* e = ckpt_.find(name);
  if (!e) return not_found(name);
  const DType dt = e->info->dtype;
  if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16)
    return error("tensor '" + name + "': dtype " + std::string(dtype_name(dt)) +
                 ", expected BF16, F16 or F32");
  return ckpt_.get(name, dt, shape);
}

Result<float> WeightLoader::scalar(const std::string& name) {
  const Checkpoint::Entry* e = ckpt_.find(name);
  if (!e) return not_found(name);
  const std::vector<int64_t>& s = e->info->shape;
  if (e->info->dtype != DType::kF32 || !(s.empty() || (s.size() == 1 && s[0] == 1)))
    return error("tensor '" + name + "': expected an F32 scalar ([] or [1]), got " +
                 std::string(dtype_name(e->info->dtype)) + " " + shape_string(s));
  const float v = *e->view().as<float>();
  if (!std::isfinite(v) || v <= 0) return error("tensor '" + name + "': global scale " + std::to_string(v));
  return v;
}

Result<Weight> WeightLoader::linear(const std::string& prefix, int64_t n, int64_t k) {
  if (dummy_) {
    const QuantMethod m = config_.quant.method;
    const bool nvfp4 = (m == QuantMethod::kModeloptNvfp4 || m == QuantMethod::kCompressedTensorsNvfp4) &&
                       !is_module_excluded(config_.quant, prefix) && k % fmt::kNvfp4Block == 0;
    return dummy_linear(prefix, n, k, nvfp4 ? WeightFormat::kNVFP4 : WeightFormat::kBF16);
  }
  Weight w;
  w.n = n;
  w.k = k;
  WeightPart part;
  part.rows = n;
  part.name = prefix;
  const Checkpoint::Entry* plain = ckpt_.find(prefix + ".weight");
  std::string format;
  if (ckpt_.has(prefix + ".weight_packed") || (plain && plain->info->dtype == DType::kU8)) {
    // NVFP4, either producer: codes [n, k/2], UE4M3 block scales [n, k/16], one FP32 global scale.
    const bool ct = ckpt_.has(prefix + ".weight_packed");
    const std::string codes = prefix + (ct ? ".weight_packed" : ".weight");
    NB_RETURN_IF_ERROR(
        check_method(codes, ct ? QuantMethod::kCompressedTensorsNvfp4 : QuantMethod::kModeloptNvfp4));
    if (k % fmt::kNvfp4Block != 0)
      return error("tensor '" + codes + "': NVFP4 needs k % 16 == 0, k = " + std::to_string(k));
    w.format = WeightFormat::kNVFP4;
    NB_ASSIGN_OR_RETURN(part.data, ckpt_.get(codes, DType::kU8, {n, k / 2}));
    NB_ASSIGN_OR_RETURN(part.scales, ckpt_.get(prefix + ".weight_scale", DType::kF8_E4M3, {n, k / 16}));
    NB_ASSIGN_OR_RETURN(part.global_scale,
                        scalar(prefix + (ct ? ".weight_global_scale" : ".weight_scale_2")));
    part.convention = ct ? fmt::GlobalScale::kDivide : fmt::GlobalScale::kMultiply;
    format = ct ? "nvfp4 (compressed-tensors)" : "nvfp4 (modelopt)";
  } else if (plain && plain->info->dtype == DType::kF8_E4M3) {
    // compressed-tensors float-quantized, per channel: E4M3 codes [n, k], F32 weight_scale [n, 1].
    NB_RETURN_IF_ERROR(check_method(prefix + ".weight", QuantMethod::kCompressedTensorsFp8));
    w.format = WeightFormat::kFP8E4M3;
    NB_ASSIGN_OR_RETURN(part.data, ckpt_.get(prefix + ".weight", DType::kF8_E4M3, {n, k}));
    part.data.dtype = DType::kU8;  // WeightFormat carries the meaning; backends read bytes
    NB_ASSIGN_OR_RETURN(part.scales, ckpt_.get(prefix + ".weight_scale", DType::kF32, {n, 1}));
    part.scales.shape = {n};
    format = "fp8 (compressed-tensors)";
  } else {
    w.format = WeightFormat::kBF16;
    NB_ASSIGN_OR_RETURN(part.data, get_float(prefix + ".weight", {n, k}));
    format = "dense " + std::string(dtype_name(part.data.dtype));
  }
  record(prefix, format, {n, k}, n * k,
         view_bytes(part.data) + view_bytes(part.scales) + (w.format == WeightFormat::kNVFP4 ? 4 : 0));
  w.parts.push_back(std::move(part));
  return maybe_requantize(prefix, std::move(w));
}

Result<Weight> WeightLoader::fused(const std::vector<std::string>& prefixes, const std::vector<int64_t>& ns,
                                   int64_t k) {
  NB_CHECK(prefixes.size() == ns.size() && !prefixes.empty(), "fused: one row count per prefix");
  Weight w;
  w.n = 0;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    const std::string& p = prefixes[i];
    NB_ASSIGN_OR_RETURN(Weight one, linear(p, ns[i], k));
    if (!w.empty() && (one.format != w.format || one.parts[0].data.dtype != w.parts[0].data.dtype))
      return error("tensor '" + p + "': stored as " + weight_format_name(one.format) + " " +
                   std::string(dtype_name(one.parts[0].data.dtype)) + " but '" + prefixes[0] + "' as " +
                   weight_format_name(w.format) + " " + std::string(dtype_name(w.parts[0].data.dtype)) +
                   "; fused weights need one format");
    w.format = one.format;
    for (WeightPart& part : one.parts) w.parts.push_back(std::move(part));
    w.n += ns[i];
  }
  w.k = k;
  return w;
}

Result<Tensor> WeightLoader::concat_floats(const std::vector<std::string>& names, const std::vector<int64_t>& sizes) {
  std::vector<float> all;
  for (size_t i = 0; i < names.size(); ++i) {
    NB_ASSIGN_OR_RETURN(Tensor t, floats(names[i], {sizes[i]}));
    const std::vector<float> h = backend_.to_host(t);
    all.insert(all.end(), h.begin(), h.end());
  }
  return backend_.upload(TensorView{all.data(), DType::kF32, {static_cast<int64_t>(all.size())}});
}

Result<Weight> WeightLoader::dense(const std::string& name, int64_t n, int64_t k) {
  if (dummy_) return dummy_linear(name, n, k, WeightFormat::kBF16);
  Weight w;
  w.n = n;
  w.k = k;
  WeightPart part;
  part.rows = n;
  part.name = name;
  NB_ASSIGN_OR_RETURN(part.data, get_float(name, {n, k}));
  record(name, "dense " + std::string(dtype_name(part.data.dtype)), {n, k}, n * k, part.data.nbytes());
  w.parts.push_back(std::move(part));
  return w;
}

Result<Tensor> WeightLoader::floats(const std::string& name, const std::vector<int64_t>& shape) {
  if (dummy_) {
    // Norm weights near 1, biases and sinks small.
    const bool norm = name.find("norm") != std::string::npos;
    Tensor t = factory_->random_floats(shape, norm ? 1.0f : 0.0f, norm ? 0.05f : 0.02f, seed_of(name));
    record(name, "dummy F32", shape, t.numel(), t.numel() * 4);
    return t;
  }
  NB_ASSIGN_OR_RETURN(TensorView v, get_float(name, shape));
  record(name, "dense " + std::string(dtype_name(v.dtype)), shape, v.numel(), v.nbytes());
  return backend_.upload(v);
}

Result<MoeExperts> WeightLoader::stacked_mxfp4_experts(const std::string& prefix, int n_experts, int d_expert,
                                                       int d_model) {
  MoeExperts ex;
  ex.n_experts = n_experts;
  ex.d_expert = d_expert;
  ex.layout = GluLayout::kInterleaved;
  // fc1: gate_up_proj [E, 2 * d_expert, d_model]; fc2: down_proj [E, d_model, d_expert] (formats.md §2.3).
  struct Stack {
    const char* name;
    int64_t n, k;
    std::vector<Weight>* out;
  };
  for (const Stack& s : {Stack{"gate_up_proj", 2 * int64_t{d_expert}, d_model, &ex.fc1},
                         Stack{"down_proj", d_model, d_expert, &ex.fc2}}) {
    const std::string base = prefix + "." + s.name;
    if (dummy_) {
      for (int e = 0; e < n_experts; ++e) {
        const std::string name = base + "[" + std::to_string(e) + "]";
        s.out->push_back(factory_->random_weight(WeightFormat::kMXFP4, s.n, s.k, 0.02f, seed_of(name), name));
      }
      record(base, "dummy mxfp4", {n_experts, s.n, s.k}, n_experts * s.n * s.k,
             n_experts * (s.n * s.k / 2 + s.n * s.k / 32));
      continue;
    }
    if (!ckpt_.has(base + "_blocks") && ckpt_.has(base)) {
      // Unquantized (BF16) gpt-oss checkpoints store each expert transposed, [E, k, n] (HF computes
      // x @ W[e]); nibble's weights are [n, k], so each expert is transposed here into F32 memory the
      // backend owns (upload), and the Weight keeps that memory alive.
      NB_RETURN_IF_ERROR(check_method(base, QuantMethod::kNone));
      NB_ASSIGN_OR_RETURN(TensorView t, get_float(base, {n_experts, s.k, s.n}));
      std::vector<float> tr(static_cast<size_t>(s.n * s.k));
      for (int e = 0; e < n_experts; ++e) {
        Weight one;
        one.n = s.n;
        one.k = s.k;
        one.parts.resize(1);
        one.parts[0].rows = s.n;
        one.parts[0].name = base + "[" + std::to_string(e) + "]";
        const TensorView ex = expert_slice(t, e);
        Weight src;  // the stored [k, n] matrix, read row by row through dequantize_row
        src.n = s.k;
        src.k = s.n;
        src.parts.resize(1);
        src.parts[0].rows = s.k;
        src.parts[0].data = ex;
        src.parts[0].data.shape = {s.k, s.n};
        std::vector<float> row(static_cast<size_t>(s.n));
        for (int64_t i = 0; i < s.k; ++i) {
          dequantize_row(src, i, row.data());
          for (int64_t j = 0; j < s.n; ++j) tr[j * s.k + i] = row[j];
        }
        Tensor dev = backend_.upload(TensorView{tr.data(), DType::kF32, {s.n, s.k}, Device::kCpu});
        one.parts[0].data = TensorView{dev.storage.get(), DType::kF32, {s.n, s.k}, dev.device};
        one.parts[0].owner = dev.storage;
        s.out->push_back(std::move(one));
      }
      record(base, "dense " + std::string(dtype_name(t.dtype)) + " (transposed)", {n_experts, s.n, s.k},
             n_experts * s.n * s.k, t.nbytes());
      continue;
    }
    if (!ckpt_.has(base + "_blocks"))
      return error("tensor '" + base + "_blocks' not found (gpt-oss experts must be MXFP4 _blocks/_scales or "
                   "BF16 " + s.name + ")");
    NB_RETURN_IF_ERROR(check_method(base + "_blocks", QuantMethod::kMxfp4));
    if (s.k % fmt::kMxfp4Block != 0)
      return error("tensor '" + base + "_blocks': MXFP4 needs k % 32 == 0, k = " + std::to_string(s.k));
    const int64_t kb = s.k / fmt::kMxfp4Block;
    NB_ASSIGN_OR_RETURN(TensorView blocks, ckpt_.get(base + "_blocks", DType::kU8, {n_experts, s.n, kb, 16}));
    NB_ASSIGN_OR_RETURN(TensorView scales, ckpt_.get(base + "_scales", DType::kU8, {n_experts, s.n, kb}));
    record(base, "mxfp4", {n_experts, s.n, s.k}, n_experts * s.n * s.k, blocks.nbytes() + scales.nbytes());
    for (int e = 0; e < n_experts; ++e) {
      Weight w;
      w.format = WeightFormat::kMXFP4;
      w.n = s.n;
      w.k = s.k;
      WeightPart part;
      part.rows = s.n;
      part.name = base + "[" + std::to_string(e) + "]";
      part.data = expert_slice(blocks, e);
      part.data.shape = {s.n, s.k / 2};
      part.scales = expert_slice(scales, e);
      w.parts.push_back(std::move(part));
      s.out->push_back(std::move(w));
    }
  }
  NB_ASSIGN_OR_RETURN(ex.fc1_bias, floats(prefix + ".gate_up_proj_bias", {n_experts, 2 * int64_t{d_expert}}));
  NB_ASSIGN_OR_RETURN(ex.fc2_bias, floats(prefix + ".down_proj_bias", {n_experts, d_model}));
  return ex;
}

Result<MoeExperts> WeightLoader::per_expert_experts(const std::string& prefix, int n_experts, int d_expert,
                                                    int d_model) {
  MoeExperts ex;
  ex.n_experts = n_experts;
  ex.d_expert = d_expert;
  ex.layout = GluLayout::kHalves;  // gate_proj rows, then up_proj rows
  for (int e = 0; e < n_experts; ++e) {
    const std::string p = prefix + "." + std::to_string(e);
    NB_ASSIGN_OR_RETURN(Weight fc1, fused({p + ".gate_proj", p + ".up_proj"}, d_expert, d_model));
    NB_ASSIGN_OR_RETURN(Weight fc2, linear(p + ".down_proj", d_model, d_expert));
    ex.fc1.push_back(std::move(fc1));
    ex.fc2.push_back(std::move(fc2));
  }
  return ex;
}

Result<AttentionWeights> load_attention(WeightLoader& w, const ModelConfig& c, int layer, bool qk_norm,
                                        bool sinks) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  AttentionWeights a;
  NB_ASSIGN_OR_RETURN(a.norm, w.floats(p + "input_layernorm.weight", {c.d_model}));
  const std::string q = p + "self_attn.q_proj", k = p + "self_attn.k_proj", v = p + "self_attn.v_proj";
  NB_ASSIGN_OR_RETURN(a.qkv, w.fused({q, k, v}, {q_dim, kv_dim, kv_dim}, c.d_model));
  NB_ASSIGN_OR_RETURN(a.o, w.linear(p + "self_attn.o_proj", c.d_model, q_dim));
  if (c.attention_bias) {
    NB_ASSIGN_OR_RETURN(a.qkv_bias, w.concat_floats({q + ".bias", k + ".bias", v + ".bias"}, {q_dim, kv_dim, kv_dim}));
    NB_ASSIGN_OR_RETURN(a.o_bias, w.floats(p + "self_attn.o_proj.bias", {c.d_model}));
  }
  if (qk_norm) {
    NB_ASSIGN_OR_RETURN(a.q_norm, w.floats(p + "self_attn.q_norm.weight", {c.head_dim}));
    NB_ASSIGN_OR_RETURN(a.k_norm, w.floats(p + "self_attn.k_norm.weight", {c.head_dim}));
  }
  if (sinks) {
    NB_ASSIGN_OR_RETURN(a.sinks, w.floats(p + "self_attn.sinks", {c.n_heads}));
  }
  return a;
}

Result<DenseMlpWeights> load_dense_mlp(WeightLoader& w, const std::string& prefix, int d_ff, int d_model) {
  DenseMlpWeights m;
  NB_ASSIGN_OR_RETURN(m.gate, w.linear(prefix + ".gate_proj", d_ff, d_model));
  NB_ASSIGN_OR_RETURN(m.up, w.linear(prefix + ".up_proj", d_ff, d_model));
  NB_ASSIGN_OR_RETURN(m.down, w.linear(prefix + ".down_proj", d_model, d_ff));
  return m;
}

std::string catalog_table(const WeightCatalog& catalog) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof(line), "  %-48s %-28s %6s %-22s %14s %14s\n", "tensor class", "format", "count",
                "shape (each)", "parameters", "bytes");
  out += line;
  int64_t params = 0, bytes = 0;
  for (const auto& [name, c] : catalog) {
    std::snprintf(line, sizeof(line), "  %-48s %-28s %6lld %-22s %14lld %14lld\n", name.c_str(),
                  c.format.c_str(), static_cast<long long>(c.count), c.shape.c_str(),
                  static_cast<long long>(c.parameters), static_cast<long long>(c.bytes));
    out += line;
    params += c.parameters;
    bytes += c.bytes;
  }
  std::snprintf(line, sizeof(line), "  total: %lld parameters, %lld bytes (%.2f MiB)\n",
                static_cast<long long>(params), static_cast<long long>(bytes), bytes / 1048576.0);
  return out + line;
}

}  // namespace nb
