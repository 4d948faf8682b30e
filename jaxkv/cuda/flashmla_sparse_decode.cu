// FlashMLA's sm90 sparse FP8 decode (its "MODEL1" layout: DeepSeek-V4) on jaxkv's pool bytes,
// one launch sequence (run) with two ways in: an XLA FFI handler for jitted JAX and an
// extern "C" launcher that torch_bridge/flashmla.py calls through ctypes, so both sides use
// one library and one code path.
//
// Not part of libjaxkv_cuda (jaxkv/cuda/build.py): it includes FlashMLA's headers and links
// FlashMLA's own translation units, so jaxkv/cuda/flashmla.py builds it only when a FlashMLA
// source tree is given ($FLASHMLA_SRC). run does what FlashMLA's torch entry point
// (csrc/api/sparse_decode.h) does for one sm90 MODEL1 decode: the split schedule (unless an
// earlier call's is reused), the decode kernel, the combine of split partials. The caller owns
// every buffer (XLA as results of the call, torch as tensors); nothing persists between calls.
// FlashMLA's host checks throw: run returns their message, no exception crosses into XLA or ctypes.
//
// The FFI handler passes each (request, token) as one request of one token (s_q 1, batch N)
// without lengths; the sink goes to FlashMLA when its two pools are all the query attends to
// (with_sink), otherwise the caller merges FlashMLA's (out, lse) with its other parts and the
// sink (kernels/pool_attention.py). The C launcher passes torch's shapes and strides as
// FlashMLA's entry point does (s_q = T, per-request lengths, a schedule to reuse).

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include <cuda_runtime.h>

#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace ffi = xla::ffi;

