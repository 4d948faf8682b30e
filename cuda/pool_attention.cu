// Pool attention for DeepSeek-V4 (MQA, K = V, head_dim 512): per query row, softmax(q K^T)
// K over FP8 pool rows read where they are stored, in either storage family. The rows come
// in blocks of 64 (a row list per query, a valid-row count per block); the output is the
// split's normalized partial and its base-2 log-sum-exp, merged with the sink by XLA
// (jaxkv.kernels.pool_attention: shapes, reference, the merge).
//
// One CTA of 8 warps (2 warpgroups) per (query row, 64 heads, key split), 1 CTA per SM
// (176 KiB of shared memory). Per block of 64 key rows:
//   1. the raw row bytes (576 B of codes + rope, the scale bytes) arrive by cp.async into a
//      staging buffer, issued one block ahead so the loads overlap the previous block's math;
//   2. all threads dequantize the block into a BF16 K tile (f32 product, round to BF16: the
//      bytes of jaxkv.formats' decoders) in the wgmma 128-byte-swizzle layout (``swz``);
//   3. S = Q K^T: warpgroup h takes keys 32 h.. with wgmma m64n32k16 straight from shared
//      memory (sm_90a; mma.sync on other archs); the online softmax (base 2) shares row maxima,
//      the row rescales and P (bf16) through shared memory;
//   4. O = alpha O + P V with mma.sync: warp w owns output dims 64 w.. of all 64 heads, so V
//      (K read transposed) and P are each read from shared memory once per warp.
// Rows past a block's count, and ids outside their pool, are zero-filled and masked: no read
// outside a pool. Deterministic: a fixed order of every sum.
// Why CUDA and not Mosaic GPU: a block's rows are scattered over the pool and Mosaic GPU has
// no per-thread gather; per-row TMAs cost more than the math (kernels.pool_attention).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "ptx.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {
namespace {

constexpr int kBlock = 64;                 // keys per block; heads per CTA
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunks = kHeadDim / 8;      // 16-byte BF16 chunks of a row (64)
constexpr int kCodeChunks = kNope / 16;    // 16-byte FP8 chunks of a row (28)
constexpr int kRawChunks = kOffData / 16;  // codes + rope (36)
constexpr int kRopeChunks = kRawChunks - kCodeChunks;
constexpr int kScaleBytes = kOffScales;    // staged scale bytes per row (8; per_entry uses 4)
constexpr int kMaxParts = 3;
constexpr int kMaxBlocks = 128;
static_assert(kRawChunks * 16 == kOffData && kRopeChunks == 8 && kThreads == 4 * kBlock, "layout");

// shared memory, bytes
constexpr int kQBytes = kBlock * kHeadDim * 2;
constexpr int kKBytes = kBlock * kHeadDim * 2;
constexpr int kRawBytes = kBlock * kOffData;
constexpr int kPBytes = kBlock * kBlock * 2;
constexpr int kSmem = 1024 + kQBytes + kKBytes + kRawBytes + kBlock * kScaleBytes + kPBytes + 5 * kBlock * 4 +
                      2 * kBlock + 2 * kMaxBlocks * 4 + 16;

struct Part {
  const uint8_t* pool;  // u8[blocks, bs * E]
  int64_t items;        // blocks * bs: ids in [0, items) are rows of this pool
  int32_t bs;
  int32_t end;          // the part owns list blocks [previous end, end)
};

struct AttnArgs {
  const __nv_bfloat16* q;  // bf16[N, H, 512]
  const int32_t* rows;     // i32[N, NB * 64]
  const int32_t* nvalid;   // i32[N, NB]
  Part part[kMaxParts];
  __nv_bfloat16* out;      // bf16[N * splits, H, 512]
  float* lse;              // f32[N * splits, H]
  int32_t heads, nb, splits, storage;
  float c;                 // softmax scale * log2(e)
};

// ---- PTX (the rest is ptx.cuh) --------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// d += a b: a bf16[16, 16] (row), b bf16[16, 8] (col), d f32[16, 8]
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // sm_90a: S = Q K^T by wgmma
#define JAXKV_WGMMA 1
// d (+)= a b^T for one warpgroup: a bf16[64, 16], b bf16[32, 16] (both K-major in shared
// memory), d f32[64, 32] in the mma.sync C layout per 8 columns (warp w of the group: rows 16 w..)
__device__ __forceinline__ void wgmma_64x32(float (&d)[4][4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(a), "l"(b), "r"(accumulate));
}
#endif

// S = Q K^T for warpgroup h: heads 16 g + (rows of this thread), keys 32 h.. (C layout per 8 keys)
__device__ __forceinline__ void qk_block(float (&S)[4][4], uint32_t q_s, uint32_t k_s, int g, int h, int lane) {
#ifdef JAXKV_WGMMA
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t off = (kk >> 2) * (kBlock * 128) + (kk & 3) * 32;
    wgmma_64x32(S, wgmma_desc(q_s + off), wgmma_desc(k_s + off + h * 32 * 128), kk > 0);
  }
  wgmma_commit();
  wgmma_wait();
#else  // other archs: mma.sync, operands by ldmatrix
#pragma unroll
  for (int i = 0; i < 4; ++i) S[i][0] = S[i][1] = S[i][2] = S[i][3] = 0.f;
#pragma unroll 4
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t qa[4];
    ldmatrix_x4(qa, q_s + swz(16 * g + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t kb[4];
      ldmatrix_x4(kb, k_s + swz(32 * h + 16 * np + (lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1)));
      mma(S[2 * np], qa, kb[0], kb[1]);
      mma(S[2 * np + 1], qa, kb[2], kb[3]);
    }
  }
#endif
}

