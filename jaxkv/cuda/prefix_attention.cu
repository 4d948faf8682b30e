// Prefix attention (Hopper): every query attends to the keys [0, kv_len) of its buffer, bf16,
// head_dim 64. The same contract and float32 reference as the Mosaic GPU kernel
// in kernels/prefix_attention.py, which holds the shapes, splits and the log-sum-exp merge; this one is
// reached from jitted JAX through jax.ffi (kernels.prefix_attention_cuda) and from PyTorch
// through ctypes on torch's stream (torch_bridge.kernels.prefix_attention), so the drop-in
// manager attends the visible prefix of jaxkv's buffers with no JAX dispatch in between.
//
// Design (FlashAttention-3's warp specialization): one CTA of 3 warpgroups (FP8: 4) per (128
// queries, query head, key split).
//   * a producer warpgroup streams K and V blocks of kBlockKV rows into a ring of kStages
//     shared-memory stages by cp.async (rows at or past the length are zero-filled, so nothing
//     past the prefix is read), each stage's arrival counted on an mbarrier; it gives its
//     registers to the other two (setmaxnreg);
//   * two consumer warpgroups own 64 queries each: S = Q K^T by wgmma (Q and K straight from shared
//     memory, 128-byte swizzle), the online softmax in registers (base 2), then O += P V by
//     wgmma with P from registers (the accumulator layout is wgmma's A layout) and V read
//     N-major (transposed) from the same swizzled tile. The two alternate on the tensor cores
//     (named barriers "turn"): a turn issues block i's Q K^T with block i-1's P V, so one
//     warpgroup's softmax overlaps the other's matrix products.
// Only the last block of a split is masked. Deterministic: a fixed order of every sum.
// sm_90a only (wgmma, setmaxnreg); the launcher refuses other devices.
//
// FP8 storage (jaxkv.formats.quantize_fp8_rows: E4M3 codes, one bf16 scale per row and head):
// two producer warpgroups cp.async a block's codes and scales into a ring of kRaw raw stages (half
// a bf16 block's bytes), then decode them (integer ops and bf16 multiplies, codes.cuh) into the same
// swizzled bf16 stages the consumers read, so the consumers are the bf16 kernel's. Each producer
// thread decodes exactly the bytes it copied: its own cp.async.wait_group orders the two, no
// barrier. A decoded value is bf16(code * scale), one rounding, as dequantize_fp8_rows rounds
// to bf16 (docs/kernels/frame_cache_fp8.md).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "ptx.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {
namespace {

constexpr int kD = 64;           // head dim: one 128-byte swizzle row per key
constexpr int kBQ = 64;          // queries per consumer warpgroup (the wgmma M)
// 2 consumer warpgroups, then the producer warpgroups: one for bf16 (its copies are cp.async),
// kFp8Producers for FP8, whose decode in registers bounded one producer (frame_cache_fp8.md)
#ifndef JAXKV_FP8_PRODUCERS  // a build knob (-DJAXKV_FP8_PRODUCERS=1 or 2)
#define JAXKV_FP8_PRODUCERS 2
#endif
constexpr int kFp8Producers = JAXKV_FP8_PRODUCERS;
static_assert(kFp8Producers == 1 || kFp8Producers == 2, "JAXKV_FP8_PRODUCERS: 1 or 2 warpgroups");
template <bool kFp8>
__host__ __device__ constexpr int producers() {
  return kFp8 ? kFp8Producers : 1;
}
template <bool kFp8>
__host__ __device__ constexpr int threads() {
  return 128 * (2 + producers<kFp8>());
}
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kQBytes = kBQ * kD * 2;  // one warpgroup's Q tile
constexpr int kRaw = 2;                // FP8: raw (code + scale) stages in flight

// The launch shapes built: (keys per stage, stages in flight); the caller picks one by its
// launch table (docs/kernels/launch.md, "prefix_attention_cuda").
// FP8 raw stage: K codes, V codes (kBlockKV x 64 bytes each), then K and V scale words (one
// 4-byte copy per (row, chunk) thread: the aligned pair holding the row's bf16 scale)
template <int kBlockKV>
__host__ __device__ constexpr int raw_bytes() {
  return 2 * kBlockKV * kD + 2 * kBlockKV * 16;
}
template <int kBlockKV, int kStages, bool kFp8>
constexpr int smem_bytes() {
  return 1024 + 2 * kQBytes + 2 * kStages * kBlockKV * kD * 2 + (kFp8 ? kRaw * raw_bytes<kBlockKV>() : 0) +
         4 * kStages * 8;
}

struct PrefixArgs {
  const __nv_bfloat16* q;  // bf16[B, Tq, Hq, 64] (row and batch strides below)
  const void* k;           // bf16[B, T, H, 64], or FP8 E4M3 codes u8[B, T, H, 64] (k_scale set)
  const void* v;           // likewise
  const __nv_bfloat16* k_scale;  // FP8: bf16[B, T, H] (strides s_batch, s_row); bf16 storage: null
  const __nv_bfloat16* v_scale;
  const int32_t* kv_len;   // i32[B] on the device, or null: every entry has kv_len_value
  int32_t kv_len_value;
  __nv_bfloat16* out;      // bf16[B, Tq, Hq, 64] contiguous (splits == 1)
  float* part;             // f32[B * splits, Tq, Hq, 64] normalized partials (splits > 1)
  float* lse;              // f32[B * splits, Hq, Tq] base-2 log-sum-exp; -inf: no keys (splits > 1)
  int64_t q_batch, q_row, kv_batch, kv_row;  // strides in elements; heads are 64 apart
  int64_t s_batch, s_row;  // FP8 scales' strides in elements; heads are 1 apart
  int32_t Tq, T, H, Hq, splits, chunk;
  float c;                 // softmax scale * log2(e)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXKV_PREFIX_SM90 1
// registers per thread after setmaxnreg: 128 x producers x 40 + 256 x consumer <= 64 K
constexpr int kProducerRegs = 40;
template <bool kFp8>
__host__ __device__ constexpr int consumer_regs() {
  return producers<kFp8>() == 1 ? 232 : 216;
}
constexpr int kTurn0 = 1, kTurn1 = 2, kQReady0 = 3;  // named barriers (0 is __syncthreads)
#endif

#ifdef JAXKV_PREFIX_SM90
// The FP8 producers (file comment): producer thread t of kN copies, then decodes, 16-byte code
// chunk t % 4 of rows t / 4 + kN / 4 j of each block, and the scale word of those rows.
template <int kBlockKV, int kStages>
__device__ __forceinline__ void produce_fp8(const PrefixArgs& a, uint8_t* Ks, uint8_t* Vs, uint8_t* raw, uint32_t k_full,
                                            uint32_t v_full, uint32_t k_free, uint32_t v_free, int b, int kvh,
                                            int start, int length, int steps, int t) {
  constexpr int kN = 128 * kFp8Producers, kStride = kN / 4;  // producer threads; rows between a thread's rows
  constexpr int kKVBytes = kBlockKV * kD * 2, kRows = kBlockKV / kStride, kCodes = kBlockKV * kD;
  static_assert(kBlockKV % kStride == 0, "a block's rows split evenly over the producer threads");
  const int r0 = t >> 2, ch = t & 3;
  const uint8_t* kc = static_cast<const uint8_t*>(a.k) + b * a.kv_batch + int64_t(start + r0) * a.kv_row + kvh * kD + ch * 16;
  const uint8_t* vc = static_cast<const uint8_t*>(a.v) + (kc - static_cast<const uint8_t*>(a.k));
  const int64_t s0 = b * a.s_batch + int64_t(start + r0) * a.s_row + kvh;  // scale element of row r0
  auto issue = [&](int i) {  // block i's codes and scales -> raw stage i % kRaw (then a commit, always)
    if (i < steps) {
      const uint32_t st = smem_addr(raw + (i % kRaw) * raw_bytes<kBlockKV>());
      const int left = length - i * kBlockKV - r0;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const bool ok = kStride * j < left;  // rows past the prefix are zero-filled: code 0, scale 0
        const int64_t row = ok ? int64_t(i) * kBlockKV + kStride * j : 0;
        const int r = r0 + kStride * j;
        cp_async<16>(st + r * kD + ch * 16, kc + row * a.kv_row, ok);
        cp_async<16>(st + kCodes + r * kD + ch * 16, vc + row * a.kv_row, ok);
        const int64_t e = (s0 + row * a.s_row) & ~int64_t(1);  // the aligned pair (T is even: in bounds)
        cp_async<4>(st + 2 * kCodes + (r * 4 + ch) * 4, a.k_scale + e, ok);
        cp_async<4>(st + 2 * kCodes + kBlockKV * 16 + (r * 4 + ch) * 4, a.v_scale + e, ok);
      }
    }
    cp_async_commit();
  };
  // one block's K or V codes in raw stage ``st`` -> the swizzled bf16 stage ``dst``
  auto decode = [&](int i, const uint8_t* codes, const uint32_t* scales, uint8_t* dst) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = r0 + kStride * j;
      const uint4 w = *reinterpret_cast<const uint4*>(codes + r * kD + ch * 16);
      const uint32_t pair = scales[r * 4 + ch];
      const bool hi = (s0 + (int64_t(i) * kBlockKV + kStride * j) * a.s_row) & 1;
      const uint32_t h = hi ? pair >> 16 : pair & 0xFFFFu, s2 = h | (h << 16);
      const uint32_t x[4] = {w.x, w.y, w.z, w.w};
      uint32_t o[8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        o[2 * u] = bf16x2_mul(e4m3x2_to_bf16x2(x[u], 0x1404), s2);
        o[2 * u + 1] = bf16x2_mul(e4m3x2_to_bf16x2(x[u], 0x3424), s2);
      }
      *reinterpret_cast<uint4*>(dst + swz(r, 2 * ch)) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(dst + swz(r, 2 * ch + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
    }
    fence_async_smem();
  };
#pragma unroll
  for (int i = 0; i < kRaw; ++i) issue(i);
  for (int i = 0; i < steps; ++i) {
    const int s = i % kStages;
    const uint32_t parity = ((i / kStages) & 1) ^ 1;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kRaw - 1) : "memory");  // block i's raw stage landed
    const uint8_t* st = raw + (i % kRaw) * raw_bytes<kBlockKV>();
    const uint32_t* sc = reinterpret_cast<const uint32_t*>(st + 2 * kCodes);
    mbar_wait(k_free + 8 * s, parity);
    decode(i, st, sc, Ks + s * kKVBytes);
    mbar_arrive(k_full + 8 * s);
    mbar_wait(v_free + 8 * s, parity);
    decode(i, st + kCodes, sc + kBlockKV * 4, Vs + s * kKVBytes);
    mbar_arrive(v_full + 8 * s);
    issue(i + kRaw);  // into the stage just decoded: this thread read only its own copies
  }
  cp_async_wait_all();
}
#endif

