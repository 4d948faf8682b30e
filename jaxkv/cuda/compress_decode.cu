// Fused decode compressor: a CSA / HCA layer's whole per-token cache update in one launch.
//
// One CTA (128 threads) per request of a decode step (one token each): fold the token's
// compressor inputs into the request's running-softmax tail (thread t: main channels
// [4t, 4t + 4), the indexer's channel t); where the token completes a window, pool it (a +
// previous-b streams for CSA), RMSNorm, RoPE on the last 64 dims at entry * ratio, the
// indexer key's Hadamard rotation, then one warp writes the entry and one the key
// (write_entry.cuh: FP8 entry bytes and FP4 key bytes of the storage family) through the
// block table, and the tail moves on (CSA a -> b rotation, HCA reset). A request whose flush
// finds no block gets `fault` (Fault.POOL_EXHAUSTED) in its error word; a token with a NaN or
// Inf in any of its inputs changes nothing and its request gets `nonfinite` (Fault.NONFINITE_KV):
// hybrid.compress's rule, which the XLA path applies with a reduction and a scatter of its own.
//
// The math is jaxkv.math.compressor's, operation for operation, in float32 without
// contractions (every multiply and add rounded on its own, as XLA computes the reference
// hybrid.compress(impl="xla")); the sums of RMSNorm are a tree here, so an entry can differ
// from the reference's in its last bit where the float32 value sits on a bf16 rounding
// boundary. exp, rsqrt, sin and cos are CUDA's.
//
// Reached through jax.ffi (jaxkv.kernels.compress_decode); tails, pools and the error
// words are aliased in place.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "write_entry.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

constexpr int kThreads = 128;  // one CTA per request
static_assert(kHeadDim == 4 * kThreads && kIndexDim == kThreads, "thread t holds main channels [4t, 4t+4), index t");

// kv, score, ikv, iscore may each be float32 or bfloat16: bit set = bfloat16
enum InputBits : uint32_t { kKvBf16 = 1, kScoreBf16 = 2, kIkvBf16 = 4, kIscoreBf16 = 8 };

struct CompressArgs {
  float* tails;          // f32[R, streams, 3, width]  this layer's tails (CSA 3 streams, width 640; HCA 1, 512)
  PoolView pools;        // this layer's entry pool (and the CSA key pool)
  uint32_t* error;       // u32[R + 1]
  const void* kv;        // float[B, coff * 512]  CSA: [:512] the b stream, [512:] the a stream
  const void* score;     // float[B, coff * 512]  Z without the bias
  const void* ikv;       // float[B, 256]  the indexer's, CSA only
  const void* iscore;    // float[B, 256]
  const float* bias;     // f32[ratio, coff * 512]
  const float* norm;     // f32[512]
  const float* ibias;    // f32[ratio, 256]
  const float* inorm;    // f32[128]
  const float* freqs;    // f32[32]  RoPE frequencies
  const int32_t* slot;        // i32[B]  the tail read
  const int32_t* write_slot;  // i32[B]  the tail written; outside [0, R): inactive
  const int32_t* start;       // i32[B]  the token's position
  const int32_t* num_tokens;  // i32[B]  0: inactive
  const int32_t* table;       // i32[R, max_blocks]
  int64_t R;
  int32_t max_blocks;
  int32_t ratio;
  float eps;
  uint32_t fault;      // Fault.POOL_EXHAUSTED
  uint32_t nonfinite;  // Fault.NONFINITE_KV
  uint32_t dtypes;     // InputBits
};

struct Triple {  // a stream's running softmax on one channel (compressor.py: M, S, A)
  float m, s, a;
};

__device__ __forceinline__ Triple fold(Triple x, float kv, float z) {  // compressor.fold_triple
  const float m = fmaxf(x.m, z);
  const float keep = expf(__fsub_rn(x.m, m)), w = expf(__fsub_rn(z, m));
  return {m, __fadd_rn(__fmul_rn(x.s, keep), w), __fadd_rn(__fmul_rn(x.a, keep), __fmul_rn(kv, w))};
}

