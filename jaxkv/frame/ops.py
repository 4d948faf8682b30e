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

from jaxkv import _backend
from jaxkv.errors import Fault, finite_rows, record
from jaxkv.formats.fp8 import quantize_fp8_rows
from jaxkv.frame import plan, tuning
from jaxkv.frame.state import NONE, ROW_BUFFERS, FrameCacheState
from jaxkv.frame.views import visible_mask
from jaxkv.kernels.frame_append import write_frame, write_frame_fp8, write_rows
from jaxkv.kernels.move_rows import move_rows_cuda, ref_move_rows
from jaxkv.sharding import on_devices


# ---------------------------------------------------------------- row-block helpers
# A skipped write is not masked: it is sent to the trash rows at the end of the buffer
# (``FrameSpec.trash_row``), which nothing reads. Every write stays one in-place
# dynamic-update-slice with no read of the old rows.
def _write(buf, b, row, block):
    """Write ``block`` [1, n, ...] at rows [row, row+n) of stream b."""
    return lax.dynamic_update_slice(buf, block.astype(buf.dtype), (b, row) + (0,) * (buf.ndim - 2))


def _move_rows(state, moves, n):
    """Copy ``n`` rows per ``(stream, src, dst, ok)`` in every K/V buffer and token_id.

    A move that is not ``ok`` copies to the trash rows. On a GPU with nvcc every buffer's
    rows move from one launch (``kernels.move_rows_cuda``, ``frame.move_rows``), else by a
    slice and an update per buffer. Where control flow is free (``tuning.branch_free``
    false: CPU) the copies are skipped when no move is ``ok`` (the steady state); on a GPU
    a ``cond`` would sync the frame step with the host, so the copies always run. A state
    without K/V buffers (``k = v = ()``) moves only token_id, never under a branch: its
    owner moves the K/V rows itself (``torch_bridge.FlashInferKVCacheManager``).
    """
    arrays = (*(x for name in ROW_BUFFERS for x in getattr(state, name)), state.token_id)
    table = row_moves(moves, state.spec.trash_row)  # i32[M, 3]
    impl = _backend.choose("frame.move_rows", "auto") if state.k else "xla"
    move = move_rows_cuda if impl == "cuda" else ref_move_rows

    def run(arrays):
        return move(arrays, table, rows=n)

    if state.k and not tuning.branch_free():
        any_ok = jnp.any(jnp.stack([ok for *_, ok in moves]))
        arrays = lax.cond(any_ok, run, lambda a: a, arrays)
    else:
        arrays = run(arrays)
    out, i = {}, 0
    for name in ROW_BUFFERS:
        n = len(getattr(state, name))
        out[name], i = tuple(arrays[i : i + n]), i + n
    return dict(out, token_id=arrays[i])


def row_moves(moves, trash_row):
    """The moves as i32[M, 3] ``(stream, src, dst)`` in order, ``dst`` = trash where not ok."""
    return jnp.stack(
        [jnp.stack([jnp.asarray(b, jnp.int32), src, jnp.where(ok, dst, trash_row)]) for b, src, dst, ok in moves]
    ).astype(jnp.int32)


def _as_streams(x, B, name, dtype=jnp.bool_):
    x = jnp.asarray(x)
    if x.ndim == 0:
        x = jnp.broadcast_to(x, (B,))
    if x.shape != (B,):
        raise ValueError(f"{name}: expected a scalar or shape ({B},), got shape {tuple(x.shape)}")
    return x.astype(dtype)


