// Tests for io/safetensors: files written here byte by byte (good, sharded, scalar and zero-size
// tensors, and every corrupt header we know of). Each bad file must give ok() == false and one message
// naming the file and, where there is one, the tensor.
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

namespace nb {
namespace {

namespace fs = std::filesystem;

// A tensor to write: raw header fields, so tests can also write wrong ones.
struct Spec {
  std::string name;
  std::string dtype;
  std::string shape;  // JSON text, e.g. "[2, 3]"
  uint64_t nbytes;    // bytes this tensor occupies in the data buffer
};

// Header JSON for tensors laid out contiguously from offset 0, in the given order.
std::string header_for(const std::vector<Spec>& specs, const std::string& extra = "") {
  std::string h = "{";
  uint64_t off = 0;
  for (const Spec& s : specs) {
    if (h.size() > 1) h += ",";
    h += "\"" + s.name + "\":{\"dtype\":\"" + s.dtype + "\",\"shape\":" + s.shape + ",\"data_offsets\":[" +
         std::to_string(off) + "," + std::to_string(off + s.nbytes) + "]}";
    off += s.nbytes;
  }
  if (!extra.empty()) h += (h.size() > 1 ? "," : "") + extra;
  return h + "}";
}

uint64_t data_size(const std::vector<Spec>& specs) {
  uint64_t n = 0;
  for (const Spec& s : specs) n += s.nbytes;
  return n;
}

// The file image: 8-byte little-endian N, the header padded with spaces to 8-byte alignment, the data.
std::string image(std::string header, const std::string& data, bool pad = true) {
  if (pad)
    while ((8 + header.size()) % 8 != 0) header += ' ';
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string pattern_bytes(uint64_t n) {
  std::string d(n, '\0');
  for (uint64_t i = 0; i < n; ++i) d[i] = static_cast<char>(i * 7 + 1);
  return d;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / ("nibble_st_" + std::to_string(::getpid())) / info->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& bytes) {
    fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p.string();
  }
  std::string write_specs(const std::string& name, const std::vector<Spec>& specs,
                          const std::string& extra = "") {
    return write(name, image(header_for(specs, extra), pattern_bytes(data_size(specs))));
  }

  // Opens a file that must be rejected; checks the message names the file and (if given) the tensor.
  std::string expect_bad(const std::string& bytes, const std::string& tensor, const std::string& fragment) {
    const std::string path = write("bad.safetensors", bytes);
    auto f = SafetensorsFile::open(path);
    EXPECT_FALSE(f.ok());
    if (f.ok()) return "";
    const std::string& msg = f.status().message();
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    if (!tensor.empty()) {
      EXPECT_NE(msg.find("'" + tensor + "'"), std::string::npos) << msg;
    }
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    // The in-memory parser must agree.
    auto p = SafetensorsFile::parse("bad.safetensors", reinterpret_cast<const uint8_t*>(bytes.data()),
                                    bytes.size());
    EXPECT_FALSE(p.ok());
    return msg;
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, GoodSingleFile) {
  std::vector<Spec> specs = {
      {"model.embed_tokens.weight", "BF16", "[4, 3]", 24},
      {"model.layers.0.mlp.experts.down_proj_blocks", "U8", "[2, 3, 1, 16]", 96},
      {"model.layers.0.mlp.experts.down_proj_scales", "U8", "[2, 3, 1]", 6},
      {"model.norm.weight", "F32", "[3]", 12},
      {"x.weight_scale", "F8_E4M3", "[2, 2]", 4},
  };
  const std::string path =
      write_specs("model.safetensors", specs, R"("__metadata__":{"format":"pt","producer":"test"})");
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f.value()->path(), path);
  ASSERT_EQ(f.value()->tensors().size(), 5u);
  uint64_t prev = 0;
  for (const TensorInfo& t : f.value()->tensors()) {
    EXPECT_EQ(t.begin, prev);
    prev = t.end;
  }
  EXPECT_EQ(f.value()->metadata().at("format"), "pt");
  EXPECT_EQ(f.value()->metadata().at("producer"), "test");

  const TensorInfo* t = f.value()->find("model.layers.0.mlp.experts.down_proj_scales");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kU8);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(t->begin, 24u + 96u);
  TensorView v = f.value()->view(*t);
  EXPECT_EQ(v.nbytes(), 6);
  const std::string expect = pattern_bytes(data_size(specs)).substr(t->begin, 6);
  EXPECT_EQ(std::memcmp(v.data, expect.data(), 6), 0);
  EXPECT_EQ(f.value()->find("missing"), nullptr);
}

TEST_F(SafetensorsTest, ScalarsZeroSizeAndSubByte) {
  std::vector<Spec> specs = {
      {"empty_a", "F32", "[0, 3]", 0},
      {"scalar", "F32", "[]", 4},
      {"empty_b", "BF16", "[3, 0]", 0},
      {"empty_c", "U8", "[0]", 0},
      {"fp4", "F4", "[2, 3]", 3},
      {"f6", "F6_E2M3", "[4]", 3},
      {"huge_but_empty", "F64", "[4611686018427387904, 0]", 0},
  };
  auto f = SafetensorsFile::open(write_specs("model.safetensors", specs));
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f.value()->tensors().size(), 7u);
  const TensorInfo* s = f.value()->find("scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(f.value()->view(*s).numel(), 1);
  EXPECT_EQ(f.value()->find("empty_b")->end - f.value()->find("empty_b")->begin, 0u);
}

TEST_F(SafetensorsTest, EmptyHeaderAndUnpaddedHeader) {
  auto a = SafetensorsFile::open(write("a.safetensors", image("{}", "")));
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_TRUE(a.value()->tensors().empty());
  std::vector<Spec> specs = {{"w", "I16", "[3]", 6}};
  auto b = SafetensorsFile::open(write("b.safetensors", image(header_for(specs), pattern_bytes(6), false)));
  ASSERT_TRUE(b.ok()) << b.status().message();
  auto c =
      SafetensorsFile::open(write("c.safetensors", image(header_for(specs) + "        ", pattern_bytes(6))));
  ASSERT_TRUE(c.ok()) << c.status().message();
}

TEST_F(SafetensorsTest, ParseInMemory) {
  const std::string bytes = image(header_for({{"w", "F16", "[2]", 4}}), pattern_bytes(4));
  auto f = SafetensorsFile::parse("mem", reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f.value()->view(*f.value()->find("w")).data, bytes.data() + bytes.size() - 4);
}

TEST_F(SafetensorsTest, TruncatedFile) {
  expect_bad("", "", "shorter than the 8-byte header length");
  expect_bad(std::string("\x10\0\0\0\0", 5), "", "shorter than the 8-byte header length");
}

TEST_F(SafetensorsTest, TruncatedHeader) {
  std::string full = image(header_for({{"w", "F32", "[2]", 8}}), pattern_bytes(8));
  expect_bad(full.substr(0, 30), "", "runs past the end of the file");
}

TEST_F(SafetensorsTest, HeaderLengthHuge) {
  std::string bytes(8, '\0');
  bytes[5] = 1;  // 2^40
  expect_bad(bytes + "{}", "", "exceeds the limit of 100000000 bytes");
  uint64_t n = 100'000'001;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  expect_bad(bytes + "{}", "", "exceeds the limit");
  std::string all_ones(8, '\xff');
  expect_bad(all_ones + "{}", "", "exceeds the limit");
}

TEST_F(SafetensorsTest, NotJson) {
  expect_bad(image("{\"w\": {\"dtype\": ", ""), "", "not valid JSON");
  expect_bad(image("{\"w\": 1} trailing", ""), "", "not valid JSON");
  expect_bad(image("", "abc"), "", "not a JSON object");
}

TEST_F(SafetensorsTest, JsonNotAnObject) {
  expect_bad(image("[1, 2, 3]", ""), "", "not a JSON object");
  expect_bad(image("\"str\"", ""), "", "not a JSON object");
  expect_bad(image("{\"w\": 5}", ""), "w", "entry must be a JSON object");
}

TEST_F(SafetensorsTest, UnknownDtype) {
  expect_bad(image(header_for({{"w", "Q4_K", "[2]", 2}}), pattern_bytes(2)), "w", "unknown dtype 'Q4_K'");
  expect_bad(image(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", "x"), "w",
             "'dtype' must be a string");
}

TEST_F(SafetensorsTest, BadShape) {
  expect_bad(image(header_for({{"w", "U8", "[2, -1]", 2}}), pattern_bytes(2)), "w", "shape[1] must be");
  expect_bad(image(header_for({{"w", "U8", "[2.5]", 2}}), pattern_bytes(2)), "w", "a float");
  expect_bad(image(header_for({{"w", "U8", "[\"2\"]", 2}}), pattern_bytes(2)), "w", "shape[0] must be");
  expect_bad(image(header_for({{"w", "U8", "2", 2}}), pattern_bytes(2)), "w", "'shape' must be an array");
  expect_bad(image(header_for({{"w", "U8", "[18446744073709551615]", 2}}), pattern_bytes(2)), "w",
             "shape[0]");
  // numel overflows uint64: checked multiplication must catch it, not wrap to a small size.
  expect_bad(image(header_for({{"w", "F32", "[4294967296, 4294967296, 4]", 0}}), ""), "w", "more elements");
  expect_bad(image(header_for({{"w", "F32", "[4611686018427387904, 2]", 0}}), ""), "w", "more elements");
  // Empty, but TensorView::numel() would overflow int64 multiplying the dims before the 0.
  expect_bad(image(header_for({{"w", "U8", "[4611686018427387904, 4, 0]", 0}}), ""), "w", "more elements");
  expect_bad(image(R"({"w":{"dtype":"U8","data_offsets":[0,0]}})", ""), "w", "'shape' is missing");
}

TEST_F(SafetensorsTest, SubByteNotWholeBytes) {
  expect_bad(image(header_for({{"w", "F4", "[3]", 1}}), pattern_bytes(1)), "w",
             "not a whole number of bytes");
}

TEST_F(SafetensorsTest, OffsetsPastTheEnd) {
  // The header is self-consistent, but the file holds 4 bytes of data instead of 8.
  expect_bad(image(header_for({{"w", "F32", "[2]", 8}}), pattern_bytes(4)), "w", "run past the data buffer");
  expect_bad(
      image(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[18446744073709551612,18446744073709551616]}})",
            "abcd"),
      "w", "'data_offsets' must hold two non-negative integers");
}

