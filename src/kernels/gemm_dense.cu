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
  // Per shape (with bias, m, rows, k, ld): the descriptors and the heuristic's algorithm, made once. The MoE
  // experts' GEMMs (one per expert and projection, every prefill step) would otherwise spend more host time
  // creating descriptors than the GPU spends multiplying. Only the bias pointer changes between calls.
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<std::tuple<bool, int64_t, int64_t, int64_t, int64_t>, Plan> plans;

  Impl() {
    lt_check(cublasLtCreate(&handle), "create");
    CUDA_CHECK(cudaMalloc(&workspace, kWorkspace));
  }
  ~Impl() {
    for (auto& [key, p] : plans) {
      cublasLtMatrixLayoutDestroy(p.la);
      cublasLtMatrixLayoutDestroy(p.lb);
      cublasLtMatrixLayoutDestroy(p.ld);
      cublasLtMatmulDescDestroy(p.op);
    }
    cudaFree(workspace);
    cublasLtDestroy(handle);
  }

  Plan& plan(bool bias, int64_t rows, int64_t k, int64_t m, int64_t ldd) {
    const auto key = std::make_tuple(bias, m, rows, k, ldd);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    Plan p;
    lt_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "transa");
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)), "transb");
    if (bias) {
      const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
      lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "epilogue");
    }
    lt_check(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, k, rows, k), "layout a");
    lt_check(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, k, m, k), "layout b");
    lt_check(cublasLtMatrixLayoutCreate(&p.ld, CUDA_R_32F, rows, m, ldd), "layout d");
    cublasLtMatmulPreference_t pref;
    lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
    lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                                  sizeof(kWorkspace)),
             "workspace");
    // Pointers are 16-byte aligned, not the 256 the heuristic assumes by default: a fused weight's later parts,
    // their slices of y, and an expert's rows of the grouped activations start inside a buffer.
    const uint32_t align = 16;
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      lt_check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)), "alignment");
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    lt_check(cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.la, p.lb, p.ld, p.ld, pref, 1, &res, &found), "heuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    NB_CHECK(found == 1, "cuBLASLt: no BF16 GEMM algorithm for [" + std::to_string(rows) + ", " + std::to_string(k) + "]");
    p.algo = res.algo;
    return plans.emplace(key, p).first->second;
  }

  // D (rows x m, ld ldd) = alpha * op(A) B + beta * D (+ bias when given; it needs beta = 0 here).
  void gemm(const void* a, int64_t rows, int64_t k, const void* b, int64_t m, float* d, int64_t ldd, const float* bias,
            float beta, cudaStream_t s) {
    Plan& p = plan(bias != nullptr, rows, k, m, ldd);
    if (bias)  // (read when cublasLtMatmul launches: a later call may point it elsewhere)
      lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), "bias");
    const float alpha = 1.0f;
    lt_check(cublasLtMatmul(handle, p.op, &alpha, a, p.la, b, p.lb, &beta, d, p.ld, d, p.ld, &p.algo, workspace,
                            kWorkspace, s),
             "matmul");
  }
};

DenseGemm::DenseGemm() : impl_(std::make_unique<Impl>()) {}
DenseGemm::~DenseGemm() = default;

void DenseGemm::split(const float* x, int64_t m, int64_t k, void* scratch, cudaStream_t s) {
  auto* hi = static_cast<__nv_bfloat16*>(scratch);
  const int64_t total = m * k;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
  launch_pdl(split_bf16_kernel, blocks, 256, 0, s, x, total, hi, hi + total);
  CUDA_CHECK(cudaGetLastError());
}

void DenseGemm::run_split(const DevWeight& w, const void* scratch, int64_t m, int64_t r0, int64_t rows,
                          const float* bias, float* y, cudaStream_t s) {
  NB_CHECK(supports(w) && rows >= 1 && r0 >= 0 && r0 + rows <= m, "dense GEMM: unsupported weight or rows");
  const int64_t k = w.k, n = w.n;
  const auto* hi = static_cast<const __nv_bfloat16*>(scratch) + r0 * k;
  const __nv_bfloat16* lo = hi + m * k;
  int64_t p0 = 0;
  for (int p = 0; p < w.n_parts; ++p) {
    const DevPart& part = w.part[p];
    float* d = y + p0;  // rows p0.. of y^T
    impl_->gemm(part.data, part.rows, k, hi, rows, d, n, bias ? bias + p0 : nullptr, 0.0f, s);
    impl_->gemm(part.data, part.rows, k, lo, rows, d, n, nullptr, 1.0f, s);
    p0 += part.rows;
  }
}

void DenseGemm::run(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, void* scratch,
                    cudaStream_t s) {
  NB_CHECK(supports(w) && m >= 1, "dense GEMM: unsupported weight");
  split(x, m, w.k, scratch, s);
  run_split(w, scratch, m, 0, m, bias, y, s);
}

}  // namespace nb::cuda