# ---------------------------------------------------------------- append
def begin_frame_moves(state: FrameCacheState, defer, finite=None):
    """``begin_frame``, not jitted, also returning the row moves it made: -> (state,
    i32[B, 3] ``row_moves``). The rules are ``frame.plan.begin``'s; here faults skip the
    frame and the token ids are written (and the K/V rows moved, where the state has them).
    finite: bool[B] or None, whether each stream's frame K/V is finite (``append``): a
    stream whose K/V is not gets NONFINITE_KV and no frame."""
    s = state.spec
    B, ps, P, NS = s.num_streams, s.page_size, s.patches_per_frame, s.num_special
    defer = _as_streams(defer, B, "defer")

    pending_fault = state.pending != NONE
    capacity_fault = state.num_special + NS > s.special_capacity
    nonfinite = jnp.zeros((B,), bool) if finite is None else ~finite
    ok = ~pending_fault & ~capacity_fault & ~nonfinite
    error = record(
        record(state.error, pending_fault, Fault.APPEND_WHILE_PENDING), capacity_fault, Fault.SPECIAL_CAPACITY
    )
    error = record(error, nonfinite, Fault.NONFINITE_KV)

    new = plan.begin(s, plan.counters(state), defer)
    patch_row = jnp.where(ok, new.patch_row, s.trash_row)  # where this frame goes (trash rows: skipped)
    special_row = jnp.where(ok, new.special_row, s.trash_row)
    if new.move.ok is False:  # a spec without specials: the rows stay, the report says trash
        moves = [(b, new.move.src[b], new.move.dst[b], False) for b in range(B)]
        moved = {name: getattr(state, name) for name in (*ROW_BUFFERS, "token_id")}
    else:
        moves = [(b, new.move.src[b], new.move.dst[b], ok[b] & new.move.ok[b]) for b in range(B)]
        moved = _move_rows(state, moves, ps)

    # Token ids of the new frame: ps patch rows (padding rows of a page are -1), then specials.
    token_id = moved["token_id"]
    base = state.num_frames * s.tokens_per_frame
    rows = jnp.arange(ps, dtype=jnp.int32)
    for b in range(B):
        token_id = _write(token_id, b, patch_row[b], jnp.where(rows < P, base[b] + NS + rows, -1)[None])
        if NS:
            token_id = _write(token_id, b, special_row[b], (base[b] + jnp.arange(NS, dtype=jnp.int32))[None])

    after = jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new.after, plan.counters(state))
    return state.replace(
        **{name: moved[name] for name in ROW_BUFFERS},
        token_id=token_id,
        **after._asdict(),
        write_patch_row=patch_row,
        write_special_row=special_row,
        error=error,
    ), row_moves(moves, s.trash_row)