// ---- the block pipeline ---------------------------------------------------------------------
// Issue the raw bytes of list block ``b`` into staging: thread t owns row t / 4 and its
// chunks t % 4 + 4 k. ok[r]: row r is a real key of this block.
__device__ __forceinline__ void issue_block(const AttnArgs& a, int64_t n, int b, int nv, uint8_t* raw,
                                            uint8_t* scales, uint8_t* ok) {
  const int t = threadIdx.x, r = t >> 2, q4 = t & 3;
  int p = 0;
#pragma unroll
  for (int i = 0; i < kMaxParts - 1; ++i) p += b >= a.part[i].end;
  const Part P = a.part[p];
  const int id = __ldg(a.rows + (n * a.nb + b) * kBlock + r);
  const bool valid = r < nv && id >= 0 && id < P.items;
  const int64_t blk = valid ? id / P.bs : 0;
  const int sl = valid ? id % P.bs : 0;
  const bool official = a.storage == kOfficial;
  const uint8_t* base = P.pool + blk * P.bs * entry_bytes(a.storage);
  const uint8_t* codes = base + sl * (official ? kOffData : kPeCodes);
  const uint8_t* rope = official ? codes + kNope : base + P.bs * kPeCodes + sl * kPeRope;
  const uint32_t dst = smem_addr(raw + r * kOffData);
#pragma unroll
  for (int k = 0; k < kRawChunks / 4; ++k) {
    const int c = q4 + 4 * k;
    cp_async<16>(dst + 16 * c, c < kCodeChunks ? codes + 16 * c : rope + 16 * (c - kCodeChunks), valid);
  }
  if (q4 == 0) {
    const uint8_t* s = base + P.bs * kOffData + sl * (official ? kOffScales : kPeScale);
    if (official)
      cp_async<8>(smem_addr(scales + r * kScaleBytes), s, valid);
    else
      cp_async<4>(smem_addr(scales + r * kScaleBytes), s, valid);
  } else if (q4 == 1) {
    ok[r] = valid;
  }
}

