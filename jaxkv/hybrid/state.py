"""HybridCacheState: every buffer of a DeepSeek-V4 style cache, as one pytree.

Arrays are stacked over the layers that share a shape, so a step's executable has a
handful of buffers, not a few per layer. Per request slot (``R = config.max_requests``):

* ``position: i32[R]`` tokens the request has seen (its next token's position);
* ``window: u8[L, R, window * E]`` every layer's SWA ring: the token at position p sits in
  item ``p % window`` of the request's block (``E`` = the storage's entry bytes; in the
  official family a request's ring is one ds_mla block);
* ``tails[g]: f32[Lg, R, streams, 3, width]`` the running-softmax tails of the ``Lg``
  layers of ratio ``config.ratios[g]`` (see ``compressor``): CSA 3 streams over
  ``head_dim + index_dim`` channels (the main and the indexer compressor side by side),
  HCA 1 stream over ``head_dim``. Stacked, like the pools: every buffer of the state costs
  the step's dispatch a few microseconds (``benchmarks/RESULTS.md``).

Per ratio ``g``, paged pools ``entries[g]: u8[Lg, num_blocks, block_size * E]`` and, for the
CSA ratio, ``index_keys: u8[Lg, num_blocks, block_size * K]``. Every layer of a ratio
holds the same number of entries per request, so they share one ``BlockAllocator``:
physical block ``b`` of a request's table is block ``b`` of each of those layers' pools
(bookkeeping once per ratio, not once per layer).

``error: u32[R + 1]`` sticky fault bits per slot; the last entry collects faults of a
batch row whose slot is out of range or repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._pytree import cache_dataclass, static_field
from jaxkv.math.compressor import empty_tail
from jaxkv.hybrid.config import HybridConfig


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
    window: jnp.ndarray
    tails: tuple
    entries: tuple
    index_keys: jnp.ndarray
    alloc: tuple
    config: HybridConfig = static_field()

    def fault_owner(self, i: int) -> str:
        return "batch row with a bad slot" if i == self.config.max_requests else f"request slot {i}"

    def group(self, layer: int) -> tuple[int, int]:
        """(ratio group g, index of the layer among that ratio's layers)."""
        c = self.config
        r = c.compress_ratios[layer]
        return c.ratios.index(r), [l for l in range(c.num_layers) if c.compress_ratios[l] == r].index(layer)

    def allocator(self, layer: int) -> BlockAllocator:
        return self.alloc[self.group(layer)[0]]


def _layers_of(c: HybridConfig, ratio: int) -> int:
    return c.compress_ratios.count(ratio)


def init(config: HybridConfig) -> HybridCacheState:
    """An empty cache: every slot at position 0, every block free."""
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config: expected a jaxkv.hybrid.HybridConfig, got {type(config).__name__}")
    c = config
    fmt = c.storage_format
    R = c.max_requests
    key_bytes = fmt.index_key_bytes(c.index_dim)

    def tails(r):  # f32[Lg, R, streams, 3, width]: CSA's three streams over main + indexer channels
        csa = r == c.indexer_ratio
        streams, width = (3, c.head_dim + c.index_dim) if csa else (1, c.head_dim)
        return jnp.array(empty_tail((_layers_of(c, r), R), streams, width))

    n_csa = _layers_of(c, c.indexer_ratio)
    return HybridCacheState(
        position=jnp.zeros((R,), jnp.int32),
        error=jnp.zeros((R + 1,), jnp.uint32),
        window=jnp.zeros((c.num_layers, R, c.window * fmt.entry_bytes), jnp.uint8),
        tails=tuple(tails(r) for r in c.ratios),
        entries=tuple(jnp.zeros((_layers_of(c, r), c.num_blocks(r), c.block_size * fmt.entry_bytes), jnp.uint8)
                      for r in c.ratios),
        index_keys=jnp.zeros((n_csa, c.num_blocks(c.indexer_ratio) if n_csa else 0, c.block_size * key_bytes), jnp.uint8),
        alloc=tuple(BlockAllocator.create(c.num_blocks(r), R, c.max_blocks_per_request(r)) for r in c.ratios),
        config=c,
    )


def nbytes(state: HybridCacheState) -> int:
    """Device bytes the cache holds."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)))
