"""Top-k selection over score rows without sorting them: a radix select in one CUDA kernel.

XLA's ``lax.top_k`` sorts each row; a CSA layer needs only the k best of it. The kernel
(``jaxkv/cuda/top_k.cu``, one block of threads per row, through ``jax.ffi``) finds the k-th
largest score digit by digit from histograms, keeps every larger score and the lowest
indices of the equal ones in one pass, then sorts the k picks. A row whose keys fit in
shared memory (about 48K scores) is read from HBM once. The measurements:
docs/kernels/index_scores.md.

The meaning, both paths: a NaN or infinite score is never picked (its slot is -1), -0.0
equals +0.0, equal scores go to the lower index, and the picks come best first. Given
``visible``, each row also says whether one of its first ``visible`` scores is NaN or
infinite (the indexer's fault; the -inf past them is its masking), from the kernel's one
read of the row. ``top_k_record`` records that fault itself, in the error word of the row's
request, so a step spends no launch of its own on it.

    scores: f32[..., n]  ->  i32[..., k]   (1 <= k <= min(n, MAX_K))
    visible: i32[...] (optional)  ->  also bool[...]
    top_k_record: + visible i32[B, ...], error u32[words], slot i32[B]  ->  i32[B, ..., k], error
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cuda import register_ffi_targets
from jaxkv.errors import Fault, finite_rows, record_at

MAX_K = 2048  # the kernel sorts its picks in shared memory


def _check(scores, k: int, visible):
    if scores.ndim < 1 or scores.dtype != jnp.float32:
        raise ValueError(f"scores: expected f32[..., n], got {scores.dtype}{list(scores.shape)}")
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= {n} (the scores' last axis), got {k}")
    if visible is not None and (visible.shape != scores.shape[:-1] or not jnp.issubdtype(visible.dtype, jnp.integer)):
        raise ValueError(f"visible: expected int{list(scores.shape[:-1])}, got {visible.dtype}{list(visible.shape)}")


def nonfinite_rows(scores, visible):
    """bool[...]: whether one of each row's first ``visible`` scores is NaN or infinite."""
    seen = jnp.arange(scores.shape[-1]) < jnp.asarray(visible)[..., None]
    return ~finite_rows(jnp.where(seen, scores, 0.0), (scores.ndim - 1,))


def ref_top_k(scores, k: int, visible=None):
    """The jnp reference: ``lax.top_k`` after NaN / Inf become -inf and -0.0 becomes +0.0
    (``lax.top_k`` gives equal values to the lower index first); with ``visible``, also
    ``nonfinite_rows``."""
    _check(scores, k, visible)
    s = jnp.where(jnp.isfinite(scores), jnp.where(scores == 0, 0.0, scores), -jnp.inf)
    val, idx = jax.lax.top_k(s, k)
    idx = jnp.where(val > -jnp.inf, idx, -1).astype(jnp.int32)
    return idx if visible is None else (idx, nonfinite_rows(scores, visible))


def _check_kernel_k(k: int):
    if k > MAX_K:
        raise ValueError(f"k: expected at most {MAX_K} for the top-k kernel, got {k} (use the XLA path)")


def top_k(scores, k: int, visible=None):
    """The kernel: the same as ``ref_top_k``. k at most ``MAX_K``."""
    _check(scores, k, visible)
    _check_kernel_k(k)
    register_ffi_targets()
    rows = scores.reshape(-1, scores.shape[-1])
    n = 0 if visible is None else rows.shape[0]
    seen = jnp.zeros(0, jnp.int32) if visible is None else jnp.asarray(visible, jnp.int32).reshape(n)
    out = (jax.ShapeDtypeStruct((rows.shape[0], k), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32))
    idx, bad = jax.ffi.ffi_call("jaxkv_top_k", out)(rows, seen, k=np.int32(k))
    idx = idx.reshape(*scores.shape[:-1], k)
    return idx if visible is None else (idx, bad.reshape(scores.shape[:-1]) != 0)


def _check_record(scores, k, visible, error, slot):
    _check(scores, k, visible)
    if visible is None or visible.ndim < 1:
        raise ValueError(
            f"visible: expected int[B, ...] (B the requests), got {None if visible is None else visible.shape}"
        )
    if error.ndim != 1 or error.dtype != jnp.uint32:
        raise ValueError(f"error: expected u32[words], got {error.dtype}{list(error.shape)}")
    if slot.shape != visible.shape[:1] or slot.dtype != jnp.int32:
        raise ValueError(
            f"slot: expected int32[{visible.shape[0]}] (one per request), got {slot.dtype}{list(slot.shape)}"
        )


def ref_top_k_record(scores, k: int, visible, error, slot, fault: Fault):
    """The jnp reference of ``top_k_record``: ``ref_top_k``'s picks, and ``fault`` ORed into
    ``error[slot[b]]`` for each request b with a NaN / Inf among a row's visible scores (a
    slot outside ``error`` records nothing)."""
    _check_record(scores, k, visible, error, slot)
    idx, bad = ref_top_k(scores, k, visible)
    return idx, record_at(error, slot, bad.reshape(slot.shape[0], -1).any(1), fault)


def top_k_record(scores, k: int, visible, error, slot, fault: Fault):
    """The kernel: ``ref_top_k_record``'s picks and error words in one launch (``error``
    updated in place)."""
    _check_record(scores, k, visible, error, slot)
    _check_kernel_k(k)
    register_ffi_targets()
    rows = scores.reshape(-1, scores.shape[-1])
    out = (jax.ShapeDtypeStruct((rows.shape[0], k), jnp.int32), jax.ShapeDtypeStruct(error.shape, error.dtype))
    idx, error = jax.ffi.ffi_call("jaxkv_top_k_record", out, input_output_aliases={2: 1})(
        rows,
        jnp.asarray(visible, jnp.int32).reshape(-1),
        error,
        slot,
        k=np.int32(k),
        fault=np.int32(int(fault)),
    )
    return idx.reshape(*scores.shape[:-1], k), error


__all__ = ["MAX_K", "nonfinite_rows", "ref_top_k", "ref_top_k_record", "top_k", "top_k_record"]
