// Pool attention for DeepSeek-V4 (MQA, K = V, head_dim 512): per query row, softmax(q K^T)
// K over FP8 pool rows read where they are stored, in either storage family. The rows come
// in blocks of 64 (a row list per query, a valid-row count per block). Key splits, where the
// batch does not fill the GPU, leave a normalized partial per split with its base-2
// log-sum-exp, merged with the sink by XLA (jaxkv.kernels.pool_attention: shapes, reference,
// that merge), except two splits at 64 heads, which merge inside the kernel. With one partial
// per query left the kernel adds the sink to the denominator itself and its output is the
// attention.
//
// Hopper (sm_90a), warp-specialized: one CTA of 3 warpgroups per (query row, 64 heads, key
// split), 1 CTA per SM (about 205 KiB of shared memory: Q, two BF16 K stages, P).
//   * at 64 heads, two splits run as a 2-CTA cluster and merge at the end: each CTA owns one
//     warpgroup's output dims, the peer's weighted partial of them comes through distributed
//     shared memory into its K stages (free by then) and is added to its own, so no partial
//     reaches global memory and no merge kernel runs. More splits merge in XLA (larger
//     clusters run in two waves: docs/kernels/pool_attention.md);
//   * the producer warpgroup lists the non-empty blocks while the consumers load Q (alone, the
//     consumers then load and dequantize the first block, the producer the rest), then loads
//     a block's raw row bytes (576 B of codes + rope, the scale bytes) into registers one block
//     ahead (its row ids one block further), dequantizes them into a free BF16 K stage (the
//     bytes of jaxkv.formats' decoders) in the wgmma 128-byte swizzle layout (``swz``), and
//     signals the stage's mbarrier. With 128 heads or more, the CTAs of a query row's head
//     groups 2 g and 2 g + 1 run as a 2-CTA cluster: each producer gathers half the block's
//     rows (two blocks ahead: half a block fits the registers twice) and stores them
//     dequantized into both CTAs' K stage (the peer's by st.async), so an SM gathers 32 rows
//     per block, not 64 (FlashMLA's pairing);
//   * warpgroup 0: S = Q K^T by wgmma m64n64k16 (Q and K from shared memory), the online
//     softmax over whole rows in registers (base 2), P to shared memory for warpgroup 1, then
//     O[:, :256] = alpha O + P V with P from registers (m64n256k16);
//   * warpgroup 1: O[:, 256:] = alpha O + P V with P from shared memory. V is the same K stage
//     read N-major (transposed): the dequantized tile is both operands.
// So the CUDA cores' dequantization of block j + 1 runs under the tensor cores' products of
// block j. At 64 heads the gather bounds it; paired, no one part does. 64 heads stay unpaired
// (twice the CTAs would not pay: docs/kernels/pool_attention.md). Rows past a block's count,
// and ids outside their pool, are zero-filled and masked: no read outside a pool.
// Deterministic: a fixed order of every sum. sm_90a only (wgmma, setmaxnreg); the launcher
// refuses other devices.
// Why CUDA and not Mosaic GPU: a block's rows are scattered over the pool and Mosaic GPU has
// no per-thread gather; per-row TMAs cost more than the math (kernels.pool_attention).
// One producer warpgroup, although at 64 heads the row loads bound the kernel: a second one
// does not pay for its registers (docs/kernels/pool_attention.md).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "codes.cuh"
#include "ffi_handler.cuh"
#include "ptx.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {
namespace {

constexpr int kBlock = 64;                 // keys per block; heads per CTA
constexpr int kThreads = 384;              // warpgroups: 0 and 1 consume, 2 produces
constexpr int kStages = 2;                 // BF16 K stages in flight
constexpr int kChunks = kHeadDim / 8;      // 16-byte BF16 chunks of a row (64)
constexpr int kCodeChunks = kNope / 16;    // 16-byte FP8 chunks of a row (28)
constexpr int kRawChunks = kOffData / 16;  // codes + rope (36)
constexpr int kPerThread = kRawChunks / 4; // chunks a producer thread loads per row (9)
constexpr int kMaxParts = 3;
constexpr int kMaxBlocks = 128;
static_assert(kRawChunks == 4 * kPerThread && kCodeChunks == 4 * (kNope / kTile) && kHeadDim == 2 * 256, "layout");

// shared memory, bytes
constexpr int kTileBytes = kBlock * kHeadDim * 2;  // a BF16 [64, 512] tile: Q, a K stage
constexpr int kPBytes = kBlock * kBlock * 2;
constexpr int kSmem = 1024 + (1 + kStages) * kTileBytes + kPBytes + 3 * kBlock * 4 + kStages * kBlock +
                      2 * kMaxBlocks * 4 + 16 + 3 * kStages * 8;
// registers per thread after setmaxnreg: 128 x (208 + 168 + 128) = 384 x 168 (as launched); no spills
constexpr int kRegs0 = 208, kRegs2 = 128;
constexpr int kBarP = 1, kBarPFree = 2, kBarOut = 3, kBarList = 4, kBarReady = 5;  // named barriers (0: __syncthreads)
constexpr int kConsumerWarps = 8;                     // arrivals a K stage's `free` barrier takes per CTA

struct Part {
  const uint8_t* pool;  // u8[blocks, bs * E]: the call's span of its pool
  int64_t items;        // blocks * bs: ids in [0, items) are rows of the span
  int32_t bs;
  int32_t end;          // the part owns list blocks [previous end, end)
};

struct AttnArgs {
  const __nv_bfloat16* q;  // bf16[N, H, 512]
  const int32_t* rows;     // i32[N, NB * 64]
  const int32_t* nvalid;   // i32[N, NB]
  Part part[kMaxParts];
  const float* sink;       // f32[H]  per-head logit in the denominator (used with one partial per query left)
  __nv_bfloat16* out;      // bf16[N * parts, H, 512]  parts = splits / kSplits
  float* lse;              // f32[N * parts, H]
  int32_t heads, nb, splits, storage;
  float c;                 // softmax scale * log2(e)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXKV_POOL_SM90 1
// ---- the producer ---------------------------------------------------------------------------
// Producer thread t (of 128) owns rows t / 4 and 32 + t / 4 of a block and their 16-byte
// chunks t % 4 + 4 k (k < 9: 7 of codes, then 2 of rope): a warp reads 64 contiguous bytes of
// each of 8 rows per load, and its 16-byte stores into the swizzled tile spread evenly over
// the bank groups. In a 2-CTA cluster, CTA rank r's producer thread t owns row 32 r + t / 4
// only. A block's rows take two dependent global reads (the row ids, then the rows), so the
// producer runs them a block apart: while it stores block j it holds block j + 1's ids (j + 2
// in a cluster). Alone in its CTA (64 heads), once it has stored one of its two rows of block
// j it loads the same row of block j + 1 into the registers just freed, so that load is in
// flight while it dequantizes the other row; the consumers, not the producer, fence the stage
// for the tensor cores (fence.proxy.async is MEMBAR.ALL.CTA in SASS, which would wait for the
// thread's loads in flight; docs/kernels/pool_attention.md). In a cluster the producer fences
// its stores itself, as FlashMLA does, and loads the rows of block j + 2 after them. Rows go
// through registers, not cp.async into the free stage, whose loads could start only once the
// consumers free it (docs/kernels/pool_attention.md).
template <int kPairs>
struct RowIds {
  static constexpr int kRows = 2 / kPairs;
  int id[kRows];  // the pool ids of this thread's rows
  int peer;       // cluster: the id of the peer's row 32 (1 - r) + t / 4
  int b, nv;      // the block (-1: past the split's last) and its valid-row count
};
template <int kPairs>
struct RawRows {
  static constexpr int kRows = 2 / kPairs;
  uint4 v[kRows][kPerThread];  // the chunks
  uint2 s[kRows];              // official: the 8 scale bytes; per_entry: the f32 scale in .x
  bool ok[kRows];              // a real row
  bool peer_ok;                // cluster: the peer's row is real (its flag is set here)
};

// 16 bytes of a pool row, bypassing L1 (each is read once), fetched into L2 by 256 B (a row is 576 B)
__device__ __forceinline__ uint4 ld_row16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// the ids of this thread's rows of list block b (b < 0: none)
template <int kPairs>
__device__ __forceinline__ RowIds<kPairs> fetch_ids(const AttnArgs& a, int64_t n, int b, const int* nv_s,
                                                    int rank) {  // the producer's rows
  RowIds<kPairs> ids;
  ids.b = b;
  ids.nv = b >= 0 ? nv_s[b] : 0;
  const int32_t* rows = a.rows + (n * a.nb + max(b, 0)) * kBlock;
  const int t = threadIdx.x & 127;
#pragma unroll
  for (int h = 0; h < ids.kRows; ++h) ids.id[h] = b >= 0 ? __ldg(rows + 32 * (h + rank) + (t >> 2)) : -1;
  ids.peer = kPairs == 2 && b >= 0 ? __ldg(rows + 32 * (1 - rank) + (t >> 2)) : -1;
  return ids;
}
__device__ __forceinline__ const Part& part_of(const AttnArgs& a, int b) {
  int p = 0;
#pragma unroll
  for (int i = 0; i < kMaxParts - 1; ++i) p += b >= a.part[i].end;
  return a.part[p];
}
// row h of the block ``ids`` names -> raw (zeros and !ok past the count, for ids outside the pool);
// ``t``, the loading thread: a producer's (0-127), or alone a consumer's (0-255) for a split's first block
template <int kPairs>
__device__ __forceinline__ void load_row(const AttnArgs& a, const RowIds<kPairs>& ids, int h, int rank,
                                         RawRows<kPairs>& raw, int t = threadIdx.x & 127) {
  const int q4 = t & 3;
  const Part& P = part_of(a, max(ids.b, 0));
  const bool official = a.storage == kOfficial;
  if (kPairs == 2 && h == 0) {
    const int r = 32 * (1 - rank) + (t >> 2);
    raw.peer_ok = r < ids.nv && ids.peer >= 0 && ids.peer < P.items;
  }
  const int r = 32 * (h + rank) + (t >> 2), id = ids.id[h];
  const bool valid = r < ids.nv && id >= 0 && id < P.items;
  const int64_t blk = valid ? id / P.bs : 0;
  const int sl = valid ? id % P.bs : 0;
  const uint8_t* base = P.pool + blk * P.bs * entry_bytes(a.storage);
  const uint8_t* codes = base + sl * (official ? kOffData : kPeCodes);
  const uint8_t* rope = official ? codes + kNope : base + P.bs * kPeCodes + sl * kPeRope;
  const uint8_t* sc = base + P.bs * kOffData + sl * (official ? kOffScales : kPeScale);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int c = q4 + 4 * k;
    raw.v[h][k] = valid ? ld_row16(k < kCodeChunks / 4 ? codes + 16 * c : rope + 16 * (c - kCodeChunks))
                        : make_uint4(0, 0, 0, 0);
  }
  raw.s[h] = !valid ? make_uint2(0, 0)
             : official ? __ldg(reinterpret_cast<const uint2*>(sc))
                        : make_uint2(__ldg(reinterpret_cast<const uint32_t*>(sc)), 0);
  raw.ok[h] = valid;
}

// a UE8M0 byte as a bf16x2 pair of its power of two (0xFF: NaN; 0: 2^-127, a bf16 subnormal)
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t e) {
  const uint32_t h = e == 0xFF ? 0x7FC0u : e == 0 ? 0x0040u : e << 7;
  return h | (h << 16);
}

