"""Byte encoders the flush and packing kernels share, written for in-register use.

Each is the formats' math (``jaxkv.formats``) rearranged for a kernel: NaN found from the
bits (the Triton lowering folds ``x != x`` to false), division by a power-of-two scale
as a multiply by its exact inverse, by a float32 scale through a ``division.Division``,
and 128-dim keys handled as their (even, odd) element pairs so two codes pack into a
byte with no shuffle. Same bytes as the formats' encoders (tests in ``tests/kernels``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxkv.formats import fp4 as _fp4
from jaxkv.formats.fp8 import UE8M0_MIN_SCALE
from jaxkv.formats.numerics import E8M0_NAN, FP4_MAX, FP8_MAX, e8m0_to_float, ue8m0_scale
from jaxkv.formats.storage import NOPE_TILES
from jaxkv.kernels.division import EXACT


def is_nan_bits(v):
    """i32 1 where v is NaN, from its bits (the Triton lowering folds ``x != x`` to false)."""
    bits = lax.bitcast_convert_type(v, jnp.int32) & 0x7FFFFFFF
    return (bits > 0x7F800000).astype(jnp.int32)


def pow2_inverse(byte):
    """``1 / 2**(byte - 127)`` exactly, NaN for the UE8M0 NaN byte. Dividing by a power-of-two
    scale is then a multiply: exact, and where a quotient would be an f32 subnormal (the
    only place the two could round differently) FP8 and E2M1 both encode zero — the
    reference's integer long division is not needed in a kernel."""
    b = byte.astype(jnp.int32)
    return jnp.where(b == E8M0_NAN, jnp.nan, e8m0_to_float((254 - b).astype(jnp.uint8)))


def mxfp4_pairs(even, odd, div=EXACT):
    """MXFP4 of groups given as their even and odd elements, f32[..., G, 16] each ->
    (packed bytes u8[..., G, 16], UE8M0 scales u8[..., G]); a group with a NaN is all 7s.
    ``div``: a ``Division`` (the same quotients either way)."""
    nan = jnp.maximum(jnp.max(is_nan_bits(even), axis=-1), jnp.max(is_nan_bits(odd), axis=-1)) > 0
    amax = jnp.maximum(jnp.max(jnp.abs(even), axis=-1), jnp.max(jnp.abs(odd), axis=-1))
    _, byte = ue8m0_scale(div.one(jnp.maximum(amax, _fp4.MXFP4_MIN_AMAX), FP4_MAX))
    byte = jnp.where(nan, jnp.uint8(E8M0_NAN), byte)
    inv = pow2_inverse(byte)[..., None]
    lo = jnp.where(nan[..., None], jnp.uint8(7), _fp4.e2m1_encode(even * inv))
    hi = jnp.where(nan[..., None], jnp.uint8(7), _fp4.e2m1_encode(odd * inv))
    return lo | (hi << 4), byte


def nan_amax(*parts, axis=-1):
    """``max(|x|)`` over ``axis`` of all ``parts`` together, NaN if any element is NaN (as
    ``formats._common.amax_abs``; NaN found from the bits)."""
    nan = functools.reduce(jnp.maximum, [jnp.max(is_nan_bits(x), axis=axis) for x in parts]) > 0
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=axis) for x in parts])
    return jnp.where(nan, jnp.nan, amax)


def e4m3_bytes(x):
    """f32 -> float8_e4m3fn bytes (round to nearest even, saturating, NaN 0x7F), u8."""
    return lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


