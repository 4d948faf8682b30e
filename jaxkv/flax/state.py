"""Finding the cache states inside an NNX module (for ``jaxkv.check`` and notebooks)."""

from __future__ import annotations

import jax
from flax import nnx

from jaxkv import errors
from jaxkv.frame.state import FrameCacheState
from jaxkv.hybrid.state import HybridCacheState

CACHE_TYPES = (FrameCacheState, HybridCacheState)


def caches(module: nnx.Module) -> list:
    """Every cache state held in ``module``'s ``nnx.Cache`` variables, in graph order.

    Layers stacked by ``nnx.vmap`` / ``nnx.scan`` give one state whose arrays carry the
    layer axis first.
    """
    leaves = jax.tree.leaves(nnx.state(module, nnx.Cache), is_leaf=lambda x: isinstance(x, CACHE_TYPES))
    return [x for x in leaves if isinstance(x, CACHE_TYPES)]


def check(module: nnx.Module) -> None:
    """``jaxkv.check`` on every cache in ``module`` (a host sync: call it between steps)."""
    for state in caches(module):
        errors.check(state)
