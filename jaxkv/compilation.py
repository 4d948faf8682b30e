"""JAX's persistent compilation cache for jaxkv's programs.

A model step compiles once per process (the lingbot-map port's first frames: a minute on a
GPU); with the cache on, the next process start loads the compiled executables instead.
JAX keys each entry by the program, its compile options, the jax / jaxlib version and the
device, so a stale entry is never used; the custom calls a program names (jaxkv's CUDA and
Mosaic GPU kernels) are looked up by name when it loads, as when it compiles. Programs that
compile in under ``jax_persistent_cache_min_compile_time_secs`` (1 s by default) are not
written.
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxkv.cuda.build import cache_dir


def persistent_cache(path=None) -> Path:
    """Turn JAX's persistent compilation cache on at ``path`` (default
    ``$JAXKV_CACHE_DIR/xla``, beside jaxkv's built kernels) for this process -> the path.
    Call it before the programs to keep are compiled; it replaces a directory set before."""
    where = Path(path).expanduser() if path is not None else cache_dir() / "xla"
    if where.exists() and not where.is_dir():
        raise ValueError(f"path: expected a directory for the compilation cache, got the file {where}")
    where.mkdir(parents=True, exist_ok=True)
    compilation_cache.reset_cache()  # a directory chosen earlier in the process is dropped
    jax.config.update("jax_compilation_cache_dir", str(where))
    return where


__all__ = ["persistent_cache"]
