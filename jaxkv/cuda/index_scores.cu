// Lightning-indexer scores over FP4 indexer keys read in place:
// I[n, s] = sum_h w[n, h] * relu(q[n, h] . K[s]) for every entry s < count[n] of row n's
// request, -inf elsewhere (jaxkv.kernels.ref_index_scores' contract).
//
// One warpgroup per (row, chunk of 64-key tiles). Each thread loads 16 code bytes of two keys
// straight into registers: 32 dims, one MXFP4 scale group. It decodes the E2M1 nibbles to
// BF16 with byte permutes and scales them exactly, and the keys become wgmma's register
// operand. The row's queries sit in shared memory with their dims permuted the same way, so
// no thread needs another's bytes. The heads are reduced in registers; one float per entry
// is written. Decisions and measurements: docs/kernels/index_scores.md.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "ptx.cuh"

namespace jaxkv {
namespace {

constexpr int kKeys = 64;       // keys per tile: wgmma's M
constexpr int kHeadBlock = 64;  // heads per wgmma: its N
constexpr int kThreads = 128;   // one warpgroup
constexpr int kMaxHeadBlocks = 2;

struct Args {
  const uint32_t* q;     // bf16[N, H, 128], read as pairs
  const float* w;        // f32[N, H]
  const uint8_t* pool;   // u8[P, bs * key_bytes]: the layer's pages
  const int32_t* pages;  // i32[B, NP]
  const int32_t* count;  // i32[N]
  float* out;            // f32[N, NP * bs]
  int P, page_bytes, bs, NP, H, rows_per_request, chunks, tiles_per_chunk;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)  // the kernel's helpers: sm_90a only
constexpr int kQBlockBytes = kHeadBlock * kIndexDim * 2;  // one head block's BF16 queries

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Eight E2M1 codes (four packed bytes, element 2i in the low nibble) -> four BF16 pairs,
// o[i] = (byte i's low nibble, its high nibble). Magnitudes come from two 8-entry byte tables
// (each BF16's low and high byte) by byte permutes; each pair's two signs by one more.
__device__ __forceinline__ void e2m1x8_bf16(uint32_t w, uint32_t (&o)[4]) {
  // BF16 of 0, .5, 1, 1.5, 2, 3, 4, 6: low bytes 00 00 80 C0 00 40 80 C0, high 00 3F 3F 3F 40 40 40 40
  constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u, kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;
  const uint32_t m = w & 0x77777777u, m_hi = m >> 16, w4 = w << 4;
  const uint32_t lo_a = prmt(kLo0, kLo1, m), hi_a = prmt(kHi0, kHi1, m);  // nibbles 0..3
  const uint32_t lo_b = prmt(kLo0, kLo1, m_hi), hi_b = prmt(kHi0, kHi1, m_hi);
  o[0] = prmt(lo_a, hi_a, 0x5140) | (prmt(w, w4, 0x0040) & 0x80008000u);
  o[1] = prmt(lo_a, hi_a, 0x7362) | (prmt(w, w4, 0x1050) & 0x80008000u);
  o[2] = prmt(lo_b, hi_b, 0x5140) | (prmt(w, w4, 0x2060) & 0x80008000u);
  o[3] = prmt(lo_b, hi_b, 0x7362) | (prmt(w, w4, 0x3070) & 0x80008000u);
}

// UE8M0 byte -> 2^(e - 127) as a BF16 pair (e = 0: 2^-127, a BF16 subnormal; 0xFF: NaN).
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t e) {
  const uint32_t b = e == 0 ? 0x0040u : e == 0xFF ? 0x7FC0u : e << 7;
  return b * 0x00010001u;
}
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {  // exact for a power-of-two b
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// A BF16 pair of codes times a float32 multiplier, rounded once to BF16 as the NVFP4 decoder does.
__device__ __forceinline__ uint32_t mul_f32(uint32_t v, float s) {
  return pack_bf16(__uint_as_float(v << 16) * s, __uint_as_float(v & 0xFFFF0000u) * s);
}

__device__ __forceinline__ uint4 ld_stream(const void* p) {  // read once: bypass L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A thread's bytes of one tile: rows lane / 4 and + 8 of its warp's 16 keys, bytes
// [16 t, 16 t + 16) of each (t = lane % 4), their scale bytes and (per_entry) global scales.
struct TileBytes {
  uint4 code[2];
  uint32_t scale[2];
  float global[2];
};

template <int S>
__device__ __forceinline__ TileBytes load_tile(const Args& a, const uint8_t* page, int row, int t) {
  TileBytes b;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int k = row + 8 * r;
    b.code[r] = ld_stream(page + k * (kIndexDim / 2) + 16 * t);
    const uint8_t* scales = page + a.bs * (kIndexDim / 2);
    if constexpr (S == kOfficial) {
      b.scale[r] = scales[k * kOffKeyScales + t];
      b.global[r] = 1.f;
    } else {
      b.scale[r] = *reinterpret_cast<const uint16_t*>(scales + k * kPeKeyScales + 2 * t);
      b.global[r] = *reinterpret_cast<const float*>(scales + a.bs * kPeKeyScales + k * kPeKeyGlobal);
    }
  }
  return b;
}

// The tile's keys as wgmma A fragments: A[k] for k-step k holds (row, col) pairs (lane/4, 2t),
// (+8, 2t), (lane/4, 2t + 8), (+8, 2t + 8). Byte 2k of the thread's 16 goes to cols 2t, 2t+1 of
// k-step k, byte 2k + 1 to cols 2t + 8, 2t + 9: logical column c of k-step k is dim
// 32 (c % 8) / 2 + 4 k + (c >= 8 ? 2 : 0) + c % 2, the order the queries are stored in.
template <int S>
__device__ __forceinline__ void decode_tile(const TileBytes& b, uint32_t (&A)[8][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t words[4] = {b.code[r].x, b.code[r].y, b.code[r].z, b.code[r].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t o[4];
      e2m1x8_bf16(words[j], o);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (S == kOfficial) {
          o[i] = mul_bf16x2(o[i], e8m0_bf16x2(b.scale[r]));
        } else {  // E4M3 per 16 dims: bytes 0-7 of the thread's 16 are group 2t, 8-15 group 2t + 1
          o[i] = mul_f32(o[i], fp8_e4m3_value(uint8_t(b.scale[r] >> (8 * (j >> 1)))) * b.global[r]);
        }
      }
      A[2 * j][r] = o[0];
      A[2 * j][2 + r] = o[1];
      A[2 * j + 1][r] = o[2];
      A[2 * j + 1][2 + r] = o[3];
    }
  }
}

#endif

template <int HB, int S>
__global__ void __launch_bounds__(kThreads, 3) index_scores_kernel(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(1024) uint8_t qs[HB * kQBlockBytes];
  const int n = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int req = n / a.rows_per_request, sub = a.bs / kKeys, NT = a.NP * sub;
  const int first = chunk * a.tiles_per_chunk, last = min(first + a.tiles_per_chunk, NT);
  const int count = a.count[n];
  const int todo = max(min((count + kKeys - 1) / kKeys, last) - first, 0);  // tiles holding counted entries
  float* out = a.out + static_cast<int64_t>(n) * NT * kKeys;

  // tiles past count: -inf, nothing read
  for (int i = first * kKeys + todo * kKeys + tid; i < last * kKeys; i += kThreads) out[i] = -INFINITY;
  if (todo == 0) return;

  // the row's queries, K-major and 128-byte swizzled, dims permuted as decode_tile's columns:
  // 16-byte chunk c of head h's logical row holds its pairs c, 16 + c, 32 + c, 48 + c
  const uint32_t* q = a.q + static_cast<int64_t>(n) * a.H * (kIndexDim / 2);
  for (int i = tid; i < HB * kHeadBlock * 16; i += kThreads) {
    const int h = i >> 4, c = i & 15;
    const uint32_t* src = q + h * (kIndexDim / 2);
    *reinterpret_cast<uint4*>(qs + (h >> 6) * kQBlockBytes + swz(h & 63, c)) =
        make_uint4(src[c], src[16 + c], src[32 + c], src[48 + c]);
  }
  float wr[HB][16];  // weights of this thread's accumulator columns: heads 8 i + 2 t + {0, 1}
#pragma unroll
  for (int hb = 0; hb < HB; ++hb)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) wr[hb][2 * i + e] = a.w[static_cast<int64_t>(n) * a.H + hb * 64 + 8 * i + 2 * t + e];
  fence_async_smem();
  __syncthreads();

