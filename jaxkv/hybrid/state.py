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
  HCA 1 stream over ``head_dim``. Stacked, like the pools: every buffer of the state adds
  to the step's dispatch time (docs/hybrid.md).

Per ratio ``g``, paged pools ``entries[g]: u8[Lg, num_blocks, block_size * E]`` and, for the
CSA ratio, ``index_keys: u8[Lg, num_blocks, block_size * K]``. Every layer of a ratio
holds the same number of entries per request, so they share one ``BlockAllocator``:
physical block ``b`` of a request's table is block ``b`` of each of those layers' pools
(bookkeeping once per ratio, not once per layer).

``error: u32[R + 1]`` sticky fault bits per slot; the last entry collects faults of a
batch row whose slot is out of range or repeated.

Laid out on a mesh (``init(config, mesh=...)``, ``jaxkv.sharding``), the request slots are
split over the data axis into ``S`` shards of ``R / S`` consecutive slots, and each shard
has the whole structure above for its slots: its own pools (``num_blocks`` of a
``local_config`` each, concatenated along the block axis), free stacks and block tables
holding *its own* block ids (``0 ..`` its blocks: what a kernel on that device indexes),
``num_free: i32[S]``, and ``error: u32[S * (R / S + 1)]``. Allocation never leaves the
shard, so a step needs no collective.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv._pytree import cache_dataclass, static_field
from jaxkv.hybrid.config import HybridConfig
from jaxkv.math.compressor import empty_tail
from jaxkv.sharding import Layout


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
    def create(num_blocks: int, requests: int, max_blocks: int) -> BlockAllocator:
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
    layout: Layout | None = static_field(default=None)

    def fault_owner(self, i: int) -> str:
        R = self.config.max_requests
        if self.layout is None:
            return "batch row with a bad slot" if i == R else f"request slot {i}"
        n = R // self.layout.shards("requests")
        shard, j = divmod(i, n + 1)
        if j == n:
            return (
                f"batch row with a bad slot on data shard {shard} (out of range, repeated, or owned by another shard)"
            )
        return f"request slot {shard * n + j}"

    def group(self, layer: int) -> tuple[int, int]:
        """(ratio group g, index of the layer among that ratio's layers)."""
        c = self.config
        r = c.compress_ratios[layer]
        return c.ratios.index(r), [l for l in range(c.num_layers) if c.compress_ratios[l] == r].index(layer)

    def allocator(self, layer: int) -> BlockAllocator:
        return self.alloc[self.group(layer)[0]]

    # how the state splits on its layout (``jaxkv.sharding.on_devices``)
    def partition_specs(self) -> HybridCacheState:
        """The PartitionSpec of every array on ``layout``'s mesh (a state of specs)."""
        return specs(self.config, self.layout)

    def to_shard(self) -> HybridCacheState:
        """This device's part as a state of its own: a ``local_config``, its own block ids
        and ``num_free``, no layout."""
        alloc = tuple(a.replace(num_free=a.num_free[0]) for a in self.alloc)
        return self.replace(config=local_config(self.config, self.layout.shards("requests")), layout=None, alloc=alloc)

    def from_shard(self, part: HybridCacheState) -> HybridCacheState:
        """A device's ``part`` (``to_shard``, updated) as its piece of this whole state."""
        alloc = tuple(a.replace(num_free=a.num_free[None]) for a in part.alloc)
        return part.replace(config=self.config, layout=self.layout, alloc=alloc)


def _layers_of(c: HybridConfig, ratio: int) -> int:
    return c.compress_ratios.count(ratio)


def init(config: HybridConfig, *, mesh=None, rules=None) -> HybridCacheState:
    """An empty cache: every slot at position 0, every block free.

    mesh: a ``jax.sharding.Mesh``: request slots (and their pools, block tables and free
      stacks) are split over its ``data`` axis (``rules``: see ``jaxkv.sharding``); each
      device holds and steps its own requests. None: one device.
    """
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config: expected a jaxkv.hybrid.HybridConfig, got {type(config).__name__}")
    lay = sharding.layout(mesh, rules)
    if lay is None:
        return _empty(config)
    lay.check_divides("requests", config.max_requests, "HybridConfig.max_requests")
    n = lay.shards("requests")
    local = local_config(config, n)
    names, tree = jax.tree_util.tree_flatten(logical_axes(config, lay), is_leaf=_is_spec)

    def make():
        parts = [jax.tree_util.tree_leaves(_empty(local)) for _ in range(n)]

        def join(axes, *xs):  # the shards' arrays side by side along the requests axis; num_free: stacked
            return jnp.stack(xs) if xs[0].ndim < len(axes) else jnp.concatenate(xs, axis=list(axes).index("requests"))

        return jax.tree_util.tree_unflatten(tree, [join(a, *xs) for a, *xs in zip(names, *parts)])

    return sharding.build(make, specs(config, lay), lay).replace(config=config)


def local_config(config: HybridConfig, shards: int) -> HybridConfig:
    """The config of one of ``shards`` request shards: ``max_requests / shards`` slots and
    ``pool_tokens / shards`` (rounded up) of pool."""
    pool = None if config.pool_tokens is None else -(-config.pool_tokens // shards)
    return dataclasses.replace(config, max_requests=config.max_requests // shards, pool_tokens=pool)


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def logical_axes(config: HybridConfig, lay: Layout | None = None) -> HybridCacheState:
    """The logical axes (``jaxkv.sharding``) of every array, as a state of PartitionSpecs."""

    def req(ndim, axis=0):
        return jax.sharding.PartitionSpec(*("requests" if i == axis else None for i in range(ndim)))

    return HybridCacheState(
        position=req(1),
        error=req(1),
        window=req(3, 1),
        tails=tuple(req(5, 1) for _ in config.ratios),
        entries=tuple(req(3, 1) for _ in config.ratios),
        index_keys=req(3, 1),
        alloc=tuple(BlockAllocator(free=req(1), num_free=req(1), table=req(2), owned=req(1)) for _ in config.ratios),
        config=config,
        layout=lay,
    )


def specs(config: HybridConfig, lay: Layout) -> HybridCacheState:
    """The PartitionSpec of every array of a cache laid out by ``lay`` (a state of specs)."""
    return jax.tree_util.tree_map(lambda axes: lay.spec(*axes), logical_axes(config, lay), is_leaf=_is_spec)


def _empty(config: HybridConfig) -> HybridCacheState:
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
        entries=tuple(
            jnp.zeros((_layers_of(c, r), c.num_blocks(r), c.block_size * fmt.entry_bytes), jnp.uint8) for r in c.ratios
        ),
        index_keys=jnp.zeros(
            (n_csa, c.num_blocks(c.indexer_ratio) if n_csa else 0, c.block_size * key_bytes), jnp.uint8
        ),
        alloc=tuple(BlockAllocator.create(c.num_blocks(r), R, c.max_blocks_per_request(r)) for r in c.ratios),
        config=c,
    )


def nbytes(state: HybridCacheState) -> int:
    """Device bytes the cache holds."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)))


def block_counts(state: HybridCacheState) -> tuple[int, int]:
    """(blocks in use, blocks the block tables name), over every ratio; reads the device.
    With shared prefixes (``hybrid.share``) a block named by several tables counts once in
    the first and once per table in the second: what the same requests would hold unshared."""
    used = sum(int(a.free.shape[0] - a.num_free.sum()) for a in state.alloc)
    return used, sum(int(a.owned.sum()) for a in state.alloc)