template <int kBlockKV, int kStages, bool kFp8>
__global__ void __launch_bounds__(threads<kFp8>(), 1) prefix_attention_kernel(const __grid_constant__ PrefixArgs a) {
#ifdef JAXKV_PREFIX_SM90
  constexpr int kKVBytes = kBlockKV * kD * 2;  // one K or V stage
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* Qs = base;                          // bf16[2][64, 64] swizzled, a tile per consumer
  uint8_t* Ks = Qs + 2 * kQBytes;              // bf16[stages][kBlockKV, 64] swizzled
  uint8_t* Vs = Ks + kStages * kKVBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(Vs + kStages * kKVBytes);
  const uint32_t k_full = smem_addr(bars), v_full = k_full + 8 * kStages;
  const uint32_t k_free = v_full + 8 * kStages, v_free = k_free + 8 * kStages;

  const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;  // wg 2 (and 3): the producers
  const int head = blockIdx.y, b = blockIdx.z / a.splits, split = blockIdx.z % a.splits;
  const int start = split * a.chunk;
  const int visible = max(0, min(a.kv_len ? __ldg(a.kv_len + b) : a.kv_len_value, a.T));  // no overflow below
  const int length = max(0, min(visible - start, a.chunk));
  const int steps = (length + kBlockKV - 1) / kBlockKV;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full + 8 * s, 128 * producers<kFp8>());
      mbar_init(v_full + 8 * s, 128 * producers<kFp8>());
      mbar_init(k_free + 8 * s, 256);
      mbar_init(v_free + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg >= 2) {  // the producers: K and V blocks into the ring
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if constexpr (kFp8) {
      produce_fp8<kBlockKV, kStages>(a, Ks, Vs, reinterpret_cast<uint8_t*>(bars) + 4 * kStages * 8, k_full, v_full,
                                     k_free, v_free, b, head / (a.Hq / a.H), start, length, steps, threadIdx.x - 256);
      return;
    }
    // thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 j of each block
    const int kvh = head / (a.Hq / a.H), r0 = t >> 3, ch = t & 7;
    const int64_t off = b * a.kv_batch + int64_t(start + r0) * a.kv_row + kvh * kD + ch * 8;
    const char* kp = reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(a.k) + off);
    const char* vp = reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(a.v) + off);
    const int64_t step = 16 * a.kv_row * 2;  // bytes between a thread's rows
    const uint32_t dst0 = r0 * 128 + (((ch ^ r0) & 7) << 4);
    for (int i = 0; i < steps; ++i) {
      const int s = i % kStages;
      const uint32_t parity = ((i / kStages) & 1) ^ 1;
      const int left = length - i * kBlockKV - r0;  // this thread's rows j < ceil(left / 16) are keys
      mbar_wait(k_free + 8 * s, parity);
      const uint32_t kd = smem_addr(Ks + s * kKVBytes) + dst0, vd = smem_addr(Vs + s * kKVBytes) + dst0;
#pragma unroll
      for (int j = 0; j < kBlockKV / 16; ++j) cp_async<16>(kd + j * 2048, kp + (16 * j < left ? j * step : 0), 16 * j < left);
      mbar_arrive_cp_async(k_full + 8 * s);
      mbar_wait(v_free + 8 * s, parity);
#pragma unroll
      for (int j = 0; j < kBlockKV / 16; ++j) cp_async<16>(vd + j * 2048, vp + (16 * j < left ? j * step : 0), 16 * j < left);
      mbar_arrive_cp_async(v_full + 8 * s);
      kp += kBlockKV / 16 * step;
      vp += kBlockKV / 16 * step;
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(consumer_regs<kFp8>()));
  const int c = wg, warp = t >> 5, lane = t & 31;
  const int q0 = blockIdx.x * (2 * kBQ) + c * kBQ;  // this warpgroup's first query
  uint8_t* Q = Qs + c * kQBytes;
  {  // Q -> shared (rows past Tq are zeros)
    const __nv_bfloat16* qb = a.q + b * a.q_batch + head * kD;
#pragma unroll
    for (int j = 0; j < kBQ * 8 / 128; ++j) {
      const int idx = t + 128 * j, r = idx >> 3, ch = idx & 7;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (q0 + r < a.Tq) x = *reinterpret_cast<const uint4*>(qb + int64_t(q0 + r) * a.q_row + ch * 8);
      *reinterpret_cast<uint4*>(Q + swz(r, ch)) = x;
    }
    fence_async_smem();
    bar_sync(kQReady0 + c, 128);
  }
  const uint64_t q_desc = wgmma_desc(smem_addr(Q));

  float O[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) O[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int mine = c == 0 ? kTurn0 : kTurn1, other = c == 0 ? kTurn1 : kTurn0;
  if (c == 1) bar_arrive(kTurn0, 256);  // the first consumer takes the tensor cores first

  // Per turn on the tensor cores a warpgroup issues S(i) = Q K(i)^T and O += P(i-1) V(i-1)
  // together, then hands the turn over and runs block i's softmax while the other warpgroup's
  // products run (FlashAttention-3's schedule): a turn per block, plus one for the last P V.
  float S[kBlockKV / 2];
  uint32_t P[kBlockKV / 16][4];
  for (int i = 0; i <= steps; ++i) {
    const bool qk = i < steps, pv = i > 0;
    const int s = i % kStages, sp = (i + kStages - 1) % kStages;
    if (qk) {
      mbar_wait(k_full + 8 * s, (i / kStages) & 1);
      fence_async_smem();
    }
    if (pv) {
      mbar_wait(v_full + 8 * sp, ((i - 1) / kStages) & 1);
      fence_async_smem();
    }
    bar_sync(mine, 256);
    wgmma_fence();
    if (qk) {
      const uint64_t k_desc = wgmma_desc(smem_addr(Ks + s * kKVBytes));
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) wgmma_ss(S, q_desc + 2 * kk, k_desc + 2 * kk, kk > 0);
    }
    if (pv) {
      const uint32_t v_s = smem_addr(Vs + sp * kKVBytes);
#pragma unroll
      for (int kc = 0; kc < kBlockKV / 16; ++kc) wgmma_rs(O, P[kc], wgmma_desc(v_s + kc * 2048));
    }
    wgmma_commit();
    bar_arrive(other, 256);  // the other warpgroup's products queue behind these
    wgmma_wait();
    if (qk) mbar_arrive(k_free + 8 * s);
    if (pv) mbar_arrive(v_free + 8 * sp);
    if (!qk) break;

    const int left = length - i * kBlockKV;  // keys of this block inside the prefix
    if (left < kBlockKV) {
#pragma unroll
      for (int j = 0; j < kBlockKV / 8; ++j) {
        const int col = 8 * j + 2 * (lane & 3);
        if (col >= left) S[4 * j] = S[4 * j + 2] = -INFINITY;
        if (col + 1 >= left) S[4 * j + 1] = S[4 * j + 3] = -INFINITY;
      }
    }
    float alpha[2];
    softmax_block<kBlockKV / 8>(S, a.c, m, l, P, alpha);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      O[4 * j] *= alpha[0];
      O[4 * j + 1] *= alpha[0];
      O[4 * j + 2] *= alpha[1];
      O[4 * j + 3] *= alpha[1];
    }
  }
  if (c == 0) bar_sync(kTurn0, 256);  // the second consumer's last hand-over

  // epilogue: each row's sum over its 4 lanes; out = O / l (zeros where no key)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  const int col = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = q0 + 16 * warp + (lane >> 2) + 8 * h;
    if (q >= a.Tq) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    if (a.splits == 1) {
      __nv_bfloat16* o = a.out + ((int64_t(b) * a.Tq + q) * a.Hq + head) * kD + col;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<uint32_t*>(o + 8 * j) = pack_bf16(O[4 * j + 2 * h] * inv, O[4 * j + 2 * h + 1] * inv);
    } else {
      float* o = a.part + ((int64_t(blockIdx.z) * a.Tq + q) * a.Hq + head) * kD + col;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float2*>(o + 8 * j) = make_float2(O[4 * j + 2 * h] * inv, O[4 * j + 2 * h + 1] * inv);
      if ((lane & 3) == 0)
        a.lse[(int64_t(blockIdx.z) * a.Hq + head) * a.Tq + q] = l[h] > 0.f ? m[h] + __log2f(l[h]) : -INFINITY;
    }
  }
