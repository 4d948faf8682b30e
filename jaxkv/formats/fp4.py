"""FP4 E2M1 formats for indexer keys: NVFP4 (the reference DeepSeek-V4 cache design,
``docs/glossary.md``) and MXFP4 (official DeepSeek-V4).

Codes are packed two per byte, element ``2i`` in the low nibble and ``2i+1`` in the high
nibble. E2M1 has no NaN or inf: rounding is to nearest-even and magnitudes above 6
saturate to ±6. A non-finite input makes its group's scale NaN (E4M3 NaN for NVFP4, the
UE8M0 NaN byte 0xFF for MXFP4), so the whole group dequantizes to NaN.

The (de)quantizers are jitted: called eagerly, each of their ops would compile on its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.formats.numerics import (
    FP4_MAX,
    FP8_MAX,
    amax_abs,
    check_float,
    check_groups,
    div_rn,
    e8m0_to_float,
    exact_div,
    fp8_e4m3_encode,
    group,
    ue8m0_scale,
    ungroup,
)

NVFP4_GROUP = 16
MXFP4_GROUP = 32
MXFP4_MIN_AMAX = 1e-4  # DeepGEMM: s = 2**ceil(log2(max(amax, 1e-4) / 6))

# E2M1 magnitudes by code 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even boundaries between consecutive codes: (upper bound, inclusive?).
# A tie goes to the code with an even mantissa bit (0, 1.0, 2.0, 4.0).
_BOUNDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))


def e2m1_encode(y):
    """float32[...] (already scaled) -> uint8[...] E2M1 codes (sign in bit 3), RNE, saturating.

    Negative values that round to zero keep the sign (code 8), like ml_dtypes and the
    hardware conversion; NaN (only seen with a NaN scale) encodes as 7.
    """
    a = jnp.abs(y)
    code = jnp.zeros(y.shape, jnp.uint8)
    for bound, inclusive in _BOUNDS:
        above = a > bound if inclusive else a >= bound
        code = code + above.astype(jnp.uint8)
    sign = (jnp.signbit(y) & ~jnp.isnan(y)).astype(jnp.uint8) << 3  # -0 keeps its sign, as cvt.rn does
    return jnp.where(jnp.isnan(y), jnp.uint8(7), code | sign)


def e2m1_decode(code):
    """uint8[...] E2M1 codes -> float32[...]."""
    table = jnp.asarray(E2M1_VALUES, jnp.float32)
    mag = table[(code & 7).astype(jnp.int32)]
    return jnp.where((code & 8) != 0, -mag, mag)


def pack_nibbles(codes):
    """uint8[..., d] codes -> uint8[..., d/2]; element 2i in the low nibble."""
    check_groups(codes, 2, "codes")
    pairs = group(codes, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed):
    """uint8[..., d/2] -> uint8[..., d] codes."""
    lo = packed & 0xF
    hi = packed >> 4
    return ungroup(jnp.stack([lo, hi], axis=-1))


@jax.jit
def quantize_mxfp4(x):
    """MXFP4: E2M1 with one UE8M0 scale per 32 elements, no global scale (DeepGEMM's rule).

    Args:
      x: float[..., d], d a multiple of 32
    Returns:
      packed: uint8[..., d/2]
      scales: uint8[..., d/32]  E8M0 bytes, scale = 2**(byte-127)
    A 128-dim key is 64 + 4 = 68 bytes.
    """
    check_float(x)
    check_groups(x, MXFP4_GROUP)
    xg = group(x.astype(jnp.float32), MXFP4_GROUP)
    amax = amax_abs(xg, axis=-1)
    s, byte = ue8m0_scale(exact_div(jnp.maximum(amax, MXFP4_MIN_AMAX), FP4_MAX))
    codes = e2m1_encode(div_rn(xg, s[..., None]))
    return pack_nibbles(ungroup(codes)), byte


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp4(packed, scales, dtype=jnp.bfloat16):
    """packed: uint8[..., d/2], scales: uint8[..., d/32] -> dtype[..., d]."""
    vals = group(e2m1_decode(unpack_nibbles(packed)), MXFP4_GROUP)
    return ungroup(vals * e8m0_to_float(scales)[..., None]).astype(dtype)


@jax.jit
def nvfp4_global_scale(x):
    """The tensor-wide NVFP4 dequantization scale ``amax / (448 * 6)`` (1.0 for an all-zero x)."""
    amax = amax_abs(x.astype(jnp.float32))
    return jnp.where(amax > 0, exact_div(amax, FP8_MAX * FP4_MAX), 1.0).astype(jnp.float32)


@jax.jit
def quantize_nvfp4(x, global_scale=None):
    """NVFP4: E2M1 with one E4M3 scale per 16 elements and one float32 global scale.

    The group scale is ``amax_group / 6 / global_scale`` rounded to E4M3; codes are
    ``x / (group_scale * global_scale)``. Dequantize: ``code * group_scale * global_scale``.

    Args:
      x: float[..., d], d a multiple of 16
      global_scale: f32[] or None (then ``nvfp4_global_scale(x)``, over all of x)
    Returns:
      packed: uint8[..., d/2]
      scales: float8_e4m3fn[..., d/16]
      global_scale: f32[]
    """
    check_float(x)
    check_groups(x, NVFP4_GROUP)
    xf = x.astype(jnp.float32)
    g = nvfp4_global_scale(xf) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    xg = group(xf, NVFP4_GROUP)
    amax = amax_abs(xg, axis=-1)
    bs = jnp.where(jnp.isfinite(amax), div_rn(exact_div(amax, FP4_MAX), g), jnp.nan)
    bs8 = fp8_e4m3_encode(bs)
    denom = bs8.astype(jnp.float32) * g
    y = jnp.where((denom > 0)[..., None], div_rn(xg, jnp.where(denom > 0, denom, 1.0)[..., None]), 0.0)
    return pack_nibbles(ungroup(e2m1_encode(y))), bs8, g


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_nvfp4(packed, scales, global_scale, dtype=jnp.bfloat16):
    """packed: uint8[..., d/2], scales: float8_e4m3fn[..., d/16], global_scale: f32[] -> dtype[..., d]."""
    vals = group(e2m1_decode(unpack_nibbles(packed)), NVFP4_GROUP)
    s = scales.astype(jnp.float32) * jnp.asarray(global_scale, jnp.float32)
    return ungroup(vals * s[..., None]).astype(dtype)
