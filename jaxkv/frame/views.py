"""Read-only views of a frame cache: the FlashInfer-style page table and the visible token ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import cache_dataclass
from jaxkv.frame import plan
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
    c = plan.counters(state)
    num_pages = plan.num_pages(s, c)
    col = lambda x: x[:, None]  # noqa: E731 - [B] -> [B, 1] against the page axis
    j = jnp.arange(s.max_pages, dtype=jnp.int32)[None]
    idx = plan.page_id(s, plan.Counters(*map(col, c)), j)
    idx = jnp.where(j < num_pages[:, None], idx, 0)
    return PageTable(indices=idx.astype(jnp.int32), num_pages=num_pages, last_page_len=plan.last_page_len(s, c))


def visible_mask(state: FrameCacheState):
    """bool[B, T]: rows attention reads (the valid prefix, minus page padding)."""
    rows = jnp.arange(state.spec.capacity, dtype=jnp.int32)[None]
    return (rows < state.num_valid[:, None]) & (state.token_id >= 0)


def visible_token_ids(state: FrameCacheState):
    """i32[B, T]: ``frame * tokens_per_frame + token`` of each visible row, -1 elsewhere."""
    return jnp.where(visible_mask(state), state.token_id, -1)


def num_frames(state: FrameCacheState):
    """i32[B]: frames appended and not rolled back (``num_frames`` of lingbot-map's FlashInferKVCacheManager)."""
    return state.num_frames
