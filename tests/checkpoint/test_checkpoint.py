"""jaxkv.save / restore: a run cut by a save and continued in a fresh process equals the
uninterrupted run bit for bit; bad checkpoints are refused, never loaded half way."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import streams as S

import jaxkv
from jaxkv import checkpoint as C
from jaxkv import frame
from jaxkv import hybrid as H

HERE = pathlib.Path(__file__).resolve().parent


def _fresh(kind, mode, path, t0, t1, tmp_path):
    """One run of ``streams.py`` in a fresh process -> its npz."""
    out = tmp_path / f"{mode}.npz"
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"  # see streams.py
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "XLA_FLAGS": flags.strip(),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    p = subprocess.run(
        [sys.executable, str(HERE / "streams.py"), kind, mode, str(path), str(t0), str(t1), str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return np.load(out)


def _cut_equals_whole(kind, n, m, tmp_path):
    """Run [0, n), save, continue [n, n + m) in another process: == one run of [0, n + m)."""
    path = tmp_path / "ck"
    whole = _fresh(kind, "whole", path, 0, n + m, tmp_path)
    part = _fresh(kind, "part", path, 0, n, tmp_path)
    np.testing.assert_array_equal(part["outputs"], whole["outputs"][:n])
    assert sorted(os.listdir(tmp_path)) == ["ck", "part.npz", "whole.npz"]  # no temporary left behind
    got = _fresh(kind, "continue", path, n, n + m, tmp_path)
    np.testing.assert_array_equal(got["outputs"], whole["outputs"][n:])
    leaves = [k for k in whole.files if k.startswith("leaf")]
    assert leaves and leaves == [k for k in got.files if k.startswith("leaf")]
    for k in leaves:
        np.testing.assert_array_equal(got[k], whole[k], err_msg=k)
    return part


def test_frame_cache_continues_bit_identically_in_a_fresh_process(tmp_path):
    part = _cut_equals_whole("frame", 6, 5, tmp_path)  # frame 5 is deferred: the save holds a pending frame
    assert int(part["pending"][0]) != frame.NONE


@pytest.mark.slow  # three processes compile the hybrid model; the frame cache's test runs the same path
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_hybrid_cache_continues_bit_identically_in_a_fresh_process(tmp_path, storage):
    # CSA flushes on both sides of the cut, the SWA ring wraps, HCA tails carry over
    _cut_equals_whole(f"hybrid:{storage}", 21, 14, tmp_path)
    assert C.read_meta(tmp_path / "ck")["spec"]["storage"] == storage


def _saved(tmp_path, rng):
    state, _ = S.frame_run(frame.init(S.FRAME_SPEC), 0, 3)
    return state, jaxkv.save(tmp_path / "ck", state)


def test_restore_onto_like_and_errors(tmp_path, rng):
    state, path = _saved(tmp_path, rng)
    back = jaxkv.restore(path, like=state)
    jax.tree.map(np.testing.assert_array_equal, back, state)
    with pytest.raises(FileExistsError, match="path: .* exists"):
        jaxkv.save(path, state)
    with pytest.raises(TypeError, match="state: expected a frame.FrameCacheState or hybrid.HybridCacheState"):
        jaxkv.save(tmp_path / "x", {"k": jnp.ones(3)})
    other = frame.init(dataclasses.replace(S.FRAME_SPEC, sliding_window=4))
    with pytest.raises(C.CheckpointError, match=r"sliding_window=4 \(checkpoint: 3\)"):
        jaxkv.restore(path, like=other)
    with pytest.raises(C.CheckpointError, match="a hybrid cache, but .* holds a frame cache"):
        jaxkv.restore(path, like=H.init(S.HYBRID))
    with pytest.raises(C.CheckpointError, match="does not exist"):
        jaxkv.restore(tmp_path / "nowhere")


def _data_files(path):
    return sorted(
        p
        for p in (path / C.ARRAYS).rglob("*")
        if p.is_file() and p.stat().st_size > 64 and "metadata" not in p.name.lower() and p.parent.name == "d"
    )


def test_corrupted_checkpoints_are_refused(tmp_path, rng):
    state, path = _saved(tmp_path, rng)
    files = _data_files(path)
    assert files, "expected Orbax data files under arrays/"
    # a flipped byte in the array data (the largest file: the arrays' bytes)
    victim = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(bytes(data))
    with pytest.raises(C.CheckpointError, match="corrupted"):
        jaxkv.restore(path)
    # a truncated data file
    state, path = state, jaxkv.save(tmp_path / "ck2", state)
    for f in _data_files(path):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    with pytest.raises(C.CheckpointError, match="corrupted"):
        jaxkv.restore(path)
    # a save that never completed: no metadata
    path = jaxkv.save(tmp_path / "ck3", state)
    (path / C.META).unlink()
    with pytest.raises(C.CheckpointError, match="incomplete"):
        jaxkv.restore(path)
    # another format version
    path = jaxkv.save(tmp_path / "ck4", state)
    meta = (path / C.META).read_text().replace('"version": 1', '"version": 99')
    (path / C.META).write_text(meta)
    with pytest.raises(C.CheckpointError, match="format version 99"):
        jaxkv.restore(path)


MESH_SCRIPT = r"""
import sys, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxkv
from jaxkv import frame
assert len(jax.devices()) == 4, jax.devices()
spec = frame.FrameSpec(num_layers=2, num_heads=2, head_dim=8, patches_per_frame=5, num_special=2, num_streams=4)
rng = np.random.default_rng(0)
st = frame.init(spec)
for t in range(3):
    k = jnp.asarray(rng.normal(size=(2, 4, spec.tokens_per_frame, 2, 8)), jnp.bfloat16)
    st = frame.append(st, k, k, defer=t == 2)
path = jaxkv.save(sys.argv[1] + "/one_device", st)  # saved from one device
mesh = Mesh(np.array(jax.devices()), ("data",))
# onto a mesh, replicated
rep = jaxkv.restore(path, mesh=mesh)
# onto streams sharded over the mesh: like's shardings place every array
place = lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if x.ndim and x.shape[0] == 4 else P()))
like = jax.tree.map(place, st)
shard = jaxkv.restore(path, like=like)
for a, b, c in zip(jax.tree.leaves(st), jax.tree.leaves(rep), jax.tree.leaves(shard)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
assert shard.k[0].sharding == NamedSharding(mesh, P("data")), shard.k[0].sharding
assert rep.k[0].sharding.is_fully_replicated and len(rep.k[0].sharding.device_set) == 4
# and back: a sharded state saves, and restores onto one device
back = jaxkv.restore(jaxkv.save(sys.argv[1] + "/sharded", shard))
for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print("ok")
"""


def test_restore_across_meshes(tmp_path):
    """A state saved from one device restores replicated over a 4-device mesh, or sharded by
    stream as ``like`` is; a sharded state saves and restores onto one device (4 CPU devices)."""
    env = {
        **os.environ,
        "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip(),
        "JAX_PLATFORMS": "cpu",
    }
    p = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
