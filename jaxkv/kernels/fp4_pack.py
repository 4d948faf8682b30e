"""FP4 packing: float keys -> E2M1 nibbles + group scales (MXFP4: UE8M0 per 32; NVFP4:
E4M3 per 16 and a float32 global scale), as Pallas kernels.

The math is ``jaxkv.formats.quantize_mxfp4`` / ``quantize_nvfp4``'s (same helpers, same
bytes), except for the division: by MXFP4's power-of-two group scale it is a multiply by
the exact inverse, by NVFP4's float32 scales the GPU's correctly rounded ``div.rn.f32``
(the reference's integer long division ``div_rn`` computes the same quotients, and is what
interpret mode runs); ``kernels.division`` holds the choice, ``kernels.codes`` the
per-group byte math every kernel shares. Each program quantizes ``ROWS`` keys (``tuning``). The input is viewed as
``[N, G, P, 2]`` (G groups of P element pairs) so the even and odd elements of every
group load as two ``[ROWS, G, P]`` blocks and pack into one byte each, with no reshape
inside the kernel. Lowering: Triton (``pltriton.CompilerParams``).

    MXFP4: x float[N, d] (d % 32 == 0) -> packed u8[N, d/2], scales u8[N, d/32]
    NVFP4: x float[N, d] (d % 16 == 0), global_scale f32[] or f32[N]
           -> packed u8[N, d/2], scales float8_e4m3fn[N, d/16], global_scale
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats import fp4 as _fp4
from jaxkv.formats.numerics import check_float, check_groups
from jaxkv.kernels.codes import mxfp4_pairs, nvfp4_pairs
from jaxkv.kernels.division import EXACT, GENERAL
from jaxkv.kernels.tuning import launch


def ref_quantize_mxfp4(x):
    """The jnp reference (``jaxkv.formats.quantize_mxfp4``)."""
    return _fp4.quantize_mxfp4(x)


def _check_rows(x, group):
    check_float(x)
    check_groups(x, group)
    if x.ndim != 2:
        raise ValueError(f"x: expected float[N, d], got shape {tuple(x.shape)}")


def _pack_kernel(x_ref, *refs, n, pairs, ROWS):
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
    tune = launch("fp4_pack")
    ROWS = tune["rows"]
    packed, scales = pl.pallas_call(
        functools.partial(_pack_kernel, n=n, pairs=functools.partial(pairs, div=EXACT if interpret else GENERAL),
                          ROWS=ROWS),
        out_shape=(jax.ShapeDtypeStruct((n, groups, p), jnp.uint8), jax.ShapeDtypeStruct((n, groups), jnp.uint8)),
        grid=(pl.cdiv(n, ROWS),),
        compiler_params=pltriton.CompilerParams(num_warps=tune["warps"], num_stages=1),
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
