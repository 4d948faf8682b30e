"""A host tier for the hybrid cache: requests leave the device whole and come back bit-exact.

Preemption by swap instead of recompute: ``offload`` copies each request's whole state (its
compressed entries and indexer keys, SWA ring, compressor tails, position and fault bits)
into a ``RequestImage`` and releases its slot; ``to_host`` moves the image to pinned host
memory (a JAX memory kind: no torch); ``reload`` puts it back into any empty slot, on fresh
blocks, so the request decodes on as if it had never left. Blocks travel in logical order
and land wherever the free stacks give them: a block table is rebuilt, never copied.

On a mesh the image's rows split like a step's batch (row f on request shard f // (F / S),
its slot one of that shard's: docs/sharding.md), so each device moves only its own
requests and nothing crosses devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxkv._pytree import cache_dataclass, static_field
from jaxkv.errors import Fault, record
from jaxkv.hybrid.config import HybridConfig
from jaxkv.hybrid.state import HybridCacheState
from jaxkv.hybrid.step import _as_i32, _bad_rows, _check_batch, _finish, _holds, _pop_blocks, _shard_slots, _slot_rows
from jaxkv.sharding import on_devices


@cache_dataclass
class RequestImage:
    """F requests' cache, outside a state (``offload``); row f is ``slots[f]``'s request.

    position: i32[F]  tokens each request had seen (0: the row held nothing)
    error: u32[F]  its sticky fault bits
    window: u8[L, F, window * E]  its SWA rings
    tails: tuple of f32[Lg, F, streams, 3, width]  its compressor tails, per ratio
    entries: tuple of u8[Lg, F, max_blocks, block * E]  its blocks in logical order, per
      ratio (the first ``owned[g]`` hold data; the rest zeros)
    index_keys: u8[Lcsa, F, max_blocks, block * K]  the CSA ratio's indexer keys, likewise
    owned: i32[G, F]  blocks it held per ratio
    """

    position: jnp.ndarray
    error: jnp.ndarray
    window: jnp.ndarray
    tails: tuple
    entries: tuple
    index_keys: jnp.ndarray
    owned: jnp.ndarray
    config: HybridConfig = static_field()


def _image_axes(config: HybridConfig) -> RequestImage:
    """The logical axes of an image's arrays (``jaxkv.sharding``): its rows are requests."""
    rows, later = PartitionSpec("requests"), PartitionSpec(None, "requests")
    G = len(config.ratios)
    return RequestImage(rows, rows, later, (later,) * G, (later,) * G, later, later, config)


def _on_shards(fn, state: HybridCacheState, slots, *image):
    """``fn(part, local slots, *image)`` on each request shard (the state's own when it has no
    layout); an image crosses the boundary with the whole state's config."""
    lay = state.layout
    if lay is None:
        return fn(state, slots, *image)
    _check_batch(state, slots.shape[0])
    c = state.config

    def local(part, slots, *img):
        img = tuple(i.replace(config=part.config) for i in img)
        res = fn(part, _shard_slots(slots, lay, part.config.max_requests), *img)
        return jax.tree_util.tree_map(
            lambda x: x.replace(config=c) if isinstance(x, RequestImage) else x,
            res,
            is_leaf=lambda x: isinstance(x, RequestImage),
        )

    axes = (("requests",),) + (_image_axes(c),) * len(image)
    out = ["state", _image_axes(c)] if not image else "state"
    return on_devices(local, state, slots, *image, axes=axes, out=out)


@functools.partial(jax.jit, donate_argnums=0)
def offload(state: HybridCacheState, slots):
    """(state with ``slots`` released, their ``RequestImage``).

    slots: i32[F] request slots. A slot out of range or repeated records a fault (as
    ``finish``) and its row of the image is empty (position 0), as is an empty slot's.
    """
    slots = _as_i32("slots", slots)
    if slots.ndim != 1:
        raise ValueError(f"slots: expected shape [F], got {tuple(slots.shape)}")
    return _on_shards(_offload, state, slots)


def _offload(state: HybridCacheState, slots):
    c = state.config
    R = c.max_requests
    in_range, slot, repeated = _slot_rows(slots, R)
    ok = in_range & ~repeated

    def rows(x, axis):  # x's rows of the ok slots along ``axis`` (zeros elsewhere)
        got = jnp.take(x, slot, axis=axis)
        keep = ok.reshape((1,) * axis + (-1,) + (1,) * (got.ndim - axis - 1))
        return jnp.where(keep, got, jnp.zeros((), got.dtype))

    owned = jnp.stack([jnp.where(ok, al.owned[slot], 0) for al in state.alloc])  # i32[G, F]

    def blocks(pool, al, n):  # u8[Lg, F, max_blocks, bytes]: each row's blocks, logical order
        table = al.table[slot]  # i32[F, max_blocks]
        held = jnp.arange(table.shape[1])[None, :] < n[:, None]
        got = pool[:, jnp.where(held, table, 0)]
        return jnp.where(held[None, :, :, None], got, jnp.zeros((), pool.dtype))

    g_csa = c.ratios.index(c.indexer_ratio) if c.index_layers else None
    image = RequestImage(
        position=rows(state.position, 0),
        error=rows(state.error[:R], 0),
        window=rows(state.window, 1),
        tails=tuple(rows(t, 1) for t in state.tails),
        entries=tuple(blocks(p, al, owned[g]) for g, (p, al) in enumerate(zip(state.entries, state.alloc))),
        index_keys=blocks(state.index_keys, state.alloc[g_csa], owned[g_csa])
        if g_csa is not None
        else jnp.zeros((0, slots.shape[0], 1, state.index_keys.shape[-1]), jnp.uint8),
        owned=owned,
        config=c,
    )
    return _finish(state, slots, jnp.ones(slots.shape, jnp.bool_), empty_is_fault=False), image


