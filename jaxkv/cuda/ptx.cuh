// PTX wrappers the wgmma kernels share (pool_attention.cu, prefix_attention.cu, index_scores.cu): shared
// addresses, cp.async, the 128-byte-swizzle tile layout, and on sm_90a the wgmma instructions,
// fences and shared-memory descriptors, mbarriers and named barriers.
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

// One block of the online softmax (base 2) for a thread's two rows of a wgmma accumulator
// (rows lane / 4 and + 8 of its warp, each spread over the 4 lanes of a quad): S holds the
// block's raw scores (masked keys at -inf, J column pairs per row); c is the softmax scale
// times log2(e). The running maxima m (scaled) and sums l move on; P gets the block's
// probabilities as bf16 pairs in wgmma's A-operand order; alpha is what the earlier sums and
// outputs are rescaled by. A row with no key yet keeps m = -inf and gets P = 0.
template <int J>
__device__ __forceinline__ void softmax_block(const float (&S)[4 * J], float c, float (&m)[2], float (&l)[2],
                                              uint32_t (&P)[J / 2][4], float (&alpha)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < J; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(S[4 * j], S[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(S[4 * j + 2], S[4 * j + 3]));
  }
  float base[2], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float mn = fmaxf(m[h], mx[h] * c);
    base[h] = mn == -INFINITY ? 0.f : mn;
    alpha[h] = ex2(m[h] - base[h]);
    m[h] = mn;
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float p0 = ex2(fmaf(S[4 * j], c, -base[0])), p1 = ex2(fmaf(S[4 * j + 1], c, -base[0]));
    const float p2 = ex2(fmaf(S[4 * j + 2], c, -base[1])), p3 = ex2(fmaf(S[4 * j + 3], c, -base[1]));
    sum[0] += p0 + p1;
    sum[1] += p2 + p3;
    P[j >> 1][(j & 1) * 2] = pack_bf16(p0, p1);
    P[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + sum[h];
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

// Operand lists of the wgmma wrappers below: accumulator operands "+f"(d[i]) .. "+f"(d[i + 31])
// and their names "%0" .. "%127" in the instruction, 32 at a time.
#define JAXKV_D8(i) \
  "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define JAXKV_D32(i) JAXKV_D8(i), JAXKV_D8((i) + 8), JAXKV_D8((i) + 16), JAXKV_D8((i) + 24)
#define JAXKV_R0_31 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JAXKV_R32_63 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "\
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JAXKV_R64_95 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "\
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define JAXKV_R96_127 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "\
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d (+)= a b^T for one warpgroup, a bf16[64, 16] and b bf16[N, 16] K-major in shared memory,
// d f32[64, N] (N = 64, 128, 192: the accumulator's size picks it)
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" JAXKV_R0_31 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : JAXKV_D32(0)
               : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" JAXKV_R0_31 ", " JAXKV_R32_63
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : JAXKV_D32(0), JAXKV_D32(32)
               : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_ss(float (&d)[96], uint64_t a, uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {" JAXKV_R0_31 ", " JAXKV_R32_63 ", " JAXKV_R64_95
               "}, %96, %97, p, 1, 1, 0, 0;\n}\n"
               : JAXKV_D32(0), JAXKV_D32(32), JAXKV_D32(64)
               : "l"(a), "l"(b), "r"(accumulate));
}
// d += a b for one warpgroup, a bf16[64, 16] in registers (the accumulator layout), b bf16[16, N]
// N-major in shared memory, d f32[64, N] (N = 64, 256)
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" JAXKV_R0_31
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
               : JAXKV_D32(0)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// d (+)= a b^T for one warpgroup, a bf16[64, 16] in registers (the accumulator layout), b bf16[64, 16]
// K-major in shared memory, d f32[64, 64]; accumulate = 0 overwrites d
__device__ __forceinline__ void wgmma_rs_kmajor(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" JAXKV_R0_31
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : JAXKV_D32(0)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" JAXKV_R0_31 ", " JAXKV_R32_63 ", "
               JAXKV_R64_95 ", " JAXKV_R96_127 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
               : JAXKV_D32(0), JAXKV_D32(32), JAXKV_D32(64), JAXKV_D32(96)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// d += a b for one warpgroup, a bf16[64, 16] K-major and b bf16[16, 256] N-major, both in shared memory
__device__ __forceinline__ void wgmma_ss_nmajor(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" JAXKV_R0_31 ", " JAXKV_R32_63 ", "
               JAXKV_R64_95 ", " JAXKV_R96_127 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
               : JAXKV_D32(0), JAXKV_D32(32), JAXKV_D32(64), JAXKV_D32(96)
               : "l"(a), "l"(b));
}

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
// thread-block clusters: a CTA's rank, a shared address of this CTA -> the same offset in
// CTA `rank`'s shared memory (a shared::cluster address), arrivals on a peer's mbarrier,
// 16-byte stores into a peer's shared memory that complete_tx its mbarrier, plain loads and
// stores there, the cluster barrier
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t d;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(d) : "r"(addr), "r"(rank));
  return d;
}
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void st_async16(uint32_t cluster_addr, uint4 v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory");
}
// 8 bytes of shared::cluster memory (a peer's, through mapa) -> registers; 16 bytes into it
__device__ __forceinline__ float2 ld_cluster_f32x2(uint32_t cluster_addr) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(cluster_addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_cluster_f32x4(uint32_t cluster_addr, float x, float y, float z, float w) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(cluster_addr), "f"(x), "f"(y), "f"(z),
               "f"(w)
               : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
#endif

}  // namespace jaxkv
