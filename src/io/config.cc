// config.json (+ hf_quant_config.json) -> ModelConfig for gpt_oss, qwen3, qwen3_moe and llama, in the
// classic and the transformers v5 dialects, and the quantization flavour (formats.md §2.2, §3, §6, §9).
// Keys that fix tensor shapes are required; other keys fall back to the transformers class defaults.
// Every error names config.json and the key at fault.
#include "io/config.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

namespace nb {
namespace {

using json = nlohmann::json;

constexpr const char* kSupportedArchs = "gpt_oss, qwen3, qwen3_moe, llama";
constexpr const char* kSupportedQuantMethods = "mxfp4, modelopt, compressed-tensors";
constexpr const char* kSupportedModeloptAlgos = "NVFP4, W4A16_NVFP4";
constexpr const char* kSupportedCtFormats = "nvfp4-pack-quantized, float-quantized";
bool supported_ct_format(const std::string& f) { return f == "nvfp4-pack-quantized" || f == "float-quantized"; }
constexpr const char* kSupportedRopeTypes = "default, yarn, llama3";
constexpr int kMaxLayers = 100000;  // far above any real model; keeps per-layer vectors bounded

std::string found(const json& v) {
  if (v.is_number_float()) return "a float";
  if (v.is_number()) return "an integer";
  return std::string("a JSON ") + v.type_name();
}

// Reads typed fields from one JSON object, remembering the first error. A key that is absent or null
// takes the default; a key of the wrong type is an error (null is how transformers writes "unset").
class Reader {
 public:
  Reader(std::string file, const json& obj, std::string prefix = "")
      : file_(std::move(file)), obj_(obj), prefix_(std::move(prefix)) {}

  const json* find(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const char* key) const { return find(key) != nullptr; }
  std::string name(const char* key) const { return "'" + prefix_ + key + "'"; }

  void fail(const std::string& msg) {
    if (status_.ok()) status_ = error(file_ + ": " + msg);
  }
  void missing(const char* key) { fail(name(key) + " is missing"); }
  void wrong_type(const char* key, const char* want, const json& v) {
    fail(name(key) + " must be " + want + ", found " + found(v));
  }

  // Returns whether the key was present (and well typed).
  bool integer(const char* key, int* out, bool required = false) {
    const json* v = find(key);
    if (v == nullptr) {
      if (required) missing(key);
      return false;
    }
    if (!v->is_number_integer()) return wrong_type(key, "an integer", *v), false;
    if (v->is_number_unsigned() ? v->get<uint64_t>() > static_cast<uint64_t>(INT_MAX)
                                : (v->get<int64_t>() > INT_MAX || v->get<int64_t>() < INT_MIN)) {
      return fail(name(key) + " is out of range"), false;
    }
    *out = v->get<int>();
    return true;
  }
  bool number(const char* key, double* out, bool required = false) {
    const json* v = find(key);
    if (v == nullptr) {
      if (required) missing(key);
      return false;
    }
    if (!v->is_number()) return wrong_type(key, "a number", *v), false;
    *out = v->get<double>();
    return true;
  }
  bool number(const char* key, float* out, bool required = false) {
    double d = *out;
    if (!number(key, &d, required)) return false;
    *out = static_cast<float>(d);
    return true;
  }
  bool boolean(const char* key, bool* out) {
    const json* v = find(key);
    if (v == nullptr) return false;
    if (!v->is_boolean()) return wrong_type(key, "true or false", *v), false;
    *out = v->get<bool>();
    return true;
  }
  bool string(const char* key, std::string* out, bool required = false) {
    const json* v = find(key);
    if (v == nullptr) {
      if (required) missing(key);
      return false;
    }
    if (!v->is_string()) return wrong_type(key, "a string", *v), false;
    *out = v->get<std::string>();
    return true;
  }
  bool string_list(const char* key, std::vector<std::string>* out) {
    const json* v = find(key);
    if (v == nullptr) return false;
    if (!v->is_array()) return wrong_type(key, "a list of strings", *v), false;
    out->clear();
    for (const json& e : *v) {
      if (!e.is_string()) return wrong_type(key, "a list of strings", e), false;
      out->push_back(e.get<std::string>());
    }
    return true;
  }
  bool int_list(const char* key, std::vector<int>* out) {
    const json* v = find(key);
    if (v == nullptr) return false;
    if (!v->is_array()) return wrong_type(key, "a list of integers", *v), false;
    out->clear();
    for (const json& e : *v) {
      if (!e.is_number_integer() || e.get<int64_t>() < INT_MIN || e.get<int64_t>() > INT_MAX ||
          (e.is_number_unsigned() && e.get<uint64_t>() > static_cast<uint64_t>(INT_MAX))) {
        return wrong_type(key, "a list of integers", e), false;
      }
      out->push_back(e.get<int>());
    }
    return true;
  }
  // An object-valued key; nullptr when absent/null (or wrong type, which records an error).
  const json* object(const char* key) {
    const json* v = find(key);
    if (v != nullptr && !v->is_object()) return wrong_type(key, "an object", *v), nullptr;
    return v;
  }

