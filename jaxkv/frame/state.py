"""FrameCacheState: the frame cache as a pytree, and the functions that make or resize one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import sharding
from jaxkv._pytree import cache_dataclass, static_field
from jaxkv.frame.spec import FrameSpec
from jaxkv.sharding import Layout

# The fields holding per-layer buffers of rows [B, T, ...]: they move and are written together.
ROW_BUFFERS = ("k", "v", "k_scale", "v_scale")
# ``pending`` values: which kind of deferred frame awaits commit or rollback.
NONE, IN_SLOT, STAGED = 0, 1, 2


@cache_dataclass
class FrameCacheState:
    """All arrays of a frame cache; ``spec`` is static. Counters are per stream ``[B]``.

    k, v: tuple of L dtype[B, T, H, D]  keys (RoPE applied) and values, one buffer per layer
      so attention reads a layer in place; layout in ``FrameSpec``
    token_id: i32[B, T]  ``frame * tokens_per_frame + token`` of each row, -1 for none
    num_frames: i32[B]  frames appended and not rolled back (``frame_count`` of lingbot-map's FlashInferKVCacheManager)
    num_scale: i32[B]  filled scale slots (<= S)
    num_window: i32[B]  filled window slots (<= W)
    window_head: i32[B]  ring offset of the oldest window frame
    num_special: i32[B]  special tokens stored
    pending: i32[B]  NONE, IN_SLOT or STAGED: the deferred frame awaiting commit/rollback
    write_patch_row: i32[B]  where the current frame's patches go (set by begin_frame;
      ``spec.trash_row`` when they are not to be stored: a fault, or W == 0)
    write_special_row: i32[B]  where the current frame's specials go (likewise)
    error: u32[B]  sticky fault bits (``jaxkv.errors.Fault``)
    layout: where the arrays live (``jaxkv.sharding.Layout``: streams over a data axis,
      heads over a model axis), or None for one device
    k_scale, v_scale: tuple of L bf16[B, T, H]  an FP8 cache's scale per row and head
      (``jaxkv.formats.quantize_fp8_rows``); () for a float cache. They move with their rows.
    """

    k: tuple
    v: tuple
    token_id: jax.Array
    num_frames: jax.Array
    num_scale: jax.Array
    num_window: jax.Array
    window_head: jax.Array
    num_special: jax.Array
    pending: jax.Array
    write_patch_row: jax.Array
    write_special_row: jax.Array
    error: jax.Array
    spec: FrameSpec = static_field()
    layout: Layout | None = static_field(default=None)
    k_scale: tuple = ()
    v_scale: tuple = ()

    @property
    def num_slots_used(self):
        """i32[B]: occupied patch slots."""
        return self.num_scale + self.num_window

    # how the state splits on its layout (``jaxkv.sharding.on_devices``)
    def partition_specs(self) -> FrameCacheState:
        """The PartitionSpec of every array on ``layout``'s mesh (a state of specs)."""
        return specs(self.spec, self.layout)

    def to_shard(self) -> FrameCacheState:
        """This device's part as a state of its own: its streams and heads, no layout."""
        lay = self.layout
        return self.replace(
            spec=dataclasses.replace(
                self.spec,
                num_streams=self.spec.num_streams // lay.shards("streams"),
                num_heads=self.spec.num_heads // lay.shards("heads"),
            ),
            layout=None,
        )

    def from_shard(self, part: FrameCacheState) -> FrameCacheState:
        """A device's ``part`` (``to_shard``, updated) as its piece of this whole state."""
        return part.replace(spec=self.spec, layout=self.layout)

    @property
    def num_valid(self):
        """i32[B]: visible rows form the prefix ``[0, num_valid)`` of each buffer."""
        s = self.spec
        staged = jnp.where(self.pending == STAGED, s.patches_per_frame, 0)
        return self.num_slots_used * s.page_size + self.num_special + staged


def _zeros(b, dtype=jnp.int32):
    return jnp.zeros((b,), dtype)


def init(spec: FrameSpec, *, mesh=None, rules=None) -> FrameCacheState:
    """An empty cache. K/V rows start as zeros and are never visible until written.

    mesh: a ``jax.sharding.Mesh`` to lay the cache out on (streams over its ``data`` axis,
      heads over ``model``; ``rules`` overrides, see ``jaxkv.sharding``): each device
      holds, and each step computes, only its streams' and heads' part. None: one device.
    """
    if not isinstance(spec, FrameSpec):
        raise TypeError(f"spec: expected a jaxkv.frame.FrameSpec, got {type(spec).__name__}")
    lay = sharding.layout(mesh, rules)
    if lay is None:
        return _empty(spec)
    lay.check_divides("streams", spec.num_streams, "FrameSpec.num_streams")
    lay.check_divides("heads", spec.num_heads, "FrameSpec.num_heads")
    return sharding.build(lambda: _empty(spec).replace(layout=lay), specs(spec, lay), lay)