__device__ __forceinline__ Triple combine(Triple x, Triple y) {  // compressor.combine_triples
  const float m = fmaxf(x.m, y.m);
  const float ex = expf(__fsub_rn(x.m, m)), ey = expf(__fsub_rn(y.m, m));
  return {m, __fadd_rn(__fmul_rn(x.s, ex), __fmul_rn(y.s, ey)), __fadd_rn(__fmul_rn(x.a, ex), __fmul_rn(y.a, ey))};
}

__device__ __forceinline__ bool is_nonfinite(float x) { return word_nonfinite(__float_as_uint(x), kWordF32); }

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ void load4(const void* base, int64_t i, bool bf16, float (&out)[4]) {
  if (bf16) {
    const uint2 r = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + i);
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&r);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = __bfloat162float(h[k]);
  } else {
    const float4 r = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    out[0] = r.x, out[1] = r.y, out[2] = r.z, out[3] = r.w;
  }
}

__device__ __forceinline__ float load1(const void* base, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]) : static_cast<const float*>(base)[i];
}

// One stream's triples on channels [ch, ch + 4) / channel ch; width: the stream's row length.
__device__ __forceinline__ void load_triples(const float* stream, int width, int ch, Triple (&x)[4]) {
  float4 r[3];
#pragma unroll
  for (int c = 0; c < 3; ++c) r[c] = *reinterpret_cast<const float4*>(stream + c * width + ch);
  x[0] = {r[0].x, r[1].x, r[2].x}, x[1] = {r[0].y, r[1].y, r[2].y};
  x[2] = {r[0].z, r[1].z, r[2].z}, x[3] = {r[0].w, r[1].w, r[2].w};
}

__device__ __forceinline__ void store_triples(float* stream, int width, int ch, const Triple (&x)[4]) {
  *reinterpret_cast<float4*>(stream + ch) = make_float4(x[0].m, x[1].m, x[2].m, x[3].m);
  *reinterpret_cast<float4*>(stream + width + ch) = make_float4(x[0].s, x[1].s, x[2].s, x[3].s);
  *reinterpret_cast<float4*>(stream + 2 * width + ch) = make_float4(x[0].a, x[1].a, x[2].a, x[3].a);
}

__device__ __forceinline__ Triple load_triple(const float* stream, int width, int ch) {
  return {stream[ch], stream[width + ch], stream[2 * width + ch]};
}

__device__ __forceinline__ void store_triple(float* stream, int width, int ch, Triple x) {
  stream[ch] = x.m, stream[width + ch] = x.s, stream[2 * width + ch] = x.a;
}

// The sum of v over the CTA (all threads call it); sums: __shared__ f32[kThreads / 32].
__device__ __forceinline__ float cta_sum(float v, float* sums) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = v;
  __syncthreads();
  return __fadd_rn(__fadd_rn(sums[0], sums[1]), __fadd_rn(sums[2], sums[3]));
}

