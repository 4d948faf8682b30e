"""The torch drop-in's host side of jaxkv's page structure: a mirror of ``jaxkv.frame.plan``
on Python ints (``Pages``), and the queue that replays jaxkv's bookkeeping on the device in
batches (``ReplayQueue``), so the per-frame step never reads the device or waits for JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import frame
from jaxkv.frame import plan
from jaxkv.frame.state import NONE, ROW_BUFFERS

REPLAY = 64  # bookkeeping calls queued before one batched replay on the device
BEGIN, RESOLVE = 1, 2  # kinds of a queued call (0: none, padding)


@functools.partial(jax.jit, donate_argnums=0)
def replay(meta, calls):
    """Apply queued bookkeeping to a state without its row buffers (K/V and an FP8 cache's
    scales: ``()``) in one dispatch.

    calls: i32[REPLAY, 2]  (kind, flag) rows in order: ``BEGIN`` with flag = defer,
      ``RESOLVE`` with flag = keep, 0 = nothing (padding)
    """

    def one(meta, call):
        kind, flag = call[0], call[1].astype(bool)
        begun, resolved = frame.begin_frame_moves(meta, flag)[0], frame.resolve_moves(meta, flag)[0]
        pick = lambda old, b, r: jnp.where(kind == BEGIN, b, jnp.where(kind == RESOLVE, r, old))  # noqa: E731
        return jax.tree_util.tree_map(pick, meta, begun, resolved), None

    return jax.lax.scan(one, meta, calls)[0]


class ReplayQueue:
    """jaxkv's bookkeeping of frames (``BEGIN``) and decisions (``RESOLVE``) not yet applied on
    the device. Nothing in the step waits for it (torch's rows come from ``Pages``), so it is
    replayed ``REPLAY`` calls per dispatch, or when someone reads the state."""

    def __init__(self):
        self.calls = []

    def push(self, kind: int, flag: bool) -> bool:
        """Queue a call -> whether the queue is full (time to ``apply``)."""
        self.calls.append((kind, int(flag)))
        return len(self.calls) == REPLAY

    def clear(self) -> None:
        self.calls = []

    def apply(self, state: frame.FrameCacheState, device) -> frame.FrameCacheState:
        """``state`` with the queued calls applied on jax ``device`` (its K/V untouched); empties
        the queue."""
        if not self.calls:
            return state
        calls = np.zeros((REPLAY, 2), np.int32)
        calls[: len(self.calls)] = self.calls
        self.calls = []
        rows = {name: getattr(state, name) for name in ROW_BUFFERS}  # torch's to write and move
        with jax.default_device(device):
            meta = replay(state.replace(**{name: () for name in ROW_BUFFERS}), calls)
        return meta.replace(**rows)


class Pages:
    """Host mirror of the shared page structure that ``jaxkv.frame`` keeps on the device.

    It follows from the calls alone, so a frame's rows, the row moves and the visible page
    ids are known on the host without reading the device or waiting for JAX. The rules
    are ``jaxkv.frame.plan``'s, run on Python ints (``plan.HOST``) for one stream. Rows
    and moves are token rows of a layer buffer; a move is ``(src, dst)``, ``page_size``
    rows, never overlapping.
    """

    def __init__(self, spec):
        self.spec = spec
        self.reset()

    def reset(self):
        self.c = plan.Counters(num_frames=0, num_scale=0, num_window=0, window_head=0, num_special=0, pending=NONE)
        self.version = 0  # bumps on every change

    def load(self, counters: plan.Counters) -> None:
        """Continue from ``counters`` (a loaded state's, read from the device once)."""
        self.c = counters
        self.version += 1

    @property
    def frames(self) -> int:
        return self.c.num_frames

    @property
    def pending(self) -> int:
        return self.c.pending

    @property
    def num_scale(self) -> int:
        return self.c.num_scale

    @property
    def num_window(self) -> int:
        return self.c.num_window

    def begin(self, defer: bool):
        """Count a new frame -> (moves, special_row, patch_row): where its tokens go."""
        new = plan.begin(self.spec, self.c, defer, plan.HOST)
        self.c = new.after
        self.version += 1
        return [(new.move.src, new.move.dst)] if new.move.ok else [], new.special_row, new.patch_row

    def resolve(self, keep: bool):
        """Commit or roll back the pending frame -> the row moves it makes."""
        new = plan.resolve(self.spec, self.c, keep, plan.HOST)
        self.c = new.after
        self.version += 1
        return [(new.move.src, new.move.dst)] if new.move.ok else []

    def num_pages(self) -> int:
        return plan.num_pages(self.spec, self.c, plan.HOST)

    def last_page_len(self) -> int:
        return plan.last_page_len(self.spec, self.c, plan.HOST)

    def visible_rows(self) -> int:
        """n: the visible keys are rows ``[0, n)`` of every buffer (``plan.num_valid``), which
        is ``(num_pages - 1) * page_size + last_page_len`` whenever a page is visible."""
        return plan.num_valid(self.spec, self.c, plan.HOST)

    def page_ids(self) -> list[int]:
        """Visible page ids: scale slots -> window slots (oldest first) -> tail pages."""
        return [plan.page_id(self.spec, self.c, j, plan.HOST) for j in range(self.num_pages())]


__all__ = ["BEGIN", "REPLAY", "RESOLVE", "Pages", "ReplayQueue", "replay"]
