"""The frame cache's page rules, written once: where a frame's rows go, which rows move, which
pages are visible.

Two callers keep the same page structure: ``frame.ops`` on the device (jnp arrays over
streams, under jit, with faults) and ``torch_bridge``'s host mirror (Python ints for one
stream, so torch knows a frame's rows without reading the device). Both call these
functions; ``xp`` says which arithmetic: ``DEVICE`` (``jnp.where`` ...) or ``HOST``
(Python conditionals, no array in sight: a frame's host bookkeeping stays microseconds).

Rows are token rows of a layer buffer (``FrameSpec``): patch slot ``i`` is page ``i``
(rows ``[i*page_size, (i+1)*page_size)``), slots ``[0, S)`` the scale frames, ``[S, S+W)``
the window's ring (oldest at ``S + window_head``); the tail after the used slots holds
the specials, then a staged frame's patches. A move is ``page_size`` rows ``src -> dst``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxkv.frame.state import IN_SLOT, NONE, STAGED


class Xp(NamedTuple):
    where: Callable
    maximum: Callable
    not_: Callable


DEVICE = Xp(jnp.where, jnp.maximum, jnp.logical_not)
HOST = Xp(lambda c, a, b: a if c else b, max, lambda c: not c)


class Counters(NamedTuple):
    """A stream's page counters (i32[B] each on the device, ints on the host)."""

    num_frames: Any
    num_scale: Any
    num_window: Any
    window_head: Any
    num_special: Any
    pending: Any  # NONE, IN_SLOT or STAGED


class Move(NamedTuple):
    src: Any
    dst: Any
    ok: Any  # whether the move happens


class Begin(NamedTuple):
    """A new frame: its rows, the move that makes room, the counters after it."""

    patch_row: Any  # first row of its patch page (``spec.trash_row``: never visible)
    special_row: Any  # first row of its specials
    move: Move  # the specials sitting in the claimed slot move to the tail's end
    after: Counters


class Resolve(NamedTuple):
    """A decision on the pending frame: the move it makes, the counters after it."""

    move: Move  # commit a staged frame, or give a rolled-back slot's rows back
    nothing_pending: Any  # a rollback with nothing pending (a fault on the device)
    after: Counters


def counters(state) -> Counters:
    """A ``FrameCacheState``'s counters (i32[B] each)."""
    return Counters(*(getattr(state, f) for f in Counters._fields))


def slots(c: Counters):
    return c.num_scale + c.num_window


def begin(spec, c: Counters, defer, xp: Xp = DEVICE) -> Begin:
    """Start a frame (``defer``: keep the oldest window frame until ``resolve``)."""
    ps, NS, S, W = spec.page_size, spec.num_special, spec.scale_frames, spec.sliding_window
    f, ns = slots(c), c.num_special
    room = f < S + W  # a free slot: scale or window still filling
    staged = xp.not_(room) & defer
    patch_row = xp.where(room, f * ps, xp.where(staged, f * ps + ns + NS, (S + c.window_head) * ps))
    if W == 0:  # a committed frame's patches are never visible
        patch_row = xp.where(room | staged, patch_row, spec.trash_row)
    special_row = xp.where(room, (f + 1) * ps + ns, f * ps + ns)
    # without specials nothing sits in a claimed slot: no move, known when tracing
    move = Move(f * ps, xp.maximum((f + 1) * ps, f * ps + ns), room & (ns > 0) if NS else False)
    fill_scale = room & (c.num_scale < S)
    fill_window = room & xp.not_(fill_scale)
    evict = xp.not_(room) & xp.not_(defer) & (W > 0)
    after = Counters(
        num_frames=c.num_frames + 1,
        num_scale=c.num_scale + fill_scale,
        num_window=c.num_window + fill_window,
        window_head=xp.where(evict, (c.window_head + 1) % max(W, 1), c.window_head),
        num_special=ns + NS,
        pending=xp.where(defer, xp.where(room, IN_SLOT, STAGED), NONE),
    )
    return Begin(patch_row, special_row, move, after)


def resolve(spec, c: Counters, keep, xp: Xp = DEVICE) -> Resolve:
    """Commit (``keep``) or roll back the pending frame."""
    ps, NS, S, W = spec.page_size, spec.num_special, spec.scale_frames, spec.sliding_window
    pend = c.pending
    nothing = (pend == NONE) & xp.not_(keep)
    commit_staged = keep & (pend == STAGED) & (W > 0)
    undo_slot = xp.not_(keep) & (pend == IN_SLOT)
    undo = xp.not_(keep) & (pend != NONE)
    f, ns = slots(c), c.num_special
    f0, ns0 = f - 1, ns - NS
    # Commit a staged frame: its patches replace the oldest window frame's (a whole page,
    # so power-of-two padding comes along). Roll back a frame that claimed a slot: the
    # specials it displaced move back into the slot. A commit needs keep and a rollback its
    # negation, so keep picks the one move there can be: one copy of the rows, not two.
    move = Move(
        xp.where(keep, f * ps + ns, xp.maximum(f * ps, f0 * ps + ns0)),
        xp.where(keep, (S + c.window_head) * ps, f0 * ps),
        xp.where(keep, commit_staged, undo_slot & (ns0 > 0)),
    )
    from_window = undo_slot & (c.num_window > 0)
    from_scale = undo_slot & xp.not_(from_window)
    after = Counters(
        num_frames=c.num_frames - undo,
        num_scale=c.num_scale - from_scale,
        num_window=c.num_window - from_window,
        window_head=xp.where(commit_staged, (c.window_head + 1) % max(W, 1), c.window_head),
        num_special=xp.where(undo, ns0, ns),
        pending=xp.where(nothing, pend, NONE),
    )
    return Resolve(move, nothing, after)


# ---------------------------------------------------------------- visible pages
def tail_rows(spec, c: Counters, xp: Xp = DEVICE):
    """Rows after the used slots: the specials, then a staged frame's patches."""
    return c.num_special + xp.where(c.pending == STAGED, spec.patches_per_frame, 0)


def num_valid(spec, c: Counters, xp: Xp = DEVICE):
    """Visible rows: with exact pages they are the prefix ``[0, num_valid)`` of every buffer
    (with power-of-two pages the prefix also holds each slot's padding rows);
    ``FrameCacheState.num_valid`` on the device."""
    return slots(c) * spec.page_size + tail_rows(spec, c, xp)


def num_pages(spec, c: Counters, xp: Xp = DEVICE):
    return slots(c) + -(-tail_rows(spec, c, xp) // spec.page_size)


def last_page_len(spec, c: Counters, xp: Xp = DEVICE):
    """Valid rows of the last visible page."""
    t = tail_rows(spec, c, xp)
    return xp.where(t == 0, spec.patches_per_frame, (t - 1) % spec.page_size + 1)


def page_id(spec, c: Counters, j, xp: Xp = DEVICE):
    """The ``j``-th visible page: scale slots -> window slots (oldest first) -> tail pages."""
    S, W = spec.scale_frames, spec.sliding_window
    ns, nw = c.num_scale, c.num_window
    window = S + (c.window_head + (j - ns)) % max(W, 1)
    return xp.where(j < ns, j, xp.where(j < ns + nw, window, slots(c) + (j - ns - nw)))


__all__ = [
    "DEVICE",
    "HOST",
    "Begin",
    "Counters",
    "Move",
    "Resolve",
    "Xp",
    "begin",
    "counters",
    "last_page_len",
    "num_pages",
    "num_valid",
    "page_id",
    "resolve",
    "slots",
    "tail_rows",
]
