"""Shared helpers for the quantized formats: exact power-of-two scales and shape checks."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest float4_e2m1fn
E8M0_BIAS = 127
E8M0_NAN = 255


def check_groups(x, group: int, name: str = "x") -> None:
    """Raise ValueError unless the last axis of ``x`` splits into groups of ``group``."""
    if x.ndim < 1 or x.shape[-1] % group != 0:
        raise ValueError(f"{name}: expected a last dimension that is a multiple of {group}, got shape {tuple(x.shape)}")


def check_float(x, name: str = "x") -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array, got dtype {x.dtype}")


def amax_abs(x, axis=None):
    """``max(|x|)`` over ``axis`` that is NaN wherever a NaN is reduced.

    XLA's max-reduction is not reliably NaN-propagating (a vectorized ``max`` keeps the
    other operand, so the result depends on where the NaN sits); the formats promise that
    a non-finite input poisons its group's scale, so they reduce with this.
    """
    a = jnp.abs(x)
    has_nan = jnp.max(jnp.isnan(a).astype(jnp.int32), axis=axis) > 0  # an int max: Pallas Triton has no reduce_or
    return jnp.where(has_nan, jnp.nan, jnp.max(a, axis=axis))


def div_rn(x, y):
    """Correctly rounded float32 ``x / y`` (IEEE round-to-nearest-even), on every backend.

    XLA's own ``/`` is not: on GPU it emits ``div.full.f32`` (up to 2 ulp; about a quarter
    of quotients are 1 ulp off) and on CPU it rewrites division by a constant into
    multiplication by a rounded reciprocal. torch and CUDA C++ (``div.rn``) round
    correctly, and a quantizer must give the same bytes as theirs, so scales and
    quantized values use this: the quotient of the two 24-bit significands by integer
    long division (4 x 7 bits), a sticky bit for the remainder, and one correctly rounded
    rounding in integers at the result's last bit (subnormal results included). Zeros,
    infinities, NaN and a zero divisor follow IEEE. (XLA's CPU backend reads subnormal
    operands as zero, before this code sees them.)
    """
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)
    x, y = jnp.broadcast_arrays(x, y)
    mx, ex = jnp.frexp(jnp.abs(x))  # |x| = mx * 2**ex, mx in [0.5, 1)
    my, ey = jnp.frexp(jnp.abs(y))
    Mx = (mx * 2.0**24).astype(jnp.int32)  # 24-bit significands
    My = jnp.maximum((my * 2.0**24).astype(jnp.int32), 1)
    q = jnp.zeros_like(Mx)
    r = Mx
    for _ in range(4):  # q = floor(Mx * 2**28 / My) < 2**29
        r = r << 7
        d = lax.div(r, My)
        q = (q << 7) | d
        r = r - d * My
    qs = (q << 1) | (r != 0).astype(jnp.int32)  # |x / y| = (qs + a sticky fraction) * 2**(ex - ey - 29)
    # Round once, in integers, at the result's last bit: 24 significant bits of qs (a 29- or
    # 30-bit number), or the subnormal grid 2**-149 where that is coarser.
    E = ex - ey - 29
    top = jnp.where(qs >= 1 << 29, 29, 28)  # qs in [2**28, 2**30)
    grid = jnp.maximum(E + top - 23, -149)
    d = jnp.minimum(grid - E, 31).astype(jnp.uint32)  # bits of qs to drop, >= 5
    u = qs.astype(jnp.uint32)
    m = u >> d
    rem = u - (m << d)
    half = jnp.uint32(1) << (d - 1)
    m = m + ((rem > half) | ((rem == half) & ((m & 1) == 1))).astype(jnp.uint32)
    # m * 2**grid as float32 bits (no multiply: XLA's CPU flushes subnormal products to
    # zero). m in [2**23, 2**24] (or < 2**23 on the subnormal grid, where this is m itself);
    # a carry into the exponent is right, past the largest exponent it is inf.
    expo = (jnp.minimum(grid, 105) + 150).astype(jnp.uint32) << 23
    bits = jnp.minimum(expo + m - jnp.uint32(1 << 23), jnp.uint32(0x7F800000))
    bits = bits | jnp.where(jnp.signbit(x) ^ jnp.signbit(y), jnp.uint32(0x80000000), jnp.uint32(0))
    res = lax.bitcast_convert_type(bits, jnp.float32)
    special = (x == 0) | (y == 0) | ~jnp.isfinite(x) | ~jnp.isfinite(y)
    return jnp.where(special, x / y, res)


def exact_div(x, c: float):
    """``x / c`` for a constant ``c``, correctly rounded (see ``div_rn``)."""
    return div_rn(x, jnp.float32(c))


def ceil_log2(v):
    """Exact ``ceil(log2(v))`` for positive finite float32 ``v`` (int32).

    Uses the float's exponent instead of a rounded ``log2``: values a few ulps above a
    power of two round up, as the math says.
    """
    m, e = jnp.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    return jnp.where(m == 0.5, e - 1, e).astype(jnp.int32)


def ue8m0_scale(v):
    """Power-of-two scale ``2**ceil(log2(v))`` for v > 0, as (float32 scale, uint8 E8M0 byte).

    Non-finite ``v`` gives the E8M0 NaN byte (0xFF) and a NaN scale, so the whole group
    dequantizes to NaN instead of to plausible numbers.
    """
    finite = jnp.isfinite(v)
    e = jnp.clip(ceil_log2(jnp.where(finite, v, 1.0)), -E8M0_BIAS, E8M0_BIAS)
    byte = jnp.where(finite, e + E8M0_BIAS, E8M0_NAN).astype(jnp.uint8)
    return e8m0_to_float(byte), byte


def e8m0_to_float(byte):
    """UE8M0 byte -> float32 ``2**(byte-127)``, built from its bits; 0xFF -> NaN."""
    b = byte.astype(jnp.int32)
    val = lax.bitcast_convert_type(jnp.where(b == 0, 1 << 22, b << 23), jnp.float32)
    return jnp.where(b == E8M0_NAN, jnp.nan, val)


def pow2(e):
    """float32 ``2**e`` for int e in [-126, 127], built from its bits (exact on every backend)."""
    return lax.bitcast_convert_type((jnp.asarray(e, jnp.int32) + 127) << 23, jnp.float32)


def ldexp(x, e):
    """``x * 2**e`` by two exact power-of-two multiplies (normal results are exact)."""
    e1 = jnp.clip(e, -126, 127)
    return x * pow2(e1) * pow2(jnp.clip(e - e1, -126, 127))


def fp8_e4m3_encode(y):
    """float32 -> float8_e4m3fn, round-to-nearest-even, saturating at ±448, subnormals exact.

    Done with integer arithmetic, not XLA's convert, so every backend gives the same bytes
    (XLA's GPU conversion disagrees with ml_dtypes / CUDA in the subnormal range).
    NaN -> NaN (0x7F, sign kept).
    """
    return _e4m3(jnp.asarray(y, jnp.float32))


def fp8_e4m3_quotient(x, s):
    """``fp8_e4m3_encode(div_rn(x, s))`` without the division, for ``x`` of at most 11
    significant bits (bfloat16 or float16 values, as float32) and ``s > 0`` a bfloat16
    value (a row scale, broadcast against ``x``); the same bytes at a fraction of the work.

    ``q = x * (1 / s)`` is within 2**-21 of ``x / s`` relatively. With x = X 2**a, s = S 2**b
    (X < 2**11, S < 2**8) and an E4M3 rounding midpoint m = M 2**c (M < 2**5 odd), either
    x = m s exactly (a tie) or |x / s - m| >= 2**-14 m: ``x - m s`` is a nonzero multiple of
    2**min(a, b + c). So ``q`` rounds as ``x / s`` does, except on a tie, which it finds by
    coming within 2**-16 of a midpoint and resolves to even. A tiny ``s`` (below 2**-64)
    and its row are scaled by 2**64 first, exactly, so ``1 / s`` stays finite.
    """
    x = jnp.asarray(x, jnp.float32)
    s = jnp.asarray(s, jnp.float32)
    tiny = s < 2.0**-64
    xs = jnp.where(tiny, x * 2.0**64, x)
    ss = jnp.where(tiny, s * 2.0**64, s)
    return _e4m3(xs * div_rn(jnp.float32(1.0), ss), ties_within=2.0**-16)


def _e4m3(y, ties_within=None):
    """float32 ``y`` -> float8_e4m3fn (``fp8_e4m3_encode``); with ``ties_within``, a value
    that close to a rounding midpoint is taken to be on it (``fp8_e4m3_quotient``)."""
    a = jnp.minimum(jnp.abs(y), 448.0)
    _, e = jnp.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    exp = jnp.where(a > 0, jnp.maximum(e - 1, -6), -6)  # unbiased exponent; subnormals use -6
    # a in ulps of 2**(exp-3), rounded half to even: [8, 16) for normals (the leading 1 is
    # bit 3, so it adds 8 to the biased exponent field), [0, 8] for subnormals; a carry
    # to 16 moves into the next exponent by plain addition.
    t = a * pow2(3 - exp)
    steps = jnp.round(t)
    if ties_within is not None:
        f = jnp.floor(t)
        steps = jnp.where(jnp.abs(t - f - 0.5) < ties_within, f + f % 2, steps)
    code = ((exp + 6) << 3) + steps.astype(jnp.int32)
    code = jnp.where(jnp.isnan(y), 0x7F, jnp.minimum(code, 0x7E))
    byte = (code | (jnp.signbit(y).astype(jnp.int32) << 7)).astype(jnp.uint8)
    return lax.bitcast_convert_type(byte, jnp.float8_e4m3fn)


def round_bf16(x):
    """float32 -> float32 rounded to the nearest bfloat16 (ties to even), by integer ops.

    ``x.astype(bf16).astype(f32)`` is not reliable under XLA: its excess-precision rewrite
    may drop the round trip when fused, so a value meant to be rounded to bf16 keeps its
    float32 bits (and Pallas's Triton lowering has no ``reduce_precision``). NaN stays NaN.
    """
    x = jnp.asarray(x, jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    lsb = (bits >> 16) & 1
    r = lax.bitcast_convert_type((bits + 0x7FFF + lsb) & jnp.int32(-65536), jnp.float32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return jnp.where(nan, x, r)


def group(x, size: int):
    """[..., d] -> [..., d/size, size]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def ungroup(x):
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