#else
  __trap();  // the launcher refuses devices other than sm_90
#endif
}

// out[b, q, h] = sum over splits of 2^(lse_s - lse_max) part_s / sum of the same weights
__global__ void merge_kernel(const float* part, const float* lse, __nv_bfloat16* out, int32_t splits, int32_t Tq,
                             int32_t Hq) {
  const int64_t row = blockIdx.x;  // (b * Tq + q) * Hq + h
  const int h = row % Hq, q = (row / Hq) % Tq;
  const int64_t b = row / (int64_t(Hq) * Tq);
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse[((b * splits + s) * Hq + h) * Tq + q]);
  float acc = 0.f, den = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ls = lse[((b * splits + s) * Hq + h) * Tq + q];
    const float w = ls == -INFINITY ? 0.f : exp2f(ls - mx);
    acc += w * part[(((b * splits + s) * Tq + q) * Hq + h) * kD + threadIdx.x];
    den += w;
  }
  out[row * kD + threadIdx.x] = __float2bfloat16_rn(den > 0.f ? acc / den : 0.f);
}

template <int kBlockKV, int kStages, bool kFp8>
void start_as(dim3 ctas, cudaStream_t stream, const PrefixArgs& a) {
  constexpr int smem = smem_bytes<kBlockKV, kStages, kFp8>();
  // per launch, not once: the attribute belongs to the current device's context
  cudaFuncSetAttribute(prefix_attention_kernel<kBlockKV, kStages, kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       smem);
  prefix_attention_kernel<kBlockKV, kStages, kFp8><<<ctas, threads<kFp8>(), smem, stream>>>(a);
}
template <int kBlockKV, int kStages>
void start(dim3 ctas, cudaStream_t stream, const PrefixArgs& a) {
  if (a.k_scale)
    start_as<kBlockKV, kStages, true>(ctas, stream, a);
  else
    start_as<kBlockKV, kStages, false>(ctas, stream, a);
}

