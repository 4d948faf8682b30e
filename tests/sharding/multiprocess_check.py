"""One of two processes joined by ``jax.distributed`` on CPU (2 host devices each, a 4-device
``data`` mesh): each holds half the requests / streams and feeds only its half of every
batch; both step in lockstep. Each checks its own shards against a one-device run of the
whole batch on its first local device. Run by ``test_sharding.py``:

    python -m jaxkv launch --processes 2 --cpu-devices 2 tests/sharding/multiprocess_check.py
"""

from __future__ import annotations

import pathlib
import sys

import jax

import jaxkv.launch

jaxkv.launch.initialize()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: hybrid_driver

import hybrid_driver as D  # noqa: E402

from jaxkv import frame  # noqa: E402
from jaxkv import hybrid as H

assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = NamedSharding(mesh, P("data"))
me = jax.process_index()
half = lambda x: np.asarray(x)[2 * me * (x.shape[0] // 4) : 2 * (me + 1) * (x.shape[0] // 4)]  # noqa: E731
local = lambda x: jax.make_array_from_process_local_data(rows, half(x))  # noqa: E731 - my half of a batch


def mine_equal(ref, got, what):
    """My shards of ``got`` (global arrays) equal the same rows of the one-device ``ref``."""
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        r = np.asarray(r)
        for shard in g.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), r[shard.index], err_msg=what)


one = jax.local_devices()[0]
rng = np.random.default_rng(0)  # the same inputs in both processes; each feeds its half

# the hybrid cache: 8 requests, 2 per device; steps of up to 4 tokens
cfg = H.HybridConfig(
    compress_ratios=(0, 4, 8), max_requests=8, max_context=128, top_k=4, block_size=8, index_heads=2, window=8
)
params = jax.tree.map(np.asarray, D.make_params(cfg, rng))
st = H.init(cfg, mesh=mesh)
with jax.default_device(one):
    ref = H.init(cfg)
slots, pos = np.arange(8, dtype=np.int32), np.zeros(8, np.int32)
for T in (4, 4, 4):  # one shape: one compile
    n = rng.integers(T // 2, T + 1, size=8).astype(np.int32)
    x = jax.tree.map(np.asarray, D.make_inputs(cfg, rng, 8, T))
    st, step = H.prepare_forward(st, local(slots), local(pos), local(n), chunk=T)
    st, _, idxs = D.model_step(st, step, jax.tree.map(local, x), params)
    with jax.default_device(one):
        ref, rstep = H.prepare_forward(ref, slots, pos, n, chunk=T)
        ref, _, ridxs = D.model_step(ref, rstep, x, params)
    mine_equal((rstep, ridxs), (step, idxs), "hybrid step, top-k")
    pos += n
mine_equal((ref.position, ref.window, ref.tails), (st.position, st.window, st.tails), "hybrid state")

# the frame cache: 4 streams, one per device
spec = frame.FrameSpec(
    num_layers=2,
    num_heads=2,
    head_dim=8,
    patches_per_frame=5,
    num_special=2,
    num_streams=4,
    scale_frames=1,
    sliding_window=2,
    max_frames=8,
)
fs = frame.init(spec, mesh=mesh)
with jax.default_device(one):
    fref = frame.init(spec)
for t in range(4):
    k, v = (rng.normal(size=(2, 4, spec.tokens_per_frame, 2, 8)).astype(jnp.bfloat16) for _ in range(2))
    q = rng.normal(size=(4, 3, 2, 8)).astype(jnp.bfloat16)
    defer = rng.random(4) < 0.5
    kv_rows = NamedSharding(mesh, P(None, "data"))
    kl, vl = (jax.make_array_from_process_local_data(kv_rows, a[:, 2 * me : 2 * me + 2]) for a in (k, v))
    fs = frame.append(fs, kl, vl, local(defer))
    out = frame.attention(fs, 1, local(q), impl="xla")
    fs = frame.resolve(fs, local(~defer))
    with jax.default_device(one):
        fref = frame.append(fref, k, v, defer)
        rout = frame.attention(fref, 1, jnp.asarray(q), impl="xla")
        fref = frame.resolve(fref, ~defer)
    mine_equal(rout, out, f"frame attention, frame {t}")
mine_equal((fref.num_frames, fref.num_valid), (fs.num_frames, fs.num_valid), "frame counters")
print(f"process {me}: ok", flush=True)
