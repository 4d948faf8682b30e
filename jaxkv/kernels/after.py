"""``after``: arrays returned unchanged, ordered after other values exist.

A jitted step reads a buffer (an attention kernel over a pool) and then updates it in place
(the next write). Nothing in the data orders the read before the write, so XLA keeps the
read's version alive by copying the whole buffer. ``after(values, deps)`` returns ``values``
as results that depend on ``deps``: pass them to the writes, and the writes stay in place.

* ``after_cuda``: an FFI call (``jaxkv/cuda/after.cu``) that takes both and returns
  ``values`` aliased to its inputs: no kernel and no bytes moved.
* ``after_xla``: each value rewrites one of its elements with itself at an index computed
  from ``deps`` (0 or 1: the sign bit of their sum), which XLA cannot know: one reduction
  over ``deps`` and one single-element update per value, on any backend.

Both return the same values. docs/hybrid.md, "``after_reads``".

    values: tuple of arrays (each at least 1-d, last axis >= 2), deps: tuple of float arrays
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxkv.cuda import call_in_place


def _check(values, deps):
    for i, v in enumerate(values):
        if v.size and (v.ndim < 1 or v.shape[-1] < 2):
            raise ValueError(f"values[{i}]: expected an array whose last axis has 2 or more elements, got {v.shape}")
    if not deps:
        raise ValueError("deps: expected at least one array to order after, got none")


def after_xla(values: tuple, deps: tuple) -> tuple:
    """``values``, each rewritten at one element with itself (index from ``deps``)."""
    _check(values, deps)
    total = sum(jnp.sum(d.astype(jnp.float32)) for d in deps)
    i = (lax.bitcast_convert_type(total, jnp.uint32) >> 31).astype(jnp.int32)

    def touch(v):
        if v.size == 0:
            return v
        start = (jnp.int32(0),) * (v.ndim - 1) + (i,)
        return lax.dynamic_update_slice(v, lax.dynamic_slice(v, start, (1,) * v.ndim), start)

    return tuple(map(touch, values))


def after_cuda(values: tuple, deps: tuple) -> tuple:
    """``values`` through an FFI call that also takes ``deps`` and moves nothing."""
    _check(values, deps)
    return call_in_place("jaxkv_after", values, after=deps)


__all__ = ["after_cuda", "after_xla"]