// 16 bytes of the K stage: here, and in a cluster at the same offset of the peer's stage
// (``peer_k``: that stage's shared::cluster address), counted on the peer's ``peer_bar``
template <int kPairs>
__device__ __forceinline__ void put16(uint8_t* K, uint32_t off, uint4 v, uint32_t peer_k, uint32_t peer_bar) {
  *reinterpret_cast<uint4*>(K + off) = v;
  if (kPairs == 2) st_async16(peer_k + off, v, peer_bar);
}

// loaded row h -> the BF16 K stage (swizzled) and its row flag (in a cluster, the peer's row's
// flag too). The codes' exact values times the scale, rounded to BF16: official scales are
// powers of two, so one bf16 multiply is exact (it and the reference's f32 product differ only
// below 2^-126, past the encoder's smallest scale); per_entry scales are any f32, multiplied in
// f32 as the reference does.
template <int kPairs>
__device__ __forceinline__ void store_row(const RawRows<kPairs>& raw, int h, int rank, uint8_t* K, uint8_t* ok,
                                          uint32_t peer_k, uint32_t peer_bar, bool official, int t = threadIdx.x & 127) {
  const int q4 = t & 3;
  if (kPairs == 2 && q4 == 1) ok[32 * (1 - rank) + (t >> 2)] = raw.peer_ok;
  const int r = 32 * (h + rank) + (t >> 2);
  // bf16x2 words decoded before they are stored: in a cluster 4 (16 bytes at a time: fewer
  // registers live), alone 8 (docs/kernels/pool_attention.md)
  constexpr int kWords = kPairs == 2 ? 4 : 8;
#pragma unroll
  for (int k = 0; k < kCodeChunks / 4; ++k) {  // chunk c = q4 + 4 k lies in scale tile k
    const int c = q4 + 4 * k;
    const uint32_t w[4] = {raw.v[h][k].x, raw.v[h][k].y, raw.v[h][k].z, raw.v[h][k].w};
#pragma unroll
    for (int e = 0; e < 8 / kWords; ++e) {  // the chunk's 32 bytes kWords * 4 at a time
      uint32_t o[kWords];
      if (official) {
        const uint32_t s2 = e8m0_bf16x2(((k < 4 ? raw.s[h].x : raw.s[h].y) >> (8 * (k & 3))) & 0xFF);
#pragma unroll
        for (int i = 0; i < kWords / 2; ++i) {
          o[2 * i] = bf16x2_mul(e4m3x2_to_bf16x2(w[e * kWords / 2 + i], 0x1404), s2);
          o[2 * i + 1] = bf16x2_mul(e4m3x2_to_bf16x2(w[e * kWords / 2 + i], 0x3424), s2);
        }
      } else {
        const float s = __uint_as_float(raw.s[h].x);
#pragma unroll
        for (int i = 0; i < kWords / 2; ++i) {
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const uint32_t x = e4m3x2_to_bf16x2(w[e * kWords / 2 + i], u ? 0x3424 : 0x1404);
            o[2 * i + u] = pack_bf16(__fmul_rn(__uint_as_float(x << 16), s), __fmul_rn(__uint_as_float(x & 0xFFFF0000u), s));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kWords / 4; ++u)
        put16<kPairs>(K, swz(r, 2 * c + e * kWords / 4 + u), make_uint4(o[4 * u], o[4 * u + 1], o[4 * u + 2], o[4 * u + 3]),
                      peer_k, peer_bar);
    }
  }
#pragma unroll
  for (int k = kCodeChunks / 4; k < kPerThread; ++k) {  // rope: BF16 already
    const int c = q4 + 4 * k;
    put16<kPairs>(K, swz(r, c + kCodeChunks), raw.v[h][k], peer_k, peer_bar);
  }
  if (q4 == 0) ok[r] = raw.ok[h];
}
#endif  // sm_90a

// A 2-CTA cluster along y or z, or none: a query row's head groups 2 g and 2 g + 1 (kPairs = 2;
// the cluster rank is the pair rank), or its two key splits (kSplits = 2, merged at the end;
// the cluster rank is the split's).
template <int kPairs, int kSplits>
__device__ __forceinline__ void pool_attention_cta(const AttnArgs& a) {
#ifdef JAXKV_POOL_SM90
  constexpr bool kCluster = kPairs * kSplits > 1;
  constexpr int kOwn = kChunks / kSplits;  // 8-dim output chunks a split owns in the merge
  static_assert(kPairs * kSplits <= 2, "one CTA per SM: clusters of 4 or 8 run in two waves (docs/kernels/pool_attention.md)");
  static_assert(kSplits == 1 || kOwn == 32, "two splits: each owns one warpgroup's output dims");
  static_assert(kOwn * 128 * 16 <= kStages * kTileBytes, "the peer's partial fits the K stages");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // the swizzled tiles need 1024-byte alignment (the swizzle reads address bits 7..9)
  uint8_t* Q = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // bf16[64, 512]; the output at the end
  uint8_t* Ks = Q + kTileBytes;                          // bf16[stages][64, 512] swizzled; the peer's partial at the end
  uint8_t* P = Ks + kStages * kTileBytes;                // bf16[64, 64] swizzled
  float* alpha_s = reinterpret_cast<float*>(P + kPBytes);  // f32[64] the block's rescale of each row
  float* ml = alpha_s + kBlock;                          // f32[64, 2] each row's final (max, sum), for the merge
  uint8_t* ok = reinterpret_cast<uint8_t*>(ml + 2 * kBlock);  // u8[stages][64] real keys of each stage
  int* nv_s = reinterpret_cast<int*>(ok + kStages * kBlock);  // i32[128]
  int* list = nv_s + kMaxBlocks;                         // i32[128] non-empty blocks, in order
  int* total_s = list + kMaxBlocks;
  uint64_t* bars = reinterpret_cast<uint64_t*>(total_s + 4);  // 8-byte aligned: full, free, peer_full [stages]
  const uint32_t full = smem_addr(bars), free_ = full + 8 * kStages, peer_full = free_ + 8 * kStages;
  const int rank = kPairs == 2 ? static_cast<int>(cluster_ctarank()) : 0;  // this CTA's half of a pair

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, wg = t >> 7;
  const int64_t n = blockIdx.x;
  const int hg = blockIdx.y, split = blockIdx.z;
  const int zr = split % kSplits, part = split / kSplits, parts = a.splits / kSplits;  // rank in the merge; the partial
  const bool official = a.storage == kOfficial;

  // full[s]: this CTA's producer stored its rows of stage s; peer_full[s] (pairs): the
  // peer's rows landed here (one arrival + their bytes); free[s]: every consumer warp of the
  // pair is done with stage s (both CTAs' stages are written by both producers)
  if (t == 32) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, 128);
      mbar_init(free_ + 8 * s, kConsumerWarps * kPairs);
      if (kPairs == 2) mbar_init(peer_full + 8 * s, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (kPairs == 2) {
    cluster_sync();  // the peer's barriers exist before anything reaches them
  } else {
    __syncthreads();  // split pairs touch each other only after the loops, behind a cluster barrier
  }
  // The prologue runs in two parts at once: the consumers load Q while the producer lists
  // the non-empty blocks (the path to the first product is three dependent global reads: the
  // counts, the ids, the rows). Then, alone (64 heads), the consumers load and dequantize the
  // first block themselves, one row per four threads, while the producer starts on the second
  // (with the producer's two rows per thread, the second row's loads would queue behind the
  // first's). The first block's ids are read after the counts, not guessed beside them
  // (docs/kernels/pool_attention.md).
  if (wg == 2) {
    if (t - 256 < a.nb) nv_s[t - 256] = min(max(__ldg(a.nvalid + n * a.nb + t - 256), 0), kBlock);
    bar_sync(kBarList, 128);
    if (warp == 8) {  // the non-empty blocks, in order: a ballot per 32
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
    bar_sync(kBarList, 128);
    bar_arrive(kBarReady, kThreads);  // the list -> the consumers
  } else {
    const __nv_bfloat16* qn = a.q + (n * a.heads + hg * kBlock) * kHeadDim;
    for (int i = t; i < kBlock * kChunks; i += 256) {
      const int r = i / kChunks, c = i % kChunks;
      *reinterpret_cast<uint4*>(Q + swz(r, c)) = __ldg(reinterpret_cast<const uint4*>(qn + r * kHeadDim + 8 * c));
    }
    fence_async_smem();
    bar_sync(kBarReady, kThreads);  // also: both consumer warpgroups' parts of Q are in
  }
  const int total = *total_s;
  const int per = (total + a.splits - 1) / a.splits;
  const int j0 = min(split * per, total), j1 = min(j0 + per, total), blocks = j1 - j0;
  // alone, the consumers' first block -> stage 0 (thread t: row t / 4; the prologue's comment)
  constexpr int kFirst = kPairs == 1 ? 1 : 0;  // the producer's first block
  if (kPairs == 1 && wg < 2 && blocks > 0) {
    RowIds<kPairs> ids0;
    ids0.b = list[j0];
    ids0.nv = nv_s[ids0.b];
    ids0.id[0] = __ldg(a.rows + (n * a.nb + ids0.b) * kBlock + (t >> 2));
    RawRows<kPairs> raw0;
    load_row<kPairs>(a, ids0, 0, 0, raw0, t);
    store_row<kPairs>(raw0, 0, 0, Ks, ok, 0, 0, official, t);
    bar_sync(kBarOut, 256);  // the consumers' rows of stage 0 are in
    if (wg == 0) mbar_arrive(full);  // its 128 arrivals
  }

  // a consumer warp is done with stage s: one arrival on each of the pair's free[s]
  auto release = [&](int s) {
    if (lane == 0) {
      if (kPairs == 1) {
        mbar_arrive(free_ + 8 * s);
      } else {
        mbar_arrive_cluster(mapa(free_ + 8 * s, 0));
        mbar_arrive_cluster(mapa(free_ + 8 * s, 1));
      }
    }
  };

  if (wg == 2) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs2));
    const uint32_t peer_k = kPairs == 2 ? mapa(smem_addr(Ks), 1 - rank) : 0;
    const uint32_t peer_bar = kPairs == 2 ? mapa(peer_full, 1 - rank) : 0;
    auto ids_of = [&](int i) { return fetch_ids<kPairs>(a, n, i < blocks ? list[j0 + i] : -1, nv_s, rank); };
    auto load = [&](const RowIds<kPairs>& ids, RawRows<kPairs>& raw) {
#pragma unroll
      for (int h = 0; h < raw.kRows; ++h)
        if (ids.b >= 0) load_row<kPairs>(a, ids, h, rank, raw);
    };
    // block i's rows -> stage i % kStages, and the rows of block i + kPairs (``next``) -> raw:
    // alone, each row's load right after that row's store; in a cluster, after the stage's
    // fence and arrival
    auto put = [&](int i, RawRows<kPairs>& raw, const RowIds<kPairs>& next) {
      const int s = i % kStages;
      mbar_wait(free_ + 8 * s, ((i / kStages) & 1) ^ 1);
      // the peer's half of stage s: its bytes complete the phase (they may land before this)
      if (kPairs == 2 && t == 256) mbar_arrive_expect_tx(peer_full + 8 * s, 32 * kHeadDim * 2);
      if constexpr (kPairs == 1) {  // row h of the next block in flight while row 1 - h is stored
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          store_row<kPairs>(raw, h, rank, Ks + s * kTileBytes, ok + s * kBlock, 0, 0, official);
          if (h == 1) mbar_arrive(full + 8 * s);  // unfenced: the consumers fence the stage
          if (next.b >= 0) load_row<kPairs>(a, next, h, rank, raw);
        }
      } else {
        store_row<kPairs>(raw, 0, rank, Ks + s * kTileBytes, ok + s * kBlock, peer_k + s * kTileBytes,
                          peer_bar + 8 * s, official);
        fence_async_smem();
        mbar_arrive(full + 8 * s);
        load(next, raw);
      }
    };
    RowIds<kPairs> ids = ids_of(kFirst);
    if (kPairs == 2) {  // half the rows each: registers for two blocks in flight
      RawRows<kPairs> r0, r1;
      load(ids, r0);
      ids = ids_of(1);
      load(ids, r1);
      ids = ids_of(2);
      for (int i = 0; i < blocks; i += 2) {
        put(i, r0, ids);
        ids = ids_of(i + 3);
        if (i + 1 < blocks) {
          put(i + 1, r1, ids);
          ids = ids_of(i + 4);
        }
      }
    } else {
      RawRows<kPairs> raw;
      load(ids, raw);
      ids = ids_of(kFirst + 1);
      for (int i = kFirst; i < blocks; ++i) {
        put(i, raw, ids);
        ids = ids_of(i + 2);
      }
    }
    if (kCluster) cluster_sync();  // the consumers': the loops are done
    if (kSplits > 1) cluster_sync();  // the partials are exchanged
    return;
  }

  // consumers: warp w of warpgroup wg holds rows (heads) 16 (w % 4) + lane / 4 (+ 8) of the
  // accumulators; O: output dims 256 wg + 8 j + 2 (lane % 4) (+ 1) in O[4 j ..]
  const int row0 = 16 * (warp & 3) + (lane >> 2);
  const uint32_t q_s = smem_addr(Q), k_s = smem_addr(Ks), p_s = smem_addr(P);
  float O[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) O[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  if (wg == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs0));
    for (int i = 0; i < blocks; ++i) {
      const int s = i % kStages;
      const uint32_t ks = k_s + s * kTileBytes;
      mbar_wait(full + 8 * s, (i / kStages) & 1);
      if (kPairs == 2) mbar_wait(peer_full + 8 * s, (i / kStages) & 1);
      if (kPairs == 1) fence_async_smem();  // the producer's stores -> this warpgroup's wgmma
      float S[32];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const uint32_t off = (kk >> 2) * (kBlock * 128) + (kk & 3) * 32;
        wgmma_ss(S, wgmma_desc(q_s + off), wgmma_desc(ks + off), kk > 0);
      }
      wgmma_commit();
      wgmma_wait();
      // the online softmax over the block's 64 keys (base 2): whole rows in this warpgroup
      const uint8_t* okb = ok + s * kBlock;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * (lane & 3);
        if (!okb[col]) S[4 * j] = S[4 * j + 2] = -INFINITY;
        if (!okb[col + 1]) S[4 * j + 1] = S[4 * j + 3] = -INFINITY;
      }
      uint32_t Pr[4][4];  // P as wgmma's A operand: [k step][fragment]
      float alpha[2];
      softmax_block<8>(S, a.c, m, l, Pr, alpha);
      // P and the row rescales -> warpgroup 1, once it is done with the previous block's
      bar_sync(kBarPFree, 256);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t col = 4 * (lane & 3);
        *reinterpret_cast<uint32_t*>(P + swz(row0, j) + col) = Pr[j >> 1][(j & 1) * 2];
        *reinterpret_cast<uint32_t*>(P + swz(row0 + 8, j) + col) = Pr[j >> 1][(j & 1) * 2 + 1];
      }
      if ((lane & 3) == 0) {
        alpha_s[row0] = alpha[0];
        alpha_s[row0 + 8] = alpha[1];
      }
      fence_async_smem();
      bar_arrive(kBarP, 256);
      // O[:, :256] = alpha O + P V
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        O[4 * j] *= alpha[0];
        O[4 * j + 1] *= alpha[0];
        O[4 * j + 2] *= alpha[1];
        O[4 * j + 3] *= alpha[1];
      }
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < kBlock / 16; ++kc) wgmma_rs(O, Pr[kc], wgmma_desc(ks + kc * 2048, 8192));
      wgmma_commit();
      wgmma_wait();
      release(s);
    }
    bar_sync(kBarPFree, 256);  // warpgroup 1's last hand-back
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
      if ((lane & 3) == 0) {
        ml[2 * (row0 + 8 * h)] = m[h];
        ml[2 * (row0 + 8 * h) + 1] = l[h];
      }
    }
  } else {  // warpgroup 1
    bar_arrive(kBarPFree, 256);
    for (int i = 0; i < blocks; ++i) {
      const int s = i % kStages;
      const uint32_t ks = k_s + s * kTileBytes;
      mbar_wait(full + 8 * s, (i / kStages) & 1);
      if (kPairs == 2) mbar_wait(peer_full + 8 * s, (i / kStages) & 1);
      if (kPairs == 1) fence_async_smem();  // the producer's stores -> this warpgroup's wgmma
      bar_sync(kBarP, 256);
      const float a0 = alpha_s[row0], a1 = alpha_s[row0 + 8];
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        O[4 * j] *= a0;
        O[4 * j + 1] *= a0;
        O[4 * j + 2] *= a1;
        O[4 * j + 3] *= a1;
      }
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < kBlock / 16; ++kc)
        wgmma_ss_nmajor(O, wgmma_desc(p_s + kc * 32), wgmma_desc(ks + 4 * 8192 + kc * 2048, 8192));
      wgmma_commit();
      wgmma_wait();
      bar_arrive(kBarPFree, 256);
      release(s);
    }
  }

  // every loop of the cluster is done (its K stages are free; no peer reaches this CTA's
  // barriers any more) and every (max, sum) is in ml
  if (kCluster) {
    cluster_sync();
  } else {
    bar_sync(kBarOut, 256);
  }
  // the merge's weights: split k's partial counts 2^(m_k - M) / (sum_k l_k 2^(m_k - M) + 2^(sink - M)),
  // M the largest of the maxima and the sink (base 2; the sink only with one partial per query
  // left, else XLA adds it); a split with no key counts 0. The partial's lse (base 2): the
  // keys' alone, M' + log2(sum_k l_k 2^(m_k - M')), M' the largest of the maxima
  float w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + 8 * h;
    const uint32_t at = smem_addr(ml + 2 * r);
    auto ml_of = [&](int k) {  // split k's (max, sum) of row r
      return kSplits == 1 ? make_float2(ml[2 * r], ml[2 * r + 1]) : ld_cluster_f32x2(mapa(at, k));
    };
    const float sink = parts == 1 ? __ldg(a.sink + hg * kBlock + r) * 1.4426950408889634f : -INFINITY;
    float2 v[kSplits];  // read once: a peer's are ld.shared::cluster loads
    float top = -INFINITY;
