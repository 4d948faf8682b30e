"""Typed read views of one layer for one step: what an attention kernel is handed.

The counterpart of the read side of the reference DeepSeek-V4 cache design's
``LayerCacheHandle`` (``SWAView``,
``ClassicalView``, ``IndexerView``) as one immutable value: raw pools plus the step's
block tables and counts, so a kernel (FlashMLA, DeepGEMM, a Pallas gather) reads the
bytes in place, each request through its own block table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.hybrid.config import CSA, SWA
from jaxkv.hybrid.ops import check_layer, entry_count
from jaxkv.hybrid.state import HybridCacheState
from jaxkv.hybrid.step import Step


@dataclasses.dataclass(frozen=True)
class LayerView:
    """kind: "swa" | "csa" | "hca"; ratio: 0 for SWA.

    window: u8[L, R, window * E]   every layer's SWA ring (this layer is ``layer``)
    window_slot: i32[B]            each batch row's ring (its request slot)
    window_start: i32[B]           tokens before the step (ring item of position p: p % window)
    entries: u8[Lg, blocks, bs * E] | None   the ratio's entry pools (this layer: ``index``)
    index_keys: u8[Lg, blocks, bs * K] | None  CSA indexer keys (same ``index``)
    index: int                     position of this layer in the ratio's stacked pools
    block_table: i32[B, max_blocks] | None   physical block of each row's logical block
    num_entries: i32[B] | None     entries each row holds after the step
    """

    kind: str
    ratio: int
    layer: int
    window: jnp.ndarray
    window_slot: jnp.ndarray
    window_start: jnp.ndarray
    entries: jnp.ndarray | None
    index_keys: jnp.ndarray | None
    index: int
    block_table: jnp.ndarray | None
    num_entries: jnp.ndarray | None


def layer_view(state: HybridCacheState, step: Step, layer: int) -> LayerView:
    kind = check_layer(state, layer)
    ratio = state.config.compress_ratios[layer]
    if kind == SWA:
        return LayerView(kind, 0, layer, state.window, step.slot, step.start, None, None, -1, None, None)
    g, j = state.group(layer)
    return LayerView(
        kind,
        ratio,
        layer,
        state.window,
        step.slot,
        step.start,
        state.entries[g],
        state.index_keys if kind == CSA else None,
        j,
        state.alloc[g].table[step.slot],
        entry_count(step, ratio),
    )
