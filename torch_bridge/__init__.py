"""PyTorch side of jaxkv: zero-copy DLPack views of jaxkv state, a FlashInfer drop-in
frame manager over jaxkv buffers, and the ``cuda/`` flush kernels for torch callers.

``import jaxkv`` never needs torch; this package does (FlashInfer is optional).
Modules: ``dlpack`` (the views), ``manager`` (``FlashInferKVCacheManager``), ``pages`` (its
host mirror of the page structure), ``backends`` (its attention backends), ``lingbot``
(``use_in_lingbot_map``), ``kernels`` (the ``cuda/`` kernels through ctypes), ``flashmla``.
"""

from torch_bridge.dlpack import from_torch, to_torch
from torch_bridge.lingbot import use_in_lingbot_map
from torch_bridge.manager import FlashInferKVCacheManager

__all__ = ["FlashInferKVCacheManager", "from_torch", "to_torch", "use_in_lingbot_map"]
