"""LingbotConfig: the static shape and cache policy of a lingbot-map ``GCTStream`` port."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# DINOv2 backbones with registers that upstream's ``patch_embed`` option names:
# name -> (dim, blocks, heads). ViT-g uses a SwiGLU FFN that this port does not carry.
BACKBONES = {
    "dinov2_vits14_reg": (384, 12, 6),
    "dinov2_vitb14_reg": (768, 12, 12),
    "dinov2_vitl14_reg": (1024, 24, 16),
}


@dataclasses.dataclass(frozen=True)
class LingbotConfig:
    """Defaults: the released model (``demo.py``) streaming 518x378 frames.

    height, width: frame size in pixels (multiples of ``patch_size``).
    img_size: the square size the backbone's position embedding was trained for
      (its grid is ``img_size // patch_size`` a side; resized bicubically per frame size).
    patch_embed: the DINOv2 backbone (``BACKBONES``); its width is the model's width.
    depth, num_heads: aggregator frame/global block pairs and their heads.
    enable_3d_rope: global blocks rotate by (keyframe index, row, column) instead of the
      2D (row, column) of frame blocks; ``max_frame_num`` bounds the keyframe index.
    num_scale_frames: frames attended together first (phase 1).
    kv_cache_scale_frames, kv_cache_sliding_window: the global caches keep the first
      ``kv_cache_scale_frames`` frames and the last ``kv_cache_sliding_window`` frames'
      patches, and every frame's special tokens (upstream's defaults, the only policy
      upstream's demo runs).
    camera_num_iterations: refinement passes of the camera head; each pass has its own
      caches (one per trunk block), never evicted, sized ``max_frame_num``.
    dtype: compute dtype (upstream's autocast) of the backbone, the aggregator, their
      caches and the DPT convolutions; their matmul weights are stored in it. Norms,
      residuals, the camera head and the final activations stay float32.
    impl: the frame-cache attention backend (``jaxkv.frame.attention``).
    kv_dtype: the global cache's K/V storage: None (``dtype``), or "float8_e4m3fn" (FP8
      with a scale per token and head, about half the bytes; the cache then takes and
      answers bfloat16: docs/kernels/frame_cache_fp8.md).
    """

    height: int = 378
    width: int = 518
    img_size: int = 518
    patch_size: int = 14
    patch_embed: str = "dinov2_vitl14_reg"
    num_register_tokens: int = 4
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    rope_freq: float = 100.0
    enable_3d_rope: bool = True
    max_frame_num: int = 1024
    selected_idx: tuple = (4, 11, 17, 23)
    enable_camera: bool = True
    camera_num_iterations: int = 4
    camera_trunk_depth: int = 4
    enable_camera_3d_rope: bool = False
    camera_rope_theta: float = 10000.0
    enable_depth: bool = True
    enable_point: bool = False
    num_scale_frames: int = 8
    kv_cache_scale_frames: int = 8
    kv_cache_sliding_window: int = 64
    num_streams: int = 1
    dtype: str = "bfloat16"
    impl: str = "auto"
    kv_dtype: str | None = None

    def __post_init__(self):
        p = self.patch_size
        if self.height % p or self.width % p or self.height < p or self.width < p:
            raise ValueError(
                f"height, width: expected positive multiples of patch_size={p}, got {self.height}x{self.width}"
            )
        if self.img_size % p:
            raise ValueError(f"img_size: expected a multiple of patch_size={p}, got {self.img_size}")
        if self.patch_embed not in BACKBONES:
            raise ValueError(f"patch_embed: expected one of {sorted(BACKBONES)}, got {self.patch_embed!r}")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(
                f"num_heads: expected a divisor of {self.dim} leaving a head_dim divisible by 4, got {self.num_heads}"
            )
        if self.enable_3d_rope and self.head_dim != 64:
            raise ValueError(
                f"enable_3d_rope: upstream's 3D RoPE splits a 64-dim head (20+22+22); "
                f"this config has head_dim={self.head_dim}"
            )
        if self.enable_camera_3d_rope and 2 * self.dim // self.num_heads != 128:
            raise ValueError(
                "enable_camera_3d_rope: upstream's camera RoPE splits a 128-dim head (40+44+44); "
                f"this config has {2 * self.dim // self.num_heads}"
            )
        if (
            sorted(self.selected_idx) != list(self.selected_idx)
            or len(self.selected_idx) != 4
            or not 0 <= self.selected_idx[0]
            or self.selected_idx[-1] >= self.depth
        ):
            raise ValueError(
                f"selected_idx: expected 4 increasing block indices below depth={self.depth}, got {self.selected_idx}"
            )
        for name in ("num_scale_frames", "max_frame_num", "num_streams", "camera_num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        if self.kv_cache_scale_frames < 0 or self.kv_cache_sliding_window < 1:
            raise ValueError(
                "kv_cache_scale_frames, kv_cache_sliding_window: expected >= 0 and >= 1, got "
                f"{self.kv_cache_scale_frames}, {self.kv_cache_sliding_window}"
            )
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype: expected 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.kv_dtype not in (None, "float8_e4m3fn"):
            raise ValueError(f"kv_dtype: expected None or 'float8_e4m3fn', got {self.kv_dtype!r}")

    @property
    def dim(self) -> int:
        return BACKBONES[self.patch_embed][0]

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // self.patch_size, self.width // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_special(self) -> int:
        """camera + registers + scale: the tokens before the patches of every frame."""
        return 2 + self.num_register_tokens

    @property
    def tokens_per_frame(self) -> int:
        return self.num_special + self.num_patches

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> LingbotConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def small(cls, **changes) -> LingbotConfig:
        """A ViT-S config for CPU tests: every component of the released model at 1/8 the size."""
        base = dict(
            height=42,
            width=56,
            img_size=56,
            patch_embed="dinov2_vits14_reg",
            enable_3d_rope=False,
            num_scale_frames=2,
            kv_cache_scale_frames=2,
            kv_cache_sliding_window=3,
            max_frame_num=64,
            dtype="float32",
        )
        return cls(**{**base, **changes})
