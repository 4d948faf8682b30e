"""The FP8 frame cache (``FrameSpec(dtype="float8_e4m3fn")``): its rows are exactly the bf16
cache's rows quantized (``quantize_fp8_rows``) through appends, evictions, commits,
rollbacks and growth; its attention paths dequantize; what cannot read it says so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import _backend, frame
from jaxkv.errors import Fault
from jaxkv.formats import dequantize_fp8_rows, quantize_fp8_rows

FP8 = "float8_e4m3fn"
KW = dict(num_layers=2, num_heads=2, head_dim=64, patches_per_frame=8, num_special=2, scale_frames=1, sliding_window=2)


def _pair(**kw):
    kw = {**KW, "max_frames": 16, **kw}
    return frame.init(frame.FrameSpec(dtype=FP8, **kw)), frame.init(frame.FrameSpec(dtype="bfloat16", **kw))


def _frame(rng, spec, scale=3.0):
    shape = (spec.num_layers, spec.num_streams, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    k = jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    return k, v


def _run(rng, states, frames=9, streams=1):
    """Both caches through the same frames: scale frames, a full window, deferred frames
    committed and rolled back per stream."""
    s8, s16 = states
    for f in range(frames):
        k, v = _frame(rng, s8.spec)
        defer = f >= 4
        s8, s16 = (frame.append(s, k, v, defer=defer) for s in (s8, s16))
        if defer:
            keep = jnp.asarray([(f + b) % 3 != 0 for b in range(streams)])
            s8, s16 = (frame.resolve(s, keep) for s in (s8, s16))
    return s8, s16


@pytest.fixture(scope="module")
def ran():
    """Both caches after the same 9 frames on 2 streams (shared: compiling is most of the time)."""
    return _run(np.random.default_rng(7), _pair(num_streams=2), streams=2)


def test_rows_are_the_bf16_rows_quantized(ran):
    s8, s16 = ran
    assert not np.asarray(s8.error).any() and not np.asarray(s16.error).any()
    np.testing.assert_array_equal(s8.num_valid, s16.num_valid)
    np.testing.assert_array_equal(s8.token_id, s16.token_id)
    visible = np.asarray(frame.visible_mask(s8))  # bool[B, T]
    for l in range(KW["num_layers"]):
        for x8, sc, x16 in ((s8.k[l], s8.k_scale[l], s16.k[l]), (s8.v[l], s8.v_scale[l], s16.v[l])):
            q, s = quantize_fp8_rows(x16)
            np.testing.assert_array_equal(np.asarray(x8)[visible].view(np.uint8), np.asarray(q)[visible].view(np.uint8))
            np.testing.assert_array_equal(np.asarray(sc)[visible], np.asarray(s)[visible])


def test_grow_keeps_rows_and_scales(rng, ran):
    g8, g16 = frame.grow(ran[0], 32), frame.grow(ran[1], 32)
    assert g8.k_scale[0].shape == g8.k[0].shape[:3] and g8.spec.max_frames == 32
    g8, g16 = _run(rng, (g8, g16), frames=3, streams=2)
    visible = np.asarray(frame.visible_mask(g8))
    q, s = quantize_fp8_rows(g16.k[1])
    np.testing.assert_array_equal(np.asarray(g8.k_scale[1])[visible], np.asarray(s)[visible])


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_attention_dequantizes(rng, ran, impl):
    s8, s16 = ran
    q = jnp.asarray(rng.normal(size=(2, 10, 4, 64)), jnp.bfloat16)
    got = np.asarray(frame.attention(s8, 1, q, impl=impl), np.float32)
    # the same attention over the dequantized rows, float32: what the FP8 cache holds, read exactly
    deq = s16.replace(
        k=tuple(dequantize_fp8_rows(x, s, jnp.float32) for x, s in zip(s8.k, s8.k_scale)),
        v=tuple(dequantize_fp8_rows(x, s, jnp.float32) for x, s in zip(s8.v, s8.v_scale)),
        spec=s16.spec,
    )
    want = np.asarray(frame.attention(deq, 1, q.astype(jnp.float32), impl="reference"))
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())  # bf16 output
    # and against the bf16 cache: FP8's 3 mantissa bits on K and V
    bf16 = np.asarray(frame.attention(s16, 1, q, impl=impl), np.float32)
    err = np.abs(got - bf16).max() / np.abs(bf16).max()
    assert 0 < err < 0.15, err


def test_bytes_at_lingbot_size():
    kw = dict(num_layers=24, num_heads=16, head_dim=64, patches_per_frame=37 * 27, scale_frames=8, sliding_window=64)
    fp8, bf16 = frame.FrameSpec(dtype=FP8, **kw), frame.FrameSpec(**kw)
    assert fp8.kv_bytes / bf16.kv_bytes == pytest.approx(66 / 128)  # a bf16 scale per 64-byte head row: <= 0.53
    s = jax.eval_shape(lambda: frame.init(fp8))
    nbytes = sum(x.size * x.dtype.itemsize for x in (*s.k, *s.v, *s.k_scale, *s.v_scale))
    assert nbytes == fp8.kv_bytes


def test_large_values_are_scaled_not_clipped():
    x = jnp.asarray([[1e30, -3e29, 1.0], [1e-30, 2e-30, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
    q, s = quantize_fp8_rows(x)
    back, x = np.asarray(dequantize_fp8_rows(q, s, jnp.float32)), np.asarray(x)
    np.testing.assert_allclose(back[0, :2], x[0, :2], rtol=2**-4)  # E4M3: 3 mantissa bits
    assert back[0, 2] == 0  # a row spans E4M3's range below its largest value: 1 is 2**-99 of it
    np.testing.assert_allclose(back[1], x[1], rtol=2**-4)  # tiny rows keep their precision
    assert np.isfinite(back).all() and not back[2].any()


def test_nonfinite_kv_is_the_same_fault(rng):
    s8, _ = _pair()
    k, v = _frame(rng, s8.spec)
    s8 = frame.append(s8, k.at[1, 0, 3, 1, 5].set(jnp.inf), v)
    assert int(s8.error[0]) & int(Fault.NONFINITE_KV)
    assert int(s8.num_frames[0]) == 0


def test_what_cannot_read_fp8_says_so(rng):
    s8, _ = _pair()
    k, v = _frame(rng, s8.spec)
    with pytest.raises(ValueError, match="k: expected bfloat16"):
        frame.append(s8, k.astype(jnp.float8_e4m3fn), v)
    with pytest.raises(ValueError, match="impl='pallas' .*FP8"):
        frame.append(s8, k, v, impl="pallas")
    s8 = frame.append(s8, k, v)
    q = jnp.asarray(rng.normal(size=(1, 10, 2, 64)), jnp.bfloat16)
    for impl in ("pallas", "cudnn") + (() if _backend.is_hopper() else ("cuda",)):  # cuda reads FP8 on Hopper
        with pytest.raises(ValueError, match=f"impl={impl!r}"):
            frame.attention(s8, 0, q, impl=impl)
    with pytest.raises(ValueError, match="q: expected dtype bfloat16 .the cache.s, for its float8_e4m3fn K/V"):
        frame.attention(s8, 0, q.astype(jnp.float32), impl="xla")
    with pytest.raises(ValueError, match="FrameSpec.dtype: expected one of .*'float8_e4m3fn', got 'int8'"):
        frame.FrameSpec(dtype="int8", **KW)


def test_checkpoint_records_the_storage_dtype(ran, tmp_path):
    s8, s16 = ran
    jaxkv.save(tmp_path / "fp8", s8)
    back = jaxkv.restore(tmp_path / "fp8")
    assert back.spec.dtype == FP8
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(s8)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    jaxkv.save(tmp_path / "bf16", s16)
    with pytest.raises(jaxkv.checkpoint.CheckpointError, match="dtype"):
        jaxkv.restore(tmp_path / "bf16", like=s8)
