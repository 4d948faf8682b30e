// Exhaustive check of jaxkv/cuda/div_rn.cuh's SharedDivisor against div.rn.f32 over every quotient
// the per_entry-family flush forms from bf16 inputs (tests/cuda/test_cuda.py builds and runs it).
// Prints one line per domain; exits 1 if any quotient differs. An optional argument k checks
// every k-th divisor's amax only (a sanitizer-sized run: tests/cuda/test_cuda.py).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_fp8.h>

#include "div_rn.cuh"

__device__ unsigned long long g_checked, g_differ;
__device__ uint32_t g_example[3];

__device__ __forceinline__ float bf16_bits(uint32_t b) { return __uint_as_float(b << 16); }

// equal bits where |want| >= 2^-12; below that, a zero code of the same sign either way
__device__ __forceinline__ void compare(float x, float want, float got, uint32_t what) {
  const bool same = fabsf(want) >= 0x1p-12f ? __float_as_uint(want) == __float_as_uint(got)
                                            : fabsf(got) < 0x1p-11f && signbit(got) == signbit(want);
  if (!same && atomicAdd(&g_differ, 1ULL) == 0) {
    g_example[0] = what, g_example[1] = __float_as_uint(x), g_example[2] = __float_as_uint(got);
  }
}

// FP8 entry scale d = amax / 448 for every positive finite bf16 amax; every bf16 |x| <= amax
__global__ void entry_domain(uint32_t stride) {
  const float amax = bf16_bits(blockIdx.x * stride + 1);
  const float d = __fdiv_rn(amax, 448.f);
  if (!(d > 0.f)) return;
  const jaxkv::SharedDivisor div(d);
  unsigned long long n = 0;
  for (uint32_t b = threadIdx.x; b < 0x10000; b += blockDim.x) {
    const float x = bf16_bits(b);
    if (!(fabsf(x) <= amax)) continue;
    ++n;
    compare(x, __fdiv_rn(x, d), div(x), blockIdx.x * stride + 1);
  }
  atomicAdd(&g_checked, n);
}

// NVFP4 group denominator d = e4m3 * (gmax / 2688) for every positive finite bf16 gmax and
// every positive finite E4M3 byte; every bf16 x whose quotient is at most 16 in magnitude
__global__ void nvfp4_domain(uint32_t stride) {
  const float g = __fdiv_rn(bf16_bits(blockIdx.x * stride + 1), 2688.f);
  __nv_fp8_e4m3 e;
  e.__x = static_cast<__nv_fp8_storage_t>(blockIdx.y + 1);
  const float d = float(e) * g;
  if (!(d > 0.f)) return;
  const jaxkv::SharedDivisor div(d);
  unsigned long long n = 0;
  for (uint32_t b = threadIdx.x; b < 0x10000; b += blockDim.x) {
    const float x = bf16_bits(b), want = __fdiv_rn(x, d);
    if (!(fabsf(want) <= 16.f)) continue;
    ++n;
    compare(x, want, div(x), (blockIdx.x * stride + 1) | ((blockIdx.y + 1) << 16));
  }
  atomicAdd(&g_checked, n);
}

int main(int argc, char** argv) {
  const uint32_t stride = argc > 1 ? static_cast<uint32_t>(atoi(argv[1])) : 1;
  if (stride < 1) return 2;
  const uint32_t amaxes = (0x7F7F + stride - 1) / stride;  // bf16 bit patterns 1 .. 0x7F7F, every stride-th
  int bad = 0;
  for (int domain = 0; domain < 2; ++domain) {
    const unsigned long long zero = 0;
    cudaMemcpyToSymbol(g_checked, &zero, sizeof zero);
    cudaMemcpyToSymbol(g_differ, &zero, sizeof zero);
    if (domain == 0) entry_domain<<<amaxes, 256>>>(stride);
    else nvfp4_domain<<<dim3(amaxes, 0x7E), 256>>>(stride);
    const cudaError_t err = cudaDeviceSynchronize();
    unsigned long long checked = 0, differ = 0;
    uint32_t ex[3] = {0, 0, 0};
    cudaMemcpyFromSymbol(&checked, g_checked, sizeof checked);
    cudaMemcpyFromSymbol(&differ, g_differ, sizeof differ);
    cudaMemcpyFromSymbol(ex, g_example, sizeof ex);
    printf("%s: %llu quotients checked, %llu differ", domain ? "nvfp4" : "entry", checked, differ);
    if (differ) printf(" (first: divisor key %08x, x %08x, got %08x)", ex[0], ex[1], ex[2]);
    printf("%s%s\n", err != cudaSuccess ? ", CUDA error: " : "", err != cudaSuccess ? cudaGetErrorString(err) : "");
    bad |= differ != 0 || err != cudaSuccess || checked == 0;
  }
  return bad;
}
