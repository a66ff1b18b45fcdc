// Harmony's JSON-schema -> TypeScript rendering. The odd spacing (nested objects closing at the inner
// indent, oneOf variants on their own lines) is what gpt-oss saw in training, so it is kept as is.
#include "text/harmony_tools.h"

#include <algorithm>
#include <vector>

namespace nb::text {
namespace {

using ojson = nlohmann::ordered_json;

const std::string* get_string(const ojson& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? &it->get_ref<const std::string&>() : nullptr;
}

bool is_enum(const ojson& j) {
  auto it = j.find("enum");
  return it != j.end() && it->is_array() && !it->empty();
}

bool nullable(const ojson& j) {
  auto it = j.find("nullable");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// "default: ..." as harmony writes it: plain strings quoted, enum strings bare, the rest as JSON.
// `bare_enum_string` is false only for top-level oneOf variants, which print every value as JSON.
std::string default_comment(const ojson& owner, const ojson& value, bool bare_enum_string = true) {
  if (value.is_string() && !is_enum(owner)) return "default: \"" + value.get<std::string>() + "\"";
  if (value.is_string() && bare_enum_string) return "default: " + value.get<std::string>();
  return "default: " + dump(value);
}

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

std::string with_null(const ojson& variant, std::string type) {
  if (nullable(variant) && type.find("null") == std::string::npos) type += " | null";
  return type;
}

std::string object_type(const ojson& schema, const std::string& indent) {
  std::string out;
  if (const std::string* d = get_string(schema, "description")) out += indent + "// " + *d + "\n";
  out += "{\n";
  auto props = schema.find("properties");
  if (props != schema.end() && props->is_object()) {
    std::vector<std::string> required;
    auto req = schema.find("required");
    if (req != schema.end() && req->is_array()) {
      for (const ojson& r : *req) {
        if (r.is_string()) required.push_back(r.get<std::string>());
      }
    }
    for (const auto& [key, val] : props->items()) {
      bool is_required = std::find(required.begin(), required.end(), key) != required.end();
      const char* opt = is_required ? "" : "?";
      if (const std::string* t = get_string(val, "title"))
        out += indent + "// " + *t + "\n" + indent + "//\n";
      auto one_of = val.find("oneOf");
      bool has_one_of = one_of != val.end();
      const std::string* desc = get_string(val, "description");
      if (!has_one_of && desc) out += indent + "// " + *desc + "\n";
      auto examples = val.find("examples");
      if (examples != val.end() && examples->is_array() && !examples->empty()) {
        out += indent + "// Examples:\n";
        for (const ojson& ex : *examples) {
          if (ex.is_string()) out += indent + "// - \"" + ex.get<std::string>() + "\"\n";
        }
      }
      if (has_one_of && one_of->is_array()) {
        // The property's description goes above it unless the first variant repeats it.
        const std::string* first_desc =
            one_of->empty() ? nullptr : get_string(one_of->front(), "description");
        bool desc_above = desc && !(first_desc && *first_desc == *desc);
        if (desc_above) out += indent + "// " + *desc + "\n";
        if (auto def = val.find("default"); def != val.end())
          out += indent + "// " + default_comment(val, *def) + "\n";
        out += indent + key + opt + ":\n";
        for (size_t i = 0; i < one_of->size(); ++i) {
          const ojson& variant = (*one_of)[i];
          out += indent + " | " + with_null(variant, json_schema_to_typescript(variant, indent + "   "));
          std::vector<std::string> comments;
          const std::string* vd = get_string(variant, "description");
          if (!(i == 0 && desc_above) && vd && !(desc && *vd == *desc)) comments.push_back(*vd);
          if (auto def = variant.find("default"); def != variant.end())
            comments.push_back(default_comment(variant, *def));
          if (!comments.empty()) out += " // " + join(comments, " ");
          out += "\n";
        }
        out += indent + ",\n";
        continue;
      }
      out +=
          indent + key + opt + ": " + with_null(val, json_schema_to_typescript(val, indent + "    ")) + ",";
      if (!has_one_of) {
        if (auto def = val.find("default"); def != val.end()) out += " // " + default_comment(val, *def);
      }
      out += "\n";
    }
  }
  out += indent + "}";
  return out;
}

}  // namespace

std::string json_schema_to_typescript(const ojson& schema, const std::string& indent) {
  if (!schema.is_object()) return "any";
  auto one_of = schema.find("oneOf");
  if (one_of != schema.end() && one_of->is_array()) {
    std::string out;
    for (const ojson& variant : *one_of) {
      out += "\n" + indent + " | " + with_null(variant, json_schema_to_typescript(variant, indent + "   "));
      std::vector<std::string> comments;
      if (const std::string* d = get_string(variant, "description")) comments.push_back(*d);
      if (auto def = variant.find("default"); def != variant.end()) {
        comments.push_back(default_comment(variant, *def, /*bare_enum_string=*/false));
      }
      if (!comments.empty()) out += " // " + join(comments, " ");
    }
    return out;
  }
  auto type = schema.find("type");
  if (type != schema.end() && type->is_array()) {
    std::vector<std::string> names;
    for (const ojson& t : *type) {
      if (t.is_string()) names.push_back(t.get<std::string>() == "integer" ? "number" : t.get<std::string>());
    }
    if (!names.empty()) return join(names, " | ");
  }
  if (type == schema.end() || !type->is_string()) return "any";
  const std::string& t = type->get_ref<const std::string&>();
  if (t == "object") return object_type(schema, indent);
  if (t == "string") {
    std::vector<std::string> values;
    if (auto e = schema.find("enum"); e != schema.end() && e->is_array()) {
      for (const ojson& v : *e) {
        if (v.is_string()) values.push_back("\"" + v.get<std::string>() + "\"");
      }
    }
    return values.empty() ? "string" : join(values, " | ");
  }
  if (t == "number" || t == "integer") return "number";
  if (t == "boolean") return "boolean";
  if (t == "array") {
    auto items = schema.find("items");
    return items != schema.end() ? json_schema_to_typescript(*items, indent) + "[]" : "Array<any>";
  }
  return "any";
}

}  // namespace nb::text