#pragma unroll
    for (int k = 0; k < kSplits; ++k) {
      v[k] = ml_of(k);
      top = v[k].y > 0.f ? fmaxf(top, v[k].x) : top;
    }
    float keys = 0.f;  // the keys' sum, scaled by 2^-top
#pragma unroll
    for (int k = 0; k < kSplits; ++k) keys += v[k].y > 0.f ? v[k].y * ex2(v[k].x - top) : 0.f;
    const float both = fmaxf(top, sink);
    w[h] = ml[2 * r + 1] > 0.f ? ex2(ml[2 * r] - both) / (keys * ex2(top - both) + ex2(sink - both)) : 0.f;
    if (zr == 0 && wg == 0 && (lane & 3) == 0)
      a.lse[(n * parts + part) * a.heads + hg * kBlock + r] = keys > 0.f ? top + __log2f(keys) : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    O[4 * j] *= w[0];
    O[4 * j + 1] *= w[0];
    O[4 * j + 2] *= w[1];
    O[4 * j + 3] *= w[1];
  }
  // the epilogue: the output chunks this CTA owns, as bf16, through shared memory (Q's tile:
  // its last reader is done), then to global memory by whole rows
  auto stage = [&](int c, float x0, float x1, float x2, float x3) {  // chunk c (8 output dims) of rows row0, + 8
    const uint32_t col = 4 * (lane & 3);
    *reinterpret_cast<uint32_t*>(Q + swz(row0, c) + col) = pack_bf16(x0, x1);
    *reinterpret_cast<uint32_t*>(Q + swz(row0 + 8, c) + col) = pack_bf16(x2, x3);
  };
  if constexpr (kSplits == 2) {
    // split zr owns warpgroup zr's output dims: the other warpgroup sends its weighted partial
    // to the peer's K stages (as float4s at chunk * 2 KiB + 16 x thread), the owner adds the
    // peer's to its own (one f32 sum of two terms: the same bits every run)
    const uint32_t tw16 = (t & 127) * 16;
    if (wg != zr) {
      const uint32_t dst = mapa(k_s, wg) + tw16;  // split wg's CTA
#pragma unroll
      for (int j = 0; j < 32; ++j) st_cluster_f32x4(dst + j * 2048, O[4 * j], O[4 * j + 1], O[4 * j + 2], O[4 * j + 3]);
    }
    cluster_sync();
    if (wg == zr) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const float4 v = *reinterpret_cast<const float4*>(Ks + j * 2048 + tw16);
        stage(32 * wg + j, O[4 * j] + v.x, O[4 * j + 1] + v.y, O[4 * j + 2] + v.z, O[4 * j + 3] + v.w);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) stage(32 * wg + j, O[4 * j], O[4 * j + 1], O[4 * j + 2], O[4 * j + 3]);
  }
  bar_sync(kBarOut, 256);
  uint4* out = reinterpret_cast<uint4*>(a.out + ((n * parts + part) * a.heads + hg * kBlock) * kHeadDim);
  for (int i = t; i < kBlock * kOwn; i += 256) {
    const int r = i / kOwn, c = zr * kOwn + i % kOwn;
    out[r * kChunks + c] = *reinterpret_cast<const uint4*>(Q + swz(r, c));
  }
