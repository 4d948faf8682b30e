"""DeepSeek-V4's attention block in Flax NNX, over the hybrid cache.

``V4Attention`` is one layer's attention as DeepSeek-V4's inference code computes it, with
every cache operation done by ``jaxkv.hybrid``: the low-rank query (``wq_a``, RMSNorm,
``wq_b``, each head scaled to unit RMS, RoPE on its last 64 dims), the one K = V head
(``wkv``, RMSNorm, RoPE), the compressor projections of a CSA / HCA layer (float32) and
the CSA indexer's query and head weights, then ``compress`` / ``index_topk`` /
``attention`` / ``write_window``, the inverse RoPE on the output's last 64 dims, and the
grouped low-rank output projection (``wo_a`` per group of heads, ``wo_b``).

RoPE: SWA layers rotate by ``rope_theta`` (no YaRN); CSA / HCA layers by the cache's
compressed-entry RoPE (``HybridConfig.rope_theta`` with YaRN), as upstream does.
Matmuls take bf16 operands (the compressor's float32), norms and RoPE run in float32.
``load_upstream`` reads the weights of upstream's ``Attention`` module (its state dict,
FP8 weights with their block scales dequantized). Parity with upstream:
``tests/hybrid/test_upstream_parity.py`` (``$DSV4_SRC``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxkv import hybrid as H
from jaxkv.hybrid.ops import freqs_of
from jaxkv.math.compressor import rms_norm
from jaxkv.math.rotation import apply_rope_tail, rope_freqs


@dataclasses.dataclass(frozen=True)
class V4AttentionConfig:
    """The attention block's shapes; ``cache`` gives the layer schedule, entry width, window,
    indexer and the compressed layers' RoPE.

    Args:
      cache: the hybrid cache's config (its ``head_dim`` is the attention head width).
      dim: the model width (the block's input and output).
      num_heads: query heads (one K = V head).
      q_lora_rank: width of the low-rank query.
      o_groups, o_lora_rank: the output projection's head groups and their rank.
      rope_theta: RoPE base of SWA layers.
      norm_eps: RMSNorm epsilon (also the per-head query scaling's).
    """

    cache: H.HybridConfig
    dim: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    o_groups: int = 16
    o_lora_rank: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("dim", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"o_groups: expected a divisor of num_heads={self.num_heads}, got {self.o_groups}")


# DeepSeek-V4-Pro's attention (its inference/config.json), on the V4-Pro cache schedule.
V4_PRO_ATTENTION = V4AttentionConfig(cache=H.V4_PRO)


def _rms_norm(x, w, eps):
    """DeepSeek's RMSNorm (``math.compressor.rms_norm``) on x: bf16[..., n] -> bf16."""
    return rms_norm(x.astype(jnp.float32), w, eps).astype(x.dtype)


def _linear(din, dout, dtype, rngs):
    return nnx.Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class _Compressor(nnx.Module):
    """A compressor's learned tensors: its kv / score projections (float32), bias and norm."""

    def __init__(self, dim, width, ratio, coff, rngs):
        self.wkv = _linear(dim, coff * width, jnp.float32, rngs)
        self.wgate = _linear(dim, coff * width, jnp.float32, rngs)
        self.ape = nnx.Param(0.02 * jax.random.normal(rngs.params(), (ratio, coff * width), jnp.float32))
        self.norm = nnx.Param(jnp.ones((width,), jnp.float32))

    def inputs(self, xf):
        """(kv, score, params) for ``hybrid.compress``: xf f32[B, T, dim]."""
        return self.wkv(xf), self.wgate(xf), H.CompressorParams(self.ape[...], self.norm[...])


class V4Attention(nnx.Module):
    """Layer ``layer``'s attention block; call it with the cache state and the step."""

    def __init__(self, config: V4AttentionConfig, layer: int, *, rngs: nnx.Rngs):
        c, hc = config, config.cache
        if not isinstance(layer, int) or not 0 <= layer < hc.num_layers:
            raise ValueError(f"layer: expected an int in [0, {hc.num_layers}), got {layer!r}")
        self.config, self.layer, self.kind = config, layer, hc.kind(layer)
        bf16, D = jnp.bfloat16, hc.head_dim
        self.wq_a = _linear(c.dim, c.q_lora_rank, bf16, rngs)
        self.q_norm = nnx.Param(jnp.ones((c.q_lora_rank,), jnp.float32))
        self.wq_b = _linear(c.q_lora_rank, c.num_heads * D, bf16, rngs)
        self.wkv = _linear(c.dim, D, bf16, rngs)
        self.kv_norm = nnx.Param(jnp.ones((D,), jnp.float32))
        group = c.num_heads * D // c.o_groups
        self.wo_a = nnx.Param(
            (jax.random.normal(rngs.params(), (c.o_groups, c.o_lora_rank, group), jnp.float32) * group**-0.5).astype(
                bf16
            )
        )  # bf16[G, R, H * D / G]
        self.wo_b = _linear(c.o_groups * c.o_lora_rank, c.dim, bf16, rngs)
        self.sink = nnx.Param(jnp.zeros((c.num_heads,), jnp.float32))
        ratio = hc.compress_ratios[layer]
        self.compressor = _Compressor(c.dim, D, ratio, 2 if self.kind == H.CSA else 1, rngs) if ratio else None
        if self.kind == H.CSA:
            self.index_wq_b = _linear(c.q_lora_rank, hc.index_heads * hc.index_dim, bf16, rngs)
            self.index_weights = _linear(c.dim, hc.index_heads, bf16, rngs)
            self.index_compressor = _Compressor(c.dim, hc.index_dim, ratio, 2, rngs)

    def freqs(self):
        """f32[rope_dim / 2]: this layer's RoPE frequencies."""
        c, hc = self.config, self.config.cache
        if self.kind == H.SWA:
            return rope_freqs(hc.rope_dim, c.rope_theta, hc.rope_factor, 0, hc.beta_fast, hc.beta_slow)
        return freqs_of(hc)  # the compressed entries' RoPE

    def __call__(self, state: H.HybridCacheState, step: H.Step, x, *, impl: str = "auto"):
        """One step of this layer.

        state: the hybrid cache (its config must be this block's ``config.cache``)
        step: from ``hybrid.prepare_forward``: row b is request ``step.slot[b]``
        x: bf16[B, T, dim] the layer's input for the step's tokens
        impl: ``hybrid.attention``'s
        Returns (state, bf16[B, T, dim]); rows past ``step.num_tokens`` are padding.
        """
        c, hc, layer = self.config, self.config.cache, self.layer
        if state.config != hc:
            raise ValueError(f"state: expected a cache of this block's config.cache, got one of {state.config}")
        B = step.slot.shape[0]
        if x.ndim != 3 or x.shape[0] != B or x.shape[2] != c.dim or x.dtype != jnp.bfloat16:
            raise ValueError(f"x: expected bf16[{B}, T, {c.dim}], got {x.dtype}{list(x.shape)}")
        T, D, rd, freqs = x.shape[1], hc.head_dim, hc.rope_dim, self.freqs()
        pos = H.query_positions(step, T)  # i32[B, T]

        qr = _rms_norm(self.wq_a(x), self.q_norm[...], c.norm_eps)
        q = self.wq_b(qr).reshape(B, T, c.num_heads, D)
        q = apply_rope_tail(_rms_norm(q, 1.0, c.norm_eps), pos[..., None], freqs, rd)
        kv = apply_rope_tail(_rms_norm(self.wkv(x), self.kv_norm[...], c.norm_eps), pos, freqs, rd)

        idx = None
        if self.compressor is not None:
            xf = x.astype(jnp.float32)
            index = self.index_compressor.inputs(xf) if self.kind == H.CSA else None
            state = H.compress(state, step, layer, *self.compressor.inputs(xf), index=index)
        if self.kind == H.CSA:
            iq = self.index_wq_b(qr).reshape(B, T, hc.index_heads, hc.index_dim)
            iq = H.index_query(state, apply_rope_tail(iq, pos[..., None], freqs, rd))
            w = self.index_weights(x).astype(jnp.float32) * (hc.index_dim**-0.5 * hc.index_heads**-0.5)
            state, idx = H.index_topk(state, step, layer, iq, w)
        if T == 1:  # decode: the window written first, attention reads the token from the ring
            state = H.write_window(state, step, layer, kv)
            o = H.attention(state, step, layer, q, self.sink[...], None, idx, impl=impl)
            state = H.after_reads(state, o)
        else:  # a chunk's tokens would overwrite ring slots its earlier queries see
            o = H.attention(state, step, layer, q, self.sink[...], kv, idx, impl=impl)
            state = H.after_reads(state, o)
            state = H.write_window(state, step, layer, kv)

        o = apply_rope_tail(o, pos[..., None], -freqs, rd)  # the inverse rotation
        o = jnp.einsum(
            "btgd,grd->btgr", o.reshape(B, T, c.o_groups, -1), self.wo_a[...], preferred_element_type=jnp.float32
        ).astype(jnp.bfloat16)
        return state, self.wo_b(o.reshape(B, T, -1))


# --- upstream weights ---------------------------------------------------------------------
# upstream's name (relative to its Attention module) -> this block's parameter, and whether it is
# a linear weight ([out, in] there, a kernel [in, out] here)
_NAMES = {
    "wq_a.weight": ("wq_a.kernel", True),
    "q_norm.weight": ("q_norm", False),
    "wq_b.weight": ("wq_b.kernel", True),
    "wkv.weight": ("wkv.kernel", True),
    "kv_norm.weight": ("kv_norm", False),
    "wo_a.weight": ("wo_a", False),
    "wo_b.weight": ("wo_b.kernel", True),
    "attn_sink": ("sink", False),
    "compressor.wkv.weight": ("compressor.wkv.kernel", True),
    "compressor.wgate.weight": ("compressor.wgate.kernel", True),
    "compressor.ape": ("compressor.ape", False),
    "compressor.norm.weight": ("compressor.norm", False),
    "indexer.wq_b.weight": ("index_wq_b.kernel", True),
    "indexer.weights_proj.weight": ("index_weights.kernel", True),
    "indexer.compressor.wkv.weight": ("index_compressor.wkv.kernel", True),
    "indexer.compressor.wgate.weight": ("index_compressor.wgate.kernel", True),
    "indexer.compressor.ape": ("index_compressor.ape", False),
    "indexer.compressor.norm.weight": ("index_compressor.norm", False),
}


def _variable(block, path):
    obj = block
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _numpy(t) -> np.ndarray:
    """A tensor as numpy; torch's FP8 / E8M0 tensors by their bytes (numpy has no such dtypes)."""
    if not hasattr(t, "detach"):
        return np.asarray(t)
    import torch  # only reached with a torch tensor: torch stays an optional dependency

    t = t.detach().cpu()
    fp8 = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e8m0fnu: ml_dtypes.float8_e8m0fnu}
    return t.view(torch.uint8).numpy().view(fp8[t.dtype]) if t.dtype in fp8 else t.float().numpy()


def _weight(weights, name):
    """f32[out, in]: ``name``.weight, times its 128 x 128 block scales ``name``.scale if FP8."""
    w = _numpy(weights[f"{name}.weight"])
    if w.dtype != ml_dtypes.float8_e4m3fn:
        return w.astype(np.float32)
    if f"{name}.scale" not in weights:
        raise ValueError(f"weights: {name}.weight is FP8 but {name}.scale (its block scales) is missing")
    s = _numpy(weights[f"{name}.scale"]).astype(np.float32)
    return w.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]


