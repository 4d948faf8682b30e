"""Both caches sharded with jax.sharding (``jaxkv.sharding``): on CPU meshes of 8 host
devices, and across two processes joined by ``jax.distributed`` (``jaxkv launch``).

Host devices must be configured before jax starts, so the checks run as scripts in fresh
processes (``mesh_check.py``, ``multiprocess_check.py``); this process's jax is untouched.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxkv import frame, sharding
from jaxkv import hybrid as H

HERE = pathlib.Path(__file__).resolve().parent


def _env(devices: int) -> dict:
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}


def _mesh_check(*args) -> str:
    p = subprocess.run(
        [sys.executable, str(HERE / "mesh_check.py"), *args], capture_output=True, text=True, env=_env(8), timeout=900
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout


def test_bad_meshes_refused():
    """Bad meshes and a state moved to another mesh raise ValueErrors naming the axis and
    the dimension / both meshes."""
    _mesh_check("bad")


@pytest.mark.slow
def test_meshes_no_collectives_bit_identical():
    """On meshes 8x1, 4x2 and 2x4 every per-step op of both caches compiles with no
    collective and gives the one-device outputs bit for bit."""
    lines = [l for l in _mesh_check("8x1", "4x2", "2x4").splitlines() if l.startswith("mesh ")]
    assert len(lines) == 3 and all("=[" not in l for l in lines), lines


@pytest.mark.slow
def test_two_processes_lockstep():
    """Two processes (``jaxkv launch``, 2 CPU devices each) each hold half the requests and
    streams, feed their half of every batch, and get the one-device results for it."""
    p = subprocess.run(
        [sys.executable, "-m", "jaxkv", "launch", "--processes", "2", "--cpu-devices", "2"]
        + [str(HERE / "multiprocess_check.py")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[0] process 0: ok" in p.stdout and "[1] process 1: ok" in p.stdout, p.stdout[-2000:]


# ---------------------------------------------------------------- in this process (one device)
def _mesh1():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def test_layout_rules():
    mesh = _mesh1()
    lay = sharding.layout(mesh, {"heads": None})
    assert lay.spec("streams", None, "heads") == jax.sharding.PartitionSpec("data", None, None)
    assert sharding.layout(Mesh(np.array(jax.devices()[:1]), ("x",))).spec("streams") == jax.sharding.PartitionSpec(
        None
    )
    with pytest.raises(ValueError, match="rules: expected logical axes among"):
        sharding.layout(mesh, {"layers": "data"})
    with pytest.raises(ValueError, match="mesh axis 'tp'"):
        sharding.layout(mesh, {"heads": "tp"})
    with pytest.raises(ValueError, match="mesh: expected a jax.sharding.Mesh"):
        frame.init(frame.FrameSpec(num_layers=1, num_heads=1, head_dim=8, patches_per_frame=4), mesh="data")


def test_one_device_mesh_equals_no_mesh(rng):
    """A 1x1 mesh runs the sharded code path; its results equal the plain state's."""
    spec = frame.FrameSpec(
        num_layers=1,
        num_heads=2,
        head_dim=8,
        patches_per_frame=4,
        num_special=1,
        num_streams=2,
        scale_frames=1,
        sliding_window=1,
        max_frames=8,
    )
    a, b = frame.init(spec), frame.init(spec, mesh=_mesh1())
    assert b.layout is not None and a.layout is None
    for t in range(3):
        k = jnp.asarray(rng.normal(size=(1, 2, 5, 2, 8)), jnp.bfloat16)
        a, b = frame.append(a, k, -k, defer=t == 1), frame.append(b, k, -k, defer=t == 1)
        q = jnp.asarray(rng.normal(size=(2, 3, 2, 8)), jnp.bfloat16)
        np.testing.assert_array_equal(
            np.asarray(frame.attention(a, 0, q, impl="xla")), np.asarray(frame.attention(b, 0, q, impl="xla"))
        )
        a, b = frame.commit(a), frame.commit(b)
    cfg = H.HybridConfig(
        compress_ratios=(0, 4), max_requests=2, max_context=64, top_k=4, block_size=8, index_heads=2, window=8
    )
    s1, s2 = H.init(cfg), H.init(cfg, mesh=_mesh1())
    assert s2.alloc[0].num_free.shape == (1,) and s2.error.shape == s1.error.shape
    s1, st1 = H.prepare_forward(s1, jnp.arange(2), jnp.zeros(2, jnp.int32), chunk=3)
    s2, st2 = H.prepare_forward(s2, jnp.arange(2), jnp.zeros(2, jnp.int32), chunk=3)
    kv = jnp.asarray(rng.normal(size=(2, 3, 512)), jnp.bfloat16)
    s1, s2 = H.write_window(s1, st1, 1, kv), H.write_window(s2, st2, 1, kv)
    np.testing.assert_array_equal(np.asarray(s1.window), np.asarray(s2.window))
    np.testing.assert_array_equal(np.asarray(s1.alloc[0].table), np.asarray(s2.alloc[0].table))