  const std::string& file() const { return file_; }
  const std::string& prefix() const { return prefix_; }
  const Status& status() const { return status_; }
  void merge(const Reader& other) {
    if (status_.ok()) status_ = other.status_;
  }

 private:
  std::string file_;
  const json& obj_;
  std::string prefix_;
  Status status_;
};

Result<json> parse_json(const std::string& file, const std::string& text) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) return error(file + ": not a JSON object");
    return j;
  } catch (const json::exception& e) {
    return error(file + ": not valid JSON: " + e.what());
  }
}

// --- RoPE -------------------------------------------------------------------------------------------------

// Reads the scaling fields from `r` (rope_scaling, or v5 rope_parameters, which also holds rope_theta).
void parse_rope_fields(Reader& r, int max_position_embeddings, RopeConfig* rope) {
  std::string type = "default";
  if (!r.string("rope_type", &type)) r.string("type", &type);
  if (!r.status().ok()) return;
  if (type == "default") {
    rope->type = RopeType::kDefault;
  } else if (type == "yarn") {
    rope->type = RopeType::kYarn;
    r.number("factor", &rope->factor, /*required=*/true);
    r.number("beta_fast", &rope->beta_fast);
    r.number("beta_slow", &rope->beta_slow);
    r.boolean("truncate", &rope->truncate);
    r.number("attention_factor", &rope->attention_factor);
    // transformers falls back to max_position_embeddings when the original length is not given.
    rope->original_max_position_embeddings = max_position_embeddings;
    r.integer("original_max_position_embeddings", &rope->original_max_position_embeddings);
    if (r.has("mscale") || r.has("mscale_all_dim")) {
      r.fail(r.name("mscale") + " (DeepSeek-style yarn) is not supported");
    }
  } else if (type == "llama3") {
    rope->type = RopeType::kLlama3;
    r.number("factor", &rope->factor, true);
    r.number("low_freq_factor", &rope->low_freq_factor, true);
    r.number("high_freq_factor", &rope->high_freq_factor, true);
    r.integer("original_max_position_embeddings", &rope->original_max_position_embeddings, true);
  } else {
    r.fail(r.name("rope_type") + " '" + type + "' is not supported (supported: " + kSupportedRopeTypes + ")");
  }
}

void parse_rope(Reader& top, double default_theta, int max_position_embeddings, RopeConfig* rope) {
  rope->theta = default_theta;
  top.number("rope_theta", &rope->theta);
  // v5 keeps everything in rope_parameters; it wins over a leftover classic rope_scaling.
  if (const json* params = top.object("rope_parameters")) {
    Reader r(top.file(), *params, "rope_parameters.");
    r.number("rope_theta", &rope->theta);
    parse_rope_fields(r, max_position_embeddings, rope);
    top.merge(r);
  } else if (const json* scaling = top.object("rope_scaling")) {
    Reader r(top.file(), *scaling, "rope_scaling.");
    parse_rope_fields(r, max_position_embeddings, rope);
    top.merge(r);
  }
}

// --- quantization -----------------------------------------------------------------------------------------