TEST_F(SafetensorsTest, BadOffsetsArray) {
  expect_bad(image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "a"), "w", "[begin, end]");
  expect_bad(image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "a"), "w", "[begin, end]");
  expect_bad(image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", "a"), "w",
             "end before they begin");
  expect_bad(image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "a"), "w", "non-negative");
  expect_bad(image(R"({"w":{"dtype":"U8","shape":[1]}})", "a"), "w", "'data_offsets' is missing");
}

TEST_F(SafetensorsTest, Hole) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  expect_bad(image(h, pattern_bytes(12)), "b", "leave a hole after tensor 'a', which ends at 4");
  // A hole at the start.
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", pattern_bytes(8)), "a",
             "leave a hole at the start of the data buffer");
  // Bytes after the last tensor.
  expect_bad(image(header_for({{"a", "F32", "[1]", 4}}), pattern_bytes(6)), "a", "cover 4 bytes but");
}

TEST_F(SafetensorsTest, Overlap) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})";
  expect_bad(image(h, pattern_bytes(6)), "b", "[2, 6] overlap tensor 'a', which ends at 4");
  const std::string same = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_bad(image(same, pattern_bytes(4)), "b", "overlap tensor 'a'");
}

TEST_F(SafetensorsTest, ShapeDtypeMismatch) {
  const std::string h =
      R"({"model.layers.0.mlp.experts.down_proj_blocks":{"dtype":"U8","shape":[2,3],"data_offsets":[0,100]}})";
  std::string msg = expect_bad(image(h, pattern_bytes(100)), "model.layers.0.mlp.experts.down_proj_blocks",
                               "data_offsets [0, 100] hold 100 bytes but U8 [2, 3] needs 6");
  EXPECT_NE(msg.find("bad.safetensors: tensor 'model.layers.0.mlp.experts.down_proj_blocks': data_offsets"),
            std::string::npos)
      << msg;
}

