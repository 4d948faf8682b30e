// DeepSeek-V4 flush kernels for jaxkv's hybrid cache layout (jaxkv/hybrid/state.py).
//
//   flush_write: CSA, entry + indexer key; HCA, entry only.
//     finished BF16 entries -> FP8 (UE8M0 64-element tiles, or one float32 scale per
//     entry) + BF16 rope dims, scattered into a layer's paged pool through (block, slot);
//     CSA also writes the rotated indexer key in MXFP4 or NVFP4. One warp per entry.
//   window_write: a decode step writes each request's token into its layer's SWA ring (a block of
//     `window` entries per request slot, in the same entry format), checking it on the way:
//     a token with a NaN or Inf is not written and its request gets Fault.NONFINITE_KV.
//   encode_rows: tokens encoded into a fresh pool of their own (row i at item i % block_size of
//     block i / block_size): the step's own tokens as the pool attention reads them.
//   csa_rotate_state  after a CSA flush: previous-b <- current-b, current a/b emptied.
//   hca_reset_state   after an HCA flush: the one stream emptied.
//
// Bytes are identical to jaxkv.formats.storage's jnp encoders (write_entry.cuh): every step
// is exact (IEEE div.rn, or div_rn.cuh's SharedDivisor where it is proven equal; power-of-two
// scales; integer FP8/FP4 encoding), NaN handled as they do.
// Two ways in: XLA FFI handlers (jax.ffi, buffers aliased in place) and extern "C"
// launchers (ctypes, for torch_bridge). Built by jaxkv/cuda/build.py for sm_90a / sm_100a.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "write_entry.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

// The row kernels (flush-write, SWA ring write) run one warp per row, kRowsPerBlock rows per
// CTA (launch_rows): this warp's row.
__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
}

// ---- flush-write ---------------------------------------------------------------------------
struct FlushArgs {
  PoolView pools;           // one layer's entry pool and key pool (null for HCA)
  const __nv_bfloat16* x;   // bf16[n, 512]  finished entries (RMSNorm + RoPE applied)
  const __nv_bfloat16* xi;  // bf16[n, 128]  finished, rotated indexer keys, or null
  const int32_t* block;   // i32[n]  physical block; rows outside [0, num_blocks) are skipped
  const int32_t* slot;    // i32[n]  item within the block, in [0, block_size)
  int64_t n;
};

__global__ void __launch_bounds__(32 * kRowsPerBlock) flush_write_kernel(FlushArgs a) {
  const int64_t row = warp_row();
  const int lane = threadIdx.x % 32;
  if (row >= a.n) return;
  // Load the entry and its key before the block table: every load is in flight at once,
  // so the warp waits for DRAM once, not twice (block/slot, then the data).
  const uint4* src = reinterpret_cast<const uint4*>(a.x + row * kHeadDim) + 2 * lane;
  const uint4 raw[2] = {src[0], src[1]};
  const PoolView& p = a.pools;
  const uint2 raw_key = p.index_pool != nullptr ? reinterpret_cast<const uint2*>(a.xi + row * kIndexDim)[lane]
                                                : make_uint2(0, 0);
  const int32_t blk = a.block[row];
  const int32_t sl = a.slot[row];
  if (blk < 0 || blk >= p.num_blocks || sl < 0 || sl >= p.block_size) return;  // warp-uniform
  write_entry(p, raw, blk, sl, lane);
  if (p.index_pool != nullptr) write_index_key(p, raw_key, blk, sl, lane);
}

// ---- SWA ring write, one decode token per request ------------------------------------------------
struct WindowArgs {
  PoolView ring;              // one layer's rings: block r is request slot r's, block_size = window
  const __nv_bfloat16* x;     // bf16[B, 512]  each request's token (normalised, RoPE applied)
  const int32_t* write_slot;  // i32[B]  the request's slot; outside [0, R): inactive
  const int32_t* start;       // i32[B]  the token's position (its ring item: start % window)
  const int32_t* num_tokens;  // i32[B]  0: no token
  uint32_t* error;            // u32[R + 1]
  uint32_t fault;             // Fault.NONFINITE_KV
  int64_t n;
};

