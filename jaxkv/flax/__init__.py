"""Flax NNX integration: cache states as module state, and a streaming attention layer.

Every jaxkv cache state is registered with ``nnx.register_data_type`` and can sit in an
``nnx.Cache`` variable; ``StreamingGlobalAttention`` holds a frame cache that way.
``caches(module)`` lists the cache states inside a module so ``jaxkv.check`` can look at
them all. ``CachedStep`` runs a streaming step without ``nnx.jit``'s per-call host
work (split once, caches donated). Importing this module needs flax (``pip install flax``).
"""

from jaxkv.flax.attention import QKVProjection, StreamingGlobalAttention
from jaxkv.flax.rope import apply_rope, axial_rope
from jaxkv.flax.state import caches, check
from jaxkv.flax.step import CachedStep

__all__ = ["CachedStep", "QKVProjection", "StreamingGlobalAttention", "apply_rope", "axial_rope", "caches", "check"]
