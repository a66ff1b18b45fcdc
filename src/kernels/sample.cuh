// Token sampling on the device: one id per logits row under a SampleSpec (backend.h), so a decode step
// copies ids to the host, not [rows, vocab] logits. Same rules as runtime/sampler.cc's sample_row; the
// uniform draw u comes from the host. Greedy is one argmax pass; otherwise the top-k, top-p and min-p
// prefixes of the sorted order are found by radix selection (no sort), and u picks a token by inverse
// CDF over the kept tokens in id order (the same distribution as the host's walk in sorted order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace nb::cuda {

struct DevSampleSpec {
  float temperature = 0.0f, top_p = 1.0f;
  int32_t top_k = 0;
  float min_p = 0.0f;
  double u = 0.0;
};

// Greedy rows' argmax split over kArgmaxSplit blocks per row (one block read the 201088 logits of gpt-oss
// in ~14 us, a tenth of a 20b decode step's fixed cost); the last block to finish merges.
constexpr int kArgmaxSplit = 32;
struct ArgmaxScratch {
  float* value;     // [rows, kArgmaxSplit]
  int32_t* id;      // [rows, kArgmaxSplit]
  uint32_t* count;  // [min(rows, 65535)], zero before the launch; the merging block zeroes it again
};

// logits [rows, vocab] fp32; specs [rows] (device memory, or mapped host memory the host filled before the
// launch); ids [rows] (device); host_ids [rows] (optional, mapped host memory): the ids written there too, read
// by the host after an event recorded behind the launch (no copy in the stream). greedy / sampled: whether any
// row is greedy (temperature <= 0 or top_k == 1) / any is not (the host knows the specs; each kernel skips the
// other's rows).
void launch_sample(const float* logits, int64_t rows, int64_t vocab, const DevSampleSpec* specs, int32_t* ids,
                   int32_t* host_ids, bool greedy, bool sampled, const ArgmaxScratch& scratch, cudaStream_t s);

}  // namespace nb::cuda
