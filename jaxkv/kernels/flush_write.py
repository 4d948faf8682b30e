"""CSA / HCA flush-write as a Pallas kernel: finished entries -> FP8 entry bytes (and FP4
indexer keys) scattered into one layer of a paged pool, in place, in either storage family.

The byte layout is ``jaxkv.formats.storage``'s (the kernel reads the segment sizes from
there): the official family stores per entry 448 FP8 dims with one UE8M0 scale per
64-element tile and 64 BF16 RoPE dims in a segment-major ``ds_mla`` block, and per key
MXFP4 nibbles and UE8M0 bytes; the per_entry family one float32 scale per entry and NVFP4
keys. The math is the formats' (``kernels.codes``; same bytes as
``hybrid.flush.ref_flush_write``): dividing by a power-of-two scale is a multiply by its
exact inverse, by a float32 scale correctly rounded (``kernels.division``). Each program
handles ``tuning``'s rows for the family and writes them with scatter stores
(integer-array indexers of the pool viewed as ``[layers * blocks, block bytes]``).
Lowering: Triton (``pltriton.CompilerParams``).

    pool: u8[L, NB, bs * E]        index_pool: u8[L, NB, bs * K] (CSA) or None   (E, K: storage.entry_bytes, key_bytes)
    x: bf16[N, 512] (or a ``jaxkv.stacked.Stacked`` row of bf16[n, N, 512])   xi: bf16[N, 128] (CSA) or None
    block, slot: i32[N]            rows outside [0, NB) are not written
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats.storage import (INDEX_DIM, KEY_CODES, NOPE, NOPE_TILES, STORAGES, entry_bytes, key_bytes,
                                   segment_offsets, storage_name)
from jaxkv.kernels.codes import f32_bytes, mxfp4_pairs, nvfp4_pairs, per_entry_codes, ue8m0_tile_codes
from jaxkv.kernels.division import division
from jaxkv.kernels.tuning import launch
from jaxkv.stacked import as_stack


def _kernel(x_ref, xi_ref, blk_ref, slot_ref, pool_in, index_in, pool_ref, index_ref, *, n, nb, bs, layer,
            with_index, x_off, storage, div, R):
    # x_ref: bf16[n * N, 8, 64] (tiles; tile 7 = the rope dims; entry e at row x_off + e); xi_ref: u32[N, 4, 16]
    # the key as 4 groups of 16 (even, odd) bf16 pairs; blk_ref, slot_ref: i32[N]; pool_ref: u8[L * NB, bs * E];
    # index_ref: u8[L * NB, bs * K]
    from jax.experimental.pallas import triton as pltriton

    del pool_in, index_in  # aliased to pool_ref / index_ref
    official = storage == "official"
    seg, kseg = STORAGES[storage].entry.segments, STORAGES[storage].index_key(INDEX_DIM).segments
    off, koff = segment_offsets(seg, bs), segment_offsets(kseg, bs)
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
        code_col, rope_col = off[0] + sl[:, None, None] * seg[0], off[0] + sl[:, None] * seg[0] + NOPE
        t2 = jnp.arange(seg[1])[None, :]
        put(pool_ref, off[1] + sl[:, None] * seg[1] + t2, jnp.where(t2 < NOPE_TILES, byte, jnp.uint8(0)), ok2)
    else:  # per_entry: [bs x 448 codes] [bs x 128 rope] [bs x f32 scale]
        scale, (q,) = per_entry_codes(x, div=div)
        code_col, rope_col = off[0] + sl[:, None, None] * seg[0], off[1] + sl[:, None] * seg[1]
        put(pool_ref, off[2] + sl[:, None] * seg[2] + jnp.arange(4)[None, :], f32_bytes(scale), ok2)
    put(pool_ref, code_col + tile * 64 + lane, q, ok3 & (tile < NOPE_TILES))
    rope = jnp.stack([(raw & 0xFF).astype(jnp.uint8), (raw >> 8).astype(jnp.uint8)], axis=-1)  # [R, 64, 2]
    put(pool_ref, rope_col + jnp.arange(128)[None, :], rope.reshape(R, 128), ok2)  # one contiguous run

    if with_index:  # FP4 key: 64 B of nibbles (element pair 16 g + k), then the scales
        kcol = koff[0] + sl[:, None, None] * KEY_CODES + jnp.arange(4)[None, :, None] * 16 + jnp.arange(16)[None, None, :]
        if official:  # MXFP4: 4 groups of 32 = 16 pairs, 4 UE8M0 bytes
            packed, kbyte = mxfp4_pairs(ev, od, div=div)  # [R, 4, 16], [R, 4]
            put(index_ref, koff[1] + sl[:, None] * kseg[1] + jnp.arange(4)[None, :], kbyte, ok2)
        else:  # NVFP4: 8 groups of 16 = 8 pairs, 8 E4M3 bytes, the f32 global scale
            packed, kbyte, g = nvfp4_pairs(ev.reshape(R, 8, 8), od.reshape(R, 8, 8), div=div)
            packed = packed.reshape(R, 4, 16)
            put(index_ref, koff[1] + sl[:, None] * kseg[1] + jnp.arange(8)[None, :], kbyte, ok2)
            put(index_ref, koff[2] + sl[:, None] * kseg[2] + jnp.arange(4)[None, :], f32_bytes(g), ok2)
        put(index_ref, kcol, packed, ok3)


def flush_write(pool, layer: int, x, block, slot, *, storage: str, index_pool=None, xi=None, interpret: bool = False):
    """The kernel; same contract and bytes as ``hybrid.flush.ref_flush_write`` for either
    storage family. Returns the new pool, or ``(pool, index_pool)`` for CSA."""
    return _flush_write(pool, layer, x, block, slot, storage=storage_name(storage), index_pool=index_pool, xi=xi,
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("layer", "storage", "interpret"), donate_argnames=("pool", "index_pool"))
def _flush_write(pool, layer: int, x, block, slot, *, storage: str, index_pool=None, xi=None, interpret: bool = False):
    from jax.experimental.pallas import triton as pltriton

    L, nb, w = pool.shape
    bs = w // entry_bytes(storage)
    n = x.shape[0]
    tune = launch(f"flush_write/{storage}")
    rows = tune["rows"]
    x, x_row = as_stack(x)  # x: a hybrid.Stacked row, read in place
    with_index = index_pool is not None
    if not with_index:  # a 1-row stand-in keeps one kernel signature
        index_pool = jnp.zeros((1, 1, bs * key_bytes(storage)), jnp.uint8)
        xi = jnp.zeros((1, INDEX_DIM), jnp.bfloat16)
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, nb=nb, bs=bs, layer=layer, with_index=with_index, x_off=x_row * n,
                          storage=storage, div=division(interpret), R=rows),
        out_shape=(jax.ShapeDtypeStruct((L * nb, w), jnp.uint8),
                   jax.ShapeDtypeStruct((index_pool.shape[0] * index_pool.shape[1], index_pool.shape[2]), jnp.uint8)),
        grid=(pl.cdiv(n, rows),),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltriton.CompilerParams(num_warps=tune["warps"], num_stages=1),
        interpret=interpret,
        name="jaxkv_flush_write",
    )(x.reshape(-1, 8, 64), lax.bitcast_convert_type(xi.reshape(-1, 64, 2), jnp.uint32).reshape(-1, 4, 16), block, slot, pool.reshape(L * nb, w),
      index_pool.reshape(-1, index_pool.shape[2]))
    pool = outs[0].reshape(L, nb, w)
    if not with_index:
        return pool
    return pool, outs[1].reshape(index_pool.shape)