#endif
}

// The cluster shape is the kernel's attribute, so every kernel starts as a plain kernel call,
// cheaper on the host than cudaLaunchKernelEx with a cluster attribute (docs/kernels/pool_attention.md).
__global__ void __launch_bounds__(kThreads, 1) pool_attention_kernel(const __grid_constant__ AttnArgs a) {
  pool_attention_cta<1, 1>(a);
}
template <int kPairs, int kSplits>
__global__ void __cluster_dims__(1, kPairs, kSplits) __launch_bounds__(kThreads, 1)
    pool_attention_cluster_kernel(const __grid_constant__ AttnArgs a) {
  pool_attention_cta<kPairs, kSplits>(a);
}

}  // namespace

namespace ffi = xla::ffi;

// q and sink come in as their whole (flattened) stacks; this call's bf16[N, H, 512] and f32[H]
// start at q_offset and sink_offset. N is rows', H out's.
static ffi::Error pool_attention(cudaStream_t stream, ffi::Buffer<ffi::BF16, 1> q, ffi::Buffer<ffi::S32, 2> rows,
                                 ffi::Buffer<ffi::S32, 2> nvalid, ffi::Buffer<ffi::U8, 2> pool0,
                                 ffi::Buffer<ffi::U8, 2> pool1, ffi::Buffer<ffi::U8, 2> pool2,
                                 ffi::Buffer<ffi::F32, 1> sink, ffi::ResultBuffer<ffi::BF16, 3> out,
                                 ffi::ResultBuffer<ffi::F32, 2> lse,
                                 int32_t blocks0, int32_t blocks1, int32_t blocks2, int32_t splits, float scale,
                                 int32_t storage, int64_t q_offset, int64_t sink_offset, int64_t first0,
                                 int64_t count0, int64_t first1, int64_t count1, int64_t first2, int64_t count2) {
  const int64_t N = rows.dimensions()[0], H = out->dimensions()[1];
  const int32_t nb = blocks0 + blocks1 + blocks2;
  if (storage != kOfficial && storage != kPerEntry)
    return ffi::Error::InvalidArgument("storage: expected a code of jaxkv.formats.storage.STORAGE_CODES");
  if (out->dimensions()[2] != kHeadDim || H < kBlock || H % kBlock)
    return ffi::Error::InvalidArgument("out: expected bf16[N * parts, H, 512], H % 64 == 0");
  if (q_offset < 0 || q_offset + N * H * kHeadDim > q.dimensions()[0])
    return ffi::Error::InvalidArgument("q: expected bf16[N, H, 512] at q_offset (N rows' rows, H out's heads)");
  if (nb < 1 || nb > kMaxBlocks || blocks0 < 0 || blocks1 < 0 || blocks2 < 0)
    return ffi::Error::InvalidArgument("blocks: expected 1..128 blocks of 64 rows in all");
  if (rows.dimensions()[0] != N || rows.dimensions()[1] != int64_t(nb) * kBlock || nvalid.dimensions()[0] != N ||
      nvalid.dimensions()[1] != nb)
    return ffi::Error::InvalidArgument("rows, nvalid: expected i32[N, blocks * 64] and i32[N, blocks]");
  // a 2-CTA cluster per query row's head groups 2 g, 2 g + 1 when they pair up, else per its
  // two splits when it has two (merged in the kernel: one partial left). More splits merge in
  // XLA (docs/kernels/pool_attention.md; the Python side counts them the same way)
  const bool pairs = (H / kBlock) % 2 == 0, split_pairs = !pairs && splits == 2;
  const int64_t parts = split_pairs ? 1 : splits;
  if (splits < 1) return ffi::Error::InvalidArgument("splits: expected >= 1");
  if (out->dimensions()[0] != N * parts || out->dimensions()[1] != H || lse->dimensions()[0] != N * parts ||
      lse->dimensions()[1] != H)
    return ffi::Error::InvalidArgument(
        "out, lse: expected bf16[N * parts, H, 512] and f32[N * parts, H], parts = 1 for 2 splits at H / 64 odd, "
        "else splits");
  if (sink_offset < 0 || sink_offset + H > sink.dimensions()[0])
    return ffi::Error::InvalidArgument("sink: expected f32[H] at sink_offset");
  AttnArgs a{};
  const ffi::Buffer<ffi::U8, 2>* pools[kMaxParts] = {&pool0, &pool1, &pool2};
  const int32_t blocks[kMaxParts] = {blocks0, blocks1, blocks2};
  const int64_t first[kMaxParts] = {first0, first1, first2}, count[kMaxParts] = {count0, count1, count2};
  int32_t end = 0;
  for (int p = 0; p < kMaxParts; ++p) {
    const auto pd = pools[p]->dimensions();
    const int64_t E = entry_bytes(storage);
    if (pd[1] % E || (pd[1] / E) % 32)
      return ffi::Error::InvalidArgument("pools: expected u8[blocks, block_size * entry bytes], block_size % 32 == 0");
    if (first[p] < 0 || count[p] < 0 || first[p] + count[p] > pd[0])
      return ffi::Error::InvalidArgument("spans: expected 0 <= first, 0 <= count, first + count <= the pool's blocks");
    end += blocks[p];
    a.part[p] = Part{pools[p]->typed_data() + first[p] * pd[1], count[p] * (pd[1] / E), static_cast<int32_t>(pd[1] / E),
                     end};
  }
  a.q = reinterpret_cast<const __nv_bfloat16*>(q.untyped_data()) + q_offset;
  a.rows = rows.typed_data();
  a.nvalid = nvalid.typed_data();
  a.sink = sink.typed_data() + sink_offset;
  a.out = reinterpret_cast<__nv_bfloat16*>(out->untyped_data());
  a.lse = lse->typed_data();
  a.heads = static_cast<int32_t>(H);
  a.nb = nb;
  a.splits = splits;
  a.storage = storage;
  a.c = scale * 1.4426950408889634f;
  if (N == 0) return ffi::Error::Success();
  if (!on_hopper()) return ffi::Error::InvalidArgument("pool_attention: the kernel is built for Hopper (sm_90a) only");
  const auto kernel = pairs         ? pool_attention_cluster_kernel<2, 1>
                      : split_pairs ? pool_attention_cluster_kernel<1, 2>
                                    : pool_attention_kernel;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  kernel<<<dim3(static_cast<unsigned>(N), static_cast<unsigned>(H / kBlock), splits), kThreads, kSmem, stream>>>(a);
  return launch_status(cudaGetLastError(), "pool_attention");
}

}  // namespace jaxkv

