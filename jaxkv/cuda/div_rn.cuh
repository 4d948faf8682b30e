// Correctly rounded float32 x / d for many x over one divisor d > 0: the reciprocal once per
// divisor, then per quotient a multiply and one fused correction.
//
// div.rn.f32 refines the reciprocal for every quotient and checks for its slow path; SharedDivisor
// does that fast path's arithmetic with the refinement hoisted out of the loop
// (docs/kernels/cache_writes.md).
//
// Its contract is narrower than div.rn's: it equals div.rn.f32 bit for bit wherever the
// quotient could reach a FP8 or FP4 code (|x / d| >= 2^-12) for every bfloat16 x, with d
// either amax / 448 (the per_entry family's FP8 entry scale, amax any positive bf16) or
// e4m3 * (gmax / 2688) (the per_entry family's NVFP4 group denominator, gmax any positive bf16).
// Smaller quotients (which both FP8 and E2M1 encode as a zero of x's sign) may differ in
// their last bits but keep the sign. tests/cuda/div_rn_check.cu checks this exhaustively over
// both domains (tests/cuda/test_cuda.py::test_shared_divisor_exhaustive). jaxkv/kernels/division.py's
// ptx_div_shared is the same instruction sequence for the Pallas kernels.

#pragma once

#include <cuda_runtime.h>

namespace jaxkv {

struct SharedDivisor {
  float k;   // 2^64 for divisors below 2^-32, else 1: x k / (d k) keeps every step normal
  float nd;  // -(d k)
  float y;   // ~1 / (d k): the approximate reciprocal with one Newton step (div.rn's own)

  __device__ __forceinline__ explicit SharedDivisor(float d) {
    k = d < 0x1p-32f ? 0x1p64f : 1.f;
    const float dk = d * k;
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(dk));
    y = __fmaf_rn(__fmaf_rn(-dk, r0, 1.f), r0, r0);
    nd = -dk;
  }

  __device__ __forceinline__ float operator()(float x) const {
    const float xk = __fmul_rn(x, k);
    const float q = __fmul_rn(xk, y);
    const float r = __fmaf_rn(nd, q, xk);          // the remainder, exact
    return copysignf(__fmaf_rn(r, y, q), x);       // x = -0: the correction's +0 would drop the sign
  }
};

}  // namespace jaxkv