namespace {

// the official storage family is FlashMLA's MODEL1 byte for byte; its numbers come from
// jaxkv.formats.storage as -D flags (jaxkv/cuda/flashmla.py passes cuda_defines())
constexpr int kHeadDim = JAXKV_HEAD_DIM;                   // d_qk = d_v of MODEL1
constexpr int kEntryBytes = JAXKV_OFFICIAL_ENTRY_BYTES;    // FP8 codes, BF16 rope dims, UE8M0 scales, pad
constexpr int kTopkBlock = 64;     // FlashMLA walks indices 64 at a time (api/sparse_decode.h: block_size_topk)
constexpr int kFixedOverhead = 5;  // its scheduler's per-request overhead in blocks (Decode_Sm90_Impl::get_meta)
constexpr int kSchedInts = sizeof(DecodingSchedMeta) / sizeof(int);

// One decode: strides in elements (bytes for the u8 pools), as FlashMLA's params take them.
struct Call {
  int64_t b, s_q, h;
  const void* q;  // bf16[b, s_q, h, 512], last dim contiguous
  int64_t stride_q_b, stride_q_s_q, stride_q_h_q;
  const void* kv;  // num_blocks blocks of block_size entries, each block contiguous
  int64_t num_blocks, block_size, stride_kv_block;
  const int32_t* indices;  // i32[b, s_q, topk] pool-wide ids, -1 = none
  int64_t topk, stride_indices_b, stride_indices_s_q;
  const int32_t* topk_length;  // i32[b] or null
  const void* extra_kv;  // read iff extra_block_size > 0 (else no extra cache)
  int64_t extra_num_blocks, extra_block_size, stride_extra_kv_block;
  const int32_t* extra_indices;  // i32[b, s_q, extra_topk]
  int64_t extra_topk, stride_extra_indices_b, stride_extra_indices_s_q;
  const int32_t* extra_topk_length;  // i32[b] or null
  const float* sink;                 // f32[h] or null
  float scale;
  void* out;   // bf16[b, s_q, h, 512], contiguous
  float* lse;  // f32[b, s_q, h], contiguous; natural log, +inf: no key
  int32_t* sched;  // i32[parts, 8]
  int32_t* splits; // i32[b + 1]
  int64_t parts;
  bool make_schedule;  // false: sched and splits hold an earlier call's schedule for these shapes and lengths
  float* lse_acc;      // f32[b + parts, s_q, h], contiguous
  float* o_acc;        // f32[b + parts, s_q, h, 512], contiguous
  cudaStream_t stream;
};

struct Status {
  bool ok = true;
  bool bad_argument = false;  // else a failure inside FlashMLA or CUDA
  std::string message;
};

Status bad(const std::string& m) { return {false, true, m}; }

Status run(const Call& c) {
  if (c.h != 64 && c.h != 128) return bad("q: expected 64 or 128 heads, got " + std::to_string(c.h));
  if (c.block_size <= 0 || c.topk <= 0 || c.topk % kTopkBlock)
    return bad("kv, indices: expected block_size > 0 and topk a positive multiple of 64");
  if (c.extra_block_size > 0 && (c.extra_topk <= 0 || c.extra_topk % kTopkBlock))
    return bad("extra_indices: expected extra_topk a positive multiple of 64");
  if (c.parts < 1) return bad("scratch: expected at least one SM part");
  const int64_t sizes[] = {c.b, c.s_q, c.stride_q_b, c.stride_q_s_q, c.stride_q_h_q, c.num_blocks,
                           c.stride_kv_block, c.stride_indices_b, c.stride_indices_s_q, c.extra_num_blocks,
                           c.stride_extra_kv_block, c.stride_extra_indices_b, c.stride_extra_indices_s_q,
                           c.s_q * c.h * kHeadDim};  // the largest stride of out and the partials
  for (int64_t v : sizes)  // FlashMLA's params hold ints (its int64_stride_to_int)
    if (v < 0 || v > INT_MAX) return bad("a size or stride is negative or exceeds int32: " + std::to_string(v));
  if (c.b == 0 || c.s_q == 0) return {};
  if (!jaxkv::on_hopper()) return bad("flashmla sparse decode: built for Hopper (sm_90a) only");

  using bf16 = cutlass::bfloat16_t;
  const int b = static_cast<int>(c.b), s_q = static_cast<int>(c.s_q), h = static_cast<int>(c.h);
  const int topk = static_cast<int>(c.topk);
  const bool extra = c.extra_block_size > 0;
  const int extra_topk = extra ? static_cast<int>(c.extra_topk) : 0;
  SparseAttnDecodeParams p{};
  p.b = b;
  p.s_q = s_q;
  p.h_q = h;
  p.h_kv = 1;
  p.d_qk = kHeadDim;
  p.d_v = kHeadDim;
  p.sm_scale = c.scale;
  p.sm_scale_div_log2 = c.scale * 1.4426950408889634f;
  p.num_blocks = static_cast<int>(c.num_blocks);
  p.page_block_size = static_cast<int>(c.block_size);
  p.topk = topk;
  p.model_type = ModelType::MODEL1;
  p.q = reinterpret_cast<bf16*>(const_cast<void*>(c.q));
  p.kv = reinterpret_cast<bf16*>(const_cast<void*>(c.kv));
  p.indices = const_cast<int*>(c.indices);
  p.topk_length = const_cast<int*>(c.topk_length);
  p.attn_sink = const_cast<float*>(c.sink);
  p.lse = c.lse;
  p.out = reinterpret_cast<bf16*>(c.out);
  p.extra_num_blocks = extra ? static_cast<int>(c.extra_num_blocks) : 0;
  p.extra_page_block_size = extra ? static_cast<int>(c.extra_block_size) : 0;
  p.extra_topk = extra_topk;
  p.extra_kv = extra ? reinterpret_cast<bf16*>(const_cast<void*>(c.extra_kv)) : nullptr;
  p.extra_indices = extra ? const_cast<int*>(c.extra_indices) : nullptr;
  p.extra_topk_length = extra ? const_cast<int*>(c.extra_topk_length) : nullptr;
  p.stride_q_b = static_cast<int>(c.stride_q_b);
  p.stride_q_s_q = static_cast<int>(c.stride_q_s_q);
  p.stride_q_h_q = static_cast<int>(c.stride_q_h_q);
  p.stride_kv_block = static_cast<int>(c.stride_kv_block);  // bytes: FlashMLA walks the u8 block
  p.stride_kv_row = kEntryBytes;
  p.stride_indices_b = static_cast<int>(c.stride_indices_b);
  p.stride_indices_s_q = static_cast<int>(c.stride_indices_s_q);
  p.stride_lse_b = s_q * h;
  p.stride_lse_s_q = h;
  p.stride_o_b = s_q * h * kHeadDim;
  p.stride_o_s_q = h * kHeadDim;
  p.stride_o_h_q = kHeadDim;
  p.stride_extra_kv_block = extra ? static_cast<int>(c.stride_extra_kv_block) : 0;
  p.stride_extra_kv_row = extra ? kEntryBytes : 0;
  p.stride_extra_indices_b = extra ? static_cast<int>(c.stride_extra_indices_b) : 0;
  p.stride_extra_indices_s_q = extra ? static_cast<int>(c.stride_extra_indices_s_q) : 0;
  p.stream = c.stream;
  p.lse_accum = c.lse_acc;
  p.o_accum = c.o_acc;
  p.stride_lse_accum_split = s_q * h;
  p.stride_lse_accum_s_q = h;
  p.stride_o_accum_split = s_q * h * kHeadDim;
  p.stride_o_accum_s_q = h * kHeadDim;
  p.stride_o_accum_h_q = kHeadDim;
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(c.sched);
  p.num_splits_ptr = c.splits;
  p.num_sm_parts = static_cast<int>(c.parts);

  try {
    if (c.make_schedule) {
      GetDecodeSchedMetaParams sp{};
      sp.b = b;
      sp.s_q = s_q;
      sp.block_size_n = kTopkBlock;
      sp.fixed_overhead_num_blocks = kFixedOverhead;
      sp.topk = topk;
      sp.extra_topk = extra_topk;
      sp.topk_length = p.topk_length;
      sp.extra_topk_length = p.extra_topk_length;
      sp.seqlens_k_ptr = nullptr;
      sp.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
      sp.num_splits_ptr = p.num_splits_ptr;
      sp.num_sm_parts = p.num_sm_parts;
      sp.stream = c.stream;
      smxx::decode::run_get_decoding_sched_meta_kernel(sp);
    }

    if (h == 64)
      sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 64>(p);
    else
      sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 128>(p);

    CombineParams cp{};
    cp.b = b;
    cp.s_q = s_q;
    cp.h_q = h;
    cp.d_v = kHeadDim;
    cp.lse = p.lse;
    cp.out = p.out;
    cp.stride_lse_b = p.stride_lse_b;
    cp.stride_lse_s_q = p.stride_lse_s_q;
    cp.stride_o_b = p.stride_o_b;
    cp.stride_o_s_q = p.stride_o_s_q;
    cp.stride_o_h_q = p.stride_o_h_q;
    cp.lse_accum = p.lse_accum;
    cp.o_accum = p.o_accum;
    cp.stride_lse_accum_split = p.stride_lse_accum_split;
    cp.stride_lse_accum_s_q = p.stride_lse_accum_s_q;
    cp.stride_o_accum_split = p.stride_o_accum_split;
    cp.stride_o_accum_s_q = p.stride_o_accum_s_q;
    cp.stride_o_accum_h_q = p.stride_o_accum_h_q;
    cp.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
    cp.num_splits_ptr = p.num_splits_ptr;
    cp.num_sm_parts = p.num_sm_parts;
    cp.attn_sink = p.attn_sink;
    cp.stream = c.stream;
    smxx::decode::run_flash_mla_combine_kernel<bf16>(cp);
  } catch (const std::exception& e) {
    return {false, false, std::string("flashmla sparse decode: ") + e.what()};
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return {false, false, std::string("flashmla sparse decode: ") + cudaGetErrorString(e)};
  return {};
}

// ---- XLA FFI handler (jax.ffi; kernels.pool_attention_flashmla) ----------------------------------
ffi::Error sparse_decode(cudaStream_t stream,
                         ffi::Buffer<ffi::BF16, 4> q,            // bf16[N, 1, H, 512]
                         ffi::Buffer<ffi::U8, 2> kv,             // u8[num_blocks, block_size * E], official storage
                         ffi::Buffer<ffi::S32, 3> indices,       // i32[N, 1, K] pool-wide ids, -1 = none
                         ffi::Buffer<ffi::U8, 2> extra_kv,       // u8[extra_blocks, extra_block_size * E]
                         ffi::Buffer<ffi::S32, 3> extra_indices, // i32[N, 1, W]
                         ffi::Buffer<ffi::F32, 1> sink,          // f32[H] (read iff with_sink)
                         ffi::ResultBuffer<ffi::BF16, 4> out,    // bf16[N, 1, H, 512]
                         ffi::ResultBuffer<ffi::F32, 3> lse,     // f32[N, 1, H] natural log, +inf: no key
                         ffi::ResultBuffer<ffi::S32, 2> sched,   // i32[num_sm_parts, 8] scratch
                         ffi::ResultBuffer<ffi::S32, 1> splits,  // i32[N + 1] scratch
                         ffi::ResultBuffer<ffi::F32, 3> lse_acc, // f32[N + num_sm_parts, 1, H] scratch
                         ffi::ResultBuffer<ffi::F32, 4> o_acc,   // f32[N + num_sm_parts, 1, H, 512] scratch
                         int32_t block_size, int32_t extra_block_size, float scale, int32_t with_sink) {
  const auto qd = q.dimensions();
  const int64_t N = qd[0], H = qd[2];
  const int64_t parts = sched->dimensions()[0];
  const bool extra = extra_block_size > 0;
  if (qd[1] != 1 || qd[3] != kHeadDim || (H != 64 && H != 128))
    return ffi::Error::InvalidArgument("q: expected bf16[N, 1, H, 512] with H 64 or 128");
  if (block_size <= 0 || kv.dimensions()[1] != int64_t(block_size) * kEntryBytes)
    return ffi::Error::InvalidArgument("kv: expected u8[blocks, block_size * entry bytes] (official storage)");
  const auto id = indices.dimensions();
  if (id[0] != N || id[1] != 1 || id[2] <= 0 || id[2] % kTopkBlock)
    return ffi::Error::InvalidArgument("indices: expected i32[N, 1, K], K a positive multiple of 64");
  const auto xd = extra_indices.dimensions();
  if (extra && (extra_kv.dimensions()[1] != int64_t(extra_block_size) * kEntryBytes || xd[0] != N || xd[1] != 1 ||
                xd[2] <= 0 || xd[2] % kTopkBlock))
    return ffi::Error::InvalidArgument("extra_kv, extra_indices: expected u8[blocks, extra_block_size * entry bytes] and "
                                       "i32[N, 1, W], W a positive multiple of 64");
  if (with_sink && sink.dimensions()[0] != H) return ffi::Error::InvalidArgument("sink: expected f32[H]");
  if (parts < 1 || sched->dimensions()[1] != kSchedInts || splits->dimensions()[0] != N + 1 ||
      lse_acc->dimensions()[0] != N + parts || o_acc->dimensions()[0] != N + parts)
    return ffi::Error::InvalidArgument("scratch: expected i32[parts, 8], i32[N + 1], f32[N + parts, 1, H(, 512)]");
  if (N == 0) return ffi::Error::Success();

  Call c{};
  c.b = N;
  c.s_q = 1;  // one query row per request
  c.h = H;
  c.q = q.untyped_data();
  c.stride_q_b = H * kHeadDim;
  c.stride_q_s_q = H * kHeadDim;
  c.stride_q_h_q = kHeadDim;
  c.kv = kv.untyped_data();
  c.num_blocks = kv.dimensions()[0];
  c.block_size = block_size;
  c.stride_kv_block = int64_t(block_size) * kEntryBytes;
  c.indices = indices.typed_data();
  c.topk = id[2];
  c.stride_indices_b = id[2];
  c.stride_indices_s_q = id[2];
  c.topk_length = nullptr;
  if (extra) {
    c.extra_kv = extra_kv.untyped_data();
    c.extra_num_blocks = extra_kv.dimensions()[0];
    c.extra_block_size = extra_block_size;
    c.stride_extra_kv_block = int64_t(extra_block_size) * kEntryBytes;
    c.extra_indices = extra_indices.typed_data();
    c.extra_topk = xd[2];
    c.stride_extra_indices_b = xd[2];
    c.stride_extra_indices_s_q = xd[2];
  }
  c.extra_topk_length = nullptr;
  c.sink = with_sink ? sink.typed_data() : nullptr;
  c.scale = scale;
  c.out = out->untyped_data();
  c.lse = lse->typed_data();
  c.sched = sched->typed_data();
  c.splits = splits->typed_data();
  c.parts = parts;
  c.make_schedule = true;
  c.lse_acc = lse_acc->typed_data();
  c.o_acc = o_acc->typed_data();
  c.stream = stream;
  const Status s = run(c);
  if (s.ok) return ffi::Error::Success();
  return s.bad_argument ? ffi::Error::InvalidArgument(s.message) : ffi::Error::Internal("jaxkv " + s.message);
}

}  // namespace

namespace flashmla_types {  // buffer types without commas, so they can sit inside the macro
using Q = ffi::Buffer<ffi::BF16, 4>;
using Pool = ffi::Buffer<ffi::U8, 2>;
using Ids = ffi::Buffer<ffi::S32, 3>;
using Sink = ffi::Buffer<ffi::F32, 1>;
using Sched = ffi::Buffer<ffi::S32, 2>;
using Splits = ffi::Buffer<ffi::S32, 1>;
using Lse = ffi::Buffer<ffi::F32, 3>;
using Acc = ffi::Buffer<ffi::F32, 4>;
using Stream = ffi::PlatformStream<cudaStream_t>;
}  // namespace flashmla_types

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvFlashmlaSparseDecode, sparse_decode,
                              ffi::Ffi::Bind()
                                  .Ctx<flashmla_types::Stream>()
                                  .Arg<flashmla_types::Q>()       // q
                                  .Arg<flashmla_types::Pool>()    // kv
                                  .Arg<flashmla_types::Ids>()     // indices
                                  .Arg<flashmla_types::Pool>()    // extra_kv
                                  .Arg<flashmla_types::Ids>()     // extra_indices
                                  .Arg<flashmla_types::Sink>()    // sink
                                  .Ret<flashmla_types::Q>()       // out
                                  .Ret<flashmla_types::Lse>()     // lse
                                  .Ret<flashmla_types::Sched>()   // schedule (scratch)
                                  .Ret<flashmla_types::Splits>()  // splits (scratch)
                                  .Ret<flashmla_types::Lse>()     // lse partials (scratch)
                                  .Ret<flashmla_types::Acc>()     // out partials (scratch)
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("extra_block_size")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("with_sink"));

