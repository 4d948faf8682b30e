"""Read-only views of a frame cache: the FlashInfer-style page table and the visible token ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import cache_dataclass
from jaxkv.frame.state import FrameCacheState


@cache_dataclass
class PageTable:
    """The visible pages of each stream, for paged-attention kernels (FlashInfer's convention).

    Page ``p`` of a layer is rows ``[p*page_size, (p+1)*page_size)`` of ``state.k[layer][b]``
    (its first ``max_pages * page_size`` rows reshaped to ``[max_pages, page_size, H, D]``). For stream ``b`` the visible pages are
    ``indices[b, :num_pages[b]]`` in the order scale slots -> window slots (oldest first)
    -> tail pages (specials, and a staged frame); every page is full except the last,
    which holds ``last_page_len[b]`` rows. Entries past ``num_pages`` are 0.

    indices: i32[B, max_pages]
    num_pages: i32[B]
    last_page_len: i32[B]
    """

    indices: jax.Array
    num_pages: jax.Array
    last_page_len: jax.Array


@jax.jit
def page_table(state: FrameCacheState) -> PageTable:
    s = state.spec
    ps, S, W = s.page_size, s.scale_frames, s.sliding_window
    ns, nw, f = state.num_scale[:, None], state.num_window[:, None], state.num_slots_used[:, None]
    tail_rows = state.num_valid - state.num_slots_used * ps  # [B]
    num_pages = state.num_slots_used + -(-tail_rows // ps)
    j = jnp.arange(s.max_pages, dtype=jnp.int32)[None]
    window = S + (state.window_head[:, None] + (j - ns)) % max(W, 1)
    idx = jnp.where(j < ns, j, jnp.where(j < ns + nw, window, f + (j - ns - nw)))
    idx = jnp.where(j < num_pages[:, None], idx, 0)
    last = jnp.where(tail_rows == 0, s.patches_per_frame, (tail_rows - 1) % ps + 1)
    return PageTable(indices=idx.astype(jnp.int32), num_pages=num_pages, last_page_len=last)


def visible_mask(state: FrameCacheState):
    """bool[B, T]: rows attention reads (the valid prefix, minus page padding)."""
    rows = jnp.arange(state.spec.capacity, dtype=jnp.int32)[None]
    return (rows < state.num_valid[:, None]) & (state.token_id >= 0)


def visible_token_ids(state: FrameCacheState):
    """i32[B, T]: ``frame * tokens_per_frame + token`` of each visible row, -1 elsewhere."""
    return jnp.where(visible_mask(state), state.token_id, -1)


def num_frames(state: FrameCacheState):
    """i32[B]: frames appended and not rolled back (the seed's ``num_frames``)."""
    return state.num_frames