// staging -> the BF16 K tile (swizzled)
__device__ __forceinline__ void dequant_block(const uint8_t* raw, const uint8_t* scales, uint8_t* K, bool official) {
  const int t = threadIdx.x, r = t >> 2, q4 = t & 3;
  const uint8_t* row = raw + r * kOffData;
  const float per_entry = official ? 0.f : *reinterpret_cast<const float*>(scales + r * kScaleBytes);
#pragma unroll
  for (int k = 0; k < kCodeChunks / 4; ++k) {
    const int c = q4 + 4 * k;
    const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * c);
    const float s = official ? e8m0_value(scales[r * kScaleBytes + c / (kTile / 16)]) : per_entry;
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2_raw hr =
            __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * h)), __NV_E4M3);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
        o[2 * i + h] = pack_bf16(__fmul_rn(f.x, s), __fmul_rn(f.y, s));
      }
    }
    *reinterpret_cast<uint4*>(K + swz(r, 2 * c)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(K + swz(r, 2 * c + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
  }
#pragma unroll
  for (int k = 0; k < kRopeChunks / 4; ++k) {
    const int c = q4 + 4 * k;
    *reinterpret_cast<uint4*>(K + swz(r, 2 * kCodeChunks + c)) =
        *reinterpret_cast<const uint4*>(row + 16 * (kCodeChunks + c));
  }
}

__global__ void __launch_bounds__(kThreads, 1) pool_attention_kernel(AttnArgs a) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // the swizzled tiles need 1024-byte alignment (the swizzle reads address bits 7..9)
  uint8_t* Q = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // bf16[64, 512]; the output at the end
  uint8_t* K = Q + kQBytes;                             // bf16[64, 512] swizzled
  uint8_t* raw = K + kKBytes;                           // u8[64, 576]
  uint8_t* scales = raw + kRawBytes;                    // u8[64, 8]
  uint8_t* P = scales + kBlock * kScaleBytes;           // bf16[64, 64] swizzled
  float* red_max = reinterpret_cast<float*>(P + kPBytes);  // f32[2, 64]
  float* red_sum = red_max + 2 * kBlock;                // f32[2, 64]
  float* alpha_s = red_sum + 2 * kBlock;                // f32[64] the block's rescale of each row
  uint8_t* ok = reinterpret_cast<uint8_t*>(alpha_s + kBlock);  // u8[2, 64]
  int* nv_s = reinterpret_cast<int*>(ok + 2 * kBlock);  // i32[128]
  int* list = nv_s + kMaxBlocks;                        // i32[128] non-empty blocks, in order
  int* total_s = list + kMaxBlocks;

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, g = warp & 3, h = warp >> 2;
  const int64_t n = blockIdx.x;
  const int hg = blockIdx.y, split = blockIdx.z;
  const bool official = a.storage == kOfficial;

  // Q (64 heads) -> shared, async
  const __nv_bfloat16* qn = a.q + (n * a.heads + hg * kBlock) * kHeadDim;
  for (int i = t; i < kBlock * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    cp_async<16>(smem_addr(Q + swz(r, c)), qn + r * kHeadDim + 8 * c, true);
  }
  // the non-empty blocks, in order (warp 0: a ballot per 32)
  if (t < a.nb) nv_s[t] = min(max(__ldg(a.nvalid + n * a.nb + t), 0), kBlock);
  __syncthreads();
  if (warp == 0) {
    int count = 0;
    for (int i0 = 0; i0 < a.nb; i0 += 32) {
      const int i = i0 + lane;
      const bool f = i < a.nb && nv_s[i] > 0;
      const unsigned m = __ballot_sync(0xffffffffu, f);
      if (f) list[count + __popc(m & ((1u << lane) - 1))] = i;
      count += __popc(m);
    }
    if (lane == 0) *total_s = count;
  }
  __syncthreads();
  const int total = *total_s;
  const int per = (total + a.splits - 1) / a.splits;
  const int j0 = min(split * per, total), j1 = min(j0 + per, total);

  if (j0 < j1) issue_block(a, n, list[j0], nv_s[list[j0]], raw, scales, ok);
  cp_async_commit();

  // Roles: for S = Q K^T and the softmax, warpgroup h takes keys 32 h.. and its warp g heads
  // 16 g.. (rows row0, row0 + 8 of this thread); for O += P V, warp w takes output dims 64 w..
  // of all 64 heads (rows 16 mt + lane / 4 (+ 8)).
  float O[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) O[mt][nt][0] = O[mt][nt][1] = O[mt][nt][2] = O[mt][nt][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const uint32_t q_s = smem_addr(Q), k_s = smem_addr(K), p_s = smem_addr(P);
  const int row0 = 16 * g + (lane >> 2);

  for (int j = j0; j < j1; ++j) {
    cp_async_wait_all();
    __syncthreads();  // block j (and Q) landed; the previous block's reads of K and P are done
    dequant_block(raw, scales, K, official);
#ifdef JAXKV_WGMMA
    fence_async_smem();  // K (and Q) written by this thread -> visible to wgmma's reads
#endif
    __syncthreads();     // K ready; staging free
    if (j + 1 < j1) issue_block(a, n, list[j + 1], nv_s[list[j + 1]], raw, scales, ok + kBlock * ((j + 1 - j0) & 1));
    cp_async_commit();
    const uint8_t* okj = ok + kBlock * ((j - j0) & 1);

    float S[4][4];
    qk_block(S, q_s, k_s, g, h, lane);
    // online softmax over the block's 64 keys (base 2), maxima shared with the other warpgroup
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool kept = okj[32 * h + 8 * nt + 2 * (lane & 3) + e];
        S[nt][e] = kept ? S[nt][e] * a.c : -INFINITY;
        S[nt][2 + e] = kept ? S[nt][2 + e] * a.c : -INFINITY;
        mx[0] = fmaxf(mx[0], S[nt][e]);
        mx[1] = fmaxf(mx[1], S[nt][2 + e]);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    if ((lane & 3) == 0) {
      red_max[h * kBlock + row0] = mx[0];
      red_max[h * kBlock + row0 + 8] = mx[1];
    }
    __syncthreads();
    float use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m_run[i], fmaxf(mx[i], red_max[(1 - h) * kBlock + row0 + 8 * i]));
      use[i] = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = ex2(m_run[i] - use[i]);
      m_run[i] = m_new;
      l_run[i] *= alpha;
      if (h == 0 && (lane & 3) == 0) alpha_s[row0 + 8 * i] = alpha;
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[e] = ex2(S[nt][e] - use[e >> 1]);
        l_run[e >> 1] += p[e];
      }
      const uint32_t col = 4 * (lane & 3);
      *reinterpret_cast<uint32_t*>(P + swz(row0, 4 * h + nt) + col) = pack_bf16(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(P + swz(row0 + 8, 4 * h + nt) + col) = pack_bf16(p[2], p[3]);
    }
    __syncthreads();  // P and the row rescales complete
    // O = alpha O + P V: warp w, output dims 64 w.. (mma.sync; V is K read transposed)
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      const float a0 = alpha_s[16 * mt + (lane >> 2)], a1 = alpha_s[16 * mt + (lane >> 2) + 8];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        O[mt][nt][0] *= a0;
        O[mt][nt][1] *= a0;
        O[mt][nt][2] *= a1;
        O[mt][nt][3] *= a1;
      }
    }