void check_patterns(Reader& r, const char* key, const std::vector<std::string>& patterns) {
  for (const std::string& p : patterns) {
    if (p.rfind("re:", 0) != 0) continue;
    try {
      std::regex re(p.substr(3));
    } catch (const std::regex_error&) {
      r.fail(r.name(key) + " entry '" + p + "' is not a valid regular expression");
    }
  }
}

// kv_cache_scheme {"num_bits": 8, "type": "float"} or kv_cache_quant_algo "FP8": recorded, never fatal
// (nibble may ignore the k_scale/v_scale tensors and keep its own cache format).
void parse_kv_cache(Reader& r, QuantConfig* q) {
  std::string algo;
  if (r.string("kv_cache_quant_algo", &algo)) {
    q->kv_cache_quant = algo;
  } else if (const json* scheme = r.object("kv_cache_scheme")) {
    Reader s(r.file(), *scheme, r.prefix() + "kv_cache_scheme.");
    int bits = 0;
    std::string type;
    s.integer("num_bits", &bits);
    s.string("type", &type);
    q->kv_cache_quant = (type == "float" && bits == 8) ? "FP8" : type + std::to_string(bits);
    r.merge(s);
  }
}

void set_modelopt_algo(Reader& r, const std::string& algo, QuantConfig* q) {
  q->method = QuantMethod::kModeloptNvfp4;
  if (algo == "NVFP4") {
    q->activations_quantized = true;
  } else if (algo == "W4A16_NVFP4") {
    q->activations_quantized = false;
  } else {
    r.fail(r.name("quant_algo") + " '" + algo + "' is not supported (supported: " + kSupportedModeloptAlgos +
           ")");
  }
}

void check_group_size(Reader& r, const char* key, int group_size, int want) {
  if (group_size != want) {
    r.fail(r.name(key) + " is " + std::to_string(group_size) + ", but this format needs " +
           std::to_string(want));
  }
}

// ModelOpt's weight group size may sit in config_groups.*.weights (new form) or at top level.
void modelopt_group_size(Reader& r, QuantConfig* q) {
  q->group_size = 16;
  if (r.integer("group_size", &q->group_size)) check_group_size(r, "group_size", q->group_size, 16);
  if (const json* groups = r.object("config_groups")) {
    for (const auto& [gname, group] : groups->items()) {
      if (!group.is_object()) continue;
      auto w = group.find("weights");
      if (w == group.end() || !w->is_object()) continue;
      Reader wr(r.file(), *w, r.prefix() + "config_groups." + gname + ".weights.");
      if (wr.integer("group_size", &q->group_size)) check_group_size(wr, "group_size", q->group_size, 16);
      r.merge(wr);
    }
  }
}

