"""Upstream's own ``GCTStream`` built from a lingbot-map checkout, for parity tests and
benchmarks side by side with the port. Needs torch; nothing here is used by the port.

The checkout comes from the caller (tests read ``LINGBOT_MAP_SRC``). Upstream's model
class mixes in ``huggingface_hub.PyTorchModelHubMixin`` for hub downloads only; where
``huggingface_hub`` is not installed (the offline GPU machine) a stand-in without those
methods is registered so the model imports.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import numpy as np

from jaxkv.models.lingbot.config import LingbotConfig

ENV = "LINGBOT_MAP_SRC"


def source() -> Path | None:
    """The lingbot-map checkout named by ``$LINGBOT_MAP_SRC``, or None."""
    src = os.environ.get(ENV)
    return Path(src) if src and (Path(src) / "lingbot_map" / "models" / "gct_stream.py").is_file() else None


def import_gct_stream(src: Path):
    """Upstream's ``GCTStream`` class from the checkout ``src``."""
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        hub = types.ModuleType("huggingface_hub")
        hub.PyTorchModelHubMixin = type("PyTorchModelHubMixin", (), {})
        sys.modules["huggingface_hub"] = hub
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    from lingbot_map.models.gct_stream import GCTStream

    return GCTStream


def build(config: LingbotConfig, src: Path, *, use_sdpa: bool, seed: int = 0, perturb: float = 0.3):
    """Upstream's model with ``config``'s architecture and cache policy, random weights.

    perturb: LayerScale gains and special tokens are drawn N(0, perturb) instead of
      upstream's near-zero init, so every branch moves the outputs (a parity check
      must see them).
    """
    import torch

    if config.depth != 24 or tuple(config.selected_idx) != (4, 11, 17, 23) or config.num_heads != 16:
        raise ValueError("config: upstream's GCTStream fixes depth=24, num_heads=16, selected_idx=(4, 11, 17, 23)")
    GCTStream = import_gct_stream(src)
    torch.manual_seed(seed)
    m = GCTStream(
        img_size=config.img_size,
        patch_size=config.patch_size,
        embed_dim=config.dim,
        patch_embed=config.patch_embed,
        enable_3d_rope=config.enable_3d_rope,
        max_frame_num=config.max_frame_num,
        kv_cache_sliding_window=config.kv_cache_sliding_window,
        kv_cache_scale_frames=config.kv_cache_scale_frames,
        enable_camera=config.enable_camera,
        enable_depth=config.enable_depth,
        enable_point=config.enable_point,
        camera_num_iterations=config.camera_num_iterations,
        enable_camera_3d_rope=config.enable_camera_3d_rope,
        camera_rope_theta=config.camera_rope_theta,
        use_sdpa=use_sdpa,
    ).eval()
    if perturb:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("gamma") or name.endswith("token") or name.endswith("tokens"):
                    p.copy_(torch.randn_like(p) * perturb)
    return m


def compile_like_gct_profile(model):
    """Upstream ``gct_profile.py``'s ``torch.compile(mode="reduce-overhead")`` of the fixed-shape
    modules (frame blocks, backbone blocks, and around each global block's manager calls)."""
    import torch

    agg = model.aggregator
    for i, b in enumerate(agg.frame_blocks):
        agg.frame_blocks[i] = torch.compile(b, mode="reduce-overhead")
    for i, b in enumerate(agg.patch_embed.blocks):
        agg.patch_embed.blocks[i] = torch.compile(b, mode="reduce-overhead")
    for b in agg.global_blocks:
        if hasattr(b, "attn_pre"):
            b.attn_pre = torch.compile(b.attn_pre, mode="reduce-overhead")
        if hasattr(b, "ffn_residual"):
            b.ffn_residual = torch.compile(b.ffn_residual, mode="reduce-overhead")
        b.attn.proj = torch.compile(b.attn.proj, mode="reduce-overhead")


def state_dict(model) -> dict:
    """``{key: f32 ndarray}`` of an upstream model, for ``convert.load_state_dict``."""
    return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def images_nchw(frames: np.ndarray):
    """f32[S, H, W, 3] -> upstream's torch f32[S, 3, H, W]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(frames, np.float32).transpose(0, 3, 1, 2)))
