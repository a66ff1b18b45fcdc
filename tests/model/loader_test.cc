// Loader and batch errors: a golden checkpoint copied to a temp dir and corrupted with a small
// safetensors writer (missing tensor, wrong shape, wrong dtype, bad global scale) must give an error
// naming the tensor; malformed batches must give errors, not crashes. Also what describe() reports.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "io/safetensors.h"
#include "model/model.h"
#if NIBBLE_HAVE_CUDA
#include "backend/cuda/device.h"
#endif

namespace nb {
namespace {

namespace fs = std::filesystem;

std::string golden(const std::string& name) {
  return std::string(NIBBLE_SOURCE_DIR) + "/tests/data/models/" + name;
}

struct OutTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

void write_safetensors(const std::string& path, const std::vector<OutTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const OutTensor& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = h.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(h.data(), h.size());
  for (const OutTensor& t : tensors) f.write(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
}

// Copies golden model `name` to a fresh temp dir, passing every tensor through `edit` (return nullopt
// to drop it). Returns the new dir.
using Edit = std::function<std::optional<OutTensor>(OutTensor)>;
std::string corrupted_copy(const std::string& name, const Edit& edit) {
  const fs::path dst =
      fs::temp_directory_path() / ("nibble_loader_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dst);
  fs::create_directories(dst);
  for (const auto& entry : fs::directory_iterator(golden(name))) {
    const fs::path out = dst / entry.path().filename();
    if (entry.path().extension() != ".safetensors") {
      fs::copy_file(entry.path(), out);
      continue;
    }
    auto file = SafetensorsFile::open(entry.path().string());
    NB_CHECK(file.ok(), file.status().message());
    std::vector<OutTensor> tensors;
    for (const TensorInfo& info : file.value()->tensors()) {
      const TensorView v = file.value()->view(info);
      const auto* p = static_cast<const uint8_t*>(v.data);
      std::optional<OutTensor> t = edit(OutTensor{info.name, std::string(dtype_name(info.dtype)), info.shape,
                                                  std::vector<uint8_t>(p, p + v.nbytes())});
      if (t) tensors.push_back(std::move(*t));
    }
    write_safetensors(out.string(), tensors);
  }
  return dst.string();
}

// Loads the corrupted copy and expects an error that names `tensor`.
void expect_error_naming(const std::string& model, const std::string& tensor, const Edit& edit) {
  ASSERT_TRUE(fs::exists(golden(model) + "/config.json")) << "no golden " << model;
  const std::string dir = corrupted_copy(model, edit);
  auto m = Model::load(dir, ModelOptions{Device::kCpu, 1});
  ASSERT_FALSE(m.ok()) << "corrupted " << tensor << " loaded";
  EXPECT_NE(m.status().message().find("'" + tensor + "'"), std::string::npos) << m.status().message();
  std::printf("  %s\n", m.status().message().c_str());
  fs::remove_all(dir);
}

TEST(LoaderErrors, MissingTensor) {
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  expect_error_naming("llama_bf16", name, [&](OutTensor t) -> std::optional<OutTensor> {
    if (t.name == name) return std::nullopt;
    return t;
  });
}

TEST(LoaderErrors, WrongShape) {
  const std::string name = "model.layers.0.self_attn.k_proj.weight";
  expect_error_naming("llama_bf16", name, [&](OutTensor t) -> std::optional<OutTensor> {
    if (t.name == name) std::swap(t.shape[0], t.shape[1]);  // same bytes, transposed shape
    return t;
  });
}

TEST(LoaderErrors, WrongDtypeInShardedCheckpoint) {
  const std::string name = "model.layers.1.mlp.experts.down_proj_scales";
  expect_error_naming("gpt_oss_mxfp4", name, [&](OutTensor t) -> std::optional<OutTensor> {
    if (t.name == name) t.dtype = "I8";
    return t;
  });
}

TEST(LoaderErrors, BadNvfp4GlobalScale) {
  const std::string name = "model.layers.0.mlp.up_proj.weight_global_scale";
  expect_error_naming("qwen3_nvfp4_ct", name, [&](OutTensor t) -> std::optional<OutTensor> {
    if (t.name == name) std::fill(t.bytes.begin(), t.bytes.end(), 0);  // 0.0f: would divide by zero
    return t;
  });
}

TEST(LoaderErrors, CudaDeviceNotAvailable) {
  auto m = Model::load(golden("llama_bf16"), ModelOptions{Device::kCuda, 1});
#if NIBBLE_HAVE_CUDA
  if (cuda_device_info(0).ok()) {  // a usable GPU: the CUDA backend loads (tests/cuda check its numbers)
    EXPECT_TRUE(m.ok()) << m.status().message();
    return;
  }
#endif
  ASSERT_FALSE(m.ok());  // no CUDA build, or no usable GPU: one clear error
  EXPECT_EQ(m.status().message().find('\n'), std::string::npos) << m.status().message();
}

TEST(BatchErrors, MalformedBatchesAreErrors) {
  auto m = Model::load(golden("llama_bf16"), ModelOptions{Device::kCpu, 1});
  ASSERT_TRUE(m.ok()) << m.status().message();
  Model& model = *m.value();
  auto cache = model.new_kv_cache(2);
  const std::vector<std::pair<const char*, Batch>> bad = {
      {"table too small", Batch{std::vector<int32_t>(17, 1), {{{0}, 0, 17, false}}}},
      {"block id out of range", Batch{{1, 2}, {{{2}, 0, 2, false}}}},
      {"token outside vocab", Batch{{1, model.config().vocab_size}, {{{0}, 0, 2, false}}}},
      {"sampled-token row without a sampled step", Batch{{1, -1}, {{{0}, 0, 2, false}}}},
      {"count mismatch", Batch{{1, 2, 3}, {{{0}, 0, 2, false}}}},
      {"no sequences", Batch{{1}, {}}},
      {"n_new zero", Batch{{}, {{{0}, 0, 0, false}}}},
  };
  for (const auto& [what, batch] : bad) {
    auto out = model.forward(batch, *cache);
    EXPECT_FALSE(out.ok()) << what;
    if (!out.ok()) std::printf("  %s: %s\n", what, out.status().message().c_str());
  }
  // After a queued step of one row, token -1 names it (resolved on the backend) and -2 is refused.
  ASSERT_TRUE(model.enqueue_sampled(Batch{{1, 2}, {{{0}, 0, 2, false}}}, *cache, {SampleSpec{}}).ok());
  auto next = model.enqueue_sampled(Batch{{-1}, {{{0}, 2, 1, false}}}, *cache, {SampleSpec{}});
  EXPECT_TRUE(next.ok()) << next.message();
  const std::vector<int32_t> first = model.wait_sampled();
  ASSERT_EQ(first.size(), 1u);
  model.wait_sampled();
  auto bad_row = model.forward(Batch{{-2}, {{{0}, 3, 1, false}}}, *cache);
  ASSERT_FALSE(bad_row.ok());
  EXPECT_NE(bad_row.status().message().find("names row 1 of the last sampled step's ids (rows: 1)"), std::string::npos)
      << bad_row.status().message();
  // forward_sampled refuses to run while a queued step has not been waited for (its ids would come back).
  ASSERT_TRUE(model.enqueue_sampled(Batch{{-1}, {{{0}, 3, 1, false}}}, *cache, {SampleSpec{}}).ok());
  EXPECT_FALSE(model.forward_sampled(Batch{{-1}, {{{0}, 4, 1, false}}}, *cache, {SampleSpec{}}).ok());
  model.wait_sampled();
}

TEST(Describe, NamesFormatsAndTotals) {
  for (const auto& [model, expect] : std::vector<std::pair<std::string, std::string>>{
           {"gpt_oss_mxfp4", "model.layers.*.mlp.experts.gate_up_proj"},
           {"qwen3_nvfp4_ct", "nvfp4 (compressed-tensors)"},
           {"qwen3_moe_nvfp4_modelopt", "nvfp4 (modelopt)"},
           {"llama_bf16", "dense BF16"}}) {
    auto m = Model::load(golden(model), ModelOptions{Device::kCpu, 1});
    ASSERT_TRUE(m.ok()) << m.status().message();
    const std::string d = m.value()->describe();
    EXPECT_NE(d.find(expect), std::string::npos) << d;
    EXPECT_NE(d.find("total:"), std::string::npos) << d;
    if (model == "gpt_oss_mxfp4") std::printf("%s", d.c_str());
  }
}

}  // namespace
}  // namespace nb
