"""Attention of a query frame over a frame cache: ``reference`` (jnp, float32), ``xla``, ``cudnn``.

Non-causal, no positional encoding (RoPE is applied before append). The visible keys of
each stream are the prefix ``[0, num_valid)`` of its buffer (see ``FrameSpec``), so the
fused backends only need a per-stream key length: nothing is gathered or masked. With
power-of-two pages the prefix has padding rows, which need an explicit mask: ``auto``
then uses ``xla``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.frame.state import FrameCacheState
from jaxkv.frame.views import visible_mask

IMPLS = ("auto", "reference", "xla", "cudnn")


def ref_attention(q, k, v, mask, scale=None):
    """Plain softmax attention in float32; rows with no visible key give zeros.

    q: float[B, Tq, Hq, D]; k, v: float[B, T, H, D] (Hq a multiple of H); mask: bool[B, T]
    returns float32[B, Tq, Hq, D]
    """
    B, Tq, Hq, D = q.shape
    H = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(B, Tq, H, Hq // H, D)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32)) * scale
    logits = jnp.where(mask[:, None, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(denom > 0, denom, 1.0), v.astype(jnp.float32))
    return out.reshape(B, Tq, Hq, D)


def default_impl(spec) -> str:
    """The fastest backend available for ``spec`` on the default device."""
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not spec.pow2_pages and spec.dtype in ("bfloat16", "float16"):
        return "cudnn"
    return "xla"


def _layer_kv(state: FrameCacheState, layer):
    if isinstance(layer, int):
        if not 0 <= layer < state.spec.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {state.spec.num_layers}, got {layer}")
        return state.k[layer], state.v[layer]
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, state.spec.num_layers - 1)
    return (lax.dynamic_index_in_dim(state.k, layer, keepdims=False),
            lax.dynamic_index_in_dim(state.v, layer, keepdims=False))


def _check_q(state, q):
    s = state.spec
    if q.ndim != 4 or q.shape[0] != s.num_streams or q.shape[3] != s.head_dim or q.shape[2] % s.num_heads:
        raise ValueError(
            f"q: expected [streams={s.num_streams}, tokens, heads (a multiple of {s.num_heads}), "
            f"head_dim={s.head_dim}], got shape {tuple(q.shape)}"
        )


def attention(state: FrameCacheState, q, layer, *, impl: str = "auto", scale=None):
    """Attend ``q`` to everything visible in ``layer``'s cache.

    q: float[B, Tq, Hq, D]  (Hq a multiple of the cache's heads: GQA)
    layer: int (static: the fused backends read the layer in place) or i32[]
    returns q.dtype[B, Tq, Hq, D]; zeros for a stream with nothing cached.
    """
    _check_q(state, q)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = default_impl(state.spec)
    k, v = _layer_kv(state, layer)
    if impl == "reference":
        return ref_attention(q, k, v, visible_mask(state), scale).astype(q.dtype)
    if q.dtype != k.dtype:
        raise ValueError(f"q: expected dtype {k.dtype} (the cache's) for impl={impl!r}, got {q.dtype}")
    n = state.num_valid
    if state.spec.pow2_pages:
        if impl == "cudnn":
            raise ValueError("impl='cudnn' needs exact pages (pow2_pages=False): padded rows need a mask")
        mask = visible_mask(state)[:, None, None, :]
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
    else:
        out = jax.nn.dot_product_attention(
            q, k, v, scale=scale, key_value_seq_lengths=n, implementation=impl
        )
    return jnp.where((n > 0)[:, None, None, None], out, jnp.zeros_like(out))