template <bool kCsa>
__global__ void __launch_bounds__(kThreads) compress_decode_kernel(CompressArgs a) {
  constexpr int kStreams = kCsa ? 3 : 1, kWidth = kCsa ? kHeadDim + kIndexDim : kHeadDim, kCoff = kCsa ? 2 : 1;
  constexpr int kStream = 3 * kWidth;  // floats per stream
  static_assert(kThreads / 32 == 4, "cta_sum adds four warps");
  __shared__ float sums[2][kThreads / 32];
  __shared__ float rot[kIndexDim];
  __shared__ __align__(16) __nv_bfloat16 entry[kHeadDim];
  __shared__ __align__(16) __nv_bfloat16 key[kIndexDim];

  const int b = blockIdx.x, t = threadIdx.x, lane = t % 32;
  const int32_t wslot = a.write_slot[b];
  if (a.num_tokens[b] <= 0 || wslot < 0 || wslot >= a.R) return;  // inactive (the whole CTA)
  const int32_t slot = min(max(a.slot[b], 0), static_cast<int32_t>(a.R - 1));
  const int32_t start = a.start[b];
  const int32_t fill = start % a.ratio, entry_index = start / a.ratio;
  const bool done = fill == a.ratio - 1;  // this token completes window entry_index
  const float* src = a.tails + static_cast<int64_t>(slot) * kStreams * kStream;
  float* dst = a.tails + static_cast<int64_t>(wslot) * kStreams * kStream;

  // ---- every load first, so the CTA waits for DRAM once -----------------------------------------
  const int ch = 4 * t;
  const int64_t row = static_cast<int64_t>(b) * kCoff * kHeadDim;
  const float* bias = a.bias + static_cast<int64_t>(fill) * kCoff * kHeadDim;
  constexpr int kA = kCsa ? kHeadDim : 0;  // the a stream's columns (CSA: after the b stream's)
  float kv_a[4], z_a[4], bias_a[4], kv_b[4], z_b[4], bias_b[4];
  Triple cur_a[4], cur_b[4], prev_b[4];
  load4(a.kv, row + kA + ch, a.dtypes & kKvBf16, kv_a);
  load4(a.score, row + kA + ch, a.dtypes & kScoreBf16, z_a);
  load4(bias, kA + ch, false, bias_a);
  load_triples(src, kWidth, ch, cur_a);
  const int32_t bs = a.pools.block_size;
  const int32_t blk = done ? a.table[static_cast<int64_t>(slot) * a.max_blocks +
                                     min(max(entry_index / bs, 0), a.max_blocks - 1)]
                           : -1;
  Triple icur_a{}, icur_b{}, iprev_b{};
  float ikv_a = 0.f, iz_a = 0.f, ikv_b = 0.f, iz_b = 0.f, ibias_a = 0.f, ibias_b = 0.f;
  const int ich = kHeadDim + t;  // the indexer's channel in the tail
  if (kCsa) {
    load4(a.kv, row + ch, a.dtypes & kKvBf16, kv_b);
    load4(a.score, row + ch, a.dtypes & kScoreBf16, z_b);
    load4(bias, ch, false, bias_b);
    load_triples(src + kStream, kWidth, ch, cur_b);
    const int64_t irow = static_cast<int64_t>(b) * 2 * kIndexDim;
    const float* ibias = a.ibias + static_cast<int64_t>(fill) * 2 * kIndexDim;
    ikv_a = load1(a.ikv, irow + kIndexDim + t, a.dtypes & kIkvBf16);
    iz_a = load1(a.iscore, irow + kIndexDim + t, a.dtypes & kIscoreBf16);
    ikv_b = load1(a.ikv, irow + t, a.dtypes & kIkvBf16);
    iz_b = load1(a.iscore, irow + t, a.dtypes & kIscoreBf16);
    ibias_a = ibias[kIndexDim + t], ibias_b = ibias[t];
    icur_a = load_triple(src, kWidth, ich);
    icur_b = load_triple(src + kStream, kWidth, ich);
    if (done) {
      load_triples(src + 2 * kStream, kWidth, ch, prev_b);
      iprev_b = load_triple(src + 2 * kStream, kWidth, ich);
    }
  }

  // ---- a NaN or Inf in the token's inputs: nothing written, the request flagged ---------------
  bool bad = false;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    bad |= is_nonfinite(kv_a[k]) | is_nonfinite(z_a[k]);
    if (kCsa) bad |= is_nonfinite(kv_b[k]) | is_nonfinite(z_b[k]);
  }
  if (kCsa) bad |= is_nonfinite(ikv_a) | is_nonfinite(iz_a) | is_nonfinite(ikv_b) | is_nonfinite(iz_b);
  if (__syncthreads_or(bad)) {
    if (t == 0) atomicOr(a.error + slot, a.nonfinite);
    return;
  }

  // ---- fold the token into the tail -------------------------------------------------------------
