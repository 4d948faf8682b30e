"""jaxkv: KV caches for JAX as immutable pytrees.

* ``jaxkv.formats`` — FP8 / FP4 / ds_mla quantized layouts (jnp, bit-exact).
* ``jaxkv.frame`` — the streaming frame cache of a reconstruction transformer.
* ``jaxkv.hybrid`` — the DeepSeek-V4 hybrid compressed cache (SWA, CSA, HCA).
* ``jaxkv.check`` — raise the faults a jitted operation recorded in a state.
* ``jaxkv.save`` / ``jaxkv.restore`` — durable cache state (``jaxkv.checkpoint``, Orbax).
* ``jaxkv.persistent_cache`` — compiled steps kept across processes (``jaxkv.compilation``).
"""

from jaxkv import formats, frame, hybrid
from jaxkv.checkpoint import CheckpointError, restore, save
from jaxkv.compilation import persistent_cache
from jaxkv.errors import CacheError, Fault, check, clear_errors

__version__ = "0.1.0"
__all__ = [
    "CacheError",
    "CheckpointError",
    "Fault",
    "check",
    "clear_errors",
    "formats",
    "frame",
    "hybrid",
    "persistent_cache",
    "restore",
    "save",
    "__version__",
]
