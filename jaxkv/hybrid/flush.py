"""The write half of a CSA / HCA flush, and the tail-state update after it.

``flush_write`` quantizes finished entries (RMSNorm and RoPE applied; for CSA also the
rotated indexer keys) in the cache's storage family and scatters them into one layer of a
paged pool through ``(block, slot)``. ``csa_rotate_state`` / ``hca_reset_state`` move a
request's tail on after its flush. Each has a jnp reference, ``ref_<op>`` (what
``hybrid.compress`` runs with ``impl="xla"``), and a CUDA kernel, ``<op>_cuda``
(``jaxkv.kernels.flush_write``: ``jaxkv/cuda/flush_write.cu`` through ``jax.ffi``,
``impl="cuda"``), buffers aliased in place; both give the same bytes. ``WRITERS`` maps an
``impl`` to its flush-write.

Shapes (``L`` layers of the pool, ``NB`` blocks, ``bs`` entries per block, ``E`` / ``K``
entry / key bytes of the storage family):

    pool:       u8[L, NB, bs * E]      index_pool: u8[L, NB, bs * K]  (CSA only)
    x:          bf16[N, 512]           xi:         bf16[N, 128]       (CSA only)
                (x may be a ``jaxkv.stacked.Stacked`` row of bf16[n, N, 512])
    block:      i32[N]  physical block; rows outside [0, NB) are not written
    slot:       i32[N]  entry within the block, in [0, bs)
    tails:      f32[R, streams, 3, width]   (CSA 3 streams, HCA 1; see ``compressor``)
    tail_slot:  i32[B]  request slots to move on; outside [0, R) skipped; distinct
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv import _backend
from jaxkv.formats.storage import HEAD_DIM, INDEX_DIM, STORAGES, storage_name, write_items
from jaxkv.kernels.flush_write import flush_write as flush_write_kernel
from jaxkv.kernels.flush_write import tail_state
from jaxkv.math.compressor import CUR_B, empty_tail
from jaxkv.stacked import check_stacked, row


# --- validators -----------------------------------------------------------------------------
def check_impl(impl: str) -> str:
    """Resolve ``impl`` (``jaxkv._backend``, operation ``hybrid.write``)."""
    return _backend.choose("hybrid.write", impl)


def default_impl() -> str:
    """ "cuda" on a GPU with nvcc (a decode step's append + flush is one fused kernel per
    layer: docs/kernels/cache_writes.md), "xla" elsewhere; the same for both storage families."""
    return _backend.choose("hybrid.write", "auto")


def _check_flush(pool, layer, x, block, slot, storage, index_pool, xi):
    fmt = STORAGES[storage_name(storage)]
    if pool.ndim != 3 or pool.dtype != jnp.uint8 or pool.shape[-1] % fmt.entry_bytes:
        raise ValueError(
            f"pool: expected u8[layers, blocks, block_size * {fmt.entry_bytes}], got {pool.dtype}{list(pool.shape)}"
        )
    if not isinstance(layer, (int, np.integer)) or not 0 <= layer < pool.shape[0]:
        raise ValueError(f"layer: expected a static int in [0, {pool.shape[0]}), got {layer!r}")
    check_stacked("x", x)
    if x.ndim != 2 or x.shape[1] != HEAD_DIM or x.dtype != jnp.bfloat16:
        raise ValueError(f"x: expected bf16[N, {HEAD_DIM}], got {x.dtype}{list(x.shape)}")
    n = x.shape[0]
    for name, a in (("block", block), ("slot", slot)):
        if a.shape != (n,) or a.dtype != jnp.int32:
            raise ValueError(f"{name}: expected i32[{n}], got {a.dtype}{list(a.shape)}")
    if (index_pool is None) != (xi is None):
        raise ValueError("index_pool, xi: expected both (a CSA layer) or neither (HCA)")
    if index_pool is not None:
        kb = fmt.index_key_bytes(INDEX_DIM)
        bs = pool.shape[-1] // fmt.entry_bytes
        if index_pool.dtype != jnp.uint8 or index_pool.shape != (*pool.shape[:2], bs * kb):
            raise ValueError(
                f"index_pool: expected u8{[*pool.shape[:2], bs * kb]}, got {index_pool.dtype}{list(index_pool.shape)}"
            )
        if xi.shape != (n, INDEX_DIM) or xi.dtype != jnp.bfloat16:
            raise ValueError(f"xi: expected bf16[{n}, {INDEX_DIM}], got {xi.dtype}{list(xi.shape)}")
    return fmt


def _check_tails(tails, tail_slot, streams):
    if tails.ndim != 4 or tails.dtype != jnp.float32 or tails.shape[1:3] != (streams, 3):
        what = "CSA" if streams == 3 else "HCA"
        raise ValueError(
            f"tails: expected f32[R, {streams}, 3, width] (an {what} tail), got {tails.dtype}{list(tails.shape)}"
        )
    if tail_slot.ndim != 1 or tail_slot.dtype != jnp.int32:
        raise ValueError(f"tail_slot: expected i32[B], got {tail_slot.dtype}{list(tail_slot.shape)}")


# --- flush-write ------------------------------------------------------------------------------
def ref_flush_write(pool, layer: int, x, block, slot, *, storage: str, index_pool=None, xi=None):
    """jnp reference: the storage family's encoders, scattered with ``write_items``.
    Returns the new pool, or ``(pool, index_pool)`` for CSA."""
    fmt = _check_flush(pool, layer, x, block, slot, storage, index_pool, xi)
    pool = write_items(pool, layer, block, slot, fmt.entry.encode(row(x)), fmt.entry.segments)
    if index_pool is None:
        return pool
    codec = fmt.index_key(xi.shape[-1])
    return pool, write_items(index_pool, layer, block, slot, codec.encode(xi), codec.segments)


def flush_write_cuda(pool, layer: int, x, block, slot, *, storage: str, index_pool=None, xi=None):
    """The CUDA kernel (``jaxkv.kernels.flush_write``, one warp per entry), in place on
    ``pool`` / ``index_pool``; same arguments and result as ``ref_flush_write``. Needs a GPU
    and nvcc (first use builds)."""
    fmt = _check_flush(pool, layer, x, block, slot, storage, index_pool, xi)
    return flush_write_kernel(pool, layer, row(x), block, slot, storage=fmt.name, index_pool=index_pool, xi=xi)


WRITERS = {"xla": ref_flush_write, "cuda": flush_write_cuda}


# --- tail state after a flush -------------------------------------------------------------------
def _skip(tail_slot, R):
    return jnp.where((tail_slot >= 0) & (tail_slot < R), tail_slot, R)


def ref_csa_rotate_state(tails, tail_slot):
    """CSA: previous-b <- current-b, current a and b emptied, for each listed request."""
    _check_tails(tails, tail_slot, 3)
    R, _, _, w = tails.shape
    cur_b = tails[jnp.clip(tail_slot, 0, R - 1), CUR_B]  # f32[B, 3, w]
    new = jnp.concatenate([empty_tail(tail_slot.shape, 2, w), cur_b[:, None]], axis=1)
    return tails.at[_skip(tail_slot, R)].set(new, mode="drop")


def ref_hca_reset_state(tails, tail_slot):
    """HCA: the stream emptied, for each listed request."""
    _check_tails(tails, tail_slot, 1)
    R, _, _, w = tails.shape
    return tails.at[_skip(tail_slot, R)].set(empty_tail(tail_slot.shape, 1, w), mode="drop")


def csa_rotate_state_cuda(tails, tail_slot):
    """The CUDA kernel of ``ref_csa_rotate_state``, in place."""
    _check_tails(tails, tail_slot, 3)
    return tail_state(tails, tail_slot)


def hca_reset_state_cuda(tails, tail_slot):
    """The CUDA kernel of ``ref_hca_reset_state``, in place."""
    _check_tails(tails, tail_slot, 1)
    return tail_state(tails, tail_slot)


__all__ = [
    "WRITERS",
    "check_impl",
    "csa_rotate_state_cuda",
    "default_impl",
    "flush_write_cuda",
    "hca_reset_state_cuda",
    "ref_csa_rotate_state",
    "ref_flush_write",
    "ref_hca_reset_state",
]
