"""StreamingGlobalAttention: a Flax NNX attention layer whose state is a frame cache."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxkv import frame
from jaxkv.flax.rope import apply_rope


class QKVProjection(nnx.Module):
    """x -> q, k, v per head, q and k RMS-normalized per head and rotated (RoPE)."""

    def __init__(self, dim: int, num_heads: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if dim % num_heads:
            raise ValueError(f"dim: expected a multiple of num_heads={num_heads}, got {dim}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_norm = nnx.RMSNorm(self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.k_norm = nnx.RMSNorm(self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin):
        """x: f[B, T, dim]; cos, sin: f32[B, T, head_dim/2] -> q, k, v: f[B, T, H, head_dim]."""
        B, T, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.num_heads, self.head_dim), 3, axis=2)
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v


class StreamingGlobalAttention(nnx.Module):
    """Non-causal attention of one frame's tokens over a bounded memory of past frames.

    Each call projects the frame to q, k, v, normalizes and rotates q and k (the cache
    keeps rotated keys), appends k and v to this layer's frame cache (``self.cache``, an
    ``nnx.Cache`` holding a ``jaxkv.frame.FrameCacheState`` with one layer), attends q to
    everything the cache keeps visible — scale frames, the window, every frame's
    specials and the frame itself — and projects out. Works under ``nnx.jit`` (donate the
    module to update the cache in place) and stacked with ``nnx.vmap`` / ``nnx.scan``.

    Cache arguments are ``jaxkv.frame.FrameSpec``'s; ``impl`` picks the attention backend.
    """

    def __init__(self, dim: int, num_heads: int, *, patches_per_frame: int, num_special: int = 6,
                 scale_frames: int = 8, sliding_window: int = 64, max_frames: int = 1024,
                 num_streams: int = 1, cache_dtype: str = "bfloat16", impl: str = "auto",
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if impl not in frame.IMPLS:
            raise ValueError(f"impl: expected one of {frame.IMPLS}, got {impl!r}")
        self.proj = QKVProjection(dim, num_heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.impl = impl
        spec = frame.FrameSpec(num_layers=1, num_heads=num_heads, head_dim=dim // num_heads,
                               patches_per_frame=patches_per_frame, num_special=num_special,
                               scale_frames=scale_frames, sliding_window=sliding_window,
                               max_frames=max_frames, num_streams=num_streams, dtype=cache_dtype)
        self.cache = nnx.Cache(frame.init(spec))

    @property
    def spec(self) -> frame.FrameSpec:
        return self.cache.get_value().spec

    def _check_x(self, x, frames_axis: str):
        s = self.spec
        dim = s.num_heads * s.head_dim
        if x.ndim != 3 or x.shape[1:] != (s.tokens_per_frame, dim):
            raise ValueError(f"x: expected [{frames_axis}, tokens_per_frame={s.tokens_per_frame}, dim={dim}] "
                             f"(specials first, then patches), got shape {tuple(x.shape)}")

    def __call__(self, x, cos, sin, *, defer=False):
        """One frame per stream.

        x: f[B, tokens_per_frame, dim];  cos, sin: f32[B, tokens_per_frame, head_dim/2]
        defer: bool or bool[B] — keep the frame pending until ``resolve`` (keyframes)
        returns f[B, tokens_per_frame, dim]
        """
        self._check_x(x, f"streams={self.spec.num_streams}")
        state = self.cache.get_value()
        cdt = state.spec.jnp_dtype
        q, k, v = self.proj(x, cos, sin)
        state = frame.append(state, k[None].astype(cdt), v[None].astype(cdt), defer=defer)
        o = frame.attention(state, q.astype(cdt), 0, impl=self.impl)
        self.cache.set_value(state)
        return self.out(o.reshape(x.shape).astype(x.dtype))

    def resolve(self, keep):
        """Commit (``keep``) or roll back the deferred frame; keep: bool or bool[B]."""
        self.cache.set_value(frame.resolve(self.cache.get_value(), keep))

    def reset(self, streams=None):
        """Empty the cache of the given streams (bool[B], default all) for a new video."""
        self.cache.set_value(frame.reset(self.cache.get_value(), streams))

    def dense(self, x, cos, sin, visible):
        """Reference without the cache: every frame of one stream at once, masked.

        x: f[F, tokens_per_frame, dim];  cos, sin: f32[F, tokens_per_frame, head_dim/2]
        visible: bool[F, F * tokens_per_frame]  keys frame f's queries see (token ids
          ``frame * tokens_per_frame + token``, as ``jaxkv.frame.visible_token_ids``)
        returns f[F, tokens_per_frame, dim]; K/V are rounded to the cache dtype as the
        cache would store them, attention runs in float32.
        """
        self._check_x(x, "frames")
        F, T, dim = x.shape
        if visible.shape != (F, F * T):
            raise ValueError(f"visible: expected bool[{F}, {F * T}], got {visible.dtype}{list(visible.shape)}")
        cdt = self.spec.jnp_dtype
        q, k, v = (a.astype(cdt) for a in self.proj(x, cos, sin))
        keys = jnp.broadcast_to(k.reshape(1, F * T, *k.shape[2:]), (F, F * T, *k.shape[2:]))
        vals = jnp.broadcast_to(v.reshape(1, F * T, *v.shape[2:]), keys.shape)
        o = frame.ref_attention(q, keys, vals, visible)
        return self.out(o.reshape(x.shape).astype(x.dtype))
