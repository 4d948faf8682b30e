// Top-k of float32 score rows by radix select: the k-th largest key is found digit by digit
// from histograms (10, 11, 11 bits), then one pass places every larger key and the lowest-
// indexed equal ones, and the k picks are put best first. Nothing sorts the row.
// The decisions and their measurements: docs/kernels/index_scores.md ("Top-k: a select").
//
// Semantics (jaxkv.kernels.ref_top_k): a NaN or infinite score is never picked and its slot
// is -1; -0.0 equals +0.0; equal scores go to the lower index; the result is best first.
// With `visible`, each row also says whether one of its first visible[row] scores is NaN or
// infinite (a fault for the caller to record; the -inf past them is masking), from the same
// read of the row, so no other kernel reads the scores for it. jaxkv_top_k_record records it
// itself: the fault bit ORed into the error word of the row's request, so the step spends no
// launch on it.
#include <cstdint>

#include <cuda_runtime.h>

#include "ffi_handler.cuh"

namespace jaxkv {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxK = 2048;           // the picks are sorted in shared memory, 8 bytes each
constexpr int kFirst = 10;            // the first digit: sign, exponent, a mantissa bit
constexpr int kSecond = (33 - kFirst) / 2, kThird = 32 - kFirst - kSecond;
constexpr int kBins = 1 << (kFirst > kSecond ? kFirst : kSecond);
constexpr int kResident = 200 << 10;  // a row whose keys fit beside the rest is read from HBM once
constexpr int kLoads = 8;             // 16-byte loads a thread has in flight while a row comes in

// A score as an unsigned key in the same order; 0 for NaN and +-inf (never picked). Every
// finite score maps to a key >= 0x00800000, so 0 is below all of them.
__device__ __forceinline__ uint32_t order_key(float f) {
  if (!isfinite(f)) return 0u;
  const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);  // -0.0 is +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block, in thread order; *total: the sum of all.
__device__ __forceinline__ uint32_t block_exclusive_sum(uint32_t v, uint32_t* warp_sums, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t t = lane < kWarps ? warp_sums[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += y;
    }
    if (lane < kWarps) warp_sums[lane] = t;
  }
  __syncthreads();
  const uint32_t before = (warp ? warp_sums[warp - 1] : 0u) + x - v;
  *total = warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// A row's keys, four consecutive at a time: from shared memory (padded with 0 to a multiple
// of four), or converted from the row in HBM on every pass when it does not fit.
struct Row {
  const float* scores;  // f32[n]
  const uint4* keys;    // u32[round_up(n, 4)] in shared memory, or nullptr
  int n, groups;        // groups: ceil(n / 4)