void parse_compressed_tensors(Reader& r, QuantConfig* q) {
  q->method = QuantMethod::kCompressedTensorsNvfp4;
  q->group_size = 16;
  std::string format;
  r.string("format", &format, /*required=*/true);
  // float-quantized: FP8 E4M3 weights with one F32 scale per output channel (what `nibble quantize
  // --format fp8` writes); checked below like the NVFP4 groups, with 8 bits and strategy "channel".
  const bool fp8 = format == "float-quantized";
  if (fp8) {
    q->method = QuantMethod::kCompressedTensorsFp8;
    q->group_size = 0;
  }
  if (r.status().ok() && !supported_ct_format(format)) {
    r.fail(r.name("format") + " '" + format + "' is not supported (supported: " + kSupportedCtFormats + ")");
  }
  std::string status;
  if (r.string("quantization_status", &status) && status != "compressed") {
    r.fail(r.name("quantization_status") + " is '" + status +
           "', but only 'compressed' (packed) weights load");
  }
  const json* groups = r.object("config_groups");
  if (groups == nullptr) {
    if (r.status().ok()) r.missing("config_groups");
    return;
  }
  if (groups->empty()) r.fail(r.name("config_groups") + " is empty");
  for (const auto& [gname, group] : groups->items()) {
    const std::string gprefix = r.prefix() + "config_groups." + gname + ".";
    if (!group.is_object()) {
      r.fail("'" + gprefix.substr(0, gprefix.size() - 1) + "' must be an object, found " + found(group));
      return;
    }
    Reader g(r.file(), group, gprefix);
    std::string gformat;
    if (g.string("format", &gformat) && gformat != format) {
      g.fail(g.name("format") + " '" + gformat + "' is not supported (supported: " + kSupportedCtFormats +
             ")");
    }
    if (const json* w = fp8 ? g.object("weights") : nullptr) {
      Reader wr(r.file(), *w, gprefix + "weights.");
      int bits = 0;
      std::string type, strategy;
      wr.integer("num_bits", &bits, true);
      wr.string("type", &type, true);
      wr.string("strategy", &strategy, true);
      if (wr.status().ok() && (bits != 8 || type != "float" || strategy != "channel"))
        wr.fail(wr.name("num_bits") + " is " + std::to_string(bits) + ", 'type' '" + type + "', 'strategy' '" +
                strategy + "', but float-quantized loads only 8, 'float', 'channel'");
      g.merge(wr);
    } else if (const json* w = g.object("weights")) {
      Reader wr(r.file(), *w, gprefix + "weights.");
      int bits = 0, group_size = 0;
      std::string type;
      wr.integer("num_bits", &bits, true);
      wr.string("type", &type, true);
      wr.integer("group_size", &group_size, true);
      if (wr.status().ok() && (bits != 4 || type != "float")) {
        wr.fail(wr.name("num_bits") + " is " + std::to_string(bits) + " and 'type' is '" + type +
                "', but nvfp4-pack-quantized needs 4 and 'float'");
      }
      if (wr.status().ok()) check_group_size(wr, "group_size", group_size, 16);
      g.merge(wr);
    } else if (g.status().ok()) {
      g.missing("weights");
    }
    if (g.has("input_activations")) q->activations_quantized = true;
    r.merge(g);
  }
}

void parse_quantization_config(Reader& r, QuantConfig* q) {
  q->source = "config.json";
  std::string method;
  if (!r.string("quant_method", &method, /*required=*/true)) return;
  if (method == "mxfp4") {
    q->method = QuantMethod::kMxfp4;
    q->group_size = 32;
    r.string_list("modules_to_not_convert", &q->exclude);
    check_patterns(r, "modules_to_not_convert", q->exclude);
  } else if (method == "modelopt") {
    std::string algo;
    if (r.string("quant_algo", &algo, true)) set_modelopt_algo(r, algo, q);
    modelopt_group_size(r, q);
    if (!r.string_list("ignore", &q->exclude)) r.string_list("exclude_modules", &q->exclude);
    check_patterns(r, "ignore", q->exclude);
    parse_kv_cache(r, q);
  } else if (method == "compressed-tensors") {
    parse_compressed_tensors(r, q);
    r.string_list("ignore", &q->exclude);
    check_patterns(r, "ignore", q->exclude);
    parse_kv_cache(r, q);
  } else {
    r.fail(r.name("quant_method") + " '" + method +
           "' is not supported (supported: " + kSupportedQuantMethods + ")");
  }
}

// ModelOpt's legacy hf_quant_config.json: {"producer": {...}, "quantization": {"quant_algo": ..., ...}}.
Status parse_hf_quant_config(const std::string& text, QuantConfig* q) {
  const std::string file = "hf_quant_config.json";
  NB_ASSIGN_OR_RETURN(json j, parse_json(file, text));
  Reader top(file, j);
  const json* quant = top.object("quantization");
  if (quant == nullptr) {
    if (top.status().ok()) top.missing("quantization");
    return top.status();
  }
  Reader r(file, *quant, "quantization.");
  q->source = file;
  std::string algo;
  if (r.string("quant_algo", &algo, true)) set_modelopt_algo(r, algo, q);
  modelopt_group_size(r, q);
  r.string_list("exclude_modules", &q->exclude);
  check_patterns(r, "exclude_modules", q->exclude);
  parse_kv_cache(r, q);
  return r.status();
}

// --- layers -----------------------------------------------------------------------------------------------

