"""Attention of a query frame over a frame cache: ``reference``, ``xla``, ``cudnn``, ``pallas`` and ``cuda``.

Non-causal, no positional encoding (RoPE is applied before append). The visible keys of
each stream are the prefix ``[0, num_valid)`` of its buffer (see ``FrameSpec``), so no
backend gathers anything:

* ``reference``: plain softmax over every row with a mask, float32 (the tests' oracle).
* ``xla``: online softmax over key blocks in a ``while`` loop that stops at the last
  visible block, float32 accumulation: work proportional to what is visible, any device.
  On a GPU, a few queries (``tuning.XLA_ONE_PASS_QUERIES``: a causal head's one token
  per frame) take one masked pass over the whole buffer instead: no loop, so no host
  sync (``tuning.branch_free``).
* ``cudnn``: cuDNN flash attention (``jax.nn.dot_product_attention``), one call with the
  prefix length as the key length. Not split over key chunks: merging chunks needs cuDNN's
  float32 log-sum-exp, which jax's public API rounds to the output dtype
  (docs/kernels/prefix_attention.md).
* ``pallas``: ``jaxkv.kernels.prefix_attention``, a FlashAttention-3-style Mosaic GPU
  kernel (Hopper) whose key loop stops at the prefix length and masks only the last
  block, so the length costs nothing. Where the queries are few, the buffer is split into
  equal key chunks run by separate programs and merged by their log-sum-exp
  (``jaxkv.kernels.launch.prefix_splits``; FlashInfer's split-KV).
* ``cuda``: ``jaxkv.kernels.prefix_attention_cuda``, the same design in CUDA
  (``jaxkv/cuda/prefix_attention.cu``; bf16, head_dim 64), the kernel the PyTorch drop-in
  launches on the same buffers. It also reads an FP8 cache's codes and scales in place.

``auto`` is ``pallas`` on a Hopper GPU, ``cudnn`` on other NVIDIA GPUs, ``xla`` elsewhere;
for an FP8 cache ``cuda`` on a Hopper GPU with nvcc, else ``xla``.
With power-of-two pages the prefix holds padding rows, which neither ``cudnn`` nor
``pallas`` masks, so ``auto`` picks ``xla`` there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv import _backend
from jaxkv.formats.fp8 import dequantize_fp8_rows
from jaxkv.frame import tuning
from jaxkv.frame.state import FrameCacheState
from jaxkv.frame.views import visible_mask
from jaxkv.kernels.launch import prefix_splits
from jaxkv.kernels.prefix_attention import prefix_attention, prefix_attention_cuda
from jaxkv.math.attention import HIGHEST, ref_attention
from jaxkv.sharding import on_devices

IMPLS = _backend.choices("frame.attention")


XLA_BLOCK = 512  # key rows per step of the ``xla`` backend


def xla_attention(q, k, v, num_valid, row_mask=None, scale=None, block: int = XLA_BLOCK, kv_scales=None):
    """Online-softmax attention over the key prefix ``[0, num_valid)``, one block per loop step.

    q: float[B, Tq, Hq, D]; k, v: float[B, T, H, D]; num_valid: i32[B];
    row_mask: bool[B, T] or None (rows inside the prefix to skip: page padding)
    kv_scales: None, or (bf16[B, T, H], bf16[B, T, H]) with k, v float8_e4m3fn[B, T, H, D]: an
      FP8 cache, each block dequantized as it is read (``jaxkv.formats.dequantize_fp8_rows``)
    returns q.dtype[B, Tq, Hq, D]
    """
    B, Tq, Hq, D = q.shape
    T, H = k.shape[1], k.shape[2]
    G = Hq // H
    block = min(block, T)
    scale = D**-0.5 if scale is None else scale
    read = lambda x, s: x.astype(jnp.float32) if s is None else dequantize_fp8_rows(x, s, jnp.float32)  # noqa: E731
    ks, vs = (None, None) if kv_scales is None else kv_scales
    if Tq * G <= tuning.XLA_ONE_PASS_QUERIES and tuning.branch_free():  # one masked pass, no loop
        ok = jnp.arange(T)[None] < num_valid[:, None]
        out = ref_attention(q, read(k, ks), read(v, vs), ok if row_mask is None else ok & row_mask, scale)
        return out.astype(q.dtype)
    qf = (q.astype(jnp.float32) * scale).reshape(B, Tq, H, G, D)
    rows_of = lambda x, start: None if x is None else lax.dynamic_slice_in_dim(x, start, block, axis=1)  # noqa: E731

    def body(i, carry):
        m, l, acc = carry
        start = jnp.minimum(i * block, T - block)  # the last block may overlap the one before
        kb = read(rows_of(k, start), rows_of(ks, start))
        vb = read(rows_of(v, start), rows_of(vs, start))
        rows = start + jnp.arange(block)
        ok = (rows[None] >= i * block) & (rows[None] < num_valid[:, None])  # [B, block]
        if row_mask is not None:
            ok &= lax.dynamic_slice_in_dim(row_mask, start, block, axis=1)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kb, precision=HIGHEST)
        s = jnp.where(ok[:, None, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p, vb, precision=HIGHEST)
        return m_new, l, acc

    init = (
        jnp.full((B, H, G, Tq), -jnp.inf, jnp.float32),
        jnp.zeros((B, H, G, Tq), jnp.float32),
        jnp.zeros((B, H, G, Tq, D), jnp.float32),
    )
    steps = (jnp.max(num_valid) + block - 1) // block
    _, l, acc = lax.fori_loop(0, steps, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Tq, Hq, D).astype(q.dtype)


def cudnn_attention(q, k, v, num_valid, scale=None):
    """cuDNN flash attention over the key prefix ``[0, num_valid)``: one call, the prefix
    length as cuDNN's key length.

    q: bf16/f16[B, Tq, Hq, D]; k, v: same dtype [B, T, H, D]; num_valid: i32[B]
    returns q.dtype[B, Tq, Hq, D]; a stream with num_valid 0 attends to row 0 (callers mask it)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, key_value_seq_lengths=jnp.maximum(num_valid, 1), implementation="cudnn"
    )


