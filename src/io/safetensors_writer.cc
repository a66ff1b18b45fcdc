// safetensors writer; see safetensors_writer.h.
#include "io/safetensors_writer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace nb {

Status SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                              const void* data, size_t bytes) {
  if (name.empty() || name == "__metadata__")
    return error("safetensors writer: bad tensor name '" + name + "'");
  if (index_.count(name)) return error("safetensors writer: tensor '" + name + "' added twice");
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return error("safetensors writer: tensor '" + name + "' has a negative dimension");
    numel *= d;
  }
  const uint64_t bits = static_cast<uint64_t>(numel) * dtype_bits(dtype);
  if (bits % 8 != 0 || bits / 8 != bytes)
    return error("safetensors writer: tensor '" + name + "' " + std::string(dtype_name(dtype)) + " " +
                 shape_string(shape) + " needs " + std::to_string(bits / 8) + " bytes, got " +
                 std::to_string(bytes));
  Entry e{name, dtype, std::move(shape), {}};
  const auto* p = static_cast<const uint8_t*>(data);
  e.bytes.assign(p, p + bytes);
  index_[name] = entries_.size();
  entries_.push_back(std::move(e));
  return Status();
}

uint64_t SafetensorsWriter::total_bytes() const {
  uint64_t n = 0;
  for (const Entry& e : entries_) n += e.bytes.size();
  return n;
}

Status SafetensorsWriter::write_entries(const std::string& path,
                                        const std::vector<const Entry*>& entries) const {
  // nlohmann::ordered_json keeps insertion order: tensors appear sorted by offset.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const Entry* e : entries) {
    header[e->name] = {{"dtype", std::string(dtype_name(e->dtype))},
                       {"shape", e->shape},
                       {"data_offsets", {offset, offset + e->bytes.size()}}};
    offset += e->bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // data starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return error(path + ": cannot open for writing");
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const Entry* e : entries)
    out.write(reinterpret_cast<const char*>(e->bytes.data()), static_cast<std::streamsize>(e->bytes.size()));
  out.close();
  if (!out) return error(path + ": write failed");
  return Status();
}

Status SafetensorsWriter::write_file(const std::string& path) const {
  std::vector<const Entry*> all;
  for (const Entry& e : entries_) all.push_back(&e);
  return write_entries(path, all);
}

Status SafetensorsWriter::write_dir(const std::string& dir, uint64_t max_shard_bytes) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return error(dir + ": cannot create directory (" + ec.message() + ")");
  std::vector<std::vector<const Entry*>> shards(1);
  uint64_t in_shard = 0;
  for (const Entry& e : entries_) {
    if (!shards.back().empty() && in_shard + e.bytes.size() > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&e);
    in_shard += e.bytes.size();
  }
  const std::filesystem::path base(dir);
  if (shards.size() == 1) return write_entries((base / "model.safetensors").string(), shards[0]);
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total_bytes()}};
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    NB_RETURN_IF_ERROR(write_entries((base / name).string(), shards[i]));
    for (const Entry* e : shards[i]) map[e->name] = name;
  }
  index["weight_map"] = map;
  std::ofstream out(base / "model.safetensors.index.json", std::ios::trunc);
  out << index.dump(2) << "\n";
  if (!out) return error(dir + ": cannot write model.safetensors.index.json");
  return Status();
}

}  // namespace nb
