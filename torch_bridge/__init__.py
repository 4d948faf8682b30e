"""PyTorch side of jaxkv: zero-copy DLPack views of jaxkv state, a FlashInfer drop-in
frame manager over jaxkv buffers, and the ``cuda/`` flush kernels for torch callers.

``import jaxkv`` never needs torch; this package does (FlashInfer is optional).
Modules: ``dlpack`` (the views), ``manager`` (``FlashInferKVCacheManager``), ``pages`` (its
host mirror of the page structure), ``backends`` (its attention backends), ``lingbot``
(``use_in_lingbot_map``), ``kernels`` (the ``cuda/`` kernels through ctypes), ``flashmla``.
"""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise  # torch is there, something it imports is not
    raise ModuleNotFoundError(
        'torch_bridge needs PyTorch, not installed here: pip install "jaxkv[torch]" (on a machine without a GPU, '
        "first: pip install torch --index-url https://download.pytorch.org/whl/cpu)",
        name="torch",
    ) from None

from torch_bridge.dlpack import from_torch, to_torch
from torch_bridge.lingbot import use_in_lingbot_map
from torch_bridge.manager import FlashInferKVCacheManager

__all__ = ["FlashInferKVCacheManager", "from_torch", "to_torch", "use_in_lingbot_map"]
