"""LingbotMap: lingbot-map's ``GCTStream`` streaming inference on jaxkv frame caches.

Per frame: DINOv2 patch tokens, six special tokens in front (camera, four registers,
scale; one learned variant for the first frame / the scale frames, one for the rest),
then ``depth`` pairs of a *frame* block (attention within the frame, 2D RoPE) and a
*global* block (attention over the frame cache: 3D RoPE whose frame index counts
keyframes, or the 2D RoPE). The outputs of four block pairs, frame and global side by
side, feed the camera head (its own caches) and the DPT depth (and point) heads.

Two phases, as upstream's ``inference_streaming``: ``scale_frames`` attends the first
``num_scale_frames`` frames to each other and fills the caches with them; then
``stream_frame`` runs one frame against the caches. A frame that is not a keyframe
(``keyframe`` false, a traced bool[B]) is appended deferred, attended, and rolled back
(``jaxkv.frame`` ``defer`` / ``resolve``): it sees the cache and itself and leaves no trace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import frame
from jaxkv.flax import FrameCacheModule
from jaxkv.models.lingbot.backbone import DinoV2
from jaxkv.models.lingbot.config import LingbotConfig
from jaxkv.models.lingbot.heads import CameraHead, DPTHead
from jaxkv.models.lingbot.layers import (
    Block,
    apply_rope2d,
    apply_rope3d,
    dense_attention,
    rope2d_tables,
    rope3d_angles,
    rope3d_tables,
)


def aggregator_spec(c: LingbotConfig) -> frame.FrameSpec:
    """The global blocks' cache: every layer, upstream's eviction policy, ``max_frame_num`` keyframes."""
    return frame.FrameSpec(
        num_layers=c.depth,
        num_heads=c.num_heads,
        head_dim=c.head_dim,
        patches_per_frame=c.num_patches,
        num_special=c.num_special,
        scale_frames=c.kv_cache_scale_frames,
        sliding_window=c.kv_cache_sliding_window,
        max_frames=c.max_frame_num,
        num_streams=c.num_streams,
        dtype=c.kv_dtype or c.dtype,
    )


@functools.lru_cache(maxsize=16)
def rope_tables(c: LingbotConfig) -> dict:
    """Host constants of a config's RoPEs: the 2D (cos, sin) f32[T, D]; with the 3D RoPE the
    frame axis (cos, sin) f32[max_frame_num, 10] and the (row, column) part f32[T, 22]."""
    out = {"2d": rope2d_tables(c.grid, c.num_special, c.head_dim, c.rope_freq)}
    if c.enable_3d_rope:
        t, h, w = rope3d_angles((20, 22, 22), c.max_frame_num, 10000.0)
        gh, gw = c.grid
        n = c.num_special
        rows = np.concatenate([np.arange(n), np.repeat(np.arange(gh), gw) + n])
        cols = np.concatenate([np.arange(n), np.tile(np.arange(gw), gh) + n])
        hw = np.concatenate([h[rows], w[cols]], -1)  # specials at (f, j, j), patches at (f, 6 + y, 6 + x)
        out["t"] = (np.cos(t).astype(np.float32), np.sin(t).astype(np.float32))
        out["hw"] = (np.cos(hw).astype(np.float32), np.sin(hw).astype(np.float32))
    return out


class Aggregator(nnx.Module):
    def __init__(self, config: LingbotConfig, rngs: nnx.Rngs):
        c = config
        self.config = c
        dt = c.compute_dtype
        self.patch_embed = DinoV2(c, rngs)
        self.frame_blocks = nnx.List(
            [Block(c.dim, c.num_heads, c.mlp_ratio, dt, rngs, qk_norm=True) for _ in range(c.depth)]
        )
        self.global_blocks = nnx.List(
            [Block(c.dim, c.num_heads, c.mlp_ratio, dt, rngs, qk_norm=True) for _ in range(c.depth)]
        )
        tok = lambda n: nnx.Param(1e-6 * jax.random.normal(rngs.params(), (2, n, c.dim)))  # noqa: E731
        self.camera_token, self.register_token, self.scale_token = tok(1), tok(c.num_register_tokens), tok(1)
        self.cache = FrameCacheModule(aggregator_spec(c))

    def _specials(self, first: bool, scale: bool):
        pick = lambda p, i: p[...][i]  # noqa: E731
        i, j = (0 if first else 1), (0 if scale else 1)
        return jnp.concatenate(
            [pick(self.camera_token, i), pick(self.register_token, i), pick(self.scale_token, j)]
        )  # [6, C]

    def _rotate_frame(self, q, k):
        cos, sin = rope_tables(self.config)["2d"]
        return apply_rope2d(q, cos, sin), apply_rope2d(k, cos, sin)

    def _global_rotation(self, frames):
        """frames: i32[B, S] keyframe indices -> rotate(q, k) for [B, S*T, H, D] tokens."""
        c = self.config
        tables = rope_tables(c)
        if not c.enable_3d_rope:
            cos, sin = (np.tile(a, (frames.shape[1], 1)) for a in tables["2d"])
            return lambda q, k: (apply_rope2d(q, cos, sin), apply_rope2d(k, cos, sin))
        B, S = frames.shape
        cs = [rope3d_tables(frames[:, s], tables["hw"], *tables["t"]) for s in range(S)]
        cos = jnp.concatenate([x[0] for x in cs], 1)
        sin = jnp.concatenate([x[1] for x in cs], 1)
        return lambda q, k: (apply_rope3d(q, cos, sin), apply_rope3d(k, cos, sin))

    def _embed(self, images, specials):
        """images: f32[B, S, H, W, 3]; specials: [S, 6, C] -> tokens f32[B, S, T, C]."""
        B, S = images.shape[:2]
        patches = self.patch_embed(images.reshape((B * S,) + images.shape[2:])).reshape(B, S, -1, self.config.dim)
        return jnp.concatenate([jnp.broadcast_to(specials, (B,) + specials.shape).astype(patches.dtype), patches], 2)

    def _run(self, x, global_attend, global_rotate):
        """x: f32[B, S, T, C] through every block pair -> the selected pairs' outputs f32[B, S, T, 2C]."""
        c = self.config
        B, S, T, C = x.shape
        out = []
        for i in range(c.depth):
            x = self.frame_blocks[i](x.reshape(B * S, T, C), rotate=self._rotate_frame)
            f = x.reshape(B, S, T, C)
            x = self.global_blocks[i](x.reshape(B, S * T, C), attend=global_attend(i), rotate=global_rotate)
            x = x.reshape(B, S, T, C)
            if i in c.selected_idx:
                out.append(jnp.concatenate([f, x], -1))
        return out

    def scale_frames(self, images):
        """Phase 1: images f32[B, S, H, W, 3] attend to each other; each layer stores its K/V of all S."""
        c = self.config
        S = images.shape[1]
        specials = jnp.stack([self._specials(first=s == 0, scale=True) for s in range(S)])
        x = self._embed(images, specials)
        start = self.cache.state.get_value().num_frames
        for _ in range(S):  # the S frames' rows chosen first; each layer then stores its K/V as it goes
            self.cache.begin_frame()
        dt = self.cache.spec.compute_dtype

        def attend(layer):
            def run(q, k, v):
                self.cache.write_frames(layer, k.astype(dt), v.astype(dt), start)
                # the write before this layer's attention, so its K/V die here: left free, XLA
                # ran every layer's write last and held all 24 layers' K/V (docs/models.md)
                state, q = jax.lax.optimization_barrier((self.cache.state.get_value(), q))
                self.cache.state.set_value(state)
                return dense_attention(q, k, v, c.compute_dtype)

            return run

        return self._run(x, attend, self._global_rotation(start[:, None] + jnp.arange(S)))

    def stream_frame(self, image, keyframe):
        """Phase 2: image f32[B, 1, H, W, 3] against the cache; keyframe: bool[B]."""
        c = self.config
        x = self._embed(image, self._specials(first=False, scale=False)[None])
        start = self.cache.state.get_value().num_frames  # keyframes so far: upstream's total_frames_processed
        self.cache.begin_frame(defer=~keyframe)
        dt = self.cache.spec.compute_dtype  # the cache's: bfloat16 for an FP8 cache

        def attend(layer):
            def run(q, k, v):
                self.cache.write(layer, k.astype(dt), v.astype(dt))
                return self.cache.attend(q.astype(dt), layer, impl=c.impl)

            return run

        out = self._run(x, attend, self._global_rotation(start[:, None]))
        self.cache.resolve(keyframe)
        return out