def _check_frame_kv(state, k, v, per_layer: bool):
    s = state.spec
    lead = () if per_layer else (s.num_layers,)
    want = lead + (s.num_streams, s.tokens_per_frame, s.num_heads, s.head_dim)
    dt = s.compute_dtype  # an FP8 cache takes bfloat16 K/V and quantizes them
    for name, x in (("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name}: expected an array {dt}{list(want)}, got a {type(x).__name__}")
        if tuple(x.shape) != want or x.dtype != dt:
            raise ValueError(
                f"{name}: expected {dt}{list(want)} "
                f"([{'' if per_layer else 'layers, '}streams, tokens_per_frame, heads, head_dim]), "
                f"got {x.dtype}{list(x.shape)}"
            )


def _write_kv(state: FrameCacheState, layer, k, v) -> FrameCacheState:
    """Write a frame's K/V at the rows begin_frame chose.

    layer None: k, v are [L, B, tokens_per_frame, H, D] for every layer. A Python int:
    [B, tokens_per_frame, H, D] into that layer's buffer alone. A traced i32: the same,
    written to every layer's buffer with the other layers' rows sent to the trash (L
    times the traffic: prefer an int).
    """
    s = state.spec
    NS, ps = s.num_special, s.page_size
    error = state.error
    finite = jnp.ones(state.write_patch_row.shape, bool)
    if layer is not None:  # write_layer: a frame must be open (a skipped frame has its own fault already)
        error = record(error, (state.write_special_row == s.trash_row) & (state.error == 0), Fault.WRITE_WITHOUT_FRAME)
        finite = finite_rows(k, (1, 2, 3)) & finite_rows(v, (1, 2, 3))  # bool[B]: append checks in begin_frame
        error = record(error, ~finite & (state.write_special_row != s.trash_row), Fault.NONFINITE_KV)
    kernel = default_append_impl(s.dtype, s.head_dim) if isinstance(layer, int) and state.k else "xla"
    if kernel != "xla":  # one launch for the layer's K and V (and scales), which quantizes itself
        special_row, patch_row = (
            jnp.where(finite, r, s.trash_row) for r in (state.write_special_row, state.write_patch_row)
        )
        write = _write_pallas if kernel == "pallas" else _write_fp8_cuda
        return write(state.replace(error=error), [layer], k[None], v[None], special_row, patch_row)
    bufs = {name: list(getattr(state, name)) for name in ROW_BUFFERS}
    stored = _stored(s, k, v)  # all layers at once for append: an FP8 frame is quantized by one fusion, not L
    if layer is None:
        targets = [(l, True, {name: x[l] for name, x in stored.items()}) for l in range(s.num_layers)]
    elif isinstance(layer, int):
        targets = [(layer, True, stored)]
    else:
        targets = [(l, layer == l, stored) for l in range(s.num_layers)]
        bad = (layer < 0) | (layer >= s.num_layers)
        error = record(error, jnp.broadcast_to(bad, error.shape), Fault.LAYER_OUT_OF_RANGE)
    for l, hit, rows_of in targets:  # a missed layer's rows (and a stream's non-finite K/V) go to the trash
        hit = hit & finite
        rows = dict(
            special_row=jnp.where(hit, state.write_special_row, s.trash_row),
            patch_row=jnp.where(hit, state.write_patch_row, s.trash_row),
        )
        for name, x in rows_of.items():
            bufs[name][l] = write_rows(bufs[name][l], x, num_special=NS, page_size=ps, **rows)
    return state.replace(**{name: tuple(b) for name, b in bufs.items()}, error=error)


def _stored(spec, k, v) -> dict:
    """A frame's K/V [..., H, D] as the cache stores them: as they are, or FP8 codes and their
    scales bf16[..., H] (``jaxkv.formats.quantize_fp8_rows``)."""
    if not spec.quantized:
        return dict(k=k, v=v)
    (kq, ks), (vq, vs) = quantize_fp8_rows(k), quantize_fp8_rows(v)
    return dict(k=kq, v=vq, k_scale=ks, v_scale=vs)


# ---------------------------------------------------------------- commit / rollback
def resolve_moves(state: FrameCacheState, keep):
    """``resolve``, not jitted, also returning the row moves it made: -> (state, i32[B, 3]
    ``row_moves``); rules: ``frame.plan.resolve``."""
    s = state.spec
    B = s.num_streams
    keep = _as_streams(keep, B, "keep")
    new = plan.resolve(s, plan.counters(state), keep)
    moves = [(b, new.move.src[b], new.move.dst[b], new.move.ok[b]) for b in range(B)]
    moved = _move_rows(state, moves, s.page_size)
    return state.replace(
        **moved,
        **new.after._asdict(),
        write_patch_row=jnp.full_like(state.write_patch_row, s.trash_row),
        write_special_row=jnp.full_like(state.write_special_row, s.trash_row),
        error=record(state.error, new.nothing_pending, Fault.ROLLBACK_NOTHING_PENDING),
    ), row_moves(moves, s.trash_row)


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
    return on_devices(
        lambda st, d: begin_frame_moves(st, d)[0], state, _streams(state, defer, "defer"), axes=(STREAMS,)
    )


# Logical axes (``jaxkv.sharding``) of the ops' arguments: a layer's K/V, every layer's, a per-stream flag.
KV, LAYERS_KV, STREAMS = ("streams", None, "heads", None), (None, "streams", None, "heads", None), ("streams",)


def _streams(state, x, name):
    return _as_streams(x, state.spec.num_streams, name)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="layer")
def _write_layer_static(state, k, v, layer):
    return on_devices(lambda st, k, v: _write_kv(st, layer, k, v), state, k, v, axes=(KV, KV))


@_donate
def _write_layer_traced(state, layer, k, v):
    return on_devices(lambda st, l, k, v: _write_kv(st, l, k, v), state, layer, k, v, axes=((), KV, KV))


def write_layer(state: FrameCacheState, layer, k, v) -> FrameCacheState:
    """Store one layer's K/V of the frame started by ``begin_frame``.

    k, v: dtype[B, tokens_per_frame, H, D]  specials first, then patches, RoPE applied
    layer: int, or a traced i32[] (out of range: LAYER_OUT_OF_RANGE, nothing written; it
      writes through a mask on every layer's buffer, so prefer an int where you can)
    A stream whose k or v holds a NaN or Inf gets NONFINITE_KV and nothing written. An int
    layer's K and V are written from one launch where ``append`` would use its kernel
    (``default_append_impl``), else by XLA's updates.
    """
    _check_frame_kv(state, k, v, per_layer=True)
    if isinstance(layer, int):
        if not 0 <= layer < state.spec.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {state.spec.num_layers}, got {layer}")
        return _write_layer_static(state, k, v, layer=layer)
    return _write_layer_traced(state, jnp.asarray(layer, jnp.int32), k, v)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="layer")
