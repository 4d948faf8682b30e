"""Per-layer writes of the hybrid cache: the SWA ring and the compressors (append + flush).

Each takes the ``Step`` from ``prepare_forward`` and a static layer index, and is jitted
with the state donated. In a layer, read the window (``window_keys``) before
``write_window`` — the ring is overwritten in place — and read compressed entries after
``compress``, which writes the entries the step completes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv import _backend
from jaxkv._pytree import cache_dataclass
from jaxkv.errors import Fault, finite_rows, record_at
from jaxkv.formats.storage import read_items
from jaxkv.hybrid.config import CSA, HCA
from jaxkv.hybrid.flush import WRITERS, check_impl
from jaxkv.hybrid.state import HybridCacheState
from jaxkv.hybrid.step import Step, on_requests, query_positions
from jaxkv.kernels.compress_decode import compress_decode
from jaxkv.kernels.dequant_gather import dequant_gather
from jaxkv.kernels.flush_write import window_write
from jaxkv.math.compressor import finalize, fold_chunk, next_tail
from jaxkv.math.paging import entry_address
from jaxkv.math.rotation import rope_freqs
from jaxkv.stacked import check_stacked, map_stack, row


@cache_dataclass
class CompressorParams:
    """The learned tensors a compressor's flush uses.

    bias: f32[ratio, coff * c]  positional bias B (DeepSeek's ``ape``), added to the
      score of the token at row ``pos % ratio`` of its window (coff = 2 for CSA)
    norm: f32[c]  RMSNorm weight
    """

    bias: jnp.ndarray
    norm: jnp.ndarray


def check_layer(state: HybridCacheState, layer, kinds=None) -> str:
    c = state.config
    if not isinstance(layer, int) or not 0 <= layer < c.num_layers:
        raise ValueError(f"layer: expected a static int in [0, {c.num_layers}), got {layer!r}")
    kind = c.kind(layer)
    if kinds is not None and kind not in kinds:
        raise ValueError(
            f"layer: expected a {' or '.join(k.upper() for k in kinds)} layer, layer {layer} is {kind.upper()}"
        )
    return kind


def check_tokens(name, x, step: Step, width: int, dtypes=None):
    check_stacked(name, x)
    B = step.slot.shape[0]
    if x.ndim != 3 or x.shape[0] != B or x.shape[2] != width:
        raise ValueError(f"{name}: expected shape [{B}, T, {width}], got {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(jnp.dtype(d)) for d in dtypes)}, got {x.dtype}")


def freqs_of(config):
    return rope_freqs(
        config.rope_dim,
        config.rope_theta,
        config.rope_factor,
        config.original_seq_len,
        config.beta_fast,
        config.beta_slow,
    )


# --- where a position and an entry sit ----------------------------------------------------------
def ring_item(pos, window: int):
    """The item of a request's SWA ring (one block of ``window`` items, block ``slot`` of
    the layer's ring pool) that holds position ``pos``."""
    return pos % window


def ring_positions(step: Step, window: int, *, written: bool = False):
    """i32[B, window]: the position ring item i holds before the step (the latest one
    before ``start`` whose ``ring_item`` is i), -1 where empty; ``written``: after the
    step's ``write_window`` (the latest before ``start + num_tokens``)."""
    p = (step.start + step.num_tokens if written else step.start)[:, None]
    pos = p - 1 - jnp.mod(p - 1 - jnp.arange(window)[None, :], window)
    return jnp.where(pos >= 0, pos, -1)


# --- sliding window -----------------------------------------------------------------------
@functools.partial(jax.jit, donate_argnums=0, static_argnames=("layer", "impl"))
def write_window(state: HybridCacheState, step: Step, layer: int, kv, *, impl: str = "auto"):
    """Write the step's tokens into layer ``layer``'s SWA ring.

    kv: bf16[B, T, head_dim]  the layer's normalised, RoPE'd KV of the step's tokens
      (or a ``Stacked`` row of ``bf16[n, B, T, head_dim]``). Only each row's last ``window``
      real tokens are written (earlier ones would be overwritten within the same step).
    A ring is one block of ``window`` entries in the storage's entry format, so the
    flush-writers quantize and scatter it: impl as in ``compress`` ("xla", "cuda", "auto");
    same bytes. With "cuda", a decode step (T = 1) is one launch that also does the
    finiteness check below (``jaxkv.kernels.flush_write.window_write``).
    A row whose real tokens hold a NaN or Inf writes nothing; its request gets NONFINITE_KV.
    """
    impl = check_impl(impl)
    check_layer(state, layer)
    check_tokens("kv", kv, step, state.config.head_dim, (jnp.bfloat16,))
    return on_requests(
        lambda st, step, kv: _write_window(st, step, layer, kv, impl), state, step, kv, axes=("batch", "batch")
    )


def _nonfinite_rows(step: Step, *xs):
    """bool[B]: a row whose real tokens (``t < num_tokens``) hold a NaN or Inf in any of ``xs``
    (each float[B, T, w] or a ``Stacked`` row)."""
    bad = jnp.zeros(step.num_tokens.shape, bool)
    for x in xs:
        x = row(x)
        pad = jnp.arange(x.shape[1])[None, :, None] >= step.num_tokens[:, None, None]
        bad |= ~finite_rows(jnp.where(pad, 0, x), (1, 2))
    return bad & step.active


def record_rows(state, step: Step, rows, fault: Fault):
    """u32 error field with ``fault`` set on the requests of batch ``rows`` (bool[B])."""
    return record_at(state.error, step.slot, rows, fault)


def _skip_rows(state, step: Step, bad):
    """The step without the ``bad`` rows (inactive, nothing written) and NONFINITE_KV on their
    requests: a replay of the valid writes only."""
    step = step.replace(
        write_slot=jnp.where(bad, state.config.max_requests, step.write_slot),
        num_tokens=jnp.where(bad, 0, step.num_tokens),
        active=step.active & ~bad,
    )
    return state.replace(error=record_rows(state, step, bad, Fault.NONFINITE_KV)), step


def _write_window(state, step, layer, kv, impl):
    c = state.config
    B, T, _ = kv.shape
    if impl == "cuda" and T == 1:  # decode: one launch that also checks the tokens
        ring, error = window_write(
            state.window, layer, kv, step.write_slot, step.start, step.num_tokens, state.error, storage=c.storage
        )
        return state.replace(window=ring, error=error)
    state, step = _skip_rows(state, step, _nonfinite_rows(step, kv))
    t = jnp.arange(T)[None, :]
    n = step.num_tokens[:, None]
    valid = (t < n) & (t >= n - c.window)
    blk = jnp.where(valid, step.write_slot[:, None], c.max_requests).astype(jnp.int32)
    item = ring_item(query_positions(step, T), c.window).astype(jnp.int32)
    rows = map_stack(lambda a: a.reshape(a.shape[0], B * T, -1), kv)  # [B * T, head_dim]
    ring = WRITERS[impl](state.window, layer, rows, blk.reshape(-1), item.reshape(-1), storage=c.storage)
    return state.replace(window=ring)


# --- compressors ------------------------------------------------------------------------------
def _check_inputs(step, kv, score, params, ratio, overlap, width, what):
    coff = 2 if overlap else 1
    check_tokens(f"{what}kv", kv, step, coff * width)
    check_tokens(f"{what}score", score, step, coff * width)
    check_stacked(f"{what}params.bias", params.bias)
    check_stacked(f"{what}params.norm", params.norm)
    if params.bias.shape != (ratio, coff * width) or params.norm.shape != (width,):
        raise ValueError(
            f"{what}params: expected bias f32[{ratio}, {coff * width}] and norm f32[{width}], "
            f"got bias {tuple(params.bias.shape)} and norm {tuple(params.norm.shape)}"
        )


def _rows(x, bias, pos, ratio, overlap, width):
    """[B, T, coff*w] inputs (+ bias by row of window) -> per-stream rows f32[B, T, rows, w]."""
    x = x.astype(jnp.float32)
    if bias is not None:
        x = x + bias.astype(jnp.float32)[pos % ratio]
    if overlap:  # a stream <- [w:], b stream <- [:w]
        return jnp.stack([x[..., width:], x[..., :width]], axis=2)
    return x[:, :, None, :]


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("layer", "impl"))
def compress(
    state: HybridCacheState,
    step: Step,
    layer: int,
    kv,
    score,
    params: CompressorParams,
    index=None,
    *,
    impl: str = "auto",
):
    """Append the step's compressor inputs to layer ``layer``'s tails and flush every
    window they complete, for all requests at once (masked; no host check).

    kv, score: float[B, T, coff * head_dim]  C and Z of each token (CSA: ``[..., :c]`` the
      b stream, ``[..., c:]`` the a stream; HCA: one stream), Z without the bias.
    params: CompressorParams of the layer's compressor.
    Any of these arrays (and the index tuple's) may be a ``Stacked`` row of an array
    stacked over layers: the fused kernel reads it in place, other paths slice it.
    index: for CSA layers, ``(kv, score, params)`` of the indexer's compressor
      (width ``index_dim``); its keys are rotated and stored in FP4. None for HCA.
    A flush pools the window (eqs. 11-12 / 20-23), applies RMSNorm and RoPE at
    ``entry * ratio``, quantizes and writes the entry at its block through the
    request's block table (allocated by ``prepare_forward``).
    impl: how the flushed entries are quantized and written (``hybrid.flush``): "xla"
      (jnp), "cuda" (the ``cuda/`` flush-write through jax.ffi; a decode step, T = 1, runs
      the whole append + flush as one fused kernel, ``jaxkv.kernels.compress_decode``),
      "auto" (``hybrid.flush.default_impl``: cuda on a GPU, xla elsewhere). xla and cuda
      give the same bytes, except in decode, where a fused entry can differ in its last bit
      (see the kernel).
    A row whose real tokens hold a NaN or Inf in kv, score or the indexer's kv / score is
    skipped (tails and entries untouched); its request gets NONFINITE_KV.
    """
    c = state.config
    impl = check_impl(impl)
    kind = check_layer(state, layer, (CSA, HCA))
    csa = kind == CSA
    if not isinstance(params, CompressorParams):
        raise ValueError(f"params: expected the layer's CompressorParams(bias, norm), got {type(params).__name__}")
    if (index is None) == csa:
        raise ValueError(
            f"index: expected (kv, score, params) for a CSA layer and None for HCA; layer {layer} is "
            f"{kind.upper()} and index is {'None' if index is None else 'given'}"
        )
    ratio = c.compress_ratios[layer]
    _check_inputs(step, kv, score, params, ratio, csa, c.head_dim, "")
    if csa:
        ikv, iscore, iparams = index
        _check_inputs(step, ikv, iscore, iparams, ratio, True, c.index_dim, "index ")
        return on_requests(
            lambda st, step, kv, score, p, ikv, iscore, ip: _compress(
                st, step, layer, kv, score, p, (ikv, iscore, ip), impl
            ),
            state,
            step,
            kv,
            score,
            params,
            ikv,
            iscore,
            iparams,
            axes=("batch", "batch", "batch", None, "batch", "batch", None),
        )
    return on_requests(
        lambda st, step, kv, score, p: _compress(st, step, layer, kv, score, p, None, impl),
        state,
        step,
        kv,
        score,
        params,
        axes=("batch", "batch", "batch", None),
    )