void parse_layer_types(Reader& r, int n_layers, std::vector<bool>* sliding, bool* present) {
  *present = false;
  std::vector<std::string> types;
  if (!r.string_list("layer_types", &types)) return;
  *present = true;
  if (static_cast<int>(types.size()) != n_layers) {
    r.fail(r.name("layer_types") + " has " + std::to_string(types.size()) +
           " entries but 'num_hidden_layers' is " + std::to_string(n_layers));
    return;
  }
  sliding->assign(n_layers, false);
  for (int i = 0; i < n_layers; ++i) {
    if (types[i] == "sliding_attention") {
      (*sliding)[i] = true;
    } else if (types[i] != "full_attention") {
      r.fail(r.name("layer_types") + "[" + std::to_string(i) + "] is '" + types[i] +
             "' (supported: sliding_attention, full_attention)");
      return;
    }
  }
}

// --- glob matching (Python fnmatch semantics, case-sensitive) ---------------------------------------------

// Matches the character class starting at pat[p] == '['; sets *len to its length. Returns false with
// *len == 0 when the '[' opens no valid class (fnmatch then treats it as a literal '[').
bool match_class(std::string_view pat, size_t p, char c, size_t* len) {
  size_t j = p + 1;
  bool negate = false;
  if (j < pat.size() && pat[j] == '!') negate = true, ++j;
  size_t first = j;
  if (j < pat.size() && pat[j] == ']') ++j;  // a leading ']' is a literal member
  while (j < pat.size() && pat[j] != ']') ++j;
  if (j >= pat.size()) {
    *len = 0;
    return false;
  }
  bool in = false;
  for (size_t k = first; k < j; ++k) {
    if (k + 2 < j && pat[k + 1] == '-') {
      if (pat[k] <= c && c <= pat[k + 2]) in = true;
      k += 2;
    } else if (pat[k] == c) {
      in = true;
    }
  }
  *len = j - p + 1;
  return in != negate;
}

bool glob_match(std::string_view pat, std::string_view s) {
  size_t p = 0, i = 0;
  size_t star_p = std::string_view::npos, star_i = 0;
  while (i < s.size()) {
    if (p < pat.size() && pat[p] == '*') {
      star_p = ++p;
      star_i = i;
      continue;
    }
    if (p < pat.size()) {
      size_t len = 1;
      bool ok;
      if (pat[p] == '?') {
        ok = true;
      } else if (pat[p] == '[') {
        ok = match_class(pat, p, s[i], &len);
        if (len == 0) len = 1, ok = (s[i] == '[');
      } else {
        ok = pat[p] == s[i];
      }
      if (ok) {
        p += len;
        ++i;
        continue;
      }
    }
    if (star_p == std::string_view::npos) return false;
    p = star_p;
    i = ++star_i;
  }
  while (p < pat.size() && pat[p] == '*') ++p;
  return p == pat.size();
}

bool pattern_matches(const std::string& pattern, const std::string& name) {
  if (pattern.rfind("re:", 0) == 0) {
    try {
      return std::regex_match(name, std::regex(pattern.substr(3)));
    } catch (const std::regex_error&) {
      return false;  // rejected when the config was parsed; a hand-built QuantConfig just does not match
    }
  }
  return glob_match(pattern, name);
}

}  // namespace

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kGptOss:
      return "gpt_oss";
    case Arch::kQwen3:
      return "qwen3";
    case Arch::kQwen3Moe:
      return "qwen3_moe";
    case Arch::kLlama:
      return "llama";
  }
  return "unknown";
}

const char* quant_method_name(QuantMethod q) {
  switch (q) {
    case QuantMethod::kNone:
      return "none";
    case QuantMethod::kMxfp4:
      return "mxfp4";
    case QuantMethod::kModeloptNvfp4:
      return "modelopt-nvfp4";
    case QuantMethod::kCompressedTensorsNvfp4:
      return "compressed-tensors-nvfp4";
    case QuantMethod::kCompressedTensorsFp8:
      return "compressed-tensors-fp8";
  }
  return "unknown";
}

