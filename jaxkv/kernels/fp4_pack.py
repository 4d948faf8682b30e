"""FP4 packing: float keys -> E2M1 nibbles + group scales (MXFP4: UE8M0 per 32; NVFP4:
E4M3 per 16 and a float32 global scale), as Pallas kernels.

The math is ``jaxkv.formats.quantize_mxfp4`` / ``quantize_nvfp4``'s (same helpers, same
bytes), except for the division: by MXFP4's power-of-two group scale it is a multiply by
the exact inverse, by NVFP4's float32 scales the GPU's correctly rounded ``div.rn.f32``
(the reference's integer long division ``div_rn`` computes the same quotients, and is what
interpret mode runs). ``Division`` bundles the choice for every kernel. Each program quantizes ``ROWS`` keys. The input is viewed as
``[N, G, P, 2]`` (G groups of P element pairs) so the even and odd elements of every
group load as two ``[ROWS, G, P]`` blocks and pack into one byte each, with no reshape
inside the kernel. Lowering: Triton (``pltriton.CompilerParams``).

    MXFP4: x float[N, d] (d % 32 == 0) -> packed u8[N, d/2], scales u8[N, d/32]
    NVFP4: x float[N, d] (d % 16 == 0), global_scale f32[] or f32[N]
           -> packed u8[N, d/2], scales float8_e4m3fn[N, d/16], global_scale
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats import fp4 as _fp4
from jaxkv.formats._common import (E8M0_NAN, FP4_MAX, FP8_MAX, check_float, check_groups, div_rn, e8m0_to_float,
                                   ue8m0_scale)
from jaxkv.kernels.tuning import MXFP4_ROWS as ROWS, MXFP4_WARPS as NUM_WARPS



def ref_quantize_mxfp4(x):
    """The jnp reference (``jaxkv.formats.quantize_mxfp4``)."""
    return _fp4.quantize_mxfp4(x)


def _asm(asm: str, *args):
    """One f32 result per element of the broadcast f32 ``args`` by the PTX ``asm``."""
    from jax.experimental.pallas import triton as pltriton

    args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
    shape = args[0].shape  # Triton's inline asm takes no all-scalar operands: a scalar goes as f32[1]
    args = [a.reshape(shape or (1,)) for a in args]
    (out,) = pltriton.elementwise_inline_asm(asm, args=args, constraints="=f" + ",f" * len(args), pack=1,
                                             result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
    return out.reshape(shape)


def ptx_div_rn(x, y):
    """Correctly rounded float32 ``x / y`` by the GPU's ``div.rn.f32`` (what CUDA's ``/``
    and ``formats._common.div_rn`` compute; the Triton lowering's own ``/`` is not
    correctly rounded). GPU only: kernels divide by ``EXACT`` in interpret mode."""
    return _asm("div.rn.f32 $0, $1, $2;", x, y)


def ptx_div_shared(x, d):
    """``div.rn.f32``'s quotients ``x / d`` for bf16-valued x over divisors d > 0 that many
    x share (d broadcasts against x), by ``cuda/div_rn.cuh``'s ``SharedDivisor``, the same
    instructions: the reciprocal once per divisor, then a multiply and one fused
    correction per quotient (div.rn spends ~10 instructions on each). Proven equal there,
    exhaustively, where a code depends on it (|quotient| >= 2^-12) for the divisors the
    seed family forms: FP8 entry scales ``amax / 448`` and NVFP4 denominators
    ``e4m3 * (gmax / 2688)``. GPU only."""
    d = jnp.asarray(d, jnp.float32)
    k = jnp.where(d < 2.0**-32, jnp.float32(2.0**64), jnp.float32(1.0))  # keeps every step normal
    dk = d * k
    y = _asm("{ .reg .f32 r, e; rcp.approx.ftz.f32 r, $1; neg.f32 e, $1; fma.rn.f32 e, e, r, 0f3F800000; "
             "fma.rn.f32 $0, e, r, r; }", dk)  # on d's own shape: once per divisor
    return _asm("{ .reg .f32 xk, q, r; mul.rn.f32 xk, $1, $2; mul.rn.f32 q, xk, $4; fma.rn.f32 r, $3, q, xk; "
                "fma.rn.f32 q, r, $4, q; copysign.f32 $0, $1, q; }", x, k, -dk, y)


class Division(NamedTuple):
    """The kernels' correctly rounded float32 division: ``one(x, y)`` for any operands,
    ``shared(x, d)`` for bf16-valued x over shared divisors of the forms
    ``ptx_div_shared`` names."""

    one: Callable
    shared: Callable


EXACT = Division(div_rn, div_rn)  # the reference's integer long division: interpret mode (CPU)
PTX = Division(ptx_div_rn, ptx_div_shared)  # the GPU's
GENERAL = Division(ptx_div_rn, ptx_div_rn)  # the GPU's, for operands outside ptx_div_shared's proof


def division(interpret: bool) -> Division:
    return EXACT if interpret else PTX


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
    None (the storage's seed family). ``div``: a ``Division``; its ``shared`` is used for
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


def _check_rows(x, group):
    check_float(x)
    check_groups(x, group)
    if x.ndim != 2:
        raise ValueError(f"x: expected float[N, d], got shape {tuple(x.shape)}")


def _pack_kernel(x_ref, *refs, n, pairs):
    # x_ref: f[N, G, P, 2]; refs: the per-row operands ``pairs`` takes after (even, odd)
    # (f32[N] each), then packed_ref: u8[N, G, P], scales_ref: u8[N, G]
    from jax.experimental.pallas import triton as pltriton

    *row_refs, packed_ref, scales_ref = refs
    i = pl.program_id(0)
    rows = pl.ds(i * ROWS, ROWS)
    ok = i * ROWS + jnp.arange(ROWS) < n
    even = pltriton.load(x_ref.at[rows, :, :, jnp.int32(0)], mask=ok[:, None, None], other=0).astype(jnp.float32)
    odd = pltriton.load(x_ref.at[rows, :, :, jnp.int32(1)], mask=ok[:, None, None], other=0).astype(jnp.float32)
    per_row = [pltriton.load(r.at[rows], mask=ok, other=1.0) for r in row_refs]
    packed, byte = pairs(even, odd, *per_row)[:2]
    pltriton.store(packed_ref.at[rows], packed, mask=ok[:, None, None])
    pltriton.store(scales_ref.at[rows], byte, mask=ok[:, None])


def _pack(x, group: int, pairs, name: str, interpret: bool, *per_row):
    """x float[N, d] (checked) -> (packed u8[N, d/2], scale bytes u8[N, d/group]) by
    ``pairs(even, odd, *per_row_values, div=)`` over groups of ``group`` elements."""
    from jax.experimental.pallas import triton as pltriton

    n, d = x.shape
    groups, p = d // group, group // 2
    packed, scales = pl.pallas_call(
        functools.partial(_pack_kernel, n=n, pairs=functools.partial(pairs, div=EXACT if interpret else GENERAL)),
        out_shape=(jax.ShapeDtypeStruct((n, groups, p), jnp.uint8), jax.ShapeDtypeStruct((n, groups), jnp.uint8)),
        grid=(pl.cdiv(n, ROWS),),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=name,
    )(x.reshape(n, groups, p, 2), *per_row)
    return packed.reshape(n, d // 2), scales


@functools.partial(jax.jit, static_argnames="interpret")
def quantize_mxfp4(x, *, interpret: bool = False):
    """Pallas MXFP4: x float[N, d] -> (packed u8[N, d/2], scales u8[N, d/32]); bytes == the reference's."""
    _check_rows(x, _fp4.MXFP4_GROUP)
    return _pack(x, _fp4.MXFP4_GROUP, mxfp4_pairs, "jaxkv_mxfp4_pack", interpret)


def ref_quantize_nvfp4(x, global_scale=None):
    """The jnp reference (``jaxkv.formats.quantize_nvfp4``)."""
    return _fp4.quantize_nvfp4(x, global_scale)


@functools.partial(jax.jit, static_argnames="interpret")
def quantize_nvfp4(x, global_scale=None, *, interpret: bool = False):
    """Pallas NVFP4: x float[N, d] -> (packed u8[N, d/2], scales float8_e4m3fn[N, d/16],
    global_scale); bytes == the reference's. ``global_scale``: f32[] for the whole of x (as
    the format; None: ``nvfp4_global_scale(x)``) or f32[N], one per row."""
    _check_rows(x, _fp4.NVFP4_GROUP)
    n = x.shape[0]
    g = _fp4.nvfp4_global_scale(x) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    if g.shape not in ((), (n,)):
        raise ValueError(f"global_scale: expected f32[] or f32[{n}], got shape {tuple(g.shape)}")
    packed, scales = _pack(x, _fp4.NVFP4_GROUP, nvfp4_pairs, "jaxkv_nvfp4_pack", interpret, jnp.broadcast_to(g, (n,)))
    return packed, lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), g