namespace jaxkv::attention_types {  // buffer types without commas, so they can sit inside the macro
using Q = xla::ffi::Buffer<xla::ffi::BF16, 1>;
using Index = xla::ffi::Buffer<xla::ffi::S32, 2>;
using Pool = xla::ffi::Buffer<xla::ffi::U8, 2>;
using Out = xla::ffi::Buffer<xla::ffi::BF16, 3>;
using Lse = xla::ffi::Buffer<xla::ffi::F32, 2>;
using Sink = xla::ffi::Buffer<xla::ffi::F32, 1>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::attention_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPoolAttention, jaxkv::pool_attention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::attention_types::Stream>()
                                  .Arg<jaxkv::attention_types::Q>()      // q: the stack of bf16[N, H, 512], flat
                                  .Arg<jaxkv::attention_types::Index>()  // rows i32[N, NB * 64]
                                  .Arg<jaxkv::attention_types::Index>()  // nvalid i32[N, NB]
                                  .Arg<jaxkv::attention_types::Pool>()   // pools, one per part
                                  .Arg<jaxkv::attention_types::Pool>()
                                  .Arg<jaxkv::attention_types::Pool>()
                                  .Arg<jaxkv::attention_types::Sink>()   // sink: the stack of f32[H], flat
                                  .Ret<jaxkv::attention_types::Out>()    // bf16[N * parts, H, 512]
                                  .Ret<jaxkv::attention_types::Lse>()    // f32[N * parts, H]
                                  .Attr<int32_t>("blocks0")
                                  .Attr<int32_t>("blocks1")
                                  .Attr<int32_t>("blocks2")
                                  .Attr<int32_t>("splits")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("storage")
                                  .Attr<int64_t>("q_offset")
                                  .Attr<int64_t>("sink_offset")
                                  .Attr<int64_t>("first0")  // spans: part p reads blocks [first, first + count)
                                  .Attr<int64_t>("count0")
                                  .Attr<int64_t>("first1")
                                  .Attr<int64_t>("count1")
                                  .Attr<int64_t>("first2")
                                  .Attr<int64_t>("count2"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
