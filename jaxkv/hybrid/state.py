"""HybridCacheState: every buffer of a DeepSeek-V4 style cache, as one pytree.

Per request slot (``R = config.max_requests``):

* ``position: i32[R]`` tokens the request has seen (its next token's position);
* ``window[l]: u8[R, window * E]`` layer l's SWA ring: token at position p sits in item
  ``p % window`` of the request's block (``E`` = the storage's entry bytes; the ring of
  a request is one ds_mla block in the official family);
* ``tails[c]: f32[R, streams, 3, head_dim]`` compressed layer c's running-softmax tail
  (see ``compressor``; 3 streams for CSA, 1 for HCA) and ``index_tails[i]`` the same for
  CSA layer i's indexer compressor (width ``index_dim``).

Per compressed layer, a paged pool: ``entries[c]: u8[num_blocks(ratio), block_size * E]``,
and for CSA layers ``index_keys[i]: u8[num_blocks(4), block_size * K]``. Every layer of
the same ratio holds the same number of entries per request, so the layers of one ratio
share one ``BlockAllocator``: physical block ``b`` of a request's table is block ``b`` of
each of those layers' pools (bookkeeping once per ratio, not once per layer).

``error: u32[R + 1]`` sticky fault bits per slot; the last entry collects faults of a
batch row whose slot is out of range or repeated.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv._pytree import cache_dataclass, static_field
from jaxkv.hybrid.compressor import empty_tail
from jaxkv.hybrid.config import CSA, HybridConfig


@cache_dataclass
class BlockAllocator:
    """Device-side block bookkeeping of one compression ratio.

    free: i32[num_blocks]  a stack; ``free[:num_free]`` are the free block ids
    num_free: i32[]
    table: i32[R, max_blocks]  physical block of each request's logical block (-1: none)
    owned: i32[R]  blocks each request holds (its table's valid prefix)
    """

    free: jnp.ndarray
    num_free: jnp.ndarray
    table: jnp.ndarray
    owned: jnp.ndarray

    @staticmethod
    def create(num_blocks: int, requests: int, max_blocks: int) -> "BlockAllocator":
        return BlockAllocator(
            free=jnp.arange(num_blocks, dtype=jnp.int32),
            num_free=jnp.asarray(num_blocks, jnp.int32),
            table=jnp.full((requests, max_blocks), -1, jnp.int32),
            owned=jnp.zeros((requests,), jnp.int32),
        )


@cache_dataclass
class HybridCacheState:
    position: jnp.ndarray
    error: jnp.ndarray
    window: tuple
    tails: tuple
    index_tails: tuple
    entries: tuple
    index_keys: tuple
    alloc: tuple
    config: HybridConfig = static_field()

    def fault_owner(self, i: int) -> str:
        return "batch row with a bad slot" if i == self.config.max_requests else f"request slot {i}"

    # layer index -> position in the per-kind tuples
    def compressed_index(self, layer: int) -> int:
        return self.config.compressed_layers.index(layer)

    def index_index(self, layer: int) -> int:
        return self.config.index_layers.index(layer)

    def allocator(self, layer: int) -> BlockAllocator:
        return self.alloc[self.config.ratios.index(self.config.compress_ratios[layer])]


def init(config: HybridConfig) -> HybridCacheState:
    """An empty cache: every slot at position 0, every block free."""
    c = config
    fmt = c.storage_format
    R = c.max_requests
    key_bytes = fmt.index_key_bytes(c.index_dim)
    return HybridCacheState(
        position=jnp.zeros((R,), jnp.int32),
        error=jnp.zeros((R + 1,), jnp.uint32),
        window=tuple(jnp.zeros((R, c.window * fmt.entry_bytes), jnp.uint8) for _ in range(c.num_layers)),
        tails=tuple(
            empty_tail((R,), 3 if c.kind(l) == CSA else 1, c.head_dim) for l in c.compressed_layers
        ),
        index_tails=tuple(empty_tail((R,), 3, c.index_dim) for _ in c.index_layers),
        entries=tuple(
            jnp.zeros((c.num_blocks(c.compress_ratios[l]), c.block_size * fmt.entry_bytes), jnp.uint8)
            for l in c.compressed_layers
        ),
        index_keys=tuple(
            jnp.zeros((c.num_blocks(c.indexer_ratio), c.block_size * key_bytes), jnp.uint8) for _ in c.index_layers
        ),
        alloc=tuple(BlockAllocator.create(c.num_blocks(r), R, c.max_blocks_per_request(r)) for r in c.ratios),
        config=c,
    )


def nbytes(state: HybridCacheState) -> int:
    """Device bytes the cache holds."""
    import jax

    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)))
