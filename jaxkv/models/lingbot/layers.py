"""The pieces every lingbot-map block is built from: MLP, self-attention projections with
qk-norm, LayerScale, the pre-norm block, the two RoPE variants and the resampling matrices.

Upstream runs the backbone and aggregator under bf16 autocast: matmuls in bf16, layer
norms and the residual stream in float32. ``dtype`` here is that matmul dtype; parameters
and the residual stream stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def linear(din: int, dout: int, dtype, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    """Weights stored in ``dtype`` (bf16 as upstream's autocast rounds them at every matmul)."""
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.truncated_normal(0.02),
        rngs=rngs,
    )


def layer_norm(dim: int, rngs: nnx.Rngs, eps: float = 1e-5, affine: bool = True) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        dim, epsilon=eps, use_bias=affine, use_scale=affine, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs
    )


class Mlp(nnx.Module):
    """fc1, exact GELU, fc2."""

    def __init__(self, din: int, hidden: int, dout: int, dtype, rngs: nnx.Rngs):
        self.fc1 = linear(din, hidden, dtype, rngs)
        self.fc2 = linear(hidden, dout, dtype, rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class LayerScale(nnx.Module):
    def __init__(self, dim: int, init: float):
        self.gamma = nnx.Param(jnp.full((dim,), init, jnp.float32))

    def __call__(self, x):
        return x * self.gamma[...]


class SelfAttention(nnx.Module):
    """qkv and output projections, optional per-head LayerNorm on q and k (upstream ``qk_norm``)."""

    def __init__(self, dim: int, num_heads: int, dtype, rngs: nnx.Rngs, qk_norm: bool = False):
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = linear(dim, 3 * dim, dtype, rngs)
        self.proj = linear(dim, dim, dtype, rngs)
        self.q_norm = layer_norm(self.head_dim, rngs) if qk_norm else None
        self.k_norm = layer_norm(self.head_dim, rngs) if qk_norm else None

    def qkv_heads(self, x):
        """x: [..., T, C] -> q, k, v: [..., T, H, D] (q, k normed)."""
        qkv = self.qkv(x).reshape(x.shape[:-1] + (3, self.num_heads, self.head_dim))
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def out(self, o):
        """o: [..., T, H, D] -> [..., T, C]."""
        return self.proj(o.reshape(o.shape[:-2] + (-1,)))


def dense_attention(q, k, v, dtype):
    """Softmax attention, every query over every key. q: [B, Tq, H, D]; k, v: [B, Tk, H, D]."""
    dt = jnp.dtype(dtype)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    if dt != jnp.float32 and jax.default_backend() == "gpu":  # cuDNN's fused kernel: no [Tq, Tk] logits
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        except (NotImplementedError, RuntimeError, ValueError):  # this cuDNN / shape: XLA's
            pass
    return jax.nn.dot_product_attention(q, k, v)


class Block(nnx.Module):
    """Pre-norm transformer block with LayerScale: ``x + ls1(attn(norm1 x))``, ``x + ls2(mlp(norm2 x))``.

    ``attend(q, k, v) -> o`` is the block's attention (dense within a frame, or through a
    cache); ``rotate(q, k) -> q, k`` its positional encoding.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        dtype,
        rngs: nnx.Rngs,
        *,
        qk_norm: bool = False,
        ls_init: float | None = 0.01,
        eps: float = 1e-5,
    ):
        self.dtype = jnp.dtype(dtype)
        self.norm1 = layer_norm(dim, rngs, eps)
        self.attn = SelfAttention(dim, num_heads, dtype, rngs, qk_norm=qk_norm)
        self.ls1 = LayerScale(dim, ls_init) if ls_init else None
        self.norm2 = layer_norm(dim, rngs, eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dim, dtype, rngs)
        self.ls2 = LayerScale(dim, ls_init) if ls_init else None

    def _scale(self, ls, x):
        return x if ls is None else ls(x)

    def __call__(self, x, attend=None, rotate=None):
        q, k, v = self.attn.qkv_heads(self.norm1(x))
        if rotate is not None:
            q, k = rotate(q, k)
        o = attend(q, k, v) if attend is not None else dense_attention(q, k, v, self.dtype)
        x = x + self._scale(self.ls1, self.attn.out(o))
        return x + self._scale(self.ls2, self.mlp(self.norm2(x)))


# ---------------------------------------------------------------- rotary encodings
def rope2d_tables(grid: tuple[int, int], num_special: int, head_dim: int, freq: float):
    """cos, sin: f32[T, head_dim] for upstream's 2D RoPE over one frame's tokens.

    Specials sit at (0, 0), patch (y, x) at (y + 1, x + 1). The first half of a head
    rotates by the row, the second by the column, each as a rotate-half RoPE.
    """
    gh, gw = grid
    ys, xs = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    pos = np.concatenate([np.zeros((num_special, 2), np.int64), np.stack([ys.ravel(), xs.ravel()], -1) + 1])  # [T, 2]
    f = head_dim // 2
    inv = (1.0 / freq ** (np.arange(0, f, 2, dtype=np.float32) / np.float32(f))).astype(np.float32)
    ang = pos[..., None].astype(np.float32) * inv  # [T, 2, f/2]
    ang = np.concatenate([ang, ang], -1).reshape(len(pos), head_dim)  # [rows half | cols half]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope2d(x, cos, sin):
    """x: [..., T, H, D]; cos, sin: [T, D]. Rotate-half within each of the two halves."""
    d = x.shape[-1]
    f, g = d // 2, d // 4
    rot = jnp.concatenate([-x[..., g:f], x[..., :g], -x[..., f + g :], x[..., f : f + g]], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return (x * c + rot * s).astype(x.dtype)


def rope3d_angles(dims: tuple[int, int, int], length: int, theta: float):
    """float64[length, sum(dims)//2] per axis: upstream's Wan 3D RoPE angles (f, h, w)."""
    out = []
    for d in dims:
        inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d)
        out.append(np.outer(np.arange(length, dtype=np.float64), inv))
    return out


def rope3d_tables(frame_index, static_hw, t_cos, t_sin):
    """cos, sin: f32[B, T, D/2] for tokens at (frame_index[b], h, w).

    frame_index: i32[B] (traced); static_hw: (cos, sin) f32[T, (dh + dw)/2] of the
    (h, w) part; t_cos, t_sin: f32[max_frames, dt/2] of the frame axis.
    """
    tc, ts = jnp.asarray(t_cos)[frame_index], jnp.asarray(t_sin)[frame_index]  # [B, dt/2]
    hc, hs = static_hw
    T = hc.shape[0]
    cos = jnp.concatenate(
        [jnp.broadcast_to(tc[:, None], (tc.shape[0], T, tc.shape[1])), jnp.broadcast_to(hc, (tc.shape[0],) + hc.shape)],
        -1,
    )
    sin = jnp.concatenate(
        [jnp.broadcast_to(ts[:, None], (ts.shape[0], T, ts.shape[1])), jnp.broadcast_to(hs, (ts.shape[0],) + hs.shape)],
        -1,
    )
    return cos, sin


def apply_rope3d(x, cos, sin):
    """x: [B, T, H, D]; cos, sin: [B, T, D/2]. Interleaved pairs (2i, 2i+1) rotate together."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(x.shape)


# ---------------------------------------------------------------- resampling matrices
def _aa_cubic(x, a=-0.5):
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def bicubic_aa_matrix(n_in: int, n_out: int) -> np.ndarray:
    """f64[n_out, n_in]: torch's ``interpolate(mode="bicubic", antialias=True)`` along one axis.

    The separable PIL-style filter torch uses with antialiasing (Keys cubic, a = -0.5,
    widened by the scale when downsampling, weights renormalised at the borders).
    """
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        w = _aa_cubic((np.arange(lo, hi) - center + 0.5) * inv)
        m[i, lo:hi] = w / w.sum() if w.sum() != 0 else w
    return m


def bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """f32[n_out, n_in]: ``interpolate(mode="bilinear", align_corners=True)`` along one axis."""
    m = np.zeros((n_out, n_in), np.float32)
    scale = np.float32((n_in - 1) / (n_out - 1)) if n_out > 1 else np.float32(0)
    for i in range(n_out):
        src = scale * np.float32(i)
        i0 = min(int(np.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        frac = np.float32(src - i0)
        m[i, i0] += 1 - frac
        m[i, i1] += frac
    return m


def resize(x, rows: np.ndarray, cols: np.ndarray):
    """x: [N, h, w, C] -> [N, h', w', C] by row and column matrices [h', h], [w', w]."""
    hp = jax.lax.Precision.HIGHEST
    x = jnp.einsum("ih,nhwc->niwc", jnp.asarray(rows, x.dtype), x, precision=hp)
    return jnp.einsum("jw,niwc->nijc", jnp.asarray(cols, x.dtype), x, precision=hp)
