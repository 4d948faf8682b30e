// The pool layout and the encoders / decoders every cuda/ kernel shares (one owner:
// write_entry.cuh writes entries and keys with them, fp4_pack.cu packs FP4 rows,
// dequant_gather.cu and pool_attention.cu read entries back; prefix_attention.cu decodes the FP8
// frame cache's rows with e4m3x2_to_bf16x2).
// Bytes equal jaxkv.formats' jnp codecs; the layout comes from jaxkv.formats.storage
// (jaxkv.cuda.build passes it as -D flags).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "div_rn.cuh"

namespace jaxkv {

// The pool layout comes from jaxkv.formats.storage.cuda_defines() (jaxkv.cuda.build passes it).
#if !defined(JAXKV_HEAD_DIM) || !defined(JAXKV_OFFICIAL_ENTRY_SEG1) || !defined(JAXKV_PER_ENTRY_KEY_SEG2)
#error "build with the -D flags of jaxkv.formats.storage.cuda_defines() (jaxkv.cuda.build does)"
#endif
constexpr int kHeadDim = JAXKV_HEAD_DIM;    // stored entry: FP8 dims, then BF16 rope dims
constexpr int kNope = JAXKV_NOPE;           // FP8 dims
constexpr int kTile = JAXKV_TILE;           // UE8M0 tile
constexpr int kIndexDim = JAXKV_INDEX_DIM;  // indexer key width
constexpr int kRopeBytes = 2 * (kHeadDim - kNope);
static_assert(kHeadDim == 512 && kNope == 448 && kTile == 64 && kIndexDim == 128,
              "the warp mapping below (16 dims per lane, 4 key dims per lane) is written for these widths");
// segments (storage.py's Codec.segments): official entry [codes + rope][tile scales + pad],
// per_entry entry [codes][rope][f32 scale]; official key [codes][UE8M0], per_entry key [codes][E4M3][f32]
constexpr int kOffData = JAXKV_OFFICIAL_ENTRY_SEG0, kOffScales = JAXKV_OFFICIAL_ENTRY_SEG1;
constexpr int kPeCodes = JAXKV_PER_ENTRY_ENTRY_SEG0, kPeRope = JAXKV_PER_ENTRY_ENTRY_SEG1,
              kPeScale = JAXKV_PER_ENTRY_ENTRY_SEG2;
constexpr int kOffKeyCodes = JAXKV_OFFICIAL_KEY_SEG0, kOffKeyScales = JAXKV_OFFICIAL_KEY_SEG1;
constexpr int kPeKeyCodes = JAXKV_PER_ENTRY_KEY_SEG0, kPeKeyScales = JAXKV_PER_ENTRY_KEY_SEG1,
              kPeKeyGlobal = JAXKV_PER_ENTRY_KEY_SEG2;
static_assert(kOffData == kNope + kRopeBytes && kOffScales == 8 && kPeCodes == kNope && kPeRope == kRopeBytes &&
              kPeScale == 4 && kOffKeyCodes == kIndexDim / 2 && kPeKeyCodes == kIndexDim / 2 &&
              kOffKeyScales == 4 && kPeKeyScales == 8 && kPeKeyGlobal == 4,
              "the stores below are written for this layout: change them with it");
#ifndef JAXKV_FLUSH_ROWS  // a build knob (-DJAXKV_FLUSH_ROWS=n); the default: docs/kernels/cache_writes.md
#define JAXKV_FLUSH_ROWS 4
#endif
constexpr int kRowsPerBlock = JAXKV_FLUSH_ROWS;  // warps per CTA, one entry each

enum Storage : int32_t { kOfficial = JAXKV_OFFICIAL_CODE, kPerEntry = JAXKV_PER_ENTRY_CODE };

__host__ __device__ constexpr int entry_bytes(int32_t s) {
  return s == kOfficial ? JAXKV_OFFICIAL_ENTRY_BYTES : JAXKV_PER_ENTRY_ENTRY_BYTES;
}
__host__ __device__ constexpr int key_bytes(int32_t s) {
  return s == kOfficial ? JAXKV_OFFICIAL_KEY_BYTES : JAXKV_PER_ENTRY_KEY_BYTES;
}

// ---- exact scalar helpers (mirror jaxkv/formats/numerics.py) ------------------------------
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((e + 127) << 23); }  // e in [-126, 127]

