// safetensors checkpoints (formats.md §8): one file, or shards named by model.safetensors.index.json.
// Files are mmapped read-only; every header is validated before a byte of data is trusted:
// header size bounds, JSON shape, dtype strings, shape x dtype = bytes, offsets tiling the buffer.
// A bad file gives one error naming the file and the tensor, never a crash.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/tensor.h"

namespace nb {

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data buffer, end exclusive
};

// One mmapped .safetensors file.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  // Validates a header held in memory (the whole file image); used by open() and by the fuzz target.
  static Result<std::unique_ptr<SafetensorsFile>> parse(const std::string& display_name, const uint8_t* bytes,
                                                        uint64_t size);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by offset
  const TensorInfo* find(std::string_view name) const;
  TensorView view(const TensorInfo& t) const;  // points into the mmapped data
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;  // whole file (mmapped) or caller memory (parse)
  uint64_t map_size_ = 0;
  bool owns_map_ = false;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors, or model.safetensors.index.json and its shards, or (no
// index) every *.safetensors in it. The index's weight_map is authoritative: a mapped tensor missing
// from its shard, a shard tensor missing from the map, or a name in two files is an error.
// View data is as aligned as the file makes it: writers pad the header to 8 bytes, but the format does
// not require it, so a typed read of an odd file must not assume alignment beyond 1.
class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir);

  struct Entry {
    const TensorInfo* info;
    const SafetensorsFile* file;
    TensorView view() const { return file->view(*info); }
  };
  // nullptr-free lookup: returns false if absent.
  bool has(std::string_view name) const { return entries_.count(std::string(name)) != 0; }
  const Entry* find(std::string_view name) const;
  // Error naming the tensor if it is absent, or its dtype/shape differ from what is expected.
  Result<TensorView> get(std::string_view name, DType dtype, const std::vector<int64_t>& shape) const;
  std::vector<std::string> names() const;  // sorted
  uint64_t total_bytes() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

}  // namespace nb