class LingbotMap(nnx.Module):
    """The port of ``GCTStream``; ``LingbotStream`` drives it over a video."""

    def __init__(self, config: LingbotConfig | None = None, *, rngs: nnx.Rngs | None = None):
        c = config or LingbotConfig()
        rngs = rngs or nnx.Rngs(0)
        self.config = c
        self.aggregator = Aggregator(c, rngs)
        self.camera_head = CameraHead(c, rngs) if c.enable_camera else None
        self.depth_head = DPTHead(c, 2, "exp", rngs) if c.enable_depth else None
        self.point_head = DPTHead(c, 4, "inv_log", rngs) if c.enable_point else None

    def reset(self):
        """Empty every cache for a new video."""
        self.aggregator.cache.reset()
        if self.camera_head is not None:
            self.camera_head.cache.reset()
            self.camera_head.frame_index.set_value(jnp.zeros_like(self.camera_head.frame_index[...]))

    def _heads(self, layers, camera):
        c = self.config
        S = layers[0].shape[1]
        out = {}
        if self.camera_head is not None:
            out["pose_enc"] = camera(layers[-1][:, :, 0].astype(jnp.float32))
        for name, head in (("depth", self.depth_head), ("world_points", self.point_head)):
            if head is not None:
                run = lambda xs, head=head: head([x.astype(jnp.float32) for x in xs], c.num_special)  # noqa: E731
                if S == 1:
                    value, conf = (y[:, None] for y in run([x[:, 0] for x in layers]))
                else:  # a frame at a time: S full-resolution maps at once would set the peak memory
                    per_frame = jax.lax.map(run, [jnp.moveaxis(x, 1, 0) for x in layers])
                    value, conf = (jnp.moveaxis(y, 0, 1) for y in per_frame)
                out[name], out[name + "_conf"] = value, conf
        return out

    def scale_frames(self, images):
        """Start a video: images f32[B, S, H, W, 3] in [0, 1] (S = the scale frames) -> predictions.

        Returns {pose_enc: [B, S, 9], depth: [B, S, H, W, 1], depth_conf: [B, S, H, W]} (and
        world_points / world_points_conf with the point head).
        """
        self._check(images, None)
        self.reset()
        layers = self.aggregator.scale_frames(images)
        return self._heads(layers, lambda t: self.camera_head.scale_frames(t))

    def stream_frame(self, image, keyframe):
        """One more frame: image f32[B, 1, H, W, 3]; keyframe: bool[B] (a traced value)."""
        self._check(image, 1)
        keyframe = jnp.broadcast_to(jnp.asarray(keyframe, jnp.bool_), (self.config.num_streams,))
        layers = self.aggregator.stream_frame(image, keyframe)
        return self._heads(layers, lambda t: self.camera_head.stream_frame(t, keyframe))

    def __call__(self, images, keyframe=True, *, phase: str = "stream"):
        """``phase="scale"``: ``scale_frames(images)``; ``"stream"``: ``stream_frame(images, keyframe)``."""
        if phase == "scale":
            return self.scale_frames(images)
        if phase == "stream":
            return self.stream_frame(images, keyframe)
        raise ValueError(f"phase: expected 'scale' or 'stream', got {phase!r}")

    def _check(self, images, frames):
        c = self.config
        want = (c.num_streams, frames or "S", c.height, c.width, 3)
        shape = tuple(images.shape)
        if (
            len(shape) != 5
            or shape[0] != c.num_streams
            or shape[2:] != (c.height, c.width, 3)
            or (frames is not None and shape[1] != frames)
        ):
            raise ValueError(
                f"images: expected float[{', '.join(map(str, want))}] (streams, frames, height, "
                f"width, RGB in [0, 1]), got shape {shape}"
            )
