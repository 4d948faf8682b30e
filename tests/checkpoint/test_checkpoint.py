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

import jaxkv
from jaxkv import checkpoint as C
from jaxkv import frame
from jaxkv import hybrid as H

import streams as S

HERE = pathlib.Path(__file__).resolve().parent


def _continue_elsewhere(kind, path, t0, t1, tmp_path):
    out = tmp_path / "continued.npz"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(HERE / "streams.py"), kind, str(path), str(t0), str(t1), str(out)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return np.load(out)


def _same_run(whole_state, whole_out, n, got):
    np.testing.assert_array_equal(got["outputs"], whole_out[n:])
    for i, x in enumerate(S.leaves(whole_state).values()):
        np.testing.assert_array_equal(got[f"leaf{i}"], S.as_bytes(x), err_msg=f"leaf {i}")


def test_frame_cache_continues_bit_identically_in_a_fresh_process(tmp_path):
    N, M = 6, 5  # frame 5 is deferred: the save holds a pending frame
    whole, whole_out = S.frame_run(frame.init(S.FRAME_SPEC), 0, N + M)
    part, part_out = S.frame_run(frame.init(S.FRAME_SPEC), 0, N)
    assert int(part.pending[0]) != frame.NONE
    np.testing.assert_array_equal(part_out, whole_out[:N])
    path = jaxkv.save(tmp_path / "frames", part)
    assert sorted(os.listdir(tmp_path)) == ["frames"]  # no temporary left behind
    _same_run(whole, whole_out, N, _continue_elsewhere("frame", path, N, N + M, tmp_path))


@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_hybrid_cache_continues_bit_identically_in_a_fresh_process(tmp_path, storage):
    cfg = dataclasses.replace(S.HYBRID, storage=storage)
    N, M = 21, 14  # CSA flushes on both sides of the cut, the SWA ring wraps, HCA tails carry over
    whole, whole_out = S.hybrid_run(H.init(cfg), 0, N + M)
    part, _ = S.hybrid_run(H.init(cfg), 0, N)
    path = jaxkv.save(tmp_path / storage, part)
    assert C.read_meta(path)["spec"]["storage"] == storage
    _same_run(whole, whole_out, N, _continue_elsewhere("hybrid", path, N, N + M, tmp_path))


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
    return sorted(p for p in (path / C.ARRAYS).rglob("*") if p.is_file() and p.stat().st_size > 64
                  and "metadata" not in p.name.lower() and p.parent.name == "d")


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
