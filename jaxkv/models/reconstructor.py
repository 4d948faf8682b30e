"""A streaming reconstruction transformer in lingbot-map's shape, with random weights.

Per frame: patch embedding (14x14 patches), then ``2 + num_registers`` special tokens
first (camera, registers, scale), then ``depth`` pairs of blocks — *frame* attention
within the frame, then *global* attention over the frame cache (one
``StreamingGlobalAttention`` per pair) — and two heads: a camera head on the camera
token (9 numbers: translation, quaternion, field of view, as VGGT's pose encoding) and a
depth head on the patches. The global layers share one ``FrameCacheModule`` (one page
structure, bookkeeping once per frame). Positions are 3D (frame, row, column) and rotate q and k
before the keys enter the cache.

Keyframes: with ``keyframe_threshold`` set, every frame is appended deferred; after the
frame's forward pass a frame whose mean absolute pixel change since the last keyframe is
below the threshold is rolled back from the cache (scale frames always stay).
The decision is a traced boolean: the whole step is one jitted function.

``dense`` runs the same model over a whole clip at once, each frame's global attention
masked to what the cache showed it — the reference the streaming path is tested against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import frame
from jaxkv.flax import FrameCacheModule, QKVProjection, StreamingGlobalAttention, axial_rope


@dataclasses.dataclass(frozen=True)
class ReconstructorConfig:
    """Sizes and cache policy. Defaults: lingbot-map at 518x378 (999 patches, 24 layer pairs)."""

    height: int = 378
    width: int = 518
    patch_size: int = 14
    dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    num_registers: int = 4
    scale_frames: int = 8
    sliding_window: int = 64
    max_frames: int = 1024
    num_streams: int = 1
    keyframe_threshold: float | None = None
    cache_dtype: str = "bfloat16"
    dtype: str = "float32"
    param_dtype: str = "float32"
    impl: str = "auto"
    rope_theta: float = 100.0

    def __post_init__(self):
        if self.height % self.patch_size or self.width % self.patch_size:
            raise ValueError(
                f"height, width: expected multiples of patch_size={self.patch_size}, got {self.height}x{self.width}"
            )
        if self.dim % self.num_heads:
            raise ValueError(f"dim: expected a multiple of num_heads={self.num_heads}, got {self.dim}")

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // self.patch_size, self.width // self.patch_size

    @property
    def patches_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_special(self) -> int:
        return 2 + self.num_registers

    @property
    def tokens_per_frame(self) -> int:
        return self.num_special + self.patches_per_frame

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def cache_spec(self) -> frame.FrameSpec:
        """The FrameSpec of the cache the model holds (the demo sizes its memory by it)."""
        return frame.FrameSpec(
            num_layers=self.depth,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            patches_per_frame=self.patches_per_frame,
            num_special=self.num_special,
            scale_frames=self.scale_frames,
            sliding_window=self.sliding_window,
            max_frames=self.max_frames,
            num_streams=self.num_streams,
            dtype=self.cache_dtype,
        )


LINGBOT_518 = ReconstructorConfig()
SMALL = ReconstructorConfig(
    height=42,
    width=56,
    dim=64,
    depth=2,
    num_heads=4,
    scale_frames=2,
    sliding_window=4,
    max_frames=128,
    cache_dtype="float32",
)


class Mlp(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(dim, hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class FrameAttention(nnx.Module):
    """Attention among one frame's own tokens (no cache)."""

    def __init__(self, dim: int, num_heads: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.proj = QKVProjection(dim, num_heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin):
        q, k, v = self.proj(x, cos, sin)
        return self.out(jax.nn.dot_product_attention(q, k, v).reshape(x.shape))


class Block(nnx.Module):
    """Pre-norm residual block around an attention module and an MLP."""

    def __init__(self, attn: nnx.Module, dim: int, mlp_ratio: float, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn = attn
        self.norm2 = nnx.LayerNorm(dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *args, **kw):
        x = x + self.attn(self.norm1(x), *args, **kw)
        return x + self.mlp(self.norm2(x))

    def dense(self, x, *args):
        x = x + self.attn.dense(self.norm1(x), *args)
        return x + self.mlp(self.norm2(x))


class StreamingReconstructor(nnx.Module):
    """See the module docstring. ``model(images)`` is one streaming step."""

    def __init__(self, config: ReconstructorConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs)
        p = c.patch_size
        self.patch_embed = nnx.Linear(3 * p * p, c.dim, **kw)
        init = nnx.initializers.normal(0.02)
        self.special_tokens = nnx.Param(
            init(rngs.params(), (c.num_special, c.dim), kw["param_dtype"])
        )  # camera, registers, scale
        self.frame_blocks = nnx.List(
            [Block(FrameAttention(c.dim, c.num_heads, **kw), c.dim, c.mlp_ratio, **kw) for _ in range(c.depth)]
        )
        self.cache = FrameCacheModule(c.cache_spec)
        self.global_blocks = nnx.List(
            [
                Block(
                    StreamingGlobalAttention(c.dim, c.num_heads, cache=self.cache, layer=i, impl=c.impl, **kw),
                    c.dim,
                    c.mlp_ratio,
                    **kw,
                )
                for i in range(c.depth)
            ]
        )
        self.norm = nnx.LayerNorm(c.dim, **kw)
        self.camera_head = nnx.Linear(c.dim, 9, **kw)
        self.depth_head = nnx.Linear(c.dim, p * p, **kw)
        self.frame_index = nnx.Cache(jnp.zeros((c.num_streams,), jnp.int32))
        self.last_keyframe = nnx.Cache(jnp.zeros((c.num_streams, c.height, c.width, 3), jnp.float32))

    # ------------------------------------------------------------ pieces
    def _check_images(self, images, batch_name: str):
        c = self.config
        if images.ndim != 4 or images.shape[1:] != (c.height, c.width, 3):
            raise ValueError(
                f"images: expected f32[{batch_name}, {c.height}, {c.width}, 3], got {images.dtype}{list(images.shape)}"
            )

    def tokens(self, images):
        """f[N, H, W, 3] -> f[N, tokens_per_frame, dim]: specials, then patches in row-major order."""
        c = self.config
        (gh, gw), p = c.grid, c.patch_size
        n = images.shape[0]
        patches = images.reshape(n, gh, p, gw, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, gh * gw, p * p * 3)
        x = self.patch_embed(patches.astype(jnp.dtype(c.dtype)))
        special = jnp.broadcast_to(self.special_tokens[...].astype(x.dtype), (n, c.num_special, c.dim))
        return jnp.concatenate([special, x], axis=1)

    def rope(self, frame_index):
        """i32[N] -> cos, sin f32[N, tokens_per_frame, head_dim/2] over (frame, row, column).

        Specials sit at (frame, 0, 0); patch (r, c) at (frame, r + 1, c + 1).
        """
        c = self.config
        gh, gw = c.grid
        rows, cols = jnp.meshgrid(jnp.arange(gh) + 1, jnp.arange(gw) + 1, indexing="ij")
        rc = jnp.concatenate(
            [jnp.zeros((c.num_special, 2), jnp.int32), jnp.stack([rows.ravel(), cols.ravel()], -1).astype(jnp.int32)]
        )
        f = jnp.broadcast_to(frame_index[:, None, None], (frame_index.shape[0], c.tokens_per_frame, 1))
        pos = jnp.concatenate([f, jnp.broadcast_to(rc, (frame_index.shape[0],) + rc.shape)], -1)
        return axial_rope(pos, c.head_dim, c.rope_theta)

    def heads(self, x):
        """f[N, T, dim] -> camera f32[N, 9], depth f32[N, H, W] (positive)."""
        c = self.config
        (gh, gw), p = c.grid, c.patch_size
        x = self.norm(x)
        camera = self.camera_head(x[:, 0]).astype(jnp.float32)
        d = self.depth_head(x[:, c.num_special :]).astype(jnp.float32)
        d = d.reshape(-1, gh, gw, p, p).transpose(0, 1, 3, 2, 4).reshape(-1, c.height, c.width)
        return camera, jax.nn.softplus(d)

    # ------------------------------------------------------------ streaming
    def __call__(self, images):
        """One frame per stream: images f[B, H, W, 3] in [0, 1].

        Returns a dict: camera f32[B, 9], depth f32[B, H, W], keep bool[B] (whether the
        frame stays in the caches: always true without ``keyframe_threshold``).
        """
        c = self.config
        self._check_images(images, f"streams={c.num_streams}")
        t = self.frame_index.get_value()
        x = self.tokens(images)
        cos, sin = self.rope(t)
        defer = c.keyframe_threshold is not None
        self.cache.begin_frame(defer)  # page bookkeeping once for all global layers
        for fb, gb in zip(self.frame_blocks, self.global_blocks):
            x = gb(fb(x, cos, sin), cos, sin)
        camera, depth = self.heads(x)
        keep = jnp.ones((c.num_streams,), jnp.bool_)
        if defer:
            last = self.last_keyframe.get_value()
            motion = jnp.mean(jnp.abs(images.astype(jnp.float32) - last), axis=(1, 2, 3))
            keep = (t < c.scale_frames) | (motion >= c.keyframe_threshold)
            self.cache.resolve(keep)
            self.last_keyframe.set_value(jnp.where(keep[:, None, None, None], images.astype(jnp.float32), last))
        self.frame_index.set_value(t + 1)
        return {"camera": camera, "depth": depth, "keep": keep}

    def reset(self):
        """Forget every stream's frames (a new video)."""
        self.cache.reset()
        self.frame_index.set_value(jnp.zeros_like(self.frame_index.get_value()))
        self.last_keyframe.set_value(jnp.zeros_like(self.last_keyframe.get_value()))

    # ------------------------------------------------------------ reference
    def dense(self, images, visible):
        """All frames of one clip at once, no cache.

        images: f[F, H, W, 3];  visible: bool[F, F * tokens_per_frame]  the keys (token ids
        ``frame * tokens_per_frame + token``) frame f's global attention sees.
        Returns camera f32[F, 9], depth f32[F, H, W].
        """
        self._check_images(images, "frames")
        x = self.tokens(images)
        cos, sin = self.rope(jnp.arange(images.shape[0], dtype=jnp.int32))
        for fb, gb in zip(self.frame_blocks, self.global_blocks):
            x = gb.dense(fb(x, cos, sin), cos, sin, visible)
        return self.heads(x)
