"""The prediction heads: the causal camera head (its own never-evicted frame caches) and
the DPT head for depth (and points). The camera head runs in float32, as upstream's (autocast
off); the DPT head's convolutions in the config's dtype (see ``DPTHead``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import frame
from jaxkv.flax import FrameCacheModule
from jaxkv.models.lingbot.config import LingbotConfig
from jaxkv.models.lingbot.layers import (
    Block,
    Mlp,
    apply_rope3d,
    bilinear_matrix,
    dense_attention,
    layer_norm,
    linear,
    resize,
    rope3d_angles,
)

F32 = jnp.float32


def activate_pose(enc):
    """Translation and quaternion as they are, field of view through a ReLU (upstream's defaults)."""
    return jnp.concatenate([enc[..., :7], jax.nn.relu(enc[..., 7:])], axis=-1)


@functools.lru_cache(maxsize=16)
def camera_rope_tables(c: LingbotConfig):
    """((cos, sin) f32[frames, 20] of the frame axis, (cos, sin) f32[44] of (0, 0)): every
    camera token sits at (frame, 0, 0); upstream's table has 1024 frames at least."""
    t, h, w = rope3d_angles((40, 44, 44), max(c.max_frame_num, 1024), c.camera_rope_theta)
    hw = np.concatenate([h[0], w[0]])
    return (
        (np.cos(t).astype(np.float32), np.sin(t).astype(np.float32)),
        (np.cos(hw).astype(np.float32), np.sin(hw).astype(np.float32)),
    )


class CameraHead(nnx.Module):
    """Upstream's ``CameraCausalHead``: iterative refinement of a 9-number pose encoding
    from each frame's camera token, through ``trunk_depth`` blocks that attend over the
    camera tokens of earlier frames.

    Every (iteration, block) pair has its own cache layer: one token per frame, kept for
    the whole video (upstream never evicts them: its eviction needs more than one token
    per frame), ``max_frame_num`` frames at most.
    """

    def __init__(self, config: LingbotConfig, rngs: nnx.Rngs):
        c = config
        dim = 2 * c.dim
        self.config = c
        self.trunk = nnx.List([Block(dim, c.num_heads, 4.0, F32, rngs) for _ in range(c.camera_trunk_depth)])
        self.token_norm = layer_norm(dim, rngs)
        self.trunk_norm = layer_norm(dim, rngs)
        self.empty_pose_tokens = nnx.Param(jnp.zeros((9,), F32))
        self.embed_pose = linear(9, dim, F32, rngs)
        self.poseLN_modulation = linear(dim, 3 * dim, F32, rngs)
        self.adaln_norm = layer_norm(dim, rngs, eps=1e-6, affine=False)
        self.pose_branch = Mlp(dim, dim // 2, 9, F32, rngs)
        self.cache = FrameCacheModule(
            frame.FrameSpec(
                num_layers=c.camera_num_iterations * c.camera_trunk_depth,
                num_heads=c.num_heads,
                head_dim=dim // c.num_heads,
                patches_per_frame=1,
                num_special=0,
                scale_frames=0,
                sliding_window=c.max_frame_num,
                max_frames=c.max_frame_num,
                num_streams=c.num_streams,
                dtype="float32",
            )
        )
        self.frame_index = nnx.Cache(jnp.zeros((c.num_streams,), jnp.int32))  # every frame, for the camera RoPE

    def _rotate(self, frames):
        """frames: i32[B, S] -> rotate(q, k) for tokens at (frames, 0, 0), or None."""
        if not self.config.enable_camera_3d_rope:
            return None
        t, hw = camera_rope_tables(self.config)
        tc, ts = (jnp.asarray(a)[frames] for a in t)  # [B, S, 20]
        hc, hs = (jnp.broadcast_to(a, tc.shape[:2] + a.shape) for a in hw)
        cos, sin = jnp.concatenate([tc, hc], -1), jnp.concatenate([ts, hs], -1)
        return lambda q, k: (apply_rope3d(q, cos, sin), apply_rope3d(k, cos, sin))

    def _refine(self, tokens, attend, rotate):
        """tokens: f32[B, S, 2C] camera tokens -> pose encodings f32[B, S, 9] of the last pass."""
        c = self.config
        tokens = self.token_norm(tokens)
        pred = None
        for it in range(c.camera_num_iterations):
            src = jnp.broadcast_to(self.empty_pose_tokens[...], tokens.shape[:-1] + (9,)) if pred is None else pred
            shift, scale, gate = jnp.split(self.poseLN_modulation(jax.nn.silu(self.embed_pose(src))), 3, axis=-1)
            x = gate * (self.adaln_norm(tokens) * (1 + scale) + shift) + tokens
            for j, blk in enumerate(self.trunk):
                x = blk(x, attend=attend(it * c.camera_trunk_depth + j), rotate=rotate)
            delta = self.pose_branch(self.trunk_norm(x))
            pred = delta if pred is None else pred + delta
        return activate_pose(pred)

    def scale_frames(self, tokens):
        """Phase 1: tokens f32[B, S, 2C] attend to each other; each frame's K/V then enters the caches."""
        S = tokens.shape[1]
        frames = self.frame_index[...][:, None] + jnp.arange(S)
        kv = {}

        def attend(layer):
            def run(q, k, v):
                kv[layer] = (k, v)
                return dense_attention(q, k, v, F32)

            return run

        pose = self._refine(tokens, attend, self._rotate(frames))
        for s in range(S):
            self.cache.begin_frame()
            for layer, (k, v) in sorted(kv.items()):
                self.cache.write(layer, k[:, s : s + 1], v[:, s : s + 1])
        self.frame_index.set_value(self.frame_index[...] + S)
        return pose

    def stream_frame(self, tokens, keyframe):
        """Phase 2: tokens f32[B, 1, 2C]; a non-keyframe attends to the caches and itself, then is dropped."""
        self.cache.begin_frame(defer=~keyframe)

        def attend(layer):
            def run(q, k, v):
                self.cache.write(layer, k, v)
                return self.cache.attend(q, layer, impl="xla")

            return run

        pose = self._refine(tokens, attend, self._rotate(self.frame_index[...][:, None]))
        self.cache.resolve(keyframe)
        self.frame_index.set_value(self.frame_index[...] + 1)
        return pose


# ---------------------------------------------------------------- DPT
def conv(cin, cout, k, rngs, dtype, stride=1, bias=True):
    """A 'same' convolution computing in ``dtype`` (float32: at full precision, for parity)."""
    return nnx.Conv(
        cin,
        cout,
        (k, k),
        strides=(stride, stride),
        padding=[(k // 2, k // 2)] * 2,
        use_bias=bias,
        dtype=dtype,
        param_dtype=F32,
        precision=jax.lax.Precision.HIGHEST,
        rngs=rngs,
    )


class ConvTranspose(nnx.Module):
    """A transposed convolution whose kernel equals its stride (no overlap): one matmul, then a
    pixel shuffle. Kernel as torch's ``ConvTranspose2d``: [in, out, k, k]."""

    def __init__(self, cin, cout, k, rngs, dtype):
        self.k, self.dtype = k, dtype
        bound = 1 / np.sqrt(cout * k * k)
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (cin, cout, k, k), F32, -bound, bound))
        self.bias = nnx.Param(jnp.zeros((cout,), F32))

    def __call__(self, x):
        n, h, w, _ = x.shape
        y = jnp.einsum(
            "nhwi,iokl->nhkwlo",
            x.astype(self.dtype),
            self.weight[...].astype(self.dtype),
            precision=jax.lax.Precision.HIGHEST,
        )
        return y.reshape(n, h * self.k, w * self.k, -1) + self.bias[...].astype(self.dtype)


class ResidualConvUnit(nnx.Module):
    """Two 3x3 convolutions around a ReLU. Upstream's ReLU is in-place, so its skip path
    adds the *activated* input: ``relu(x) + conv2(relu(conv1(relu(x))))``."""

    def __init__(self, f, rngs, dtype):
        self.conv1 = conv(f, f, 3, rngs, dtype)
        self.conv2 = conv(f, f, 3, rngs, dtype)

    def __call__(self, x):
        x = jax.nn.relu(x)
        return self.conv2(jax.nn.relu(self.conv1(x))) + x


class FusionBlock(nnx.Module):
    def __init__(self, f, rngs, dtype, residual=True):
        self.resConfUnit1 = ResidualConvUnit(f, rngs, dtype) if residual else None
        self.resConfUnit2 = ResidualConvUnit(f, rngs, dtype)
        self.out_conv = conv(f, f, 1, rngs, dtype)

    def __call__(self, x, skip=None, size=None):
        if skip is not None:
            x = x + self.resConfUnit1(skip)
        x = self.resConfUnit2(x)
        size = size or (2 * x.shape[1], 2 * x.shape[2])
        x = resize(x, bilinear_matrix(x.shape[1], size[0]), bilinear_matrix(x.shape[2], size[1]))
        return self.out_conv(x)


class Scratch(nnx.Module):
    def __init__(self, out_channels, f, out_dim, rngs, dtype):
        self.layer1_rn, self.layer2_rn, self.layer3_rn, self.layer4_rn = (
            conv(oc, f, 3, rngs, dtype, bias=False) for oc in out_channels
        )
        self.refinenet1, self.refinenet2, self.refinenet3 = (FusionBlock(f, rngs, dtype) for _ in range(3))
        self.refinenet4 = FusionBlock(f, rngs, dtype, residual=False)
        self.output_conv1 = conv(f, f // 2, 3, rngs, dtype)
        self.output_conv2_0 = conv(f // 2, 32, 3, rngs, dtype)
        self.output_conv2_2 = conv(32, out_dim, 1, rngs, dtype)


def uv_embedding(h: int, w: int, channels: int, aspect: float):
    """f32[h, w, C]: upstream's sinusoidal embedding of a UV grid spanning the image diagonal, x 0.1.

    Computed in the graph from [h], [w] and [C/4] vectors: as a constant the full-resolution
    embedding (378 x 518 x 128) would be folded by XLA for minutes at compile time.
    """
    diag = (aspect**2 + 1) ** 0.5
    sx, sy = aspect / diag, 1 / diag
    xs = jnp.asarray(np.linspace(-sx * (w - 1) / w, sx * (w - 1) / w, w, dtype=np.float32))
    ys = jnp.asarray(np.linspace(-sy * (h - 1) / h, sy * (h - 1) / h, h, dtype=np.float32))
    omega = jnp.asarray(
        (1.0 / 100.0 ** (np.arange(channels // 4, dtype=np.float64) / (channels / 4))).astype(np.float32)
    )

    def emb(p):  # [n] -> [n, C/2]
        out = p[:, None] * omega
        return jnp.concatenate([jnp.sin(out), jnp.cos(out)], 1)

    ex, ey = emb(xs), emb(ys)  # u varies along the width, v along the height
    e = jnp.concatenate(
        [jnp.broadcast_to(ex[None], (h, w, channels // 2)), jnp.broadcast_to(ey[:, None], (h, w, channels // 2))], -1
    )
    return e * np.float32(0.1)


class DPTHead(nnx.Module):
    """Dense prediction from the four block groups' patch tokens: project, resize to four
    scales, fuse coarse to fine, upsample to the image and activate (value, confidence).

    Convolutions compute in the config's dtype; the token norm and the final activation
    run in float32. Upstream runs its heads in float32 (autocast off); the port keeps bf16
    convolutions, whose extra depth rounding ``tests/test_lingbot_parity.py`` bounds, because
    float32 ones cost as much time and far more compile-time memory (docs/models.md)."""

    def __init__(
        self,
        config: LingbotConfig,
        out_dim: int,
        activation: str,
        rngs: nnx.Rngs,
        features: int = 256,
        out_channels=(256, 512, 1024, 1024),
    ):
        dim, dt = 2 * config.dim, config.compute_dtype
        self.config = config
        self.activation = activation
        self.norm = layer_norm(dim, rngs)
        self.projects = nnx.List([conv(dim, oc, 1, rngs, dt) for oc in out_channels])
        self.resize_0 = ConvTranspose(out_channels[0], out_channels[0], 4, rngs, dt)
        self.resize_1 = ConvTranspose(out_channels[1], out_channels[1], 2, rngs, dt)
        self.resize_3 = conv(out_channels[3], out_channels[3], 3, rngs, dt, stride=2)
        self.scratch = Scratch(out_channels, features, out_dim, rngs, dt)

    def __call__(self, layers, patch_start: int):
        """layers: 4 x f32[N, T, 2C] -> (value f32[N, H, W, out_dim - 1], confidence f32[N, H, W])."""
        c = self.config
        gh, gw = c.grid
        H, W = c.height, c.width
        outs = []
        for i, x in enumerate(layers):
            x = self.norm(x[:, patch_start:]).reshape(x.shape[0], gh, gw, -1)
            x = self.projects[i](x)
            x = x + uv_embedding(gh, gw, x.shape[-1], W / H).astype(x.dtype)
            x = (self.resize_0, self.resize_1, lambda y: y, self.resize_3)[i](x)
            outs.append(x)
        s = self.scratch
        l1, l2, l3, l4 = s.layer1_rn(outs[0]), s.layer2_rn(outs[1]), s.layer3_rn(outs[2]), s.layer4_rn(outs[3])
        out = s.refinenet4(l4, size=l3.shape[1:3])
        out = s.refinenet3(out, l3, size=l2.shape[1:3])
        out = s.refinenet2(out, l2, size=l1.shape[1:3])
        out = s.refinenet1(out, l1)
        out = s.output_conv1(out)
        out = resize(
            out, bilinear_matrix(out.shape[1], gh * c.patch_size), bilinear_matrix(out.shape[2], gw * c.patch_size)
        )
        out = out + uv_embedding(out.shape[1], out.shape[2], out.shape[-1], W / H).astype(out.dtype)
        out = s.output_conv2_2(jax.nn.relu(s.output_conv2_0(out))).astype(F32)
        value, conf = out[..., :-1], 1 + jnp.exp(out[..., -1])
        if self.activation == "exp":
            value = jnp.exp(value)
        else:  # inv_log
            value = jnp.sign(value) * jnp.expm1(jnp.abs(value))
        return value, conf
