// The decode ceiling, measured: a read-only reduction over a large device buffer (16-byte loads, one
// partial per block), as in docs/benchmarking.md §1. Benchmarks report achieved GB/s against this.
#pragma once

#include <cstddef>

namespace nb::cuda {

// Best of `reps` passes over `bytes` of device memory, in GB/s (1e9 bytes per second).
double measure_read_bandwidth(size_t bytes, int reps);

}  // namespace nb::cuda
