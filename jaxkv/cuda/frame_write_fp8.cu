// An FP8 frame cache's write: one frame's bf16 K/V for L layers quantized as they are written,
// codes and scales, from one launch (jaxkv.kernels.write_frame_fp8; docs/kernels/frame_cache_fp8.md).
// XLA does it as a quantize fusion and eight dynamic-update-slices a layer.
//
//   a warp   one (token row, head) of one layer's K or V: head_dim 64, two elements a lane.
//            Its amax (NaN kept), scale = amax / 448 correctly rounded, then rounded up to a
//            bfloat16 (NaN for a non-finite row, 0 for an all-zero one), codes
//            e4m3(x / scale) with the division correctly rounded (0 where the scale is not
//            positive): the bytes of jaxkv.formats.quantize_fp8_rows.
//   rows     a stream's specials go to special_row + t, its patches to patch_row + t, and the
//            page's padding rows (page_size > patches) get zero codes and scales. The rows
//            come clipped into the buffer (frame_append.clip_rows); a non-finite frame's rows
//            are the trash rows, chosen by the caller.
//   grid     x: warps over the (row, head) pairs of a stream's page + specials, y: layer x
//            {K, V}, z: stream.
//
// Reached through jax.ffi; the 4L buffers are aliased in place.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"  // fp8_e4m3, nanmax, group_amax
#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

namespace ffi = xla::ffi;
using Rows = ffi::Buffer<ffi::S32, 1>;  // i32[B]

constexpr int kFp8WriteWarps = 8;  // warps a block
constexpr int kFp8MaxLayers = 32;  // per launch (the kernel's parameter space); more: several launches
constexpr int kFp8HeadDim = 64;

struct Fp8Buffers {
  uint8_t* codes[2][kFp8MaxLayers];            // [K, V][layer]: u8[B, T, H, 64]
  __nv_bfloat16* scales[2][kFp8MaxLayers];     // bf16[B, T, H]
};

__global__ void __launch_bounds__(kFp8WriteWarps * 32)
    frame_write_fp8_kernel(const Fp8Buffers bufs, const __nv_bfloat16* __restrict__ k,
                           const __nv_bfloat16* __restrict__ v, const int32_t* __restrict__ special_row,
                           const int32_t* __restrict__ patch_row, int32_t first_layer, int32_t streams,
                           int32_t tpf, int32_t num_special, int32_t page_size, int32_t heads, int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kFp8WriteWarps + (threadIdx.x >> 5);
  const int l = blockIdx.y >> 1, kv = blockIdx.y & 1, b = blockIdx.z;
  if (pair >= static_cast<int64_t>(num_special + page_size) * heads) return;
  const int t = static_cast<int>(pair / heads), h = static_cast<int>(pair % heads);
  const int patches = tpf - num_special;
  const int64_t dst = t < num_special ? special_row[b] + t : patch_row[b] + (t - num_special);
  if (dst < 0 || dst >= rows) return;
  float x0 = 0.f, x1 = 0.f;  // a padding row (t - num_special >= patches) is zeros
  if (t < num_special + patches) {
    const __nv_bfloat16* src = (kv ? v : k) + ((((static_cast<int64_t>(first_layer + l) * streams + b) * tpf + t) *
                                                   heads + h) * kFp8HeadDim + 2 * lane);
    const __nv_bfloat162 pair2 = *reinterpret_cast<const __nv_bfloat162*>(src);
    x0 = __bfloat162float(pair2.x);
    x1 = __bfloat162float(pair2.y);
  }
  const float amax = group_amax<32>(nanmax(fabsf(x0), fabsf(x1)));
  float scale;
  if (isfinite(amax)) {
    const uint32_t bits = __float_as_uint(__fdiv_rn(amax, 448.f));
    scale = __uint_as_float((bits + 0xFFFFu) & 0xFFFF0000u);  // rounded up to a bfloat16
  } else {
    scale = __uint_as_float(0x7FC00000u);
  }
  uint16_t codes = 0;
  if (scale > 0.f) codes = fp8_e4m3(__fdiv_rn(x0, scale)) | (fp8_e4m3(__fdiv_rn(x1, scale)) << 8);
  const int64_t row = (static_cast<int64_t>(b) * rows + dst) * heads + h;
  reinterpret_cast<uint16_t*>(bufs.codes[kv][l] + row * kFp8HeadDim)[lane] = codes;
  if (lane == 0) {
    const uint16_t s16 = isnan(scale) ? 0x7FC0u : static_cast<uint16_t>(__float_as_uint(scale) >> 16);  // exact
    reinterpret_cast<uint16_t*>(bufs.scales[kv][l])[row] = s16;
  }
}

