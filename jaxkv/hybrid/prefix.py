"""Prefix sharing: a new request starts from the first tokens of another, its blocks shared.

``share(state, dst, src, length)`` gives each empty slot ``dst[f]`` the first ``length[f]``
tokens of slot ``src[f]`` (a live request, or a finished one its caller kept as a prefix
cache: a slot it has not finished). Per compression ratio ``r``, with ``n = length // r``
complete entries and ``bs`` entries per block:

* every block whose entries all lie before the first entry the re-feed below rewrites is
  *shared*: ``dst``'s block table names the source's block (no bytes move). A block is
  only ever written while its entries are incomplete, and a shared block's are all
  complete, so no holder writes it again; it returns to its free stack when the last
  table that names it lets go (``finish``, ``offload``: ``step.holders``);
* the blocks after those, up to the partial last one, are *copied* into fresh blocks of
  ``dst`` (entries ``< n`` only; the rest of a copied block is zeros, never the source's
  later entries).

The window ring and the compressor tails depend on the last tokens. When ``length`` is the
source's whole length they are copied and ``dst`` is ready at ``length``. Otherwise ``dst``
is left at position ``refeed_start(config, length, source_length)`` with an empty ring and
empty tails, and the caller feeds it positions ``refeed_start .. length - 1`` (the same
per-layer inputs the source was fed; at most ``window + 2 * indexer_ratio`` tokens) through
``prepare_forward`` and the layer ops, then calls ``complete_share``, which copies back the
entries ``refeed_start // r .. n - 1``: the first of them were flushed from empty tails
during the re-feed and are the source's exact bytes after it.

The re-feed start ``s`` is the largest position with ``s <= length - window`` (the ring then
holds only re-fed tokens), and, per ratio ``r``, ``s <= r * (length // r)`` for HCA (the
tail at ``length`` folds only tokens after the last boundary, which the re-feed reaches
with a reset tail) and, for CSA's overlapping windows, ``s <= r * (length // r - 1)`` with
``s`` a multiple of ``r``: entry ``i`` pools window ``i``'s a-rows and window ``i - 1``'s
b-rows, so the tail at ``length`` needs the whole previous window fed from its start.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.errors import Fault, record
from jaxkv.hybrid.config import HybridConfig
from jaxkv.hybrid.state import HybridCacheState
from jaxkv.hybrid.step import _as_i32, _bad_rows, _check_batch, _holds, _pop_blocks, _shard_slots, _slot_rows
from jaxkv.math.compressor import empty_tail
from jaxkv.sharding import on_devices


def refeed_start(config: HybridConfig, length, source_length=None):
    """First position the caller re-feeds after ``share`` of ``length`` tokens: ``length``
    itself (nothing to re-feed) when ``source_length == length``. On ints, or on i32 arrays
    inside a jitted function."""
    if not isinstance(length, jax.Array):
        s = length if source_length == length else int(refeed_start(config, jnp.asarray(length, jnp.int32)))
        return s
    s = length - config.window
    for r in config.ratios:
        s = jnp.minimum(s, (length // r - int(r == config.indexer_ratio)) * r)
    align = config.indexer_ratio if config.indexer_ratio in config.ratios else 1
    s = jnp.maximum((s // align) * align, 0)
    return s if source_length is None else jnp.where(source_length == length, length, s)


def _copied_blocks_max(config: HybridConfig, r: int) -> int:
    """Most blocks ``share`` copies per request for ratio ``r``: the re-feed spans at most
    ``max(window, 2 * CSA ratio, HCA ratios) + CSA ratio`` tokens (``refeed_start``)."""
    span = max([config.window] + [2 * q if q == config.indexer_ratio else q for q in config.ratios])
    span += config.indexer_ratio
    return min(-(-(span // r + 2) // config.block_size) + 1, config.max_blocks_per_request(r))


def _plan(config: HybridConfig, r: int, length, start):
    """(complete entries, shared blocks, blocks in all) of ratio ``r`` for a prefix of
    ``length`` tokens re-fed from ``start``."""
    n = length // r
    return n, (start // r) // config.block_size, -(-n // config.block_size)


def _item_of_byte(segments, bs: int):
    """i32[bs * sum(segments)]: the item each byte of a block belongs to (blocks are
    segment-major: ``jaxkv.formats.storage``)."""
    return np.concatenate([np.repeat(np.arange(bs, dtype=np.int32), z) for z in segments])


def _below(first_entry, n, K: int, bs: int, segments):
    """bool[1, F, K, bs * E]: the bytes of entries ``< n[f]`` in row f's K blocks, block ``k``
    holding entries ``first_entry[f] + k * bs ..``."""
    entry = first_entry[:, None, None] + (jnp.arange(K) * bs)[None, :, None] + _item_of_byte(segments, bs)[None, None]
    return (entry < n[:, None, None])[None]


def share(state: HybridCacheState, dst, src, length):
    """``state`` with each empty slot ``dst[f]`` holding the first ``length[f]`` tokens of slot
    ``src[f]`` (see the module docstring for what is shared, copied and re-fed).

    dst, src, length: i32[F]. A row whose ``dst`` is out of range, repeated or not empty, or
    whose source is out of range, on another request shard, ``dst`` itself or shorter than
    ``length`` (or ``length < 1``), or whose copies do not fit the free blocks, is not
    shared: SLOT_OUT_OF_RANGE, SLOT_REPEATED, SLOT_IN_USE, SHARE_INVALID or POOL_EXHAUSTED
    on ``dst`` (or the bad-row entry), and every other request is untouched.
    """
    return _share(state, *_rows3(dst, src, length))


def complete_share(state: HybridCacheState, dst, src, length):
    """After the re-feed of a ``share`` that left ``dst`` short of ``length``: the entries
    the re-feed flushed from empty tails replaced by the source's. ``dst`` must sit at
    ``length`` and ``src`` still hold at least ``length`` tokens (else SHARE_INVALID on
    ``dst``, nothing changed). For a ``share`` of a whole source it changes nothing."""
    return _complete(state, *_rows3(dst, src, length))


def _rows3(dst, src, length):
    dst = _as_i32("dst", dst)
    if dst.ndim != 1:
        raise ValueError(f"dst: expected shape [F], got {tuple(dst.shape)}")
    F = dst.shape[0]
    return dst, _as_i32("src", src, (F,)), _as_i32("length", length, (F,))


def _per_shard(fn, state: HybridCacheState, dst, src, length):
    """``fn`` on each request shard with the shard's own slot ids (-1: another shard's)."""
    lay = state.layout
    if lay is None:
        return fn(state, dst, src, length)
    _check_batch(state, dst.shape[0])

    def local(part, dst, src, length):
        Rl = part.config.max_requests
        return fn(part, _shard_slots(dst, lay, Rl), _shard_slots(src, lay, Rl), length)

    return on_devices(local, state, dst, src, length, axes=(("requests",),) * 3, out="state")


@functools.partial(jax.jit, donate_argnums=0)
def _share(state, dst, src, length):
    return _per_shard(_share_rows, state, dst, src, length)


@functools.partial(jax.jit, donate_argnums=0)
def _complete(state, dst, src, length):
    return _per_shard(_complete_rows, state, dst, src, length)


def _source(state, dst, src, length):
    """(rows, in_range, dst slot, repeated, src slot, valid source) common to both calls."""
    R = state.config.max_requests
    in_range, d, repeated = _slot_rows(dst, R)
    src_ok = (src >= 0) & (src < R)
    s = jnp.where(src_ok, src, 0)
    valid = src_ok & (s != d) & (length >= 1) & (length <= state.position[s])
    return in_range & ~repeated, in_range, d, repeated, s, valid


def _share_rows(state: HybridCacheState, dst, src, length):
    c = state.config
    R, bs, fmt = c.max_requests, c.block_size, c.storage_format
    rows, in_range, d, repeated, s, valid = _source(state, dst, src, length)
    busy = rows & _holds(state, d)
    bad = rows & ~busy & ~valid
    ok = rows & ~busy & valid
    src_len = state.position[s]
    whole = length == src_len
    start = refeed_start(c, length, src_len)

    plans = [_plan(c, r, length, start) for r in c.ratios]
    fits = ok
    for (_, shared, total), al in zip(plans, state.alloc):
        fits &= jnp.cumsum(jnp.where(ok, total - shared, 0)) <= al.num_free
    go = ok & fits
    ws = jnp.where(go, d, R)

    new_alloc, new_entries, got = [], [], []
    for (n, shared, total), r, al, pool in zip(plans, c.ratios, state.alloc, state.entries):
        K = _copied_blocks_max(c, r)
        own = jnp.where(go, total - shared, 0)
        blk, take = _pop_blocks(al, own, K)  # i32 / bool[F, K]
        logical = shared[:, None] + jnp.arange(K)[None, :]  # the request's block index of each copy
        src_blk = al.table[s[:, None], jnp.clip(logical, 0, al.table.shape[1] - 1)]
        dest = jnp.where(take, blk, pool.shape[1])  # out of range: dropped
        first = shared * bs
        below = _below(first, n, K, bs, fmt.entry.segments)  # entries past the prefix stay zeros
        copies = jnp.where(below, pool[:, jnp.maximum(src_blk, 0)], jnp.zeros((), pool.dtype))
        new_entries.append(pool.at[:, dest].set(copies, mode="drop"))
        got.append((dest, src_blk, first, n, K))
        j = jnp.arange(al.table.shape[1])[None, :]
        row = jnp.where(j < shared[:, None], al.table[s], -1)
        row = row.at[jnp.arange(row.shape[0])[:, None], jnp.where(take, logical, row.shape[1])].set(blk, mode="drop")
        new_alloc.append(
            al.replace(
                table=al.table.at[ws].set(row, mode="drop"),
                owned=al.owned.at[ws].set(total, mode="drop"),
                num_free=al.num_free - jnp.sum(own),
            )
        )
    index_keys = state.index_keys
    if c.index_layers:
        dest, src_blk, first, n, K = got[c.ratios.index(c.indexer_ratio)]
        below = _below(first, n, K, bs, fmt.index_key(c.index_dim).segments)
        keys = jnp.where(below, index_keys[:, jnp.maximum(src_blk, 0)], jnp.zeros((), index_keys.dtype))
        index_keys = index_keys.at[:, dest].set(keys, mode="drop")

    def rows_of(x, whole_rows):  # x's rows at the source where the whole source is taken
        keep = whole.reshape((1, -1) + (1,) * (x.ndim - 2))
        return jnp.where(keep, x[:, s], whole_rows)

    err = _bad_rows(state.error, R, ~in_range, repeated)
    row_err = record(
        record(record(err[d], busy, Fault.SLOT_IN_USE), bad, Fault.SHARE_INVALID), ok & ~fits, Fault.POOL_EXHAUSTED
    )
    err = err.at[jnp.where(rows, d, R + 1)].set(row_err, mode="drop")
    return state.replace(
        position=state.position.at[ws].set(start, mode="drop"),
        error=err,
        window=state.window.at[:, ws].set(rows_of(state.window, jnp.zeros((), state.window.dtype)), mode="drop"),
        tails=tuple(
            t.at[:, ws].set(rows_of(t, empty_tail((), t.shape[2], t.shape[-1])), mode="drop") for t in state.tails
        ),
        entries=tuple(new_entries),
        index_keys=index_keys,
        alloc=tuple(new_alloc),
    )


def _complete_rows(state: HybridCacheState, dst, src, length):
    c = state.config
    R, bs = c.max_requests, c.block_size
    rows, in_range, d, repeated, s, valid = _source(state, dst, src, length)
    ok = rows & valid & (state.position[d] == length)
    start = refeed_start(c, length)

    def merge(pool, al, r, segments):  # dst's copied blocks, entries < n from the source's same blocks
        n, shared, _ = _plan(c, r, length, start)
        K = _copied_blocks_max(c, r)
        logical = jnp.clip(shared[:, None] + jnp.arange(K)[None, :], 0, al.table.shape[1] - 1)
        mine = al.table[d[:, None], logical]
        theirs = al.table[s[:, None], logical]
        go = ok[:, None] & (mine >= 0) & (theirs >= 0) & (mine != theirs)
        below = _below(shared * bs, n, K, bs, segments)
        x = jnp.where(below, pool[:, jnp.maximum(theirs, 0)], pool[:, jnp.maximum(mine, 0)])
        return pool.at[:, jnp.where(go, mine, pool.shape[1])].set(x, mode="drop")

    fmt = c.storage_format
    entries = tuple(merge(p, al, r, fmt.entry.segments) for p, al, r in zip(state.entries, state.alloc, c.ratios))
    index_keys = state.index_keys
    if c.index_layers:
        g = c.ratios.index(c.indexer_ratio)
        index_keys = merge(index_keys, state.alloc[g], c.indexer_ratio, fmt.index_key(c.index_dim).segments)
    err = _bad_rows(state.error, R, ~in_range, repeated)
    row_err = record(err[d], rows & ~ok, Fault.SHARE_INVALID)
    err = err.at[jnp.where(rows, d, R + 1)].set(row_err, mode="drop")
    return state.replace(entries=entries, index_keys=index_keys, error=err)


__all__ = ["complete_share", "refeed_start", "share"]