  __device__ __forceinline__ void load(int g, uint32_t (&k)[4]) const {
    if (keys) {
      const uint4 v = keys[g];
      k[0] = v.x, k[1] = v.y, k[2] = v.z, k[3] = v.w;
      return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) k[j] = 4 * g + j < n ? order_key(__ldg(scores + 4 * g + j)) : 0u;
  }
};

struct Found {  // the select's state, in shared memory
  uint32_t prefix;  // the digits of the k-th largest key found so far
  uint32_t need;    // how many keys with that prefix are still to be picked
  uint32_t ties;    // after the last digit: how many keys equal the k-th largest
  uint32_t fill;    // picks placed so far (unordered placement)
};

// One digit: among the keys whose higher bits equal f->prefix, the bin of the f->need-th
// largest; prefix gains the digit, need loses the count of keys in higher bins.
template <int kShift, int kWidth>
__device__ void digit(const Row& r, uint32_t* hist, uint32_t* warp_sums, Found* f) {
  constexpr int nb = 1 << kWidth, per = nb >= kThreads ? nb / kThreads : 1;
  for (int b = threadIdx.x; b < nb; b += kThreads) hist[b] = 0u;
  __syncthreads();
  const uint32_t want = f->prefix, n = f->need;  // read by all before the one writer below
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < r.groups; base += kThreads) {  // a warp-uniform trip count (the ballots)
    const int g = base + threadIdx.x;
    uint32_t k[4] = {0u, 0u, 0u, 0u};
    if (g < r.groups) r.load(g, k);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool mine = g < r.groups && (static_cast<uint64_t>(k[j]) >> (kShift + kWidth)) == want;
      const uint32_t bin = (k[j] >> kShift) & (nb - 1);
      const unsigned active = __ballot_sync(0xffffffffu, mine);
      if (mine) {  // equal bins of a warp add once: many scores share a digit
        const unsigned peers = __match_any_sync(active, bin);
        if (lane == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
      }
    }
  }
  __syncthreads();
  // bins from the top: thread t sums ranks [t * per, (t + 1) * per)
  uint32_t local = 0;
#pragma unroll
  for (int j = 0; j < per; ++j) {
    const int rank = threadIdx.x * per + j;
    local += rank < nb ? hist[nb - 1 - rank] : 0u;
  }
  uint32_t total;
  const uint32_t before = block_exclusive_sum(local, warp_sums, &total);
  if (before < n && n <= before + local) {  // exactly one thread: the bins hold >= n keys
    uint32_t acc = before;
#pragma unroll
    for (int j = 0; j < per; ++j) {
      const uint32_t bin = nb - 1 - (threadIdx.x * per + j);
      if (n <= acc + hist[bin]) {
        f->prefix = (want << kWidth) | bin;
        f->need = n - acc;
        f->ties = hist[bin];
        break;
      }
      acc += hist[bin];
    }
  }
  __syncthreads();
}

__device__ __forceinline__ unsigned long long pick(uint32_t key, int index) {
  return (static_cast<unsigned long long>(~key) << 32) | static_cast<uint32_t>(index);  // ascending = best first
}

// Every key >= lowest: all are picked, so their places may be in any order (one
// shared-memory atomic per warp and pass).
__device__ void place_all(const Row& r, uint32_t lowest, unsigned long long* picks, Found* f) {
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < r.groups; base += kThreads) {
    const int g = base + threadIdx.x;
    uint32_t k[4] = {0u, 0u, 0u, 0u};
    if (g < r.groups) r.load(g, k);
    uint32_t cnt = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) cnt += k[j] >= lowest;
    uint32_t incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    uint32_t at = 0;
    if (lane == 31 && incl) at = atomicAdd(&f->fill, incl);
    at = __shfl_sync(0xffffffffu, at, 31) + incl - cnt;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (k[j] >= lowest) picks[at++] = pick(k[j], 4 * g + j);
  }
}

// Every key above t, and the `take` lowest-indexed keys equal to it (ties at the boundary):
// a block-wide scan in index order.
__device__ void place_in_order(const Row& r, uint32_t t, uint32_t take, uint32_t above, unsigned long long* picks,
                               uint32_t* warp_sums) {
  uint32_t gt_base = 0, eq_base = 0;
  for (int base = 0; base < r.groups; base += kThreads) {
    const int g = base + threadIdx.x;
    uint32_t k[4] = {0u, 0u, 0u, 0u};
    if (g < r.groups) r.load(g, k);
    uint32_t gt = 0, eq = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      gt += k[j] > t;
      eq += k[j] == t;
    }
    uint32_t total;
    const uint32_t before = block_exclusive_sum(gt | (eq << 16), warp_sums, &total);  // <= 4 * kThreads each
    uint32_t a = gt_base + (before & 0xffffu), e = eq_base + (before >> 16);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (k[j] > t) {
        picks[a++] = pick(k[j], 4 * g + j);
      } else if (k[j] == t) {
        if (e < take) picks[above + e] = pick(k[j], 4 * g + j);
        ++e;
      }
    }
    gt_base += total & 0xffffu;
    eq_base += total >> 16;
  }
}

