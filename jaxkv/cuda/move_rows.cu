// Row moves in many buffers at once: a frame cache's begin / commit / rollback moves one
// page of rows per stream in every layer's K, V (and FP8 scales) and in token_id. XLA does
// that as a slice and an update per buffer, two launches each; this kernel moves every
// buffer's rows in one launch (docs/kernels/frame_append.md, "Row moves").
//
//   grid   x: chunks of a move's span, y: buffers, z: moves. A block copies one chunk of
//          one buffer's span for one move, 16-byte copies where both ends are aligned.
//   moves  i32[M, 3] (stream, src, dst), rows [src, src + rows) -> [dst, dst + rows) of that
//          stream. A move whose stream or rows fall outside a buffer is skipped, so nothing
//          is written outside it. Moves run at once: no move's dst may overlap its own src
//          or another move's rows (the frame cache's never do: frame.plan).
//
// Reached through jax.ffi (jaxkv.kernels.move_rows_cuda); buffers are aliased in place.

#include <cstdint>
#include <cuda_runtime.h>

#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

namespace ffi = xla::ffi;
using Moves = ffi::Buffer<ffi::S32, 2>;  // i32[M, 3] (stream, src, dst)

constexpr int kMoveThreads = 256;
constexpr int64_t kMoveChunk = 16384;  // bytes a block copies
constexpr int kMaxMoveBuffers = 96;    // per launch (the kernel's parameter space); more: several launches

struct MoveBuffers {
  uint8_t* base[kMaxMoveBuffers];
  int64_t row_bytes[kMaxMoveBuffers];
  int64_t rows[kMaxMoveBuffers];  // R: rows per stream
  int64_t streams[kMaxMoveBuffers];
};

__global__ void __launch_bounds__(kMoveThreads)
    move_rows_kernel(const MoveBuffers bufs, const int32_t* __restrict__ moves, int64_t span_rows) {
  const int i = blockIdx.y;
  const int64_t b = moves[3 * blockIdx.z], src = moves[3 * blockIdx.z + 1], dst = moves[3 * blockIdx.z + 2];
  const int64_t R = bufs.rows[i], row_bytes = bufs.row_bytes[i];
  if (b < 0 || b >= bufs.streams[i] || src < 0 || dst < 0 || src + span_rows > R || dst + span_rows > R) return;
  const int64_t bytes = span_rows * row_bytes;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * kMoveChunk;
  if (off >= bytes) return;
  const int64_t len = bytes - off < kMoveChunk ? bytes - off : kMoveChunk;
  const uint8_t* s = bufs.base[i] + (b * R + src) * row_bytes + off;
  uint8_t* d = bufs.base[i] + (b * R + dst) * row_bytes + off;
  const uintptr_t align = reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d) | static_cast<uintptr_t>(len);
  if (align % 16 == 0) {
    for (int64_t k = threadIdx.x; k < len / 16; k += blockDim.x)
      reinterpret_cast<uint4*>(d)[k] = reinterpret_cast<const uint4*>(s)[k];
  } else if (align % 4 == 0) {
    for (int64_t k = threadIdx.x; k < len / 4; k += blockDim.x)
      reinterpret_cast<uint32_t*>(d)[k] = reinterpret_cast<const uint32_t*>(s)[k];
  } else {
    for (int64_t k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
  }
}

// args: moves i32[M, 3], then the n buffers [B, R, ...]; rets: the n buffers, aliased.
static ffi::Error move_rows(cudaStream_t stream, int64_t span_rows, Moves moves,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const int64_t n = static_cast<int64_t>(rets.size());
  if (static_cast<int64_t>(args.size()) != n) return ffi::Error::InvalidArgument("move_rows: expected one result a buffer");
  if (moves.dimensions()[1] != 3) return ffi::Error::InvalidArgument("move_rows: expected moves i32[M, 3]");
  const int64_t M = moves.dimensions()[0];
  if (span_rows <= 0) return ffi::Error::InvalidArgument("move_rows: expected rows >= 1");
  MoveBuffers bufs{};
  int64_t most = 0;
  int count = 0;
  auto launch = [&]() {
    if (count && M && most) {
      const dim3 grid(static_cast<unsigned>((most + kMoveChunk - 1) / kMoveChunk), count, static_cast<unsigned>(M));
      move_rows_kernel<<<grid, kMoveThreads, 0, stream>>>(bufs, moves.typed_data(), span_rows);
    }
    count = 0;
    most = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("move_rows: expected array buffers");
    const auto dims = in->dimensions();
    if (dims.size() < 2 || in->size_bytes() != (*out)->size_bytes())
      return ffi::Error::InvalidArgument("move_rows: expected buffers [B, R, ...], each result its input's shape");
    in_place(*out, *in, stream);
    const int64_t B = dims[0], R = dims[1];
    if (B == 0 || R == 0) continue;
    bufs.base[count] = static_cast<uint8_t*>((*out)->untyped_data());
    bufs.row_bytes[count] = static_cast<int64_t>(in->size_bytes()) / (B * R);
    bufs.rows[count] = R;
    bufs.streams[count] = B;
    most = span_rows * bufs.row_bytes[count] > most ? span_rows * bufs.row_bytes[count] : most;
    if (++count == kMaxMoveBuffers) launch();
  }
  launch();
  return launch_status(cudaGetLastError(), "move_rows");
}

}  // namespace jaxkv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvMoveRows, jaxkv::move_rows,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("rows")
                                  .Arg<jaxkv::Moves>()  // i32[M, 3]
                                  .RemainingArgs()      // the buffers [B, R, ...]
                                  .RemainingRets(),     // the same, aliased
                              {xla::ffi::Traits::kCmdBufferCompatible});
