"""kernels.fp4_pack (jaxkv/cuda/fp4_pack.cu) against the formats' MXFP4 / NVFP4 codecs natively on a GPU;
its validators everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _keys(rng, n, d=128, dtype=jnp.float32):
    scales = [1e-4, 1e-3, 1.0, 40.0, 1e3] if dtype == jnp.float16 else [1e-7, 1e-3, 1.0, 40.0, 3e4]  # f16: no overflow
    x = rng.normal(size=(n, d)) * rng.choice(scales, size=(n, 1))
    x[0, :32] = 0.0  # an all-zero group: the 1e-4 amax floor
    x[-1, 40] = np.inf  # a non-finite group: NaN scale byte
    return jnp.asarray(x, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,d,dtype", [(5, 128, jnp.float32), (77, 128, jnp.float32), (40, 64, jnp.bfloat16), (9, 96, jnp.float16)]
)
def test_mxfp4_pack_matches_reference(rng, n, d, dtype):
    from jaxkv.kernels import quantize_mxfp4, ref_quantize_mxfp4

    x = _keys(rng, n, d, dtype)
    got = quantize_mxfp4(x)
    want = ref_quantize_mxfp4(x)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(got[1])[-1, 1] == 0xFF  # the inf's group


def test_mxfp4_pack_bad_inputs():
    from jaxkv.kernels import quantize_mxfp4

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(jnp.ones((4, 48)))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mxfp4(jnp.ones((4, 64), jnp.int32))
    with pytest.raises(ValueError, match=r"x: expected float\[N, d\]"):
        quantize_mxfp4(jnp.ones((2, 4, 64)))


@pytest.mark.gpu
def test_mxfp4_pack_native_large(rng):
    from jaxkv.kernels import quantize_mxfp4, ref_quantize_mxfp4

    x = _keys(rng, 100_003)
    for a, b in zip(quantize_mxfp4(x), ref_quantize_mxfp4(x), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor-scale", "row-scales"])
@pytest.mark.parametrize("n,d,dtype", [(77, 128, jnp.float32), (40, 64, jnp.bfloat16), (9, 48, jnp.float16)])
def test_nvfp4_pack_matches_reference(rng, n, d, dtype, per_row):
    """Every byte and scale, with a tensor-wide global scale (the format's default) or one
    per row (the per_entry storage family's keys); zero, tiny, saturating and non-finite groups."""
    from jaxkv.formats import nvfp4_global_scale
    from jaxkv.kernels import quantize_nvfp4, ref_quantize_nvfp4

    x = _keys(rng, n, d, dtype)
    x = x.at[1, 3].set(jnp.nan)
    if per_row:
        g = jax.vmap(nvfp4_global_scale)(x)
        got = quantize_nvfp4(x, g)
        want = jax.vmap(ref_quantize_nvfp4)(x, g)
    else:
        got = quantize_nvfp4(x[2:-1])  # finite rows: a finite tensor-wide scale
        want = ref_quantize_nvfp4(x[2:-1])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if a.dtype != np.float32 else np.asarray(a),
            np.asarray(b).view(np.uint8) if b.dtype != np.float32 else np.asarray(b),
        )
    assert np.asarray(got[0]).any()
    with pytest.raises(ValueError, match=r"global_scale: expected f32\[\] or f32\["):
        quantize_nvfp4(x, jnp.ones(3))


@pytest.mark.gpu
def test_mxfp4_pack_extreme_magnitudes(rng):
    """Scales from 2^-127 to 2^127, subnormal quotients, NaN/inf anywhere: still the reference's bytes."""
    from jaxkv.kernels import quantize_mxfp4, ref_quantize_mxfp4

    x = rng.normal(size=(40, 128)) * 10.0 ** rng.uniform(-40, 38, size=(40, 128))
    x = np.clip(x, -3e38, 3e38).astype(np.float32)
    x[3], x[6] = 0.0, -0.0
    x[4, 0], x[5, 7], x[7, 95] = np.nan, -np.inf, np.nan
    got = quantize_mxfp4(jnp.asarray(x))
    for a, b in zip(got, ref_quantize_mxfp4(jnp.asarray(x)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