def nvfp4_pairs(even, odd, g=None, div=EXACT):
    """NVFP4 of rows given as their even and odd elements, f32[..., G, 8] each (G groups of
    16 elements as 8 pairs) -> (packed bytes u8[..., G, 8], E4M3 group scales u8[..., G],
    global scale f32[...]): ``formats.quantize_nvfp4`` with the global scale ``g``
    (f32[...], one per row), or with each row's own ``nvfp4_global_scale`` where ``g`` is
    None (the per_entry storage family). ``div``: a ``Division``; its ``shared`` is used for
    the codes, so on a GPU pass ``PTX`` only for bf16-valued keys with ``g=None``."""
    amax = nan_amax(even, odd)  # [..., G]
    if g is None:
        key_amax = jnp.max(amax, axis=-1)  # NaN groups are dropped by max; the reference then also gives 1.0
        key_amax = jnp.where(jnp.max(is_nan_bits(amax), axis=-1) > 0, jnp.nan, key_amax)
        g = jnp.where(key_amax > 0, div.one(key_amax, jnp.float32(FP8_MAX * FP4_MAX)), 1.0)
    gs = g[..., None]
    bs = jnp.where(amax < jnp.inf, div.one(div.one(amax, jnp.float32(FP4_MAX)), gs), jnp.nan)
    byte = e4m3_bytes(bs)
    denom = (lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float32) * gs)[..., None]
    ok = denom > 0
    safe = jnp.where(ok, denom, 1.0)

    def codes(x):
        y = jnp.where(ok, div.shared(x, safe), 0.0)
        return jnp.where(is_nan_bits(y) > 0, jnp.uint8(7), _fp4.e2m1_encode(y))

    return codes(even) | (codes(odd) << 4), byte, g


def ue8m0_tile_codes(*parts, div=EXACT):
    """FP8 E4M3 codes with one UE8M0 scale per tile, a tile given as ``parts`` f32[..., n]
    (its elements are all the parts' last axes together) -> (scale bytes u8[...], codes
    u8[..., n] per part). A tile holding a NaN gets the NaN scale byte and all NaN codes.
    ``div``: an ``fp4_pack.Division`` (the same quotients either way)."""
    nan = functools.reduce(jnp.maximum, [jnp.max(is_nan_bits(x), axis=-1) for x in parts]) > 0
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1) for x in parts])
    _, byte = ue8m0_scale(jnp.maximum(div.one(amax, FP8_MAX), UE8M0_MIN_SCALE))
    byte = jnp.where(nan, jnp.uint8(E8M0_NAN), byte)
    inv = pow2_inverse(byte)[..., None]
    nan_tile = (byte == E8M0_NAN)[..., None]
    return byte, [jnp.where(nan_tile, jnp.uint8(0x7F),
                            lax.bitcast_convert_type((x * inv).astype(jnp.float8_e4m3fn), jnp.uint8)) for x in parts]


def per_entry_codes(*parts, div=EXACT):
    """FP8 E4M3 codes with one float32 scale per entry (the per_entry storage family,
    ``formats.quantize_fp8_per_entry``), an entry's 448 FP8 dims given as ``parts``
    f32[R, 8, n] (bf16 values) whose tile 7 (the RoPE dims) is left out -> (scale f32[R],
    codes u8[R, 8, n] per part). A non-finite entry gets a NaN scale and zero codes.
    ``div``: an ``fp4_pack.Division`` (the same quotients either way)."""
    nope = jnp.arange(8)[None, :, None] < NOPE_TILES
    tiles = nan_amax(*[jnp.where(nope, x, 0.0) for x in parts])  # [R, 8]
    amax = nan_amax(tiles)  # [R]
    scale = jnp.where(amax < jnp.inf, div.one(amax, jnp.float32(FP8_MAX)), jnp.nan)
    ok = (scale > 0)[:, None, None]
    safe = jnp.where(ok, scale[:, None, None], 1.0)
    return scale, [jnp.where(ok, e4m3_bytes(div.shared(x, safe)), jnp.uint8(0)) for x in parts]


def f32_bytes(x):
    """f32[...] -> its 4 little-endian bytes, u8[..., 4]."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)[..., None]
    return ((bits >> (8 * jnp.arange(4, dtype=jnp.uint32))) & 0xFF).astype(jnp.uint8)
