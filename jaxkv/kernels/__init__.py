"""Pallas kernels for the memory-bound cache steps, each beside its jnp reference.

* ``frame_append``: one frame's K/V into every layer of a frame cache, one launch
  (Triton lowering).
"""

from jaxkv.kernels.frame_append import ref_write_frame, write_frame

__all__ = ["ref_write_frame", "write_frame"]
