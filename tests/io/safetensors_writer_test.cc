// Tests for io/safetensors_writer: what it writes reads back through the validating reader (one file
// and shards with an index), the header is 8-byte aligned and in offset order, and bad input to the
// writer is an error, not a file.
#include "io/safetensors_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/safetensors.h"

namespace nb {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const char* tag) {
  fs::path d = fs::temp_directory_path() / ("nb_writer_" + std::string(tag) + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(SafetensorsWriter, RoundTripOneFile) {
  const fs::path dir = temp_dir("one");
  SafetensorsWriter w;
  const auto a = random_bytes(3 * 5 * 2, 1), b = random_bytes(7, 2), c = random_bytes(4, 3);
  ASSERT_TRUE(w.add("z.first", DType::kBF16, {3, 5}, a.data(), a.size()).ok());
  ASSERT_TRUE(w.add("a.second", DType::kU8, {7}, b.data(), b.size()).ok());
  ASSERT_TRUE(w.add("scalar", DType::kF32, {}, c.data(), c.size()).ok());
  ASSERT_TRUE(w.add("empty", DType::kF32, {0, 4}, nullptr, 0).ok());
  ASSERT_TRUE(w.write_dir(dir.string()).ok());
  ASSERT_TRUE(fs::exists(dir / "model.safetensors"));
  ASSERT_FALSE(fs::exists(dir / "model.safetensors.index.json"));

  // Header length is a multiple of 8 and the JSON is padded with spaces.
  std::ifstream in(dir / "model.safetensors", std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  EXPECT_EQ(header.front(), '{');
  EXPECT_LT(header.find("z.first"), header.find("a.second"));  // offset order, not name order

  auto ck = Checkpoint::open(dir.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  auto va = ck.value().get("z.first", DType::kBF16, {3, 5});
  ASSERT_TRUE(va.ok());
  EXPECT_EQ(std::memcmp(va.value().data, a.data(), a.size()), 0);
  auto vb = ck.value().get("a.second", DType::kU8, {7});
  ASSERT_TRUE(vb.ok());
  EXPECT_EQ(std::memcmp(vb.value().data, b.data(), b.size()), 0);
  auto vc = ck.value().get("scalar", DType::kF32, {});
  ASSERT_TRUE(vc.ok());
  EXPECT_EQ(std::memcmp(vc.value().data, c.data(), c.size()), 0);
  EXPECT_TRUE(ck.value().get("empty", DType::kF32, {0, 4}).ok());
  fs::remove_all(dir);
}

TEST(SafetensorsWriter, RoundTripShardsWithIndex) {
  const fs::path dir = temp_dir("shards");
  SafetensorsWriter w;
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < 5; ++i) {
    data.push_back(random_bytes(100, 10 + i));
    ASSERT_TRUE(w.add("t" + std::to_string(i), DType::kU8, {100}, data.back()).ok());
  }
  ASSERT_TRUE(w.write_dir(dir.string(), /*max_shard_bytes=*/250).ok());  // 2 + 2 + 1 tensors
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir / "model-00001-of-00003.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "model-00003-of-00003.safetensors"));
  auto ck = Checkpoint::open(dir.string());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck.value().total_bytes(), 500u);
  for (int i = 0; i < 5; ++i) {
    auto v = ck.value().get("t" + std::to_string(i), DType::kU8, {100});
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(std::memcmp(v.value().data, data[i].data(), 100), 0) << i;
  }
  fs::remove_all(dir);
}

TEST(SafetensorsWriter, BadInputIsAnError) {
  SafetensorsWriter w;
  const auto a = random_bytes(8, 4);
  EXPECT_FALSE(w.add("x", DType::kF32, {3}, a.data(), a.size()).ok());  // 12 bytes expected
  ASSERT_TRUE(w.add("x", DType::kF32, {2}, a.data(), a.size()).ok());
  const Status dup = w.add("x", DType::kF32, {2}, a.data(), a.size());
  EXPECT_FALSE(dup.ok());
  EXPECT_NE(dup.message().find("'x'"), std::string::npos);
  EXPECT_FALSE(w.add("__metadata__", DType::kU8, {1}, a.data(), 1).ok());
  EXPECT_FALSE(w.add("neg", DType::kU8, {-1}, a.data(), 0).ok());
  EXPECT_FALSE(w.write_file("/nonexistent-dir/x/model.safetensors").ok());
}

}  // namespace
}  // namespace nb
