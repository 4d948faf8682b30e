"""CSA / HCA flush-write: finished entries -> FP8 entry bytes (and FP4 indexer keys)
scattered into one layer of a paged pool, in place, in either storage family; the decode
write of each request's token into its SWA ring; a step's own tokens encoded into a fresh
pool (what the pool attention reads them from); and the tail-state moves after a flush.

The byte layout is ``jaxkv.formats.storage``'s (passed to the build as ``-D`` flags): the
official family stores per entry 448 FP8 dims with one UE8M0 scale per 64-element tile and
64 BF16 RoPE dims in a segment-major ``ds_mla`` block, and per key MXFP4 nibbles and UE8M0
bytes; the per_entry family one float32 scale per entry and NVFP4 keys. The bytes are the
formats' (``hybrid.flush.ref_flush_write``).

The kernels are ``jaxkv/cuda/flush_write.cu`` (one warp per entry; the encoders in
``jaxkv/cuda/write_entry.cuh``, shared with the fused decode compressor) reached through
``jax.ffi``, not Pallas: a flush scatters a few hundred bytes per entry to data-dependent
pool rows, and Mosaic GPU on Hopper has no row scatter (``tests/kernels/test_mosaic_limits.py``;
docs/kernels/cache_writes.md). Validation is the caller's (``hybrid.flush``); these take
checked arguments.

    pool: u8[L, NB, bs * E]        index_pool: u8[L, NB, bs * K] (CSA) or None   (E, K: storage.entry_bytes, key_bytes)
    x: bf16[N, 512]                xi: bf16[N, 128] (CSA) or None
    block, slot: i32[N]            rows outside [0, NB) are not written
    tails: f32[R, streams, 3, width]   tail_slot: i32[B]  (outside [0, R): skipped)
    ring: u8[L, R, window * E]     error: u32[R + 1]
    write_slot, start, num_tokens: i32[B]   (``hybrid.Step``)
    encode_rows: x bf16[..., 512] (N rows) -> u8[ceil(N / bs), bs * E]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cuda import STORAGE_CODES, register_ffi_targets
from jaxkv.errors import Fault
from jaxkv.formats.storage import STORAGES, entry_bytes, pack_items, storage_name
from jaxkv.stacked import as_flat, row


def flush_write(pool, layer: int, x, block, slot, *, storage: str, index_pool=None, xi=None):
    """The kernel, in place on ``pool`` / ``index_pool``. Returns the new pool, or
    ``(pool, index_pool)`` for CSA. Needs a GPU and nvcc (the first use builds ``cuda/``)."""
    storage = storage_name(storage)
    register_ffi_targets()
    attrs = dict(
        layer=np.int32(layer),
        block_size=np.int32(pool.shape[-1] // entry_bytes(storage)),
        storage=np.int32(STORAGE_CODES[storage]),
    )
    out = jax.ShapeDtypeStruct(pool.shape, pool.dtype)
    if index_pool is None:
        return jax.ffi.ffi_call("jaxkv_flush_write_hca", out, input_output_aliases={0: 0})(
            pool, x, block, slot, **attrs
        )
    outs = (out, jax.ShapeDtypeStruct(index_pool.shape, index_pool.dtype))
    return jax.ffi.ffi_call("jaxkv_flush_write_csa", outs, input_output_aliases={0: 0, 1: 1})(
        pool, index_pool, x, xi, block, slot, **attrs
    )


def window_write(ring, layer: int, x, write_slot, start, num_tokens, error, *, storage: str):
    """A decode step's tokens into layer ``layer``'s SWA rings, in place: request ``b``'s
    token ``x[b]`` (bf16[B, 512], or a ``jaxkv.stacked.Stacked`` row, read in place) goes to
    item ``start[b] % window`` of ring ``write_slot[b]`` (one ring per request slot) where
    ``num_tokens[b] > 0``; a token holding a NaN or Inf is not written and sets
    ``Fault.NONFINITE_KV`` in its request's error word. Returns ``(ring, error)``. Needs a
    GPU and nvcc."""
    storage = storage_name(storage)
    register_ffi_targets()
    flat, offset = as_flat(x)
    outs = (jax.ShapeDtypeStruct(ring.shape, ring.dtype), jax.ShapeDtypeStruct(error.shape, error.dtype))
    return jax.ffi.ffi_call("jaxkv_window_write", outs, input_output_aliases={0: 0, 1: 1})(
        ring,
        error,
        flat,
        write_slot,
        start,
        num_tokens,
        layer=np.int32(layer),
        window=np.int32(ring.shape[-1] // entry_bytes(storage)),
        storage=np.int32(STORAGE_CODES[storage]),
        fault=np.int32(int(Fault.NONFINITE_KV)),
        x_offset=np.int64(offset),
    )


def _check_rows(x, block_size: int):
    if x.ndim < 1 or x.shape[-1] != 512 or x.dtype != jnp.bfloat16 or not math.prod(x.shape[:-1]):
        raise ValueError(f"x: expected bf16[..., 512] with at least one row, got {x.dtype}{list(x.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size: expected at least 1, got {block_size}")


def ref_encode_rows(x, block_size: int, *, storage: str):
    """The jnp reference: the rows of ``x`` (bf16[..., 512], or a ``Stacked`` row) encoded
    in the storage's entry format, row i at item ``i % block_size`` of block ``i //
    block_size`` (``formats.storage.pack_items``)."""
    codec = STORAGES[storage_name(storage)].entry
    _check_rows(x, block_size)
    return pack_items(codec.encode(row(x).reshape(-1, 512)), block_size, codec.segments)


def encode_rows(x, block_size: int, *, storage: str):
    """The kernel: ``ref_encode_rows``'s bytes in one launch (a warp a row); a ``Stacked``
    row is read in place. Needs a GPU and nvcc."""
    storage = storage_name(storage)
    _check_rows(x, block_size)
    register_ffi_targets()
    n = math.prod(x.shape[:-1])
    flat, offset = as_flat(x)
    out = jax.ShapeDtypeStruct((-(-n // block_size), block_size * entry_bytes(storage)), jnp.uint8)
    return jax.ffi.ffi_call("jaxkv_encode_rows", out)(
        flat,
        block_size=np.int32(block_size),
        storage=np.int32(STORAGE_CODES[storage]),
        rows=np.int64(n),
        x_offset=np.int64(offset),
    )


def tail_state(tails, tail_slot):
    """After a flush, in place: CSA tails (3 streams) rotate (previous-b <- current-b, a and b
    emptied), HCA tails (1 stream) are emptied, for each listed request."""
    register_ffi_targets()
    name = "jaxkv_csa_rotate_state" if tails.shape[1] == 3 else "jaxkv_hca_reset_state"
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(tails.shape, tails.dtype), input_output_aliases={0: 0})(
        tails, tail_slot
    )


__all__ = ["encode_rows", "flush_write", "ref_encode_rows", "tail_state", "window_write"]