// The picks best first, up to kThreads of them: each one's place is the count of picks
// before it (all distinct), one pick a thread.
__device__ void write_ranked(const unsigned long long* picks, int filled, int k, int32_t* out) {
  const unsigned long long mine = threadIdx.x < filled ? picks[threadIdx.x] : 0ull;
  int rank = 0;
  for (int j = 0; j < filled; ++j) rank += picks[j] < mine;  // the same word for every thread: a broadcast
  if (threadIdx.x < filled) out[rank] = static_cast<int32_t>(static_cast<uint32_t>(mine));
  for (int j = filled + threadIdx.x; j < k; j += kThreads) out[j] = -1;
}

// More picks: a bitonic sort of all cap (a power of two; the padding sorts last).
__device__ void write_sorted(unsigned long long* picks, int cap, int k, int32_t* out) {
  for (int size = 2; size <= cap; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int p = threadIdx.x; p < cap / 2; p += kThreads) {
        const int i = 2 * p - (p & (stride - 1)), j = i + stride;
        const unsigned long long a = picks[i], b = picks[j];
        if ((a > b) == ((i & size) == 0)) {
          picks[i] = b;
          picks[j] = a;
        }
      }
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += kThreads)
    out[j] = picks[j] == ~0ull ? -1 : static_cast<int32_t>(static_cast<uint32_t>(picks[j]));
}

// Where a row's NaN / Inf goes: error[slot[row / rows_per_slot]] |= fault (a slot outside the
// error words records nothing), or nowhere (error null).
struct Record {
  uint32_t* error;
  const int32_t* slot;
  int rows_per_slot, words;
  uint32_t fault;
};

__global__ void __launch_bounds__(kThreads, 2)
    top_k_kernel(const float* __restrict__ scores, int32_t* __restrict__ out, const int32_t* __restrict__ visible,
                 int32_t* __restrict__ nonfinite, Record rec, int n, int k, int cap, bool resident) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem);                               // [kBins]
  unsigned long long* picks = reinterpret_cast<unsigned long long*>(hist + kBins);  // [cap]
  uint4* keys = reinterpret_cast<uint4*>(picks + cap);                              // [ceil(n / 4)] when resident
  __shared__ uint32_t warp_sums[kWarps];
  __shared__ Found f;

  const float* row = scores + static_cast<int64_t>(blockIdx.x) * n;
  const int groups = (n + 3) / 4;
  const int seen = visible ? min(max(visible[blockIdx.x], 0), n) : 0;  // scores checked for NaN / Inf
  bool bad = false;
  for (int j = threadIdx.x; j < cap; j += kThreads) picks[j] = ~0ull;
  if (resident) {
    if ((n & 3) == 0) {  // rows start 16-byte aligned; kLoads loads in flight per thread
      const float4* r4 = reinterpret_cast<const float4*>(row);
      for (int base = 0; base < groups; base += kLoads * kThreads) {
        float4 v[kLoads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
          const int i = base + j * kThreads + threadIdx.x;
          if (i < groups) v[j] = __ldg(r4 + i);
        }
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
          const int i = base + j * kThreads + threadIdx.x;
          if (i < groups) {
            keys[i] = make_uint4(order_key(v[j].x), order_key(v[j].y), order_key(v[j].z), order_key(v[j].w));
            bad |= (4 * i < seen && !isfinite(v[j].x)) || (4 * i + 1 < seen && !isfinite(v[j].y)) ||
                   (4 * i + 2 < seen && !isfinite(v[j].z)) || (4 * i + 3 < seen && !isfinite(v[j].w));
          }
        }
      }
    } else {
      uint32_t* k1 = reinterpret_cast<uint32_t*>(keys);
      for (int i = threadIdx.x; i < 4 * groups; i += kThreads) {
        const float x = i < n ? __ldg(row + i) : 0.f;
        k1[i] = i < n ? order_key(x) : 0u;
        bad |= i < seen && !isfinite(x);
      }
    }
  } else {  // a long row is read on every pass; this check is one more
    for (int i = threadIdx.x; i < seen; i += kThreads) bad |= !isfinite(__ldg(row + i));
  }
  const bool found = __syncthreads_or(bad);  // every thread joins
  if (nonfinite && threadIdx.x == 0) nonfinite[blockIdx.x] = found;
  if (rec.error && found && threadIdx.x == 0) {
    const int32_t s = rec.slot[blockIdx.x / rec.rows_per_slot];
    if (s >= 0 && s < rec.words) atomicOr(rec.error + s, rec.fault);
  }
  if (threadIdx.x == 0) f = Found{0u, static_cast<uint32_t>(k), 0u, 0u};
  __syncthreads();
  const Row r{row, resident ? keys : nullptr, n, groups};
  digit<32 - kFirst, kFirst>(r, hist, warp_sums, &f);
  digit<kThird, kSecond>(r, hist, warp_sums, &f);
  digit<0, kThird>(r, hist, warp_sums, &f);

  // f.prefix: the k-th largest key t; f.need: how many keys equal to t are picked (the
  // lowest indices). t == 0: fewer than k finite scores, all of them picked.
  const uint32_t t = f.prefix, take = t ? f.need : 0u, above = static_cast<uint32_t>(k) - f.need;
  if (t && f.ties > take)
    place_in_order(r, t, take, above, picks, warp_sums);
  else  // every key equal to t is picked too; t == 0: every finite key (all are >= 1)
    place_all(r, t ? t : 1u, picks, &f);
  __syncthreads();

  const int filled = static_cast<int>(above + take);
  int32_t* o = out + static_cast<int64_t>(blockIdx.x) * k;
  if (filled <= kThreads)
    write_ranked(picks, filled, k, o);
  else
    write_sorted(picks, cap, k, o);
}

}  // namespace

