"""The lightning indexer: its queries (``index_query``), scores (``index_scores``) and the
top-k entries a CSA layer attends to (``index_topk``).

The XLA path is the meaning the kernels are tested against; ``index_scores(impl="cuda")``
runs ``kernels.index_scores_cuda``, ``impl="pallas"`` ``kernels.index_scores`` (Hopper).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import _backend
from jaxkv.errors import Fault
from jaxkv.hybrid.attention import causal_entry_mask, visible_entries
from jaxkv.hybrid.config import CSA
from jaxkv.hybrid.ops import check_layer, entry_count, index_keys, record_rows
from jaxkv.hybrid.state import HybridCacheState
from jaxkv.hybrid.step import Step, on_requests
from jaxkv.kernels.index_query import index_query_cuda, ref_index_query
from jaxkv.kernels.index_scores import index_scores as score_kernel
from jaxkv.kernels.index_scores import index_scores_cuda
from jaxkv.kernels.top_k import MAX_K, nonfinite_rows, top_k_record
from jaxkv.stacked import map_stack, row


def index_query(state: HybridCacheState, q, *, impl: str = "auto"):
    """Indexer queries as DeepSeek-V4 scores them: Hadamard-rotated and rounded through the
    cache's FP4 key format. q: bf16[..., index_dim] (RoPE applied; or a ``Stacked`` row, which
    the kernel reads in place) -> bf16[..., index_dim].
    impl: "xla" (the rotation and the storage codec in jnp), "cuda" (``kernels.index_query_cuda``:
    one launch, the same values), "auto" (cuda on a GPU with nvcc, else xla)."""
    if not jnp.issubdtype(q.dtype, jnp.floating) or q.shape[-1:] != (state.config.index_dim,):
        raise ValueError(f"q: expected bf16[..., {state.config.index_dim}], got {q.dtype}{list(q.shape)}")
    impl = _backend.choose("hybrid.index_query", impl, dtype=str(q.dtype))
    fn = index_query_cuda if impl == "cuda" else ref_index_query
    if state.layout is None:
        return fn(q, state.config.storage)
    state.layout.check_divides("requests", q.shape[0] if q.ndim > 1 else 0, "q's leading (batch) axis")
    return on_requests(lambda st, q: fn(q, st.config.storage), state, q, axes=("batch",), out="batch")


def _scores_impl(state, impl):
    c = state.config
    return _backend.choose(
        "hybrid.index_scores", impl, index_heads=c.index_heads, index_dim=c.index_dim, block_size=c.block_size
    )


def index_scores(state: HybridCacheState, step: Step, layer: int, q, weights, *, impl: str = "auto"):
    """Lightning-indexer scores ``I[t, s] = sum_h w[t,h] * ReLU(q[t,h] . K[s])``.

    q: bf16[B, T, H, index_dim] from ``index_query``; weights: f32[B, T, H] (DeepSeek-V4
    scales them by ``index_dim**-0.5 * H**-0.5``), or a ``Stacked`` row the CUDA kernel reads
    in place.
    Returns f32[B, T, max_entries]; entries a query may not see (``s >= (t+1) // ratio``)
    are -inf. impl: "xla" (every key dequantized to BF16, one batched matmul), "cuda"
    (``kernels.index_scores_cuda``: the FP4 keys read in place, Hopper, nvcc), "pallas"
    (``kernels.index_scores``: the same in Mosaic GPU, Hopper), "auto" (the first that runs
    here, in that order from cuda). All multiply the same BF16 keys and queries with float32
    sums; they differ only in summation order.
    """
    _check_scores(state, step, layer, q, weights)
    impl = _scores_impl(state, impl)
    return on_requests(
        lambda st, step, q, w: _index_scores(st, step, layer, q, w, impl),
        state,
        step,
        q,
        weights,
        axes=("batch",) * 3,
        out="batch",
    )


def _check_scores(state, step, layer, q, weights):
    check_layer(state, layer, (CSA,))
    c = state.config
    B, T, H, D = q.shape
    if (B, D) != (step.slot.shape[0], c.index_dim) or weights.shape != (B, T, H):
        raise ValueError(
            f"q, weights: expected [B, T, H, {c.index_dim}] and [B, T, H] with B={step.slot.shape[0]}, "
            f"got {tuple(q.shape)} and {tuple(weights.shape)}"
        )


def _index_scores(state, step, layer, q, weights, impl):
    c = state.config
    B, T, H, D = q.shape
    ratio = c.compress_ratios[layer]
    if impl in ("pallas", "cuda"):
        g, j = state.group(layer)
        visible = _visible(step, T, ratio)
        s = (score_kernel if impl == "pallas" else index_scores_cuda)(
            q.reshape(B * T, H, D).astype(jnp.bfloat16),
            map_stack(lambda w: w.reshape(w.shape[0], B * T, H), weights),  # a Stacked row stays one
            state.index_keys,
            j,
            state.alloc[g].table[step.slot],
            visible.reshape(-1).astype(jnp.int32),
            storage=c.storage,
        )
        return s[:, : c.max_entries(ratio)].reshape(B, T, -1)
    keys, _ = index_keys(state, step, layer)  # bf16[B, N, D]: exact products in f32, f32 sums
    dots = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32)
    s = jnp.sum(jax.nn.relu(dots) * row(weights).astype(jnp.float32)[..., None], axis=2)
    return jnp.where(causal_entry_mask(keys.shape[1], step, T, ratio), s, -jnp.inf)


def index_topk(
    state: HybridCacheState,
    step: Step,
    layer: int,
    q,
    weights,
    top_k: int | None = None,
    *,
    impl: str = "auto",
    select: str = "auto",
):
    """Top-k entries per query by indexer score: ``(state, idx)``, idx i32[B, T, k] (-1 where
    fewer are visible), best first, ties to the lower entry.

    A NaN or infinite score is never picked; a real query row with one among its visible
    entries records ``Fault.NONFINITE_SCORES`` on its request (``jaxkv.check`` raises it).
    Keys are checked when written, so such a score comes from the step's query or weights:
    the returned state differs from ``state`` only in that error field.
    ``k = min(top_k or config.top_k, max_entries)``. impl: the scores, as ``index_scores``.
    select: "xla" (``lax.top_k``, which sorts), "cuda" (``kernels.top_k``, a radix select; k
    up to ``kernels.top_k.MAX_K``), "auto" (cuda on a GPU with nvcc where k allows, else
    xla); both pick the same entries in the same order."""
    _check_scores(state, step, layer, q, weights)
    impl = _scores_impl(state, impl)
    _backend.choose("hybrid.index_topk", select, top_k=top_k or state.config.top_k, max_top_k=MAX_K)

    def local(st, step, q, w):
        s = _index_scores(st, step, layer, q, w, impl)
        k = min(top_k or st.config.top_k, s.shape[-1])
        # a real query row's visible scores are checked for NaN / Inf; the -inf past them is masking
        T = s.shape[1]
        real = jnp.arange(T)[None, :] < step.num_tokens[:, None]
        seen = jnp.where(real, _visible(step, T, st.config.compress_ratios[layer]), 0)
        if _backend.choose("hybrid.index_topk", select, top_k=k, max_top_k=MAX_K) == "cuda":
            # the kernel ORs the fault into the request's word itself: no launch of its own
            idx, error = top_k_record(s, k, seen, st.error, step.slot, Fault.NONFINITE_SCORES)
            return st.replace(error=error), idx
        idx, bad = _select(s, k, seen)
        bad = jnp.any(bad, axis=1) & step.active
        return st.replace(error=record_rows(st, step, bad, Fault.NONFINITE_SCORES)), idx

    return on_requests(local, state, step, q, weights, axes=("batch",) * 3, out=("state", "batch"))


def _visible(step: Step, T: int, ratio: int):
    """i32[B, T]: the entries each query sees that the request holds after the step."""
    return jnp.minimum(visible_entries(step, T, ratio), entry_count(step, ratio)[:, None])


def _select(s, k: int, visible):
    """f32[..., N] scores -> (i32[..., k], bool[...]) in XLA: ``kernels.ref_top_k``'s picks
    (NaN / Inf never picked, -1 past the finite ones) and each row's NaN / Inf among its
    first ``visible`` scores (select="cuda" is ``kernels.top_k_record``)."""
    s, bad = jnp.where(jnp.isfinite(s), jnp.where(s == 0, 0.0, s), -jnp.inf), nonfinite_rows(s, visible)
    val, idx = _top_k(s, k)
    return jnp.where(val > -jnp.inf, idx, -1), bad


def _top_k(s, k: int, chunks: int = 4):
    """``lax.top_k`` over the last axis, in two exact stages where the axis is long: the k best
    of each of ``chunks`` slices, then the k best of those (the same values and indices, ties
    to the lower index). XLA's top-k sorts, and four short sorts take less time than one long
    one (docs/kernels/index_scores.md)."""
    n = s.shape[-1]
    if n % chunks or n < 2 * chunks * k:
        return jax.lax.top_k(s, k)
    val, idx = jax.lax.top_k(s.reshape(*s.shape[:-1], chunks, n // chunks), k)
    idx = idx + (jnp.arange(chunks, dtype=idx.dtype) * (n // chunks))[:, None]
    val, pick = jax.lax.top_k(val.reshape(*s.shape[:-1], chunks * k), k)
    return val, jnp.take_along_axis(idx.reshape(*s.shape[:-1], chunks * k), pick, axis=-1)


__all__ = ["index_query", "index_scores", "index_topk"]
