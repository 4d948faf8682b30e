"""``attention``: the one call a DeepSeek-V4 layer makes to attend over the hybrid cache.

A query at position p sees, in every layer, the raw tokens of its window (the SWA ring as
it was before this step, and the step's own tokens, ``p - window < pos <= p``), and in a
compressed layer also compressed entries: the top-k a CSA layer's indexer picked
(``index_topk``), or every visible entry of an HCA layer (``s < (p + 1) // ratio``).
One softmax runs over their union, with the layer's per-head attention sink in the
denominator; K = V.

``impl="xla"`` dequantizes the rows into BF16 copies (``gather_entries`` /
``all_entries`` / ``window_keys``) and runs the float32 reference ``sparse_attention``;
``impl="cuda"`` (``kernels.pool_attention_cuda``, Hopper, any storage family), ``impl="pallas"``
(``kernels.pool_attention_pallas``, Mosaic GPU, Hopper, official storage) and ``impl="flashmla"``
(``kernels.pool_attention_flashmla``: FlashMLA's sm90 kernel built from ``$FLASHMLA_SRC``,
official storage, 64 or 128 heads; the step's own tokens and the sink merged by XLA) read the FP8 rows where
they are stored: only the step's own tokens are encoded first, into a small pool of their
own (the bytes ``write_window`` will store; ``kernels.encode_rows``, one launch, where
``hybrid.write`` runs its kernels). ``"auto"``: cuda on Hopper with nvcc, else pallas on Hopper, else xla.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxkv import _backend
from jaxkv.hybrid.config import CSA, HCA, SWA
from jaxkv.hybrid.ops import (
    all_entries,
    check_layer,
    check_tokens,
    gather_entries,
    ring_positions,
    window_keys,
)
from jaxkv.hybrid.state import HybridCacheState
from jaxkv.hybrid.step import Step, on_requests, query_positions
from jaxkv.kernels.after import after_cuda, after_xla
from jaxkv.kernels.entry_rows import block_counts, entry_rows_cuda, masked_ids, ref_entry_rows
from jaxkv.kernels.flush_write import encode_rows, ref_encode_rows
from jaxkv.kernels.launch import pool_splits
from jaxkv.kernels.pool_attention import BLOCK, pool_attention_cuda, pool_attention_flashmla, pool_attention_pallas
from jaxkv.math.paging import entry_address
from jaxkv.stacked import Stacked, map_stack, row

_HI = lax.Precision.HIGHEST
OWN_BLOCK = 32  # own tokens travel as a small pool of 32-token blocks (the kernel needs bs % 32 == 0)


def attention(
    state: HybridCacheState,
    step: Step,
    layer: int,
    q,
    sink,
    kv,
    idx=None,
    *,
    scale: float | None = None,
    impl: str = "auto",
):
    """Attention of the step's queries over layer ``layer`` of the cache.

    q: bf16[B, T, H, 512] (RoPE applied to the last 64 dims)
    sink: f32[H] the layer's attention-sink logits
    kv: bf16[B, T, 512] the step's own tokens (what ``write_window`` stores; call before it),
      or None in a decode step (T = 1) whose ``write_window`` ran first: the ring then holds
      the token, which the query sees as stored, and the kernel path reads the ring alone
      (no encoding of the token a layer, one key block fewer). Writing first is exact at
      T = 1 only: the slot the token overwrites held the position one window back, which
      the query does not see. (A row whose token was not finite wrote nothing; its request
      is faulted and its output is not the token's.)
    (q, sink and kv may be ``Stacked`` rows, which the cuda kernels read in place)
    idx: i32[B, T, k] the entries a CSA layer attends to (``index_topk``; -1: none;
      entries a query may not see yet are skipped); None for SWA and HCA layers
    scale: softmax scale (default ``512 ** -0.5``)
    Returns bf16[B, T, H, 512]; rows past ``num_tokens`` are padding.
    """
    kind = check_layer(state, layer)
    B = step.slot.shape[0]
    if kv is None:
        T = q.shape[1] if q.ndim == 4 else None
        if T != 1:
            raise ValueError(
                f"kv: None (the step's tokens already in the ring: write_window before attention) needs a "
                f"decode step, q of bf16[{B}, 1, H, {state.config.head_dim}]; got q {list(q.shape)}: pass kv "
                f"and call write_window after attention"
            )
    else:
        check_tokens("kv", kv, step, state.config.head_dim, (jnp.bfloat16,))
        T = row(kv).shape[1]
    if q.ndim != 4 or q.shape[:2] != (B, T) or q.shape[3] != state.config.head_dim or q.dtype != jnp.bfloat16:
        raise ValueError(f"q: expected bf16[{B}, {T}, H, {state.config.head_dim}], got {q.dtype}{list(q.shape)}")
    H = q.shape[2]
    sink = sink if isinstance(sink, Stacked) else jnp.asarray(sink)
    if sink.shape != (H,) or not jnp.issubdtype(sink.dtype, jnp.floating):
        raise ValueError(f"sink: expected float[{H}] (one logit per head), got {sink.dtype}{list(sink.shape)}")
    if kind == CSA:
        if (
            idx is None
            or jnp.ndim(idx) != 3
            or jnp.shape(idx)[:2] != (B, T)
            or not jnp.issubdtype(jnp.result_type(idx), jnp.integer)
        ):
            raise ValueError(
                f"idx: a CSA layer expects int[{B}, {T}, k] entry indices (index_topk), got "
                f"{None if idx is None else (jnp.result_type(idx), list(jnp.shape(idx)))}"
            )
        if jnp.shape(idx)[2] > state.config.top_k:
            raise ValueError(
                f"idx: expected at most HybridConfig.top_k = {state.config.top_k} picks per query, got "
                f"{jnp.shape(idx)[2]} (index_topk with a top_k above the config's?)"
            )
    elif idx is not None:
        raise ValueError(f"idx: layer {layer} is {kind.upper()}, which attends to no picked entries; pass idx=None")
    impl = _backend.choose(
        "hybrid.attention",
        impl,
        heads=H,
        block_size=state.config.block_size,
        window=state.config.window,
        storage=state.config.storage,
    )
    scale = float(state.config.head_dim**-0.5 if scale is None else scale)
    sink = map_stack(lambda s: s.astype(jnp.float32), sink)
    if impl == "xla":
        fn = _xla
    else:  # the kernel looked up now: tests swap pool_attention_pallas for its reference
        kernel = {"cuda": pool_attention_cuda, "flashmla": pool_attention_flashmla}.get(impl, pool_attention_pallas)
        fn = functools.partial(_in_place, kernel=kernel)
    idx = None if idx is None else jnp.asarray(idx, jnp.int32)
    return on_requests(
        lambda st, step, q, kv, idx: fn(st, step, layer, kind, q, kv, idx, sink, scale),
        state,
        step,
        q,
        kv,
        idx,
        axes=("batch",) * 4,
        out="batch",
    )


def after_reads(state: HybridCacheState, *outs, impl: str = "auto") -> HybridCacheState:
    """``state`` ordered after the reads that produced ``outs`` (``attention``'s output):
    pass the result to the writes that follow (``write_window``, the next ``compress``).

    A decode step reads a layer's pools (``attention``, ``index_topk``) and then updates
    the same stacked arrays in place. Nothing in the data orders the read before the write,
    so XLA keeps the read's version alive by copying the whole stacked pool, layer after
    layer (a long context then does not fit: docs/hybrid.md). Here the pools become values
    that depend on ``outs`` (``kernels.after_cuda``: an FFI call that moves nothing; or
    ``kernels.after_xla``: one byte of each pool rewritten with itself at an index XLA
    cannot know), and the writes after them stay in place. No value changes.
    impl: "cuda", "xla", or "auto" (cuda on a GPU with nvcc, else xla).
    """
    after = after_cuda if _backend.choose("hybrid.after_reads", impl) == "cuda" else after_xla

    def local(st, *outs):
        window, index_keys, *entries = after((st.window, st.index_keys, *st.entries), outs)
        return st.replace(window=window, entries=tuple(entries), index_keys=index_keys)

    return on_requests(local, state, *outs, axes=("batch",) * len(outs), out="state")


# --- what a query sees, and the reference attention over it ---------------------------------------
# Both paths (``_xla`` and ``_in_place``) and the indexer ask these; nothing else restates them.
def window_first(step: Step, T: int, window: int):
    """i32[B, T]: the oldest position in the window of each query row. A query at position p
    sees the raw tokens at ``p - window < pos <= p``: ``window_first <= pos <= p``."""
    return query_positions(step, T) - window + 1


def window_mask(key_pos, step: Step, T: int, window: int):
    """bool[B, T, K]: query t sees key k iff ``p - window < key_pos <= p`` (p its position)."""
    p = query_positions(step, T)[..., None]
    kp = key_pos[:, None, :]
    return (kp >= 0) & (kp <= p) & (kp >= window_first(step, T, window)[..., None])


def visible_entries(step: Step, T: int, ratio: int):
    """i32[B, T]: compressed entries the query at position p may see, ``(p + 1) // ratio``."""
    return (query_positions(step, T) + 1) // ratio


def entry_visible(entry, step: Step, T: int, ratio: int):
    """bool[B, T, k]: query t sees compressed entry ``entry[b, t, k]`` (-1: none) iff
    ``0 <= entry < (p + 1) // ratio``."""
    return (entry >= 0) & (entry < visible_entries(step, T, ratio)[..., None])


def causal_entry_mask(num_entries: int, step: Step, T: int, ratio: int):
    """bool[B, T, N]: query at position p sees compressed entry s iff ``s < (p + 1) // ratio``."""
    return entry_visible(jnp.arange(num_entries)[None, None, :], step, T, ratio)


def sparse_attention(q, parts, sink, scale: float):
    """Reference MQA over per-query key sets, K = V, with an attention sink.

    q: float[B, T, H, D]
    parts: sequence of (keys float[B, T, K, D] or float[B, K, D] (shared by the row's
      queries), mask bool[B, T, K]); the key sets are concatenated.
    sink: f32[H] learnable logit added to every softmax denominator.
    Returns f32[B, T, H, D]. A query with no visible key returns 0.
    """
    qf = q.astype(jnp.float32)
    logits, values = [], []
    for keys, mask in parts:
        kf = keys.astype(jnp.float32)
        eq = "bthd,bkd->bthk" if kf.ndim == 3 else "bthd,btkd->bthk"
        l = jnp.einsum(eq, qf, kf, precision=_HI) * scale
        logits.append(jnp.where(mask[:, :, None, :], l, -jnp.inf))
        values.append(kf)
    sink = jnp.asarray(sink, jnp.float32)[None, None, :]
    m = jnp.maximum(jnp.max(jnp.concatenate(logits, axis=-1), axis=-1), sink)  # f32[B, T, H]
    denom = jnp.exp(sink - m)
    out = 0.0
    for l, kf in zip(logits, values):
        p = jnp.exp(l - m[..., None])
        denom = denom + jnp.sum(p, axis=-1)
        eq = "bthk,bkd->bthd" if kf.ndim == 3 else "bthk,btkd->bthd"
        out = out + jnp.einsum(eq, p, kf, precision=_HI)
    return out / denom[..., None]


# --- the two paths -----------------------------------------------------------------------------
def _xla(state, step, layer, kind, q, kv, idx, sink, scale):
    c = state.config
    T = q.shape[1]
    keys, pos = window_keys(state, step, layer, kv, impl="xla")
    parts = [(keys, window_mask(pos, step, T, c.window))]
    if kind == CSA:
        ok = entry_visible(idx, step, T, c.compress_ratios[layer]) & _entry_blocks(state, step, layer, idx)[2]
        parts.append((gather_entries(state, step, layer, jnp.where(ok, idx, -1), impl="xla"), ok))
    elif kind == HCA:
        entries, _ = all_entries(state, step, layer, impl="xla")
        e = jnp.arange(entries.shape[1], dtype=jnp.int32)[None, None, :]
        ok = (
            causal_entry_mask(entries.shape[1], step, T, c.compress_ratios[layer])
            & _entry_blocks(state, step, layer, e)[2]
        )
        parts.append((entries, ok))
    return sparse_attention(row(q), parts, row(sink), scale).astype(jnp.bfloat16)


def _entry_blocks(state, step, layer, entry):
    """(block, item, in_pool) of compressed entry ``entry`` (i32[B or 1, T or 1, k]) of each
    request: ``entry_address``, and whether its block is one of the pool's. An unallocated or
    corrupt table cell is not a key on either path (past the pool, an id would name another
    layer's rows of the stacked pool)."""
    g, _ = state.group(layer)
    blk, item = entry_address(state.alloc[g].table, step.slot[:, None, None], entry, state.config.block_size)
    return blk, item, (blk >= 0) & (blk < state.entries[g].shape[1])


def _pool_span(pool, layer):
    """A stacked pool u8[L, NB, width] as the kernels read it, u8[L * NB, width], and the
    span of layer ``layer``'s blocks in it. Row ids within the span do not depend on the
    layer, so the layers that share a table share one computation of them."""
    L, NB, width = pool.shape
    return pool.reshape(L * NB, width), (layer * NB, NB)


def _own_part(step, kv, W, storage):
    """The step's own tokens as a part of the kernel path's row list: (rows u8[B * T, E], the
    span, ids i32[N, K'], count i32[N])."""
    B, T = kv.shape[:2]  # a Stacked row's shape
    N = B * T
    # the step's own tokens in query t's window: t' from first to t (positions start + t'),
    # encoded as write_window will store them
    encode = encode_rows if _backend.choose("hybrid.write", "auto") == "cuda" else ref_encode_rows  # one launch
    own = encode(kv, OWN_BLOCK, storage=storage)  # its N rows; a Stacked kv read in place
    K = min(T, W)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    first = jnp.maximum(window_first(step, T, W) - step.start[:, None], 0)  # i32[B, T]
    own_ids = (
        jnp.arange(B, dtype=jnp.int32)[:, None, None] * T
        + first[..., None]
        + jnp.arange(K, dtype=jnp.int32)[None, None, :]
    )  # [B, T, K]
    own_count = (t - first + 1).reshape(N)
    own_ids = jnp.pad(jnp.minimum(own_ids, N - 1).reshape(N, K), ((0, 0), (0, -K % BLOCK)))
    return own, (0, own.shape[0]), own_ids, own_count.astype(jnp.int32)


def _in_place(state, step, layer, kind, q, kv, idx, sink, scale, *, kernel):
    """The kernel path: each part's row ids (through the block tables), then ``kernel``. The
    ring's and the own tokens' lists do not depend on the layer (one computation a step);
    a compressed layer's entries go in front of them through ``entry_rows``: for a CSA
    layer's picks one launch on a GPU (``kernels.entry_rows_cuda``), for an HCA layer's
    every entry the jnp rule, which XLA computes once for the layers sharing a table."""
    c = state.config
    B, T, H, D = q.shape
    N = B * T
    W = c.window
    parts = []  # (pool u8[P, bs * E], span, ids i32[N, k], count i32[N]): the ring, the own tokens

    # the ring as it was before this step (after its write with kv None): item i of block
    # ``slot`` holds ring_positions[:, i]
    seen = window_mask(ring_positions(step, W, written=kv is None), step, T, W)  # [B, T, W]
    pool, span = _pool_span(state.window, layer)
    ring_ids = step.slot[:, None] * W + jnp.arange(W, dtype=jnp.int32)[None, :]  # a ring is one block
    ring_ids = jnp.broadcast_to(ring_ids[:, None, :], (B, T, W))
    parts.append((pool, span) + masked_ids(ring_ids.reshape(N, W), seen.reshape(N, W)))

    if kv is not None:
        parts.append(_own_part(step, kv, W, c.storage))

    rows = jnp.concatenate([ids for _, _, ids, _ in parts], axis=1).astype(jnp.int32)
    nvalid = jnp.concatenate([block_counts(n, ids.shape[1] // BLOCK) for _, _, ids, n in parts], axis=1)
    pools = tuple(p for p, _, _, _ in parts)
    part_blocks = tuple(ids.shape[1] // BLOCK for _, _, ids, _ in parts)
    spans = tuple(span for _, span, _, _ in parts)
    if kind != SWA:
        ratio = c.compress_ratios[layer]
        g, j = state.group(layer)
        if kind == CSA:
            e = idx.reshape(N, -1)
            cuda = _backend.choose("hybrid.entry_rows", "auto") == "cuda"
        else:
            e = jnp.broadcast_to(jnp.arange(c.max_entries(ratio), dtype=jnp.int32), (N, c.max_entries(ratio)))
            cuda = False
        rows, nvalid = (entry_rows_cuda if cuda else ref_entry_rows)(
            e,
            state.alloc[g].table,
            step.slot,
            visible_entries(step, T, ratio).reshape(N).astype(jnp.int32),
            rows,
            nvalid,
            block_size=c.block_size,
            pool_blocks=state.entries[g].shape[1],
        )
        pool, span = _pool_span(state.entries[g], j)
        pools, spans = (pool,) + pools, (span,) + spans
        part_blocks = (-(-e.shape[1] // BLOCK),) + part_blocks
    out = kernel(
        map_stack(lambda x: x.reshape(x.shape[0], N, H, D), q),  # a Stacked row stays one
        pools,
        part_blocks,
        rows,
        nvalid,
        sink,
        storage=c.storage,
        scale=scale,
        splits=pool_splits(N, H, rows.shape[1] // BLOCK),
        spans=spans,
    )
    return out.reshape(B, T, H, D)


__all__ = [
    "after_reads",
    "attention",
    "causal_entry_mask",
    "entry_visible",
    "sparse_attention",
    "visible_entries",
    "window_first",
    "window_mask",
]
