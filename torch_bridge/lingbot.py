"""Installing the torch drop-in into lingbot-map's model in place (``use_in_lingbot_map``)."""

from __future__ import annotations

import inspect

from torch_bridge import backends
from torch_bridge.manager import FlashInferKVCacheManager


class _Installed:
    """What ``use_in_lingbot_map`` changed; ``undo()`` (or leaving a ``with`` block) puts it back."""

    def __init__(self, changes):
        self._changes = changes  # (module, attribute, previous value)

    def undo(self) -> None:
        for module, name, old in reversed(self._changes):
            setattr(module, name, old)
        self._changes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def use_in_lingbot_map(backend: str = "auto", *, kv_dtype=None) -> _Installed:
    """Make lingbot-map's model use ``torch_bridge.FlashInferKVCacheManager``: the one-import
    change, done in place.

    Replaces ``lingbot_map.layers.flashinfer_cache.FlashInferKVCacheManager`` with that
    class (with ``backend`` other than ``"auto"``: a subclass whose default ``backend`` is
    that; with ``kv_dtype``, e.g. ``torch.float8_e4m3fn``, a subclass that stores K/V in that
    dtype whatever upstream asks for: its FP8 cache, docs/torch.md). Upstream imports that
    name at call time in both places that matter, so both pick this class up: the lazy
    construction in ``aggregator/stream.py`` (``_get_flashinfer_manager``) and the
    ``isinstance`` check in ``FlashInferAttention.forward``, which otherwise takes the
    batch-SDPA branch in the scale phase and never appends (silently wrong output).

    Where ``flashinfer`` is not importable it also sets
    ``lingbot_map.layers.attention.FLASHINFER_AVAILABLE = True``, so that upstream's
    FlashInfer model path (``use_sdpa=False``) can be built, on CPU too, and runs with this
    manager (``"sdpa"`` backend). Call it before building the model and before its first
    forward; ``lingbot_map`` must be importable (its checkout on ``sys.path``). Returns a
    handle whose ``undo()`` restores both (also a context manager).
    """
    if backend not in backends.BACKENDS:
        raise ValueError(f"backend: expected one of {backends.BACKENDS}, got {backend!r}")
    if kv_dtype is not None and kv_dtype not in backends.DTYPES:
        raise ValueError(f"kv_dtype: expected None or one of {list(backends.DTYPES)}, got {kv_dtype!r}")
    try:
        from lingbot_map.layers import attention as upstream_attention
        from lingbot_map.layers import flashinfer_cache as upstream_cache
    except ImportError as exc:
        raise ImportError(
            f"use_in_lingbot_map: lingbot_map is not importable; put a lingbot-map checkout on sys.path ({exc})"
        ) from exc
    cls = FlashInferKVCacheManager
    if backend != "auto" or kv_dtype is not None:
        signature = inspect.signature(FlashInferKVCacheManager.__init__)

        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)  # upstream passes dtype by name or position
            if kv_dtype is not None:
                bound.arguments["dtype"] = kv_dtype
            bound.arguments.setdefault("backend", backend)
            FlashInferKVCacheManager.__init__(*bound.args, **bound.kwargs)

        cls = type(
            "FlashInferKVCacheManager",
            (FlashInferKVCacheManager,),
            {
                "__init__": __init__,
                "__module__": __name__,
                "__doc__": f"backend={backend!r} by default" + (f", K/V stored as {kv_dtype}." if kv_dtype else "."),
            },
        )
    changes = [(upstream_cache, "FlashInferKVCacheManager", upstream_cache.FlashInferKVCacheManager)]
    upstream_cache.FlashInferKVCacheManager = cls
    if not backends.FLASHINFER_AVAILABLE:
        changes.append((upstream_attention, "FLASHINFER_AVAILABLE", upstream_attention.FLASHINFER_AVAILABLE))
        upstream_attention.FLASHINFER_AVAILABLE = True
    return _Installed(changes)


__all__ = ["use_in_lingbot_map"]
