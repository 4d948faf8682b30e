// PTX wrappers the attention kernels share (pool_attention.cu, prefix_attention.cu): shared
// addresses, cp.async, the 128-byte-swizzle tile layout, and on sm_90a the wgmma fences,
// shared-memory descriptors, mbarriers and named barriers.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

namespace jaxkv {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, bool ok) {  // zero-fill when !ok
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(kBytes),
                 "r"(ok ? kBytes : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte offset of 16-byte chunk ``c`` of row ``r`` in a swizzled BF16 tile: rows of 64 BF16
// (128 B), a chunk's index inside its row XORed with the row's low 3 bits (wgmma's "128-byte
// swizzle", so the tensor cores read the tile straight from shared memory, and 8 consecutive
// rows at one chunk hit 8 bank groups). A tile wider than 64 BF16 is stored as column groups
// of 64 rows (8 KiB each): chunk c >= 8 goes to group c / 8.
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return ((c >> 3) << 13) + (r << 7) + (((c ^ r) & 7) << 4);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma shared-memory descriptor of a 128-byte-swizzled operand at ``addr`` whose 8-row groups
// are 1024 B apart (K-major: rows are M / N; N-major: rows are K). ``group_bytes``: for an
// N-major operand wider than 64, the distance between its 64-column groups (``swz``: 8 KiB);
// unused otherwise.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t group_bytes = 16) {
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(group_bytes >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// this thread's shared-memory writes (generic proxy) -> visible to wgmma's reads (async proxy)
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarriers (arrival counts, phase parity) and named barriers between warpgroups
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// the arrival of this thread's cp.asyncs so far, counted when they land
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
#endif

}  // namespace jaxkv
