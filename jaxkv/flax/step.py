"""CachedStep: a streaming step over an NNX module without ``nnx.jit``'s per-call graph work.

``nnx.jit`` walks the module graph on every call (split before, merge and update after).
For a 24-layer model that host work costs tens of milliseconds per frame — more than the
GPU step. ``CachedStep`` splits the module once into its ``nnx.Cache`` state (the caches,
donated to each call and updated in place) and everything else (parameters, passed in
unchanged), and runs one ``jax.jit`` of a pure function per call. Both are kept as flat
lists of arrays: flattening an ``nnx.State`` walks Python objects per variable, which for
a 1.16 B-parameter model costs milliseconds of host time on every call.
"""

from __future__ import annotations

import jax
from flax import nnx


class CachedStep:
    """``step = CachedStep(model); out = step(frame)``: jitted, caches donated.

    fn: ``fn(module, *args, **kwargs) -> out`` (default: call the module). The module
      may change its ``nnx.Cache`` variables and nothing else.
    static_argnames: keyword arguments that select a different trace (a model's phase, say)
    The module itself goes stale while the step runs (its cache buffers are donated);
    ``sync()`` writes the step's caches back into it and returns it.
    """

    def __init__(self, module: nnx.Module, fn=None, static_argnames=()):
        self.module = module
        self.fn = fn or (lambda m, *a, **k: m(*a, **k))
        self.graphdef, caches, rest = nnx.split(module, nnx.Cache, ...)
        self._caches, self._cache_tree = jax.tree.flatten(caches)
        self._rest, rest_tree = jax.tree.flatten(rest)

        def pure(caches, rest, *args, **kwargs):
            m = nnx.merge(
                self.graphdef, jax.tree.unflatten(self._cache_tree, caches), jax.tree.unflatten(rest_tree, rest)
            )
            out = self.fn(m, *args, **kwargs)
            return out, jax.tree.leaves(nnx.state(m, nnx.Cache))

        self._step = jax.jit(pure, donate_argnums=0, static_argnames=static_argnames)

    @property
    def caches(self) -> nnx.State:
        """The step's current ``nnx.Cache`` state."""
        return jax.tree.unflatten(self._cache_tree, self._caches)

    def __call__(self, *args, **kwargs):
        out, self._caches = self._step(self._caches, self._rest, *args, **kwargs)
        return out

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The step lowered for these arguments (``.compile().memory_analysis()``: its buffers)."""
        return self._step.lower(self._caches, self._rest, *args, **kwargs)

    def sync(self) -> nnx.Module:
        """The module with the step's current caches (copies them: the step keeps its own)."""
        nnx.update(self.module, jax.tree.map(lambda x: x.copy(), self.caches))
        return self.module
