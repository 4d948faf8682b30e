"""FP4 packing: float rows -> E2M1 nibbles + group scales (MXFP4: UE8M0 per 32; NVFP4:
E4M3 per 16 and a float32 global scale), by one CUDA kernel.

The math is ``jaxkv.formats.quantize_mxfp4`` / ``quantize_nvfp4``'s and so are the bytes:
dividing by MXFP4's power-of-two group scale is a multiply by its exact inverse, by
NVFP4's float32 scales the GPU's correctly rounded ``div.rn.f32`` (the reference's integer
long division ``div_rn`` computes the same quotients). The kernel is ``jaxkv/cuda/fp4_pack.cu``
(four elements per thread, a group's lanes sharing its maximum by shuffles; the encoders
are ``jaxkv/cuda/codes.cuh``'s, which the flush-write's indexer keys use too) reached through
``jax.ffi``, not Pallas: each group packs its even and odd elements into one byte, a
strided register slice Mosaic GPU does not lower, and its ``e2m1`` / ``e8m0`` types are
Blackwell's (``tests/kernels/test_mosaic_limits.py``; docs/kernels/cache_writes.md).

    MXFP4: x float[N, d] (d % 32 == 0) -> packed u8[N, d/2], scales u8[N, d/32]
    NVFP4: x float[N, d] (d % 16 == 0), global_scale f32[] or f32[N]
           -> packed u8[N, d/2], scales float8_e4m3fn[N, d/16], global_scale
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.cuda import register_ffi_targets
from jaxkv.formats import fp4 as _fp4
from jaxkv.formats.numerics import check_float, check_groups


def ref_quantize_mxfp4(x):
    """The jnp reference (``jaxkv.formats.quantize_mxfp4``)."""
    return _fp4.quantize_mxfp4(x)


def ref_quantize_nvfp4(x, global_scale=None):
    """The jnp reference (``jaxkv.formats.quantize_nvfp4``)."""
    return _fp4.quantize_nvfp4(x, global_scale)


def _check_rows(x, group):
    check_float(x)
    check_groups(x, group)
    if x.ndim != 2:
        raise ValueError(f"x: expected float[N, d], got shape {tuple(x.shape)}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")


def _pack(target: str, x, g, group: int):
    """x float[N, d] (checked), g f32[N] -> (packed u8[N, d/2], scale bytes u8[N, d/group])."""
    register_ffi_targets()
    n, d = x.shape
    out = (jax.ShapeDtypeStruct((n, d // 2), jnp.uint8), jax.ShapeDtypeStruct((n, d // group), jnp.uint8))
    return jax.ffi.ffi_call(target, out)(x, g)


@jax.jit
def quantize_mxfp4(x):
    """MXFP4 on the GPU: x float[N, d] -> (packed u8[N, d/2], scales u8[N, d/32]); bytes ==
    the reference's. Needs a GPU and nvcc (the first use builds ``cuda/``)."""
    _check_rows(x, _fp4.MXFP4_GROUP)
    return _pack("jaxkv_mxfp4_pack", x, jnp.zeros((1,), jnp.float32), _fp4.MXFP4_GROUP)


@jax.jit
def quantize_nvfp4(x, global_scale=None):
    """NVFP4 on the GPU: x float[N, d] -> (packed u8[N, d/2], scales float8_e4m3fn[N, d/16],
    global_scale); bytes == the reference's. ``global_scale``: f32[] for the whole of x (as
    the format; None: ``nvfp4_global_scale(x)``) or f32[N], one per row."""
    _check_rows(x, _fp4.NVFP4_GROUP)
    n = x.shape[0]
    g = _fp4.nvfp4_global_scale(x) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    if g.shape not in ((), (n,)):
        raise ValueError(f"global_scale: expected f32[] or f32[{n}], got shape {tuple(g.shape)}")
    packed, scales = _pack("jaxkv_nvfp4_pack", x, jnp.broadcast_to(g, (n,)), _fp4.NVFP4_GROUP)
    return packed, lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), g


__all__ = ["quantize_mxfp4", "quantize_nvfp4", "ref_quantize_mxfp4", "ref_quantize_nvfp4"]