bool ModelConfig::is_moe_layer(int layer) const {
  if (n_experts == 0 || layer < 0 || layer >= n_layers) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

bool is_module_excluded(const QuantConfig& quant, const std::string& module_name) {
  if (quant.exclude.empty()) return false;
  std::vector<std::string> candidates = {module_name, module_name + "."};
  for (size_t dot = module_name.find('.'); dot != std::string::npos; dot = module_name.find('.', dot + 1)) {
    candidates.push_back(module_name.substr(0, dot));
  }
  for (const std::string& pattern : quant.exclude) {
    for (const std::string& c : candidates) {
      if (pattern_matches(pattern, c)) return true;
    }
  }
  return false;
}

Result<ModelConfig> parse_model_config(const std::string& config_text, const std::string& quant_text) {
  const std::string file = "config.json";
  NB_ASSIGN_OR_RETURN(json j, parse_json(file, config_text));
  Reader r(file, j);
  ModelConfig c;

  if (!r.string("model_type", &c.model_type, /*required=*/true)) return r.status();
  double default_theta = 10000.0;
  if (c.model_type == "gpt_oss") {
    c.arch = Arch::kGptOss;
    default_theta = 150000.0;
  } else if (c.model_type == "qwen3") {
    c.arch = Arch::kQwen3;
  } else if (c.model_type == "qwen3_moe") {
    c.arch = Arch::kQwen3Moe;
  } else if (c.model_type == "llama") {
    c.arch = Arch::kLlama;
  } else {
    return error(file + ": model_type '" + c.model_type +
                 "' is not supported (supported: " + kSupportedArchs + ")");
  }
  const bool gpt_oss = c.arch == Arch::kGptOss;
  const bool qwen = c.arch == Arch::kQwen3 || c.arch == Arch::kQwen3Moe;

  // Shape-defining keys: required.
  r.integer("vocab_size", &c.vocab_size, true);
  r.integer("hidden_size", &c.d_model, true);
  r.integer("num_hidden_layers", &c.n_layers, true);
  r.integer("num_attention_heads", &c.n_heads, true);
  // transformers: num_key_value_heads None means multi-head attention (llama, qwen3); gpt-oss has no
  // such fallback, so there it is required.
  if (!r.integer("num_key_value_heads", &c.n_kv_heads, gpt_oss)) c.n_kv_heads = c.n_heads;
  if (!r.status().ok()) return r.status();
  if (c.n_heads <= 0)
    return error(file + ": 'num_attention_heads' must be positive, found " + std::to_string(c.n_heads));
  if (c.n_layers <= 0 || c.n_layers > kMaxLayers) {
    return error(file + ": 'num_hidden_layers' must be in [1, " + std::to_string(kMaxLayers) + "], found " +
                 std::to_string(c.n_layers));
  }
  // head_dim: Qwen3Config always carries one (class default 128, which differs from hidden/heads for the
  // small Qwen3 models); Llama and gpt-oss fall back to hidden/heads.
  if (!r.integer("head_dim", &c.head_dim)) c.head_dim = qwen ? 128 : c.d_model / c.n_heads;

  // Everything else: the transformers class defaults.
  c.rms_norm_eps = gpt_oss ? 1e-5f : 1e-6f;
  r.number("rms_norm_eps", &c.rms_norm_eps);
  c.max_position_embeddings = gpt_oss ? 131072 : (qwen ? 32768 : 2048);
  r.integer("max_position_embeddings", &c.max_position_embeddings);
  c.attention_bias = gpt_oss;
  r.boolean("attention_bias", &c.attention_bias);
  r.boolean("tie_word_embeddings", &c.tie_word_embeddings);
  r.integer("bos_token_id", &c.bos_token_id);
  if (const json* eos = r.find("eos_token_id")) {
    if (eos->is_array()) {
      r.int_list("eos_token_id", &c.eos_token_ids);
    } else {
      int id = 0;
      if (r.integer("eos_token_id", &id)) c.eos_token_ids = {id};
    }
  }

  switch (c.arch) {
    case Arch::kGptOss: {
      // The HF form says num_local_experts / num_experts_per_tok; the original checkpoint num_experts /
      // experts_per_token. Either is accepted; both must agree when both appear.
      int a = 0, b = 0;
      bool has_a = r.integer("num_local_experts", &a), has_b = r.integer("num_experts", &b);
      if (has_a && has_b && a != b) r.fail("'num_local_experts' and 'num_experts' disagree");
      if (!has_a && !has_b && r.status().ok()) r.missing("num_local_experts");
      c.n_experts = has_a ? a : b;
      has_a = r.integer("num_experts_per_tok", &a), has_b = r.integer("experts_per_token", &b);
      if (has_a && has_b && a != b) r.fail("'num_experts_per_tok' and 'experts_per_token' disagree");
      if (!has_a && !has_b && r.status().ok()) r.missing("num_experts_per_tok");
      c.top_k = has_a ? a : b;
      r.integer("intermediate_size", &c.d_ff, true);
      c.d_expert = c.d_ff;
      c.swiglu_limit = 7.0f;
      r.number("swiglu_limit", &c.swiglu_limit);
      c.sliding_window = 128;
      r.integer("sliding_window", &c.sliding_window);
      bool present = false;
      parse_layer_types(r, c.n_layers, &c.layer_sliding, &present);
      if (!present) {  // configuration_gpt_oss.py: layer i slides iff i is even
        c.layer_sliding.assign(c.n_layers, false);
        for (int i = 0; i < c.n_layers; i += 2) c.layer_sliding[i] = true;
      }
      break;
    }
    case Arch::kQwen3Moe: {
      int a = 0, b = 0;
      bool has_a = r.integer("num_experts", &a), has_b = r.integer("num_local_experts", &b);
      if (has_a && has_b && a != b) r.fail("'num_experts' and 'num_local_experts' disagree");
      if (!has_a && !has_b && r.status().ok()) r.missing("num_experts");
      c.n_experts = has_a ? a : b;
      r.integer("num_experts_per_tok", &c.top_k, true);
      r.integer("moe_intermediate_size", &c.d_expert, true);
      r.boolean("norm_topk_prob", &c.norm_topk_prob);
      r.integer("decoder_sparse_step", &c.decoder_sparse_step);
      r.int_list("mlp_only_layers", &c.mlp_only_layers);
      r.integer("intermediate_size", &c.d_ff);  // only dense layers need it; checked below
      [[fallthrough]];
    }
    case Arch::kQwen3: {
      if (c.arch == Arch::kQwen3) r.integer("intermediate_size", &c.d_ff, true);
      // configuration_qwen3.py: sliding only with use_sliding_window, and then for layers >=
      // max_window_layers.
      bool use_sliding = false;
      r.boolean("use_sliding_window", &use_sliding);
      int window = 4096, max_window_layers = 28;
      r.integer("sliding_window", &window);
      r.integer("max_window_layers", &max_window_layers);
      c.sliding_window = use_sliding ? window : 0;
      bool present = false;
      std::vector<bool> types;
      parse_layer_types(r, c.n_layers, &types, &present);
      c.layer_sliding.assign(c.n_layers, false);
      for (int i = 0; i < c.n_layers && c.sliding_window > 0; ++i) {
        c.layer_sliding[i] = present ? static_cast<bool>(types[i]) : i >= max_window_layers;
      }
      break;
    }
    case Arch::kLlama:
      r.integer("intermediate_size", &c.d_ff, true);
      c.layer_sliding.assign(c.n_layers, false);
      break;
  }
  if (!r.status().ok()) return r.status();

  parse_rope(r, default_theta, c.max_position_embeddings, &c.rope);
  if (!r.status().ok()) return r.status();

  // Quantization: config.json's quantization_config wins; ModelOpt's legacy hf_quant_config.json otherwise.
  if (const json* q = r.object("quantization_config")) {
    Reader qr(file, *q, "quantization_config.");
    parse_quantization_config(qr, &c.quant);
    if (!qr.status().ok()) return qr.status();
  } else if (!r.status().ok()) {
    return r.status();
  } else if (!quant_text.empty()) {
    NB_RETURN_IF_ERROR(parse_hf_quant_config(quant_text, &c.quant));
  }

  // Sanity checks.
  auto positive = [&](const char* key, long long v) {
    if (v <= 0) r.fail("'" + std::string(key) + "' must be positive, found " + std::to_string(v));
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.d_model);
  positive("num_key_value_heads", c.n_kv_heads);
  positive("head_dim", c.head_dim);
  positive("max_position_embeddings", c.max_position_embeddings);
  if (!r.status().ok()) return r.status();
  if (c.n_heads % c.n_kv_heads != 0) {
    return error(file + ": 'num_attention_heads' (" + std::to_string(c.n_heads) +
                 ") must be a multiple of 'num_key_value_heads' (" + std::to_string(c.n_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0)
    return error(file + ": 'head_dim' must be even for RoPE, found " + std::to_string(c.head_dim));
  if (!(c.rms_norm_eps > 0.0f)) return error(file + ": 'rms_norm_eps' must be positive");
  if (!(c.rope.theta > 0.0)) return error(file + ": 'rope_theta' must be positive");
  if (c.rope.type != RopeType::kDefault) {
    if (!(c.rope.factor > 0.0)) return error(file + ": rope scaling 'factor' must be positive");
    if (c.rope.original_max_position_embeddings <= 0) {
      return error(file + ": rope scaling 'original_max_position_embeddings' must be positive");
    }
    if (c.rope.type == RopeType::kLlama3 && !(c.rope.high_freq_factor > c.rope.low_freq_factor)) {
      return error(file + ": rope scaling 'high_freq_factor' must exceed 'low_freq_factor'");
    }
  }
  if (c.arch == Arch::kGptOss || c.arch == Arch::kQwen3Moe) {
    positive(gpt_oss ? "num_local_experts" : "num_experts", c.n_experts);
    positive("num_experts_per_tok", c.top_k);
    positive(gpt_oss ? "intermediate_size" : "moe_intermediate_size", c.d_expert);
    if (!r.status().ok()) return r.status();
    if (c.top_k > c.n_experts) {
      return error(file + ": 'num_experts_per_tok' (" + std::to_string(c.top_k) +
                   ") exceeds the number of experts (" + std::to_string(c.n_experts) + ")");
    }
    if (c.decoder_sparse_step < 1) return error(file + ": 'decoder_sparse_step' must be at least 1");
    for (int l : c.mlp_only_layers) {
      if (l < 0 || l >= c.n_layers) {
        return error(file + ": 'mlp_only_layers' entry " + std::to_string(l) + " is not a layer index");
      }
    }
  }
  bool dense_layer = false;
  for (int l = 0; l < c.n_layers; ++l) dense_layer = dense_layer || !c.is_moe_layer(l);
  if (dense_layer) {
    if (c.d_ff == 0 && c.arch == Arch::kQwen3Moe) {
      return error(file + ": 'intermediate_size' is missing (needed by the dense layers)");
    }
    positive("intermediate_size", c.d_ff);
  }
  if (std::find(c.layer_sliding.begin(), c.layer_sliding.end(), true) != c.layer_sliding.end()) {
    positive("sliding_window", c.sliding_window);
  } else if (c.arch != Arch::kGptOss) {
    c.sliding_window = 0;
  }
  if (!(c.swiglu_limit >= 0.0f)) r.fail("'swiglu_limit' must not be negative");
  return r.status().ok() ? Result<ModelConfig>(std::move(c)) : Result<ModelConfig>(r.status());
}

Result<ModelConfig> load_model_config(const std::string& dir) {
  namespace fs = std::filesystem;
  auto read = [](const fs::path& p, std::string* out) -> Status {
    std::ifstream in(p, std::ios::binary);
    if (!in) return error(p.string() + ": cannot open: " + std::strerror(errno));
    std::ostringstream ss;
    ss << in.rdbuf();
    *out = ss.str();
    return Status::ok_status();
  };
  std::string config_text, quant_text;
  NB_RETURN_IF_ERROR(read(fs::path(dir) / "config.json", &config_text));
  std::error_code ec;
  const fs::path quant_path = fs::path(dir) / "hf_quant_config.json";
  if (fs::is_regular_file(quant_path, ec)) {
    NB_RETURN_IF_ERROR(read(quant_path, &quant_text));
    if (quant_text.empty()) return error(quant_path.string() + ": file is empty");
  }
  auto c = parse_model_config(config_text, quant_text);
  if (!c.ok()) return c.status().with_context(dir);
  return c;
}

}  // namespace nb
