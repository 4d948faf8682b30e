"""Dequant-gather: compressed entries picked by (block, slot) from a paged pool,
dequantized to BF16, as a Pallas kernel, in either storage family.

Serves CSA's top-k entries, HCA's all-entries reads and the SWA window
(``hybrid.gather_entries`` / ``all_entries`` / ``window_keys``, ``impl="pallas"``): each
item's 448 FP8 dims times its scale (UE8M0 per 64-dim tile in the official ``ds_mla``
block, one float32 per entry in the per_entry family's), and its 64 BF16 RoPE dims as stored;
K = V, so one gather serves both. Each program reads ``ROWS`` items (``tuning``) with gather loads
(integer-array indexers of the pool viewed as ``[layers * blocks, block bytes]``) and
writes their rows contiguously. Lowering: Triton (``pltriton.CompilerParams``).

    pool: u8[L, NB, bs * E]   (E: ``jaxkv.formats.storage.entry_bytes(storage)``)
    block, slot: i32[M]   item m's block and entry slot; block outside [0, NB) -> zeros
    -> bf16[M, 512]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.formats.numerics import e8m0_to_float
from jaxkv.formats.storage import HEAD_DIM, NOPE, NOPE_TILES, STORAGES, entry_bytes, read_items, segment_offsets, storage_name
from jaxkv.kernels.tuning import launch


def ref_dequant_gather(pool, layer: int, block, slot, storage: str = "official"):
    """The jnp reference (``formats.storage.read_items`` + the storage's entry decoder)."""
    codec = STORAGES[storage_name(storage)].entry
    nb = pool.shape[1]
    ok = (block >= 0) & (block < nb)
    items = codec.decode(read_items(pool, layer, block, slot, codec.segments))
    return jnp.where(ok[:, None], items, 0).astype(jnp.bfloat16)


def _kernel(blk_ref, slot_ref, pool_ref, out_ref, *, m, nb, bs, layer, storage, ROWS):
    # blk_ref, slot_ref: i32[M]; pool_ref: u8[L * NB, bs * E]; out_ref: bf16[M, 8, 64]
    from jax.experimental.pallas import triton as pltriton

    i = pl.program_id(0)
    rows = pl.ds(i * ROWS, ROWS)
    live = i * ROWS + jnp.arange(ROWS) < m
    blk = pltriton.load(blk_ref.at[rows], mask=live, other=-1)
    sl = jnp.clip(pltriton.load(slot_ref.at[rows], mask=live, other=0), 0, bs - 1)
    ok = live & (blk >= 0) & (blk < nb)
    prow = jnp.where(ok, layer * nb + blk, 0)

    def load(col, other):  # u8 bytes at ``col`` of each item's pool row
        row = jnp.broadcast_to(prow.reshape((ROWS,) + (1,) * (col.ndim - 1)), col.shape)
        return pltriton.load(pool_ref.at[row, col], mask=ok.reshape(row.shape[:1] + (1,) * (col.ndim - 1)),
                             other=other)

    tile = jnp.arange(8)[None, :, None]
    lane = jnp.arange(64)[None, None, :]
    nope = jnp.minimum(tile, NOPE_TILES - 1) * 64 + lane
    seg = STORAGES[storage].entry.segments
    off = segment_offsets(seg, bs)
    if storage == "official":  # ds_mla: [bs x (448 codes + 128 rope)] [bs x (7 UE8M0 + pad)]
        q = load(off[0] + sl[:, None, None] * seg[0] + nope, 0)  # u8[R, 8, 64]
        byte = load(off[1] + sl[:, None] * seg[1] + jnp.minimum(jnp.arange(8)[None, :], NOPE_TILES - 1), 127)
        scale = e8m0_to_float(byte)[..., None]  # [R, 8, 1]
        rope_col = off[0] + sl[:, None] * seg[0] + NOPE
    else:  # per_entry: [bs x 448 codes] [bs x 128 rope] [bs x f32 scale]
        q = load(off[0] + sl[:, None, None] * seg[0] + nope, 0)
        b4 = load(off[2] + sl[:, None] * seg[2] + jnp.arange(4)[None, :], 0).astype(jnp.uint32)  # [R, 4]
        bits = jnp.sum(b4 << (8 * jnp.arange(4, dtype=jnp.uint32))[None, :], axis=1)
        scale = lax.bitcast_convert_type(bits, jnp.float32)[:, None, None]
        rope_col = off[1] + sl[:, None] * seg[1]
    deq = lax.bitcast_convert_type(q, jnp.float8_e4m3fn).astype(jnp.float32) * scale
    rcol = rope_col + 2 * jnp.arange(64)[None, :]
    lo = load(rcol, 0).astype(jnp.uint16)
    hi = load(rcol + 1, 0).astype(jnp.uint16)
    rope = lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16)  # [R, 64]
    out = jnp.where(tile < NOPE_TILES, deq.astype(jnp.bfloat16), rope[:, None, :])
    out = jnp.where(ok[:, None, None], out, jnp.zeros_like(out))
    pltriton.store(out_ref.at[rows], out, mask=live[:, None, None])


def dequant_gather(pool, layer: int, block, slot, *, storage: str = "official", interpret: bool = False):
    """The kernel: bf16[M, 512], bytes-exact with ``ref_dequant_gather``."""
    return _dequant_gather(pool, layer, block, slot, storage=storage_name(storage), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("layer", "storage", "interpret"))
def _dequant_gather(pool, layer: int, block, slot, *, storage: str, interpret: bool):
    from jax.experimental.pallas import triton as pltriton

    L, nb, w = pool.shape
    E = entry_bytes(storage)
    if w % E:
        raise ValueError(f"pool: expected u8[layers, blocks, block_size * {E}] ({storage} storage), got "
                         f"{pool.dtype}{list(pool.shape)}")
    m = block.shape[0]
    tune = launch("dequant_gather")
    ROWS = tune["rows"]
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, nb=nb, bs=w // E, layer=layer, storage=storage, ROWS=ROWS),
        out_shape=jax.ShapeDtypeStruct((m, 8, 64), jnp.bfloat16),
        grid=(pl.cdiv(m, ROWS),),
        compiler_params=pltriton.CompilerParams(num_warps=tune["warps"], num_stages=1),
        interpret=interpret,
        name="jaxkv_dequant_gather",
    )(block.astype(jnp.int32), slot.astype(jnp.int32), pool.reshape(L * nb, w))
    return out.reshape(m, HEAD_DIM)