#pragma unroll
  for (int k = 0; k < 4; ++k) cur_a[k] = fold(cur_a[k], kv_a[k], __fadd_rn(z_a[k], bias_a[k]));
  if (kCsa) {
#pragma unroll
    for (int k = 0; k < 4; ++k) cur_b[k] = fold(cur_b[k], kv_b[k], __fadd_rn(z_b[k], bias_b[k]));
    icur_a = fold(icur_a, ikv_a, __fadd_rn(iz_a, ibias_a));
    icur_b = fold(icur_b, ikv_b, __fadd_rn(iz_b, ibias_b));
  }
  if (!done) {
    store_triples(dst, kWidth, ch, cur_a);
    if (kCsa) {
      store_triples(dst + kStream, kWidth, ch, cur_b);
      store_triple(dst, kWidth, ich, icur_a);
      store_triple(dst + kStream, kWidth, ich, icur_b);
    }
    return;
  }

  // ---- a window is complete: pool it, move the tail on ----------------------------------------
  Triple pooled[4];
  Triple ipooled = kCsa ? combine(icur_a, iprev_b) : Triple{};
#pragma unroll
  for (int k = 0; k < 4; ++k) pooled[k] = kCsa ? combine(cur_a[k], prev_b[k]) : cur_a[k];
  const Triple empty{-INFINITY, 0.f, 0.f};
  const Triple empties[4] = {empty, empty, empty, empty};
  store_triples(dst, kWidth, ch, empties);
  if (kCsa) {
    store_triples(dst + kStream, kWidth, ch, empties);
    store_triples(dst + 2 * kStream, kWidth, ch, cur_b);
    store_triple(dst, kWidth, ich, empty);
    store_triple(dst + kStream, kWidth, ich, empty);
    store_triple(dst + 2 * kStream, kWidth, ich, icur_b);
  }
  if (blk < 0 || blk >= a.pools.num_blocks) {  // no block for the entry: nothing written
    if (t == 0) atomicOr(a.error + slot, a.fault);
    return;
  }

  // ---- finalize (compressor.finalize): bf16 -> RMSNorm -> bf16 -> RoPE -> bf16 (-> Hadamard) ------
  float x[4];
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[k] = bf16r(__fdiv_rn(pooled[k].a, pooled[k].s));
    sq = __fadd_rn(sq, __fmul_rn(x[k], x[k]));
  }
  const float xi0 = kCsa ? bf16r(__fdiv_rn(ipooled.a, ipooled.s)) : 0.f;
  const float r = rsqrtf(__fadd_rn(__fmul_rn(cta_sum(sq, sums[0]), 1.f / kHeadDim), a.eps));
  const float ri = kCsa ? rsqrtf(__fadd_rn(__fmul_rn(cta_sum(__fmul_rn(xi0, xi0), sums[1]), 1.f / kIndexDim), a.eps))
                        : 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = bf16r(__fmul_rn(a.norm[ch + k], __fmul_rn(x[k], r)));
  const float pos = static_cast<float>(entry_index * a.ratio);
  if (ch >= kNope) {  // RoPE on the pairs (x[0], x[1]), (x[2], x[3])
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const float ang = __fmul_rn(pos, a.freqs[(ch - kNope) / 2 + p]);
      const float c = cosf(ang), s = sinf(ang), e = x[2 * p], o = x[2 * p + 1];
      x[2 * p] = bf16r(__fsub_rn(__fmul_rn(e, c), __fmul_rn(o, s)));
      x[2 * p + 1] = bf16r(__fadd_rn(__fmul_rn(e, s), __fmul_rn(o, c)));
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) entry[ch + k] = __float2bfloat16_rn(x[k]);
  if (kCsa) {
    float y = bf16r(__fmul_rn(a.inorm[t], __fmul_rn(xi0, ri)));
    const float other = __shfl_xor_sync(0xffffffffu, y, 1);  // the pair's other element
    if (t >= kIndexDim - (kHeadDim - kNope)) {  // the key's rope dims
      const float ang = __fmul_rn(pos, a.freqs[(t - (kIndexDim - (kHeadDim - kNope))) / 2]);
      const float c = cosf(ang), s = sinf(ang);
      const float e = t % 2 ? other : y, o = t % 2 ? y : other;
      y = bf16r(t % 2 ? __fadd_rn(__fmul_rn(e, s), __fmul_rn(o, c)) : __fsub_rn(__fmul_rn(e, c), __fmul_rn(o, s)));
    }
    // Hadamard (rotation.hadamard): butterflies on pairs (i, i + h) for h = 1, 2, .., 64, then / sqrt(128)
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
      const float p = __shfl_xor_sync(0xffffffffu, y, h);
      y = t & h ? __fsub_rn(p, y) : __fadd_rn(y, p);
    }
