"""Dequant-gather: compressed entries picked by (block, slot) from a ``ds_mla`` paged pool,
dequantized to BF16, as a Pallas kernel.

Serves CSA's top-k entries and HCA's all-entries reads (``hybrid.gather_entries(...,
impl="pallas")``): each item's 448 FP8 dims times its UE8M0 tile scale, and its 64 BF16
RoPE dims as stored; K = V, so one gather serves both. Official storage family only.
Each program reads ``ROWS`` items with gather loads (integer-array indexers of the pool
viewed as ``[layers * blocks, block bytes]``) and writes their rows contiguously.
Lowering: Triton (``pltriton.CompilerParams``).

    pool: u8[L, NB, bs * 584]
    block, slot: i32[M]   item m's block and entry slot; block outside [0, NB) -> zeros
    -> bf16[M, 512]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats._common import e8m0_to_float
from jaxkv.kernels.tuning import DEQUANT_GATHER_ROWS as ROWS, DEQUANT_GATHER_WARPS as NUM_WARPS

ENTRY, DATA, NOPE_TILES = 584, 576, 7


def ref_dequant_gather(pool, layer: int, block, slot):
    """The jnp reference (``hybrid.storage.read_items`` + the official entry decoder)."""
    from jaxkv.hybrid.storage import STORAGES, read_items

    codec = STORAGES["official"].entry
    nb = pool.shape[1]
    ok = (block >= 0) & (block < nb)
    items = codec.decode(read_items(pool, layer, block, slot, codec.segments))
    return jnp.where(ok[:, None], items, 0).astype(jnp.bfloat16)


def _kernel(blk_ref, slot_ref, pool_ref, out_ref, *, m, nb, bs, layer):
    # blk_ref, slot_ref: i32[M]; pool_ref: u8[L * NB, bs * 584]; out_ref: bf16[M, 8, 64]
    from jax.experimental.pallas import triton as pltriton

    i = pl.program_id(0)
    rows = pl.ds(i * ROWS, ROWS)
    live = i * ROWS + jnp.arange(ROWS) < m
    blk = pltriton.load(blk_ref.at[rows], mask=live, other=-1)
    sl = jnp.clip(pltriton.load(slot_ref.at[rows], mask=live, other=0), 0, bs - 1)
    ok = live & (blk >= 0) & (blk < nb)
    prow = jnp.where(ok, layer * nb + blk, 0)

    tile = jnp.arange(8)[None, :, None]
    col = sl[:, None, None] * DATA + jnp.minimum(tile, NOPE_TILES - 1) * 64 + jnp.arange(64)[None, None, :]
    row3 = jnp.broadcast_to(prow[:, None, None], col.shape)
    q = pltriton.load(pool_ref.at[row3, col], mask=ok[:, None, None], other=0)  # u8[R, 8, 64]
    scol = bs * DATA + sl[:, None] * 8 + jnp.minimum(jnp.arange(8)[None, :], NOPE_TILES - 1)
    byte = pltriton.load(pool_ref.at[jnp.broadcast_to(prow[:, None], scol.shape), scol], mask=ok[:, None], other=127)
    deq = lax.bitcast_convert_type(q, jnp.float8_e4m3fn).astype(jnp.float32) * e8m0_to_float(byte)[..., None]
    rcol = sl[:, None] * DATA + NOPE_TILES * 64 + 2 * jnp.arange(64)[None, :]
    prow2 = jnp.broadcast_to(prow[:, None], rcol.shape)
    lo = pltriton.load(pool_ref.at[prow2, rcol], mask=ok[:, None], other=0).astype(jnp.uint16)
    hi = pltriton.load(pool_ref.at[prow2, rcol + 1], mask=ok[:, None], other=0).astype(jnp.uint16)
    rope = lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16)  # [R, 64]
    out = jnp.where(tile < NOPE_TILES, deq.astype(jnp.bfloat16), rope[:, None, :])
    out = jnp.where(ok[:, None, None], out, jnp.zeros_like(out))
    pltriton.store(out_ref.at[rows], out, mask=live[:, None, None])


@functools.partial(jax.jit, static_argnames=("layer", "interpret"))
def dequant_gather(pool, layer: int, block, slot, *, interpret: bool = False):
    """The kernel: bf16[M, 512], bytes-exact with ``ref_dequant_gather``."""
    from jax.experimental.pallas import triton as pltriton

    L, nb, w = pool.shape
    if w % ENTRY:
        raise ValueError(f"pool: expected u8[layers, blocks, block_size * {ENTRY}], got {pool.dtype}{list(pool.shape)}")
    m = block.shape[0]
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, nb=nb, bs=w // ENTRY, layer=layer),
        out_shape=jax.ShapeDtypeStruct((m, 8, 64), jnp.bfloat16),
        grid=(pl.cdiv(m, ROWS),),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="jaxkv_dequant_gather",
    )(block.astype(jnp.int32), slot.astype(jnp.int32), pool.reshape(L * nb, w))
    return out.reshape(m, 512)