// One warp per request. The XLA path (hybrid.write_window, impl="xla") does the same with a
// finiteness reduction, an error scatter and the index arithmetic as launches of their own.
__global__ void __launch_bounds__(32 * kRowsPerBlock) window_write_kernel(WindowArgs a) {
  const int64_t row = warp_row();
  const int lane = threadIdx.x % 32;
  if (row >= a.n) return;
  const uint4* src = reinterpret_cast<const uint4*>(a.x + row * kHeadDim) + 2 * lane;
  const uint4 raw[2] = {src[0], src[1]};
  const int32_t blk = a.write_slot[row];
  if (a.num_tokens[row] <= 0 || blk < 0 || blk >= a.ring.num_blocks) return;  // warp-uniform
  const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
  bool bad = false;
#pragma unroll
  for (int k = 0; k < 8; ++k) bad |= word_nonfinite(w[k], kWordBf16);
  if (__any_sync(0xffffffffu, bad)) {
    if (lane == 0) atomicOr(a.error + blk, a.fault);  // the ring's block is the request's slot
    return;
  }
  int32_t item = a.start[row] % a.ring.block_size;
  write_entry(a.ring, raw, blk, item < 0 ? item + a.ring.block_size : item, lane);
}

// ---- a fresh pool of encoded rows --------------------------------------------------------------
struct EncodeArgs {
  PoolView out;            // u8[ceil(n / block_size), block_size * entry_bytes]
  const __nv_bfloat16* x;  // bf16[n, 512]
  int64_t n;
};

// One warp per row, encoded as write_window stores it (NaN and Inf encoded, not checked).
__global__ void __launch_bounds__(32 * kRowsPerBlock) encode_rows_kernel(EncodeArgs a) {
  const int64_t row = warp_row();
  const int lane = threadIdx.x % 32;
  if (row >= a.n) return;
  const uint4* src = reinterpret_cast<const uint4*>(a.x + row * kHeadDim) + 2 * lane;
  const uint4 raw[2] = {src[0], src[1]};
  const int bs = a.out.block_size;
  write_entry(a.out, raw, static_cast<int>(row / bs), static_cast<int>(row % bs), lane);
}

// ---- tail state: CSA rotation, HCA reset ----------------------------------------------------
// tails: f32[R, streams, 3, width]  per stream the running softmax (M, S, A) (compressor.py).
// CSA (3 streams: current a, current b, previous b): previous b <- current b, a and b emptied.
// HCA (1 stream): emptied. Empty = (M, S, A) = (-inf, 0, 0). Rows whose slot is outside
// [0, R) are skipped.
__global__ void tail_state_kernel(float* tails, int64_t R, int32_t streams, int32_t width, const int32_t* slot) {
  const int32_t s = slot[blockIdx.y];
  if (s < 0 || s >= R) return;
  const int64_t stream_size = 3LL * width;
  float* t = tails + s * streams * stream_size;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < stream_size;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float empty = i < width ? -INFINITY : 0.f;  // row M of the triple, else S / A
    if (streams == 3) t[2 * stream_size + i] = t[stream_size + i];
    t[i] = empty;
    if (streams == 3) t[stream_size + i] = empty;
  }
}

