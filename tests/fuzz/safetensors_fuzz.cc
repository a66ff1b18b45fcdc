// libFuzzer target for the safetensors header parser: any byte string must give either an error or a
// file whose every tensor view lies inside the input. Built with -DNIBBLE_FUZZ=ON (scripts/fuzz.sh);
// ASan/UBSan turn an out-of-bounds read or overflow into a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Copy so the buffer ends exactly at `size`: ASan then flags any read past the end.
  std::vector<uint8_t> buf(data, data + size);
  auto f = nb::SafetensorsFile::parse("fuzz.safetensors", buf.data(), buf.size());
  if (!f.ok()) {
    if (f.status().message().empty() || std::strchr(f.status().message().c_str(), '\n') != nullptr)
      std::abort();
    return 0;
  }
  const uint8_t* end = buf.data() + buf.size();
  uint64_t sum = 0;
  for (const nb::TensorInfo& t : f.value()->tensors()) {
    nb::TensorView v = f.value()->view(t);
    const auto* p = static_cast<const uint8_t*>(v.data);
    const uint64_t n = t.end - t.begin;
    if (static_cast<uint64_t>(v.nbytes()) != n || p + n > end) std::abort();  // size math must agree
    for (uint64_t i = 0; i < n; ++i) sum += p[i];
    if (f.value()->find(t.name) != &t) std::abort();
  }
  for (const auto& [k, val] : f.value()->metadata()) sum += k.size() + val.size();
  volatile uint64_t sink = sum;
  (void)sink;
  return 0;
}
