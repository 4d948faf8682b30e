// Shared-memory hand-offs racecheck is asked to judge: which correct protocols it follows.
//
//   nvcc -arch=sm_90a -lineinfo -o handoffs racecheck_handoffs.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard ./handoffs MODE
//
// MODE: sync (bar.sync on both sides; correct), none (no barrier; racy), arrive (bar.arrive ->
// bar.sync, the attention kernels' warpgroup hand-off; correct by PTX), mbarrier (lanes read,
// __syncwarp, lane 0 arrives, the writer waits on the phase; correct by PTX). A tool that
// follows a protocol reports 0 hazards for it. tools/sanitize.py --probes runs all four;
// docs/reliability.md has what they gave.
#include <cstdint>
#include <cstdio>
#include <cstring>

enum Mode { kSync, kNone, kArrive, kMbarrier };

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

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  float* out;
  cudaMalloc(&out, 4 * 256 * sizeof(float));
  if (!strcmp(mode, "sync")) named_barrier_handoff<kSync><<<4, 256>>>(out, 16);
  else if (!strcmp(mode, "none")) named_barrier_handoff<kNone><<<4, 256>>>(out, 16);
  else if (!strcmp(mode, "arrive")) named_barrier_handoff<kArrive><<<4, 256>>>(out, 16);
  else if (!strcmp(mode, "mbarrier")) mbarrier_handoff<<<1, 64>>>(out);
  else {
    fprintf(stderr, "MODE: expected sync, none, arrive or mbarrier, got '%s'\n", mode);
    return 2;
  }
  const cudaError_t e = cudaDeviceSynchronize();
  printf("%s: %s\n", mode, cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