TEST_F(SafetensorsTest, DuplicateKey) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_bad(image(h, pattern_bytes(8)), "a", "more than once");
  const std::string inner = R"({"a":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,4]}})";
  expect_bad(image(inner, pattern_bytes(4)), "a", "'dtype' appears more than once");
  const std::string meta = R"({"__metadata__":{"k":"1","k":"2"}})";
  expect_bad(image(meta, ""), "__metadata__", "'__metadata__': key 'k' appears more than once");
}

TEST_F(SafetensorsTest, BadMetadata) {
  expect_bad(image(R"({"__metadata__":{"format":1}})", ""), "",
             "'__metadata__' value 'format' must be a string");
  expect_bad(image(R"({"__metadata__":["a"]})", ""), "", "'__metadata__' must be an object");
  expect_bad(image(R"({"__metadata__":{"a":{"b":"c"}}})", ""), "", "'__metadata__'");
}

TEST_F(SafetensorsTest, ControlCharactersInNamesAreEscaped) {
  std::string msg = expect_bad(image(header_for({{"a\\nb", "Q", "[1]", 1}}), "x"), "", "unknown dtype");
  EXPECT_NE(msg.find("'a\\x0ab'"), std::string::npos) << msg;
}

TEST_F(SafetensorsTest, DeepNesting) {
  std::string deep = "{\"w\":" + std::string(5000, '[') + std::string(5000, ']') + "}";
  expect_bad(image(deep, ""), "w", "nested deeper");
}