__device__ __forceinline__ float nanmax(float a, float b) {  // max that keeps NaN (amax_abs): one FMNMX.NAN
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <int kWidth>  // reduce over aligned groups of kWidth lanes
__device__ __forceinline__ float group_amax(float v) {
#pragma unroll
  for (int o = 1; o < kWidth; o <<= 1) v = nanmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 2 FP8 E4M3 codes (bytes ``sel`` picks: 0x1404 the low two, 0x3424 the high two of ``w``) ->
// their exact values as a bf16x2 word, with integer ops and one bf16 multiply instead of the
// conversion instructions (whose pipe runs at a quarter of the ALU's rate; it bounded the
// dequantization). A code's magnitude bits set as a bf16's exponent and mantissa (bits 10..4)
// read as value * 2^-120, subnormal codes included; the multiply by 2^120 is exact. The NaN
// codes 0x7F / 0xFF, which the encoder never writes, come out as +-480.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));  // + (-0): exact x * y
  return d;
}
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t w, uint32_t sel) {
  const uint32_t t = __byte_perm(w, 0, sel);  // the two codes at bits 8..15 and 24..31
  return bf16x2_mul(((t & 0x7F007F00u) >> 4) | (t & 0x80008000u), 0x7B807B80u);  // * 2^120
}
// float32 -> E4M3 byte: RNE, saturating at 448, subnormals exact, NaN -> 0x7F | sign
// (the hardware conversion, cvt.rn.satfinite, for everything but NaN, whose sign it drops).
__device__ __forceinline__ uint8_t fp8_e4m3(float y) {
  if (isnan(y)) return 0x7F | (signbit(y) ? 0x80 : 0);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
}

// Four float32 -> E4M3 bytes in one word (element 0 in the low byte) by the hardware's
// cvt.rn.satfinite: RNE, saturating at 448, NaN -> 0x7F. Callers only meet NaN where the
// scale is NaN, and then every code of the group is 0x7F (``ue8m0_tile_codes``).
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// 1 / s for a power-of-two s, exact: x / s is then x * inv_pow2(s), equal to the correctly
// rounded quotient except where that is an f32 subnormal, which FP8 and FP4 both encode
// as zero anyway. NaN s (a non-finite group) gives NaN like the division.
__device__ __forceinline__ float inv_pow2(float s) { return __frcp_rn(s); }

__device__ __forceinline__ float fp8_e4m3_value(uint8_t b) {
  const int ex = (b >> 3) & 15, m = b & 7;
  float v = (ex == 15 && m == 7) ? __int_as_float(0x7fc00000)
            : ex == 0            ? m * pow2f(-9)
                                 : (8 + m) * pow2f(ex - 10);
  return (b & 0x80) ? -v : v;
}

// 2**(b - 127) exactly (b = 0: the f32 subnormal 2**-127); NaN for 0xFF (formats.numerics.e8m0_to_float).
__device__ __forceinline__ float e8m0_value(uint8_t b) {
  return b == 0xFF ? __int_as_float(0x7fc00000) : b == 0 ? __int_as_float(1 << 22) : __int_as_float(int(b) << 23);
}

// 2**ceil(log2(v)) as (float, E8M0 byte); non-finite v -> (NaN, 0xFF).
__device__ __forceinline__ float ue8m0_scale(float v, uint8_t* byte) {
  if (!isfinite(v)) {
    *byte = 0xFF;
    return __int_as_float(0x7fc00000);
  }
  int e;
  const float m = frexpf(v, &e);
  const int c = min(max(m == 0.5f ? e - 1 : e, -127), 127);
  *byte = static_cast<uint8_t>(c + 127);
  return c == -127 ? __int_as_float(1 << 22) : pow2f(c);
}

// float32 (already scaled) -> E2M1 code, RNE, saturating; NaN -> 7; sign in bit 3.
__device__ __forceinline__ uint8_t e2m1(float y) {
  if (isnan(y)) return 7;
  const float a = fabsf(y);
  const uint8_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return c | (signbit(y) ? 8 : 0);
}

// E2M1 code -> float (formats.fp4.e2m1_decode: the sign bit negates, so code 8 is -0.0).
// Built from the code's bits, not a table, which would sit in local memory.
__device__ __forceinline__ float e2m1_value(uint8_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;  // codes 0, 1: 0 and 0.5; else 2^(e-1) * (1 + m/2)
  const float mag = e == 0 ? 0.5f * static_cast<float>(m) : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (c & 8) ? -mag : mag;
}