def load_upstream(block: V4Attention, weights: Mapping[str, object]) -> None:
    """Set ``block``'s parameters from upstream's ``Attention`` state dict (names relative to
    the module, e.g. ``wq_a.weight``; numpy arrays or torch tensors). FP8 weights are
    dequantized with their ``.scale`` (one per 128 x 128 block). Exactly the tensors of the
    block's layer kind, in upstream's shapes: anything missing, extra or misshapen raises."""
    expected = {src for src, (dst, _) in _NAMES.items() if _variable(block, dst) is not None}
    given = {k for k in weights if not k.endswith(".scale")}
    if given != expected:
        raise ValueError(
            f"weights: expected the {len(expected)} tensors of a {block.kind.upper()} layer, "
            f"missing {sorted(expected - given)}, unexpected {sorted(given - expected)}"
        )
    values = {}
    G, R, Dg = block.wo_a.shape
    for src in sorted(expected):
        dst, is_linear = _NAMES[src]
        var = _variable(block, dst)
        want = var.shape[::-1] if is_linear else (G * R, Dg) if src == "wo_a.weight" else var.shape
        # every ``.weight`` through _weight: FP8 ones (wo_a too, FP8 in DeepSeek's checkpoints) times their scales
        value = _weight(weights, src[: -len(".weight")]) if src.endswith(".weight") else _numpy(weights[src])
        if value.shape != tuple(want):
            raise ValueError(f"weights: {src}: expected shape {tuple(want)}, got {tuple(value.shape)}")
        values[dst] = var, value.T if is_linear else value.reshape(var.shape)
    for var, value in values.values():  # nothing set unless everything fits
        var.set_value(jnp.asarray(value, var.dtype))