def _write_frames(state, k, v, first_frame, layer):
    def local(state, k, v, first):
        s = state.spec
        T, S = s.tokens_per_frame, k.shape[1] // s.tokens_per_frame
        # where each token of the S frames sits now: visible rows whose id is frame * T + token
        # (rows past the valid prefix keep stale ids; a duplicate would race in the scatter)
        pos = state.token_id - (first * T)[:, None]  # i32[B, rows]
        pos = jnp.where(visible_mask(state) & (pos >= 0) & (pos < S * T), pos, S * T)
        # token -> row by one in-bounds scatter: rows holding none of the tokens go to an extra
        # slot that is dropped after (no out-of-bounds indices, no vmap)
        rows = jnp.broadcast_to(jnp.arange(s.capacity, dtype=jnp.int32), pos.shape)
        b = jnp.arange(s.num_streams)[:, None]
        dst = jnp.full((s.num_streams, S * T + 1), s.trash_row, jnp.int32).at[b, pos].set(rows)[:, : S * T]
        finite = finite_rows(k, (1, 2, 3)) & finite_rows(v, (1, 2, 3))  # bool[B]
        error = record(state.error, ~finite, Fault.NONFINITE_KV)
        dst = jnp.where(finite[:, None], dst, s.trash_row)
        bufs = {}
        for name, x in _stored(s, k, v).items():
            buf = getattr(state, name)[layer]
            bufs[name] = (
                getattr(state, name)[:layer]
                + (buf.at[b, dst].set(x.astype(buf.dtype)),)
                + getattr(state, name)[layer + 1 :]
            )
        return state.replace(**bufs, error=error)

    return on_devices(local, state, k, v, first_frame, axes=(KV, KV, STREAMS))


def write_frames(state: FrameCacheState, layer: int, k, v, first_frame) -> FrameCacheState:
    """Store one layer's K/V of S frames already begun (``begin_frame`` once for each),
    found by their token ids: a model that runs S frames through its layers together
    (lingbot-map's scale frames) writes each layer as it goes instead of keeping every
    layer's K/V until the frames can be appended one by one.

    k, v: dtype[B, S * tokens_per_frame, H, D]  frame-major, each frame's specials first
    first_frame: i32[B]  ``num_frames`` before the first of the S ``begin_frame`` calls
    A token whose frame was skipped (a fault) is not stored; a stream whose k or v holds
    a NaN or Inf gets NONFINITE_KV and nothing stored. Padding rows of power-of-two pages
    keep what they held (masked, as always).
    """
    s = state.spec
    if not isinstance(layer, int) or not 0 <= layer < s.num_layers:
        raise ValueError(f"layer: expected an int, 0 <= layer < {s.num_layers}, got {layer!r}")
    T = s.tokens_per_frame
    want = (s.num_streams, None, s.num_heads, s.head_dim)
    for name, x in (("k", k), ("v", v)):
        shape = tuple(getattr(x, "shape", ()))
        if (
            len(shape) != 4
            or shape[0] != s.num_streams
            or shape[2:] != want[2:]
            or shape[1] % T
            or not shape[1]
            or getattr(x, "dtype", None) != s.compute_dtype
        ):
            raise ValueError(
                f"{name}: expected {s.compute_dtype}[{s.num_streams}, S * {T}, {s.num_heads}, {s.head_dim}] "
                f"([streams, frames x tokens_per_frame, heads, head_dim]), got "
                f"{getattr(x, 'dtype', type(x).__name__)}{list(shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {list(k.shape)}, got {list(v.shape)}")
    first = _as_streams(first_frame, s.num_streams, "first_frame", jnp.int32)
    return _write_frames(state, k, v, first, layer=layer)


def default_append_impl(dtype: str = "bfloat16", head_dim: int = 64) -> str:
    """``pallas`` on Hopper (one launch for every layer; docs/kernels/frame_append.md); an
    FP8 cache ``cuda`` on a GPU with nvcc (quantized as written, one launch); else ``xla``
    (``jaxkv._backend``)."""
    return _backend.choose("frame.append", "auto", dtype=dtype, head_dim=head_dim)


