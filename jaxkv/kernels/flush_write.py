"""CSA / HCA flush-write as a Pallas kernel: finished entries -> FP8 entry bytes (and FP4
indexer keys) scattered into one layer of a paged pool, in place, in either storage family.

``hybrid.storage``: the official family stores per entry 448 FP8 dims with one UE8M0
scale per 64-element tile and 64 BF16 RoPE dims, 584 B in a segment-major ``ds_mla``
block, and per key 64 B of E2M1 nibbles and 4 UE8M0 bytes (MXFP4); the seed family one
float32 scale per entry (580 B) and NVFP4 keys (8 E4M3 group scales and a float32 global
scale, 76 B). The math is the formats' (same helpers, same bytes as
``hybrid.flush.ref_flush_write``): dividing by a power-of-two scale is a multiply by its
exact inverse, by a float32 scale correctly rounded (``fp4_pack.Division``: on a GPU the
scale's reciprocal once and one fused correction per element); the keys use
``fp4_pack.mxfp4_pairs`` / ``nvfp4_pairs``. Each program handles ``tuning.FLUSH_WRITE_ROWS[storage]`` entries
and writes them with scatter stores (integer-array indexers of the pool viewed as
``[layers * blocks, block bytes]``). Lowering: Triton (``pltriton.CompilerParams``).

    pool: u8[L, NB, bs * E]        index_pool: u8[L, NB, bs * K] (CSA) or None   (E, K: ENTRY, KEY)
    x: bf16[N, 512] (or a ``hybrid.Stacked`` row of bf16[n, N, 512])   xi: bf16[N, 128] (CSA) or None
    block, slot: i32[N]            rows outside [0, NB) are not written
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats._common import E8M0_NAN, FP8_MAX, ue8m0_scale
from jaxkv.formats.fp8 import UE8M0_MIN_SCALE
from jaxkv.hybrid.stacked import as_stack
from jaxkv.kernels.fp4_pack import (EXACT, division, e4m3_bytes, is_nan_bits, mxfp4_pairs, nan_amax, nvfp4_pairs,
                                    pow2_inverse)
from jaxkv.kernels.tuning import FLUSH_WRITE_ROWS, FLUSH_WRITE_WARPS

NOPE, DATA, NOPE_TILES, CODES = 448, 576, 7, 64  # FP8 dims; bytes of codes + rope; FP8 tiles; FP4 code bytes
ENTRY = {"official": 584, "seed": 580}  # bytes per entry
KEY = {"official": 68, "seed": 76}  # bytes per 128-dim indexer key


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
    """FP8 E4M3 codes with one float32 scale per entry (the seed storage family,
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


def _kernel(x_ref, xi_ref, blk_ref, slot_ref, pool_in, index_in, pool_ref, index_ref, *, n, nb, bs, layer,
            with_index, x_off, storage, div, R):
    # x_ref: bf16[n * N, 8, 64] (tiles; tile 7 = the rope dims; entry e at row x_off + e); xi_ref: u32[N, 4, 16]
    # the key as 4 groups of 16 (even, odd) bf16 pairs; blk_ref, slot_ref: i32[N]; pool_ref: u8[L * NB, bs * E];
    # index_ref: u8[L * NB, bs * K]
    from jax.experimental.pallas import triton as pltriton

    del pool_in, index_in  # aliased to pool_ref / index_ref
    official = storage == "official"
    i = pl.program_id(0)
    rows = pl.ds(i * R, R)
    live = i * R + jnp.arange(R) < n
    # Every load is masked by ``live`` alone (not by the block table): all are in flight at
    # once, and the kernel waits for DRAM once, not twice.
    xrows = pl.ds(x_off + i * R, R)
    x = pltriton.load(x_ref.at[xrows], mask=live[:, None, None], other=0).astype(jnp.float32)  # [R, 8, 64]
    raw = lax.bitcast_convert_type(pltriton.load(x_ref.at[xrows, jnp.int32(7)], mask=live[:, None], other=0),
                                   jnp.uint16)  # [R, 64] rope dims
    if with_index:  # a 32-bit word holds an (even, odd) pair of bf16: low half even, high half odd
        pairs = pltriton.load(xi_ref.at[rows], mask=live[:, None, None], other=0)  # u32[R, 4, 16]
        ev = lax.bitcast_convert_type(pairs << 16, jnp.float32)  # exact: bf16 is f32's high half
        od = lax.bitcast_convert_type(pairs & jnp.uint32(0xFFFF0000), jnp.float32)
    blk = pltriton.load(blk_ref.at[rows], mask=live, other=-1)
    sl = pltriton.load(slot_ref.at[rows], mask=live, other=0)
    ok = live & (blk >= 0) & (blk < nb) & (sl >= 0) & (sl < bs)
    prow = jnp.where(ok, layer * nb + blk, 0)  # i32[R] pool row (block of the layer)

    def put(ref, col, val, mask):  # col: [R, ...] byte columns of each row's pool row
        pltriton.store(ref.at[jnp.broadcast_to(prow.reshape((R,) + (1,) * (col.ndim - 1)), col.shape), col], val,
                       mask=mask)

    # entry: FP8 codes (UE8M0 tiles or one f32 scale), the rope dims' raw bytes, the scales
    tile = jnp.arange(8)[None, :, None]
    lane = jnp.arange(64)[None, None, :]
    ok2, ok3 = ok[:, None], ok[:, None, None]
    if official:  # ds_mla: [bs x (448 codes + 128 rope)] [bs x (7 scales + pad)]
        byte, (q,) = ue8m0_tile_codes(x, div=div)  # [R, 8], [R, 8, 64]
        code_col, rope_col = sl[:, None, None] * DATA, sl[:, None] * DATA + NOPE_TILES * 64
        t2 = jnp.arange(8)[None, :]
        put(pool_ref, bs * DATA + sl[:, None] * 8 + t2, jnp.where(t2 < NOPE_TILES, byte, jnp.uint8(0)), ok2)
    else:  # seed: [bs x 448 codes] [bs x 128 rope] [bs x f32 scale]
        scale, (q,) = per_entry_codes(x, div=div)
        code_col, rope_col = sl[:, None, None] * NOPE, bs * NOPE + sl[:, None] * 128
        put(pool_ref, bs * DATA + sl[:, None] * 4 + jnp.arange(4)[None, :], f32_bytes(scale), ok2)
    put(pool_ref, code_col + tile * 64 + lane, q, ok3 & (tile < NOPE_TILES))
    rope = jnp.stack([(raw & 0xFF).astype(jnp.uint8), (raw >> 8).astype(jnp.uint8)], axis=-1)  # [R, 64, 2]
    put(pool_ref, rope_col + jnp.arange(128)[None, :], rope.reshape(R, 128), ok2)  # one contiguous run

    if with_index:  # FP4 key: 64 B of nibbles (element pair 16 g + k), then the scales
        kcol = sl[:, None, None] * CODES + jnp.arange(4)[None, :, None] * 16 + jnp.arange(16)[None, None, :]
        if official:  # MXFP4: 4 groups of 32 = 16 pairs, 4 UE8M0 bytes
            packed, kbyte = mxfp4_pairs(ev, od, div=div)  # [R, 4, 16], [R, 4]
            put(index_ref, bs * CODES + sl[:, None] * 4 + jnp.arange(4)[None, :], kbyte, ok2)
        else:  # NVFP4: 8 groups of 16 = 8 pairs, 8 E4M3 bytes, the f32 global scale
            packed, kbyte, g = nvfp4_pairs(ev.reshape(R, 8, 8), od.reshape(R, 8, 8), div=div)
            packed = packed.reshape(R, 4, 16)
            put(index_ref, bs * CODES + sl[:, None] * 8 + jnp.arange(8)[None, :], kbyte, ok2)
            put(index_ref, bs * (CODES + 8) + sl[:, None] * 4 + jnp.arange(4)[None, :], f32_bytes(g), ok2)
        put(index_ref, kcol, packed, ok3)


@functools.partial(jax.jit, static_argnames=("layer", "storage", "interpret"), donate_argnames=("pool", "index_pool"))
def flush_write(pool, layer: int, x, block, slot, *, storage: str, index_pool=None, xi=None, interpret: bool = False):
    """The kernel; same contract and bytes as ``hybrid.flush.ref_flush_write`` for either
    storage family. Returns the new pool, or ``(pool, index_pool)`` for CSA."""
    from jax.experimental.pallas import triton as pltriton

    L, nb, w = pool.shape
    bs = w // ENTRY[storage]
    n = x.shape[0]
    rows = FLUSH_WRITE_ROWS[storage]
    x, x_row = as_stack(x)  # x: a hybrid.Stacked row, read in place
    with_index = index_pool is not None
    if not with_index:  # a 1-row stand-in keeps one kernel signature
        index_pool = jnp.zeros((1, 1, bs * KEY[storage]), jnp.uint8)
        xi = jnp.zeros((1, 128), jnp.bfloat16)
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, nb=nb, bs=bs, layer=layer, with_index=with_index, x_off=x_row * n,
                          storage=storage, div=division(interpret), R=rows),
        out_shape=(jax.ShapeDtypeStruct((L * nb, w), jnp.uint8),
                   jax.ShapeDtypeStruct((index_pool.shape[0] * index_pool.shape[1], index_pool.shape[2]), jnp.uint8)),
        grid=(pl.cdiv(n, rows),),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltriton.CompilerParams(num_warps=FLUSH_WRITE_WARPS[storage], num_stages=1),
        interpret=interpret,
        name="jaxkv_flush_write",
    )(x.reshape(-1, 8, 64), lax.bitcast_convert_type(xi.reshape(-1, 64, 2), jnp.uint32).reshape(-1, 4, 16), block, slot, pool.reshape(L * nb, w),
      index_pool.reshape(-1, index_pool.shape[2]))
    pool = outs[0].reshape(L, nb, w)
    if not with_index:
        return pool
    return pool, outs[1].reshape(index_pool.shape)
