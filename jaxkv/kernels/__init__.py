"""The kernels of the cache steps, each beside its jnp reference: Pallas with the Mosaic GPU
lowering (Hopper), or a ``cuda/`` kernel through ``jax.ffi`` where Mosaic GPU cannot express
it on Hopper (row gathers and scatters, strided register slices; the module says why).
A leaf layer: plain arrays and static parameters in, arrays out; no cache imported.

* ``frame_append``: one frame's K/V into every layer of a frame cache, one launch
  (Mosaic GPU bulk copies, Hopper); ``write_frame_fp8``: the same into an FP8 cache,
  quantized as written (``jaxkv/cuda/frame_write_fp8.cu``).
* ``move_rows_cuda``: a span of rows moved in many buffers at once (a frame cache's page
  moves in every layer: ``jaxkv/cuda/move_rows.cu``, one launch; ``ref_move_rows``).
* ``dequant_gather``: compressed entries picked through block tables, FP8 + UE8M0 -> BF16
  (``hybrid.gather_entries(impl="cuda")``; ``jaxkv/cuda/dequant_gather.cu`` through jax.ffi).
* ``flush_write``: a CSA / HCA flush's quantize-and-scatter in either storage family
  (``ds_mla`` entries + MXFP4 keys, or per-entry FP8 + NVFP4 keys;
  ``hybrid.compress(impl="cuda")``; ``jaxkv/cuda/flush_write.cu``); ``window_write``: a decode
  step's tokens into their SWA rings, NaN / Inf checked in the kernel
  (``hybrid.write_window(impl="cuda")`` with one token per request); ``encode_rows``: a
  step's own tokens encoded into a fresh pool for the pool attention (``hybrid.attention``).
* ``compress_decode``: a decode step's whole CSA / HCA compressor update (tail append,
  pool, RMSNorm, RoPE, quantize, scatter, tail move-on), one launch per layer
  (``hybrid.compress(impl="cuda")`` with one token per request; ``jaxkv/cuda/compress_decode.cu``).
* ``prefix_attention``: attention over the key prefix ``[0, kv_len)`` of a buffer, a
  FlashAttention-3-style kernel (Mosaic GPU lowering, Hopper) whose length costs nothing
  (``impl="pallas"``); ``prefix_attention_cuda``: the same in ``cuda/`` (``impl="cuda"``).
* ``fp4_pack``: MXFP4 and NVFP4 packing (E2M1 nibbles + UE8M0 / E4M3 scales), the
  formats' bytes (``jaxkv/cuda/fp4_pack.cu``).
* ``index_query_cuda``: the indexer's query rotated and rounded through the FP4 key format,
  one launch (``hybrid.index_query(impl="cuda")``; ``jaxkv/cuda/index_query.cu``).
* ``entry_rows_cuda``: a CSA layer's picks through the block table into pool attention's row
  list, one launch (``jaxkv/cuda/entry_rows.cu``; ``ref_entry_rows``, the rule).
* ``pool_attention_cuda``: DeepSeek-V4 MQA with a sink over FP8 pool rows read in place,
  ``jaxkv/cuda/pool_attention.cu`` (``hybrid.attention(impl="cuda")``, auto on Hopper);
  ``pool_attention_pallas``: the same contract in Mosaic GPU (Hopper, official storage;
  ``impl="pallas"``); ``pool_attention_flashmla``: on FlashMLA's sm90 decode kernel, built
  from ``$FLASHMLA_SRC`` (``impl="flashmla"``).
* ``index_scores_cuda``, ``index_scores``: the lightning indexer's scores over FP4 keys read in
  place (``cuda/`` and Mosaic GPU, Hopper; ``hybrid.index_scores`` / ``index_topk(impl="cuda")``,
  ``impl="pallas"``).
* ``after_cuda``, ``after_xla``: arrays returned unchanged but ordered after other values, so
  the in-place writes that follow a read need no copy (``hybrid.after_reads``;
  ``jaxkv/cuda/after.cu`` moves nothing).
* ``top_k``: the k best of each score row by a radix select, no sort (``hybrid.index_topk
  (select="cuda")``; ``jaxkv/cuda/top_k.cu``); ``top_k_record`` also records a row's NaN /
  Inf in its request's error word.
"""

from jaxkv.kernels.after import after_cuda, after_xla
from jaxkv.kernels.compress_decode import compress_decode
from jaxkv.kernels.dequant_gather import dequant_gather, ref_dequant_gather
from jaxkv.kernels.entry_rows import entry_rows_cuda, ref_entry_rows
from jaxkv.kernels.flush_write import encode_rows, flush_write, ref_encode_rows, window_write
from jaxkv.kernels.fp4_pack import quantize_mxfp4, quantize_nvfp4, ref_quantize_mxfp4, ref_quantize_nvfp4
from jaxkv.kernels.frame_append import ref_write_frame, ref_write_frame_fp8, write_frame, write_frame_fp8
from jaxkv.kernels.index_query import index_query_cuda, ref_index_query
from jaxkv.kernels.index_scores import index_scores, index_scores_cuda, ref_index_scores
from jaxkv.kernels.move_rows import move_rows_cuda, ref_move_rows
from jaxkv.kernels.pool_attention import (
    pool_attention_cuda,
    pool_attention_flashmla,
    pool_attention_pallas,
    ref_pool_attention,
    span_rows,
)
from jaxkv.kernels.prefix_attention import prefix_attention, prefix_attention_cuda, ref_prefix_attention
from jaxkv.kernels.top_k import ref_top_k, ref_top_k_record, top_k, top_k_record

__all__ = [
    "after_cuda",
    "after_xla",
    "compress_decode",
    "dequant_gather",
    "encode_rows",
    "entry_rows_cuda",
    "flush_write",
    "index_query_cuda",
    "index_scores",
    "index_scores_cuda",
    "move_rows_cuda",
    "pool_attention_cuda",
    "pool_attention_flashmla",
    "pool_attention_pallas",
    "prefix_attention",
    "prefix_attention_cuda",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "ref_dequant_gather",
    "ref_encode_rows",
    "ref_entry_rows",
    "ref_index_query",
    "ref_index_scores",
    "ref_move_rows",
    "ref_pool_attention",
    "ref_prefix_attention",
    "ref_quantize_mxfp4",
    "ref_quantize_nvfp4",
    "ref_top_k",
    "ref_top_k_record",
    "ref_write_frame",
    "ref_write_frame_fp8",
    "span_rows",
    "top_k",
    "top_k_record",
    "window_write",
    "write_frame",
    "write_frame_fp8",
]
