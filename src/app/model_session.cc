#include "app/model_session.h"

#include <filesystem>

#include "base/log.h"
#if NIBBLE_HAVE_CUDA
#include "backend/cuda/device.h"
#endif

namespace nb {

Result<ModelSession> open_model_session(const std::string& dir, const std::string& device, int threads,
                                        bool need_tokenizer, const std::string& dense_format,
                                        const std::string& kv_cache_dtype, bool dummy_weights) {
  ModelOptions options;
  options.dummy_weights = dummy_weights;
  options.n_threads = threads;
  options.device = Device::kCpu;
  static const char* kDense[] = {"keep", "fp8", "mxfp4", "nvfp4"};
  for (int i = 0; i < 4; ++i)
    if (dense_format == kDense[i]) options.dense_format = static_cast<DenseFormat>(i);
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") options.kv_cache_dtype = DType::kF8_E4M3;
#if NIBBLE_HAVE_CUDA
  if (device == "cuda") {
    options.device = Device::kCuda;  // errors (no GPU, unsupported GPU) come from Model::load
  } else if (device == "auto") {
    Result<CudaDeviceInfo> gpu = cuda_device_info(0);
    if (gpu.ok()) {
      options.device = Device::kCuda;
      NB_LOG_INFO("device auto: using the CUDA backend on %s", describe(gpu.value()).c_str());
    } else {
      NB_LOG_INFO("device auto: no usable GPU (%s); using the CPU backend", gpu.status().message().c_str());
    }
  }
#else
  if (device == "cuda") return error("--device cuda: this build has no CUDA backend (built without nvcc)");
  if (device == "auto") NB_LOG_INFO("device auto: built without CUDA; using the CPU backend");
#endif

  if (options.device == Device::kCpu && kv_cache_dtype != "auto")
    return error("--kv-cache-dtype " + kv_cache_dtype + " needs the CUDA backend (the CPU backend keeps fp32)");
  ModelSession session;
  NB_ASSIGN_OR_RETURN(session.model, Model::load(dir, options));
  const bool has_tokenizer = std::filesystem::exists(std::filesystem::path(dir) / "tokenizer.json");
  if (has_tokenizer) {
    NB_ASSIGN_OR_RETURN(session.tokenizer, Tokenizer::load(dir));
  } else if (need_tokenizer) {
    return error(dir + ": no tokenizer.json (needed to turn text into tokens)");
  }
  return session;
}

}  // namespace nb
