"""Frame cache updates: append (whole frame or layer by layer), commit / rollback, all jitted.

Bookkeeping happens once per frame (``begin_frame``) for every layer; the per-layer
``write_layer`` only copies K/V into the rows ``begin_frame`` chose. Every data-dependent
fault leaves the cache unchanged and sets a sticky bit in ``state.error``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.errors import Fault, record
from jaxkv.frame.state import IN_SLOT, NONE, STAGED, FrameCacheState


# ---------------------------------------------------------------- row-block helpers
def _rows(buf, b, start, n):
    """Rows [start, start+n) of stream b of ``buf`` [B, T, ...] -> [1, n, ...]."""
    return lax.dynamic_slice(buf, (b, start) + (0,) * (buf.ndim - 2), (1, n) + buf.shape[2:])


def _put_rows(buf, b, start, block, ok):
    """Write ``block`` [1, n, ...] at rows [start, ...) of stream b where ``ok``; else keep the old rows.

    Reading the old rows back costs one block read, and keeps every write an in-place
    dynamic-update-slice (no conditional around a large buffer).
    """
    new = jnp.where(ok, block, _rows(buf, b, start, block.shape[1]))
    return lax.dynamic_update_slice(buf, new, (b, start) + (0,) * (buf.ndim - 2))


def _move_rows(arrays, b, src, dst, n, ok):
    """Copy rows [src, src+n) to [dst, dst+n) of stream b in every array, where ``ok``."""
    return tuple(_put_rows(x, b, dst, _rows(x, b, src, n), ok) for x in arrays)


def _all_rows(state):
    return (*state.k, *state.v, state.token_id)


def _split_rows(state, arrays):
    L = state.spec.num_layers
    return dict(k=tuple(arrays[:L]), v=tuple(arrays[L : 2 * L]), token_id=arrays[2 * L])


def _as_streams(x, B, name, dtype=jnp.bool_):
    x = jnp.asarray(x)
    if x.ndim == 0:
        x = jnp.broadcast_to(x, (B,))
    if x.shape != (B,):
        raise ValueError(f"{name}: expected a scalar or shape ({B},), got shape {tuple(x.shape)}")
    return x.astype(dtype)


# ---------------------------------------------------------------- append
def _begin_frame(state: FrameCacheState, defer) -> FrameCacheState:
    s = state.spec
    B, ps, P, NS = s.num_streams, s.page_size, s.patches_per_frame, s.num_special
    S, W = s.scale_frames, s.sliding_window
    defer = _as_streams(defer, B, "defer")

    f = state.num_slots_used
    ns = state.num_special
    pending_fault = state.pending != NONE
    capacity_fault = ns + NS > s.special_capacity
    ok = ~pending_fault & ~capacity_fault
    error = record(record(state.error, pending_fault, Fault.APPEND_WHILE_PENDING), capacity_fault, Fault.SPECIAL_CAPACITY)

    room = f < S + W  # a free slot: scale or window still filling
    staged = ~room & defer
    # Where this frame's patches and specials go.
    patch_row = jnp.where(room, f * ps, jnp.where(staged, f * ps + ns + NS, (S + state.window_head) * ps))
    special_row = jnp.where(room, (f + 1) * ps + ns, f * ps + ns)
    if W == 0:  # the window holds nothing: a committed frame's patches are never visible
        patch_ok = ok & (room | staged)
    else:
        patch_ok = ok

    # Claiming slot f: the specials sitting in its rows move to the tail's end.
    move = ok & room & (ns > 0)
    reloc_dst = jnp.maximum((f + 1) * ps, f * ps + ns)
    arrays = _all_rows(state)
    for b in range(B):
        arrays = _move_rows(arrays, b, f[b] * ps, reloc_dst[b], ps, move[b])
    moved = _split_rows(state, arrays)
    token_id = moved["token_id"]

    # Token ids of the new frame (patch slot rows beyond P are padding: -1).
    base = state.num_frames * s.tokens_per_frame
    for b in range(B):
        sp_ids = base[b] + jnp.arange(NS, dtype=jnp.int32)[None]
        n_patch_rows = jnp.where(room[b], ps, P)  # a claimed slot is rewritten whole
        rows = jnp.arange(ps, dtype=jnp.int32)
        pt_ids = jnp.where(rows < P, base[b] + NS + rows, -1)
        if ps > P:  # staged frames write only P rows; keep what follows them
            old = _rows(token_id, b, patch_row[b], ps)[0]
            pt_ids = jnp.where(rows < n_patch_rows, pt_ids, old)
        token_id = _put_rows(token_id, b, patch_row[b], pt_ids[None], patch_ok[b])
        if NS:
            token_id = _put_rows(token_id, b, special_row[b], sp_ids, ok[b])

    fill_scale = room & (state.num_scale < S)
    fill_window = room & ~fill_scale
    evict = ok & ~room & ~defer & (W > 0)
    upd = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    return state.replace(
        k=moved["k"],
        v=moved["v"],
        token_id=token_id,
        num_frames=upd(state.num_frames + 1, state.num_frames),
        num_scale=upd(state.num_scale + fill_scale, state.num_scale),
        num_window=upd(state.num_window + fill_window, state.num_window),
        window_head=jnp.where(evict, (state.window_head + 1) % max(W, 1), state.window_head),
        num_special=upd(ns + NS, ns),
        pending=upd(jnp.where(defer, jnp.where(room, IN_SLOT, STAGED), NONE), state.pending),
        write_patch_row=patch_row,
        write_special_row=special_row,
        write_ok=ok,
        write_patches=patch_ok,
        error=error,
    )


def _check_frame_kv(state, k, v, per_layer: bool):
    s = state.spec
    lead = () if per_layer else (s.num_layers,)
    want = lead + (s.num_streams, s.tokens_per_frame, s.num_heads, s.head_dim)
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != want or x.dtype != s.jnp_dtype:
            raise ValueError(
                f"{name}: expected {s.dtype}{list(want)} "
                f"([{'' if per_layer else 'layers, '}streams, tokens_per_frame, heads, head_dim]), "
                f"got {x.dtype}{list(x.shape)}"
            )


def _write(state: FrameCacheState, layer, k, v) -> FrameCacheState:
    """Write a frame's K/V at the rows begin_frame chose.

    layer None: k, v are [L, B, tokens_per_frame, H, D] for every layer. A Python int:
    [B, tokens_per_frame, H, D] into that layer's buffer alone. A traced i32: the same,
    by a masked write to every layer's buffer (L times the traffic: prefer an int).
    """
    s = state.spec
    NS, P, ps = s.num_special, s.patches_per_frame, s.page_size
    kbufs, vbufs = list(state.k), list(state.v)
    error = state.error
    if layer is None:
        targets = [(l, True, k[l], v[l]) for l in range(s.num_layers)]
    elif isinstance(layer, int):
        targets = [(layer, True, k, v)]
    else:
        hit = [(layer == l) for l in range(s.num_layers)]
        targets = [(l, hit[l], k, v) for l in range(s.num_layers)]
        bad = (layer < 0) | (layer >= s.num_layers)
        error = record(error, jnp.broadcast_to(bad, error.shape), Fault.LAYER_OUT_OF_RANGE)
    for l, layer_ok, kl, vl in targets:
        for bufs, x in ((kbufs, kl), (vbufs, vl)):
            buf = bufs[l]
            for b in range(s.num_streams):
                xb = x[b : b + 1]  # [1, tokens_per_frame, H, D]
                if NS:
                    buf = _put_rows(buf, b, state.write_special_row[b], xb[:, :NS], state.write_ok[b] & layer_ok)
                patches = xb[:, NS:]
                if ps > P:  # a slot write also zeroes the slot's padding rows
                    row = state.write_patch_row[b]
                    full_slot = row < s.num_slots * ps
                    old = _rows(buf, b, row + P, ps - P)
                    patches = jnp.concatenate([patches, jnp.where(full_slot, jnp.zeros_like(old), old)], axis=1)
                buf = _put_rows(buf, b, state.write_patch_row[b], patches, state.write_patches[b] & layer_ok)
            bufs[l] = buf
    return state.replace(k=tuple(kbufs), v=tuple(vbufs), error=error)


# ---------------------------------------------------------------- commit / rollback
def _resolve(state: FrameCacheState, keep) -> FrameCacheState:
    s = state.spec
    B, ps, P, NS = s.num_streams, s.page_size, s.patches_per_frame, s.num_special
    S, W = s.scale_frames, s.sliding_window
    keep = _as_streams(keep, B, "keep")
    pend = state.pending
    nothing = (pend == NONE) & ~keep
    error = record(state.error, nothing, Fault.ROLLBACK_NOTHING_PENDING)

    commit_staged = keep & (pend == STAGED) & (W > 0)
    undo_slot = ~keep & (pend == IN_SLOT)
    undo = ~keep & (pend != NONE)

    f = state.num_slots_used
    ns = state.num_special
    arrays = _all_rows(state)
    # Commit a staged frame: its patches replace the oldest window frame's.
    stage_row = f * ps + ns
    oldest_row = (S + state.window_head) * ps
    for b in range(B):
        arrays = _move_rows(arrays, b, stage_row[b], oldest_row[b], P, commit_staged[b])
    # Roll back a frame that claimed a slot: move the displaced specials back into it.
    f0 = f - 1
    ns0 = ns - NS
    back_src = jnp.maximum(f * ps, f0 * ps + ns0)
    for b in range(B):
        arrays = _move_rows(arrays, b, back_src[b], f0[b] * ps, ps, undo_slot[b] & (ns0[b] > 0))
    moved = _split_rows(state, arrays)

    from_window = undo_slot & (state.num_window > 0)
    from_scale = undo_slot & ~from_window
    return state.replace(
        **moved,
        num_frames=state.num_frames - undo,
        num_scale=state.num_scale - from_scale,
        num_window=state.num_window - from_window,
        window_head=jnp.where(commit_staged, (state.window_head + 1) % max(W, 1), state.window_head),
        num_special=jnp.where(undo, ns0, ns),
        pending=jnp.where(nothing, pend, NONE),
        write_ok=jnp.zeros_like(state.write_ok),
        write_patches=jnp.zeros_like(state.write_patches),
        error=error,
    )


# ---------------------------------------------------------------- public, jitted
_donate = functools.partial(jax.jit, donate_argnums=0)


@_donate
def begin_frame(state: FrameCacheState, defer=False) -> FrameCacheState:
    """Start a frame on every stream: choose its rows, evict, count it — once for all layers.

    Follow with ``write_layer`` for each layer (or use ``append``). With ``defer`` (a
    bool, or bool[B] per stream) the oldest window frame stays visible until
    ``commit``; ``rollback`` removes the new frame instead. Faults (special capacity
    exhausted, a deferred frame still pending) skip the frame and set an error bit.
    """
    return _begin_frame(state, defer)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="layer")
def _write_layer_static(state, k, v, layer):
    return _write(state, layer, k, v)


@_donate
def _write_layer_traced(state, layer, k, v):
    return _write(state, layer, k, v)


def write_layer(state: FrameCacheState, layer, k, v) -> FrameCacheState:
    """Store one layer's K/V of the frame started by ``begin_frame``.

    k, v: dtype[B, tokens_per_frame, H, D]  specials first, then patches, RoPE applied
    layer: int, or a traced i32[] (out of range: LAYER_OUT_OF_RANGE, nothing written; it
      writes through a mask on every layer's buffer, so prefer an int where you can)
    """
    _check_frame_kv(state, k, v, per_layer=True)
    if isinstance(layer, int):
        if not 0 <= layer < state.spec.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {state.spec.num_layers}, got {layer}")
        return _write_layer_static(state, k, v, layer=layer)
    return _write_layer_traced(state, jnp.asarray(layer, jnp.int32), k, v)


@_donate
def append(state: FrameCacheState, k, v, defer=False) -> FrameCacheState:
    """Append one frame to every layer: ``begin_frame`` + ``write_layer`` for all layers.

    k, v: dtype[L, B, tokens_per_frame, H, D]
    """
    _check_frame_kv(state, k, v, per_layer=False)
    return _write(_begin_frame(state, defer), None, k, v)


@_donate
def resolve(state: FrameCacheState, keep) -> FrameCacheState:
    """Commit (``keep`` true) or roll back (false) the deferred frame; ``keep``: bool or bool[B].

    Commit evicts the oldest window frame if the window is over its size (a no-op when
    nothing is pending). Rollback removes the pending frame's patches, specials and count;
    with nothing pending it sets ROLLBACK_NOTHING_PENDING and changes nothing else.
    """
    return _resolve(state, keep)


def commit(state: FrameCacheState) -> FrameCacheState:
    return resolve(state, True)


def rollback(state: FrameCacheState) -> FrameCacheState:
    return resolve(state, False)