def _compress(state, step, layer, kv, score, params, index, impl):
    c = state.config
    csa = index is not None
    B, T, _ = kv.shape
    if impl == "cuda" and T == 1 and (not csa or c.index_dim == 128):  # decode: one fused launch (checks too)
        return _compress_decode(state, step, layer, kv, score, params, index)
    state, step = _skip_rows(state, step, _nonfinite_rows(step, kv, score, *(index[:2] if csa else ())))
    ratio = c.compress_ratios[layer]
    g, j = state.group(layer)
    al = state.alloc[g]
    if csa:
        ikv, iscore, iparams = index
    kv, score, params = row(kv), row(score), _row_params(params)
    if csa:
        ikv, iscore, iparams = row(ikv), row(iscore), _row_params(iparams)
    pos = query_positions(step, T)
    kv_rows = _rows(kv, None, pos, ratio, csa, c.head_dim)
    z_rows = _rows(score, params.bias, pos, ratio, csa, c.head_dim)
    if csa:  # the indexer's compressor: the same math on 128 more channels
        kv_rows = jnp.concatenate([kv_rows, _rows(ikv, None, pos, ratio, True, c.index_dim)], axis=-1)
        z_rows = jnp.concatenate([z_rows, _rows(iscore, iparams.bias, pos, ratio, True, c.index_dim)], axis=-1)

    tails = state.tails[g]  # f32[Lg, R, streams, 3, width]
    tail = tails[j, step.slot]  # f32[B, streams, 3, width]
    wins, pooled, complete = jax.vmap(functools.partial(fold_chunk, ratio=ratio, overlap=csa))(
        tail, kv_rows, z_rows, step.start, step.num_tokens
    )
    new_tail = jax.vmap(functools.partial(next_tail, ratio=ratio, overlap=csa))(tail, wins, step.start, step.num_tokens)
    tails = tails.at[j, step.write_slot].set(new_tail, mode="drop")

    nw = pooled.shape[1]
    entry = step.start[:, None] // ratio + jnp.arange(nw)[None, :]  # i32[B, NW] logical entry index
    blk, slot = entry_address(al.table, step.slot[:, None], entry, c.block_size)
    write = complete & step.active[:, None]
    missing = jnp.any(write & (blk < 0), axis=1)
    blk = jnp.where(write & (blk >= 0), blk, al.free.shape[0]).reshape(-1).astype(jnp.int32)
    slot = slot.reshape(-1).astype(jnp.int32)
    freqs = freqs_of(c)
    x = finalize(
        pooled[..., : c.head_dim], entry, ratio, params.norm.astype(jnp.float32), freqs, c.norm_eps, c.rope_dim, False
    )
    write = WRITERS[impl]
    new = dict(tails=_put(state.tails, g, tails))
    if csa:
        xi = finalize(
            pooled[..., c.head_dim :],
            entry,
            ratio,
            iparams.norm.astype(jnp.float32),
            freqs,
            c.norm_eps,
            c.rope_dim,
            True,
        )
        entries, new["index_keys"] = write(
            state.entries[g],
            j,
            x.reshape(B * nw, -1),
            blk,
            slot,
            storage=c.storage,
            index_pool=state.index_keys,
            xi=xi.reshape(B * nw, -1),
        )
    else:
        entries = write(state.entries[g], j, x.reshape(B * nw, -1), blk, slot, storage=c.storage)
    new["entries"] = _put(state.entries, g, entries)
    return state.replace(error=record_rows(state, step, missing, Fault.POOL_EXHAUSTED), **new)


