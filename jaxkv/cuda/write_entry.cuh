// One warp writes one finished entry (and a CSA layer's indexer key) into a layer's paged
// pool, in either storage family: what flush_write.cu does per row and compress_decode.cu
// per request after pooling. Bytes equal jaxkv.formats.storage's jnp encoders (codes.cuh).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "codes.cuh"

namespace jaxkv {

// One layer's pools and how to address them.
struct PoolView {
  uint8_t* pool;        // u8[num_blocks, block_size * entry_bytes]
  uint8_t* index_pool;  // u8[num_blocks, block_size * key_bytes], or null (HCA)
  int64_t num_blocks;
  int32_t block_size;
  int32_t storage;
};

// raw: this lane's elements [16 lane, 16 lane + 16) of the bf16 entry: lanes 0..27 the FP8
// part, 28..31 the rope dims. blk in [0, num_blocks), sl in [0, block_size).
__device__ inline void write_entry(const PoolView& p, const uint4 (&raw)[2], int blk, int sl, int lane) {
  const int bs = p.block_size;
  uint8_t* base = p.pool + static_cast<int64_t>(blk) * bs * entry_bytes(p.storage);
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(raw);
  const bool nope = lane < kNope / 16;
  float v[16];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = __bfloat162float(h[i]);
    if (nope) amax = nanmax(amax, fabsf(v[i]));
  }
  uint4 q;  // 16 FP8 codes
  uint32_t* w = reinterpret_cast<uint32_t*>(&q);
  if (p.storage == kOfficial) {  // ds_mla: [448 fp8 | 64 bf16] x bs, then [7 UE8M0 + pad] x bs
    amax = group_amax<kTile / 16>(amax);
    float t = __fdiv_rn(amax, 448.f);
    if (!isnan(t)) t = fmaxf(t, 1e-4f);
    uint8_t byte;
    const float s = ue8m0_scale(t, &byte);
    // the 7 tile scales (lanes 0, 4, .., 24 hold them) and a zero pad byte: one 8-byte store
    const uint32_t lo = gather_bytes<4, 4>(byte), hi = gather_bytes<3, 4>(byte, 16);
    if (lane == 0) *reinterpret_cast<uint2*>(base + bs * kOffData + sl * kOffScales) = make_uint2(lo, hi);
    const float inv = inv_pow2(s);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = e4m3x4(v[4 * i] * inv, v[4 * i + 1] * inv, v[4 * i + 2] * inv, v[4 * i + 3] * inv);
    if (nope) {
      store16(base + sl * kOffData + 16 * lane, q);
    } else {  // the rope dims' bytes as they came
      uint8_t* dst = base + sl * kOffData + kNope + 32 * (lane - kNope / 16);
      store16(dst, raw[0]);
      store16(dst + 16, raw[1]);
    }
  } else {  // per_entry: [448 fp8] x bs, [64 bf16] x bs, [f32 scale] x bs
    amax = group_amax<32>(amax);
    const float scale = isfinite(amax) ? __fdiv_rn(amax, 448.f) : __int_as_float(0x7fc00000);
    if (nope) {
      const bool ok = scale > 0.f;  // else (zero or NaN scale) all codes are 0
      const SharedDivisor div(ok ? scale : 1.f);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = ok ? e4m3x4(div(v[4 * i]), div(v[4 * i + 1]), div(v[4 * i + 2]), div(v[4 * i + 3])) : 0u;
      store16(base + sl * kPeCodes + 16 * lane, q);
      if (lane == 0)
        *reinterpret_cast<uint32_t*>(base + bs * (kPeCodes + kPeRope) + sl * kPeScale) = __float_as_uint(scale);
    } else {
      uint8_t* dst = base + bs * kPeCodes + sl * kPeRope + 32 * (lane - kNope / 16);
      store16(dst, raw[0]);
      store16(dst + 16, raw[1]);
    }
  }
}

// raw: this lane's elements [4 lane, 4 lane + 4) of the bf16 key: MXFP4 (official) or NVFP4
// with the key's own global scale (per_entry).
__device__ inline void write_index_key(const PoolView& p, const uint2& raw, int blk, int sl, int lane) {
  const int bs = p.block_size;
  uint8_t* base = p.index_pool + static_cast<int64_t>(blk) * bs * key_bytes(p.storage);
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(h[i]);
  uint8_t c[4];
  if (p.storage == kOfficial) {  // MXFP4: [64 B codes] x bs, [4 UE8M0] x bs
    const uint8_t byte = mxfp4_lane(v, c);
    const uint32_t scales = gather_bytes<4, 8>(byte);  // lanes 0, 8, 16, 24
    if (lane == 0) *reinterpret_cast<uint32_t*>(base + bs * kOffKeyCodes + sl * kOffKeyScales) = scales;
  } else {  // NVFP4: [64 B codes] x bs, [8 E4M3] x bs, [f32 global] x bs
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = nanmax(amax, fabsf(v[i]));
    const float gmax = group_amax<32>(amax);
    const float g = nvfp4_global_scale(gmax);
    const uint8_t b8 = nvfp4_lane<true, 4>(v, g, c);
    const uint32_t lo = gather_bytes<4, 4>(b8), hi = gather_bytes<4, 4>(b8, 16);  // lanes 0, 4, .., 28
    if (lane == 0) {
      uint32_t* d = reinterpret_cast<uint32_t*>(base + bs * kPeKeyCodes + sl * kPeKeyScales);
      d[0] = lo, d[1] = hi;
      *reinterpret_cast<uint32_t*>(base + bs * (kPeKeyCodes + kPeKeyScales) + sl * kPeKeyGlobal) = __float_as_uint(g);
    }
  }
  // this lane's 2 code bytes, paired with the next lane's: one 4-byte store per even lane
  const uint32_t mine = pack_e2m1x4(c);
  const uint32_t next = __shfl_down_sync(0xffffffffu, mine, 1);
  if (lane % 2 == 0) *reinterpret_cast<uint32_t*>(base + sl * kOffKeyCodes + 2 * lane) = mine | (next << 16);
}

}  // namespace jaxkv