  const int32_t* pages = a.pages + static_cast<int64_t>(req) * a.NP;
  const int row = warp * 16 + g;
  auto load = [&](int tile, bool& ok) {
    const int p = pages[tile / sub];
    ok = p >= 0 && p < a.P;
    const uint8_t* page = a.pool + static_cast<int64_t>(ok ? p : 0) * a.page_bytes;
    return load_tile<S>(a, page, (tile % sub) * kKeys + row, t);
  };

  bool ok;
  TileBytes cur = load(first, ok);
  for (int i = 0; i < todo; ++i) {
    const int tile = first + i;
    const bool cur_ok = ok;
    TileBytes nxt = cur;
    if (i + 1 < todo) nxt = load(tile + 1, ok);  // in flight while this tile computes

    uint32_t A[8][4];
    decode_tile<S>(cur, A);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      float d[32];
      const uint32_t base = smem_addr(qs + hb * kQBlockBytes);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 8; ++k) wgmma_rs_kmajor(d, A[k], wgmma_desc(base + (k >> 2) * 8192 + (k & 3) * 32), k);
      wgmma_commit();
      wgmma_wait();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[0] = fmaf(fmaxf(d[4 * j], 0.f), wr[hb][2 * j], s[0]);
        s[0] = fmaf(fmaxf(d[4 * j + 1], 0.f), wr[hb][2 * j + 1], s[0]);
        s[1] = fmaf(fmaxf(d[4 * j + 2], 0.f), wr[hb][2 * j], s[1]);
        s[1] = fmaf(fmaxf(d[4 * j + 3], 0.f), wr[hb][2 * j + 1], s[1]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      s[r] += __shfl_xor_sync(0xffffffffu, s[r], 1);
      s[r] += __shfl_xor_sync(0xffffffffu, s[r], 2);
    }
    if (t < 2) {  // lane t = 0 writes row lane / 4, t = 1 row lane / 4 + 8
      const int key = tile * kKeys + row + 8 * t;
      out[key] = cur_ok && key < count ? s[t] : -INFINITY;
    }
    cur = nxt;
  }
