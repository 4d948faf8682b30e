"""The cache states inside an NNX module: find them (for ``jaxkv.check`` and notebooks), and
save and restore them (``jaxkv.checkpoint``, one checkpoint per cache state)."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from jaxkv import checkpoint, errors
from jaxkv.frame.state import FrameCacheState
from jaxkv.hybrid.state import HybridCacheState

CACHE_TYPES = (FrameCacheState, HybridCacheState)


def caches(module: nnx.Module) -> list:
    """Every cache state held in ``module``'s ``nnx.Cache`` variables, in graph order.

    Layers stacked by ``nnx.vmap`` / ``nnx.scan`` give one state whose arrays carry the
    layer axis first.
    """
    leaves = jax.tree.leaves(nnx.state(module, nnx.Cache), is_leaf=lambda x: isinstance(x, CACHE_TYPES))
    return [x for x in leaves if isinstance(x, CACHE_TYPES)]


def check(module: nnx.Module) -> None:
    """``jaxkv.check`` on every cache in ``module`` (a host sync: call it between steps)."""
    for state in caches(module):
        errors.check(state)


def _is_cache(x) -> bool:
    return isinstance(x, CACHE_TYPES)


def _split(module: nnx.Module):
    """(leaves of ``module``'s nnx.Cache state with cache states as leaves, their treedef)."""
    return jax.tree.flatten(nnx.state(module, nnx.Cache), is_leaf=_is_cache)


def save_caches(path, module: nnx.Module) -> Path:
    """Save ``module``'s whole ``nnx.Cache`` state to the new directory ``path``: each cache
    state (``caches``' order) as a ``jaxkv.save`` checkpoint ``cache0``, ``cache1``, ...,
    and the other cache variables (a model's frame counter, say) as ``others``. Whole or
    nothing; ``restore_caches`` puts it back."""
    path = Path(path).absolute()
    leaves, _ = _split(module)
    found = [x for x in leaves if _is_cache(x)]
    if not found:
        raise ValueError(f"module: no jaxkv cache state in the nnx.Cache variables of {type(module).__name__}")
    with checkpoint.new_directory(path) as tmp:
        for i, state in enumerate(found):
            checkpoint.save(tmp / f"cache{i}", state)
        checkpoint.save_arrays(tmp / "others", {f"v{i}": x for i, x in enumerate(leaves) if not _is_cache(x)})
    return path


def restore_caches(path, module: nnx.Module) -> None:
    """Put the ``nnx.Cache`` state ``save_caches`` wrote back into ``module`` (one of the
    same architecture: its own cache state is the ``like`` of what is restored into it)."""
    path = Path(path).absolute()
    leaves, treedef = _split(module)
    n = sum(map(_is_cache, leaves))
    saved = len([p for p in path.glob("cache*") if p.is_dir()]) if path.is_dir() else 0
    other = len(checkpoint.read_meta(path / "others")["arrays"]) if saved else 0
    if (saved, other) != (n, len(leaves) - n):
        raise checkpoint.CheckpointError(
            f"path: {path} holds {saved} cache states and {other} other cache variables, module "
            f"{type(module).__name__} has {n} and {len(leaves) - n} (another architecture?)"
        )
    others = checkpoint.restore_arrays(path / "others", {f"v{i}": x for i, x in enumerate(leaves) if not _is_cache(x)})
    j, new = 0, []
    for i, x in enumerate(leaves):
        if _is_cache(x):
            x = checkpoint.restore(path / f"cache{j}", like=x)
            j += 1
        else:
            x = others[f"v{i}"]
        new.append(x)
    nnx.update(module, jax.tree.unflatten(treedef, new))
