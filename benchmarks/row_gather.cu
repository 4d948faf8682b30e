// benchmarks/row_gather.py's kernels: read scattered pool rows and nothing else, to measure
// what an H100 gives for DeepSeek-V4's row pattern (576 bytes of codes + rope per row, 64-byte
// aligned, and the row's 8 scale bytes elsewhere) against how many loads are in flight.
// Not part of jaxkv: built on first use into the cache directory.
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

#include "../jaxkv/cuda/ptx.cuh"  // wgmma (sm_90a)

namespace {

// Q K^T-shaped products (m64n64k16, 32 k-steps over the 64 KiB tiles at q and k) back to back
// until *done, with a 2 us pause after each with busy 2, or with A from registers (only the
// 64 KiB at k read from shared memory, as if Q lived in registers) with busy 3; *out written
// only on an impossible sum (keeps the products)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <bool kRegsA>
__device__ __forceinline__ void products_loop(uint32_t q, uint32_t k, const int* done, int busy, uint4* out) {
  float S[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) S[i] = 0.f;
  const uint32_t a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};  // bf16 ones (kRegsA)
  for (;;) {
    // stop together: wgmma's .sync.aligned forms need the whole warpgroup (one OR over it)
    uint32_t stop;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.b32 q, %1, 0;\nbar.red.or.pred p, 2, 128, q;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(stop) : "r"(*reinterpret_cast<const volatile int*>(done)) : "memory");
    if (stop) break;
    jaxkv::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 32; ++kk) {
      if constexpr (kRegsA) {
        jaxkv::wgmma_rs(S, a, jaxkv::wgmma_desc(k + kk * 2048, 8192));
      } else {
        const uint32_t off = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
        jaxkv::wgmma_ss(S, jaxkv::wgmma_desc(q + off), jaxkv::wgmma_desc(k + off), kk > 0);
      }
    }
    jaxkv::wgmma_commit();
    jaxkv::wgmma_wait();
    if (busy == 2) __nanosleep(2000);
  }
  float x = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) x += S[i];
  if (x == 1.2345f) *out = make_uint4(1, 1, 1, 1);
}
#endif
// The tensor-core warpgroup of the loaders-beside-products kernels: the tiles are the first
// 128 KiB at a 1024-byte boundary from ``tiles`` (a shared address); busy 0 returns at once
__device__ __forceinline__ void products_until(uint32_t tiles, const int* done, int busy, uint4* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (busy == 0) return;
  const uint32_t q = (tiles + 1023) & ~1023u, k = q + 65536;
  if (busy == 3) {
    products_loop<true>(q, k, done, busy, out);
  } else {
    products_loop<false>(q, k, done, busy, out);
  }
#endif
}
// the loaders (threads 0 .. loaders - 1) are done: the products stop
__device__ __forceinline__ void loads_done(int* done, int loaders) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(loaders) : "memory");
  if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(done) = 1;
}
// a row's 16 bytes, by load variant: 0 as the attention's producer loads them (pool_attention.cu's
// ld_row16: non-coherent, no L1 allocation, L2 fetches of 256 B), 1 a plain ld.global, 2 a
// coherent one without L1 allocation
template <int LD>
__device__ __forceinline__ uint4 ld_variant(const uint4* p) {
  uint4 v;
  if constexpr (LD == 0)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (LD == 1)
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Loads laid out as pool_attention's producer lays them: four threads per row, thread t reads
// 16-byte chunks t % 4 + 4 k (k < 9) of rows t / 4 + (blockDim / 4) h (h < R), and the scale;
// the next group's row ids one group ahead. Each CTA takes groups of blockDim / 4 * R rows.
template <int R, int LD = 0>
__device__ __forceinline__ uint4 load_rows(const int32_t* ids, int n, const uint4* codes, const uint2* scales,
                                           int threads) {  // this thread's part of rows_by_thread; threads: the loaders
  const int t = threadIdx.x, per = threads / 4 * R;
  uint4 acc = make_uint4(0, 0, 0, 0);
  auto id_at = [&](int g, int h) {
    const int i = g + h * (threads / 4) + t / 4;
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
      for (int k = 0; k < 9; ++k)
        v[h][k] = id[h] >= 0 ? ld_variant<LD>(row + (t & 3) + 4 * k) : make_uint4(0, 0, 0, 0);
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
  return acc;
}
// The launch bounds let ptxas hold all R rows' loads in flight, as the attention's producer
// does (SASS: every load of a group before its first use; without them about one row per
// thread is in flight, whatever R: docs/kernels/pool_attention.md).
template <int R>
__global__ void __launch_bounds__(R == 4 ? 256 : 512, 1) rows_by_thread(const int32_t* ids, int n, const uint4* codes, const uint2* scales, uint4* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = load_rows<R>(ids, n, codes, scales, blockDim.x);  // keeps the loads
}

// What the attention's tensor-core reads of shared memory do to its producer's row loads: one
// warpgroup loads as rows_by_thread (R rows per thread, load variant LD) while a second runs
// Q K^T-shaped wgmma (m64n64k16, 32 k-steps over two 64 KiB tiles, as the 64-head consumer's
// S = Q K^T) back to back until the loads are done (busy 1), with a 2 us pause after each
// product (busy 2, about the attention consumers' share of a block), back to back with A from
// registers (busy 3: half the shared-memory reads), or not at all (busy 0).
// The tiles are never written: their values do not change the products' time.
template <int R, int LD>
__global__ void __launch_bounds__(256, 1) rows_beside_wgmma(const int32_t* ids, int n, const uint4* codes, const uint2* scales, uint4* out,
                                  int busy) {
  extern __shared__ __align__(1024) uint8_t raw[];  // u8[1024 + 2 * 64 KiB]
  __shared__ int done;
  const int t = threadIdx.x;
  if (t == 0) done = 0;
  __syncthreads();
  if (t >= 128) {
    products_until(jaxkv::smem_addr(raw), &done, busy, out + blockIdx.x * blockDim.x + t);
    return;
  }
  out[blockIdx.x * blockDim.x + t] = load_rows<R, LD>(ids, n, codes, scales, 128);
  loads_done(&done, 128);
}

// One bulk copy (TMA, cp.async.bulk) per row into shared memory: groups of G rows, two stages,
// the next group's copies issued before the current group is read.
// (busy >= 0: threads 0..127 copy, syncing by a named barrier, and threads 128.. run
// rows_beside_wgmma's products over 128 KiB after the stages, with its busy, until they are done)
__global__ void rows_by_bulk_copy(const int32_t* ids, int n, const uint4* codes, const uint2* scales, uint4* out,
                                  int G, int busy = -1) {
  extern __shared__ __align__(1024) uint8_t stage[];  // u8[2][G][576] (+ 1024 + 128 KiB with busy)
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ int done;
  const int t = threadIdx.x;
  const int loaders = busy < 0 ? blockDim.x : 128;
  if (t == 0) done = 0;
  const uint32_t bar = jaxkv::smem_addr(bars), base = jaxkv::smem_addr(stage);
  if (t == 0) {
    for (int s = 0; s < 2; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (t >= loaders) {
    products_until(base + 2 * G * 576, &done, busy, out + blockIdx.x * blockDim.x + t);
    return;
  }
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
    for (int i = t; i < G * 36; i += loaders) {
      const uint4 v = st[i];
      acc.x ^= v.x;
      acc.z ^= v.z;
    }
    asm volatile("bar.sync 1, %0;\n" ::"r"(loaders) : "memory");  // stage s is free again
  }
  out[blockIdx.x * blockDim.x + t] = acc;
  if (busy > 0) loads_done(&done, loaders);
}

}  // namespace

namespace ffi = xla::ffi;
using Ids = ffi::Buffer<ffi::S32, 1>;
using Words = ffi::Buffer<ffi::U32, 2>;
using Sink = ffi::Buffer<ffi::U32, 1>;
using Stream = ffi::PlatformStream<cudaStream_t>;

// Dynamic shared memory for a kernel that needs ``bytes`` of it, launched as ``ctas`` CTAs:
// at least enough that no more than ctas / SMs CTAs fit an SM (228 KiB), so that the block
// scheduler cannot stack them on some SMs and leave others idle (a guard)
template <class K>
static int per_sm_smem(K kernel, int bytes, int ctas) {
  int dev = 0, sms = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int per_sm = (ctas + sms - 1) / sms;
  bytes = std::max(bytes, 228 * 1024 / (per_sm + 1) + 4096);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  return bytes;
}
template <int R>
static void launch_beside(int ld, int ctas, cudaStream_t stream, const int32_t* ids, int n, const uint4* c,
                          const uint2* s, uint4* o, int busy) {
  auto k = ld == 0 ? rows_beside_wgmma<R, 0> : ld == 1 ? rows_beside_wgmma<R, 1> : rows_beside_wgmma<R, 2>;
  k<<<ctas, 256, per_sm_smem(k, 1024 + 2 * 65536, ctas), stream>>>(ids, n, c, s, o, busy);
}
template <int R>
static void launch_by_thread(int ctas, int threads, cudaStream_t stream, const int32_t* ids, int n, const uint4* c,
                             const uint2* s, uint4* o) {
  rows_by_thread<R><<<ctas, threads, per_sm_smem(rows_by_thread<R>, 0, ctas), stream>>>(ids, n, c, s, o);
}

// mode 0: rows_by_thread with ``rows`` rows per thread; mode 1: rows_by_bulk_copy with groups of ``rows``;
// mode 2: rows_beside_wgmma (256 threads) with ``rows`` rows per thread and load variant ``ld``;
// mode 3: rows_by_bulk_copy (256 threads) beside the products. ``busy``: the products' duty (modes 2, 3)
static ffi::Error row_gather(cudaStream_t stream, Ids ids, Words codes, Words scales, ffi::ResultBuffer<ffi::U32, 1> out,
                             int32_t mode, int32_t rows, int32_t threads, int32_t ctas, int32_t ld, int32_t busy) {
  if (codes.dimensions()[1] != 144 || scales.dimensions()[1] != 2)
    return ffi::Error::InvalidArgument("codes, scales: expected u32[M, 144] and u32[M, 2]");
  if (out->dimensions()[0] != int64_t(ctas) * threads * 4) return ffi::Error::InvalidArgument("out: expected u32[ctas * threads * 4]");
  const int n = static_cast<int>(ids.dimensions()[0]);
  auto c = reinterpret_cast<const uint4*>(codes.typed_data());
  auto s = reinterpret_cast<const uint2*>(scales.typed_data());
  auto o = reinterpret_cast<uint4*>(out->typed_data());
  if (mode == 2 || mode == 3) {
    if (threads != 256) return ffi::Error::InvalidArgument("threads: expected 256 beside the products");
    if (ld < 0 || ld > 2) return ffi::Error::InvalidArgument("ld: expected 0, 1 or 2");
  }
  if (mode == 1 || mode == 3) {
    const int bytes = 2 * rows * 576 + (mode == 3 ? 1024 + 2 * 65536 : 0);
    if (bytes > 227 * 1024) return ffi::Error::InvalidArgument("rows: the stages do not fit shared memory");
    rows_by_bulk_copy<<<ctas, threads, per_sm_smem(rows_by_bulk_copy, bytes, ctas), stream>>>(
        ids.typed_data(), n, c, s, o, rows, mode == 3 ? busy : -1);
  } else if (mode == 2) {
    if (rows == 1) launch_beside<1>(ld, ctas, stream, ids.typed_data(), n, c, s, o, busy);
    else if (rows == 2) launch_beside<2>(ld, ctas, stream, ids.typed_data(), n, c, s, o, busy);
    else return ffi::Error::InvalidArgument("rows: expected 1 or 2 per thread beside the products");
  } else if (rows == 1) {
    launch_by_thread<1>(ctas, threads, stream, ids.typed_data(), n, c, s, o);
  } else if (rows == 2) {
    launch_by_thread<2>(ctas, threads, stream, ids.typed_data(), n, c, s, o);
  } else if (rows == 4) {
    launch_by_thread<4>(ctas, threads, stream, ids.typed_data(), n, c, s, o);
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
                                  .Attr<int32_t>("ctas")
                                  .Attr<int32_t>("ld")
                                  .Attr<int32_t>("busy"));