def _compress_decode(state, step, layer, kv, score, params, index):
    def token(x):  # [B, 1, w] -> [B, w], a Stacked row's stack reshaped (no copy)
        return map_stack(lambda a: a.reshape(a.shape[:2] + a.shape[3:]), x)

    c = state.config
    g, j = state.group(layer)
    csa = index is not None
    extra = {}
    if csa:
        ikv, iscore, iparams = index
        extra = dict(index=(token(ikv), token(iscore), iparams.bias, iparams.norm), index_pool=state.index_keys)
    out = compress_decode(
        state.tails[g],
        token(kv),
        token(score),
        params.bias,
        params.norm,
        step.slot,
        step.write_slot,
        step.start,
        step.num_tokens,
        state.alloc[g].table,
        state.entries[g],
        state.error,
        jnp.asarray(freqs_of(c)),
        layer=j,
        ratio=c.compress_ratios[layer],
        eps=c.norm_eps,
        storage=c.storage,
        **extra,
    )
    new = dict(tails=_put(state.tails, g, out[0]), entries=_put(state.entries, g, out[1]), error=out[-1])
    if csa:
        new["index_keys"] = out[2]
    return state.replace(**new)


def _row_params(p: CompressorParams) -> CompressorParams:
    return CompressorParams(row(p.bias), row(p.norm))


