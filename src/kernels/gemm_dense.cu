// cuBLASLt BF16 prefill GEMM with split activations (see gemm_dense.cuh).
// Column-major view of the row-major tensors: y^T [n, m] = W [k x n col-major, op T] * x^T [k x m]; each
// weight part (fused QKV has three) is its own GEMM writing rows [r0, r0 + rows) of y^T (ld n).
#include "kernels/gemm_dense.cuh"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <map>
#include <string>
#include <tuple>

#include "backend/cuda/cuda_check.h"

namespace nb::cuda {
namespace {

void lt_check(cublasStatus_t st, const char* what) {
  NB_CHECK(st == CUBLAS_STATUS_SUCCESS, std::string("cuBLASLt ") + what + " failed (status " + std::to_string(st) + ")");
}

// x [m, k] fp32 -> hi = bf16(x), lo = bf16(x - hi), both [m, k].
__global__ void split_bf16_kernel(const float* __restrict__ x, int64_t n, __nv_bfloat16* __restrict__ hi,
                                  __nv_bfloat16* __restrict__ lo) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    hi[i] = h;
    lo[i] = __float2bfloat16_rn(v - __bfloat162float(h));
  }
}

}  // namespace

struct DenseGemm::Impl {
  static constexpr size_t kWorkspace = size_t{32} << 20;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  // The heuristic's algorithm per (with bias, m, rows, k): asked once per shape.
  std::map<std::tuple<bool, int64_t, int64_t, int64_t>, cublasLtMatmulAlgo_t> algos;

  Impl() {
    lt_check(cublasLtCreate(&handle), "create");
    CUDA_CHECK(cudaMalloc(&workspace, kWorkspace));
  }
  ~Impl() {
    cudaFree(workspace);
    cublasLtDestroy(handle);
  }

  // D (rows x m, ld ldd) = alpha * op(A) B + beta * D (+ bias when given; it needs beta = 0 here).
  void gemm(const void* a, int64_t rows, int64_t k, const void* b, int64_t m, float* d, int64_t ldd, const float* bias,
            float beta, cudaStream_t s) {
    cublasLtMatmulDesc_t op;
    lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "transa");
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)), "transb");
    if (bias) {
      const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
      lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "epilogue");
      lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), "bias");
    }
    cublasLtMatrixLayout_t la, lb, ld;
    lt_check(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, rows, k), "layout a");
    lt_check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k), "layout b");
    lt_check(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, rows, m, ldd), "layout d");
    const auto key = std::make_tuple(bias != nullptr, m, rows, k);
    auto it = algos.find(key);
    if (it == algos.end()) {
      cublasLtMatmulPreference_t pref;
      lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
      lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                                    sizeof(kWorkspace)),
               "workspace");
      cublasLtMatmulHeuristicResult_t res;
      int found = 0;
      lt_check(cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, ld, ld, pref, 1, &res, &found), "heuristic");
      cublasLtMatmulPreferenceDestroy(pref);
      NB_CHECK(found == 1, "cuBLASLt: no BF16 GEMM algorithm for [" + std::to_string(rows) + ", " + std::to_string(k) + "]");
      it = algos.emplace(key, res.algo).first;
    }
    const float alpha = 1.0f;
    lt_check(cublasLtMatmul(handle, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &it->second, workspace, kWorkspace, s),
             "matmul");
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
  }
};

DenseGemm::DenseGemm() : impl_(std::make_unique<Impl>()) {}
DenseGemm::~DenseGemm() = default;

void DenseGemm::run(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, void* scratch,
                    cudaStream_t s) {
  NB_CHECK(supports(w) && m >= 1, "dense GEMM: unsupported weight");
  const int64_t k = w.k, n = w.n;
  auto* hi = static_cast<__nv_bfloat16*>(scratch);
  __nv_bfloat16* lo = hi + m * k;
  const int64_t total = m * k;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
  launch_pdl(split_bf16_kernel, blocks, 256, 0, s, x, total, hi, lo);
  CUDA_CHECK(cudaGetLastError());
  int64_t r0 = 0;
  for (int p = 0; p < w.n_parts; ++p) {
    const DevPart& part = w.part[p];
    float* d = y + r0;  // rows r0.. of y^T
    impl_->gemm(part.data, part.rows, k, hi, m, d, n, bias ? bias + r0 : nullptr, 0.0f, s);
    impl_->gemm(part.data, part.rows, k, lo, m, d, n, nullptr, 1.0f, s);
    r0 += part.rows;
  }
}

}  // namespace nb::cuda