// Random corruption of a valid image must never crash or read out of bounds (ASan builds check the
// latter); the libFuzzer target (tests/fuzz) explores this much further.
TEST_F(SafetensorsTest, RandomCorruptionNeverCrashes) {
  const std::string good =
      image(header_for({{"a", "BF16", "[2, 3]", 12}, {"s", "F32", "[]", 4}, {"z", "U8", "[0]", 0}},
                       R"("__metadata__":{"format":"pt"})"),
            pattern_bytes(16));
  std::mt19937 rng(1234);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string b = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 4) {
        case 0:
          b[rng() % b.size()] = static_cast<char>(rng());
          break;
        case 1:
          b.resize(rng() % (b.size() + 1));
          break;
        case 2:
          b.insert(rng() % (b.size() + 1), 1, "{}[]\",:0123456789-.e"[rng() % 20]);
          break;
        case 3:
          if (!b.empty()) b.erase(rng() % b.size(), 1);
          break;
      }
      if (b.empty()) break;
    }
    // Copy into an exactly sized heap buffer so ASan sees any read past the end.
    std::vector<uint8_t> buf(b.begin(), b.end());
    auto f = SafetensorsFile::parse("fuzz", buf.data(), buf.size());
    if (!f.ok()) {
      EXPECT_FALSE(f.status().message().empty());
      continue;
    }
    ++accepted;
    uint64_t sum = 0;
    for (const TensorInfo& t : f.value()->tensors()) {
      TensorView v = f.value()->view(t);
      const auto* p = static_cast<const uint8_t*>(v.data);
      for (uint64_t i = 0; i < t.end - t.begin; ++i) sum += p[i];
    }
    (void)sum;
  }
  EXPECT_GT(accepted, 0);  // some edits (e.g. inside the data buffer) keep the file valid
}

// --- Checkpoint --------------------------------------------------------------------------------------------

class CheckpointTest : public SafetensorsTest {
 protected:
  // gpt-oss style: shards numbered from 00000.
  void write_sharded(const std::string& index_json) {
    write_specs("model-00000-of-00002.safetensors", {{"model.embed_tokens.weight", "BF16", "[4, 2]", 16},
                                                     {"model.norm.weight", "BF16", "[2]", 4}});
    write_specs("model-00001-of-00002.safetensors", {{"lm_head.weight", "BF16", "[4, 2]", 16},
                                                     {"model.layers.0.self_attn.sinks", "F32", "[]", 4}});
    write("model.safetensors.index.json", index_json);
  }
  static std::string good_index() {
    return R"({"metadata":{"total_size":40},"weight_map":{
      "model.embed_tokens.weight":"model-00000-of-00002.safetensors",
      "model.norm.weight":"model-00000-of-00002.safetensors",
      "lm_head.weight":"model-00001-of-00002.safetensors",
      "model.layers.0.self_attn.sinks":"model-00001-of-00002.safetensors"}})";
  }
  std::string expect_bad_dir(const std::vector<std::string>& fragments) {
    auto ck = Checkpoint::open(dir_.string());
    EXPECT_FALSE(ck.ok());
    if (ck.ok()) return "";
    const std::string& msg = ck.status().message();
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  }
};

