// safetensors reading: mmap, full header validation (formats.md §8) and the checkpoint directory
// (single file, sharded index, or a bare set of *.safetensors). Nothing in the data buffer is trusted
// until the header has been checked against the file size, so a bad file is an error, never a crash.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace nb {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference parser's limit (MAX_HEADER_SIZE)
// The deepest valid header value is a shape/offset element: {top} -> {entry} -> [shape] -> int.
constexpr int kMaxJsonDepth = 3;

// Quotes a name from the file for an error message, escaping control bytes so the message stays one line.
std::string quote(std::string_view s) {
  std::string out = "'";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out + "'";
}

std::string offsets_string(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// Thrown from the JSON parser callback to stop at the first structural problem; caught in parse_header.
struct HeaderReject {
  std::string message;
};

// Parses the header JSON, rejecting duplicate keys at any level (nlohmann keeps the last one silently)
// and nesting deeper than any valid header needs (bounds memory on hostile input).
Result<json> parse_header_json(std::string_view text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string tensor;                       // current top-level key, for messages
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth > kMaxJsonDepth) {
          throw HeaderReject{(tensor.empty() ? "" : "tensor " + quote(tensor) + ": ") +
                             "header JSON is nested deeper than a safetensors header can be"};
        }
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (depth == 1) tensor = key;
        if (!keys.empty() && !keys.back().insert(key).second) {
          if (depth == 1)
            throw HeaderReject{"tensor " + quote(key) + " appears more than once in the header"};
          throw HeaderReject{(tensor == "__metadata__" ? quote(tensor) : "tensor " + quote(tensor)) +
                             ": key " + quote(key) + " appears more than once"};
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const HeaderReject& e) {
    return error(e.message);
  } catch (const json::exception& e) {
    return error(std::string("header is not valid JSON: ") + e.what());
  }
}

// Reads a non-negative JSON integer that fits in int64 (all sizes and offsets are used as int64 later).
bool get_count(const json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) {
    // Non-negative integers parse as unsigned; "-0" parses as signed zero and is harmless.
    if (!v.is_number_integer() || v.get<int64_t>() != 0) return false;
    *out = 0;
    return true;
  }
  uint64_t x = v.get<uint64_t>();
  if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = x;
  return true;
}

std::string json_kind(const json& v) {
  if (v.is_number_float()) return "a float";
  if (v.is_number_integer() && !v.is_number_unsigned()) return "a negative number";
  return std::string("a JSON ") + v.type_name();
}

// Validates one header entry and fills `t` (name already set).
Status parse_entry(const json& entry, TensorInfo* t) {
  if (!entry.is_object()) return error("entry must be a JSON object, found " + json_kind(entry));
  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return error("'dtype' is missing");
  if (!dtype_it->is_string()) return error("'dtype' must be a string, found " + json_kind(*dtype_it));
  const auto& dtype_str = dtype_it->get_ref<const std::string&>();
  auto dtype = parse_dtype(dtype_str);
  if (!dtype) return error("unknown dtype " + quote(dtype_str));
  t->dtype = *dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return error("'shape' is missing");
  if (!shape_it->is_array()) return error("'shape' must be an array, found " + json_kind(*shape_it));
  // numel and bit count with checked multiplication: a hostile header can name dims near 2^63. The
  // product of the non-zero dims must fit in int64 even for an empty tensor, because TensorView::numel()
  // multiplies the dims in order in int64 ([2^62, 4, 0] would overflow before reaching the 0).
  uint64_t nonzero_product = 1;
  bool overflow = false, empty = false;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    uint64_t d = 0;
    if (!get_count((*shape_it)[i], &d)) {
      return error("shape[" + std::to_string(i) + "] must be a non-negative integer, found " +
                   ((*shape_it)[i].is_number_unsigned() ? std::string("a number over 2^63")
                                                        : json_kind((*shape_it)[i])));
    }
    t->shape.push_back(static_cast<int64_t>(d));
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(nonzero_product, d, &nonzero_product) ||
               nonzero_product > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      overflow = true;
    }
  }
  const uint64_t numel = empty ? 0 : nonzero_product;
  const int bits = dtype_bits(t->dtype);
  uint64_t total_bits = 0;
  if (overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(bits), &total_bits) ||
      total_bits > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return error(std::string(dtype_name(t->dtype)) + " " + shape_string(t->shape) +
                 " has more elements than a file can hold");
  }
  if (total_bits % 8 != 0) {
    return error(std::string(dtype_name(t->dtype)) + " " + shape_string(t->shape) + " is " +
                 std::to_string(total_bits) + " bits, not a whole number of bytes");
  }

  auto off_it = entry.find("data_offsets");
  if (off_it == entry.end()) return error("'data_offsets' is missing");
  if (!off_it->is_array() || off_it->size() != 2) {
    return error("'data_offsets' must be an array [begin, end], found " +
                 (off_it->is_array() ? "an array of " + std::to_string(off_it->size()) : json_kind(*off_it)));
  }
  if (!get_count((*off_it)[0], &t->begin) || !get_count((*off_it)[1], &t->end)) {
    return error("'data_offsets' must hold two non-negative integers");
  }
  if (t->begin > t->end)
    return error("data_offsets " + offsets_string(t->begin, t->end) + " end before they begin");
  const uint64_t need = total_bits / 8;
  if (t->end - t->begin != need) {
    return error("data_offsets " + offsets_string(t->begin, t->end) + " hold " +
                 std::to_string(t->end - t->begin) + " bytes but " + std::string(dtype_name(t->dtype)) + " " +
                 shape_string(t->shape) + " needs " + std::to_string(need));
  }
  return Status::ok_status();
}

