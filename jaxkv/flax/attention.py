"""StreamingGlobalAttention: a Flax NNX attention layer whose state is a frame cache."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxkv import frame
from jaxkv.flax.rope import apply_rope
from jaxkv.formats.fp8 import dequantize_fp8_rows, quantize_fp8_rows


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


class FrameCacheModule(nnx.Module):
    """A frame cache as NNX state (``self.state``: an ``nnx.Cache`` holding a ``FrameCacheState``).

    Share one between the global-attention layers of a model: the page bookkeeping runs
    once per frame (``begin_frame``), each layer then writes and reads only its own K/V
    buffers (``StreamingGlobalAttention(..., cache=shared, layer=i)``).
    """

    def __init__(self, spec: frame.FrameSpec):
        self.state = nnx.Cache(frame.init(spec))

    @property
    def spec(self) -> frame.FrameSpec:
        return self.state.get_value().spec

    def _apply(self, fn, *args, **kw):
        self.state.set_value(fn(self.state.get_value(), *args, **kw))

    def begin_frame(self, defer=False):
        """Start a frame on every layer: ``jaxkv.frame.begin_frame``."""
        self._apply(frame.begin_frame, defer)

    def append(self, k, v, defer=False):
        """Store one frame's K/V of every layer, k, v: [L, B, tokens_per_frame, H, D]:
        ``jaxkv.frame.append`` (one write for all layers, not one a layer)."""
        self._apply(frame.append, k, v, defer)

    def write(self, layer: int, k, v):
        """Store one layer's K/V of the current frame: ``jaxkv.frame.write_layer``."""
        self._apply(frame.write_layer, layer, k, v)

    def write_frames(self, layer: int, k, v, first_frame):
        """Store one layer's K/V of several begun frames: ``jaxkv.frame.write_frames``."""
        self._apply(frame.write_frames, layer, k, v, first_frame)

    def attend(self, q, layer: int, impl: str = "auto"):
        """``jaxkv.frame.attention`` over ``layer``'s visible keys."""
        return frame.attention(self.state.get_value(), layer, q, impl=impl)

    def resolve(self, keep):
        """Commit (``keep``) or roll back the deferred frame; keep: bool or bool[B]."""
        self._apply(frame.resolve, keep)

    def reset(self, streams=None):
        """Empty the given streams (bool[B], default all) for a new video."""
        self._apply(frame.reset, streams)