TEST_F(CheckpointTest, SingleFile) {
  write_specs("model.safetensors", {{"a", "F32", "[2]", 8}, {"b", "U8", "[3]", 3}});
  auto ck = Checkpoint::open(dir_.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck.value().names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(ck.value().total_bytes(), 11u);
  EXPECT_TRUE(ck.value().has("a"));
  EXPECT_FALSE(ck.value().has("c"));
  auto v = ck.value().get("b", DType::kU8, {3});
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v.value().nbytes(), 3);
}

TEST_F(CheckpointTest, ShardedWithIndex) {
  write_sharded(good_index());
  auto ck = Checkpoint::open(dir_.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck.value().names().size(), 4u);
  EXPECT_EQ(ck.value().total_bytes(), 40u);
  const Checkpoint::Entry* e = ck.value().find("lm_head.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_NE(e->file->path().find("model-00001-of-00002.safetensors"), std::string::npos);
  auto sinks = ck.value().get("model.layers.0.self_attn.sinks", DType::kF32, {});
  ASSERT_TRUE(sinks.ok()) << sinks.status().message();
  EXPECT_EQ(sinks.value().rank(), 0);
}

TEST_F(CheckpointTest, GetErrors) {
  write_sharded(good_index());
  auto ck = Checkpoint::open(dir_.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  auto absent = ck.value().get("model.layers.1.self_attn.sinks", DType::kF32, {});
  ASSERT_FALSE(absent.ok());
  EXPECT_NE(absent.status().message().find("'model.layers.1.self_attn.sinks' is missing"), std::string::npos)
      << absent.status().message();
  auto dtype = ck.value().get("lm_head.weight", DType::kF32, {4, 2});
  ASSERT_FALSE(dtype.ok());
  EXPECT_NE(dtype.status().message().find("'lm_head.weight': expected F32 [4, 2], found BF16 [4, 2]"),
            std::string::npos)
      << dtype.status().message();
  EXPECT_NE(dtype.status().message().find("model-00001-of-00002.safetensors"), std::string::npos);
  auto shape = ck.value().get("model.norm.weight", DType::kBF16, {3});
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("expected BF16 [3], found BF16 [2]"), std::string::npos)
      << shape.status().message();
}

TEST_F(CheckpointTest, IndexNamesMissingShard) {
  write_sharded(R"({"weight_map":{"model.embed_tokens.weight":"model-00000-of-00002.safetensors",
      "model.norm.weight":"model-00000-of-00002.safetensors",
      "lm_head.weight":"model-00002-of-00002.safetensors"}})");
  expect_bad_dir({"model.safetensors.index.json", "'model-00002-of-00002.safetensors'", "'lm_head.weight'",
                  "does not exist"});
}

TEST_F(CheckpointTest, IndexNamesTensorAbsentFromShard) {
  write_sharded(R"({"weight_map":{"model.embed_tokens.weight":"model-00000-of-00002.safetensors",
      "model.norm.weight":"model-00000-of-00002.safetensors",
      "lm_head.weight":"model-00000-of-00002.safetensors",
      "model.layers.0.self_attn.sinks":"model-00001-of-00002.safetensors"}})");
  expect_bad_dir({"model.safetensors.index.json", "'lm_head.weight'", "'model-00000-of-00002.safetensors'",
                  "does not hold it"});
}

TEST_F(CheckpointTest, ShardTensorNotInIndex) {
  write_sharded(R"({"weight_map":{"model.embed_tokens.weight":"model-00000-of-00002.safetensors",
      "model.norm.weight":"model-00000-of-00002.safetensors",
      "lm_head.weight":"model-00001-of-00002.safetensors"}})");
  expect_bad_dir({"model-00001-of-00002.safetensors", "'model.layers.0.self_attn.sinks'", "not listed"});
}

