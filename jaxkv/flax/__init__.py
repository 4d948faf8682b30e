"""Flax NNX integration: cache states as module state, and a streaming attention layer.

Every jaxkv cache state is registered with ``nnx.register_data_type`` and can sit in an
``nnx.Cache`` variable; ``FrameCacheModule`` is a frame cache as an NNX module, which one
``StreamingGlobalAttention`` layer owns or all global layers of a model share.
``caches(module)`` lists the cache states inside a module so ``jaxkv.check`` can look at
them all. ``CachedStep`` runs a streaming step without ``nnx.jit``'s per-call host
work (split once, caches donated). Importing this module needs flax (``pip install flax``).
"""

from jaxkv.flax.attention import FrameCacheModule, QKVProjection, StreamingGlobalAttention
from jaxkv.flax.rope import apply_rope, axial_rope
from jaxkv.flax.state import caches, check, restore_caches, save_caches
from jaxkv.flax.step import CachedStep

__all__ = [
    "CachedStep",
    "FrameCacheModule",
    "QKVProjection",
    "StreamingGlobalAttention",
    "apply_rope",
    "axial_rope",
    "caches",
    "check",
    "restore_caches",
    "save_caches",
]