def _write_pallas(state: FrameCacheState, layers, k, v, special_row, patch_row) -> FrameCacheState:
    """K/V of ``layers`` (k, v: [len(layers), B, tokens_per_frame, H, D]) by the Mosaic GPU
    kernel (``kernels.write_frame``): one launch for all their buffers."""
    s = state.spec
    flat = lambda b: b.reshape(b.shape[:2] + (-1,))  # noqa: E731 - a bitcast
    kb, vb = write_frame(
        [flat(state.k[l]) for l in layers],
        [flat(state.v[l]) for l in layers],
        k.reshape(k.shape[:3] + (-1,)),
        v.reshape(v.shape[:3] + (-1,)),
        special_row,
        patch_row,
        num_special=s.num_special,
        page_size=s.page_size,
    )
    shape = state.k[0].shape
    ks, vs = list(state.k), list(state.v)
    for i, l in enumerate(layers):
        ks[l], vs[l] = kb[i].reshape(shape), vb[i].reshape(shape)
    return state.replace(k=tuple(ks), v=tuple(vs))


def _write_fp8_cuda(state: FrameCacheState, layers, k, v, special_row, patch_row) -> FrameCacheState:
    """An FP8 cache's K/V of ``layers`` (k, v: bf16[len(layers), B, tokens_per_frame, H, 64])
    quantized as written by ``kernels.write_frame_fp8``: one launch, codes and scales."""
    s = state.spec
    layers = list(layers)
    codes = [state.k[l] for l in layers] + [state.v[l] for l in layers]
    scales = [state.k_scale[l] for l in layers] + [state.v_scale[l] for l in layers]
    codes, scales = write_frame_fp8(
        codes, scales, k, v, special_row, patch_row, num_special=s.num_special, page_size=s.page_size
    )
    bufs = {name: list(getattr(state, name)) for name in ROW_BUFFERS}
    n = len(layers)
    for i, l in enumerate(layers):
        bufs["k"][l], bufs["v"][l] = codes[i], codes[n + i]
        bufs["k_scale"][l], bufs["v_scale"][l] = scales[i], scales[n + i]
    return state.replace(**{name: tuple(b) for name, b in bufs.items()})


@functools.partial(jax.jit, donate_argnums=0, static_argnames="impl")
def _append(state, k, v, defer, impl):
    def local(state, k, v, defer):
        finite = finite_rows(k, (0, 2, 3, 4)) & finite_rows(v, (0, 2, 3, 4))  # bool[B]
        state = begin_frame_moves(state, defer, finite)[0]
        rows = state.write_special_row, state.write_patch_row
        if impl == "pallas":
            return _write_pallas(state, range(state.spec.num_layers), k, v, *rows)
        if impl == "cuda":
            return _write_fp8_cuda(state, range(state.spec.num_layers), k, v, *rows)
        return _write_kv(state, None, k, v)

    return on_devices(local, state, k, v, _streams(state, defer, "defer"), axes=(LAYERS_KV, LAYERS_KV, STREAMS))


def append(state: FrameCacheState, k, v, defer=False, *, impl: str = "auto") -> FrameCacheState:
    """Append one frame to every layer: ``begin_frame`` + ``write_layer`` for all layers.

    k, v: dtype[L, B, tokens_per_frame, H, D]
    impl: how the K/V rows are written — ``xla`` (dynamic-update-slices), ``pallas``
      (``jaxkv.kernels.write_frame``: one launch; Mosaic GPU, Hopper), ``cuda`` (an FP8
      cache: ``jaxkv.kernels.write_frame_fp8``, quantized as written, one launch),
      ``auto`` (``default_append_impl()``). The bookkeeping is the same jnp code.
    A stream whose k or v holds a NaN or Inf gets NONFINITE_KV and no frame.
    """
    _check_frame_kv(state, k, v, per_layer=False)
    return _append(
        state,
        k,
        v,
        defer,
        impl=_backend.choose("frame.append", impl, dtype=state.spec.dtype, head_dim=state.spec.head_dim),
    )


@_donate
def resolve(state: FrameCacheState, keep) -> FrameCacheState:
    """Commit (``keep`` true) or roll back (false) the deferred frame; ``keep``: bool or bool[B].

    Commit evicts the oldest window frame if the window is over its size (a no-op when
    nothing is pending). Rollback removes the pending frame's patches, specials and count;
    with nothing pending it sets ROLLBACK_NOTHING_PENDING and changes nothing else.
    """
    return on_devices(
        lambda st, keep: resolve_moves(st, keep)[0], state, _streams(state, keep, "keep"), axes=(STREAMS,)
    )


def commit(state: FrameCacheState) -> FrameCacheState:
    return resolve(state, True)


def rollback(state: FrameCacheState) -> FrameCacheState:
    return resolve(state, False)