def _put(tup, i, x):
    return tup[:i] + (x,) + tup[i + 1 :]


# --- reads ------------------------------------------------------------------------------------------
def window_keys(state: HybridCacheState, step: Step, layer: int, kv, *, impl: str = "auto"):
    """The raw keys the step's queries may see in layer ``layer``: the ring as it was
    before this step, then the step's own tokens, both as stored (quantized, dequantized).

    kv: bf16[B, T, head_dim] (the tokens ``write_window`` will store; or a ``Stacked`` row),
      or None: the step's ``write_window`` has run, so the ring holds them (the ring alone,
      at its positions after the write; right for a decode step, ``attention``'s check)
    Returns keys bf16[B, window + T, head_dim] and their positions i32[B, window + T]
    (-1: empty; window keys with kv None). Query at position p sees the keys with
    ``p - window < pos <= p``. impl: how the ring is read, as in ``gather_entries``.
    """
    check_layer(state, layer)
    if kv is not None:
        check_tokens("kv", kv, step, state.config.head_dim, (jnp.bfloat16,))
    return on_requests(
        lambda st, step, kv: _window_keys(st, step, layer, kv, impl),
        state,
        step,
        kv,
        axes=("batch", "batch"),
        out=("batch", "batch"),
    )


def _window_keys(state, step, layer, kv, impl):
    c = state.config
    fmt = c.storage_format
    B = step.slot.shape[0]
    j = jnp.arange(c.window)[None, :]
    ring_pos = ring_positions(step, c.window, written=kv is None)
    rows = jnp.broadcast_to(step.slot[:, None], (B, c.window))  # a request's ring is block ``slot``
    ring = _read(
        state.window, layer, rows, jnp.broadcast_to(j, (B, c.window)), fmt.entry, c.storage, _gather_impl(impl)
    )
    if kv is None:
        return ring, ring_pos
    T = row(kv).shape[1]
    own = fmt.entry.decode(fmt.entry.encode(row(kv)))
    t = jnp.arange(T)[None, :]
    own_pos = jnp.where(t < step.num_tokens[:, None], query_positions(step, T), -1)
    return jnp.concatenate([ring, own], axis=1), jnp.concatenate([ring_pos, own_pos], axis=1)