namespace ffi = xla::ffi;

static ffi::Error launch_top_k(cudaStream_t stream, const ffi::Buffer<ffi::F32, 2>& scores, const int32_t* visible,
                               ffi::ResultBuffer<ffi::S32, 2>& out, int32_t* nonfinite, Record rec, int32_t k) {
  const auto d = scores.dimensions();
  const int64_t rows = d[0], n = d[1];
  if (k < 1 || k > kMaxK || k > n)
    return ffi::Error::InvalidArgument("k: expected 1 <= k <= min(2048, the scores' last axis)");
  if (n >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("scores: expected fewer than 2**31 per row");
  if (out->dimensions()[0] != rows || out->dimensions()[1] != k)
    return ffi::Error::InvalidArgument("out: expected i32[rows, k]");
  if (rows == 0) return ffi::Error::Success();
  int cap = 2;  // a power of two >= 2: the bitonic sort's width, and the keys after the picks stay aligned
  while (cap < k) cap <<= 1;
  const size_t fixed = sizeof(uint32_t) * kBins + sizeof(unsigned long long) * cap;
  const size_t row_keys = sizeof(uint32_t) * 4 * ((n + 3) / 4);
  const bool resident = fixed + row_keys <= static_cast<size_t>(kResident);
  const size_t bytes = fixed + (resident ? row_keys : 0);
  // per launch, not once: the attribute belongs to the current device's context
  cudaFuncSetAttribute(top_k_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kResident);
  top_k_kernel<<<static_cast<unsigned>(rows), kThreads, bytes, stream>>>(
      scores.typed_data(), out->typed_data(), visible, nonfinite, rec, static_cast<int>(n), k, cap, resident);
  return launch_status(cudaGetLastError(), "top_k");
}

// Only enqueue work on XLA's stream (no host sync, no allocation), so they are marked
// command-buffer compatible: XLA captures them into the CUDA graph of a jitted step.
// visible: i32[rows] (the check asked for) or i32[0] (not); nonfinite: i32[rows] or i32[0] alike.
static ffi::Error top_k_select(cudaStream_t stream, ffi::Buffer<ffi::F32, 2> scores, ffi::Buffer<ffi::S32, 1> visible,
                               ffi::ResultBuffer<ffi::S32, 2> out, ffi::ResultBuffer<ffi::S32, 1> nonfinite,
                               int32_t k) {
  const int64_t rows = scores.dimensions()[0];
  const bool check = visible.dimensions()[0] != 0;
  if ((check && visible.dimensions()[0] != rows) || nonfinite->dimensions()[0] != visible.dimensions()[0])
    return ffi::Error::InvalidArgument("visible, nonfinite: expected i32[rows] each, or i32[0] each");
  return launch_top_k(stream, scores, check ? visible.typed_data() : nullptr, out,
                      check ? nonfinite->typed_data() : nullptr, Record{}, k);
}

// visible: i32[rows]; error: u32[words], returned in place with fault ORed into the word of
// each row's slot (slot: i32[rows / rows_per_slot]) whose visible scores hold a NaN or Inf.
static ffi::Error top_k_record(cudaStream_t stream, ffi::Buffer<ffi::F32, 2> scores, ffi::Buffer<ffi::S32, 1> visible,
                               ffi::Buffer<ffi::U32, 1> error, ffi::Buffer<ffi::S32, 1> slot,
                               ffi::ResultBuffer<ffi::S32, 2> out, ffi::ResultBuffer<ffi::U32, 1> error_out, int32_t k,
                               int32_t fault) {
  const int64_t rows = scores.dimensions()[0], slots = slot.dimensions()[0];
  if (visible.dimensions()[0] != rows) return ffi::Error::InvalidArgument("visible: expected i32[rows]");
  if (slots < 1 || rows % slots) return ffi::Error::InvalidArgument("slot: expected i32[B] with B dividing the rows");
  if (error_out->dimensions()[0] != error.dimensions()[0]) return ffi::Error::InvalidArgument("error: expected u32[words]");
  in_place(error_out, error, stream);
  const Record rec{error_out->typed_data(), slot.typed_data(), static_cast<int>(rows / slots),
                   static_cast<int>(error.dimensions()[0]), static_cast<uint32_t>(fault)};
  return launch_top_k(stream, scores, visible.typed_data(), out, nullptr, rec, k);
}

}  // namespace jaxkv

