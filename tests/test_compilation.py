"""jaxkv.persistent_cache: a second process loads the step the first one compiled."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jaxkv

ROOT = Path(__file__).resolve().parent.parent

STEP = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    import jaxkv
    from jaxkv import frame

    hits = []
    jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
    jaxkv.persistent_cache(sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the tiny step counts
    spec = frame.FrameSpec(num_layers=2, num_heads=2, head_dim=64, patches_per_frame=12, num_special=2,
                           scale_frames=1, sliding_window=2, max_frames=8)
    k = jax.random.normal(jax.random.key(0), (2, 1, 14, 2, 64), jnp.bfloat16)
    state = jax.jit(frame.append)(frame.init(spec), k, -k)
    print(json.dumps(dict(hits=hits.count("/jax/compilation_cache/cache_hits"),
                          k=float(jnp.abs(state.k[1].astype(jnp.float32)).sum()))))
    """
)


def _run(cache):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", STEP, str(cache)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_step(tmp_path):
    """The first process writes its executables and hits nothing; the second hits the cache,
    writes nothing new, and computes the same state."""
    first = _run(tmp_path / "xla")
    entries = sorted(p.name for p in (tmp_path / "xla").iterdir())
    second = _run(tmp_path / "xla")
    assert first["hits"] == 0 and entries
    assert second["hits"] > 0 and sorted(p.name for p in (tmp_path / "xla").iterdir()) == entries
    assert second["k"] == first["k"] > 0


def test_default_directory_sits_beside_the_built_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path))
    try:
        assert jaxkv.persistent_cache() == tmp_path / "xla" and (tmp_path / "xla").is_dir()
    finally:
        jaxkv.compilation.compilation_cache.reset_cache()
        import jax

        jax.config.update("jax_compilation_cache_dir", None)


def test_a_file_in_the_way_is_an_error(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="path: expected a directory for the compilation cache, got the file"):
        jaxkv.persistent_cache(tmp_path / "f")
