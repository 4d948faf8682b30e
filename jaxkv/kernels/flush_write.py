"""CSA / HCA flush-write as a Pallas kernel: finished entries -> ``ds_mla`` bytes (and
MXFP4 indexer keys) scattered into one layer of a paged pool, in place.

The official storage family (``hybrid.storage``): per entry 448 FP8 dims with one UE8M0
scale per 64-element tile and 64 BF16 RoPE dims, 584 B in a segment-major block; per key
64 B of E2M1 nibbles and 4 UE8M0 bytes. The math is the formats' (same helpers, same
bytes as ``hybrid.flush.ref_flush_write``); dividing by a power-of-two scale is a
multiply by its exact inverse and the keys use ``fp4_pack.mxfp4_pairs``. Each program handles ``ROWS`` entries
and writes them with scatter stores (integer-array indexers of the pool viewed as
``[layers * blocks, block bytes]``). Lowering: Triton (``pltriton.CompilerParams``).

    pool: u8[L, NB, bs * 584]      index_pool: u8[L, NB, bs * 68] (CSA) or None
    x: bf16[N, 512] (or a ``hybrid.Stacked`` row of bf16[n, N, 512])   xi: bf16[N, 128] (CSA) or None
    block, slot: i32[N]            rows outside [0, NB) are not written
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats._common import E8M0_NAN, FP8_MAX, exact_div, ue8m0_scale
from jaxkv.formats.fp8 import UE8M0_MIN_SCALE
from jaxkv.hybrid.stacked import as_stack
from jaxkv.kernels.fp4_pack import is_nan_bits, mxfp4_pairs, pow2_inverse

# entries per program (a power of two: Triton blocks) and warps: ROWS 4-32 x warps 1-8 on
# an H100 gave 7.65-8.1 us at 4,096 entries at best (4 x 2, 8 x 4, 16 x 4, 16 x 8); kept 16 x 4
ROWS = 16
NUM_WARPS = 4
ENTRY, DATA, NOPE_TILES = 584, 576, 7
KEY, CODES = 68, 64


def ue8m0_tile_codes(*parts):
    """FP8 E4M3 codes with one UE8M0 scale per tile, a tile given as ``parts`` f32[..., n]
    (its elements are all the parts' last axes together) -> (scale bytes u8[...], codes
    u8[..., n] per part). A tile holding a NaN gets the NaN scale byte and all NaN codes."""
    nan = functools.reduce(jnp.maximum, [jnp.max(is_nan_bits(x), axis=-1) for x in parts]) > 0
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1) for x in parts])
    _, byte = ue8m0_scale(jnp.maximum(exact_div(amax, FP8_MAX), UE8M0_MIN_SCALE))
    byte = jnp.where(nan, jnp.uint8(E8M0_NAN), byte)
    inv = pow2_inverse(byte)[..., None]
    nan_tile = (byte == E8M0_NAN)[..., None]
    return byte, [jnp.where(nan_tile, jnp.uint8(0x7F),
                            lax.bitcast_convert_type((x * inv).astype(jnp.float8_e4m3fn), jnp.uint8)) for x in parts]


def _kernel(x_ref, xi_e_ref, xi_o_ref, blk_ref, slot_ref, pool_in, index_in, pool_ref, index_ref, *, n, nb, bs, layer,
            with_index, x_off):
    # x_ref: bf16[n * N, 8, 64] (tiles; tile 7 = the rope dims; entry e at row x_off + e); xi_e/o_ref: bf16[N, 4, 16] even / odd
    # elements of each 32-group; blk_ref, slot_ref: i32[N]; pool_ref: u8[L * NB, bs * 584];
    # index_ref: u8[L * NB, bs * 68]
    from jax.experimental.pallas import triton as pltriton

    del pool_in, index_in  # aliased to pool_ref / index_ref
    i = pl.program_id(0)
    rows = pl.ds(i * ROWS, ROWS)
    live = i * ROWS + jnp.arange(ROWS) < n
    blk = pltriton.load(blk_ref.at[rows], mask=live, other=-1)
    sl = pltriton.load(slot_ref.at[rows], mask=live, other=0)
    ok = live & (blk >= 0) & (blk < nb) & (sl >= 0) & (sl < bs)
    prow = jnp.where(ok, layer * nb + blk, 0)  # i32[ROWS] pool row (block of the layer)

    # entry: FP8 tiles with UE8M0 scales, then the rope dims' raw bytes
    xrows = pl.ds(x_off + i * ROWS, ROWS)
    x = pltriton.load(x_ref.at[xrows], mask=ok[:, None, None], other=0).astype(jnp.float32)  # [R, 8, 64]
    byte, (q,) = ue8m0_tile_codes(x)  # [R, 8], [R, 8, 64]
    tile = jnp.arange(8)[None, :, None]
    col = sl[:, None, None] * DATA + tile * 64 + jnp.arange(64)[None, None, :]  # [R, 8, 64]
    row3 = jnp.broadcast_to(prow[:, None, None], col.shape)
    pltriton.store(pool_ref.at[row3, col], q, mask=ok[:, None, None] & (tile < NOPE_TILES))
    raw = lax.bitcast_convert_type(pltriton.load(x_ref.at[xrows, jnp.int32(7)], mask=ok[:, None], other=0),
                                   jnp.uint16)  # [R, 64] rope dims
    rcol = sl[:, None] * DATA + NOPE_TILES * 64 + 2 * jnp.arange(64)[None, :]
    prow2 = jnp.broadcast_to(prow[:, None], rcol.shape)
    pltriton.store(pool_ref.at[prow2, rcol], (raw & 0xFF).astype(jnp.uint8), mask=ok[:, None])
    pltriton.store(pool_ref.at[prow2, rcol + 1], (raw >> 8).astype(jnp.uint8), mask=ok[:, None])
    scol = bs * DATA + sl[:, None] * 8 + jnp.arange(8)[None, :]  # 7 scale bytes + a zero pad
    tile2 = jnp.arange(8)[None, :]
    pltriton.store(pool_ref.at[jnp.broadcast_to(prow[:, None], scol.shape), scol],
                   jnp.where(tile2 < NOPE_TILES, byte, jnp.uint8(0)), mask=ok[:, None])

    if with_index:  # MXFP4 key: 4 groups of 32 = 16 even/odd pairs
        ev = pltriton.load(xi_e_ref.at[rows], mask=ok[:, None, None], other=0).astype(jnp.float32)  # [R, 4, 16]
        od = pltriton.load(xi_o_ref.at[rows], mask=ok[:, None, None], other=0).astype(jnp.float32)
        packed, kbyte = mxfp4_pairs(ev, od)  # [R, 4, 16], [R, 4]
        g = jnp.arange(4)[None, :, None]
        kcol = sl[:, None, None] * CODES + g * 16 + jnp.arange(16)[None, None, :]  # [R, 4, 16]
        pltriton.store(index_ref.at[jnp.broadcast_to(prow[:, None, None], kcol.shape), kcol], packed,
                       mask=ok[:, None, None])
        kscol = bs * CODES + sl[:, None] * 4 + jnp.arange(4)[None, :]
        pltriton.store(index_ref.at[jnp.broadcast_to(prow[:, None], kscol.shape), kscol], kbyte, mask=ok[:, None])


@functools.partial(jax.jit, static_argnames=("layer", "interpret"), donate_argnames=("pool", "index_pool"))
def flush_write_official(pool, layer: int, x, block, slot, *, index_pool=None, xi=None, interpret: bool = False):
    """The kernel; same contract and bytes as ``hybrid.flush.ref_flush_write(storage="official")``.
    Returns the new pool, or ``(pool, index_pool)`` for CSA."""
    from jax.experimental.pallas import triton as pltriton

    L, nb, w = pool.shape
    bs = w // ENTRY
    n = x.shape[0]
    x, x_row = as_stack(x)  # x: a hybrid.Stacked row, read in place
    with_index = index_pool is not None
    if not with_index:  # a 1-row stand-in keeps one kernel signature
        index_pool = jnp.zeros((1, 1, bs * KEY), jnp.uint8)
        xi = jnp.zeros((1, 128), jnp.bfloat16)
    ni = xi.shape[0]
    xi4 = xi.reshape(ni, 4, 16, 2)
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, nb=nb, bs=bs, layer=layer, with_index=with_index, x_off=x_row * n),
        out_shape=(jax.ShapeDtypeStruct((L * nb, w), jnp.uint8),
                   jax.ShapeDtypeStruct((index_pool.shape[0] * index_pool.shape[1], index_pool.shape[2]), jnp.uint8)),
        grid=(pl.cdiv(n, ROWS),),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="jaxkv_flush_write",
    )(x.reshape(-1, 8, 64), xi4[..., 0], xi4[..., 1], block, slot, pool.reshape(L * nb, w),
      index_pool.reshape(-1, index_pool.shape[2]))
    pool = outs[0].reshape(L, nb, w)
    if not with_index:
        return pool
    return pool, outs[1].reshape(index_pool.shape)
