"""Addresses through a block table: where a request's n-th item sits in a paged pool.

The hybrid cache's ops and the row-list kernels' references both look entries up this way;
one rule, so a pool layout change cannot leave one of them behind."""

from __future__ import annotations

import jax.numpy as jnp


def entry_address(table, slot, entry, block_size: int):
    """(block, item): where item ``entry`` of request ``slot`` sits in a paged pool: block
    ``table[slot, entry // block_size]`` (-1 where ``entry`` < 0 or no block is allocated),
    item ``entry % block_size``. ``slot`` broadcasts against ``entry`` (i32[B, 1, ...]
    against i32[B, ...]); ``table``: i32[R, max_blocks]. A block index past the table is
    clamped into it, as XLA's gather clamps; the caller masks what it may not read."""
    e = jnp.maximum(entry, 0)
    blk = table[slot, jnp.clip(e // block_size, 0, table.shape[1] - 1)]
    return jnp.where(entry >= 0, blk, -1), e % block_size


__all__ = ["entry_address"]