// args: k, v bf16[L, B, tpf, H, 64], special_row, patch_row i32[B], then the 4L buffers:
// K codes x L, V codes x L, K scales x L, V scales x L; rets: those buffers, aliased.
static ffi::Error frame_write_fp8(cudaStream_t stream, int32_t num_special, int32_t page_size, ffi::AnyBuffer k,
                                  ffi::AnyBuffer v, Rows special_row, Rows patch_row, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets) {
  const auto dims = k.dimensions();
  if (dims.size() != 5 || dims[4] != kFp8HeadDim || k.element_type() != ffi::BF16 || v.element_type() != ffi::BF16 ||
      v.size_bytes() != k.size_bytes())
    return ffi::Error::InvalidArgument("write_frame_fp8: expected k, v bf16[L, B, tokens, H, 64]");
  const int64_t L = dims[0], B = dims[1], tpf = dims[2], H = dims[3];
  if (static_cast<int64_t>(args.size()) != 4 * L || static_cast<int64_t>(rets.size()) != 4 * L)
    return ffi::Error::InvalidArgument("write_frame_fp8: expected 4 buffers a layer (K, V codes, K, V scales)");
  if (num_special < 0 || num_special > tpf || page_size < tpf - num_special)
    return ffi::Error::InvalidArgument("write_frame_fp8: expected 0 <= num_special <= tokens <= num_special + page_size");
  int64_t rows = -1;
  Fp8Buffers bufs{};
  for (int64_t chunk = 0; chunk < L; chunk += kFp8MaxLayers) {
    const int64_t n = L - chunk < kFp8MaxLayers ? L - chunk : kFp8MaxLayers;
    for (int64_t j = 0; j < n; ++j) {
      for (int part = 0; part < 4; ++part) {
        const int64_t i = part * L + chunk + j;
        auto in = args.get<ffi::AnyBuffer>(i);
        auto out = rets.get<ffi::AnyBuffer>(i);
        if (!in.has_value() || !out.has_value())
          return ffi::Error::InvalidArgument("write_frame_fp8: expected array buffers");
        const auto bd = in->dimensions();
        const bool codes = part < 2;
        if (bd.size() != (codes ? 4u : 3u) || bd[0] != B || bd[2] != H || (codes && bd[3] != kFp8HeadDim) ||
            in->size_bytes() != (*out)->size_bytes() || (rows >= 0 && bd[1] != rows))
          return ffi::Error::InvalidArgument(
              "write_frame_fp8: expected codes u8[B, T, H, 64] and scales bf16[B, T, H], T the same in all");
        rows = bd[1];
        in_place(*out, *in, stream);
        if (codes)
          bufs.codes[part][j] = static_cast<uint8_t*>((*out)->untyped_data());
        else
          bufs.scales[part - 2][j] = static_cast<__nv_bfloat16*>((*out)->untyped_data());
      }
    }
    if (rows < num_special || rows < page_size)
      return ffi::Error::InvalidArgument("write_frame_fp8: expected buffers of at least a page and the specials");
    const int64_t pairs = (num_special + page_size) * H;
    const dim3 grid(static_cast<unsigned>((pairs + kFp8WriteWarps - 1) / kFp8WriteWarps), static_cast<unsigned>(2 * n),
                    static_cast<unsigned>(B));
    if (pairs && B)
      frame_write_fp8_kernel<<<grid, kFp8WriteWarps * 32, 0, stream>>>(
          bufs, static_cast<const __nv_bfloat16*>(k.untyped_data()), static_cast<const __nv_bfloat16*>(v.untyped_data()),
          special_row.typed_data(), patch_row.typed_data(), static_cast<int32_t>(chunk), static_cast<int32_t>(B),
          static_cast<int32_t>(tpf), num_special, page_size, static_cast<int32_t>(H), rows);
  }
  return launch_status(cudaGetLastError(), "write_frame_fp8");
}

}  // namespace jaxkv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvFrameWriteFp8, jaxkv::frame_write_fp8,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("num_special")
                                  .Attr<int32_t>("page_size")
                                  .Arg<xla::ffi::AnyBuffer>()  // k bf16[L, B, tokens, H, 64]
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Arg<jaxkv::Rows>()          // special_row i32[B]
                                  .Arg<jaxkv::Rows>()          // patch_row i32[B]
                                  .RemainingArgs()             // 4L buffers
                                  .RemainingRets(),            // the same, aliased
                              {xla::ffi::Traits::kCmdBufferCompatible});