#pragma unroll
    for (int ks = 0; ks < kBlock / 16; ++ks) {
      uint32_t pa[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) ldmatrix_x4(pa[mt], p_s + swz(16 * mt + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
      for (int dp = 0; dp < 4; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, k_s + swz(16 * ks + (lane & 7) + (((lane >> 3) & 1) << 3), 8 * warp + 2 * dp + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          mma(O[mt][2 * dp], pa[mt], vb[0], vb[1]);
          mma(O[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait_all();  // Q, when no block ran

  // epilogue: row sums over both key halves; the normalized output through shared memory
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  if ((lane & 3) == 0) {
    red_sum[h * kBlock + row0] = l_run[0];
    red_sum[h * kBlock + row0 + 8] = l_run[1];
  }
  __syncthreads();
  const int64_t orow = (n * a.splits + split) * a.heads + hg * kBlock;
  if (h == 0 && (lane & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + 8 * i;
      const float l = red_sum[r] + red_sum[kBlock + r];
      a.lse[orow + r] = l > 0.f ? m_run[i] + __log2f(l) : -INFINITY;
    }
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 16 * mt + (lane >> 2) + 8 * i;
      const float l = red_sum[r] + red_sum[kBlock + r];
      inv[i] = l > 0.f ? 1.f / l : 0.f;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int r = 16 * mt + (lane >> 2);
      const uint32_t col = 4 * (lane & 3);
      *reinterpret_cast<uint32_t*>(Q + swz(r, 8 * warp + nt) + col) = pack_bf16(O[mt][nt][0] * inv[0], O[mt][nt][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(Q + swz(r + 8, 8 * warp + nt) + col) =
          pack_bf16(O[mt][nt][2] * inv[1], O[mt][nt][3] * inv[1]);
    }
  }
  __syncthreads();
  uint4* out = reinterpret_cast<uint4*>(a.out + orow * kHeadDim);
  for (int i = t; i < kBlock * kChunks; i += kThreads)
    out[i] = *reinterpret_cast<const uint4*>(Q + swz(i / kChunks, i % kChunks));
}

}  // namespace

namespace ffi = xla::ffi;

static ffi::Error pool_attention(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::S32, 2> rows,
                                 ffi::Buffer<ffi::S32, 2> nvalid, ffi::Buffer<ffi::U8, 2> pool0,
                                 ffi::Buffer<ffi::U8, 2> pool1, ffi::Buffer<ffi::U8, 2> pool2,
                                 ffi::ResultBuffer<ffi::BF16, 3> out, ffi::ResultBuffer<ffi::F32, 2> lse,
                                 int32_t blocks0, int32_t blocks1, int32_t blocks2, int32_t splits, float scale,
                                 int32_t storage) {
  const auto qd = q.dimensions();
  const int64_t N = qd[0], H = qd[1];
  const int32_t nb = blocks0 + blocks1 + blocks2;
  if (storage != kOfficial && storage != kPerEntry)
    return ffi::Error::InvalidArgument("storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (qd[2] != kHeadDim || H % kBlock) return ffi::Error::InvalidArgument("q: expected bf16[N, H, 512], H % 64 == 0");
  if (nb < 1 || nb > kMaxBlocks || blocks0 < 0 || blocks1 < 0 || blocks2 < 0)
    return ffi::Error::InvalidArgument("blocks: expected 1..128 blocks of 64 rows in all");
  if (rows.dimensions()[0] != N || rows.dimensions()[1] != int64_t(nb) * kBlock || nvalid.dimensions()[0] != N ||
      nvalid.dimensions()[1] != nb)
    return ffi::Error::InvalidArgument("rows, nvalid: expected i32[N, blocks * 64] and i32[N, blocks]");
  if (splits < 1 || out->dimensions()[0] != N * splits || out->dimensions()[1] != H ||
      lse->dimensions()[0] != N * splits || lse->dimensions()[1] != H)
    return ffi::Error::InvalidArgument("out, lse: expected bf16[N * splits, H, 512] and f32[N * splits, H]");
  AttnArgs a{};
  const ffi::Buffer<ffi::U8, 2>* pools[kMaxParts] = {&pool0, &pool1, &pool2};
  const int32_t blocks[kMaxParts] = {blocks0, blocks1, blocks2};
  int32_t end = 0;
  for (int p = 0; p < kMaxParts; ++p) {
    const auto pd = pools[p]->dimensions();
    const int64_t E = entry_bytes(storage);
    if (pd[1] % E || (pd[1] / E) % 32)
      return ffi::Error::InvalidArgument("pools: expected u8[blocks, block_size * entry bytes], block_size % 32 == 0");
    end += blocks[p];
    a.part[p] = Part{pools[p]->typed_data(), pd[0] * (pd[1] / E), static_cast<int32_t>(pd[1] / E), end};
  }
  a.q = reinterpret_cast<const __nv_bfloat16*>(q.untyped_data());
  a.rows = rows.typed_data();
  a.nvalid = nvalid.typed_data();
  a.out = reinterpret_cast<__nv_bfloat16*>(out->untyped_data());
  a.lse = lse->typed_data();
  a.heads = static_cast<int32_t>(H);
  a.nb = nb;
  a.splits = splits;
  a.storage = storage;
  a.c = scale * 1.4426950408889634f;
  if (N == 0) return ffi::Error::Success();
  cudaFuncSetAttribute(pool_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  pool_attention_kernel<<<dim3(static_cast<unsigned>(N), static_cast<unsigned>(H / kBlock), splits), kThreads, kSmem,
                          stream>>>(a);
  return launch_status(cudaGetLastError(), "pool_attention");
}

}  // namespace jaxkv

namespace jaxkv::attention_types {  // buffer types without commas, so they can sit inside the macro
using Q = xla::ffi::Buffer<xla::ffi::BF16, 3>;
using Index = xla::ffi::Buffer<xla::ffi::S32, 2>;
using Pool = xla::ffi::Buffer<xla::ffi::U8, 2>;
using Out = xla::ffi::Buffer<xla::ffi::BF16, 3>;
using Lse = xla::ffi::Buffer<xla::ffi::F32, 2>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::attention_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPoolAttention, jaxkv::pool_attention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::attention_types::Stream>()
                                  .Arg<jaxkv::attention_types::Q>()      // q bf16[N, H, 512]
                                  .Arg<jaxkv::attention_types::Index>()  // rows i32[N, NB * 64]
                                  .Arg<jaxkv::attention_types::Index>()  // nvalid i32[N, NB]
                                  .Arg<jaxkv::attention_types::Pool>()   // pools, one per part
                                  .Arg<jaxkv::attention_types::Pool>()
                                  .Arg<jaxkv::attention_types::Pool>()
                                  .Ret<jaxkv::attention_types::Out>()    // bf16[N * splits, H, 512]
                                  .Ret<jaxkv::attention_types::Lse>()    // f32[N * splits, H]
                                  .Attr<int32_t>("blocks0")
                                  .Attr<int32_t>("blocks1")
                                  .Attr<int32_t>("blocks2")
                                  .Attr<int32_t>("splits")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("storage"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
