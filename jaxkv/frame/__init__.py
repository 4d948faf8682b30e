"""The streaming frame cache of a reconstruction transformer (lingbot-map semantics).

Per frame: ``num_special`` special tokens then ``patches_per_frame`` patches. The first
``scale_frames`` frames' patches are pinned; later frames' patches form a sliding window
of ``sliding_window`` frames; every frame's specials are kept. A frame appended with
``defer`` keeps the oldest window frame visible until ``commit`` (evict it) or
``rollback`` (drop the new frame) — keyframe selection, decided by a traced bool.

Functional API (pure, jitted, state donated)::

    spec = FrameSpec(num_layers=24, num_heads=16, head_dim=64, patches_per_frame=256)
    state = init(spec)
    state = append(state, k, v)                 # k, v: [L, B, 262, 16, 64]
    out = attention(state, 3, q)                # layer 3; q: [B, 262, 16, 64]

Stateful wrapper that raises on faults: ``FrameCache``.
"""

from jaxkv.frame import plan
from jaxkv.frame.attention import IMPLS, attention, default_impl, ref_attention
from jaxkv.frame.eager import FrameCache
from jaxkv.frame.ops import (
    append,
    begin_frame,
    begin_frame_moves,
    commit,
    resolve,
    resolve_moves,
    rollback,
    write_frames,
    write_layer,
)
from jaxkv.frame.spec import FP8, FrameSpec
from jaxkv.frame.state import IN_SLOT, NONE, STAGED, FrameCacheState, grow, init, reset
from jaxkv.frame.views import PageTable, num_frames, page_table, visible_mask, visible_token_ids

__all__ = [
    "FP8",
    "IMPLS",
    "IN_SLOT",
    "NONE",
    "STAGED",
    "FrameCache",
    "FrameCacheState",
    "FrameSpec",
    "PageTable",
    "append",
    "attention",
    "begin_frame",
    "begin_frame_moves",
    "commit",
    "default_impl",
    "grow",
    "init",
    "num_frames",
    "page_table",
    "plan",
    "ref_attention",
    "reset",
    "resolve",
    "resolve_moves",
    "rollback",
    "visible_mask",
    "visible_token_ids",
    "write_frames",
    "write_layer",
]
