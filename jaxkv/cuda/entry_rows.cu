// A CSA layer's row list for pool attention, in one launch: each query's picked entries
// through its request's block table to rows of the layer's pool, -1 where an entry is not
// visible to the query or its block is not one of the pool's, the count up to the last
// valid pick, then the step's other parts (window ring, own tokens) appended. XLA made that
// four launches a layer: a gather and select, a reduction, two concatenations
// (docs/hybrid.md, "The decode step's launches"). The rule is kernels.ref_entry_rows'.
//
//   grid x: query rows n = b * T + t; 128 threads walk the row's k picks, then copy the rest.
//   entry   i32[N, k]      picks (-1: none)
//   table   i32[R, MB]     the ratio's block table; slot i32[B] (clamped into [0, R), as XLA's gather)
//   limit   i32[N]         entries the query may see, (p + 1) // ratio
//   rest    i32[N, C], rest_valid i32[N, C / 64]: the other parts' rows and per-block counts
//   rows    i32[N, K + C], nvalid i32[N, K / 64 + C / 64]  (K: k rounded up to 64, padding -1)
//
// Reached through jax.ffi (jaxkv.kernels.entry_rows_cuda).

#include <cstdint>
#include <cuda_runtime.h>

#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

namespace ffi = xla::ffi;
using Ids = ffi::Buffer<ffi::S32, 2>;  // i32[rows, columns]; no comma inside the handler macro
using Ids1 = ffi::Buffer<ffi::S32, 1>;
using IdsOut = ffi::ResultBuffer<ffi::S32, 2>;

constexpr int kRowThreads = 128;
constexpr int kRowBlock = 64;  // rows per block of pool attention's list

struct EntryRowsArgs {
  const int32_t* entry;
  const int32_t* table;
  const int32_t* slot;
  const int32_t* limit;
  const int32_t* rest;
  const int32_t* rest_valid;
  int32_t* rows;
  int32_t* nvalid;
  int32_t k, K, C, T, R, MB, block_size, pool_blocks;
};

__global__ void __launch_bounds__(kRowThreads) entry_rows_kernel(const EntryRowsArgs a) {
  const int64_t n = blockIdx.x;
  const int b = static_cast<int>(n / a.T);
  const int s = min(max(__ldg(a.slot + b), 0), a.R - 1);
  const int lim = __ldg(a.limit + n);
  const int32_t* pick = a.entry + n * a.k;
  int32_t* out = a.rows + n * (a.K + a.C);
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  int last = 0;
  for (int j = threadIdx.x; j < a.K; j += kRowThreads) {
    int32_t id = -1;
    if (j < a.k) {
      const int e = __ldg(pick + j);
      if (e >= 0 && e < lim) {
        const int col = min(e / a.block_size, a.MB - 1);
        const int blk = __ldg(a.table + int64_t(s) * a.MB + col);
        if (blk >= 0 && blk < a.pool_blocks) {
          id = blk * a.block_size + e % a.block_size;
          last = j + 1;
        }
      }
    }
    out[j] = id;
  }
  for (int o = 16; o; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
  if ((threadIdx.x & 31) == 0 && last) atomicMax(&count, last);
  const int32_t* rest = a.rest + n * a.C;
  for (int c = threadIdx.x; c < a.C; c += kRowThreads) out[a.K + c] = __ldg(rest + c);
  __syncthreads();
  const int KB = a.K / kRowBlock, CB = a.C / kRowBlock;
  int32_t* nv = a.nvalid + n * (KB + CB);
  for (int i = threadIdx.x; i < KB + CB; i += kRowThreads)
    nv[i] = i < KB ? min(max(count - kRowBlock * i, 0), kRowBlock) : __ldg(a.rest_valid + n * CB + (i - KB));
}

static ffi::Error entry_rows(cudaStream_t stream, int32_t block_size, int32_t pool_blocks,
                             Ids entry, Ids table, Ids1 slot, Ids1 limit, Ids rest, Ids rest_valid, IdsOut rows,
                             IdsOut nvalid) {
  const auto ed = entry.dimensions(), td = table.dimensions(), rd = rest.dimensions();
  const int64_t N = ed[0], k = ed[1], C = rd[1], B = slot.dimensions()[0];
  const int64_t K = (k + kRowBlock - 1) / kRowBlock * kRowBlock;
  if (B < 1 || N % B || limit.dimensions()[0] != N || rd[0] != N || C % kRowBlock ||
      rest_valid.dimensions()[0] != N || rest_valid.dimensions()[1] != C / kRowBlock || td[0] < 1 || td[1] < 1 ||
      block_size < 1 || rows->dimensions()[0] != N || rows->dimensions()[1] != K + C ||
      nvalid->dimensions()[1] != (K + C) / kRowBlock)
    return ffi::Error::InvalidArgument("entry_rows: shapes disagree (kernels.entry_rows_cuda checks them)");
  if (N == 0) return ffi::Error::Success();
  EntryRowsArgs a{entry.typed_data(), table.typed_data(), slot.typed_data(), limit.typed_data(),
                  rest.typed_data(),  rest_valid.typed_data(), rows->typed_data(), nvalid->typed_data()};
  a.k = static_cast<int32_t>(k);
  a.K = static_cast<int32_t>(K);
  a.C = static_cast<int32_t>(C);
  a.T = static_cast<int32_t>(N / B);
  a.R = static_cast<int32_t>(td[0]);
  a.MB = static_cast<int32_t>(td[1]);
  a.block_size = block_size;
  a.pool_blocks = pool_blocks;
  entry_rows_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(a);
  return launch_status(cudaGetLastError(), "entry_rows");
}

}  // namespace jaxkv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvEntryRows, jaxkv::entry_rows,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("pool_blocks")
                                  .Arg<jaxkv::Ids>()  // entry i32[N, k]
                                  .Arg<jaxkv::Ids>()  // table i32[R, MB]
                                  .Arg<jaxkv::Ids1>()  // slot i32[B]
                                  .Arg<jaxkv::Ids1>()  // limit i32[N]
                                  .Arg<jaxkv::Ids>()  // rest i32[N, C]
                                  .Arg<jaxkv::Ids>()  // rest_valid i32[N, C / 64]
                                  .Ret<jaxkv::Ids>()  // rows i32[N, K + C]
                                  .Ret<jaxkv::Ids>(),  // nvalid i32[N, (K + C) / 64]
                              {xla::ffi::Traits::kCmdBufferCompatible});
