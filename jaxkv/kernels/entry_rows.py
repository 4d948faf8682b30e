"""A CSA layer's row list for pool attention: the picked entries as rows of the layer's pool.

Pool attention reads per query a list of row ids in blocks of 64 and a count of valid rows
per block (``pool_attention``'s ``rows`` / ``nvalid``). A CSA layer's part of that list comes
from the indexer's picks: entry e of request b is item ``e % block_size`` of block
``table[slot[b], e // block_size]``. ``ref_entry_rows`` is the rule in jnp (the hybrid
cache's XLA path runs it); ``entry_rows_cuda`` (``jaxkv/cuda/entry_rows.cu``) is the same in
one launch, where XLA made four a layer. Shapes::

    entry:      i32[N, k]        picks per query row (-1: none)
    table:      i32[R, MB]       the ratio's block table
    slot:       i32[B]           each request's slot (N = B * T query rows, request-major)
    limit:      i32[N]           entries the query may see: a pick e is kept iff 0 <= e < limit
    rest:       i32[N, C]        the other parts' rows (window ring, own tokens), C % 64 == 0
    rest_valid: i32[N, C // 64]  and their per-block counts
    -> rows i32[N, K + C], nvalid i32[N, K // 64 + C // 64]   (K: k rounded up to 64)

A pick is -1 in ``rows`` where it is not visible or its block is unallocated or outside the
pool (``pool_blocks``): masked, never clamped, since a clamped id would read a row another
request may own. The picks' count is the position after the last valid one, so the blocks
past it are skipped; a hole before it is one masked row. A slot outside the table is
clamped into it, as XLA's gather clamps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cuda import register_ffi_targets
from jaxkv.math.paging import entry_address

BLOCK = 64  # rows per block of pool attention's list


def _check(entry, table, slot, limit, rest, rest_valid, block_size, pool_blocks):
    def want(name, x, ndim):
        if getattr(x, "ndim", None) != ndim or x.dtype != jnp.int32:
            raise ValueError(
                f"{name}: expected int32 with {ndim} dims, got "
                f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
            )

    for name, x, nd in (
        ("entry", entry, 2), ("table", table, 2), ("slot", slot, 1), ("limit", limit, 1),
        ("rest", rest, 2), ("rest_valid", rest_valid, 2),
    ):  # fmt: skip
        want(name, x, nd)
    N = entry.shape[0]
    B = slot.shape[0]
    if B < 1 or N % B:
        raise ValueError(f"slot: expected B >= 1 requests dividing entry's {N} query rows, got {B}")
    if limit.shape != (N,):
        raise ValueError(f"limit: expected int32[{N}], got {list(limit.shape)}")
    if rest.shape[0] != N or rest.shape[1] % BLOCK:
        raise ValueError(f"rest: expected int32[{N}, C] with C a multiple of {BLOCK}, got {list(rest.shape)}")
    if rest_valid.shape != (N, rest.shape[1] // BLOCK):
        raise ValueError(f"rest_valid: expected int32[{N}, {rest.shape[1] // BLOCK}], got {list(rest_valid.shape)}")
    if min(table.shape) < 1:
        raise ValueError(f"table: expected int32[R >= 1, MB >= 1], got {list(table.shape)}")
    for name, v in (("block_size", block_size), ("pool_blocks", pool_blocks)):
        if not isinstance(v, (int, np.integer)) or v < (1 if name == "block_size" else 0):
            raise ValueError(f"{name}: expected an int >= {1 if name == 'block_size' else 0}, got {v!r}")


def masked_ids(ids, valid):
    """i32[N, n] ids, bool[N, n] -> (ids where valid, -1 elsewhere, padded to whole 64-row
    blocks with -1: i32[N, n'], the count up to the last valid one: i32[N]). No sort: a hole
    before the last valid id is one masked row."""
    ids = jnp.where(valid, ids, -1)
    count = jnp.max(jnp.where(valid, jnp.arange(1, ids.shape[-1] + 1, dtype=jnp.int32), 0), axis=-1, initial=0)
    return jnp.pad(ids, ((0, 0), (0, -ids.shape[-1] % BLOCK)), constant_values=-1), count.astype(jnp.int32)


def block_counts(count, blocks: int):
    """i32[N, blocks]: valid rows of each 64-row block of a list whose first ``count`` are valid."""
    return jnp.clip(count[:, None] - BLOCK * jnp.arange(blocks)[None, :], 0, BLOCK).astype(jnp.int32)


def ref_entry_rows(entry, table, slot, limit, rest, rest_valid, *, block_size: int, pool_blocks: int):
    """``(rows, nvalid)`` in jnp: the module docstring's rule."""
    _check(entry, table, slot, limit, rest, rest_valid, block_size, pool_blocks)
    N, k = entry.shape
    T = N // slot.shape[0]
    blk, item = entry_address(table, jnp.repeat(slot, T)[:, None], entry, block_size)
    valid = (entry < limit[:, None]) & (blk >= 0) & (blk < pool_blocks)
    ids, count = masked_ids(jnp.maximum(blk, 0) * block_size + item, valid)
    rows = jnp.concatenate([ids, rest], axis=1)
    return rows.astype(jnp.int32), jnp.concatenate([block_counts(count, ids.shape[1] // BLOCK), rest_valid], axis=1)


def entry_rows_cuda(entry, table, slot, limit, rest, rest_valid, *, block_size: int, pool_blocks: int):
    """``ref_entry_rows`` in one launch (``jaxkv/cuda/entry_rows.cu``); needs a GPU and nvcc."""
    _check(entry, table, slot, limit, rest, rest_valid, block_size, pool_blocks)
    register_ffi_targets()
    N, k = entry.shape
    K = -(-k // BLOCK) * BLOCK
    C = rest.shape[1]
    out = (
        jax.ShapeDtypeStruct((N, K + C), jnp.int32),
        jax.ShapeDtypeStruct((N, (K + C) // BLOCK), jnp.int32),
    )
    return jax.ffi.ffi_call("jaxkv_entry_rows", out)(
        entry, table, slot, limit, rest, rest_valid,
        block_size=np.int32(block_size), pool_blocks=np.int32(pool_blocks),
    )  # fmt: skip


__all__ = ["block_counts", "entry_rows_cuda", "masked_ids", "ref_entry_rows"]
