// benchmarks/row_gather.py's kernels: read scattered pool rows and nothing else, to measure
// what an H100 gives for DeepSeek-V4's row pattern (576 bytes of codes + rope per row, 64-byte
// aligned, and the row's 8 scale bytes elsewhere) against how many loads are in flight.
// Not part of jaxkv: built on first use into the cache directory.
#include <cstdint>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace {

__device__ __forceinline__ uint4 ld_nc(const uint4* p) {  // as the attention's producer loads a row
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Loads laid out as pool_attention's producer lays them: four threads per row, thread t reads
// 16-byte chunks t % 4 + 4 k (k < 9) of rows t / 4 + (blockDim / 4) h (h < R), and the scale;
// the next group's row ids one group ahead. Each CTA takes groups of blockDim / 4 * R rows.
template <int R>
__global__ void rows_by_thread(const int32_t* ids, int n, const uint4* codes, const uint2* scales, uint4* out) {
  const int t = threadIdx.x, per = blockDim.x / 4 * R;
  uint4 acc = make_uint4(0, 0, 0, 0);
  auto id_at = [&](int g, int h) {
    const int i = g + h * (blockDim.x / 4) + t / 4;
    return i < n ? __ldg(ids + i) : -1;
  };
  int id[R];
  int g = blockIdx.x * per;
#pragma unroll
  for (int h = 0; h < R; ++h) id[h] = id_at(g, h);
  for (; g < n; g += gridDim.x * per) {
    uint4 v[R][9];
    uint2 sc[R];
#pragma unroll
    for (int h = 0; h < R; ++h) {
      const uint4* row = codes + int64_t(max(id[h], 0)) * 36;  // u32[M, 144] rows
#pragma unroll
      for (int k = 0; k < 9; ++k) v[h][k] = id[h] >= 0 ? ld_nc(row + (t & 3) + 4 * k) : make_uint4(0, 0, 0, 0);
      sc[h] = id[h] >= 0 ? __ldg(scales + id[h]) : make_uint2(0, 0);
    }
#pragma unroll
    for (int h = 0; h < R; ++h) id[h] = id_at(g + gridDim.x * per, h);
#pragma unroll
    for (int h = 0; h < R; ++h) {
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        acc.x ^= v[h][k].x;
        acc.y ^= v[h][k].y;
        acc.z ^= v[h][k].z;
        acc.w ^= v[h][k].w;
      }
      acc.x ^= sc[h].x;
      acc.y ^= sc[h].y;
    }
  }
  out[blockIdx.x * blockDim.x + t] = acc;  // keeps the loads
}

// One bulk copy (TMA, cp.async.bulk) per row into shared memory: groups of G rows, two stages,
// the next group's copies issued before the current group is read.
__global__ void rows_by_bulk_copy(const int32_t* ids, int n, const uint4* codes, const uint2* scales, uint4* out,
                                  int G) {
  extern __shared__ __align__(128) uint8_t stage[];  // u8[2][G][576]
  __shared__ __align__(8) uint64_t bars[2];
  const int t = threadIdx.x;
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
  if (t == 0) {
    for (int s = 0; s < 2; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  uint4 acc = make_uint4(0, 0, 0, 0);
  const int step = gridDim.x * G;
  auto issue = [&](int g, int s) {  // rows [g, g + G) -> stage s
    const int count = min(G, n - g);
    if (t == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar + 8 * s), "r"(count * 576)
                   : "memory");
    if (t < count) {
      const int id = __ldg(ids + g + t);
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 576, [%2];\n"
                   ::"r"(base + (s * G + t) * 576), "l"(codes + int64_t(id) * 36), "r"(bar + 8 * s) : "memory");
      acc.y ^= __ldg(scales + id).x;
    }
  };
  int g = blockIdx.x * G, it = 0;
  if (g < n) issue(g, 0);
  for (; g < n; g += step, ++it) {
    const int s = it & 1;
    if (g + step < n) issue(g + step, s ^ 1);
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n"
                 ::"r"(bar + 8 * s), "r"((it >> 1) & 1) : "memory");
    const uint4* st = reinterpret_cast<const uint4*>(stage + s * G * 576);
    for (int i = t; i < G * 36; i += blockDim.x) {
      const uint4 v = st[i];
      acc.x ^= v.x;
      acc.z ^= v.z;
    }
    __syncthreads();  // stage s is free again
  }
  out[blockIdx.x * blockDim.x + t] = acc;
}

}  // namespace

namespace ffi = xla::ffi;
using Ids = ffi::Buffer<ffi::S32, 1>;
using Words = ffi::Buffer<ffi::U32, 2>;
using Sink = ffi::Buffer<ffi::U32, 1>;
using Stream = ffi::PlatformStream<cudaStream_t>;

// mode 0: rows_by_thread with ``rows`` rows per thread; mode 1: rows_by_bulk_copy with groups of ``rows``
static ffi::Error row_gather(cudaStream_t stream, Ids ids, Words codes, Words scales, ffi::ResultBuffer<ffi::U32, 1> out,
                             int32_t mode, int32_t rows, int32_t threads, int32_t ctas) {
  if (codes.dimensions()[1] != 144 || scales.dimensions()[1] != 2)
    return ffi::Error::InvalidArgument("codes, scales: expected u32[M, 144] and u32[M, 2]");
  if (out->dimensions()[0] != int64_t(ctas) * threads * 4) return ffi::Error::InvalidArgument("out: expected u32[ctas * threads * 4]");
  const int n = static_cast<int>(ids.dimensions()[0]);
  auto c = reinterpret_cast<const uint4*>(codes.typed_data());
  auto s = reinterpret_cast<const uint2*>(scales.typed_data());
  auto o = reinterpret_cast<uint4*>(out->typed_data());
  if (mode == 1) {
    const int bytes = 2 * rows * 576;
    cudaFuncSetAttribute(rows_by_bulk_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    rows_by_bulk_copy<<<ctas, threads, bytes, stream>>>(ids.typed_data(), n, c, s, o, rows);
  } else if (rows == 1) {
    rows_by_thread<1><<<ctas, threads, 0, stream>>>(ids.typed_data(), n, c, s, o);
  } else if (rows == 2) {
    rows_by_thread<2><<<ctas, threads, 0, stream>>>(ids.typed_data(), n, c, s, o);
  } else if (rows == 4) {
    rows_by_thread<4><<<ctas, threads, 0, stream>>>(ids.typed_data(), n, c, s, o);
  } else {
    return ffi::Error::InvalidArgument("rows: expected 1, 2 or 4 per thread");
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowGather, row_gather,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<Ids>()    // ids i32[n]
                                  .Arg<Words>()  // codes u32[M, 144]: 576-byte rows
                                  .Arg<Words>()  // scales u32[M, 2]
                                  .Ret<Sink>()   // u32[ctas * threads * 4]
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("rows")
                                  .Attr<int32_t>("threads")
                                  .Attr<int32_t>("ctas"));
