// safetensors writer (formats.md §8): tensors are added in memory, then written as one file, or as
// shards of at most max_shard_bytes with model.safetensors.index.json. The header lists tensors in
// offset order (the order they were added), is padded with spaces so the data starts 8-byte aligned,
// and carries __metadata__ {"format": "pt"} like the files torch and transformers write.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "base/tensor.h"

namespace nb {

class SafetensorsWriter {
 public:
  // Copies the bytes; their size must equal numel(shape) * dtype bits / 8. Names must be unique.
  Status add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
             size_t bytes);
  template <class T>
  Status add(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
    return add(name, dtype, std::move(shape), v.data(), v.size() * sizeof(T));
  }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  uint64_t total_bytes() const;

  // Writes DIR/model.safetensors when everything fits in one shard, else DIR/model-0000i-of-0000n
  // .safetensors plus DIR/model.safetensors.index.json (tensors never split; shards in add() order).
  Status write_dir(const std::string& dir, uint64_t max_shard_bytes = uint64_t{4} << 30) const;
  // One file with every tensor.
  Status write_file(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  Status write_entries(const std::string& path, const std::vector<const Entry*>& entries) const;
  std::vector<Entry> entries_;
  std::map<std::string, size_t> index_;
};

}  // namespace nb