// NVFP4's global scale from its elements' amax: amax / (448 * 6), 1 where amax is not > 0
// (formats.nvfp4_global_scale; the per_entry family gives each indexer key its own).
__device__ __forceinline__ float nvfp4_global_scale(float amax) { return amax > 0.f ? __fdiv_rn(amax, 2688.f) : 1.f; }

__device__ __forceinline__ void store16(uint8_t* dst, const uint4& src) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = src;
  } else {  // a pool whose blocks are not 16-byte aligned (an odd block size)
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&src);
#pragma unroll
    for (int i = 0; i < 16; ++i) dst[i] = b[i];
  }
}

// Bytes held by lanes first, first + kStride, ... (kCount of them) packed little-endian into
// one word, so one lane writes them with one store. Every lane of the warp must call it.
template <int kCount, int kStride>
__device__ __forceinline__ uint32_t gather_bytes(uint8_t byte, int first = 0) {
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < kCount; ++i) word |= (__shfl_sync(0xffffffffu, uint32_t(byte), first + i * kStride) & 0xFF) << (8 * i);
  return word;
}

// ---- FP4 groups held by lanes, N consecutive elements per lane -----------------------------
// A group's lanes must be aligned (32 / N lanes for MXFP4's 32 elements, 16 / N for NVFP4's
// 16) and every lane of the warp must call (the group maxima are shuffles). Same bytes as
// jaxkv.formats.quantize_mxfp4 / quantize_nvfp4.

// MXFP4: one UE8M0 scale per 32 elements (DeepGEMM's rule s = 2^ceil(log2(max(amax, 1e-4) / 6))).
// Writes this lane's N E2M1 codes; returns the group's scale byte (on all its lanes).
template <int N>
__device__ __forceinline__ uint8_t mxfp4_lane(const float (&v)[N], uint8_t (&c)[N]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = nanmax(amax, fabsf(v[i]));
  amax = group_amax<32 / N>(amax);
  const float t = isnan(amax) ? amax : __fdiv_rn(fmaxf(amax, 1e-4f), 6.f);
  uint8_t byte;
  const float inv = inv_pow2(ue8m0_scale(t, &byte));
#pragma unroll
  for (int i = 0; i < N; ++i) c[i] = e2m1(v[i] * inv);
  return byte;
}

// NVFP4: one E4M3 scale per 16 elements, g the float32 global scale. kShared: the elements are
// bf16 values, so div_rn.cuh's SharedDivisor gives div.rn's quotients (proven there); else div.rn.
// Writes this lane's N E2M1 codes; returns the group's E4M3 byte (on all its lanes).
template <bool kShared, int N>
__device__ __forceinline__ uint8_t nvfp4_lane(const float (&v)[N], float g, uint8_t (&c)[N]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = nanmax(amax, fabsf(v[i]));
  amax = group_amax<16 / N>(amax);
  const float bsc = isfinite(amax) ? __fdiv_rn(__fdiv_rn(amax, 6.f), g) : __int_as_float(0x7fc00000);
  const uint8_t b8 = fp8_e4m3(bsc);
  const float denom = fp8_e4m3_value(b8) * g;
  const bool ok = denom > 0.f;  // else (zero or NaN) every code is 0
  if (kShared) {
    const SharedDivisor div(ok ? denom : 1.f);
#pragma unroll
    for (int i = 0; i < N; ++i) c[i] = e2m1(ok ? div(v[i]) : 0.f);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) c[i] = e2m1(ok ? __fdiv_rn(v[i], denom) : 0.f);
  }
  return b8;
}

// A 32-bit word holding a NaN or an Inf: one float32, or either of two bfloat16 / float16
// halves (all exponent bits set; a bit test, so no compiler flag can drop it). ``dtype``:
// the frame append's codes (0 bfloat16, 1 float16, 2 float32).
enum WordDtype : int32_t { kWordBf16 = 0, kWordF16 = 1, kWordF32 = 2 };
__device__ __forceinline__ bool word_nonfinite(uint32_t w, int32_t dtype) {
  if (dtype == kWordF32) return (w & 0x7F800000u) == 0x7F800000u;
  const uint32_t e = dtype == kWordBf16 ? 0x7F80u : 0x7C00u;
  return (w & e) == e || ((w >> 16) & e) == e;
}

// Four E2M1 codes -> two packed bytes (element 2i in the low nibble), low byte first.
__device__ __forceinline__ uint32_t pack_e2m1x4(const uint8_t (&c)[4]) {
  return (c[0] | (c[1] << 4)) | ((c[2] | (c[3] << 4)) << 8);
}

}  // namespace jaxkv
