// formats/ on the device: every E2M1 / E4M3 / E8M0 code decoded and re-encoded by a kernel must equal
// the host codec bit for bit, and MXFP4 / NVFP4 block encode+decode on random data must match the
// host. Outputs are poisoned before the launch so an unwritten element fails. Skips without a GPU.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "formats/blocks.h"

namespace nb::fmt {
namespace {

__global__ void codes_kernel(float* e2m1, float* e4m3, float* e8m0, uint8_t* e4m3_rt) {
  const int c = threadIdx.x;  // 256 threads
  if (c < 16) e2m1[c] = e2m1_to_float(static_cast<uint8_t>(c));
  e4m3[c] = e4m3_to_float(static_cast<uint8_t>(c));
  e8m0[c] = e8m0_to_float(static_cast<uint8_t>(c));
  e4m3_rt[c] = float_to_e4m3(e4m3[c]);
}

__global__ void encode_kernel(const float* x, int n, uint8_t* e2m1, uint8_t* e4m3, uint16_t* bf16) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  e2m1[i] = float_to_e2m1(x[i]);
  e4m3[i] = float_to_e4m3(x[i]);
  bf16[i] = float_to_bf16(x[i]);
}

__global__ void blocks_kernel(const float* x, int n_blocks, uint8_t* mx_packed, uint8_t* mx_scale, float* mx_out,
                              uint8_t* nv_packed, uint8_t* nv_scale, float* nv_out, float s2) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n_blocks) return;
  const float* xb = x + b * 32;
  mx_scale[b] = mxfp4_encode_block(xb, mx_packed + b * 16);
  mxfp4_decode_block(mx_packed + b * 16, mx_scale[b], mx_out + b * 32);
  for (int h = 0; h < 2; ++h) {
    const int nb = 2 * b + h;
    nv_scale[nb] = nvfp4_encode_block(xb + 16 * h, s2, nv_packed + nb * 8);
    nvfp4_decode_block(nv_packed + nb * 8, nv_scale[nb], s2, GlobalScale::kMultiply, nv_out + nb * 16);
  }
}

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    CUDA_CHECK(cudaMemset(p, 0xAB, n * sizeof(T)));  // poison
  }
  ~DeviceBuffer() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void put(const std::vector<T>& h) { CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
};

bool have_gpu() {
  auto info = cuda_device_info(0);
  if (!info.ok()) std::printf("skipping: %s\n", info.status().message().c_str());
  return info.ok();
}

TEST(FormatsCuda, AllCodesMatchHost) {
  if (!have_gpu()) GTEST_SKIP();
  DeviceBuffer<float> e2m1(16), e4m3(256), e8m0(256);
  DeviceBuffer<uint8_t> rt(256);
  codes_kernel<<<1, 256>>>(e2m1.p, e4m3.p, e8m0.p, rt.p);
  CUDA_CHECK(cudaGetLastError());
  auto h2 = e2m1.get(), h4 = e4m3.get(), h8 = e8m0.get();
  auto hrt = rt.get();
  for (int c = 0; c < 16; ++c) ASSERT_EQ(float_bits(h2[c]), float_bits(e2m1_to_float(c))) << c;
  for (int c = 0; c < 256; ++c) {
    ASSERT_EQ(float_bits(h4[c]), float_bits(e4m3_to_float(c))) << c;
    ASSERT_EQ(float_bits(h8[c]), float_bits(e8m0_to_float(c))) << c;
    ASSERT_EQ(hrt[c], float_to_e4m3(e4m3_to_float(c))) << c;
  }
}

TEST(FormatsCuda, EncodersMatchHostOnRandomValues) {
  if (!have_gpu()) GTEST_SKIP();
  const int n = 1 << 20;
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> expo(-20.0f, 12.0f);
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = ((rng() & 1) ? -1.0f : 1.0f) * std::exp2(expo(rng));
  for (int i = 0; i < 4096; ++i) x[i] = (i - 2048) / 256.0f;  // exact ties of both grids
  DeviceBuffer<float> dx(n);
  dx.put(x);
  DeviceBuffer<uint8_t> d2(n), d4(n);
  DeviceBuffer<uint16_t> db(n);
  encode_kernel<<<(n + 255) / 256, 256>>>(dx.p, n, d2.p, d4.p, db.p);
  CUDA_CHECK(cudaGetLastError());
  auto h2 = d2.get(), h4 = d4.get();
  auto hb = db.get();
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(h2[i], float_to_e2m1(x[i])) << "x = " << x[i];
    ASSERT_EQ(h4[i], float_to_e4m3(x[i])) << "x = " << x[i];
    ASSERT_EQ(hb[i], float_to_bf16(x[i])) << "x = " << x[i];
  }
}

TEST(FormatsCuda, BlockCodecsMatchHost) {
  if (!have_gpu()) GTEST_SKIP();
  const int n_blocks = 1 << 14;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 0.1f);
  std::vector<float> x(n_blocks * 32);
  for (auto& v : x) v = dist(rng);
  const float s2 = nvfp4_global_scale(1.0f);
  DeviceBuffer<float> dx(x.size()), mx_out(x.size()), nv_out(x.size());
  dx.put(x);
  DeviceBuffer<uint8_t> mx_packed(n_blocks * 16), mx_scale(n_blocks), nv_packed(n_blocks * 16), nv_scale(n_blocks * 2);
  blocks_kernel<<<(n_blocks + 127) / 128, 128>>>(dx.p, n_blocks, mx_packed.p, mx_scale.p, mx_out.p, nv_packed.p,
                                                  nv_scale.p, nv_out.p, s2);
  CUDA_CHECK(cudaGetLastError());
  auto hm = mx_out.get(), hn = nv_out.get();
  for (int b = 0; b < n_blocks; ++b) {
    uint8_t packed[16];
    float ref[32];
    mxfp4_decode_block(packed, mxfp4_encode_block(&x[b * 32], packed), ref);
    for (int i = 0; i < 32; ++i) ASSERT_EQ(float_bits(hm[b * 32 + i]), float_bits(ref[i])) << "mx block " << b;
    for (int h = 0; h < 2; ++h) {
      nvfp4_decode_block(packed, nvfp4_encode_block(&x[b * 32 + 16 * h], s2, packed), s2, GlobalScale::kMultiply, ref);
      for (int i = 0; i < 16; ++i)
        ASSERT_EQ(float_bits(hn[b * 32 + 16 * h + i]), float_bits(ref[i])) << "nv block " << b;
    }
  }
}

}  // namespace
}  // namespace nb::fmt