// Shared by the FFI handler and the C entry point: checks, then the launches. block_kv and
// stages pick a built launch shape (128 x 2, 128 x 4, 192 x 2, 192 x 3); another is cudaErrorInvalidValue.
int launch_prefix_attention(cudaStream_t stream, PrefixArgs a, int64_t B, int block_kv, int stages) {
  if (B < 0 || a.Tq < 0 || a.T < 0 || a.H < 1 || a.Hq < 1 || a.Hq % a.H || a.splits < 1) return cudaErrorInvalidValue;
  if (a.splits > 1 && (a.part == nullptr || a.lse == nullptr)) return cudaErrorInvalidValue;
  if ((a.k_scale == nullptr) != (a.v_scale == nullptr) || (a.k_scale && a.T % 2)) return cudaErrorInvalidValue;
  if (!on_hopper()) return cudaErrorNotSupported;
  if (B == 0 || a.Tq == 0) return cudaSuccess;
  a.chunk = (a.T + a.splits - 1) / a.splits;
  const dim3 ctas((a.Tq + 2 * kBQ - 1) / (2 * kBQ), a.Hq, static_cast<unsigned>(B * a.splits));
  if (block_kv == 128 && stages == 2)
    start<128, 2>(ctas, stream, a);
  else if (block_kv == 128 && stages == 4)
    start<128, 4>(ctas, stream, a);
  else if (block_kv == 192 && stages == 2)
    start<192, 2>(ctas, stream, a);
  else if (block_kv == 192 && stages == 3)
    start<192, 3>(ctas, stream, a);
  else
    return cudaErrorInvalidValue;
  if (a.splits > 1)
    merge_kernel<<<static_cast<unsigned>(B * a.Tq * a.Hq), kD, 0, stream>>>(a.part, a.lse, a.out, a.splits, a.Tq,
                                                                            a.Hq);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

namespace ffi = xla::ffi;

// The FFI handlers' common part: shapes checked, args filled, the launch. k_scale / v_scale:
// FP8 storage's scales, or null.
template <typename Q, typename KV>
static ffi::Error run_prefix(cudaStream_t stream, const Q& q, const KV& k, const KV& v, const void* k_scale,
                             const void* v_scale, ffi::Buffer<ffi::S32, 1> kv_len, ffi::ResultBuffer<ffi::BF16, 4> out,
                             ffi::ResultBuffer<ffi::F32, 4> part, ffi::ResultBuffer<ffi::F32, 3> lse, int32_t splits,
                             float scale, int32_t block_kv, int32_t stages) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int64_t B = qd[0];
  bool same = true;
  for (int i = 0; i < 4; ++i) same &= vd[i] == kd[i];
  if (qd[3] != kD || kd[3] != kD || kd[0] != B || !same)
    return ffi::Error::InvalidArgument("q, k, v: expected bf16[B, Tq, Hq, 64] and two [B, T, H, 64]");
  if (kv_len.dimensions()[0] != B) return ffi::Error::InvalidArgument("kv_len: expected i32[B]");
  if (splits > 1 && (part->dimensions()[0] != B * splits || lse->dimensions()[0] != B * splits))
    return ffi::Error::InvalidArgument("part, lse: expected f32[B * splits, Tq, Hq, 64] and f32[B * splits, Hq, Tq]");
  PrefixArgs a{};
  a.q = reinterpret_cast<const __nv_bfloat16*>(q.untyped_data());
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.k_scale = static_cast<const __nv_bfloat16*>(k_scale);
  a.v_scale = static_cast<const __nv_bfloat16*>(v_scale);
  a.kv_len = kv_len.typed_data();
  a.out = reinterpret_cast<__nv_bfloat16*>(out->untyped_data());
  a.part = part->typed_data();
  a.lse = lse->typed_data();
  a.Tq = static_cast<int32_t>(qd[1]);
  a.Hq = static_cast<int32_t>(qd[2]);
  a.T = static_cast<int32_t>(kd[1]);
  a.H = static_cast<int32_t>(kd[2]);
  a.q_row = qd[2] * kD;
  a.q_batch = qd[1] * a.q_row;
  a.kv_row = kd[2] * kD;
  a.kv_batch = kd[1] * a.kv_row;
  a.s_row = kd[2];
  a.s_batch = kd[1] * a.s_row;
  a.splits = splits;
  a.c = scale * kLog2e;
  const int e = launch_prefix_attention(stream, a, B, block_kv, stages);
  if (e == cudaErrorNotSupported) return ffi::Error::InvalidArgument("prefix_attention_cuda: needs an sm_90 GPU");
  if (e == cudaErrorInvalidValue) return ffi::Error::InvalidArgument("prefix_attention_cuda: bad shapes or splits");
  return launch_status(static_cast<cudaError_t>(e), "prefix_attention");
}

