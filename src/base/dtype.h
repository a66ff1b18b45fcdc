// Element types as safetensors names them, with their sizes in bits.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace nb {

enum class DType : uint8_t {
  kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64, kC64,
  kF8_E4M3, kF8_E5M2, kF8_E4M3FNUZ, kF8_E5M2FNUZ, kF8_E8M0, kF4, kF6_E2M3, kF6_E3M2,
};

struct DTypeInfo {
  DType dtype;
  std::string_view name;  // the safetensors string
  int bits;
};

inline constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 8},        {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},            {DType::kI16, "I16", 16},
    {DType::kU16, "U16", 16},         {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},       {DType::kI32, "I32", 32},
    {DType::kU32, "U32", 32},         {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},         {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},         {DType::kC64, "C64", 64},
    {DType::kF8_E4M3, "F8_E4M3", 8},  {DType::kF8_E5M2, "F8_E5M2", 8},
    {DType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8}, {DType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {DType::kF8_E8M0, "F8_E8M0", 8},  {DType::kF4, "F4", 4},
    {DType::kF6_E2M3, "F6_E2M3", 6},  {DType::kF6_E3M2, "F6_E3M2", 6},
};

constexpr const DTypeInfo& dtype_info(DType t) { return kDTypes[static_cast<int>(t)]; }
constexpr int dtype_bits(DType t) { return dtype_info(t).bits; }
constexpr std::string_view dtype_name(DType t) { return dtype_info(t).name; }

inline std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& info : kDTypes)
    if (info.name == name) return info.dtype;
  return std::nullopt;
}

}  // namespace nb
