"""FP8 E4M3 with a float32 scale per entry, or a power-of-two (UE8M0) scale per 64-element tile.

Both store ``q = x / s`` rounded to nearest-even in ``float8_e4m3fn`` (values beyond
±448 saturate) and dequantize as ``q * s``.

Non-finite input: a NaN or ±inf anywhere in a scale group makes that group's scale NaN,
so every element of the group dequantizes to NaN.

The (de)quantizers are jitted: called eagerly, each of their ops would compile on its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.formats.numerics import (
    FP8_MAX,
    amax_abs,
    check_float,
    check_groups,
    div_rn,
    e8m0_to_float,
    exact_div,
    fp8_e4m3_encode,
    fp8_e4m3_quotient,
    group,
    ue8m0_scale,
    ungroup,
)

TILE = 64
UE8M0_MIN_SCALE = 1e-4  # FlashMLA's clamp: s = 2**ceil(log2(max(amax/448, 1e-4)))


def _to_fp8(y):
    return fp8_e4m3_encode(y)


@jax.jit
def quantize_fp8_per_entry(x):
    """Per-entry FP8 (the entries and SWA ring of the reference DeepSeek-V4 cache design,
    ``docs/glossary.md``).

    Args:
      x: float[..., d]
    Returns:
      q: float8_e4m3fn[..., d]
      scale: f32[...]  dequantization multiplier ``amax / 448`` (that design calls it
        ``inv_scale``: the inverse of the quantization multiplier 448/amax). An all-zero
        entry has scale 0 and q 0.
    """
    check_float(x)
    xf = x.astype(jnp.float32)
    amax = amax_abs(xf, axis=-1)
    scale = jnp.where(jnp.isfinite(amax), exact_div(amax, FP8_MAX), jnp.nan)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = _to_fp8(jnp.where((scale > 0)[..., None], div_rn(xf, safe[..., None]), 0.0))
    return q, scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_fp8_per_entry(q, scale, dtype=jnp.bfloat16):
    """q: float8_e4m3fn[..., d], scale: f32[...] -> dtype[..., d]."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("tile",))
def quantize_fp8_ue8m0(x, tile: int = TILE):
    """FP8 with one power-of-two scale per ``tile`` elements (FlashMLA / DeepSeek-V4 rule).

    Args:
      x: float[..., d], d a multiple of ``tile``
    Returns:
      q: float8_e4m3fn[..., d]
      scale_e8m0: uint8[..., d/tile]  biased exponent bytes, scale = 2**(byte-127)
    """
    check_float(x)
    check_groups(x, tile)
    xg = group(x.astype(jnp.float32), tile)
    amax = amax_abs(xg, axis=-1)
    s, byte = ue8m0_scale(jnp.maximum(exact_div(amax, FP8_MAX), UE8M0_MIN_SCALE))
    q = _to_fp8(div_rn(xg, s[..., None]))
    return ungroup(q), byte


@functools.partial(jax.jit, static_argnames=("dtype", "tile"))
def dequantize_fp8_ue8m0(q, scale_e8m0, dtype=jnp.bfloat16, tile: int = TILE):
    """q: float8_e4m3fn[..., d], scale_e8m0: uint8[..., d/tile] -> dtype[..., d]."""
    check_groups(q, tile, "q")
    s = e8m0_to_float(scale_e8m0)
    return ungroup(group(q.astype(jnp.float32), tile) * s[..., None]).astype(dtype)


@jax.jit
def quantize_fp8_rows(x):
    """FP8 E4M3 with one bfloat16 scale per row of the last axis: the frame cache's FP8 K/V,
    a row being one token's head. The scale is ``amax / 448`` rounded up to a bfloat16, so
    a row's largest value lands at (nearly) 448 and keeps its precision: with a power-of-two
    scale it lands anywhere in [224, 448] and the attention error doubles
    (docs/kernels/frame_cache_fp8.md: the measurements). Two bytes a row; nothing is clipped.

    Args:
      x: float[..., d] within bfloat16's range
    Returns:
      q: float8_e4m3fn[..., d]
      scale: bf16[...]  dequantization multiplier; 0 for an all-zero row, NaN for a row with
        a NaN or an infinity (every element then dequantizes to NaN)
    """
    check_float(x)
    xf = x.astype(jnp.float32)
    amax = amax_abs(xf, axis=-1)
    bits = lax.bitcast_convert_type(exact_div(amax, FP8_MAX), jnp.uint32)
    up = lax.bitcast_convert_type((bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000), jnp.float32)  # ceil to bf16
    scale = jnp.where(jnp.isfinite(amax), up, jnp.nan)
    keep = (scale > 0)[..., None]
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    if x.dtype in (jnp.bfloat16, jnp.float16):  # the frame cache's input: no division per element
        q = fp8_e4m3_quotient(jnp.where(keep, xf, 0.0), safe)
    else:
        q = _to_fp8(jnp.where(keep, div_rn(xf, safe), 0.0))
    return q, scale.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_fp8_rows(q, scale, dtype=jnp.bfloat16):
    """q: float8_e4m3fn[..., d], scale: bf16[...] (``quantize_fp8_rows``) -> dtype[..., d]."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)