static ffi::Error prefix_attention_handler(cudaStream_t stream, ffi::Buffer<ffi::BF16, 4> q, ffi::Buffer<ffi::BF16, 4> k,
                                           ffi::Buffer<ffi::BF16, 4> v, ffi::Buffer<ffi::S32, 1> kv_len,
                                           ffi::ResultBuffer<ffi::BF16, 4> out, ffi::ResultBuffer<ffi::F32, 4> part,
                                           ffi::ResultBuffer<ffi::F32, 3> lse, int32_t splits, float scale,
                                           int32_t block_kv, int32_t stages) {
  return run_prefix(stream, q, k, v, nullptr, nullptr, kv_len, out, part, lse, splits, scale, block_kv, stages);
}

static ffi::Error prefix_attention_fp8_handler(cudaStream_t stream, ffi::Buffer<ffi::BF16, 4> q,
                                               ffi::Buffer<ffi::U8, 4> k, ffi::Buffer<ffi::U8, 4> v,
                                               ffi::Buffer<ffi::BF16, 3> k_scale, ffi::Buffer<ffi::BF16, 3> v_scale,
                                               ffi::Buffer<ffi::S32, 1> kv_len, ffi::ResultBuffer<ffi::BF16, 4> out,
                                               ffi::ResultBuffer<ffi::F32, 4> part, ffi::ResultBuffer<ffi::F32, 3> lse,
                                               int32_t splits, float scale, int32_t block_kv, int32_t stages) {
  const auto kd = k.dimensions(), ks = k_scale.dimensions(), vs = v_scale.dimensions();
  for (int i = 0; i < 3; ++i)
    if (ks[i] != kd[i] || vs[i] != kd[i])
      return ffi::Error::InvalidArgument("k_scale, v_scale: expected bf16[B, T, H], k's leading dimensions");
  return run_prefix(stream, q, k, v, k_scale.untyped_data(), v_scale.untyped_data(), kv_len, out, part, lse, splits,
                    scale, block_kv, stages);
}

}  // namespace jaxkv

