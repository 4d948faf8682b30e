// Frame-cache append for the torch drop-in (torch_bridge.manager): one frame's K and V rows
// scattered into a layer's buffers, unless the frame holds a NaN or an Inf anywhere, in
// which case every row goes to the trash row and a sticky flag is raised. This is
// jaxkv.frame.write_layer's rule in two launches from one ctypes call, where torch ops take
// many (isfinite is composite; docs/kernels/frame_append.md).
//
//   check   grid-stride over k and v as 32-bit words; each block writes whether its words
//           held a non-finite value to scratch[block] (no reset needed: every block writes).
//   write   one block per row: OR of scratch[0 .. check_blocks) decides the destination
//           (rows[r] or trash_row); block 0 raises *sticky when the frame is bad. A row
//           outside the buffer goes to trash_row too: no write lands outside kbuf / vbuf.
//
// dtype: 0 bfloat16, 1 float16, 2 float32 (a non-finite value has an all-ones exponent).
// Rows are row_bytes long (a multiple of 4), contiguous; 16-byte copies where aligned.

#include <cstdint>
#include <cuda_runtime.h>

#include "codes.cuh"  // word_nonfinite

namespace jaxkv {

constexpr int kCheckThreads = 256;
constexpr int kMaxCheckBlocks = 256;  // scratch holds this many ints
constexpr int kWriteThreads = 128;

__global__ void __launch_bounds__(kCheckThreads)
    check_kernel(const uint32_t* k, const uint32_t* v, int64_t words, int32_t dtype, int32_t* scratch) {
  bool bad = false;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    bad |= word_nonfinite(__ldg(k + i), dtype) | word_nonfinite(__ldg(v + i), dtype);
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) scratch[blockIdx.x] = bad;
}

__device__ __forceinline__ void copy_row(const uint8_t* src, uint8_t* dst, int64_t bytes, bool vec16) {
  if (vec16) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = s[i];
  } else {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) d[i] = s[i];
  }
}

__global__ void __launch_bounds__(kWriteThreads)
    write_kernel(const uint8_t* k, const uint8_t* v, uint8_t* kbuf, uint8_t* vbuf, const int64_t* rows,
                 int64_t row_bytes, int64_t trash_row, int64_t buf_rows, const int32_t* scratch, int32_t check_blocks,
                 uint8_t* sticky, bool vec16) {
  bool bad = false;
  for (int i = threadIdx.x; i < check_blocks; i += blockDim.x) bad |= scratch[i] != 0;
  bad = __syncthreads_or(bad);
  const int64_t r = blockIdx.x;
  const int64_t row = rows[r];
  const int64_t dst = bad || row < 0 || row >= buf_rows ? trash_row : row;
  copy_row(k + r * row_bytes, kbuf + dst * row_bytes, row_bytes, vec16);
  copy_row(v + r * row_bytes, vbuf + dst * row_bytes, row_bytes, vec16);
  if (bad && r == 0 && threadIdx.x == 0) *sticky = 1;
}

}  // namespace jaxkv

extern "C" {

// k, v: [n_rows, row_bytes] contiguous; kbuf, vbuf: [buf_rows, row_bytes]; rows: i64[n_rows]
// (outside [0, buf_rows): to trash_row); scratch: i32[256]; sticky: one byte, set to 1 (never
// cleared here). Returns a cudaError_t (0: launched); 1 (cudaErrorInvalidValue) for a bad
// size, dtype or trash_row.
int jaxkv_frame_append(void* stream, const void* k, const void* v, void* kbuf, void* vbuf, const int64_t* rows,
                       int64_t n_rows, int64_t row_bytes, int64_t trash_row, int64_t buf_rows, int32_t dtype,
                       int32_t* scratch, uint8_t* sticky) {
  if (n_rows <= 0 || row_bytes <= 0 || row_bytes % 4 || dtype < 0 || dtype > 2 || trash_row < 0 ||
      trash_row >= buf_rows)
    return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t words = n_rows * row_bytes / 4;
  const int64_t want = (words + jaxkv::kCheckThreads * 8 - 1) / (jaxkv::kCheckThreads * 8);  // ~8 words per thread
  const int blocks = static_cast<int>(want < jaxkv::kMaxCheckBlocks ? want : jaxkv::kMaxCheckBlocks);
  jaxkv::check_kernel<<<blocks, jaxkv::kCheckThreads, 0, s>>>(static_cast<const uint32_t*>(k),
                                                               static_cast<const uint32_t*>(v), words, dtype, scratch);
  const bool vec16 = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(v) % 16 == 0 && reinterpret_cast<uintptr_t>(kbuf) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(vbuf) % 16 == 0;
  jaxkv::write_kernel<<<static_cast<unsigned>(n_rows), jaxkv::kWriteThreads, 0, s>>>(
      static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v), static_cast<uint8_t*>(kbuf),
      static_cast<uint8_t*>(vbuf), rows, row_bytes, trash_row, buf_rows, scratch, blocks, sticky, vec16);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
