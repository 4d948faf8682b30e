"""Names renamed in 0.2 keep working for one release, each with a DeprecationWarning that
names the new one."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import frame
from jaxkv import hybrid as H


def test_attention_old_argument_order(rng):
    spec = frame.FrameSpec(num_layers=2, num_heads=2, head_dim=8, patches_per_frame=5, num_special=2)
    shape = (2, 1, spec.tokens_per_frame, 2, 8)
    k = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    state = frame.append(frame.init(spec), k, k)
    q = jnp.asarray(rng.normal(size=shape[1:]), jnp.bfloat16)
    want = frame.attention(state, 1, q, impl="xla")
    with pytest.warns(DeprecationWarning, match=r"pass \(state, layer, q\)"):
        got = frame.attention(state, q, 1, impl="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_seed_storage_name():
    """The per_entry family was called "seed": the same layout under either name."""
    with pytest.warns(DeprecationWarning, match="'per_entry'"):
        old = H.HybridConfig(compress_ratios=(4, 128), storage="seed")
    assert old == H.HybridConfig(compress_ratios=(4, 128), storage="per_entry")
    assert H.bytes_per_token(old) != H.bytes_per_token(H.HybridConfig(compress_ratios=(4, 128)))  # not official


def test_cuda_flush_write_old_name():
    from jaxkv.hybrid import flush

    with pytest.warns(DeprecationWarning, match="cuda_flush_write"):
        assert flush.flush_write is flush.cuda_flush_write
    with pytest.warns(DeprecationWarning, match="pallas_flush_write is now cuda_flush_write"):
        assert flush.pallas_flush_write is flush.cuda_flush_write


def test_flax_frame_cache_old_name():
    pytest.importorskip("flax")
    import jaxkv.flax

    with pytest.warns(DeprecationWarning, match="FrameCacheModule"):
        assert jaxkv.flax.FrameCache is jaxkv.flax.FrameCacheModule
