// BF16 checkpoint -> MXFP4 / NVFP4 / FP8 checkpoint in a standard layout; see quantize.h.
#include "model/quantize.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "formats/blocks.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"

namespace nb {
namespace fs = std::filesystem;
namespace {

const std::vector<std::string> kClasses = {"experts", "attn", "mlp", "lm_head", "embed"};

// The layer class of a checkpoint tensor, or "" for tensors that are always copied (norms, biases,
// sinks, routers). Names as in formats.md §2.3 and §6.
std::string class_of_tensor(const std::string& name, const TensorInfo& info) {
  static const std::regex attn(R"(model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight)");
  static const std::regex mlp(R"(model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight)");
  static const std::regex expert(R"(model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight)");
  static const std::regex stacked(R"(model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj)");
  if (std::regex_match(name, attn)) return "attn";
  if (std::regex_match(name, mlp)) return "mlp";
  if (std::regex_match(name, expert)) return "experts";
  if (std::regex_match(name, stacked) && info.shape.size() == 3) return "experts";
  if (name == "lm_head.weight") return "lm_head";
  if (name == "model.embed_tokens.weight") return "embed";
  return "";
}

std::vector<float> to_floats(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  const uint16_t* src = v.as<uint16_t>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = fmt::bf16_to_float(src[i]);
  return out;
}

Result<std::string> read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return error(p.string() + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Status write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return error(p.string() + ": cannot write");
  return Status();
}

// Which classes to quantize, checked against the format and the architecture; errors name the flag.
Result<std::set<std::string>> resolve_classes(const QuantizeOptions& o, const ModelConfig& c,
                                              const std::set<std::string>& present) {
  std::set<std::string> chosen;
  for (const std::string& l : o.layers) {
    if (std::find(kClasses.begin(), kClasses.end(), l) == kClasses.end())
      return error("--layers: unknown layer class '" + l + "' (known: experts, attn, mlp, lm_head, embed)");
    chosen.insert(l);
  }
  const bool gpt_oss = c.arch == Arch::kGptOss;
  const char* fname = o.format == QuantFormat::kMXFP4   ? "mxfp4"
                      : o.format == QuantFormat::kNVFP4 ? "nvfp4"
                                                        : "fp8";
  if (gpt_oss && o.format != QuantFormat::kMXFP4)
    return error(std::string("--format ") + fname +
                 ": gpt-oss checkpoints have one standard quantized layout, MXFP4 experts; re-quantize "
                 "attention and lm_head at load time with --dense-format instead");
  if (!gpt_oss && o.format == QuantFormat::kMXFP4)
    return error(
        std::string("--format mxfp4: only gpt-oss experts are written as MXFP4 (the gpt-oss layout); ") +
        arch_name(c.arch) + " takes --format nvfp4 or fp8");
  if (chosen.empty()) {
    for (const char* d :
         gpt_oss ? std::vector<const char*>{"experts"} : std::vector<const char*>{"attn", "mlp", "experts"})
      if (present.count(d)) chosen.insert(d);
    if (chosen.empty())
      return error("--layers: the checkpoint has no attention, MLP or expert weights to quantize");
  }
  for (const std::string& l : chosen) {
    if (gpt_oss && l != "experts")
      return error("--layers " + l +
                   ": gpt-oss MXFP4 checkpoints quantize only the experts (the layout HF and "
                   "nibble load); use --dense-format at load time for attention and lm_head");
    if (l == "embed")
      return error(
          "--layers embed: embeddings stay BF16 (no standard quantized embedding layout that nibble "
          "and HF load)");
    if (l == "lm_head" && c.tie_word_embeddings)
      return error("--layers lm_head: this model ties lm_head to the embeddings, which stay BF16");
    if (!present.count(l)) return error("--layers " + l + ": the checkpoint has no " + l + " weights");
  }
  return chosen;
}

// Modules left BF16, as fnmatch globs (ModelOpt exclude_modules) and as exact names / "re:" regexes
// (compressed-tensors ignore).
std::vector<std::string> excluded_globs(const std::set<std::string>& chosen,
                                        const std::set<std::string>& present, bool moe) {
  std::vector<std::string> g;
  if (!chosen.count("attn")) g.push_back("model.layers.*.self_attn*");
  if (!chosen.count("mlp") && present.count("mlp"))
    for (const char* p : {"*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"}) g.push_back(p);
  if (!chosen.count("experts") && present.count("experts")) g.push_back("*mlp.experts*");
  if (moe) g.push_back("*mlp.gate");  // the router
  g.push_back("lm_head");
  return g;
}

std::vector<std::string> ignore_regexes(const std::set<std::string>& chosen,
                                        const std::set<std::string>& present, bool moe) {
  std::vector<std::string> g;
  if (!chosen.count("attn")) g.push_back("re:.*self_attn\\..*");
  if (!chosen.count("mlp") && present.count("mlp")) g.push_back("re:.*mlp\\.(gate|up|down)_proj$");
  if (!chosen.count("experts") && present.count("experts")) g.push_back("re:.*mlp\\.experts\\..*");
  if (moe) g.push_back("re:.*mlp\\.gate$");
  g.push_back("lm_head");
  return g;
}

}  // namespace

void quantize_mxfp4(const float* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales) {
  const int64_t nb = k / fmt::kMxfp4Block;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b)
      scales[r * nb + b] = fmt::mxfp4_encode_block(w + r * k + b * fmt::kMxfp4Block,
                                                   codes + r * (k / 2) + b * (fmt::kMxfp4Block / 2));
}

