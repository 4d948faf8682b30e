"""PyTorch side of jaxkv: zero-copy DLPack views of jaxkv state.

``import jaxkv`` never needs torch; this package does. See ``torch_bridge.dlpack``.
"""

from torch_bridge.dlpack import from_torch, to_torch

__all__ = ["from_torch", "to_torch"]
