// The lightning indexer's query as DeepSeek-V4 scores it, in one launch: Hadamard-rotated
// (x @ H_d / sqrt(d)), rounded to bf16, then through the cache's FP4 key format and back
// (official: MXFP4; per_entry: NVFP4 with the row's own global scale). Same values as
// jaxkv.hybrid.index_query(impl="xla"): the butterflies are jaxkv.math.hadamard's, in its
// order (so the same float32 sums), and the encoders are codes.cuh's.
//
// 16 elements a lane, d / 16 lanes a row (d in 32 .. 512, a power of two): the butterflies of
// strides 1 .. 8 run in registers, the longer ones across lanes by shuffles. Reached through
// jax.ffi (jaxkv.kernels.index_query).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

constexpr int kQueryThreads = 256;
constexpr int kQueryPerLane = 16;

template <bool kMx>
__global__ void __launch_bounds__(kQueryThreads)
    index_query_kernel(const uint16_t* __restrict__ x, uint16_t* __restrict__ y, int64_t rows, int d, float inv_sqrt) {
  const int lanes = d / kQueryPerLane;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kQueryThreads + threadIdx.x;
  const int64_t row = t / lanes;
  const int lane = static_cast<int>(t % lanes);
  const bool live = row < rows;  // a dead lane still joins the shuffles, with zeros
  float v[kQueryPerLane] = {};
  if (live) {
    const uint4* src = reinterpret_cast<const uint4*>(x + kQueryPerLane * t);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint4 r = src[q];
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) v[8 * q + k] = __uint_as_float((w[k / 2] >> (16 * (k % 2))) << 16);
    }
  }
  // butterflies: element i of each block of 2h pairs with i + h; low = a + b, high = a - b
#pragma unroll
  for (int h = 1; h < kQueryPerLane; h <<= 1) {
#pragma unroll
    for (int i = 0; i < kQueryPerLane; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
  for (int o = 1; o < lanes; o <<= 1) {  // stride 16 * o: the partner is lane ^ o, same register
    const bool high = lane & o;
#pragma unroll
    for (int i = 0; i < kQueryPerLane; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], o);
      v[i] = high ? __fsub_rn(other, v[i]) : __fadd_rn(v[i], other);
    }
  }
#pragma unroll
  for (int i = 0; i < kQueryPerLane; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(v[i], inv_sqrt)));
  uint8_t c[kQueryPerLane];
  float scale;
  if (kMx) {
    scale = e8m0_value(mxfp4_lane<kQueryPerLane>(v, c));
  } else {  // the row's own global scale
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kQueryPerLane; ++i) amax = nanmax(amax, fabsf(v[i]));
    for (int o = 1; o < lanes; o <<= 1) amax = nanmax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float g = nvfp4_global_scale(amax);
    scale = __fmul_rn(fp8_e4m3_value(nvfp4_lane<false, kQueryPerLane>(v, g, c)), g);
  }
  if (!live) return;
  uint32_t w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(e2m1_value(c[2 * k]), scale)));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(e2m1_value(c[2 * k + 1]), scale)));
    w[k] = lo | (hi << 16);
  }
  uint4* dst = reinterpret_cast<uint4*>(y + kQueryPerLane * t);
  dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
  dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

namespace ffi = xla::ffi;

// Only enqueues work on XLA's stream (no host sync, no allocation), so it is marked
// command-buffer compatible: XLA captures it into the CUDA graph of a jitted step.
// x comes in as its whole (flattened) stack; y's rows are read from x_offset on.
static ffi::Error index_query(cudaStream_t stream, ffi::Buffer<ffi::BF16, 1> x, ffi::ResultBuffer<ffi::BF16, 2> y,
                              int32_t storage, float inv_sqrt, int64_t x_offset) {
  const auto yd = y->dimensions();
  const int64_t rows = yd[0], d = yd[1];
  if (d < 32 || d > 512 || (d & (d - 1)))
    return ffi::Error::InvalidArgument("y: expected bf16[rows, d] with d a power of two in 32 .. 512");
  if (storage != kOfficial && storage != kPerEntry) return ffi::Error::InvalidArgument("storage: unknown family");
  if (x_offset < 0 || x_offset + rows * d > x.dimensions()[0])
    return ffi::Error::InvalidArgument("x: expected bf16[rows, d] at x_offset");
  if (rows == 0) return ffi::Error::Success();
  const int64_t threads = rows * (d / kQueryPerLane);
  const unsigned grid = static_cast<unsigned>((threads + kQueryThreads - 1) / kQueryThreads);
  const auto* src = reinterpret_cast<const uint16_t*>(x.untyped_data()) + x_offset;
  auto* dst = reinterpret_cast<uint16_t*>(y->untyped_data());
  if (storage == kOfficial)
    index_query_kernel<true><<<grid, kQueryThreads, 0, stream>>>(src, dst, rows, static_cast<int>(d), inv_sqrt);
  else
    index_query_kernel<false><<<grid, kQueryThreads, 0, stream>>>(src, dst, rows, static_cast<int>(d), inv_sqrt);
  return launch_status(cudaGetLastError(), "index_query");
}

}  // namespace jaxkv

namespace jaxkv::index_query_types {  // buffer types without commas, so they can sit inside the macro
using Flat = xla::ffi::Buffer<xla::ffi::BF16, 1>;
using Rows = xla::ffi::Buffer<xla::ffi::BF16, 2>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::index_query_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvIndexQuery, jaxkv::index_query,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::index_query_types::Stream>()
                                  .Arg<jaxkv::index_query_types::Flat>()  // the stack of x, flattened
                                  .Ret<jaxkv::index_query_types::Rows>()  // bf16[rows, d]
                                  .Attr<int32_t>("storage")
                                  .Attr<float>("inv_sqrt")
                                  .Attr<int64_t>("x_offset"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