def specs(spec: FrameSpec, lay: Layout) -> FrameCacheState:
    """The PartitionSpec of every array of a cache laid out by ``lay`` (a state of specs)."""
    kv = lay.spec("streams", None, "heads", None)
    per_stream = lay.spec("streams")
    return FrameCacheState(
        k=(kv,) * spec.num_layers,
        v=(kv,) * spec.num_layers,
        token_id=lay.spec("streams", None),
        **{
            f: per_stream
            for f in (
                "num_frames",
                "num_scale",
                "num_window",
                "window_head",
                "num_special",
                "pending",
                "write_patch_row",
                "write_special_row",
                "error",
            )
        },
        spec=spec,
        layout=lay,
        **_scales(spec, lambda: lay.spec("streams", None, "heads")),
    )


def _scales(spec: FrameSpec, make) -> dict:
    """``k_scale`` / ``v_scale``: L of ``make()`` each for an FP8 cache, else empty."""
    n = spec.num_layers if spec.quantized else 0
    return dict(k_scale=tuple(make() for _ in range(n)), v_scale=tuple(make() for _ in range(n)))


def _empty(spec: FrameSpec) -> FrameCacheState:
    B = spec.num_streams
    shape = (B, spec.capacity, spec.num_heads, spec.head_dim)
    return FrameCacheState(
        k=tuple(jnp.zeros(shape, spec.jnp_dtype) for _ in range(spec.num_layers)),
        v=tuple(jnp.zeros(shape, spec.jnp_dtype) for _ in range(spec.num_layers)),
        token_id=jnp.full((B, spec.capacity), -1, jnp.int32),
        num_frames=_zeros(B),
        num_scale=_zeros(B),
        num_window=_zeros(B),
        window_head=_zeros(B),
        num_special=_zeros(B),
        pending=_zeros(B),
        write_patch_row=jnp.full((B,), spec.trash_row, jnp.int32),
        write_special_row=jnp.full((B,), spec.trash_row, jnp.int32),
        error=_zeros(B, jnp.uint32),
        spec=spec,
        **_scales(spec, lambda: jnp.zeros(shape[:3], jnp.bfloat16)),
    )


def _stream_mask(state, streams):
    B = state.spec.num_streams
    if streams is None:
        return jnp.ones((B,), jnp.bool_)
    m = jnp.asarray(streams)
    if m.dtype != jnp.bool_ or m.shape != (B,):
        raise ValueError(f"streams: expected bool[{B}] or None, got {m.dtype}{list(m.shape)}")
    return m


def reset(state: FrameCacheState, streams=None) -> FrameCacheState:
    """Empty the given streams (bool[B], default all) for a new video, errors included.

    K/V rows are left as they are: nothing beyond ``num_valid`` is ever read.
    """
    m = _stream_mask(state, streams)
    z = lambda x: jnp.where(m, jnp.zeros_like(x), x)  # noqa: E731
    return state.replace(
        token_id=jnp.where(m[:, None], -1, state.token_id),
        num_frames=z(state.num_frames),
        num_scale=z(state.num_scale),
        num_window=z(state.num_window),
        window_head=z(state.window_head),
        num_special=z(state.num_special),
        pending=z(state.pending),
        write_patch_row=jnp.where(m, state.spec.trash_row, state.write_patch_row),
        write_special_row=jnp.where(m, state.spec.trash_row, state.write_special_row),
        error=z(state.error),
    )


def grow(state: FrameCacheState, max_frames: int) -> FrameCacheState:
    """A copy of ``state`` with room for the specials of ``max_frames`` frames (eager, reallocates).

    Positions in the layout do not depend on the capacity, so growing only pads rows (and
    moves the trash rows to the new end). Every array is new: donating the grown state to
    a jitted update leaves ``state`` whole.
    """
    spec = state.spec
    if max_frames < spec.max_frames:
        raise ValueError(f"max_frames: expected >= the current {spec.max_frames}, got {max_frames}")
    new = spec.with_max_frames(max_frames)
    extra = new.capacity - spec.capacity
    pad = lambda x: jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    rebuilt = dict(
        k=tuple(map(pad, state.k)),
        v=tuple(map(pad, state.v)),
        k_scale=tuple(map(pad, state.k_scale)),
        v_scale=tuple(map(pad, state.v_scale)),
        token_id=jnp.pad(state.token_id, ((0, 0), (0, extra)), constant_values=-1),
        write_patch_row=jnp.where(state.write_patch_row == spec.trash_row, new.trash_row, state.write_patch_row),
        write_special_row=jnp.where(state.write_special_row == spec.trash_row, new.trash_row, state.write_special_row),
        spec=new,
    )
    copies = {
        f.name: getattr(state, f.name).copy()
        for f in dataclasses.fields(state)
        if f.name not in rebuilt and isinstance(getattr(state, f.name), jax.Array)
    }  # the counters
    return state.replace(**copies, **rebuilt)
