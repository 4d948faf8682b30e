"""Dequant-gather: compressed entries picked by (block, slot) from a paged pool,
dequantized to BF16 by one CUDA kernel, in either storage family.

Serves CSA's top-k entries, HCA's all-entries reads and the SWA window
(``hybrid.gather_entries`` / ``all_entries`` / ``window_keys``, ``impl="cuda"``): each
item's 448 FP8 dims times its scale (UE8M0 per 64-dim tile in the official ``ds_mla``
block, one float32 per entry in the per_entry family's), and its 64 BF16 RoPE dims as stored;
K = V, so one gather serves both.

The kernel is ``jaxkv/cuda/dequant_gather.cu`` (one warp per item) reached through ``jax.ffi``,
not Pallas. Its reads are rows of a few hundred bytes at data-dependent addresses, plus a
scale byte each. Mosaic GPU on Hopper has no row gather (TMA's gather4 is Blackwell's), and
its register loads take no strided slices (the scale byte per 64 codes). The minimal
kernels that show both are in ``tests/kernels/test_mosaic_limits.py``; the decisions and
their measurements: docs/kernels/dequant_gather.md.

    pool: u8[L, NB, bs * E]   (E: ``jaxkv.formats.storage.entry_bytes(storage)``)
    block, slot: i32[M]   item m's block and entry slot; block outside [0, NB) -> zeros, slot
                          clamped into the block (docs/reliability.md: the rules, what is trusted)
    -> bf16[M, 512]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cuda import STORAGE_CODES, register_ffi_targets
from jaxkv.formats.storage import HEAD_DIM, STORAGES, entry_bytes, read_items, storage_name


def ref_dequant_gather(pool, layer: int, block, slot, storage: str = "official"):
    """The jnp reference (``formats.storage.read_items`` + the storage's entry decoder)."""
    codec = STORAGES[storage_name(storage)].entry
    nb = pool.shape[1]
    ok = (block >= 0) & (block < nb)
    items = codec.decode(read_items(pool, layer, block, slot, codec.segments))
    return jnp.where(ok[:, None], items, 0).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("layer", "storage"))
def dequant_gather(pool, layer: int, block, slot, *, storage: str = "official"):
    """The kernel (``jaxkv/cuda/dequant_gather.cu`` through ``jax.ffi``; built with nvcc on first
    use): bf16[M, 512], bytes-exact with ``ref_dequant_gather``."""
    storage = storage_name(storage)
    L, nb, w = pool.shape
    E = entry_bytes(storage)
    if pool.dtype != jnp.uint8 or w % E:
        raise ValueError(
            f"pool: expected u8[layers, blocks, block_size * {E}] ({storage} storage), got "
            f"{pool.dtype}{list(pool.shape)}"
        )
    if not 0 <= layer < L:
        raise ValueError(f"layer: expected 0 <= layer < {L}, got {layer}")
    if block.ndim != 1 or slot.shape != block.shape:
        raise ValueError(f"block, slot: expected two int[M] alike, got {list(block.shape)} and {list(slot.shape)}")
    register_ffi_targets()
    return jax.ffi.ffi_call("jaxkv_dequant_gather", jax.ShapeDtypeStruct((block.shape[0], HEAD_DIM), jnp.bfloat16))(
        pool,
        block.astype(jnp.int32),
        slot.astype(jnp.int32),
        layer=np.int32(layer),
        block_size=np.int32(w // E),
        storage=np.int32(STORAGE_CODES[storage]),
    )


__all__ = ["dequant_gather", "ref_dequant_gather"]