// ---- C launcher (ctypes; torch_bridge/flashmla.py) -----------------------------------------------
// FlashMLA's torch entry point on raw pointers: the arguments of Call in its order, the
// stream torch's current one. Returns 0, or 1 with the reason in error (error_size bytes, NUL-ended).
extern "C" int jaxkv_flashmla_sparse_decode(
    void* stream, int64_t b, int64_t s_q, int64_t h,
    const void* q, int64_t stride_q_b, int64_t stride_q_s_q, int64_t stride_q_h_q,
    const void* kv, int64_t num_blocks, int64_t block_size, int64_t stride_kv_block,
    const int32_t* indices, int64_t topk, int64_t stride_indices_b, int64_t stride_indices_s_q,
    const int32_t* topk_length,
    const void* extra_kv, int64_t extra_num_blocks, int64_t extra_block_size, int64_t stride_extra_kv_block,
    const int32_t* extra_indices, int64_t extra_topk, int64_t stride_extra_indices_b,
    int64_t stride_extra_indices_s_q, const int32_t* extra_topk_length,
    const float* sink, float scale, void* out, float* lse,
    int32_t* sched, int32_t* splits, int64_t parts, int32_t make_schedule,
    float* lse_acc, float* o_acc, char* error, int64_t error_size) {
  const Call c{b, s_q, h, q, stride_q_b, stride_q_s_q, stride_q_h_q,
               kv, num_blocks, block_size, stride_kv_block,
               indices, topk, stride_indices_b, stride_indices_s_q, topk_length,
               extra_kv, extra_num_blocks, extra_block_size, stride_extra_kv_block,
               extra_indices, extra_topk, stride_extra_indices_b, stride_extra_indices_s_q, extra_topk_length,
               sink, scale, out, lse, sched, splits, parts, make_schedule != 0, lse_acc, o_acc,
               static_cast<cudaStream_t>(stream)};
  Status s;
  try {
    s = run(c);
  } catch (...) {  // std::string allocation: nothing may cross into ctypes
    s = {false, false, "flashmla sparse decode: unknown C++ exception"};
  }
  if (s.ok) return 0;
  if (error && error_size > 0) {
    const size_t n = std::min(s.message.size(), static_cast<size_t>(error_size - 1));
    std::memcpy(error, s.message.data(), n);
    error[n] = '\0';
  }
  return 1;
}
