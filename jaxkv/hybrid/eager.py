"""HybridCache: a stateful, eager wrapper for notebooks, scripts and tests.

It holds a ``HybridCacheState``, calls the jitted functions and, with ``check=True``,
raises ``CacheError`` as soon as an operation records a fault (each check is a host
sync; a serving loop uses the functional API inside ``jit`` and calls ``jaxkv.check``
now and then).
"""

from __future__ import annotations

from jaxkv.errors import check as _check
from jaxkv.hybrid import indexer, ops
from jaxkv.hybrid import state as _state
from jaxkv.hybrid import step as _step
from jaxkv.hybrid.config import HybridConfig


class HybridCache:
    def __init__(self, config: HybridConfig, *, check: bool = True):
        self.state = _state.init(config)
        self.checks = check
        self.step = None

    @property
    def config(self) -> HybridConfig:
        return self.state.config

    def _done(self, new_state):
        self.state = new_state
        if self.checks:
            _check(new_state)
        return self

    def prepare_forward(self, slots, positions, num_tokens=None, *, chunk: int = 1):
        """Start a step; the returned ``Step`` is also kept as ``self.step``."""
        new_state, self.step = _step.prepare_forward(self.state, slots, positions, num_tokens, chunk=chunk)
        self._done(new_state)
        return self.step

    def window_keys(self, layer: int, kv):
        return ops.window_keys(self.state, self.step, layer, kv)

    def write_window(self, layer: int, kv):
        return self._done(ops.write_window(self.state, self.step, layer, kv))

    def compress(self, layer: int, kv, score, params, index=None, *, impl: str = "auto"):
        return self._done(ops.compress(self.state, self.step, layer, kv, score, params, index, impl=impl))

    def index_topk(self, layer: int, q, weights, top_k=None, *, impl: str = "auto", select: str = "auto"):
        """The step's top-k entries (``hybrid.index_topk``); with ``check=True`` a NaN or Inf
        score raises ``CacheError`` here."""
        new_state, idx = indexer.index_topk(self.state, self.step, layer, q, weights, top_k, impl=impl, select=select)
        self._done(new_state)
        return idx

    def finish(self, slots):
        return self._done(_step.finish(self.state, slots))

    def nbytes(self) -> int:
        return _state.nbytes(self.state)
