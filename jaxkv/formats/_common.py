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
        raise ValueError(
            f"{name}: expected a last dimension that is a multiple of {group}, "
            f"got shape {tuple(x.shape)}"
        )


def check_float(x, name: str = "x") -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array, got dtype {x.dtype}")


def exact_div(x, c: float):
    """``x / c`` correctly rounded, as torch and CUDA compute it.

    XLA rewrites division by a constant (or a broadcast scalar) into multiplication by
    its rounded reciprocal, which is 1 ulp off for about half of all inputs and moves
    power-of-two scales across a boundary. A materialized divisor keeps a true division.
    ``x`` is a per-group array (amax), so the extra buffer is small.
    """
    return x / lax.optimization_barrier(jnp.full(jnp.shape(x), c, jnp.float32))


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
    """UE8M0 byte -> float32 ``2**(byte-127)``; 0xFF -> NaN."""
    b = byte.astype(jnp.int32)
    val = jnp.ldexp(jnp.ones(b.shape, jnp.float32), b - E8M0_BIAS)
    return jnp.where(b == E8M0_NAN, jnp.nan, val)


def group(x, size: int):
    """[..., d] -> [..., d/size, size]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def ungroup(x):
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