// POSIX read-only mapping of a whole file; unmapped by SafetensorsFile's destructor.
struct Mapping {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
};

Result<Mapping> map_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return error(path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return error(path + ": not a regular file");
  }
  Mapping m;
  m.size = static_cast<uint64_t>(st.st_size);
  if (m.size < 8) {
    ::close(fd);
    return error(path + ": file is " + std::to_string(m.size) +
                 " bytes, shorter than the 8-byte header length");
  }
  void* p = ::mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (p == MAP_FAILED) return error(path + ": cannot mmap: " + std::strerror(e));
  m.data = static_cast<const uint8_t*>(p);
  return m;
}

}  // namespace

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::parse(const std::string& display_name,
                                                                const uint8_t* bytes, uint64_t size) {
  const std::string& file = display_name;
  if (bytes == nullptr && size != 0) return error(file + ": no data");
  if (size < 8) {
    return error(file + ": file is " + std::to_string(size) +
                 " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian, whatever the host
  if (n > kMaxHeaderBytes) {
    return error(file + ": header length " + std::to_string(n) + " exceeds the limit of " +
                 std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (n > size - 8) {
    return error(file + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                 std::to_string(size) + " bytes)");
  }
  if (n == 0 || bytes[8] != '{')
    return error(file + ": header is not a JSON object (it does not start with '{')");
  std::string_view text(reinterpret_cast<const char*>(bytes + 8), n);

  auto parsed = parse_header_json(text);
  if (!parsed.ok()) return parsed.status().with_context(file);
  const json& header = parsed.value();
  if (!header.is_object()) return error(file + ": header is not a JSON object");

  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = display_name;
  f->map_ = bytes;
  f->map_size_ = size;
  f->data_start_ = 8 + n;
  const uint64_t data_size = size - f->data_start_;

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // serde's Option<HashMap> accepts null
      if (!value.is_object()) return error(file + ": '__metadata__' must be an object of strings");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return error(file + ": '__metadata__' value " + quote(mk) + " must be a string, found " +
                       json_kind(mv));
        }
        f->metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    TensorInfo t;
    t.name = key;
    Status s = parse_entry(value, &t);
    if (!s.ok()) return s.with_context(file + ": tensor " + quote(key));
    f->tensors_.push_back(std::move(t));
  }

  std::sort(f->tensors_.begin(), f->tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  // The tensors must tile [0, data_size) exactly: no hole, no overlap, nothing after the last one.
  uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : f->tensors_) {
    if (t.begin != expected) {
      // Sorted by begin, so the first tensor can only leave a hole, never overlap.
      const std::string what =
          prev == nullptr ? " leave a hole at the start of the data buffer"
                          : (t.begin > expected ? " leave a hole after tensor " : " overlap tensor ") +
                                quote(prev->name) + ", which ends at " + std::to_string(expected);
      return error(file + ": tensor " + quote(t.name) + ": data_offsets " + offsets_string(t.begin, t.end) +
                   what);
    }
    if (t.end > data_size) {
      return error(file + ": tensor " + quote(t.name) + ": data_offsets " + offsets_string(t.begin, t.end) +
                   " run past the data buffer of " + std::to_string(data_size) + " bytes");
    }
    expected = t.end;
    prev = &t;
  }
  if (expected != data_size) {
    return error(file + ": tensors cover " + std::to_string(expected) + " bytes but the data buffer holds " +
                 std::to_string(data_size) +
                 (f->tensors_.empty() ? "" : " (after tensor " + quote(f->tensors_.back().name) + ")"));
  }
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->index_.emplace(f->tensors_[i].name, i);
  return f;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  NB_ASSIGN_OR_RETURN(Mapping m, map_file(path));
  auto parsed = parse(path, m.data, m.size);
  if (!parsed.ok()) {
    ::munmap(const_cast<uint8_t*>(m.data), m.size);
    return parsed.status();
  }
  std::unique_ptr<SafetensorsFile> f = std::move(parsed).value();
  f->owns_map_ = true;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (owns_map_ && map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

TensorView SafetensorsFile::view(const TensorInfo& t) const {
  NB_CHECK(t.end <= map_size_ - data_start_, "view of a tensor not from this file: " + t.name);
  TensorView v;
  v.data = map_ + data_start_ + t.begin;
  v.dtype = t.dtype;
  v.shape = t.shape;
  v.device = Device::kCpu;
  return v;
}

// ---------------------------------------------------------------------------------------------------------
// Checkpoint

namespace {

namespace fs = std::filesystem;

constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kIndexName = "model.safetensors.index.json";

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return error(path + ": read error");
  return ss.str();
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// A shard name from the index must be a plain file name inside the checkpoint directory.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return error(dir + ": not a checkpoint directory");
  Checkpoint ck;
  ck.dir_ = dir;
  const fs::path root(dir);

  // The single-file form wins when both exist, as in transformers.
  if (is_file(root / kSingleName)) {
    NB_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open((root / kSingleName).string()));
    ck.files_.push_back(std::move(f));
  } else if (is_file(root / kIndexName)) {
    const std::string index_path = (root / kIndexName).string();
    NB_ASSIGN_OR_RETURN(std::string text, read_text(index_path));
    json index = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded()) return error(index_path + ": not valid JSON");
    if (!index.is_object()) return error(index_path + ": not a JSON object");
    auto wm = index.find("weight_map");
    if (wm == index.end()) return error(index_path + ": 'weight_map' is missing");
    if (!wm->is_object()) return error(index_path + ": 'weight_map' must be an object");
    std::map<std::string, std::string> weight_map;
    std::set<std::string> shard_names;
    for (const auto& [name, shard] : wm->items()) {
      if (!shard.is_string()) {
        return error(index_path + ": tensor " + quote(name) + ": shard name must be a string, found " +
                     json_kind(shard));
      }
      const auto& s = shard.get_ref<const std::string&>();
      if (!is_plain_file_name(s)) {
        return error(index_path + ": tensor " + quote(name) + ": shard " + quote(s) +
                     " is not a file name in the checkpoint directory");
      }
      weight_map[name] = s;
      shard_names.insert(s);
    }
    if (weight_map.empty()) return error(index_path + ": 'weight_map' is empty");
    std::map<std::string, const SafetensorsFile*> shards;
    for (const std::string& s : shard_names) {
      const fs::path p = root / s;
      if (!is_file(p)) {
        // Name a tensor that needs it, so the message says why the shard matters.
        std::string example;
        for (const auto& [name, shard] : weight_map)
          if (shard == s) {
            example = name;
            break;
          }
        return error(index_path + ": shard " + quote(s) + " (holding tensor " + quote(example) +
                     ") does not exist");
      }
      NB_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(p.string()));
      shards[s] = f.get();
      ck.files_.push_back(std::move(f));
    }
    for (const auto& [name, shard] : weight_map) {
      const SafetensorsFile* f = shards.at(shard);
      const TensorInfo* info = f->find(name);
      if (info == nullptr) {
        return error(index_path + ": tensor " + quote(name) + " is mapped to " + quote(shard) +
                     ", which does not hold it");
      }
      ck.entries_.emplace(name, Entry{info, f});
    }
    // A tensor in a shard but not in the map is an error: the map is the checkpoint's table of
    // contents, and a disagreement means mixed-up shards (e.g. two revisions in one directory).
    for (const auto& f : ck.files_) {
      for (const TensorInfo& t : f->tensors()) {
        auto it = weight_map.find(t.name);
        if (it == weight_map.end()) {
          return error(f->path() + ": tensor " + quote(t.name) + " is not listed in " + kIndexName);
        }
        if (shards.at(it->second) != f.get()) {
          return error(f->path() + ": tensor " + quote(t.name) + " is also present here, but " + kIndexName +
                       " maps it to " + quote(it->second));
        }
      }
    }
    return ck;
  } else {
    // No index: every *.safetensors in the directory (vLLM accepts this layout too).
    std::vector<std::string> paths;
    for (const auto& de : fs::directory_iterator(root, ec)) {
      if (de.path().extension() == ".safetensors" && is_file(de.path())) paths.push_back(de.path().string());
    }
    if (ec) return error(dir + ": cannot list directory: " + ec.message());
    if (paths.empty()) {
      return error(dir + ": no " + kSingleName + ", " + kIndexName + " or other *.safetensors file");
    }
    std::sort(paths.begin(), paths.end());
    for (const std::string& p : paths) {
      NB_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(p));
      ck.files_.push_back(std::move(f));
    }
  }

  for (const auto& f : ck.files_) {
    for (const TensorInfo& t : f->tensors()) {
      auto [it, inserted] = ck.entries_.emplace(t.name, Entry{&t, f.get()});
      if (!inserted) {
        return error(f->path() + ": tensor " + quote(t.name) + " is also in " + it->second.file->path());
      }
    }
  }
  return ck;
}

const Checkpoint::Entry* Checkpoint::find(std::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

Result<TensorView> Checkpoint::get(std::string_view name, DType dtype,
                                   const std::vector<int64_t>& shape) const {
  const Entry* e = find(name);
  if (e == nullptr) return error(dir_ + ": tensor " + quote(name) + " is missing from the checkpoint");
  if (e->info->dtype != dtype || e->info->shape != shape) {
    return error(e->file->path() + ": tensor " + quote(name) + ": expected " +
                 std::string(dtype_name(dtype)) + " " + shape_string(shape) + ", found " +
                 std::string(dtype_name(e->info->dtype)) + " " + shape_string(e->info->shape));
  }
  return e->view();
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, e] : entries_) total += e.info->end - e.info->begin;
  return total;
}

}  // namespace nb
