// TensorView: a non-owning view of a tensor's bytes with its shape and dtype, row-major.
// Shapes sit beside pointers everywhere in nibble; launchers check them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace nb {

enum class Device : uint8_t { kCpu, kCuda };

struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  Device device = Device::kCpu;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t nbytes() const { return numel() * dtype_bits(dtype) / 8; }
  int rank() const { return static_cast<int>(shape.size()); }
  template <class T>
  const T* as() const { return static_cast<const T*>(data); }
};

inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace nb