float quantize_nvfp4(const float* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n * k; ++i) amax = std::max(amax, std::fabs(w[i]));
  const float s2 = fmt::nvfp4_global_scale(amax);
  const int64_t nb = k / fmt::kNvfp4Block;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b)
      scales[r * nb + b] = fmt::nvfp4_encode_block(w + r * k + b * fmt::kNvfp4Block, s2,
                                                   codes + r * (k / 2) + b * (fmt::kNvfp4Block / 2));
  return s2;
}

void quantize_fp8(const float* w, int64_t n, int64_t k, uint8_t* codes, float* scales) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = w + r * k;
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
    const float s = amax > 0.0f ? amax / fmt::kE4M3Max : 1.0f;
    scales[r] = s;
    for (int64_t i = 0; i < k; ++i) codes[r * k + i] = fmt::float_to_e4m3(row[i] / s);
  }
}

Result<QuantizeReport> quantize_checkpoint(const QuantizeOptions& o) {
  const fs::path in_dir(o.input_dir), out_dir(o.output_dir);
  std::error_code ec;
  if (!fs::is_directory(in_dir, ec)) return error("-m " + o.input_dir + ": not a directory");
  if (fs::exists(out_dir, ec) && fs::equivalent(in_dir, out_dir, ec))
    return error("-o " + o.output_dir + ": the output directory must differ from the input");
  NB_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(o.input_dir));
  if (cfg.quant.method != QuantMethod::kNone)
    return error("-m " + o.input_dir + ": already quantized (" + quant_method_name(cfg.quant.method) +
                 "); quantize needs a BF16 checkpoint");
  NB_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(o.input_dir));

  std::set<std::string> present;
  for (const std::string& name : ckpt.names()) {
    const std::string c = class_of_tensor(name, *ckpt.find(name)->info);
    if (!c.empty()) present.insert(c);
  }
  NB_ASSIGN_OR_RETURN(std::set<std::string> chosen, resolve_classes(o, cfg, present));
  QuantizeReport report;
  report.classes.assign(chosen.begin(), chosen.end());

  // Tensors in file order (the order of the input's shards and offsets), each copied or replaced.
  std::vector<const Checkpoint::Entry*> order;
  for (const std::string& name : ckpt.names()) order.push_back(ckpt.find(name));
  std::stable_sort(order.begin(), order.end(), [](const Checkpoint::Entry* a, const Checkpoint::Entry* b) {
    return a->file != b->file ? a->file->path() < b->file->path() : a->info->begin < b->info->begin;
  });

  SafetensorsWriter out;
  for (const Checkpoint::Entry* e : order) {
    const TensorInfo& t = *e->info;
    const TensorView v = e->view();
    report.bytes_in += v.nbytes();
    const std::string cls = class_of_tensor(t.name, t);
    if (cls.empty() || !chosen.count(cls)) {
      NB_RETURN_IF_ERROR(out.add(t.name, t.dtype, t.shape, v.data, v.nbytes()));
      ++report.tensors_copied;
      continue;
    }
    if (t.dtype != DType::kBF16)
      return error("tensor '" + t.name + "' is " + std::string(dtype_name(t.dtype)) +
                   "; quantize needs BF16 input for --layers " + cls);
    ++report.tensors_quantized;
    const std::vector<float> w = to_floats(v);
    if (cfg.arch == Arch::kGptOss) {
      // Stacked experts, HF layout [E, k, n] (x @ W[e]) -> gpt-oss blocks [E, n, k/32, 16] + scales [E, n,
      // k/32].
      const int64_t n_exp = t.shape[0], k = t.shape[1], n = t.shape[2];
      if (k % fmt::kMxfp4Block != 0)
        return error("tensor '" + t.name + "': MXFP4 needs the input dimension % 32 == 0, got " +
                     std::to_string(k));
      std::vector<uint8_t> blocks(n_exp * n * k / 2), scales(n_exp * n * k / 32);
      std::vector<float> wt(n * k);
      for (int64_t x = 0; x < n_exp; ++x) {
        const float* src = w.data() + x * k * n;
        for (int64_t i = 0; i < k; ++i)
          for (int64_t j = 0; j < n; ++j) wt[j * k + i] = src[i * n + j];
        quantize_mxfp4(wt.data(), n, k, blocks.data() + x * n * k / 2, scales.data() + x * n * k / 32);
      }
      NB_RETURN_IF_ERROR(out.add(t.name + "_blocks", DType::kU8, {n_exp, n, k / 32, 16}, blocks));
      NB_RETURN_IF_ERROR(out.add(t.name + "_scales", DType::kU8, {n_exp, n, k / 32}, scales));
      continue;
    }
    if (t.shape.size() != 2)
      return error("tensor '" + t.name + "': expected a matrix, got " + shape_string(t.shape));
    const int64_t n = t.shape[0], k = t.shape[1];
    const std::string base = t.name.substr(0, t.name.size() - std::string(".weight").size());
    if (o.format == QuantFormat::kNVFP4) {
      if (k % fmt::kNvfp4Block != 0)
        return error("tensor '" + t.name + "': NVFP4 needs k % 16 == 0, k = " + std::to_string(k));
      std::vector<uint8_t> codes(n * k / 2), scales(n * k / 16);
      const float s2 = quantize_nvfp4(w.data(), n, k, codes.data(), scales.data());
      NB_RETURN_IF_ERROR(out.add(base + ".weight", DType::kU8, {n, k / 2}, codes));
      NB_RETURN_IF_ERROR(out.add(base + ".weight_scale", DType::kF8_E4M3, {n, k / 16}, scales));
      NB_RETURN_IF_ERROR(out.add(base + ".weight_scale_2", DType::kF32, {}, &s2, sizeof(s2)));
    } else {
      std::vector<uint8_t> codes(n * k);
      std::vector<float> scales(n);
      quantize_fp8(w.data(), n, k, codes.data(), scales.data());
      NB_RETURN_IF_ERROR(out.add(base + ".weight", DType::kF8_E4M3, {n, k}, codes));
      NB_RETURN_IF_ERROR(out.add(base + ".weight_scale", DType::kF32, {n, 1}, scales));
    }
  }

  // config.json with the quantization recorded; ModelOpt's legacy hf_quant_config.json for NVFP4.
  NB_ASSIGN_OR_RETURN(std::string config_text, read_text(in_dir / "config.json"));
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(config_text, nullptr, false);
  if (config.is_discarded() || !config.is_object())
    return error(o.input_dir + "/config.json: not a JSON object");
  const bool moe = cfg.n_experts > 0;
  std::string hf_quant;
  if (o.format == QuantFormat::kMXFP4) {
    config["quantization_config"] = {
        {"quant_method", "mxfp4"},
        {"modules_to_not_convert",
         {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"}}};
    report.layout = "gpt-oss MXFP4 experts (_blocks/_scales U8), quantization_config mxfp4";
  } else if (o.format == QuantFormat::kNVFP4) {
    nlohmann::ordered_json q;
    q["producer"] = {{"name", "nibble"}, {"version", "0.1.0"}};
    q["quantization"] = {{"quant_algo", "W4A16_NVFP4"},
                         {"kv_cache_quant_algo", nullptr},
                         {"group_size", 16},
                         {"exclude_modules", excluded_globs(chosen, present, moe)}};
    hf_quant = q.dump(2) + "\n";
    config.erase("quantization_config");
    report.layout =
        "ModelOpt W4A16_NVFP4 (weight U8, weight_scale F8_E4M3, weight_scale_2 F32), hf_quant_config.json";
  } else {
    config["quantization_config"] = {{"quant_method", "compressed-tensors"},
                                     {"format", "float-quantized"},
                                     {"quantization_status", "compressed"},
                                     {"config_groups",
                                      {{"group_0",
                                        {{"targets", {"Linear"}},
                                         {"weights",
                                          {{"num_bits", 8},
                                           {"type", "float"},
                                           {"strategy", "channel"},
                                           {"symmetric", true},
                                           {"dynamic", false},
                                           {"group_size", nullptr}}}}}}},
                                     {"ignore", ignore_regexes(chosen, present, moe)},
                                     {"kv_cache_scheme", nullptr}};
    report.layout = "compressed-tensors float-quantized FP8 E4M3, per-channel F32 weight_scale";
  }

  fs::create_directories(out_dir, ec);
  if (ec) return error("-o " + o.output_dir + ": cannot create (" + ec.message() + ")");
  for (const auto& f : fs::directory_iterator(out_dir, ec)) {  // stale weights of an earlier run
    const std::string name = f.path().filename().string();
    if (name.ends_with(".safetensors") || name == "model.safetensors.index.json" ||
        name == "hf_quant_config.json")
      fs::remove(f.path(), ec);
  }
  NB_RETURN_IF_ERROR(out.write_dir(o.output_dir));
  NB_RETURN_IF_ERROR(write_text(out_dir / "config.json", config.dump(2) + "\n"));
  if (!hf_quant.empty()) NB_RETURN_IF_ERROR(write_text(out_dir / "hf_quant_config.json", hf_quant));
  // Everything else (tokenizer, generation config, chat template, notes) is copied as it is.
  for (const auto& f : fs::directory_iterator(in_dir, ec)) {
    const std::string name = f.path().filename().string();
    if (!f.is_regular_file() || name.ends_with(".safetensors") || name == "model.safetensors.index.json" ||
        name == "config.json" || name == "hf_quant_config.json")
      continue;
    fs::copy_file(f.path(), out_dir / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return error(f.path().string() + ": cannot copy (" + ec.message() + ")");
  }
  report.bytes_out = out.total_bytes();
  return report;
}

}  // namespace nb
