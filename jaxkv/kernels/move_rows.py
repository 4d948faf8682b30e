"""Row moves: the same span of rows moved inside many buffers, in one launch.

A frame cache's ``begin_frame``, commit and rollback each move one page of rows per stream
in every layer's K and V (and an FP8 cache's scales) and in ``token_id``. XLA does that as
a slice and an update per buffer: two launches each, 4 * layers + 2 a move for a bf16
cache and 8 * layers + 2 for an FP8 one. ``move_rows_cuda`` (``jaxkv/cuda/move_rows.cu``,
through ``jax.ffi``) moves every buffer's rows from one launch, in place.
``ref_move_rows`` is the jnp reference with the same contract. Shapes::

    bufs: tuple of dtype[B, R, ...]   any dtypes, each with B streams of R rows
    moves: i32[M, 3]                 (stream, src, dst): rows [src, src + rows) of that
                                     stream to [dst, dst + rows), in every buffer

The moves are independent: no move's destination overlaps its own source or another
move's rows (``frame.plan``'s moves never do), so the kernel makes them all at once. A
move outside a buffer (stream or rows) is skipped by the kernel and clamped by XLA: the
caller keeps them inside, as the frame cache does (a skipped move targets its trash rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cuda import call_in_place


def _check(bufs, moves, rows):
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: expected an int >= 1, got {rows!r}")
    if getattr(moves, "ndim", None) != 2 or moves.shape[1] != 3 or moves.dtype != jnp.int32:
        raise ValueError(
            f"moves: expected int32[M, 3] (stream, src, dst), got "
            f"{getattr(moves, 'dtype', type(moves).__name__)}{list(getattr(moves, 'shape', ()))}"
        )
    for i, b in enumerate(bufs):
        if b.size == 0:  # an empty buffer has no rows to move
            continue
        if b.ndim < 2 or b.shape[1] < rows:
            raise ValueError(f"bufs[{i}]: expected [streams, rows >= {rows}, ...], got {list(b.shape)}")
        if b.shape[0] != bufs[0].shape[0]:
            raise ValueError(f"bufs[{i}]: expected {bufs[0].shape[0]} streams as bufs[0], got {b.shape[0]}")


def ref_move_rows(bufs: tuple, moves, *, rows: int) -> tuple:
    """``bufs`` with each move's rows copied, one move after another (slices and updates)."""
    _check(bufs, moves, rows)

    def move(buf, b, src, dst):
        tail = (0,) * (buf.ndim - 2)
        block = lax.dynamic_slice(buf, (b, src) + tail, (1, rows) + buf.shape[2:])
        return lax.dynamic_update_slice(buf, block, (b, dst) + tail)

    out = list(bufs)
    for m in range(moves.shape[0]):
        b, src, dst = moves[m, 0], moves[m, 1], moves[m, 2]
        out = [move(x, b, src, dst) if x.size else x for x in out]
    return tuple(out)


def move_rows_cuda(bufs: tuple, moves, *, rows: int) -> tuple:
    """``ref_move_rows`` from one launch (per 96 buffers): ``jaxkv/cuda/move_rows.cu``."""
    _check(bufs, moves, rows)
    if not moves.shape[0]:
        return tuple(bufs)
    return call_in_place("jaxkv_move_rows", bufs, before=(moves,), rows=np.int64(rows))


__all__ = ["move_rows_cuda", "ref_move_rows"]
