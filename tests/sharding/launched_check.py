"""A checkpoint written by two processes and restored by one (``test_launcher.py``).

    python -m jaxkv launch --processes 2 --cpu-devices 2 launched_check.py save OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python launched_check.py restore OUT

``save``: two processes (2 CPU devices each) make a frame and a hybrid cache on the global
4-device ``data`` mesh, each feeding its own rows of two steps (``Layout.local_rows``), and
save both with ``jaxkv.save``. ``restore``: one process with 4 devices runs the same steps on
the same mesh, restores both checkpoints onto its states and finds every array bit-identical;
the frame cache also restores onto one device; the hybrid cache onto another shard count is
refused, naming the shards; both go on stepping from the restored state like the live one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

mode, out = sys.argv[1], Path(sys.argv[2])
if mode == "save":
    import jaxkv.launch

    jaxkv.launch.initialize()

import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import frame  # noqa: E402
from jaxkv import hybrid as H

assert len(jax.devices()) == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("data",))
SPEC = frame.FrameSpec(
    num_layers=2, num_heads=2, head_dim=8, patches_per_frame=5, num_special=2, num_streams=4, sliding_window=2
)
CFG = H.HybridConfig(compress_ratios=(0, 4), max_requests=8, max_context=64, block_size=8, window=8, top_k=4)
rng = np.random.default_rng(0)
FRAMES = [rng.normal(size=(2, 2, 4, SPEC.tokens_per_frame, 2, 8)).astype(np.float32) for _ in range(3)]
WINDOW = [rng.normal(size=(8, 2, CFG.head_dim)).astype(np.float32) for _ in range(3)]


def frame_steps(fs, frames):
    lay = fs.layout
    for kv in frames:
        k, v = (lay.local_rows(lay_rows(lay, x, 1), None, "streams") for x in kv)
        fs = frame.append(fs, k.astype(jax.numpy.bfloat16), v.astype(jax.numpy.bfloat16))
    return fs


def lay_rows(lay, x, axis):
    """This process's rows of the whole batch ``x`` along ``axis`` (all of them in one process)."""
    n = jax.process_count()
    if n == 1:
        return x
    part = x.shape[axis] // n
    return np.take(x, np.arange(part * jax.process_index(), part * (jax.process_index() + 1)), axis=axis)


def hybrid_steps(st, windows, first: int):
    """Steps ``first``, ``first + 1``, ... of every request: ``kv.shape[1]`` tokens each."""
    lay = st.layout
    for t, kv in enumerate(windows, first):
        B, T = kv.shape[:2]
        slots, pos, n = np.arange(B, dtype=np.int32), np.full(B, t * T, np.int32), np.full(B, T, np.int32)
        put = lambda x: lay.local_rows(lay_rows(lay, x, 0), "requests")  # noqa: E731
        st, step = H.prepare_forward(st, put(slots), put(pos), put(n), chunk=T)
        for layer in range(CFG.num_layers):
            st = H.write_window(st, step, layer, put(kv.astype(jax.numpy.bfloat16)))
    return st


def equal(a, b, what):
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what}{jax.tree_util.keystr(p)}")


fs = frame_steps(frame.init(SPEC, mesh=mesh), FRAMES[:2])
st = hybrid_steps(H.init(CFG, mesh=mesh), WINDOW[:2], 0)
if mode == "save":
    jaxkv.save(out / "frame", fs)
    jaxkv.save(out / "hybrid", st)
    print(f"process {jax.process_index()}: saved", flush=True)
    sys.exit(0)

# restore: one process, the same mesh
fr, hr = jaxkv.restore(out / "frame", like=fs), jaxkv.restore(out / "hybrid", like=st)
equal(fr, fs, "frame")
equal(hr, st, "hybrid")
one = jaxkv.restore(out / "frame", like=frame.init(SPEC))  # no mesh: one device
equal(one, fs, "frame on one device")
equal(
    frame_steps(fr, FRAMES[2:]), frame_steps(fs, FRAMES[2:]), "frame, a step after the restore"
)  # (donates the states)
equal(hybrid_steps(hr, WINDOW[2:], 2), hybrid_steps(st, WINDOW[2:], 2), "hybrid, a step after the restore")
for like in (H.init(CFG), H.init(CFG, mesh=Mesh(np.array(jax.devices()[:2]), ("data",)))):
    try:
        jaxkv.restore(out / "hybrid", like=like)
    except jaxkv.CheckpointError as e:
        assert "4 request shard(s)" in str(e) and "laid out in" in str(e), e
    else:
        raise AssertionError("a hybrid cache restored onto another shard count")
print("restore: ok", flush=True)
