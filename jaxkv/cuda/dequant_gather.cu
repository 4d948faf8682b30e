// Dequant-gather for jaxkv's hybrid cache: compressed entries picked by (block, slot) from
// one layer of a paged pool, dequantized to BF16 rows, in either storage family.
//
//   out[m, d] = fp8(code[d]) * scale(d)   d < 448   (UE8M0 per 64-dim tile, or one f32 per entry)
//   out[m, d] = rope[d - 448]             d >= 448  (the BF16 bytes as stored)
//
// One warp per item: lane l holds dims [16 l, 16 l + 16): lanes 0..27 read 16 FP8 codes and
// their scale, lanes 28..31 copy 32 bytes of rope dims. A block outside [0, num_blocks) gives
// a zero row; a slot outside [0, block_size) is clamped. Bytes equal the jnp reference's
// (kernels/dequant_gather.py: f32 product, then round to BF16).
// Why CUDA and not Mosaic GPU: tests/kernels/test_mosaic_limits.py.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

#ifndef JAXKV_GATHER_ROWS
#define JAXKV_GATHER_ROWS 4
#endif
constexpr int kGatherRows = JAXKV_GATHER_ROWS;  // warps per CTA, one item each

__device__ __forceinline__ uint4 load16(const uint8_t* src) {
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) return *reinterpret_cast<const uint4*>(src);
  uint4 v;  // a pool whose blocks are not 16-byte aligned (an odd block size)
  uint8_t* b = reinterpret_cast<uint8_t*>(&v);
#pragma unroll
  for (int i = 0; i < 16; ++i) b[i] = src[i];
  return v;
}

struct GatherArgs {
  const uint8_t* pool;   // u8[num_blocks, block_size * entry_bytes]  one layer
  const int32_t* block;  // i32[m]
  const int32_t* slot;   // i32[m]
  __nv_bfloat16* out;    // bf16[m, 512]
  int64_t m;
  int64_t num_blocks;
  int32_t block_size;
  int32_t storage;
};

__global__ void __launch_bounds__(32 * kGatherRows) dequant_gather_kernel(GatherArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kGatherRows + threadIdx.x / 32;
  if (item >= a.m) return;
  const int blk = a.block[item];
  const int sl = min(max(a.slot[item], 0), a.block_size - 1);
  uint4 res[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (blk >= 0 && blk < a.num_blocks) {
    const int bs = a.block_size;
    const uint8_t* base = a.pool + static_cast<int64_t>(blk) * bs * entry_bytes(a.storage);
    const bool official = a.storage == kOfficial;
    if (lane < kNope / 16) {
      const uint4 q = load16(base + sl * (official ? kOffData : kPeCodes) + 16 * lane);
      const float scale = official ? e8m0_value(base[bs * kOffData + sl * kOffScales + lane / (kTile / 16)])
                                   : *reinterpret_cast<const float*>(base + bs * (kPeCodes + kPeRope) + sl * kPeScale);
      const uint8_t* c = reinterpret_cast<const uint8_t*>(&q);
      __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(res);
#pragma unroll
      for (int i = 0; i < 16; ++i) h[i] = __float2bfloat16_rn(fp8_e4m3_value(c[i]) * scale);
    } else {
      const uint8_t* rope = official ? base + sl * kOffData + kNope + 32 * (lane - kNope / 16)
                                     : base + bs * kPeCodes + sl * kPeRope + 32 * (lane - kNope / 16);
      res[0] = load16(rope);
      res[1] = load16(rope + 16);
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(a.out + item * kHeadDim + 16 * lane);
  dst[0] = res[0];
  dst[1] = res[1];
}

// Every handler only enqueues work on XLA's stream (no host sync, no allocation), so it is
// marked command-buffer compatible: XLA captures it into the CUDA graph of a jitted step.
namespace ffi = xla::ffi;

static ffi::Error dequant_gather(cudaStream_t stream, ffi::Buffer<ffi::U8, 3> pool, ffi::Buffer<ffi::S32, 1> block,
                                 ffi::Buffer<ffi::S32, 1> slot, ffi::ResultBuffer<ffi::BF16, 2> out, int32_t layer,
                                 int32_t block_size, int32_t storage) {
  const auto pd = pool.dimensions();
  const int64_t m = block.dimensions()[0];
  if (storage != kOfficial && storage != kPerEntry)
    return ffi::Error::InvalidArgument("storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (slot.dimensions()[0] != m || out->dimensions()[0] != m || out->dimensions()[1] != kHeadDim)
    return ffi::Error::InvalidArgument("block, slot: expected i32[m] each and a bf16[m, 512] result");
  if (layer < 0 || layer >= pd[0]) return ffi::Error::InvalidArgument("layer: out of range of the pool");
  if (pd[2] != static_cast<int64_t>(block_size) * entry_bytes(storage))
    return ffi::Error::InvalidArgument("pool: last axis must be block_size * entry bytes");
  if (m == 0) return ffi::Error::Success();
  GatherArgs a{pool.typed_data() + layer * pd[1] * pd[2], block.typed_data(), slot.typed_data(),
               reinterpret_cast<__nv_bfloat16*>(out->untyped_data()), m, pd[1], block_size, storage};
  dequant_gather_kernel<<<static_cast<unsigned>((m + kGatherRows - 1) / kGatherRows), 32 * kGatherRows, 0, stream>>>(a);
  return launch_status(cudaGetLastError(), "dequant_gather");
}

}  // namespace jaxkv

namespace jaxkv::gather_types {  // buffer types without commas, so they can sit inside the macro
using Pool = xla::ffi::Buffer<xla::ffi::U8, 3>;
using Index = xla::ffi::Buffer<xla::ffi::S32, 1>;
using Rows = xla::ffi::Buffer<xla::ffi::BF16, 2>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::gather_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDequantGather, jaxkv::dequant_gather,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::gather_types::Stream>()
                                  .Arg<jaxkv::gather_types::Pool>()   // pool
                                  .Arg<jaxkv::gather_types::Index>()  // block
                                  .Arg<jaxkv::gather_types::Index>()  // slot
                                  .Ret<jaxkv::gather_types::Rows>()   // bf16[m, 512]
                                  .Attr<int32_t>("layer")
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("storage"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