// a row kernel over its a.n rows (warp_row)
template <class Args>
cudaError_t launch_rows(void (*kernel)(Args), cudaStream_t stream, const Args& a) {
  if (a.n == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((a.n + kRowsPerBlock - 1) / kRowsPerBlock);
  kernel<<<grid, 32 * kRowsPerBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_tail_state(cudaStream_t stream, float* tails, int64_t R, int32_t streams, int32_t width,
                              const int32_t* slot, int64_t n) {
  if (n == 0) return cudaSuccess;
  const unsigned gx = static_cast<unsigned>((3 * width + 255) / 256);
  tail_state_kernel<<<dim3(gx, static_cast<unsigned>(n)), 256, 0, stream>>>(tails, R, streams, width, slot);
  return cudaGetLastError();
}

}  // namespace jaxkv

// ---- C ABI (ctypes; torch_bridge.kernels) -----------------------------------------------------
extern "C" {

// pool / index_pool point at one layer's pool (index_pool and xi null for HCA).
int jaxkv_flush_write(void* stream, uint8_t* pool, uint8_t* index_pool, const void* x, const void* xi,
                      const int32_t* block, const int32_t* slot, int64_t n, int64_t num_blocks, int32_t block_size,
                      int32_t storage) {
  jaxkv::FlushArgs a{{pool, index_pool, num_blocks, block_size, storage}, static_cast<const __nv_bfloat16*>(x),
                     static_cast<const __nv_bfloat16*>(xi), block, slot, n};
  return static_cast<int>(jaxkv::launch_rows(jaxkv::flush_write_kernel, static_cast<cudaStream_t>(stream), a));
}

// streams == 3: CSA rotation; streams == 1: HCA reset.
int jaxkv_tail_state(void* stream, float* tails, int64_t R, int32_t streams, int32_t width, const int32_t* slot,
                     int64_t n) {
  return static_cast<int>(jaxkv::launch_tail_state(static_cast<cudaStream_t>(stream), tails, R, streams, width, slot, n));
}

}  // extern "C"

// ---- XLA FFI handlers (jax.ffi; jaxkv/kernels/flush_write.py) --------------------------------
// Every handler only enqueues work on XLA's stream (no host sync, no allocation), so it is
// marked command-buffer compatible: XLA captures it into the CUDA graph of a jitted step.
namespace ffi = xla::ffi;

namespace jaxkv {
// Buffer types without commas, so they can sit inside the handler macros.
using U8x3 = ffi::Buffer<ffi::U8, 3>;
using U8x2 = ffi::Buffer<ffi::U8, 2>;
using BF16x2 = ffi::Buffer<ffi::BF16, 2>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;
using U32x1 = ffi::Buffer<ffi::U32, 1>;
using BF16x1 = ffi::Buffer<ffi::BF16, 1>;
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using Stream = ffi::PlatformStream<cudaStream_t>;


static ffi::Error flush_write_ffi(cudaStream_t stream, ffi::Buffer<ffi::U8, 3> pool, ffi::Buffer<ffi::U8, 3> index_pool,
                                  ffi::Buffer<ffi::BF16, 2> x, ffi::Buffer<ffi::BF16, 2> xi,
                                  ffi::Buffer<ffi::S32, 1> block, ffi::Buffer<ffi::S32, 1> slot,
                                  ffi::ResultBuffer<ffi::U8, 3> pool_out, ffi::ResultBuffer<ffi::U8, 3> index_out,
                                  int32_t layer, int32_t block_size, int32_t storage, bool with_index) {
  const auto pd = pool.dimensions();
  const int64_t n = x.dimensions()[0];
  if (storage != kOfficial && storage != kPerEntry)
    return ffi::Error::InvalidArgument("storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (x.dimensions()[1] != kHeadDim) return ffi::Error::InvalidArgument("x: expected bf16[n, 512]");
  if (block.dimensions()[0] != n || slot.dimensions()[0] != n)
    return ffi::Error::InvalidArgument("block, slot: expected i32[n] with n = x.shape[0]");
  if (layer < 0 || layer >= pd[0]) return ffi::Error::InvalidArgument("layer: out of range of the pool");
  if (pd[2] != static_cast<int64_t>(block_size) * entry_bytes(storage))
    return ffi::Error::InvalidArgument("pool: last axis must be block_size * entry bytes");
  if (with_index) {
    const auto id = index_pool.dimensions();
    if (xi.dimensions()[0] != n || xi.dimensions()[1] != kIndexDim)
      return ffi::Error::InvalidArgument("xi: expected bf16[n, 128]");
    if (id[0] != pd[0] || id[1] != pd[1] || id[2] != static_cast<int64_t>(block_size) * key_bytes(storage))
      return ffi::Error::InvalidArgument("index_pool: expected u8[layers, num_blocks, block_size * key bytes]");
  }
  in_place(pool_out, pool, stream);
  if (with_index) in_place(index_out, index_pool, stream);
  const int64_t layer_bytes = pd[1] * pd[2];
  FlushArgs a{{pool_out->typed_data() + layer * layer_bytes,
               with_index ? index_out->typed_data() + layer * index_pool.dimensions()[1] * index_pool.dimensions()[2]
                          : nullptr,
               pd[1], block_size, storage},
              reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()),
              with_index ? reinterpret_cast<const __nv_bfloat16*>(xi.untyped_data()) : nullptr,
              block.typed_data(), slot.typed_data(), n};
  return launch_status(launch_rows(flush_write_kernel, stream, a), "flush_write");
}

static ffi::Error flush_write_csa(cudaStream_t stream, ffi::Buffer<ffi::U8, 3> pool, ffi::Buffer<ffi::U8, 3> index_pool,
                                  ffi::Buffer<ffi::BF16, 2> x, ffi::Buffer<ffi::BF16, 2> xi,
                                  ffi::Buffer<ffi::S32, 1> block, ffi::Buffer<ffi::S32, 1> slot,
                                  ffi::ResultBuffer<ffi::U8, 3> pool_out, ffi::ResultBuffer<ffi::U8, 3> index_out,
                                  int32_t layer, int32_t block_size, int32_t storage) {
  return flush_write_ffi(stream, pool, index_pool, x, xi, block, slot, pool_out, index_out, layer, block_size, storage,
                         true);
}

static ffi::Error flush_write_hca(cudaStream_t stream, ffi::Buffer<ffi::U8, 3> pool, ffi::Buffer<ffi::BF16, 2> x,
                                  ffi::Buffer<ffi::S32, 1> block, ffi::Buffer<ffi::S32, 1> slot,
                                  ffi::ResultBuffer<ffi::U8, 3> pool_out, int32_t layer, int32_t block_size,
                                  int32_t storage) {
  return flush_write_ffi(stream, pool, pool, x, x, block, slot, pool_out, pool_out, layer, block_size, storage, false);
}

// x comes in as its whole (flattened) stack; x_offset says where this layer's rows start.
static ffi::Error window_write_ffi(cudaStream_t stream, U8x3 ring, U32x1 error, BF16x1 x, S32x1 write_slot,
                                   S32x1 start, S32x1 num_tokens, ffi::ResultBuffer<ffi::U8, 3> ring_out,
                                   ffi::ResultBuffer<ffi::U32, 1> error_out,
                                   int32_t layer, int32_t window, int32_t storage, int32_t fault, int64_t x_offset) {
  const auto rd = ring.dimensions();
  const int64_t n = write_slot.dimensions()[0];
  if (storage != kOfficial && storage != kPerEntry)
    return ffi::Error::InvalidArgument("storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (layer < 0 || layer >= rd[0]) return ffi::Error::InvalidArgument("layer: out of range of the ring");
  if (window <= 0 || rd[2] != static_cast<int64_t>(window) * entry_bytes(storage))
    return ffi::Error::InvalidArgument("ring: last axis must be window * entry bytes");
  if (error.dimensions()[0] != rd[1] + 1) return ffi::Error::InvalidArgument("error: expected u32[R + 1]");
  if (start.dimensions()[0] != n || num_tokens.dimensions()[0] != n)
    return ffi::Error::InvalidArgument("write_slot, start, num_tokens: expected i32[B] each");
  if (x_offset < 0 || x_offset + n * kHeadDim > x.dimensions()[0])
    return ffi::Error::InvalidArgument("x: expected bf16[B, 512] rows at x_offset");
  in_place(ring_out, ring, stream);
  in_place(error_out, error, stream);
  WindowArgs a{{ring_out->typed_data() + layer * rd[1] * rd[2], nullptr, rd[1], window, storage},
               reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()) + x_offset,
               write_slot.typed_data(),
               start.typed_data(),
               num_tokens.typed_data(),
               error_out->typed_data(),
               static_cast<uint32_t>(fault),
               n};
  return launch_status(launch_rows(window_write_kernel, stream, a), "window_write");
}

// x comes in as its whole (flattened) stack: the rows rows from x_offset on are encoded.
static ffi::Error encode_rows_ffi(cudaStream_t stream, BF16x1 x, ffi::ResultBuffer<ffi::U8, 2> out,
                                  int32_t block_size, int32_t storage, int64_t rows, int64_t x_offset) {
  const int64_t n = rows;
  if (storage != kOfficial && storage != kPerEntry)
    return ffi::Error::InvalidArgument("storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (n < 1 || x_offset < 0 || x_offset + n * kHeadDim > x.dimensions()[0])
    return ffi::Error::InvalidArgument("x: expected bf16[rows, 512] at x_offset");
  const auto od = out->dimensions();
  const int64_t blocks = block_size > 0 ? (n + block_size - 1) / block_size : -1;
  if (blocks < 0 || od[0] != blocks || od[1] != static_cast<int64_t>(block_size) * entry_bytes(storage))
    return ffi::Error::InvalidArgument("out: expected u8[ceil(n / block_size), block_size * entry bytes]");
  if (n % block_size)  // the last block's spare items are zeros, as formats.storage.pack_items leaves them
    cudaMemsetAsync(out->typed_data() + (blocks - 1) * od[1], 0, od[1], stream);
  EncodeArgs a{{out->typed_data(), nullptr, blocks, block_size, storage},
               reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()) + x_offset, n};
  return launch_status(launch_rows(encode_rows_kernel, stream, a), "encode_rows");
}

static ffi::Error tail_state_ffi(cudaStream_t stream, ffi::Buffer<ffi::F32, 4> tails, ffi::Buffer<ffi::S32, 1> slot,
                                 ffi::ResultBuffer<ffi::F32, 4> out, int32_t streams) {
  const auto d = tails.dimensions();
  if (d[1] != streams || d[2] != 3)
    return ffi::Error::InvalidArgument(streams == 3 ? "tails: expected f32[R, 3, 3, width] (a CSA tail)"
                                                    : "tails: expected f32[R, 1, 3, width] (an HCA tail)");
  in_place(out, tails, stream);
  return launch_status(launch_tail_state(stream, out->typed_data(), d[0], streams, static_cast<int32_t>(d[3]),
                                         slot.typed_data(), slot.dimensions()[0]),
                       "tail_state");
}

static ffi::Error csa_rotate_state(cudaStream_t stream, ffi::Buffer<ffi::F32, 4> tails, ffi::Buffer<ffi::S32, 1> slot,
                                   ffi::ResultBuffer<ffi::F32, 4> out) {
  return tail_state_ffi(stream, tails, slot, out, 3);
}

static ffi::Error hca_reset_state(cudaStream_t stream, ffi::Buffer<ffi::F32, 4> tails, ffi::Buffer<ffi::S32, 1> slot,
                                  ffi::ResultBuffer<ffi::F32, 4> out) {
  return tail_state_ffi(stream, tails, slot, out, 1);
}

}  // namespace jaxkv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvFlushWriteCsa, jaxkv::flush_write_csa,
                              ffi::Ffi::Bind()
                                  .Ctx<jaxkv::Stream>()
                                  .Arg<jaxkv::U8x3>()    // pool
                                  .Arg<jaxkv::U8x3>()    // index_pool
                                  .Arg<jaxkv::BF16x2>()  // x
                                  .Arg<jaxkv::BF16x2>()  // xi
                                  .Arg<jaxkv::S32x1>()   // block
                                  .Arg<jaxkv::S32x1>()   // slot
                                  .Ret<jaxkv::U8x3>()    // pool (aliased)
                                  .Ret<jaxkv::U8x3>()    // index_pool (aliased)
                                  .Attr<int32_t>("layer")
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("storage"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvFlushWriteHca, jaxkv::flush_write_hca,
                              ffi::Ffi::Bind()
                                  .Ctx<jaxkv::Stream>()
                                  .Arg<jaxkv::U8x3>()    // pool
                                  .Arg<jaxkv::BF16x2>()  // x
                                  .Arg<jaxkv::S32x1>()   // block
                                  .Arg<jaxkv::S32x1>()   // slot
                                  .Ret<jaxkv::U8x3>()    // pool (aliased)
                                  .Attr<int32_t>("layer")
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("storage"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvWindowWrite, jaxkv::window_write_ffi,
                              ffi::Ffi::Bind()
                                  .Ctx<jaxkv::Stream>()
                                  .Arg<jaxkv::U8x3>()    // ring (aliased)
                                  .Arg<jaxkv::U32x1>()   // error (aliased)
                                  .Arg<jaxkv::BF16x1>()  // x: the flattened stack
                                  .Arg<jaxkv::S32x1>()   // write_slot
                                  .Arg<jaxkv::S32x1>()   // start
                                  .Arg<jaxkv::S32x1>()   // num_tokens
                                  .Ret<jaxkv::U8x3>()    // ring (aliased)
                                  .Ret<jaxkv::U32x1>()   // error (aliased)
                                  .Attr<int32_t>("layer")
                                  .Attr<int32_t>("window")
                                  .Attr<int32_t>("storage")
                                  .Attr<int32_t>("fault")
                                  .Attr<int64_t>("x_offset"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvEncodeRows, jaxkv::encode_rows_ffi,
                              ffi::Ffi::Bind()
                                  .Ctx<jaxkv::Stream>()
                                  .Arg<jaxkv::BF16x1>()  // x: the whole stack, flattened
                                  .Ret<jaxkv::U8x2>()    // out
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("storage")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("x_offset"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCsaRotateState, jaxkv::csa_rotate_state,
                              ffi::Ffi::Bind()
                                  .Ctx<jaxkv::Stream>()
                                  .Arg<jaxkv::F32x4>()  // tails
                                  .Arg<jaxkv::S32x1>()  // slot
                                  .Ret<jaxkv::F32x4>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvHcaResetState, jaxkv::hca_reset_state,
                              ffi::Ffi::Bind()
                                  .Ctx<jaxkv::Stream>()
                                  .Arg<jaxkv::F32x4>()  // tails
                                  .Arg<jaxkv::S32x1>()  // slot
                                  .Ret<jaxkv::F32x4>(),
                              {ffi::Traits::kCmdBufferCompatible});
