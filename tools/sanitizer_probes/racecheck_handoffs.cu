// Shared-memory hand-offs racecheck is asked to judge: which correct protocols it follows.
//
//   nvcc -arch=sm_90a -lineinfo -o handoffs racecheck_handoffs.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard ./handoffs MODE
//
// MODE: sync (bar.sync on both sides; correct), none (no barrier; racy), arrive (bar.arrive ->
// bar.sync, the attention kernels' warpgroup hand-off; correct by PTX), mbarrier (lanes read,
// __syncwarp, lane 0 arrives, the writer waits on the phase; correct by PTX), cluster (two
// CTAs of a cluster write a (max, sum) pair each, barrier.cluster, each reads its own and its
// peer's, barrier.cluster again: the split merge's exchange; correct by PTX), merge (the
// reader hands back with bar.arrive -> bar.sync, then the writer writes a (max, sum) pair
// and both meet at bar.sync before the reader reads it: pool_attention.cu's (max, sum)
// hand-off, whose second step alone racecheck is shown to follow by sync). A tool that
// follows a protocol reports 0 hazards for it. tools/sanitize.py --probes runs them all;
// docs/reliability.md has what they gave.
#include <cstdint>
#include <cstdio>
#include <cstring>

enum Mode { kSync, kNone, kArrive, kMbarrier, kCluster, kMerge };

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// two warpgroups: 0 writes a row scale per iteration, 1 reads it (pool_attention.cu's alpha_s)
template <Mode kMode>
__global__ void named_barrier_handoff(float* out, int iters) {
  __shared__ float alpha[64];
  const int t = threadIdx.x, lane = t % 32, row = (t % 128) / 32 * 16 + lane / 4;
  const bool arrive = kMode == kArrive, sync = kMode != kNone;
  float acc = 0.f;
  if (t < 128) {
    for (int i = 0; i < iters; ++i) {
      if (sync) bar_sync(2, 256);  // the reader is done with the previous value
      if ((lane & 3) == 0) alpha[row] = float(i + row), alpha[row + 8] = float(i - row);
      if (arrive) bar_arrive(1, 256); else if (sync) bar_sync(1, 256);  // the value is in
    }
    if (sync) bar_sync(2, 256);
  } else {
    if (arrive) bar_arrive(2, 256); else if (sync) bar_sync(2, 256);
    for (int i = 0; i < iters; ++i) {
      if (sync) bar_sync(1, 256);
      acc += alpha[row] + alpha[row + 8];
      if (arrive) bar_arrive(2, 256); else if (sync) bar_sync(2, 256);
    }
  }
  out[blockIdx.x * 256 + t] = acc;
}

// one warp reads a stage, then frees it through an mbarrier; another warp waits and refills it
__global__ void mbarrier_handoff(float* out) {
  __shared__ float stage[32];
  __shared__ alignas(8) uint64_t free_bar;
  const int t = threadIdx.x, lane = t % 32;
  if (t == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem(&free_bar)));
  if (t < 32) stage[t] = float(t);
  __syncthreads();
  if (t >= 32) {
    out[t] = stage[lane];
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem(&free_bar)) : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra WAIT;\n}\n" ::"r"(
            smem(&free_bar))
        : "memory");
    stage[lane] = -1.f;
  }
}

// warpgroup 1 frees a buffer with bar.arrive; warpgroup 0 waits, writes each row's (max, sum),
// and both meet at bar.sync before warpgroup 1 reads them (pool_attention.cu's ml)
__global__ void merge_handoff(float* out) {
  __shared__ float ml[2 * 64];
  const int t = threadIdx.x, lane = t % 32, row = (t % 128) / 32 * 16 + lane / 4;
  if (t < 128) {
    bar_sync(2, 256);  // warpgroup 1's hand-back
    if ((lane & 3) == 0) ml[2 * row] = float(row), ml[2 * row + 1] = float(-row);
  } else {
    bar_arrive(2, 256);
  }
  bar_sync(3, 256);
  out[t] = t >= 128 ? ml[2 * row] + ml[2 * row + 1] : 0.f;
}

// two CTAs of a cluster: each writes its rows' (max, sum), then both read both (pool_attention.cu's ml)
__global__ void __cluster_dims__(2, 1, 1) cluster_handoff(float* out) {
  __shared__ float ml[2 * 64];
  const int t = threadIdx.x;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  if (t < 64) ml[2 * t] = float(t + rank), ml[2 * t + 1] = float(t - rank);
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  float acc = 0.f;
  if (t < 64) {
    for (uint32_t k = 0; k < 2; ++k) {
      uint32_t at;
      float2 v;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(at) : "r"(smem(ml + 2 * t)), "r"(k));
      asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(at) : "memory");
      acc += v.x + v.y;
    }
  }
  // no CTA leaves (its shared memory gone) while its peer may still read it
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  out[blockIdx.x * 64 + t] = acc + ml[t];
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  float* out;
  cudaMalloc(&out, 4 * 256 * sizeof(float));
  if (!strcmp(mode, "sync")) named_barrier_handoff<kSync><<<4, 256>>>(out, 16);
  else if (!strcmp(mode, "none")) named_barrier_handoff<kNone><<<4, 256>>>(out, 16);
  else if (!strcmp(mode, "arrive")) named_barrier_handoff<kArrive><<<4, 256>>>(out, 16);
  else if (!strcmp(mode, "mbarrier")) mbarrier_handoff<<<1, 64>>>(out);
  else if (!strcmp(mode, "cluster")) cluster_handoff<<<2, 64>>>(out);
  else if (!strcmp(mode, "merge")) merge_handoff<<<1, 256>>>(out);
  else {
    fprintf(stderr, "MODE: expected sync, none, arrive, mbarrier, cluster or merge, got '%s'\n", mode);
    return 2;
  }
  const cudaError_t e = cudaDeviceSynchronize();
  printf("%s: %s\n", mode, cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