#pragma unroll
    for (int h = 32; h < kIndexDim; h <<= 1) {
      rot[t] = y;
      __syncthreads();
      const float p = rot[t ^ h];
      __syncthreads();
      y = t & h ? __fsub_rn(p, y) : __fadd_rn(y, p);
    }
    key[t] = __float2bfloat16_rn(__fmul_rn(y, static_cast<float>(0.08838834764831845)));  // float32(128 ** -0.5)
  }
  __syncthreads();

  // ---- write: warp 0 the entry, warp 1 the key ------------------------------------------------------
  const int sl = entry_index % bs;
  if (t < 32) {
    const uint4* e = reinterpret_cast<const uint4*>(entry) + 2 * lane;
    const uint4 raw[2] = {e[0], e[1]};
    write_entry(a.pools, raw, blk, sl, lane);
  } else if (kCsa && t < 64) {
    write_index_key(a.pools, reinterpret_cast<const uint2*>(key)[lane], blk, sl, lane);
  }
}

cudaError_t launch_compress_decode(cudaStream_t stream, const CompressArgs& a, int64_t B, bool csa) {
  if (B == 0) return cudaSuccess;
  if (csa) {
    compress_decode_kernel<true><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(a);
  } else {
    compress_decode_kernel<false><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace jaxkv

// ---- XLA FFI handlers (jax.ffi; jaxkv/kernels/compress_decode.py) ---------------------------------
// Every handler only enqueues work on XLA's stream (no host sync, no allocation), so it is
// marked command-buffer compatible: XLA captures it into the CUDA graph of a jitted step.
namespace ffi = xla::ffi;

namespace jaxkv {
namespace compress_types {
using Any = ffi::AnyBuffer;
using AnyOut = ffi::Result<ffi::AnyBuffer>;
}  // namespace compress_types

static ffi::Error compress_check(bool ok, const char* what) {
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(what);
}

static bool is_float_input(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::F32 || x.element_type() == ffi::BF16;
}

// All float operands come in as their whole (flattened) stacks; the *_offset attributes say
// where this layer's row starts, in elements.
template <bool csa>
static ffi::Error compress_decode_ffi(cudaStream_t stream, ffi::AnyBuffer tails, ffi::AnyBuffer pool,
                                      ffi::AnyBuffer index_pool, ffi::AnyBuffer error, ffi::AnyBuffer kv,
                                      ffi::AnyBuffer score, ffi::AnyBuffer bias, ffi::AnyBuffer norm,
                                      ffi::AnyBuffer ikv, ffi::AnyBuffer iscore, ffi::AnyBuffer ibias,
                                      ffi::AnyBuffer inorm, ffi::AnyBuffer freqs, ffi::AnyBuffer slot,
                                      ffi::AnyBuffer write_slot, ffi::AnyBuffer start, ffi::AnyBuffer num_tokens,
                                      ffi::AnyBuffer table, ffi::Result<ffi::AnyBuffer> tails_out,
                                      ffi::Result<ffi::AnyBuffer> pool_out, ffi::Result<ffi::AnyBuffer> index_out,
                                      ffi::Result<ffi::AnyBuffer> error_out, int32_t layer, int32_t ratio, float eps,
                                      int32_t storage, int32_t fault, int32_t nonfinite, int64_t kv_offset,
                                      int64_t score_offset, int64_t bias_offset, int64_t norm_offset, int64_t ikv_offset,
                                      int64_t iscore_offset, int64_t ibias_offset, int64_t inorm_offset) {
  const auto td = tails.dimensions();  // [L, R, streams, 3, width]
  const auto pd = pool.dimensions();   // [L, NB, bs * E]
  const int streams = csa ? 3 : 1, width = csa ? kHeadDim + kIndexDim : kHeadDim;
  const int64_t B = slot.dimensions()[0];
  ffi::Error e = compress_check(storage == kOfficial || storage == kPerEntry,
                                "storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (e.failure()) return e;
  e = compress_check(tails.element_type() == ffi::F32 && td.size() == 5 && td[2] == streams && td[3] == 3 &&
                         td[4] == width,
                     csa ? "tails: expected f32[L, R, 3, 3, 640]" : "tails: expected f32[L, R, 1, 3, 512]");
  if (e.failure()) return e;
  e = compress_check(pool.element_type() == ffi::U8 && pd.size() == 3 && pd[0] == td[0] && ratio > 0 &&
                         pd[2] % entry_bytes(storage) == 0 && layer >= 0 && layer < pd[0],
                     "pool: expected u8[L, NB, bs * entry bytes] with L as tails; layer in [0, L); ratio > 0");
  if (e.failure()) return e;
  e = compress_check(is_float_input(kv) && is_float_input(score) && (!csa || (is_float_input(ikv) &&
                                                                               is_float_input(iscore))),
                     "kv, score: expected float32 or bfloat16");
  if (e.failure()) return e;
  const int32_t bs = static_cast<int32_t>(pd[2] / entry_bytes(storage));
  const auto tb = table.dimensions();
  e = compress_check(tb.size() == 2 && tb[0] == td[1] && error.dimensions()[0] == td[1] + 1,
                     "table, error: expected i32[R, max_blocks] and u32[R + 1]");
  if (e.failure()) return e;
  in_place(tails_out, tails, stream);
  in_place(pool_out, pool, stream);
  in_place(error_out, error, stream);
  if (csa) in_place(index_out, index_pool, stream);

  CompressArgs a{};
  a.tails = static_cast<float*>(tails_out->untyped_data()) + static_cast<int64_t>(layer) * td[1] * streams * 3 * width;
  a.pools = PoolView{static_cast<uint8_t*>(pool_out->untyped_data()) + layer * pd[1] * pd[2],
                     csa ? static_cast<uint8_t*>(index_out->untyped_data()) +
                               layer * pd[1] * (static_cast<int64_t>(bs) * key_bytes(storage))
                         : nullptr,
                     pd[1], bs, storage};
  a.error = static_cast<uint32_t*>(error_out->untyped_data());
  auto at = [](const ffi::AnyBuffer& x, int64_t off) -> const void* {
    return static_cast<const char*>(x.untyped_data()) + off * ffi::ByteWidth(x.element_type());
  };
  a.kv = at(kv, kv_offset), a.score = at(score, score_offset);
  a.bias = static_cast<const float*>(at(bias, bias_offset));
  a.norm = static_cast<const float*>(at(norm, norm_offset));
  if (csa) {
    a.ikv = at(ikv, ikv_offset), a.iscore = at(iscore, iscore_offset);
    a.ibias = static_cast<const float*>(at(ibias, ibias_offset));
    a.inorm = static_cast<const float*>(at(inorm, inorm_offset));
  }
  a.freqs = static_cast<const float*>(freqs.untyped_data());
  a.slot = static_cast<const int32_t*>(slot.untyped_data());
  a.write_slot = static_cast<const int32_t*>(write_slot.untyped_data());
  a.start = static_cast<const int32_t*>(start.untyped_data());
  a.num_tokens = static_cast<const int32_t*>(num_tokens.untyped_data());
  a.table = static_cast<const int32_t*>(table.untyped_data());
  a.R = td[1];
  a.max_blocks = static_cast<int32_t>(tb[1]);
  a.ratio = ratio;
  a.eps = eps;
  a.fault = static_cast<uint32_t>(fault);
  a.nonfinite = static_cast<uint32_t>(nonfinite);
  a.dtypes = (kv.element_type() == ffi::BF16 ? kKvBf16 : 0) | (score.element_type() == ffi::BF16 ? kScoreBf16 : 0) |
             (csa && ikv.element_type() == ffi::BF16 ? kIkvBf16 : 0) |
             (csa && iscore.element_type() == ffi::BF16 ? kIscoreBf16 : 0);
  return launch_status(launch_compress_decode(stream, a, B, csa), "compress_decode");
}

static ffi::Error compress_decode_hca(cudaStream_t stream, ffi::AnyBuffer tails, ffi::AnyBuffer pool,
                                      ffi::AnyBuffer error, ffi::AnyBuffer kv, ffi::AnyBuffer score,
                                      ffi::AnyBuffer bias, ffi::AnyBuffer norm, ffi::AnyBuffer freqs,
                                      ffi::AnyBuffer slot, ffi::AnyBuffer write_slot, ffi::AnyBuffer start,
                                      ffi::AnyBuffer num_tokens, ffi::AnyBuffer table,
                                      ffi::Result<ffi::AnyBuffer> tails_out, ffi::Result<ffi::AnyBuffer> pool_out,
                                      ffi::Result<ffi::AnyBuffer> error_out, int32_t layer, int32_t ratio, float eps,
                                      int32_t storage, int32_t fault, int32_t nonfinite, int64_t kv_offset,
                                      int64_t score_offset, int64_t bias_offset, int64_t norm_offset) {
  return compress_decode_ffi<false>(stream, tails, pool, pool, error, kv, score, bias, norm, kv, score, bias, norm,
                             freqs, slot, write_slot, start, num_tokens, table, tails_out, pool_out, pool_out,
                             error_out, layer, ratio, eps, storage, fault, nonfinite, kv_offset, score_offset,
                             bias_offset, norm_offset, 0, 0, 0, 0);
}

}  // namespace jaxkv

#define JAXKV_COMPRESS_ATTRS                                                                               \
  .Attr<int32_t>("layer").Attr<int32_t>("ratio").Attr<float>("eps").Attr<int32_t>("storage")               \
      .Attr<int32_t>("fault").Attr<int32_t>("nonfinite").Attr<int64_t>("kv_offset")                      \
      .Attr<int64_t>("score_offset").Attr<int64_t>("bias_offset").Attr<int64_t>("norm_offset")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCompressDecodeCsa, jaxkv::compress_decode_ffi<true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // tails (aliased)
                                  .Arg<ffi::AnyBuffer>()  // pool (aliased)
                                  .Arg<ffi::AnyBuffer>()  // index_pool (aliased)
                                  .Arg<ffi::AnyBuffer>()  // error (aliased)
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // score
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // norm
                                  .Arg<ffi::AnyBuffer>()  // index kv
                                  .Arg<ffi::AnyBuffer>()  // index score
                                  .Arg<ffi::AnyBuffer>()  // index bias
                                  .Arg<ffi::AnyBuffer>()  // index norm
                                  .Arg<ffi::AnyBuffer>()  // freqs
                                  .Arg<ffi::AnyBuffer>()  // slot
                                  .Arg<ffi::AnyBuffer>()  // write_slot
                                  .Arg<ffi::AnyBuffer>()  // start
                                  .Arg<ffi::AnyBuffer>()  // num_tokens
                                  .Arg<ffi::AnyBuffer>()  // table
                                  .Ret<ffi::AnyBuffer>()  // tails
                                  .Ret<ffi::AnyBuffer>()  // pool
                                  .Ret<ffi::AnyBuffer>()  // index_pool
                                  .Ret<ffi::AnyBuffer>()  // error
                                      JAXKV_COMPRESS_ATTRS.Attr<int64_t>("ikv_offset")
                                  .Attr<int64_t>("iscore_offset")
                                  .Attr<int64_t>("ibias_offset")
                                  .Attr<int64_t>("inorm_offset"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCompressDecodeHca, jaxkv::compress_decode_hca,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // tails (aliased)
                                  .Arg<ffi::AnyBuffer>()  // pool (aliased)
                                  .Arg<ffi::AnyBuffer>()  // error (aliased)
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // score
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // norm
                                  .Arg<ffi::AnyBuffer>()  // freqs
                                  .Arg<ffi::AnyBuffer>()  // slot
                                  .Arg<ffi::AnyBuffer>()  // write_slot
                                  .Arg<ffi::AnyBuffer>()  // start
                                  .Arg<ffi::AnyBuffer>()  // num_tokens
                                  .Arg<ffi::AnyBuffer>()  // table
                                  .Ret<ffi::AnyBuffer>()  // tails
                                  .Ret<ffi::AnyBuffer>()  // pool
                                  .Ret<ffi::AnyBuffer>()  // error
                                      JAXKV_COMPRESS_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