namespace jaxkv::top_k_types {  // buffer types without commas, so they can sit inside the macro
using Scores = xla::ffi::Buffer<xla::ffi::F32, 2>;
using Picks = xla::ffi::Buffer<xla::ffi::S32, 2>;
using Rows = xla::ffi::Buffer<xla::ffi::S32, 1>;
using Words = xla::ffi::Buffer<xla::ffi::U32, 1>;
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
}  // namespace jaxkv::top_k_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvTopK, jaxkv::top_k_select,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::top_k_types::Stream>()
                                  .Arg<jaxkv::top_k_types::Scores>()  // f32[rows, n]
                                  .Arg<jaxkv::top_k_types::Rows>()    // visible: i32[rows] or i32[0]
                                  .Ret<jaxkv::top_k_types::Picks>()   // i32[rows, k]
                                  .Ret<jaxkv::top_k_types::Rows>()    // nonfinite: i32[rows] or i32[0]
                                  .Attr<int32_t>("k"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvTopKRecord, jaxkv::top_k_record,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jaxkv::top_k_types::Stream>()
                                  .Arg<jaxkv::top_k_types::Scores>()  // f32[rows, n]
                                  .Arg<jaxkv::top_k_types::Rows>()    // visible: i32[rows]
                                  .Arg<jaxkv::top_k_types::Words>()   // error: u32[words]
                                  .Arg<jaxkv::top_k_types::Rows>()    // slot: i32[B]
                                  .Ret<jaxkv::top_k_types::Picks>()   // i32[rows, k]
                                  .Ret<jaxkv::top_k_types::Words>()   // error, in place
                                  .Attr<int32_t>("k")
                                  .Attr<int32_t>("fault"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
