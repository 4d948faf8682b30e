"""Softmax attention in float32, and the log-sum-exp merge of partial attentions.

The reference every attention backend is tested against (also ``frame.attention``'s ``xla``
backend for a few queries on a GPU, where one masked pass beats a loop), and the merge that split-KV
backends (``frame.attention``'s cuDNN path, ``kernels.prefix_attention``) use to combine
key chunks: one definition of each.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST  # float32 math means float32 on GPUs too (not TF32)


def ref_attention(q, k, v, mask, scale=None):
    """Plain softmax attention in float32; rows with no visible key give zeros.

    q: float[B, Tq, Hq, D]; k, v: float[B, T, H, D] (Hq a multiple of H); mask: bool[B, T]
    returns float32[B, Tq, Hq, D]
    """
    B, Tq, Hq, D = q.shape
    H = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(B, Tq, H, Hq // H, D)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32), precision=HIGHEST) * scale
    logits = jnp.where(mask[:, None, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", p / jnp.where(denom > 0, denom, 1.0), v.astype(jnp.float32), precision=HIGHEST
    )
    return out.reshape(B, Tq, Hq, D)


def merge_partials(out, lse, *, base2: bool = False, sink=None):
    """Combine attentions over disjoint key chunks into the attention over their union.

    out: float[B, n, Tq, Hq, D] each chunk's normalized output;
    lse: f32[B, n, Tq, Hq] each chunk's log-sum-exp of its logits (natural log, or base 2
    with ``base2``), -inf for a chunk with no keys (its ``out`` is ignored, whatever it holds)
    sink: f32[Hq] or None: a per-head logit (natural log) added to every denominator (an
    attention sink: weight, no value)
    returns float32[B, Tq, Hq, D]; zeros where no chunk has keys
    """
    top = jnp.max(lse, axis=1, keepdims=True)
    if sink is not None:
        sink = jnp.asarray(sink, jnp.float32) * (math.log2(math.e) if base2 else 1.0)
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    exp = jnp.exp2 if base2 else jnp.exp
    w = exp(lse - top)[..., None]  # 0 for an empty chunk
    total = jnp.sum(w, axis=1)
    if sink is not None:
        total = total + exp(sink - top[:, 0])[..., None]
    merged = jnp.sum(jnp.where(w > 0, out.astype(jnp.float32), 0.0) * w, axis=1)
    return merged / jnp.where(total > 0, total, 1.0)
