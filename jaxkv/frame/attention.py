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
* ``cudnn``: cuDNN flash attention with the prefix length as the key length. A frame
  has few queries (262 at 224x224: 3 query tiles x 16 heads, under half an H100's SMs),
  so the keys are split into equal chunks (a free reshape: the capacity is a multiple of
  16 x 128 rows), each chunk attended as its own batch entry, and the chunks merged by
  their log-sum-exp (``jaxkv.math.merge_partials``) — FlashInfer's split-KV, on cuDNN.
* ``pallas``: ``jaxkv.kernels.prefix_attention``, a FlashAttention-3-style Mosaic GPU
  kernel (Hopper) whose key loop stops at the prefix length and masks only the last
  block, so the length costs nothing; split-KV as above where the queries are few.
* ``cuda``: ``jaxkv.kernels.prefix_attention_cuda``, the same design in CUDA
  (``cuda/prefix_attention.cu``; bf16, head_dim 64), the kernel the PyTorch drop-in
  launches on the same buffers.

``auto`` is ``pallas`` on a Hopper GPU, ``cudnn`` on other NVIDIA GPUs, ``xla`` elsewhere.
With power-of-two pages the prefix holds padding rows, which neither ``cudnn`` nor
``pallas`` masks, so ``auto`` picks ``xla`` there.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from jaxkv import _backend
from jaxkv.frame import tuning
from jaxkv.frame.state import FrameCacheState
from jaxkv.frame.views import visible_mask
from jaxkv.kernels.prefix_attention import prefix_attention, prefix_attention_cuda
from jaxkv.math.attention import HIGHEST, merge_partials, ref_attention
from jaxkv.sharding import on_devices

IMPLS = _backend.choices("frame.attention")


XLA_BLOCK = 512  # key rows per step of the ``xla`` backend


def xla_attention(q, k, v, num_valid, row_mask=None, scale=None, block: int = XLA_BLOCK):
    """Online-softmax attention over the key prefix ``[0, num_valid)``, one block per loop step.

    q: float[B, Tq, Hq, D]; k, v: float[B, T, H, D]; num_valid: i32[B];
    row_mask: bool[B, T] or None (rows inside the prefix to skip: page padding)
    returns q.dtype[B, Tq, Hq, D]
    """
    B, Tq, Hq, D = q.shape
    T, H = k.shape[1], k.shape[2]
    G = Hq // H
    block = min(block, T)
    scale = D**-0.5 if scale is None else scale
    if Tq * G <= tuning.XLA_ONE_PASS_QUERIES and tuning.branch_free():  # one masked pass, no loop
        ok = jnp.arange(T)[None] < num_valid[:, None]
        return ref_attention(q, k, v, ok if row_mask is None else ok & row_mask, scale).astype(q.dtype)
    qf = (q.astype(jnp.float32) * scale).reshape(B, Tq, H, G, D)

    def body(i, carry):
        m, l, acc = carry
        start = jnp.minimum(i * block, T - block)  # the last block may overlap the one before
        kb = lax.dynamic_slice_in_dim(k, start, block, axis=1).astype(jnp.float32)
        vb = lax.dynamic_slice_in_dim(v, start, block, axis=1).astype(jnp.float32)
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

    init = (jnp.full((B, H, G, Tq), -jnp.inf, jnp.float32), jnp.zeros((B, H, G, Tq), jnp.float32),
            jnp.zeros((B, H, G, Tq, D), jnp.float32))
    steps = (jnp.max(num_valid) + block - 1) // block
    _, l, acc = lax.fori_loop(0, steps, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Tq, Hq, D).astype(q.dtype)


def _cudnn_fwd(q, k, v, kv_len, scale):
    """cuDNN attention returning (out, float32 log-sum-exp [B, Hq, Tq]).

    ``jax.nn.dot_product_attention`` rounds the log-sum-exp to the output dtype (bf16),
    too coarse to merge chunks; the cuDNN op underneath returns it in float32.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    B, Tq = q.shape[:2]
    out, lse = fa.dot_product_attention(
        q, k, v, q_seqlen=jnp.full((B,), Tq, jnp.int32), kv_seqlen=kv_len, scale=scale,
        mask_type=fa.MaskType.PADDING, return_residual=True,
    )
    return out, lse


def cudnn_splits(q_len: int, q_heads: int, rows: int, sm_count: int = 132) -> int:
    """Key chunks for ``cudnn_attention`` (rule and constants in ``jaxkv.frame.tuning``)."""
    tiles = -(-q_len // tuning.CUDNN_Q_TILE) * q_heads
    n = 1
    while (n < tuning.CUDNN_MAX_SPLITS and tiles * n < tuning.CUDNN_TARGET_CTAS_PER_SM * sm_count
           and rows % (2 * n * 128) == 0):
        n *= 2
    return n


def cudnn_attention(q, k, v, num_valid, scale=None, splits=None):
    """cuDNN flash attention over the key prefix ``[0, num_valid)``, split over key chunks.

    q: bf16/f16[B, Tq, Hq, D]; k, v: same dtype [B, T, H, D]; num_valid: i32[B]
    splits: key chunks (T must split into whole 128-row tiles); None = ``cudnn_splits``
    returns q.dtype[B, Tq, Hq, D]
    """
    B, Tq, Hq, D = q.shape
    T, H = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    if splits is None:
        dev = jax.devices()[0]
        splits = cudnn_splits(Tq, Hq, T, getattr(dev, "core_count", 132) or 132)
    if splits == 1:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=num_valid,
                                            implementation="cudnn")
    if T % (splits * 128):
        raise ValueError(f"splits: {T} key rows do not split into {splits} chunks of whole 128-row tiles")
    C = T // splits
    starts = jnp.arange(splits, dtype=jnp.int32) * C
    lens = jnp.clip(num_valid[:, None] - starts[None], 0, C)  # [B, n]
    qc = jnp.broadcast_to(q[:, None], (B, splits, Tq, Hq, D)).reshape(B * splits, Tq, Hq, D)
    out, lse = _cudnn_fwd(qc, k.reshape(B * splits, C, H, D), v.reshape(B * splits, C, H, D),
                          jnp.maximum(lens, 1).reshape(-1), scale)
    out = out.reshape(B, splits, Tq, Hq, D)
    lse = jnp.transpose(lse.reshape(B, splits, Hq, Tq), (0, 1, 3, 2))  # [B, n, Tq, Hq]
    lse = jnp.where((lens > 0)[:, :, None, None], lse, -jnp.inf)  # an empty chunk ran on one row
    return merge_partials(out, lse).astype(q.dtype)


def wave_splits(q_len: int, q_heads: int, counts, sm_count: int) -> int:
    """Of the key-split counts ``counts`` (ascending; 1 when none), the one whose programs
    (128-query tiles x heads x splits) fill the SMs' waves best, the smallest on a tie: the rule
    of the Pallas kernel (``prefix_splits``) and of the drop-in's CUDA kernel
    (``torch_bridge.manager.cuda_splits``), which differ only in the counts they allow."""
    programs = -(-q_len // 128) * q_heads
    sm_count = max(sm_count, 1)
    best, best_fill = 1, 0.0
    for n in counts:
        fill = programs * n / (-(-programs * n // sm_count) * sm_count)
        if fill > best_fill + 1e-9:
            best, best_fill = n, fill
    return best


def prefix_splits(q_len: int, q_heads: int, rows: int, sm_count: int = 132) -> int:
    """Key chunks for ``impl="pallas"``: ``wave_splits`` over the powers of two <= 16 that
    keep chunks whole 256-row blocks (rule measured in ``jaxkv.frame.tuning``)."""
    return wave_splits(q_len, q_heads, [n for n in (1, 2, 4, 8, 16) if rows % (n * 256) == 0], sm_count)


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
    if impl == "reference":
        return ref_attention(q, k, v, visible_mask(state), scale).astype(q.dtype)
    if q.dtype != k.dtype:
        raise ValueError(f"q: expected dtype {k.dtype} (the cache's) for impl={impl!r}, got {q.dtype}")
    n = state.num_valid
    if impl == "xla":
        return xla_attention(q, k, v, n, state.token_id >= 0 if state.spec.pow2_pages else None, scale)
    if state.spec.pow2_pages:
        raise ValueError(f"impl={impl!r} needs exact pages (pow2_pages=False): padded rows need a mask")
    if impl in ("pallas", "cuda"):
        dev = jax.devices()[0]
        splits = prefix_splits(q.shape[1], q.shape[2], k.shape[1], getattr(dev, "core_count", 132) or 132)
        kernel = prefix_attention if impl == "pallas" else prefix_attention_cuda
        return kernel(q, k, v, n, scale=scale, splits=splits)  # zeros where n == 0
    out = cudnn_attention(q, k, v, n, scale)
    return jnp.where((n > 0)[:, None, None, None], out, jnp.zeros_like(out))


_attention_static = jax.jit(_attention, static_argnames=("layer", "impl", "scale"))
_attention_traced = jax.jit(_attention, static_argnames=("impl", "scale"))
