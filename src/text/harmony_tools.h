// JSON-schema function tools -> the TypeScript-like namespace that harmony puts in the developer
// message, following openai/harmony's renderer (checked by goldens from the openai_harmony package).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace nb::text {

// `schema` keeps the key order of the request, as harmony's renderer does.
std::string json_schema_to_typescript(const nlohmann::ordered_json& schema, const std::string& indent);

}  // namespace nb::text