class StreamingGlobalAttention(nnx.Module):
    """Non-causal attention of one frame's tokens over a bounded memory of past frames.

    Each call projects the frame to q, k, v, normalizes and rotates q and k (the cache
    keeps rotated keys), stores k and v in the frame cache, attends q to everything the
    cache keeps visible — scale frames, the window, every frame's specials and the frame
    itself — and projects out. Works under ``nnx.jit`` and ``jaxkv.flax.CachedStep``.

    Two ways to hold the cache:

    * ``cache=None`` (default): the layer owns a one-layer ``FrameCacheModule`` built from the
      cache arguments (``jaxkv.frame.FrameSpec``'s) and each call appends a whole frame
      (``defer`` as in ``jaxkv.frame.append``; ``resolve`` / ``reset`` act on it).
      Layers made with ``nnx.vmap`` and driven by ``nnx.scan`` each hold their own.
    * ``cache=shared, layer=i``: layer ``i`` of a ``FrameCacheModule`` shared by the model's
      global layers (bookkeeping once per frame). The model calls
      ``shared.begin_frame(defer)`` before the layers and ``shared.resolve(keep)`` after.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        cache: FrameCacheModule | None = None,
        layer: int = 0,
        patches_per_frame: int | None = None,
        num_special: int = 6,
        scale_frames: int = 8,
        sliding_window: int = 64,
        max_frames: int = 1024,
        num_streams: int = 1,
        cache_dtype: str = "bfloat16",
        impl: str = "auto",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if impl not in frame.IMPLS:
            raise ValueError(f"impl: expected one of {frame.IMPLS}, got {impl!r}")
        self.proj = QKVProjection(dim, num_heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.impl = impl
        self.owns_cache = cache is None
        if cache is None:
            if patches_per_frame is None:
                raise ValueError("patches_per_frame: expected an int when the layer owns its cache (cache=None)")
            cache = FrameCacheModule(
                frame.FrameSpec(
                    num_layers=1,
                    num_heads=num_heads,
                    head_dim=dim // num_heads,
                    patches_per_frame=patches_per_frame,
                    num_special=num_special,
                    scale_frames=scale_frames,
                    sliding_window=sliding_window,
                    max_frames=max_frames,
                    num_streams=num_streams,
                    dtype=cache_dtype,
                )
            )
            layer = 0
        s = cache.spec
        if (s.num_heads, s.head_dim) != (num_heads, dim // num_heads):
            raise ValueError(
                f"cache: expected {num_heads} heads x {dim // num_heads} dims, got {s.num_heads} x {s.head_dim}"
            )
        if not 0 <= layer < s.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {s.num_layers} (the cache's layers), got {layer}")
        self.cache, self.layer = cache, layer

    @property
    def spec(self) -> frame.FrameSpec:
        return self.cache.spec

    def _check_x(self, x, frames_axis: str):
        s = self.spec
        dim = s.num_heads * s.head_dim
        if x.ndim != 3 or x.shape[1:] != (s.tokens_per_frame, dim):
            raise ValueError(
                f"x: expected [{frames_axis}, tokens_per_frame={s.tokens_per_frame}, dim={dim}] "
                f"(specials first, then patches), got shape {tuple(x.shape)}"
            )

    def __call__(self, x, cos, sin, *, defer=False):
        """One frame per stream.

        x: f[B, tokens_per_frame, dim];  cos, sin: f32[B, tokens_per_frame, head_dim/2]
        defer: bool or bool[B] — keep the frame pending until ``resolve`` (an owned cache
          only: a shared cache's owner passes it to ``begin_frame``)
        returns f[B, tokens_per_frame, dim]
        """
        self._check_x(x, f"streams={self.spec.num_streams}")
        if not self.owns_cache and defer is not False:
            raise ValueError("defer: a shared cache takes it in cache.begin_frame(defer), not per layer")
        cdt = self.spec.compute_dtype
        q, k, v = self.proj(x, cos, sin)
        if self.owns_cache:
            self.cache.begin_frame(defer)
        self.cache.write(self.layer, k.astype(cdt), v.astype(cdt))
        o = self.cache.attend(q.astype(cdt), self.layer, self.impl)
        return self.out(o.reshape(x.shape).astype(x.dtype))

    def _own_cache(self, what):
        if not self.owns_cache:
            raise ValueError(f"{what}: this layer's cache is shared; call it on the shared FrameCacheModule")
        return self.cache

    def resolve(self, keep):
        """Commit (``keep``) or roll back the deferred frame of an owned cache."""
        self._own_cache("resolve").resolve(keep)

    def reset(self, streams=None):
        """Empty an owned cache's streams (bool[B], default all) for a new video."""
        self._own_cache("reset").reset(streams)

    def dense(self, x, cos, sin, visible):
        """Reference without the cache: every frame of one stream at once, masked.

        x: f[F, tokens_per_frame, dim];  cos, sin: f32[F, tokens_per_frame, head_dim/2]
        visible: bool[F, F * tokens_per_frame]  keys frame f's queries see (token ids
          ``frame * tokens_per_frame + token``, as ``jaxkv.frame.visible_token_ids``)
        returns f[F, tokens_per_frame, dim]; K/V are rounded as the cache would store them
        (to its dtype, or FP8 codes and scales), attention runs in float32.
        """
        self._check_x(x, "frames")
        F, T, dim = x.shape
        if visible.shape != (F, F * T):
            raise ValueError(f"visible: expected bool[{F}, {F * T}], got {visible.dtype}{list(visible.shape)}")
        cdt = self.spec.compute_dtype
        q, k, v = (a.astype(cdt) for a in self.proj(x, cos, sin))
        if self.spec.quantized:
            k, v = (dequantize_fp8_rows(*quantize_fp8_rows(a), cdt) for a in (k, v))
        keys = jnp.broadcast_to(k.reshape(1, F * T, *k.shape[2:]), (F, F * T, *k.shape[2:]))
        vals = jnp.broadcast_to(v.reshape(1, F * T, *v.shape[2:]), keys.shape)
        o = frame.ref_attention(q, keys, vals, visible)
        return self.out(o.reshape(x.shape).astype(x.dtype))
