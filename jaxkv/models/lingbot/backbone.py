"""The patch embedding: DINOv2 with registers (upstream ``patch_embed``), patch tokens out.

A 14x14 convolution, a class token and the learned position embedding (trained at
``img_size`` a side, resized to the frame's grid with torch's antialiased bicubic
filter), then the registers, ``depth`` pre-norm blocks (LayerNorm eps 1e-6, LayerScale)
and a final norm whose patch rows are the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.lingbot.config import BACKBONES, LingbotConfig
from jaxkv.models.lingbot.layers import Block, bicubic_aa_matrix, layer_norm, resize

IMAGE_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGE_STD = np.array([0.229, 0.224, 0.225], np.float32)


class DinoV2(nnx.Module):
    def __init__(self, config: LingbotConfig, rngs: nnx.Rngs):
        dim, depth, heads = BACKBONES[config.patch_embed]
        p, dt = config.patch_size, config.compute_dtype
        self.config = config
        self.patch_embed = nnx.Conv(
            3, dim, (p, p), strides=(p, p), padding="VALID", dtype=dt, param_dtype=jnp.float32, rngs=rngs
        )
        m = config.img_size // p
        init = nnx.initializers.truncated_normal(0.02)
        self.cls_token = nnx.Param(1e-6 * jax.random.normal(rngs.params(), (dim,)))
        self.pos_embed = nnx.Param(init(rngs.params(), (m * m + 1, dim)))
        self.register_tokens = nnx.Param(1e-6 * jax.random.normal(rngs.params(), (config.num_register_tokens, dim)))
        self.blocks = nnx.List([Block(dim, heads, 4.0, dt, rngs, ls_init=1.0, eps=1e-6) for _ in range(depth)])
        self.norm = layer_norm(dim, rngs, eps=1e-6)

    def position_embedding(self):
        """f32[1 + h*w, C]: the class row, then the trained grid resized to the frame's grid."""
        c = self.config
        m = c.img_size // c.patch_size
        gh, gw = c.grid
        pe = self.pos_embed[...]
        if (gh, gw) == (m, m):
            return pe
        grid = pe[1:].reshape(1, m, m, -1)
        grid = resize(grid, bicubic_aa_matrix(m, gh), bicubic_aa_matrix(m, gw))
        return jnp.concatenate([pe[:1], grid.reshape(gh * gw, -1)])

    def __call__(self, images):
        """images: f32[N, H, W, 3] in [0, 1] -> patch tokens f32[N, h*w, C]."""
        x = (images - IMAGE_MEAN) / IMAGE_STD
        x = self.patch_embed(x)  # [N, h, w, C]
        n = x.shape[0]
        x = x.reshape(n, -1, x.shape[-1])
        cls = jnp.broadcast_to(self.cls_token[...], (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding()
        reg = jnp.broadcast_to(self.register_tokens[...], (n,) + self.register_tokens.shape)
        x = jnp.concatenate([x[:, :1], reg, x[:, 1:]], axis=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 1 + self.config.num_register_tokens :]
