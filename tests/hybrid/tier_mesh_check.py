"""The host tier on a 2-device mesh (run by ``test_tier.py`` in a fresh process with 2 CPU
devices): a request on each shard leaves and comes back into another slot of its shard;
3 more steps give the attention outputs of the run where nothing moved, bit for bit, and
offload / reload compile with no collective. Then a prefix shared on each shard: the sharers
decode as their sources do, a share across shards is refused, and share has no collective."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: hybrid_driver
import hybrid_driver as D  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import hybrid as H  # noqa: E402
from jaxkv.hybrid import prefix, tier  # noqa: E402

assert len(jax.devices()) == 2
mesh = Mesh(np.array(jax.devices()), ("data",))
c = H.HybridConfig(
    compress_ratios=(0, 4, 8), max_requests=4, max_context=64, top_k=4, block_size=4, index_heads=2, window=8
)
rng = np.random.default_rng(0)
params = D.make_params(c, rng)
T, steps, more = 4, 4, 3
inputs = D.make_inputs(c, rng, 2, T * (steps + more))


def run(state, slots, first, count):
    outs = []
    for t in range(first, first + count):
        x = D.slice_tokens(inputs, t * T, (t + 1) * T)
        state, step = H.prepare_forward(
            state, jnp.asarray(slots, jnp.int32), jnp.full(2, t * T), jnp.full(2, T), chunk=T
        )
        state, out, _ = D.model_step(state, step, x, params)
        outs.append(jax.tree.map(np.asarray, out))
    return state, outs


a, _ = run(H.init(c, mesh=mesh), [0, 2], 0, steps)
b, _ = run(H.init(c, mesh=mesh), [0, 2], 0, steps)
hlo = H.offload.lower(b, jnp.asarray([0, 2], jnp.int32)).compile().as_text()
b, image = H.offload(b, jnp.asarray([0, 2], jnp.int32))
assert {s.device for s in image.entries[0].addressable_shards} == set(jax.devices())
back = jnp.asarray([1, 3], jnp.int32)
hlo += tier._reload.lower(b, back, image).compile().as_text()
b = H.reload(b, back, H.to_host(image))
jaxkv.check(b)
D.assert_same_outputs(run(a, [0, 2], steps, more)[1], run(b, [1, 3], steps, more)[1])
# a prefix shared on each shard (whole source): the sharers decode as the sources do
sh, _ = run(H.init(c, mesh=mesh), [0, 2], 0, steps)
ref, _ = run(H.init(c, mesh=mesh), [0, 2], 0, steps)
dst, src, length = jnp.asarray([1, 3], jnp.int32), jnp.asarray([0, 2], jnp.int32), jnp.full(2, T * steps, jnp.int32)
hlo += prefix._share.lower(sh, dst, src, length).compile().as_text()
crossed = H.share(jax.tree.map(jnp.copy, sh), dst, src[::-1], length)  # each row's source on the other shard
try:
    jaxkv.check(crossed)
    raise AssertionError("a share across shards was not refused")
except jaxkv.CacheError as e:
    assert "on another request shard" in str(e), e
sh = H.share(sh, dst, src, length)
jaxkv.check(sh)
D.assert_same_outputs(run(ref, [0, 2], steps, more)[1], run(sh, [1, 3], steps, more)[1])
found = re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)", hlo)
assert not found, found
print("tier and share on a mesh: ok")
