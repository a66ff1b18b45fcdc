// NB_HD marks functions usable on host and device; formats/ codecs are written once for both.
#pragma once

#if defined(__CUDACC__)
#define NB_HD __host__ __device__ __forceinline__
#else
#define NB_HD inline
#endif