def entry_count(step: Step, ratio: int):
    """i32[B] compressed entries each request holds after the step."""
    return (step.start + step.num_tokens) // ratio


def _read(pool, j, blk, item, codec, storage, impl):
    """Items ``(blk, item)`` of layer ``j`` of a pool, dequantized: bf16[..., 512]; zeros
    where ``blk`` is outside the pool (-1: none; a clamped id would read another request's
    block). impl "cuda": one gather-dequantize kernel (entry codecs only), the same rule."""
    if impl == "cuda":
        flat = dequant_gather(pool, j, blk.reshape(-1), item.reshape(-1), storage=storage)
        return flat.reshape(*blk.shape, flat.shape[-1])
    items = codec.decode(read_items(pool, j, blk, item, codec.segments))
    return jnp.where(((blk >= 0) & (blk < pool.shape[1]))[..., None], items, 0).astype(jnp.bfloat16)


def _gather(pool, j, table, slot, idx, codec, bs, storage, impl="xla"):
    blk, item = entry_address(table, slot.reshape(slot.shape + (1,) * (idx.ndim - 1)), idx, bs)
    return _read(pool, j, blk, item, codec, storage, impl)


def _gather_impl(impl: str) -> str:
    return _backend.choose("hybrid.gather", impl)


def gather_entries(state: HybridCacheState, step: Step, layer: int, idx, *, impl: str = "auto"):
    """Compressed entries of layer ``layer`` by logical index, each request through its
    own block table, dequantized: idx i32[B, ...] (-1: none) -> bf16[B, ..., head_dim]
    (zeros where idx is -1). K = V: the one entry serves as key and value.
    impl: "xla" (jnp), "cuda" (``jaxkv.kernels.dequant_gather``; same values), "auto"
    (cuda on a GPU with nvcc, else xla)."""
    check_layer(state, layer, (CSA, HCA))
    if not jnp.issubdtype(jnp.result_type(idx), jnp.integer):
        raise ValueError(
            f"idx: expected an integer array of entry indices (-1: none), got dtype {jnp.result_type(idx)}"
        )
    impl = _gather_impl(impl)

    def local(state, step, idx):
        c = state.config
        g, j = state.group(layer)
        return _gather(
            state.entries[g],
            j,
            state.alloc[g].table,
            step.slot,
            idx,
            c.storage_format.entry,
            c.block_size,
            c.storage,
            impl,
        )

    return on_requests(local, state, step, idx, axes=("batch", "batch"), out="batch")


def all_entries(state: HybridCacheState, step: Step, layer: int, *, impl: str = "auto"):
    """Every compressed entry slot of each request: (bf16[B, max_entries, head_dim],
    count i32[B]); entries at or past ``count`` are zeros."""
    c = state.config
    ratio = c.compress_ratios[layer]
    cnt = entry_count(step, ratio)
    e = jnp.arange(c.max_entries(ratio))[None, :]
    return gather_entries(state, step, layer, jnp.where(e < cnt[:, None], e, -1), impl=impl), cnt


def index_keys(state: HybridCacheState, step: Step, layer: int):
    """Every indexer key of a CSA layer, dequantized: (bf16[B, max_entries, index_dim], count i32[B])."""
    check_layer(state, layer, (CSA,))

    def local(state, step):
        c = state.config
        ratio = c.compress_ratios[layer]
        cnt = entry_count(step, ratio)
        e = jnp.arange(c.max_entries(ratio))[None, :]
        idx = jnp.where(e < cnt[:, None], e, -1)
        g, j = state.group(layer)
        keys = _gather(
            state.index_keys,
            j,
            state.alloc[g].table,
            step.slot,
            idx,
            c.storage_format.index_key(c.index_dim),
            c.block_size,
            c.storage,
        )
        return keys, cnt

    return on_requests(local, state, step, axes=("batch",), out=("batch", "batch"))


__all__ = [
    "CompressorParams",
    "all_entries",
    "compress",
    "entry_count",
    "gather_entries",
    "index_keys",
    "ring_item",
    "ring_positions",
    "window_keys",
    "write_window",
]
