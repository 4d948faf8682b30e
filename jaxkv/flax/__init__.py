"""Flax NNX integration: cache states as module state, and a streaming attention layer.

Every jaxkv cache state is registered with ``nnx.register_data_type`` and can sit in an
``nnx.Cache`` variable; ``FrameCacheModule`` is a frame cache as an NNX module, which one
``StreamingGlobalAttention`` layer owns or all global layers of a model share.
``caches(module)`` lists the cache states inside a module so ``jaxkv.check`` can look at
them all. ``CachedStep`` runs a streaming step without ``nnx.jit``'s per-call host
work (split once, caches donated). Importing this module needs flax (``pip install flax``).
"""

import warnings

from jaxkv.flax.attention import FrameCacheModule, QKVProjection, StreamingGlobalAttention
from jaxkv.flax.rope import apply_rope, axial_rope
from jaxkv.flax.state import caches, check, restore_caches, save_caches
from jaxkv.flax.step import CachedStep



def __getattr__(name):  # the 0.1 name, kept one release (``jaxkv.frame.FrameCache`` is the eager cache)
    if name == "FrameCache":
        warnings.warn("jaxkv.flax.FrameCache is now FrameCacheModule (jaxkv.frame.FrameCache is the eager cache)",
                      DeprecationWarning, stacklevel=2)
        return FrameCacheModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CachedStep", "FrameCacheModule", "QKVProjection", "StreamingGlobalAttention", "apply_rope", "axial_rope", "caches", "check",
           "restore_caches", "save_caches"]
