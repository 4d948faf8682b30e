"""Sticky error bits: how a jitted cache operation reports a data-dependent fault.

Inside ``jit`` a cache cannot raise, so a faulty operation leaves the cache as it was and
ORs a bit into the state's ``error`` field (a uint32 per stream or request). The bit
stays set until ``clear_errors``. ``check(state)`` reads the field on the host — never do
that inside a per-frame step — and raises ``CacheError`` naming every fault.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np


class Fault(enum.IntFlag):
    SPECIAL_CAPACITY = 1 << 0
    ROLLBACK_NOTHING_PENDING = 1 << 1
    APPEND_WHILE_PENDING = 1 << 2
    LAYER_OUT_OF_RANGE = 1 << 3
    POOL_EXHAUSTED = 1 << 4
    POSITION_BACKWARDS = 1 << 5
    SLOT_OUT_OF_RANGE = 1 << 6
    POSITION_GAP = 1 << 7
    SLOT_REPEATED = 1 << 8
    CONTEXT_EXHAUSTED = 1 << 9
    WRITE_WITHOUT_FRAME = 1 << 10
    NONFINITE_KV = 1 << 11
    SLOT_IN_USE = 1 << 12
    SHARE_INVALID = 1 << 13
    SLOT_EMPTY = 1 << 14
    NONFINITE_SCORES = 1 << 15


_MESSAGES = {
    Fault.SPECIAL_CAPACITY: "special-token capacity exhausted: the frame was not appended "
    "(raise max_frames at init, or grow the cache with jaxkv.frame.grow)",
    Fault.ROLLBACK_NOTHING_PENDING: "rollback with nothing to roll back: no deferred frame is pending",
    Fault.APPEND_WHILE_PENDING: "append while a deferred frame is pending: commit or roll it back first",
    Fault.LAYER_OUT_OF_RANGE: "layer index out of range: the write was skipped",
    Fault.WRITE_WITHOUT_FRAME: "write_layer with no frame begun (call begin_frame first; commit and rollback end "
    "a frame): nothing was written",
    Fault.NONFINITE_KV: "non-finite K/V (NaN or Inf) in a write: that write was skipped for the stream or request "
    "(the cache holds what the valid writes gave it)",
    Fault.POOL_EXHAUSTED: "block pool exhausted: the step's flushes needed more free blocks than were left; "
    "the request's step was skipped (finish requests, or raise pool_tokens)",
    Fault.POSITION_BACKWARDS: "position went backwards: the step's position is below the tokens the request "
    "has seen; the step was skipped",
    Fault.SLOT_OUT_OF_RANGE: "request slot out of range; the batch row was skipped",
    Fault.POSITION_GAP: "position skips ahead: the step's position is above the tokens the request has seen; "
    "the step was skipped",
    Fault.SLOT_REPEATED: "a request slot appears twice in one batch; those rows were skipped",
    Fault.SLOT_IN_USE: "reload or share into a slot that is not empty (it holds tokens or blocks): nothing was "
    "moved into it (finish the slot first, or pick an empty one)",
    Fault.SHARE_INVALID: "share from a source that cannot give the prefix (out of range, on another request shard, "
    "the slot itself, fewer tokens than asked, or length < 1), or complete_share before the slot was re-fed to "
    "the prefix's length: nothing was shared",
    Fault.SLOT_EMPTY: "finish of a slot that holds nothing (released twice, or never used): nothing was released",
    Fault.NONFINITE_SCORES: "non-finite indexer scores (NaN or Inf) among a query's visible entries, from the "
    "step's indexer query or weights (keys are checked when written): index_topk picked none of those entries "
    "(the cache is unchanged)",
    Fault.CONTEXT_EXHAUSTED: "num_tokens out of range: negative, above the step's token axis, or past "
    "max_context; the step was skipped",
}


class CacheError(RuntimeError):
    """A data-dependent fault recorded in a cache's sticky error field."""

    def __init__(self, faults: dict[int, Fault], kind="stream"):
        self.faults = faults
        lines = []
        for idx, f in sorted(faults.items()):
            msgs = "; ".join(_MESSAGES[b] for b in Fault if b in f)
            owner = kind(idx) if callable(kind) else f"{kind} {idx}"
            lines.append(f"{owner}: {msgs}")
        super().__init__("jaxkv cache fault(s):\n  " + "\n  ".join(lines))


def record(error, fault_mask, fault: Fault):
    """error: u32[...], fault_mask: bool[...] -> error with ``fault`` ORed where the mask holds."""
    return error | jnp.where(fault_mask, jnp.uint32(int(fault)), jnp.uint32(0))


def record_at(error, index, mask, fault: Fault):
    """error: u32[W] with ``fault`` ORed into ``error[index[i]]`` where ``mask[i]`` (index,
    mask: [n]); an index outside [0, W) records nothing. One scatter that ORs in place."""
    ok = mask & (index >= 0) & (index < error.shape[0])
    return error.at[jnp.where(ok, index, error.shape[0])].apply(lambda e: record(e, True, fault), mode="drop")


def finite_rows(x, axes):
    """bool: ``x`` has only finite values along ``axes`` (integers always do)."""
    return jnp.all(jnp.isfinite(x), axis=axes)


def check(state) -> None:
    """Raise ``CacheError`` if any sticky error bit of ``state`` is set (a host sync)."""
    err = np.asarray(jax.device_get(state.error)).reshape(-1)
    bad = {int(i): Fault(int(e)) for i, e in enumerate(err) if e}
    if bad:
        raise CacheError(bad, kind=getattr(state, "fault_owner", getattr(state, "error_axis_name", "stream")))


def clear_errors(state):
    """Return ``state`` with its sticky error bits cleared."""
    return state.replace(error=jnp.zeros_like(state.error))
