"""The DeepSeek-V4 hybrid compressed cache: SWA rings, CSA / HCA compressors, paged pools.

Functional API (pure functions over ``HybridCacheState``; writes are jitted, state donated)::

    config = dataclasses.replace(jaxkv.hybrid.V4_FLASH, max_requests=8, max_context=8192)
    state = init(config)
    state, step = prepare_forward(state, slots, positions, num_tokens, chunk=T)
    for layer in range(config.num_layers):
        if config.compress_ratios[layer]:
            state = compress(state, step, layer, ckv, cscore, params, index=...)  # CSA: index=(...)
        state, idx = index_topk(state, step, layer, qi, weights)      # CSA layers only
        out = attention(state, step, layer, q, sink, kv, idx=idx)     # reads the ring before this step's write
        state = after_reads(state, out)                               # so the writes below stay in place
        state = write_window(state, step, layer, kv)
    state = finish(state, done_slots)
    state, image = offload(state, slots)          # preemption: the requests leave, whole
    state = reload(state, empty_slots, to_host(image))   # and come back bit-exact
    state = share(state, new_slots, cached_slots, lengths)  # a prefix by reference (prefix.py)

``Step`` is the boundary type between the cache and a model (its docstring defines the
batch indexing); ``Stacked(array, i)`` passes a layer's input as row ``i`` of an array
stacked over layers, without a copy; ``HybridCache`` is the eager wrapper that raises on recorded faults.
"""

from jaxkv.formats.storage import STORAGES
from jaxkv.hybrid.attention import (
    after_reads,
    attention,
    causal_entry_mask,
    sparse_attention,
    window_mask,
)
from jaxkv.hybrid.config import CSA, HCA, SWA, V4_FLASH, V4_PRO, HybridConfig, bytes_per_token
from jaxkv.hybrid.eager import HybridCache
from jaxkv.hybrid.indexer import index_query, index_scores, index_topk
from jaxkv.hybrid.ops import (
    CompressorParams,
    all_entries,
    compress,
    entry_count,
    gather_entries,
    index_keys,
    window_keys,
    write_window,
)
from jaxkv.hybrid.prefix import complete_share, refeed_start, share
from jaxkv.hybrid.prefix_index import PrefixIndex
from jaxkv.hybrid.state import BlockAllocator, HybridCacheState, block_counts, init, nbytes
from jaxkv.hybrid.step import Step, finish, prepare_forward, query_positions
from jaxkv.hybrid.tier import RequestImage, offload, reload, to_device, to_host
from jaxkv.hybrid.views import LayerView, layer_view
from jaxkv.math.compressor import ref_pool_sequence
from jaxkv.stacked import Stacked

__all__ = [
    "after_reads",
    "attention",
    "BlockAllocator",
    "block_counts",
    "CSA",
    "LayerView",
    "layer_view",
    "CompressorParams",
    "HCA",
    "HybridCache",
    "HybridCacheState",
    "HybridConfig",
    "STORAGES",
    "SWA",
    "Stacked",
    "Step",
    "V4_FLASH",
    "V4_PRO",
    "all_entries",
    "bytes_per_token",
    "causal_entry_mask",
    "complete_share",
    "compress",
    "entry_count",
    "finish",
    "gather_entries",
    "index_keys",
    "index_query",
    "index_scores",
    "index_topk",
    "init",
    "nbytes",
    "PrefixIndex",
    "prepare_forward",
    "query_positions",
    "refeed_start",
    "RequestImage",
    "share",
    "offload",
    "reload",
    "to_device",
    "to_host",
    "ref_pool_sequence",
    "sparse_attention",
    "window_keys",
    "window_mask",
    "write_window",
]
