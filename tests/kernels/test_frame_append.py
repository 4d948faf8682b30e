"""kernels.frame_append (Mosaic GPU) against its jnp reference natively on a GPU; its validators and
the refusal off Hopper everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_GPU

from jaxkv.kernels import ref_write_frame, write_frame


def _frame_case(rng, L, B, NS, P, HD, T, dtype=jnp.bfloat16):
    bufs = [[jnp.asarray(rng.normal(size=(B, T, HD)), dtype) for _ in range(L)] for _ in range(2)]
    k, v = (jnp.asarray(rng.normal(size=(L, B, NS + P, HD)), dtype) for _ in range(2))
    special_row = jnp.asarray(rng.integers(T // 2, T - NS, size=B), jnp.int32)  # runs never overlap
    return bufs, k, v, special_row


@pytest.mark.gpu
@pytest.mark.parametrize("L,B,NS,P,page", [(2, 1, 6, 37, 37), (3, 2, 6, 20, 32), (1, 2, 0, 16, 16), (2, 1, 17, 5, 8)])
def test_frame_append_matches_reference(rng, L, B, NS, P, page):
    T, HD = 160, 64
    (kb, vb), k, v, sr = _frame_case(rng, L, B, NS, P, HD, T)
    pr = jnp.asarray(rng.integers(0, T // 2 - page, size=B), jnp.int32)
    kw = dict(num_special=NS, page_size=page)
    want = jax.device_get(ref_write_frame(kb, vb, k, v, sr, pr, **kw))
    got = write_frame([x.copy() for x in kb], [x.copy() for x in vb], k, v, sr, pr, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the reference itself: rows outside the two runs untouched, page padding zero
    for l in range(L):
        for b in range(B):
            out = np.asarray(want[0][l][b], np.float32)
            np.testing.assert_array_equal(out[int(sr[b]) : int(sr[b]) + NS], np.asarray(k[l, b, :NS], np.float32))
            np.testing.assert_array_equal(out[int(pr[b]) : int(pr[b]) + P], np.asarray(k[l, b, NS:], np.float32))
            assert not out[int(pr[b]) + P : int(pr[b]) + page].any()


def test_frame_append_bad_inputs(rng):
    (kb, vb), k, v, sr = _frame_case(rng, 2, 1, 6, 10, 64, 64)
    with pytest.raises(ValueError, match="v: expected"):
        write_frame(kb, vb, k, v[:, :, :5], sr, sr, num_special=6, page_size=10)
    with pytest.raises(ValueError, match="k_bufs, v_bufs: expected 2 buffers"):
        write_frame(kb[:1], vb, k, v, sr, sr, num_special=6, page_size=10)
    with pytest.raises(ValueError, match="patch_row: expected int32"):
        write_frame(
            kb, vb, k, v, sr, sr.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16), num_special=6, page_size=10
        )
    with pytest.raises(ValueError, match="page_size"):
        write_frame(kb, vb, k, v, sr, sr, num_special=6, page_size=9)


@pytest.mark.gpu
def test_frame_append_native_lingbot_shape(rng):
    (kb, vb), k, v, sr = _frame_case(rng, 24, 1, 6, 999, 1024, 8_192)
    pr = jnp.asarray([999 * 3], jnp.int32)
    kw = dict(num_special=6, page_size=999)
    want = jax.device_get(ref_write_frame(kb, vb, k, v, sr, pr, **kw))
    got = write_frame(kb, vb, k, v, sr, pr, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_frame_append_impls_agree(rng, pow2):
    """frame.append with the Pallas writer equals the XLA writer through fills, evictions, rollbacks."""
    from jaxkv import frame

    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=2,
        head_dim=16,
        patches_per_frame=12,
        num_special=3,
        scale_frames=1,
        sliding_window=2,
        max_frames=16,
        num_streams=2,
        pow2_pages=pow2,
    )
    states = {impl: frame.init(spec) for impl in ("xla", "pallas")}
    for t in range(6):
        k, v = (jnp.asarray(rng.normal(size=(2, 2, spec.tokens_per_frame, 2, 16)), jnp.bfloat16) for _ in range(2))
        keep = jnp.asarray([t % 3 != 2, True])
        for impl in states:
            states[impl] = frame.resolve(frame.append(states[impl], k, v, defer=True, impl=impl), keep)
    a, b = (jax.device_get(states[i]) for i in ("xla", "pallas"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="impl: expected one of"):
        frame.append(states["xla"], k, v, impl="cuda")


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal off a Hopper GPU")
def test_frame_append_kernel_needs_hopper(rng):
    """Off Hopper, impl="pallas" is a ValueError that says why, "auto" is xla, and the cache is untouched."""
    from jaxkv import frame

    assert frame.ops.default_append_impl() == "xla"
    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=2,
        head_dim=16,
        patches_per_frame=4,
        num_special=1,
        scale_frames=1,
        sliding_window=2,
        max_frames=8,
    )
    st = frame.init(spec)
    k, v = (jnp.asarray(rng.normal(size=(2, 1, spec.tokens_per_frame, 2, 16)), jnp.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="impl='pallas' for frame.append: expected an NVIDIA Hopper GPU"):
        frame.append(st, k, v, impl="pallas")
    assert not np.asarray(frame.num_frames(st)).any()  # one count per stream
