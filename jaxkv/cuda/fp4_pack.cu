// FP4 packing of float rows: E2M1 nibbles and group scales, MXFP4 (one UE8M0 byte per 32
// elements) or NVFP4 (one E4M3 byte per 16 and a float32 global scale per row). Same bytes
// as jaxkv.formats.quantize_mxfp4 / quantize_nvfp4 (codes.cuh's mxfp4_lane / nvfp4_lane;
// NVFP4 divides by div.rn, as the inputs need not be bf16 values).
//
// The rows are one flat run of groups (a row's length is a multiple of the group), so thread
// i packs elements [16i, 16i + 16): one NVFP4 group per thread (its scale computed once, not
// once per lane), half an MXFP4 group, four 16-byte reads of f32 (two of bf16 / f16).
// Reached through jax.ffi (jaxkv.kernels.fp4_pack).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

enum PackInput : int32_t { kPackF32 = 0, kPackBf16 = 1, kPackF16 = 2 };

struct PackArgs {
  const void* x;       // float[N, d]: f32, bf16 or f16 (input)
  const float* g;      // f32[N] NVFP4 global scale per row (null for MXFP4)
  uint8_t* packed;     // u8[N, d / 2]
  uint8_t* scales;     // u8[N, d / 32] UE8M0 (MXFP4) or u8[N, d / 16] E4M3 (NVFP4)
  int64_t elems;       // N * d
  int64_t d;
  int32_t input;       // PackInput
};

constexpr int kPackThreads = 256;
constexpr int kPerThread = 16;  // elements

template <bool kMx>
__global__ void __launch_bounds__(kPackThreads) fp4_pack_kernel(PackArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kPackThreads + threadIdx.x;
  const int64_t i = kPerThread * t;
  const bool live = i < a.elems;  // whole groups are live or not: elems is a multiple of 16
  float v[kPerThread] = {};
  if (live) {
#pragma unroll
    for (int q = 0; q < kPerThread / 4; ++q) {
      if (a.input == kPackF32) {
        const float4 r = *reinterpret_cast<const float4*>(static_cast<const float*>(a.x) + i + 4 * q);
        v[4 * q] = r.x, v[4 * q + 1] = r.y, v[4 * q + 2] = r.z, v[4 * q + 3] = r.w;
      } else {
        const uint2 r = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.x) + i + 4 * q);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint16_t bits = static_cast<uint16_t>((k < 2 ? r.x : r.y) >> (16 * (k % 2)));
          v[4 * q + k] = a.input == kPackBf16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16)
                                              : __half2float(__ushort_as_half(bits));
        }
      }
    }
  }
  float g = 1.f;  // NVFP4: the row's global scale
  if (!kMx && live) g = a.g[i / a.d];
  uint8_t c[kPerThread];
  const uint8_t byte = kMx ? mxfp4_lane<kPerThread>(v, c) : nvfp4_lane<false, kPerThread>(v, g, c);
  if (!live) return;  // after the group shuffles, which every lane joins
  uint32_t w[2] = {0u, 0u};  // 8 packed bytes: element 2k in the low nibble of byte k
#pragma unroll
  for (int k = 0; k < kPerThread / 2; ++k) w[k / 4] |= static_cast<uint32_t>(c[2 * k] | (c[2 * k + 1] << 4)) << (8 * (k % 4));
  *reinterpret_cast<uint2*>(a.packed + (kPerThread / 2) * t) = make_uint2(w[0], w[1]);
  constexpr int kLanes = kMx ? 32 / kPerThread : 1;  // lanes per group
  if (t % kLanes == 0) a.scales[t / kLanes] = byte;
}

}  // namespace jaxkv

// Every handler only enqueues work on XLA's stream (no host sync, no allocation), so it is
// marked command-buffer compatible: XLA captures it into the CUDA graph of a jitted step.
namespace ffi = xla::ffi;

namespace jaxkv {

static ffi::Error fp4_pack(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32, 1> g,
                           ffi::Result<ffi::Buffer<ffi::U8, 2>> packed, ffi::Result<ffi::Buffer<ffi::U8, 2>> scales,
                           bool mx) {
  const auto xd = x.dimensions();
  const int group = mx ? 32 : 16;
  int32_t input;
  switch (x.element_type()) {
    case ffi::F32: input = kPackF32; break;
    case ffi::BF16: input = kPackBf16; break;
    case ffi::F16: input = kPackF16; break;
    default: return ffi::Error::InvalidArgument("x: expected float32, bfloat16 or float16");
  }
  if (xd.size() != 2 || xd[1] % group) return ffi::Error::InvalidArgument("x: expected float[N, d], d % group == 0");
  if (!mx && g.dimensions()[0] != xd[0]) return ffi::Error::InvalidArgument("global_scale: expected f32[N]");
  const auto pd = packed->dimensions(), sd = scales->dimensions();
  if (pd[0] != xd[0] || pd[1] != xd[1] / 2 || sd[0] != xd[0] || sd[1] != xd[1] / group)
    return ffi::Error::InvalidArgument("packed, scales: expected u8[N, d / 2] and u8[N, d / group]");
  const PackArgs a{x.untyped_data(), mx ? nullptr : g.typed_data(), packed->typed_data(), scales->typed_data(),
                   xd[0] * xd[1], xd[1], input};
  const int64_t threads = a.elems / kPerThread;
  if (threads == 0) return ffi::Error::Success();
  const unsigned grid = static_cast<unsigned>((threads + kPackThreads - 1) / kPackThreads);
  if (mx) {
    fp4_pack_kernel<true><<<grid, kPackThreads, 0, stream>>>(a);
  } else {
    fp4_pack_kernel<false><<<grid, kPackThreads, 0, stream>>>(a);
  }
  return launch_status(cudaGetLastError(), "fp4_pack");
}

static ffi::Error mxfp4_pack(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32, 1> g,
                             ffi::Result<ffi::Buffer<ffi::U8, 2>> packed, ffi::Result<ffi::Buffer<ffi::U8, 2>> scales) {
  return fp4_pack(stream, x, g, packed, scales, true);
}

static ffi::Error nvfp4_pack(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32, 1> g,
                             ffi::Result<ffi::Buffer<ffi::U8, 2>> packed, ffi::Result<ffi::Buffer<ffi::U8, 2>> scales) {
  return fp4_pack(stream, x, g, packed, scales, false);
}

}  // namespace jaxkv

#define JAXKV_FP4_PACK_BINDING                         \
  ffi::Ffi::Bind()                                     \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()        \
      .Arg<ffi::AnyBuffer>()           /* x */          \
      .Arg<ffi::Buffer<ffi::F32, 1>>() /* g */          \
      .Ret<ffi::Buffer<ffi::U8, 2>>()  /* packed */     \
      .Ret<ffi::Buffer<ffi::U8, 2>>()  /* scales */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvMxfp4Pack, jaxkv::mxfp4_pack, JAXKV_FP4_PACK_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvNvfp4Pack, jaxkv::nvfp4_pack, JAXKV_FP4_PACK_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