namespace jaxkv::prefix_types {  // buffer types without commas, so they can sit inside the macro
using Act = xla::ffi::Buffer<xla::ffi::BF16, 4>;
using Codes = xla::ffi::Buffer<xla::ffi::U8, 4>;  // FP8 E4M3 codes, bitcast to bytes
using Scales = xla::ffi::Buffer<xla::ffi::BF16, 3>;
using Len = xla::ffi::Buffer<xla::ffi::S32, 1>;
using Part = xla::ffi::Buffer<xla::ffi::F32, 4>;
using Lse = xla::ffi::Buffer<xla::ffi::F32, 3>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::prefix_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPrefixAttention, jaxkv::prefix_attention_handler,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::prefix_types::Stream>()
                                  .Arg<jaxkv::prefix_types::Act>()  // q bf16[B, Tq, Hq, 64]
                                  .Arg<jaxkv::prefix_types::Act>()  // k bf16[B, T, H, 64]
                                  .Arg<jaxkv::prefix_types::Act>()  // v
                                  .Arg<jaxkv::prefix_types::Len>()  // kv_len i32[B]
                                  .Ret<jaxkv::prefix_types::Act>()  // out bf16[B, Tq, Hq, 64]
                                  .Ret<jaxkv::prefix_types::Part>() // f32[B * splits, Tq, Hq, 64] (splits > 1)
                                  .Ret<jaxkv::prefix_types::Lse>()  // f32[B * splits, Hq, Tq] (splits > 1)
                                  .Attr<int32_t>("splits")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("block_kv")
                                  .Attr<int32_t>("stages"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPrefixAttentionFp8, jaxkv::prefix_attention_fp8_handler,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::prefix_types::Stream>()
                                  .Arg<jaxkv::prefix_types::Act>()     // q bf16[B, Tq, Hq, 64]
                                  .Arg<jaxkv::prefix_types::Codes>()   // k: FP8 codes u8[B, T, H, 64]
                                  .Arg<jaxkv::prefix_types::Codes>()   // v
                                  .Arg<jaxkv::prefix_types::Scales>()  // k_scale bf16[B, T, H]
                                  .Arg<jaxkv::prefix_types::Scales>()  // v_scale
                                  .Arg<jaxkv::prefix_types::Len>()     // kv_len i32[B]
                                  .Ret<jaxkv::prefix_types::Act>()     // out bf16[B, Tq, Hq, 64]
                                  .Ret<jaxkv::prefix_types::Part>()
                                  .Ret<jaxkv::prefix_types::Lse>()
                                  .Attr<int32_t>("splits")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("block_kv")
                                  .Attr<int32_t>("stages"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

extern "C" {

// PyTorch's entry (torch_bridge.kernels.prefix_attention), on ``stream``. q: bf16 [B, Tq, Hq, 64]
// with heads contiguous (strides q_batch, q_row in elements); k, v: bf16 [B, T, H, 64] likewise
// (kv_batch, kv_row); kv_len: i32[B] on the device, or null and every entry sees kv_len_value
// keys; out: bf16[B, Tq, Hq, 64] contiguous; part / lse: f32 workspaces of B * splits * Tq * Hq
// * 64 and B * splits * Hq * Tq floats (splits > 1; else null); block_kv, stages: a built launch
// shape. Returns a cudaError_t:
// 1 (cudaErrorInvalidValue) for bad sizes, 801 (cudaErrorNotSupported) off sm_90.
// jaxkv_prefix_attention_fp8: the same on FP8 storage, k / v its E4M3 codes (u8, same strides)
// and k_scale / v_scale its bf16[B, T, H] scales (strides s_batch, s_row; T even); with null
// scales, bf16 K/V as jaxkv_prefix_attention (below) passes them.
int jaxkv_prefix_attention_fp8(void* stream, const void* q, const void* k, const void* v, const void* k_scale,
                               const void* v_scale, const int32_t* kv_len, int32_t kv_len_value, void* out, float* part,
                               float* lse, int64_t B, int32_t Tq, int32_t Hq, int32_t T, int32_t H, int64_t q_batch,
                               int64_t q_row, int64_t kv_batch, int64_t kv_row, int64_t s_batch, int64_t s_row,
                               int32_t splits, float scale, int32_t block_kv, int32_t stages) {
  jaxkv::PrefixArgs a{};
  a.q = static_cast<const __nv_bfloat16*>(q);
  a.k = k;
  a.v = v;
  a.k_scale = static_cast<const __nv_bfloat16*>(k_scale);
  a.v_scale = static_cast<const __nv_bfloat16*>(v_scale);
  a.s_batch = s_batch;
  a.s_row = s_row;
  a.kv_len = kv_len;
  a.kv_len_value = kv_len_value;
  a.out = static_cast<__nv_bfloat16*>(out);
  a.part = part;
  a.lse = lse;
  a.Tq = Tq;
  a.Hq = Hq;
  a.T = T;
  a.H = H;
  a.q_batch = q_batch;
  a.q_row = q_row;
  a.kv_batch = kv_batch;
  a.kv_row = kv_row;
  a.splits = splits;
  a.c = scale * jaxkv::kLog2e;
  return jaxkv::launch_prefix_attention(static_cast<cudaStream_t>(stream), a, B, block_kv, stages);
}

int jaxkv_prefix_attention(void* stream, const void* q, const void* k, const void* v, const int32_t* kv_len,
                           int32_t kv_len_value, void* out, float* part, float* lse, int64_t B, int32_t Tq, int32_t Hq,
                           int32_t T, int32_t H, int64_t q_batch, int64_t q_row, int64_t kv_batch, int64_t kv_row,
                           int32_t splits, float scale, int32_t block_kv, int32_t stages) {
  return jaxkv_prefix_attention_fp8(stream, q, k, v, nullptr, nullptr, kv_len, kv_len_value, out, part, lse, B, Tq, Hq,
                                    T, H, q_batch, q_row, kv_batch, kv_row, 0, 0, splits, scale, block_kv, stages);
}

}  // extern "C"
