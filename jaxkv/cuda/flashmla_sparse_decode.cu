// An XLA FFI handler around FlashMLA's sm90 sparse FP8 decode (its "MODEL1" layout: DeepSeek-V4),
// so jitted JAX calls FlashMLA's kernels on jaxkv's pool bytes with no torch in between.
//
// Not part of libjaxkv_cuda (jaxkv/cuda/build.py): it includes FlashMLA's headers and links
// FlashMLA's own translation units, so jaxkv/cuda/flashmla.py builds it only when a FlashMLA
// source tree is given ($FLASHMLA_SRC). Per call it does what FlashMLA's torch entry point
// (csrc/api/sparse_decode.h) does for one sm90 MODEL1 decode: the split schedule, the decode
// kernel, the combine of split partials. The schedule and the split partials are scratch
// results of the call (XLA owns them); nothing persists between calls.
//
// Query rows are independent here: jaxkv passes each (request, token) as one request of one
// token, so FlashMLA's s_q is 1 and its batch is jaxkv's N. The sink goes to FlashMLA when its two
// pools are all the query attends to (with_sink); otherwise the caller merges FlashMLA's (out, lse)
// with its other parts and the sink (kernels/pool_attention.py).

#include <cstdint>

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
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (major != 9) return ffi::Error::InvalidArgument("flashmla sparse decode: built for Hopper (sm_90a) only");

  using bf16 = cutlass::bfloat16_t;
  const int b = static_cast<int>(N), h = static_cast<int>(H), topk = static_cast<int>(id[2]);
  const int extra_topk = extra ? static_cast<int>(xd[2]) : 0;
  SparseAttnDecodeParams p{};
  p.b = b;
  p.s_q = 1;
  p.h_q = h;
  p.h_kv = 1;
  p.d_qk = kHeadDim;
  p.d_v = kHeadDim;
  p.sm_scale = scale;
  p.sm_scale_div_log2 = scale * 1.4426950408889634f;
  p.num_blocks = static_cast<int>(kv.dimensions()[0]);
  p.page_block_size = block_size;
  p.topk = topk;
  p.model_type = ModelType::MODEL1;
  p.q = reinterpret_cast<bf16*>(q.untyped_data());
  p.kv = reinterpret_cast<bf16*>(kv.untyped_data());
  p.indices = indices.typed_data();
  p.topk_length = nullptr;
  p.attn_sink = with_sink ? sink.typed_data() : nullptr;
  p.lse = lse->typed_data();
  p.out = reinterpret_cast<bf16*>(out->untyped_data());
  p.extra_num_blocks = extra ? static_cast<int>(extra_kv.dimensions()[0]) : 0;
  p.extra_page_block_size = extra ? extra_block_size : 0;
  p.extra_topk = extra_topk;
  p.extra_kv = extra ? reinterpret_cast<bf16*>(extra_kv.untyped_data()) : nullptr;
  p.extra_indices = extra ? extra_indices.typed_data() : nullptr;
  p.extra_topk_length = nullptr;
  p.stride_q_b = h * kHeadDim;  // s_q = 1: one query row per request
  p.stride_q_s_q = h * kHeadDim;
  p.stride_q_h_q = kHeadDim;
  p.stride_kv_block = block_size * kEntryBytes;  // bytes: FlashMLA walks the u8 block
  p.stride_kv_row = kEntryBytes;
  p.stride_indices_b = topk;
  p.stride_indices_s_q = topk;
  p.stride_lse_b = h;
  p.stride_lse_s_q = h;
  p.stride_o_b = h * kHeadDim;
  p.stride_o_s_q = h * kHeadDim;
  p.stride_o_h_q = kHeadDim;
  p.stride_extra_kv_block = extra ? extra_block_size * kEntryBytes : 0;
  p.stride_extra_kv_row = extra ? kEntryBytes : 0;
  p.stride_extra_indices_b = extra_topk;
  p.stride_extra_indices_s_q = extra_topk;
  p.stream = stream;
  p.lse_accum = lse_acc->typed_data();
  p.o_accum = o_acc->typed_data();
  p.stride_lse_accum_split = h;
  p.stride_lse_accum_s_q = h;
  p.stride_o_accum_split = h * kHeadDim;
  p.stride_o_accum_s_q = h * kHeadDim;
  p.stride_o_accum_h_q = kHeadDim;
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(sched->typed_data());
  p.num_splits_ptr = splits->typed_data();
  p.num_sm_parts = static_cast<int>(parts);

  GetDecodeSchedMetaParams sp{};
  sp.b = b;
  sp.s_q = 1;
  sp.block_size_n = kTopkBlock;
  sp.fixed_overhead_num_blocks = kFixedOverhead;
  sp.topk = topk;
  sp.extra_topk = extra_topk;
  sp.topk_length = nullptr;
  sp.extra_topk_length = nullptr;
  sp.seqlens_k_ptr = nullptr;
  sp.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
  sp.num_splits_ptr = p.num_splits_ptr;
  sp.num_sm_parts = p.num_sm_parts;
  sp.stream = stream;
  smxx::decode::run_get_decoding_sched_meta_kernel(sp);

  if (h == 64)
    sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 64>(p);
  else
    sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 128>(p);

  CombineParams cp{};
  cp.b = b;
  cp.s_q = 1;
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
  cp.stream = stream;
  smxx::decode::run_flash_mla_combine_kernel<bf16>(cp);

  return jaxkv::launch_status(cudaGetLastError(), "flashmla sparse decode");
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