#else
  __trap();  // the handler refuses devices other than sm_90
#endif
}

template <int HB, int S>
cudaError_t launch(const Args& a, int grid, cudaStream_t stream) {
  index_scores_kernel<HB, S><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

namespace ffi = xla::ffi;

// Only enqueues work on XLA's stream (no host sync, no allocation): command-buffer compatible.
// w comes in as its whole (flattened) stack; this call's f32[N, H] starts at w_offset.
static ffi::Error index_scores(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::F32, 1> w,
                               ffi::Buffer<ffi::U8, 3> pool, ffi::Buffer<ffi::S32, 2> pages,
                               ffi::Buffer<ffi::S32, 1> count, ffi::ResultBuffer<ffi::F32, 2> out, int32_t layer,
                               int32_t storage, int32_t tiles, int64_t w_offset) {
  const auto qd = q.dimensions(), pd = pool.dimensions(), td = pages.dimensions();
  const int64_t N = qd[0], H = qd[1], L = pd[0], P = pd[1], page_bytes = pd[2], B = td[0], NP = td[1];
  if (storage != kOfficial && storage != kPerEntry) return ffi::Error::InvalidArgument("storage: unknown family");
  const int kb = key_bytes(storage);
  if (qd[2] != kIndexDim || H % kHeadBlock || H > kMaxHeadBlocks * kHeadBlock)
    return ffi::Error::InvalidArgument("q: expected bf16[N, H, 128] with H 64 or 128");
  if (page_bytes % (kKeys * kb)) return ffi::Error::InvalidArgument("pool: expected pages of a multiple of 64 keys");
  if (B == 0 || N % B || count.dimensions()[0] != N || w_offset < 0 || w_offset + N * H > w.dimensions()[0])
    return ffi::Error::InvalidArgument(
        "pages, count, weights: expected B dividing N, count i32[N], weights f32[N, H] at w_offset");
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("layer: out of range");
  if (tiles < 1) return ffi::Error::InvalidArgument("tiles: expected >= 1");
  const int bs = static_cast<int>(page_bytes / kb);
  if (out->dimensions()[0] != N || out->dimensions()[1] != NP * bs)
    return ffi::Error::InvalidArgument("out: expected f32[N, pages_per_request * block_size]");
  if (!on_hopper()) return ffi::Error::InvalidArgument("index_scores: needs an sm_90 GPU (wgmma)");
  if (N == 0 || NP == 0) return ffi::Error::Success();
  const int NT = static_cast<int>(NP * (bs / kKeys)), chunks = (NT + tiles - 1) / tiles;
  Args a{reinterpret_cast<const uint32_t*>(q.untyped_data()),
         w.typed_data() + w_offset,
         pool.typed_data() + layer * P * page_bytes,
         pages.typed_data(),
         count.typed_data(),
         out->typed_data(),
         static_cast<int>(P),
         static_cast<int>(page_bytes),
         bs,
         static_cast<int>(NP),
         static_cast<int>(H),
         static_cast<int>(N / B),
         chunks,
         tiles};
  const int64_t grid = N * chunks;
  if (grid >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("q, pages: too many rows x tiles");
  cudaError_t e;
  if (H == kHeadBlock)
    e = storage == kOfficial ? launch<1, kOfficial>(a, grid, stream) : launch<1, kPerEntry>(a, grid, stream);
  else
    e = storage == kOfficial ? launch<2, kOfficial>(a, grid, stream) : launch<2, kPerEntry>(a, grid, stream);
  return launch_status(e, "index_scores");
}

}  // namespace jaxkv

namespace jaxkv::index_scores_types {  // buffer types without commas, so they can sit inside the macro
using Q = xla::ffi::Buffer<xla::ffi::BF16, 3>;
using W = xla::ffi::Buffer<xla::ffi::F32, 1>;
using Pool = xla::ffi::Buffer<xla::ffi::U8, 3>;
using Pages = xla::ffi::Buffer<xla::ffi::S32, 2>;
using Count = xla::ffi::Buffer<xla::ffi::S32, 1>;
using Out = xla::ffi::Buffer<xla::ffi::F32, 2>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::index_scores_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvIndexScores, jaxkv::index_scores,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::index_scores_types::Stream>()
                                  .Arg<jaxkv::index_scores_types::Q>()      // bf16[N, H, 128]
                                  .Arg<jaxkv::index_scores_types::W>()      // the stack of f32[N, H], flattened
                                  .Arg<jaxkv::index_scores_types::Pool>()   // u8[L, P, bs * key_bytes]
                                  .Arg<jaxkv::index_scores_types::Pages>()  // i32[B, NP]
                                  .Arg<jaxkv::index_scores_types::Count>()  // i32[N]
                                  .Ret<jaxkv::index_scores_types::Out>()    // f32[N, NP * bs]
                                  .Attr<int32_t>("layer")
                                  .Attr<int32_t>("storage")
                                  .Attr<int32_t>("tiles")
                                  .Attr<int64_t>("w_offset"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
