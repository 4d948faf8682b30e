"""Each format against an independent numpy / ml_dtypes transcription of its definition."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv import formats as F

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


# ------------------------------------------------------------------ numpy references
def np_ceil_log2(v):
    m, e = np.frexp(np.asarray(v, np.float32))
    return np.where(m == 0.5, e - 1, e).astype(np.int32)


def np_fp8(y):
    return np.clip(y, -448, 448).astype(E4M3)


def np_ue8m0_tiles(x, tile=64):
    xg = x.astype(np.float32).reshape(*x.shape[:-1], -1, tile)
    amax = np.abs(xg).max(-1)
    e = np_ceil_log2(np.maximum(amax / np.float32(448), np.float32(1e-4)))
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    q = np_fp8(xg / s[..., None]).reshape(x.shape)
    return q, (e + 127).astype(np.uint8)


def np_e2m1_codes(y):
    return np.clip(y, -6, 6).astype(E2M1).view(np.uint8) & 0xF


def np_pack(codes):
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def np_mxfp4(x):
    xg = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xg).max(-1)
    e = np_ceil_log2(np.maximum(amax, np.float32(1e-4)) / np.float32(6))
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    codes = np_e2m1_codes(xg / s[..., None]).reshape(x.shape)
    return np_pack(codes), (e + 127).astype(np.uint8)


def np_nvfp4(x, g):
    xg = x.astype(np.float32).reshape(*x.shape[:-1], -1, 16)
    amax = np.abs(xg).max(-1)
    bs = np_fp8(amax / np.float32(6) / np.float32(g))
    denom = bs.astype(np.float32) * np.float32(g)
    y = np.where(denom[..., None] > 0, xg / np.where(denom > 0, denom, 1)[..., None], 0)
    return np_pack(np_e2m1_codes(y).reshape(x.shape)), bs


def randn(rng, shape, scale=1.0):
    # mixed magnitudes so tiles land in many different exponent ranges
    mag = np.exp(rng.uniform(-6, 4, size=shape[:-1] + (1,)))
    return (rng.standard_normal(shape) * mag * scale).astype(np.float32)


# ------------------------------------------------------------------ FP8 per entry
def test_fp8_per_entry_matches_numpy_and_roundtrips(rng):
    x = randn(rng, (5, 7, 512))
    q, s = jax.jit(F.quantize_fp8_per_entry)(jnp.asarray(x))
    amax = np.abs(x).max(-1)
    s_np = amax / np.float32(448)
    np.testing.assert_array_equal(np.asarray(s), s_np)
    q_np = np_fp8(x / s_np[..., None])
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_np.view(np.uint8))
    back = np.asarray(F.dequantize_fp8_per_entry(q, s, jnp.float32))
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of each element, plus subnormal floor
    err = np.abs(back - x)
    assert np.all(err <= np.abs(x) * 2**-4 + s_np[..., None] * 2**-9)
    assert np.abs(back).max() > 0


def test_fp8_per_entry_zero_entry():
    q, s = F.quantize_fp8_per_entry(jnp.zeros((2, 64)))
    assert np.all(np.asarray(s) == 0) and np.all(np.asarray(q.astype(jnp.float32)) == 0)
    assert np.all(np.asarray(F.dequantize_fp8_per_entry(q, s, jnp.float32)) == 0)


# ------------------------------------------------------------------ FP8 UE8M0 tiles
def test_fp8_ue8m0_bit_exact(rng):
    x = randn(rng, (3, 9, 448))
    q, e = jax.jit(F.quantize_fp8_ue8m0)(jnp.asarray(x))
    q_np, e_np = np_ue8m0_tiles(x)
    np.testing.assert_array_equal(np.asarray(e), e_np)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_np.view(np.uint8))
    back = np.asarray(F.dequantize_fp8_ue8m0(q, e, jnp.float32))
    s = np.repeat(np.ldexp(1.0, e_np.astype(np.int32) - 127), 64, axis=-1)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2**-4 + s * 2**-9)


def test_fp8_ue8m0_clamp_and_zero_tile():
    # amax/448 below 1e-4 -> scale 2^ceil(log2(1e-4)) = 2^-13; an all-zero tile too
    x = np.zeros((1, 128), np.float32)
    x[0, 64:] = 0.01
    q, e = F.quantize_fp8_ue8m0(jnp.asarray(x))
    assert np.asarray(e).tolist() == [[127 - 13, 127 - 13]]
    assert np.all(np.asarray(q[0, :64]).view(np.uint8) == 0)
    back = np.asarray(F.dequantize_fp8_ue8m0(q, e, jnp.float32))
    np.testing.assert_allclose(back, x, rtol=2**-4)


def test_fp8_ue8m0_power_of_two_boundary():
    # amax/448 exactly a power of two keeps that power; the next float32 quotient above
    # it rounds up (amax two ulps above 56: one ulp still divides to exactly 2^-3)
    x = np.full((1, 64), 448.0 * 2.0**-3, np.float32)
    _, e = F.quantize_fp8_ue8m0(jnp.asarray(x))
    assert int(e[0, 0]) == 127 - 3
    up = np.nextafter(np.float32(56), np.float32(np.inf))
    x[0, 0] = np.nextafter(up, np.float32(np.inf))
    _, e = F.quantize_fp8_ue8m0(jnp.asarray(x))
    assert int(e[0, 0]) == 127 - 2


def test_fp8_saturates_and_nonfinite_poison_group():
    q, s = F.quantize_fp8_per_entry(jnp.asarray([[1.0, -2.0, np.inf, 3.0]]))
    assert np.all(np.isnan(np.asarray(F.dequantize_fp8_per_entry(q, s, jnp.float32))))
    x = np.ones((1, 128), np.float32)
    x[0, 5] = np.nan
    q, e = F.quantize_fp8_ue8m0(jnp.asarray(x))
    assert int(e[0, 0]) == 255 and int(e[0, 1]) == 127 - 8
    back = np.asarray(F.dequantize_fp8_ue8m0(q, e, jnp.float32))
    assert np.all(np.isnan(back[0, :64])) and np.all(back[0, 64:] == 1.0)


def test_group_size_mismatch_raises():
    for fn, d in ((F.quantize_fp8_ue8m0, 100), (F.quantize_mxfp4, 48), (F.quantize_nvfp4, 24)):
        with pytest.raises(ValueError, match="multiple of"):
            fn(jnp.ones((2, d)))
    with pytest.raises(ValueError, match="floating"):
        F.quantize_mxfp4(jnp.ones((2, 64), jnp.int32))


# ------------------------------------------------------------------ ds_mla
def np_pack_ds_mla(kv_bf16):
    nb, bs, _ = kv_bf16.shape
    x = kv_bf16.astype(np.float32)
    q, e = np_ue8m0_tiles(x[..., :448])
    rope = kv_bf16[..., 448:].view(np.uint8).reshape(nb, bs, 128)
    data = np.concatenate([q.view(np.uint8), rope], -1).reshape(nb, bs * 576)
    sc = np.concatenate([e, np.zeros((nb, bs, 1), np.uint8)], -1).reshape(nb, bs * 8)
    return np.concatenate([data, sc], -1)


def test_ds_mla_bytes_and_roundtrip(rng):
    kv = randn(rng, (3, 16, 512)).astype(ml_dtypes.bfloat16)
    packed = jax.jit(F.pack_ds_mla)(jnp.asarray(kv))
    assert packed.shape == (3, 16 * 584) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed), np_pack_ds_mla(kv))
    back = np.asarray(F.unpack_ds_mla(packed, 16)).astype(np.float32)
    ref = kv.astype(np.float32)
    np.testing.assert_array_equal(back[..., 448:], ref[..., 448:])  # rope kept bit-exact
    _, e = np_ue8m0_tiles(ref[..., :448])
    s = np.repeat(np.ldexp(1.0, e.astype(np.int32) - 127), 64, -1)
    assert np.all(np.abs(back[..., :448] - ref[..., :448]) <= np.abs(ref[..., :448]) * 2**-4 + s * 2**-9)


def test_ds_mla_rejects_bad_input():
    with pytest.raises(ValueError, match="kv: expected shape"):
        F.pack_ds_mla(jnp.ones((2, 4, 576), jnp.bfloat16))
    with pytest.raises(ValueError, match="kv: expected dtype bfloat16"):
        F.pack_ds_mla(jnp.ones((2, 4, 512), jnp.float32))
    with pytest.raises(ValueError, match="packed"):
        F.unpack_ds_mla(jnp.zeros((2, 100), jnp.uint8), 4)


# ------------------------------------------------------------------ FP4
def test_e2m1_rounding_matches_ml_dtypes(rng):
    y = np.concatenate(
        [
            rng.uniform(-8, 8, 4000).astype(np.float32),
            np.array([0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 100, -0.25, -5.0, -0.0], np.float32),
        ]
    )
    np.testing.assert_array_equal(np.asarray(F.e2m1_encode(jnp.asarray(y))), np_e2m1_codes(y))
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(F.e2m1_decode(jnp.asarray(codes))), codes.view(E2M1).astype(np.float32))


def test_nibble_order():
    packed = F.pack_nibbles(jnp.asarray([[1, 2, 3, 4]], jnp.uint8))
    assert np.asarray(packed).tolist() == [[0x21, 0x43]]
    assert np.asarray(F.unpack_nibbles(packed)).tolist() == [[1, 2, 3, 4]]


def test_mxfp4_bit_exact_and_roundtrip(rng):
    x = randn(rng, (4, 6, 128))
    p, s = jax.jit(F.quantize_mxfp4)(jnp.asarray(x))
    assert p.shape == (4, 6, 64) and s.shape == (4, 6, 4)
    assert p.size // 24 + s.size // 24 == 68  # bytes per 128-dim key
    p_np, s_np = np_mxfp4(x)
    np.testing.assert_array_equal(np.asarray(p), p_np)
    np.testing.assert_array_equal(np.asarray(s), s_np)
    back = np.asarray(F.dequantize_mxfp4(p, s, jnp.float32))
    scale = np.repeat(np.ldexp(1.0, s_np.astype(np.int32) - 127), 32, -1)
    # scale >= amax/6 so nothing clips; max rounding error is half the widest E2M1 step (1.0)
    assert np.all(np.abs(back - x) <= 1.0 * scale + 1e-12)
    assert np.all(np.abs(back).max(-1) > 0)


def test_nvfp4_bit_exact_and_roundtrip(rng):
    x = randn(rng, (4, 6, 128))
    p, s, g = jax.jit(F.quantize_nvfp4)(jnp.asarray(x))
    g_np = np.abs(x).max() / np.float32(2688)
    np.testing.assert_allclose(float(g), g_np, rtol=1e-7)
    p_np, s_np = np_nvfp4(x, np.float32(g))
    np.testing.assert_array_equal(np.asarray(p), p_np)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), s_np.view(np.uint8))
    back = np.asarray(F.dequantize_nvfp4(p, s, g, jnp.float32))
    blocks = x.reshape(4, 6, 8, 16)
    amax = np.abs(blocks).max(-1, keepdims=True)
    # block scale (rounded to e4m3, rel. err <= 2^-4) times half the widest E2M1 step,
    # plus the saturation loss when the rounded scale came out low
    bound = amax / 6 * (1 + 2**-3) * 1.0 + amax * 2**-3 + float(g) * 2**-9 * 6
    assert np.all(np.abs(back.reshape(blocks.shape) - blocks) <= bound)


def test_nvfp4_given_global_scale_and_zero():
    x = np.zeros((2, 32), np.float32)
    p, s, g = F.quantize_nvfp4(jnp.asarray(x))
    assert float(g) == 1.0 and np.all(np.asarray(p) == 0)
    y = np.linspace(-3, 3, 32, dtype=np.float32)[None]
    p, s, g = F.quantize_nvfp4(jnp.asarray(y), global_scale=0.5)
    assert float(g) == 0.5
    p_np, s_np = np_nvfp4(y, np.float32(0.5))
    np.testing.assert_array_equal(np.asarray(p), p_np)


def test_fp4_saturation_and_nonfinite():
    # a group scale forced small makes large values clip to +-6 codes
    y = np.array([[100.0] + [0.1] * 15], np.float32)
    p, s, g = F.quantize_nvfp4(jnp.asarray(y), global_scale=1e-3)
    back = np.asarray(F.dequantize_nvfp4(p, s, g, jnp.float32))
    assert back[0, 0] == pytest.approx(6 * float(s.astype(jnp.float32)[0, 0]) * 1e-3)
    x = np.ones((1, 64), np.float32)
    x[0, 40] = -np.inf
    p, e = F.quantize_mxfp4(jnp.asarray(x))
    assert np.asarray(e).tolist() == [[125, 255]]  # 1/6 -> 2^-2
    back = np.asarray(F.dequantize_mxfp4(p, e, jnp.float32))
    assert np.all(back[0, :32] == 1.0) and np.all(np.isnan(back[0, 32:]))


def test_div_rn_is_correctly_rounded(rng):
    from jaxkv.formats.numerics import div_rn

    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 30, 200_000))).astype(np.float32)
    y = (rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 30, 200_000))).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, np.nan, 4.6875, 3163.328613]
    y[:6] = [3.0, 2.0, 5.0, 1.0, 0.9375, 3163.328613]
    # quotients across the subnormal range, from normal operands (XLA's CPU backend treats
    # subnormal inputs as zero, so no float code can see them there)
    sub = slice(100_000, 150_000)
    x[sub] = (np.sign(rng.standard_normal(50_000)) * np.exp(rng.uniform(-87, -70, 50_000))).astype(np.float32)
    y[sub] = (rng.standard_normal(50_000) * np.exp(rng.uniform(0, 30, 50_000))).astype(np.float32)
    with np.errstate(over="ignore"):  # float64 -> float32 of a huge quotient is inf, as IEEE says
        want = (x.astype(np.float64) / y.astype(np.float64)).astype(np.float32)
    assert np.sum((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)) > 10_000  # subnormal results tested
    got = np.asarray(jax.jit(div_rn)(jnp.asarray(x), jnp.asarray(y)))
    np.testing.assert_array_equal(got, want)
    assert got[4] == 5.0 and got[5] == 1.0
    np.testing.assert_array_equal(
        np.asarray(div_rn(jnp.asarray(x[6:]), 448.0)), (x[6:].astype(np.float64) / 448).astype(np.float32)
    )


def test_fp8_encoder_matches_ml_dtypes_everywhere(rng):
    """Our integer E4M3 rounding equals ml_dtypes' over normals, subnormals and edges."""
    from jaxkv.formats.numerics import fp8_e4m3_encode

    y = (rng.standard_normal(300_000) * np.exp(rng.uniform(-16, 7, 300_000))).astype(np.float32)
    y[:10] = [0.0, -0.0, 448.0, 464.0, 500.0, -1e9, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 0.0146484375]
    want = np_fp8(y).view(np.uint8)
    got = np.asarray(jax.jit(fp8_e4m3_encode)(jnp.asarray(y))).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(np.asarray(fp8_e4m3_encode(jnp.asarray([np.nan]))).astype(np.float32)[0])


