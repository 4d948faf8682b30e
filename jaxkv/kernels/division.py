"""Correctly rounded float32 division inside the Pallas kernels.

A quantizer must give the bytes of torch / CUDA C++ (``div.rn``), and the Triton
lowering's own ``/`` is not correctly rounded. ``Division`` bundles a kernel's choice:
the GPU's ``div.rn.f32`` for any operands, ``cuda/div_rn.cuh``'s shared-divisor
sequence where many quotients share a divisor (proven equal there), and in interpret
mode (CPU) ``formats.numerics.div_rn``, the reference's integer long division, which
computes the same quotients.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.formats.numerics import div_rn


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
    per_entry family forms: FP8 entry scales ``amax / 448`` and NVFP4 denominators
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