def reload(state: HybridCacheState, slots, image: RequestImage):
    """``state`` with ``image``'s requests back in the empty ``slots`` (i32[F], row f of the
    image into ``slots[f]``), on blocks from the free stacks.

    A row whose slot is out of range, repeated or not empty (it holds tokens or blocks), or
    whose blocks do not fit what is free (granted in row order, as ``prepare_forward``
    does), is not reloaded: its slot, or the bad-row entry, gets SLOT_OUT_OF_RANGE,
    SLOT_REPEATED, SLOT_IN_USE or POOL_EXHAUSTED, and the other requests are untouched. An
    image of another config is a ValueError. The image may sit in host memory (``to_host``):
    it is copied to the device first.
    """
    return _reload(state, slots, to_device(image))


@functools.partial(jax.jit, donate_argnums=0)
def _reload(state: HybridCacheState, slots, image: RequestImage):
    c = state.config
    if image.config != c:
        diff = [f for f in c.__dataclass_fields__ if getattr(c, f) != getattr(image.config, f)]
        raise ValueError(f"image: offloaded from a cache of another config (differs in {', '.join(diff)})")
    slots = _as_i32("slots", slots)
    F = image.position.shape[0]
    if slots.shape != (F,):
        raise ValueError(f"slots: expected shape [{F}] (the image's rows), got {tuple(slots.shape)}")
    return _on_shards(_reload_rows, state, slots, image)


def _reload_rows(state: HybridCacheState, slots, image: RequestImage):
    c = state.config
    R = c.max_requests
    in_range, slot, repeated = _slot_rows(slots, R)
    busy = in_range & ~repeated & _holds(state, slot)
    ok = in_range & ~repeated & ~busy
    fits = ok
    for g, al in enumerate(state.alloc):
        fits &= jnp.cumsum(jnp.where(ok, image.owned[g], 0)) <= al.num_free
    go = ok & fits
    ws = jnp.where(go, slot, R)  # the write slot: R drops

    new_alloc, new_entries, got_blocks = [], [], []
    for g, (al, pool, img) in enumerate(zip(state.alloc, state.entries, image.entries)):
        n = jnp.where(go, image.owned[g], 0)
        blk, take = _pop_blocks(al, n, img.shape[2])  # i32 / bool[F, max_blocks]
        dest = jnp.where(take, blk, pool.shape[1])  # i32[F, max_blocks]; out of range drops
        got_blocks.append(dest)
        new_entries.append(pool.at[:, dest].set(img, mode="drop"))
        new_alloc.append(
            al.replace(
                table=al.table.at[ws].set(jnp.where(take, blk, -1), mode="drop"),
                owned=al.owned.at[ws].set(n, mode="drop"),
                num_free=al.num_free - jnp.sum(n),
            )
        )
    index_keys = state.index_keys
    if c.index_layers:
        g_csa = c.ratios.index(c.indexer_ratio)
        index_keys = index_keys.at[:, got_blocks[g_csa]].set(image.index_keys, mode="drop")

    err = _bad_rows(state.error, R, ~in_range, repeated)
    row_err = jnp.where(go, image.error, err[slot])
    row_err = record(record(row_err, busy, Fault.SLOT_IN_USE), ok & ~fits, Fault.POOL_EXHAUSTED)
    own = jnp.where(in_range & ~repeated, slot, R + 1)
    err = err.at[own].set(row_err, mode="drop")
    return state.replace(
        position=state.position.at[ws].set(image.position, mode="drop"),
        error=err,
        window=state.window.at[:, ws].set(image.window, mode="drop"),
        tails=tuple(t.at[:, ws].set(i, mode="drop") for t, i in zip(state.tails, image.tails)),
        entries=tuple(new_entries),
        index_keys=index_keys,
        alloc=tuple(new_alloc),
    )


def to_host(image: RequestImage, memory_kind: str = "pinned_host") -> RequestImage:
    """``image`` in host memory (``memory_kind`` of its device: pinned, so the copies back run
    at DMA speed)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(memory_kind)), image)


def to_device(image: RequestImage) -> RequestImage:
    """``image`` back in device memory (``reload`` takes either)."""
    return to_host(image, "device")


__all__ = ["RequestImage", "offload", "reload", "to_device", "to_host"]