TEST_F(CheckpointTest, CorruptShard) {
  write_sharded(good_index());
  write(
      "model-00001-of-00002.safetensors",
      image(R"({"lm_head.weight":{"dtype":"BF16","shape":[4,2],"data_offsets":[0,15]}})", pattern_bytes(15)));
  expect_bad_dir({"model-00001-of-00002.safetensors", "'lm_head.weight'", "needs 16"});
}

TEST_F(CheckpointTest, BadIndexFile) {
  write_sharded("{\"weight_map\": ");
  expect_bad_dir({"model.safetensors.index.json", "not valid JSON"});
  write("model.safetensors.index.json", "[]");
  expect_bad_dir({"model.safetensors.index.json", "not a JSON object"});
  write("model.safetensors.index.json", R"({"metadata":{}})");
  expect_bad_dir({"model.safetensors.index.json", "'weight_map' is missing"});
  write("model.safetensors.index.json", R"({"weight_map":[]})");
  expect_bad_dir({"'weight_map' must be an object"});
  write("model.safetensors.index.json", R"({"weight_map":{"lm_head.weight":3}})");
  expect_bad_dir({"'lm_head.weight'", "shard name must be a string"});
  write("model.safetensors.index.json", R"({"weight_map":{"lm_head.weight":"../x.safetensors"}})");
  expect_bad_dir({"'lm_head.weight'", "not a file name in the checkpoint directory"});
  write("model.safetensors.index.json", R"({"weight_map":{}})");
  expect_bad_dir({"'weight_map' is empty"});
}

TEST_F(CheckpointTest, SingleFileWinsOverIndex) {
  write_sharded("not json at all");
  write_specs("model.safetensors", {{"a", "F32", "[2]", 8}});
  auto ck = Checkpoint::open(dir_.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck.value().names(), (std::vector<std::string>{"a"}));
}

TEST_F(CheckpointTest, SeveralFilesWithoutIndex) {
  write_specs("part-a.safetensors", {{"a", "F32", "[2]", 8}});
  write_specs("part-b.safetensors", {{"b", "F32", "[1]", 4}});
  write("README.md", "not a tensor file");
  auto ck = Checkpoint::open(dir_.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck.value().names(), (std::vector<std::string>{"a", "b"}));
  write_specs("part-c.safetensors", {{"a", "F32", "[2]", 8}});
  expect_bad_dir({"part-c.safetensors", "'a'", "also in", "part-a.safetensors"});
}

TEST_F(CheckpointTest, EmptyOrMissingDirectory) {
  expect_bad_dir({dir_.string(), "no model.safetensors"});
  auto missing = Checkpoint::open((dir_ / "nope").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  auto file = SafetensorsFile::open((dir_ / "nope.safetensors").string());
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find("nope.safetensors: cannot open"), std::string::npos);
  auto d = SafetensorsFile::open(dir_.string());
  ASSERT_FALSE(d.ok());
}

// The tiny checkpoints written by tools/reference (real safetensors from the Python library, sharded
// like gpt-oss) must open, and every byte of every tensor must be readable.
TEST(CommittedCheckpoints, OpenAndReadEveryTensor) {
  const fs::path models = fs::path(NIBBLE_SOURCE_DIR) / "tests" / "data" / "models";
  int opened = 0;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(models, ec)) {
    if (!de.is_directory() || !fs::exists(de.path() / "config.json")) continue;
    auto ck = Checkpoint::open(de.path().string());
    ASSERT_TRUE(ck.ok()) << ck.status().message();
    EXPECT_FALSE(ck.value().names().empty()) << de.path();
    uint64_t bytes = 0;
    for (const std::string& name : ck.value().names()) {
      const Checkpoint::Entry* e = ck.value().find(name);
      ASSERT_NE(e, nullptr);
      TensorView v = e->view();
      const auto* p = static_cast<const uint8_t*>(v.data);
      uint64_t sum = 0;
      for (int64_t i = 0; i < v.nbytes(); ++i) sum += p[i];
      (void)sum;
      bytes += static_cast<uint64_t>(v.nbytes());
    }
    EXPECT_EQ(bytes, ck.value().total_bytes());
    ++opened;
  }
  if (opened == 0) GTEST_SKIP() << "no checkpoints under " << models;
}

}  // namespace
}  // namespace nb
