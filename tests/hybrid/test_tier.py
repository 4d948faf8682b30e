"""The host tier (``hybrid.offload`` / ``reload``): requests leave the device and come back
bit-exact, onto other slots and other blocks, and decode on exactly as if they had stayed."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import hybrid as H

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: hybrid_driver
import hybrid_driver as D  # noqa: E402


def _config(storage, **kw):
    base = dict(compress_ratios=(0, 4, 8), max_requests=6, max_context=64, top_k=4, block_size=4, index_heads=2)
    base.update(kw)
    return H.HybridConfig(window=8, storage=storage, **base)


def _steps(state, slots, inputs, params, first, count, T):
    """``count`` steps of ``T`` tokens for the rows ``slots`` from step ``first`` on ->
    (state, attention outputs of each step)."""
    outs = []
    B = len(slots)
    for t in range(first, first + count):
        x = D.slice_tokens(inputs, t * T, (t + 1) * T)
        state, step = H.prepare_forward(
            state, jnp.asarray(slots, jnp.int32), jnp.full(B, t * T, jnp.int32), jnp.full(B, T, jnp.int32), chunk=T
        )
        state, out, _ = D.model_step(state, step, x, params)
        outs.append(out)
    return state, outs


@pytest.mark.parametrize("storage", ["official", pytest.param("per_entry", marks=pytest.mark.slow)])
def test_offload_reload_decodes_bit_identically(storage, rng):
    """Three requests run 5 steps; in a second cache two of them are offloaded to host
    memory, a new request takes their freed blocks, and they come back into other slots:
    their entries, indexer keys, rings, tails and positions equal the first cache's, and
    3 more steps give bit-identical attention outputs."""
    c = _config(storage)
    T, steps, more = 4, 5, 3
    params = D.make_params(c, rng)
    inputs = D.make_inputs(c, rng, 3, T * (steps + more))
    other = D.make_inputs(c, rng, 1, T * steps)
    a, _ = _steps(H.init(c), [0, 1, 2], inputs, params, 0, steps, T)
    b, _ = _steps(H.init(c), [0, 1, 2], inputs, params, 0, steps, T)

    b, image = H.offload(b, jnp.asarray([1, 2], jnp.int32))
    host = H.to_host(image)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host)} == {"pinned_host"}
    assert int(b.position[1]) == 0 and int(b.alloc[0].owned[2]) == 0  # released
    b, _ = _steps(b, [1], other, params, 0, 2, T)  # a new request takes the freed blocks
    b = H.reload(b, jnp.asarray([4, 5], jnp.int32), host)
    jaxkv.check(b)

    where = {0: 0, 1: 4, 2: 5}
    for s, t in where.items():
        D.assert_same_request(a, s, b, t, T * steps)
    moved = [int(x) for x in b.alloc[0].table[4] if x >= 0]
    assert moved != [int(x) for x in a.alloc[0].table[1] if x >= 0]  # other blocks, same bytes

    _, out_a = _steps(a, [0, 1, 2], inputs, params, steps, more, T)
    _, out_b = _steps(b, [0, 4, 5], inputs, params, steps, more, T)
    D.assert_same_outputs(out_a, out_b)


def test_reload_refusals_leave_the_others_untouched(rng):
    """A busy slot, a pool without room, an out-of-range slot: faults on those rows only;
    another config or a mis-shaped slots array: ValueError."""
    c = _config("official", pool_tokens=1)  # 6 blocks per ratio: 32 tokens take 2 of ratio 4's
    T, steps = 4, 8
    params = D.make_params(c, rng)
    inputs = D.make_inputs(c, rng, 2, T * steps)
    st, _ = _steps(H.init(c), [0, 1], inputs, params, 0, steps, T)
    st, image = H.offload(st, jnp.asarray([1], jnp.int32))
    before = jax.tree.map(np.asarray, st)

    busy = H.reload(st, jnp.asarray([0], jnp.int32), image)  # slot 0 holds a request
    with pytest.raises(jaxkv.CacheError, match="into a slot that is not empty"):
        jaxkv.check(busy)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(busy)):
        if "error" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(x, np.asarray(y), err_msg=jax.tree_util.keystr(path))

    full, _ = _steps(busy.replace(error=jnp.zeros_like(busy.error)), [2, 3], inputs, params, 0, steps, T)
    assert int(full.alloc[0].num_free) == 0  # two new requests took ratio 4's free blocks
    full = H.reload(full, jnp.asarray([5], jnp.int32), image)
    with pytest.raises(jaxkv.CacheError, match="block pool exhausted"):
        jaxkv.check(full)
    assert int(full.position[5]) == 0 and int(full.alloc[0].owned[5]) == 0 and int(full.alloc[1].owned[5]) == 0

    out = H.reload(H.init(c), jnp.asarray([9], jnp.int32), image)
    with pytest.raises(jaxkv.CacheError, match="out of range"):
        jaxkv.check(out)
    with pytest.raises(ValueError, match="image: offloaded from a cache of another config"):
        H.reload(H.init(_config("official", max_requests=4)), jnp.asarray([0], jnp.int32), image)
    with pytest.raises(ValueError, match=r"slots: expected shape \[1\]"):
        H.reload(H.init(c), jnp.asarray([0, 1], jnp.int32), image)


def test_offload_reload_on_a_mesh():
    """On a 2-device mesh each shard moves its own requests, with no collective, and they
    decode on bit-identically (``tier_mesh_check.py``, in a process with 2 CPU devices)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    here = Path(__file__).resolve().parent
    p = subprocess.run(
        [sys.executable, str(here / "tier_mesh_check.py")], capture_output=True, text=True, timeout=900, env=env
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("tier and share on a mesh: ok"), (
        p.stdout[-2000:] + p.stderr[-4000:]
    )
