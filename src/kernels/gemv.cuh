// Decode GEMV / small-M GEMM for every weight format (BF16/F16/F32, FP8 per-channel, MXFP4, NVFP4),
// plus the MoE expert projections that pick their weight per (token, choice) on the device.
// Weights stream once with 16-byte loads and are decoded in registers in software; activations are fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/common.cuh"
#include "kernels/prefetch.cuh"
#include "kernels/qkv_rope.cuh"

namespace nb::cuda {

// y[t, :] = x[t, :] @ w^T (+ bias) for t < m. x [m, k] fp32, y [m, n] fp32, bias [n] or null.
// fp16_acts: the one-token FP4 kernels round activations to one fp16 instead of hi + lo
// (CudaBackendOptions::gemm_fp16_activations; the other kernels keep their precision).
// staged (optional, one token, fp16_acts): x as the one-token attention kernel also wrote it (StagedRow); the
// one-token FP4 kernel then copies it instead of staging x (other paths read x).
struct StagedRow;
void launch_linear(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y, bool fp16_acts,
                   cudaStream_t s, const StagedRow* staged = nullptr);

// The tensor-core FP4 paths (gemv_fp4.cu): MXFP4/NVFP4, 16-byte aligned rows, linear at 1 <= m <= 8 and
// the MoE projections. Each returns false (nothing launched) for anything else, and the callers below fall
// back to the CUDA-core kernels then. NIBBLE_FP4_MMA=0 turns them off (benchmark knob).
bool launch_linear_fp4_mma(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                           cudaStream_t s);

// The row-streaming FP4 paths for one token (gemv_fp4_stream.cu): linear at m = 1 and the MoE projections
// of a single token; k % 32 == 0, k <= 4096, 16-byte aligned rows. Tried first; false (nothing launched)
// otherwise. NIBBLE_FP4_STREAM=0 turns them off (benchmark knob; the tests' second run).
bool launch_linear_fp4_stream(const DevWeight& w, const float* x, int64_t m, const float* bias, float* y,
                              bool fp16_acts, cudaStream_t s, const StagedRow* staged = nullptr);
// One row of k activations staged by its producer (the one-token attention kernel: AttnShape::stage_planes)
// in the one-token FP4 kernels' layout (stage.cuh: one fp16, hi planes), each group of 32 elements g at its
// own power-of-two prescale 2^shifts[g] (n_chunks(k) * 32 groups; padding groups 127). The linear kernel
// copies the planes after its wait, brings every group to the row's smallest prescale (exact: a power of
// two; only values below fp16's normal range round again) and unscales its outputs by that.
struct StagedRow {
  const void* planes = nullptr;
  const int8_t* shifts = nullptr;
};
// The SM count those kernels size their grids for: the device's, or fewer under NIBBLE_STREAM_SMS=n (tests).
int stream_grid_sms();

// An attention block's head at one token in one launch (gemv_fp4_stream.cu): h = rms_norm(x + y) * norm_w
// (y null: rms_norm(x); else block 0 writes x + y to x_out, another buffer), qkv = w h + bias, then as
// launch_qkv_rope_kv_write without q/k norms: RoPE on q and k, k and v into the cache slot of the token's
// position, q [n_heads, head_dim] to q_out. w: FP4 on the row-streaming path, [(nh + 2 nkv) hd, d];
// one fp16 per activation only (CudaBackendOptions::gemm_fp16_activations).
struct QkvHeadArgs {
  const float* x = nullptr;  // [d]
  const float* y = nullptr;  // [d] or null
  const float* norm_w = nullptr;
  float eps = 1e-5f;
  float* x_out = nullptr;
  const float* bias = nullptr;  // [(nh + 2 nkv) hd] or null
  QkvRopeShape s;
  DevBatch b;  // one token
  KvKind kv = KvKind::kBF16;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  float* q_out = nullptr;
};
bool qkv_head_stream_supports(const DevWeight& w, const QkvRopeShape& s, bool fp16_acts);
void launch_qkv_head_stream(const DevWeight& w, const QkvHeadArgs& a, cudaStream_t s);

enum class Glu : uint8_t { kSiluInterleaved, kSiluHalves, kGptOssInterleaved, kGptOssHalves };

// The one-token FP4 kernels' factor per output of a part's rows: they fold NVFP4's ue4m3 scale into the
// decoded weights times 2^-7 (gemv_fp4_stream.cu, Fmt<kNVFP4>), so 2^7 and the global scale come back here;
// 1 for MXFP4. Host (ExpertTable::rows) and device.
inline constexpr float kNvfp4FoldPost = 128.0f;
__host__ __device__ inline float fp4_post(WKind kind, const DevPart& p) {
  return kind == WKind::kNVFP4 ? kNvfp4FoldPost * (p.divide ? 1.0f / p.global : p.global) : 1.0f;
}

// Where the rows of one expert's projection lie for the one-token kernels (kernels/gemv_fp4_stream.cu): row
// r (FC1: output r's gate row, or its up row) at codes + r * code_step and scales + r * scale_step, its bias
// at bias[r * step] (or none), and its per-output factor (NVFP4: 2^7 times the global scale). Built on the
// host once per MoE layer (ExpertTable::rows) when the rows of each lie in one checkpoint part.
struct RowMap {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* bias;          // or null
  int code_step, scale_step;  // bytes
  int step;                   // rows
  float post;
};

// All experts of one MoE layer share a kind; `table` is [n_experts] DevWeights in device memory.
struct ExpertTable {
  const DevWeight* fc1 = nullptr;  // [n_experts] of [2 d_expert, d_model]
  const DevWeight* fc2 = nullptr;  // [n_experts] of [d_model, d_expert]
  WKind kind = WKind::kMXFP4;
  int n_experts = 0, d_expert = 0, d_model = 0;
  const float* fc1_bias = nullptr;  // [n_experts, 2 d_expert] or null
  const float* fc2_bias = nullptr;  // [n_experts, d_model] or null
  bool vec_ok = false;  // every expert's rows are 16-byte aligned: the tensor-core paths (decode, grouped GEMM)
  // FC1's gate rows and its up rows each lie in one checkpoint part (one fused tensor, or gate and up as
  // two parts of d_expert rows), FC2 is one part: the one-token kernels address rows with one stride.
  bool simple_rows = false;
  // With simple_rows, per expert e: rows[3 e] its FC1 gate rows, rows[3 e + 1] its up rows, rows[3 e + 2]
  // its FC2 rows (device memory): a routed expert's addressing is one load away from its id.
  const RowMap* rows = nullptr;
};

// FC2's input staged by the one-token FP4 FC1 kernel (launch_moe_fc1 / launch_moe_fc1_logits given one):
// besides act it writes each value as the FC2 kernel stages act in shared memory -- one fp16, times
// 2^shift, in the plane layout -- so that FC2 copies them (cp.async) after its wait instead of taking act's
// maxima, converting and storing them there (~2 us of cold code on the step's critical path, NOTES.md). Only
// where the GLU bounds act, so that one fixed shift keeps every value in fp16: gpt-oss's clamped SwiGLU,
// |act| <= limit (limit + 1). A power-of-two shift changes no product's bits (only values below fp16's
// normal range round differently from the per-row prescale).
struct StagedActs {
  void* planes = nullptr;      // staged_acts_bytes(rows, d_expert) of device memory, zeroed once (no launch
                               // writes the padding past d_expert)
  int rows = 0, d_expert = 0;  // what planes has room for
  const float* act = nullptr;  // set by each FC1 launch given this: the act it staged alongside, or null
  int shift = 0;
};
size_t staged_acts_bytes(int rows, int d_expert);

// act[p, j] = glu(fc1_e(x[p / top_k]))[j] for every pair p = t * top_k + i with e = ids[p]: one launch
// for all selected experts, SwiGLU (plain or gpt-oss clamped) fused in the epilogue. staged (optional): see
// StagedActs.
void launch_moe_fc1(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x,
                    Glu glu, float limit, float* act, bool fp16_acts, cudaStream_t s, StagedActs* staged = nullptr);
// y[t] = sum_i weights[t, i] * (fc2_e(act[t * top_k + i]) + bias_e): all choices in one launch, summed
// in choice order inside one warp (deterministic). ids and weights must be complete by the time the
// previous kernel on the stream lets it launch (as right after launch_moe_fc1 with the same routes: the
// FC1 kernels trigger only after their wait; or after launch_moe_fc1_logits, whose block 0 writes and
// fences them before its trigger): the one-token kernel reads them, and its first weights, before waiting
// for that kernel. prefetch (optional): L2 prefetch hints for weights read after this op; the one-token
// kernel issues them itself (right after its first weight loads: no launch of its own) and clears them,
// other paths leave them to the caller. staged (optional): the one-token kernel copies its planes where the
// last FC1 launch given it staged this act.
void launch_moe_fc2(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                    const float* act, float* y, bool fp16_acts, cudaStream_t s, PrefetchRanges* prefetch = nullptr,
                    const StagedActs* staged = nullptr);

bool launch_moe_fc1_fp4(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x,
                        Glu glu, float limit, float* act, cudaStream_t s);
bool launch_moe_fc2_fp4(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens, int top_k,
                        const float* act, float* y, cudaStream_t s);
// Deferred routes (norm_route's deferred mode, launch_norm_route): the router logits [n_experts] of the one
// token, whose top-k each block of the one-token FP4 FC1 kernel forms itself in shared memory (route_warp,
// route.cuh) instead of reading ids and weights; its block 0 writes the ids and weights out for FC2.
struct RouteLogits {
  const float* logits = nullptr;
  int n_experts = 0;
  bool softmax_first = false, renormalize = false;
};
inline constexpr int kRouteLogitsMaxExperts = 256;
// Whether the one-token kernels take these experts, and routes as logits (n_experts <= 256).
bool moe_fp4_stream_supports(const ExpertTable& t, int top_k, int n_experts);
// As launch_moe_fc1 for one token, the routes as logits: also writes ids [top_k] and weights [top_k], which
// launch_moe_fc2 right after it may take (they are complete before FC1 lets it launch).
// staged_x (optional, fp16_acts): x as launch_norm_route's staged_h wrote it.
// prefetch (optional): L2 prefetch hints for weights read after this op, issued by the kernel before its
// wait and cleared (as launch_moe_fc2's).
void launch_moe_fc1_logits(const ExpertTable& t, const RouteLogits& r, int top_k, int32_t* ids, float* weights,
                           const float* x, Glu glu, float limit, float* act, bool fp16_acts, cudaStream_t s,
                           StagedActs* staged = nullptr, const void* staged_x = nullptr,
                           PrefetchRanges* prefetch = nullptr);

bool launch_moe_fc1_fp4_stream(const ExpertTable& t, const int32_t* ids, int64_t n_pairs, int top_k, const float* x,
                               Glu glu, float limit, float* act, bool fp16_acts, cudaStream_t s,
                               StagedActs* staged = nullptr);
bool launch_moe_fc2_fp4_stream(const ExpertTable& t, const int32_t* ids, const float* weights, int64_t n_tokens,
                               int top_k, const float* act, float* y, bool fp16_acts, cudaStream_t s,
                               PrefetchRanges* prefetch = nullptr, const StagedActs* staged = nullptr);

// Measurement builds only (-DNIBBLE_STREAM_STAMPS=1 on gemv_fp4_stream.cu, e.g. scripts/gpu-ab.sh
// NIBBLE_AB_VARIANTS): the one-token stream kernels record, per block, %globaltimer at entry, after their
// wait for the previous kernel, once its x maxima are taken (thread 0's warp), once x is staged, once thread 0's
// first weights have arrived (a wait only this build has), and when the block's last warp leaves its walk, the newest
// launch of each kernel kind overwriting the last (linear: only weights of fewer than 65536 rows, so the
// lm_head does not overwrite the last layer's O); the MoE kernels also when their routes are mapped, and
// every kind when the block's first warp has finished its first unit. stream_stamps clears them (clear) or
// copies them out as [kStampKinds][kStampBlocks][kStampPoints] nanoseconds (0: none); false in other builds.
inline constexpr int kStampKinds = 4, kStampBlocks = 160, kStampPoints = 8;  // linear, qkv head, fc1, fc2
bool stream_stamps(bool clear, std::vector<uint64_t>* out);

}  // namespace nb::cuda