@pytest.mark.parametrize("dtype, exps", [(ml_dtypes.bfloat16, (-90, 60)), (np.float16, (-6, 3))])
def test_fp8_quotient_equals_the_rounded_division(rng, dtype, exps):
    """fp8_e4m3_quotient(x, s) is E4M3's rounding of the exact x / s (float64 here, exact
    enough: every quotient is a tie or >= 2**-14 from one) and fp8_e4m3_encode(div_rn(x, s)),
    for bf16 / f16 x and bf16 s of every magnitude (tiny s scaled inside), exact ties included."""
    from jaxkv.formats.numerics import div_rn, fp8_e4m3_encode, fp8_e4m3_quotient

    n = 1 << 15
    s = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(*exps, n)).astype(ml_dtypes.bfloat16).astype(np.float64)
    x = (rng.uniform(-448, 448, n) * 2.0 ** rng.integers(-14, 1, n) * s).astype(dtype).astype(np.float64)
    # exact ties: a midpoint of E4M3 (between every pair of neighbours) times an s of few bits
    grid = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mids = (grid[:-1] + grid[1:]) / 2
    st = (rng.integers(1, 8, mids.size) * 2.0 ** rng.integers(*exps, mids.size)).astype(np.float64)
    xt = (mids * st * rng.choice([-1, 1], mids.size)).astype(dtype).astype(np.float64)
    exact = np.abs(xt) / st == mids  # (f16's range leaves some out)
    assert exact.mean() > 0.5
    xt, st = xt[exact], st[exact]
    x, s = np.concatenate([x, xt, [0.0]]), np.concatenate([s, st, [1.0]])
    keep = np.abs(x / s) <= 448
    x, s = x[keep], s[keep]
    want = (x / s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    xj, sj = jnp.asarray(x, jnp.float32), jnp.asarray(s, jnp.float32)
    got = np.asarray(jax.jit(fp8_e4m3_quotient)(xj, sj)).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    divided = np.asarray(jax.jit(lambda x, s: fp8_e4m3_encode(div_rn(x, s)))(xj, sj)).view(np.uint8)
    np.testing.assert_array_equal(got, divided)


@pytest.mark.parametrize("pos", [0, 17, 31])
def test_nan_anywhere_in_a_group_poisons_its_scale(pos):
    """The scale of a group holding a NaN is NaN wherever the NaN sits (XLA's max-reduce alone
    is order-dependent), and the neighbouring group is untouched."""
    x = np.linspace(-3e4, 5e3, 128, dtype=np.float32).reshape(1, 128)
    x[0, pos] = np.nan
    _, e = F.quantize_mxfp4(jnp.asarray(x))
    assert np.asarray(e).tolist()[0][0] == 255 and np.asarray(e)[0, 1] != 255
    _, e = F.quantize_fp8_ue8m0(jnp.asarray(x))
    assert int(e[0, 0]) == 255 and int(e[0, 1]) != 255
    _, s, _ = F.quantize_nvfp4(jnp.asarray(x), global_scale=1.0)
    s = np.asarray(s.astype(jnp.float32))
    assert np.isnan(s[0, pos // 16]) and not np.isnan(s[0, (pos // 16) + 2])
    _, inv = F.quantize_fp8_per_entry(jnp.asarray(x))
    assert np.isnan(np.asarray(inv)).all()


def test_round_bf16_matches_ml_dtypes(rng):
    """The integer bf16 rounding (used where XLA could elide a cast round trip) equals a
    real cast: random magnitudes over the whole range, ties, overflow, inf, NaN, -0."""
    from jaxkv.formats.numerics import round_bf16

    x = (rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-40, 39, 1 << 16)).astype(np.float32)
    ties = (rng.integers(0, 1 << 15, 256).astype(np.uint32) << 16 | 0x8000).view(np.float32)  # exactly halfway
    x = np.concatenate([x, ties, np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, -3.39e38, 1e-45])])
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = np.asarray(jax.jit(round_bf16)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
