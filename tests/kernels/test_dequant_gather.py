"""kernels.dequant_gather (jaxkv/cuda/dequant_gather.cu) and the hybrid reads through it, against the jnp
reads natively on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("m", [1, 37, 300])
def test_dequant_gather_matches_reference(rng, m, storage):
    """Every byte pattern (random pool bytes: subnormal, NaN and saturated codes, NaN and
    inf scales)."""
    from jaxkv.kernels import dequant_gather, ref_dequant_gather

    L, NB, bs = 2, 12, 16
    E = {"official": 584, "per_entry": 580}[storage]
    pool = jnp.asarray(rng.integers(0, 256, size=(L, NB, bs * E), dtype=np.uint8))
    block = rng.integers(-1, NB + 1, size=m).astype(np.int32)  # -1 and NB: zeros
    slot = rng.integers(0, bs, size=m).astype(np.int32)
    want = jax.jit(ref_dequant_gather, static_argnums=(1, 4))(pool, 1, jnp.asarray(block), jnp.asarray(slot), storage)
    got = dequant_gather(pool, 1, jnp.asarray(block), jnp.asarray(slot), storage=storage)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.asarray(got[(block < 0) | (block >= NB)], np.float32).any()


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_reads_cuda_equal_xla(rng, storage):
    """window_keys, gather_entries and all_entries through the dequant-gather kernel: the
    jnp reads' values, in both storage families."""
    import hybrid_driver as D

    from jaxkv import hybrid as H

    c = H.HybridConfig(
        compress_ratios=(4, 128),
        window=32,
        index_heads=4,
        top_k=16,
        block_size=16,
        max_requests=2,
        max_context=512,
        storage=storage,
    )
    x = D.make_inputs(c, rng, 2, 140)
    st = H.init(c)
    st, step = H.prepare_forward(st, jnp.arange(2), jnp.zeros(2, jnp.int32), jnp.asarray([140, 61]), chunk=140)
    for layer in range(2):
        st = H.write_window(st, step, layer, x[layer]["kv"])
    st = D.compress_all(st, step, x, D.make_params(c, rng), "xla")
    st, step = H.prepare_forward(st, jnp.arange(2), jnp.asarray([140, 61]), chunk=1)
    kv = jnp.asarray(rng.normal(size=(2, 1, 512)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, 36, size=(2, 1, 8)), jnp.int32)
    for read in (
        lambda impl: H.window_keys(st, step, 0, kv, impl=impl)[0],
        lambda impl: H.gather_entries(st, step, 0, idx, impl=impl),
        lambda impl: H.all_entries(st, step, 1, impl=impl)[0],
    ):
        want, got = np.asarray(read("xla"), np.float32), np.asarray(read("cuda"), np.float32)
        np.testing.assert_array_equal(got, want)
        assert want.any()
