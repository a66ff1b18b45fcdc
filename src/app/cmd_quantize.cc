// nibble quantize: a BF16 checkpoint directory -> MXFP4 (gpt-oss experts), NVFP4 (ModelOpt) or FP8
// (compressed-tensors) in the standard on-disk layout; the work is model/quantize.
#include <cstdio>

#include "app/model_commands.h"
#include "model/quantize.h"

namespace nb {

int cmd_quantize(const QuantizeArgs& args) {
  QuantizeOptions o;
  o.input_dir = args.model;
  o.output_dir = args.output;
  o.format = args.format == "mxfp4" ? QuantFormat::kMXFP4
             : args.format == "fp8" ? QuantFormat::kFP8
                                    : QuantFormat::kNVFP4;
  for (size_t start = 0; start < args.layers.size();) {
    const size_t comma = args.layers.find(',', start);
    const std::string item =
        args.layers.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) o.layers.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  auto r = quantize_checkpoint(o);
  if (!r.ok()) {
    std::fprintf(stderr, "nibble: error: %s\n", r.status().message().c_str());
    return 1;
  }
  const QuantizeReport& q = r.value();
  std::string classes;
  for (const std::string& c : q.classes) classes += (classes.empty() ? "" : ",") + c;
  std::printf("%s: %s\n  layers %s: %lld tensors quantized, %lld copied; %.2f MiB -> %.2f MiB\n",
              args.output.c_str(), q.layout.c_str(), classes.c_str(),
              static_cast<long long>(q.tensors_quantized), static_cast<long long>(q.tensors_copied),
              q.bytes_in / 1048576.0, q.bytes_out / 1048576.0);
  return 0;
}

}  // namespace nb