def default_impl(spec) -> str:
    """The fastest backend available for ``spec`` on the default device (``jaxkv._backend``)."""
    return _backend.choose("frame.attention", "auto", **_context(spec))


def _context(spec) -> dict:
    return dict(pow2_pages=spec.pow2_pages, dtype=spec.dtype, head_dim=spec.head_dim)


def _check_q(state, q):
    s = state.spec
    if q.ndim != 4 or q.shape[0] != s.num_streams or q.shape[3] != s.head_dim or q.shape[2] % s.num_heads:
        raise ValueError(
            f"q: expected [streams={s.num_streams}, tokens, heads (a multiple of {s.num_heads}), "
            f"head_dim={s.head_dim}], got shape {tuple(q.shape)}"
        )


def attention(state: FrameCacheState, layer, q, *, impl: str = "auto", scale=None):
    """Attend ``q`` to everything visible in ``layer``'s cache.

    layer: int (static: the fused backends read the layer in place) or i32[]
    q: float[B, Tq, Hq, D]  (Hq a multiple of the cache's heads: GQA)
    returns q.dtype[B, Tq, Hq, D]; zeros for a stream with nothing cached.
    """
    _check_q(state, q)
    impl = _backend.choose("frame.attention", impl, **_context(state.spec))
    if isinstance(layer, int):
        if not 0 <= layer < state.spec.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {state.spec.num_layers}, got {layer}")
        return _attention_static(state, q, layer=layer, impl=impl, scale=scale)
    return _attention_traced(state, q, layer, impl=impl, scale=scale)


Q = ("streams", None, "heads", None)  # logical axes (``jaxkv.sharding``) of q and the output


def _attention(state: FrameCacheState, q, layer, impl: str, scale):
    if isinstance(layer, int):
        return on_devices(lambda st, q: _local(st, q, layer, impl, scale), state, q, axes=(Q,), out=Q)
    return on_devices(lambda st, q, l: _local(st, q, l, impl, scale), state, q, layer, axes=(Q, ()), out=Q)


def _local(state: FrameCacheState, q, layer, impl: str, scale):
    if not isinstance(layer, int):  # a traced index picks the layer's branch: no copy of its buffer
        layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, state.spec.num_layers - 1)
        branches = [lambda st, q, l=l: _local(st, q, l, impl, scale) for l in range(state.spec.num_layers)]
        return lax.switch(layer, branches, state, q)
    k, v = state.k[layer], state.v[layer]
    scales = (state.k_scale[layer], state.v_scale[layer]) if state.spec.quantized else None
    if impl == "reference":
        if scales:
            k, v = (dequantize_fp8_rows(x, s, jnp.float32) for x, s in zip((k, v), scales))
        return ref_attention(q, k, v, visible_mask(state), scale).astype(q.dtype)
    if q.dtype != state.spec.compute_dtype:
        fp8 = f", for its {state.spec.dtype} K/V" if state.spec.quantized else ""
        raise ValueError(
            f"q: expected dtype {state.spec.compute_dtype} (the cache's{fp8}) for impl={impl!r}, got {q.dtype}"
        )
    n = state.num_valid
    if impl == "xla":
        mask = state.token_id >= 0 if state.spec.pow2_pages else None
        return xla_attention(q, k, v, n, mask, scale, kv_scales=scales)
    if state.spec.pow2_pages:
        raise ValueError(f"impl={impl!r} needs exact pages (pow2_pages=False): padded rows need a mask")
    if impl in ("pallas", "cuda"):
        splits = prefix_splits(q.shape[1], q.shape[2], k.shape[1])
        if impl == "pallas":
            return prefix_attention(q, k, v, n, scale=scale, splits=splits)  # zeros where n == 0
        fp8 = dict(zip(("k_scale", "v_scale"), scales)) if scales else {}  # FP8 rows read in place
        return prefix_attention_cuda(q, k, v, n, scale=scale, splits=splits, **fp8)
    out = cudnn_attention(q, k, v, n, scale)
    return jnp.where((n > 0)[:, None, None, None], out, jnp.zeros_like(out))


_attention_static = jax.jit(_attention, static_argnames=("layer", "impl", "scale"))
_attention_traced = jax.jit(_attention, static_argnames=("impl", "scale"))
