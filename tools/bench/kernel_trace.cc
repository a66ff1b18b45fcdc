// A kernel tracer to LD_PRELOAD into a benchmark where Nsight Systems is not installed (the GPU machine):
// CUPTI's concurrent-kernel activity records (graph-launched kernels included; kernels keep running
// concurrently, as under programmatic dependent launch) written at exit as CSV in the columns of
// `nsys stats --report cuda_gpu_trace`, so tools/bench/decode_timeline.py reads either.
// Build: g++ -shared -fPIC -O2 kernel_trace.cc -I$CUDA/include -L$CUDA/lib64 -lcupti -o libkernel_trace.so
// Use:   NIBBLE_TRACE_CSV=trace.csv LD_PRELOAD=./libkernel_trace.so BINARY ARGS...
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

struct Rec {
  uint64_t start, end;
  std::string name;
};
std::vector<Rec>* records = nullptr;

void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* r = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(r);
    int status = 0;
    char* d = abi::__cxa_demangle(k->name, nullptr, nullptr, &status);
    records->push_back({k->start, k->end, status == 0 && d ? d : k->name});
    std::free(d);
  }
  std::free(buffer);
}

struct Tracer {
  Tracer() {
    if (!std::getenv("NIBBLE_TRACE_CSV")) return;
    records = new std::vector<Rec>;
    records->reserve(1 << 20);
    if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
      std::fprintf(stderr, "kernel_trace: CUPTI activity tracing could not be enabled\n");
  }
  ~Tracer() {
    const char* path = std::getenv("NIBBLE_TRACE_CSV");
    if (!path || !records) return;
    cuptiActivityFlushAll(1);
    FILE* f = std::fopen(path, "w");
    if (!f) return;
    std::fprintf(f, "\"Start (ns)\",\"Duration (ns)\",\"Name\"\n");
    for (const Rec& r : *records) {
      std::string n = r.name;
      for (char& c : n)
        if (c == '"') c = '\'';
      std::fprintf(f, "%llu,%llu,\"%s\"\n", static_cast<unsigned long long>(r.start),
                   static_cast<unsigned long long>(r.end - r.start), n.c_str());
    }
    std::fclose(f);
    std::fprintf(stderr, "kernel_trace: %zu kernels -> %s\n", records->size(), path);
  }
} tracer;

}  // namespace
