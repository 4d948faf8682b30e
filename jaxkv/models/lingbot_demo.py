"""``python -m jaxkv demo --lingbot --images DIR``: a folder of frames through the lingbot-map port.

Reads DIR's .png / .jpg files sorted by name, streams them through ``LingbotStream``
(upstream's weights with ``--checkpoint``, random weights otherwise), and writes
``trajectory.png`` (camera positions, top-down) and ``depth.png`` (the last frame's
depth next to the frame) under ``--out``.
"""

from __future__ import annotations

import json
import pathlib
import time
import warnings

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def load_images(folder, patch_size: int = 14) -> tuple[list[pathlib.Path], np.ndarray]:
    """(paths, f32[N, H, W, 3] in [0, 1]) of ``folder``'s images sorted by name.

    ValueError naming the path: a missing or empty folder, an unreadable image, sizes that
    differ or are not multiples of ``patch_size``.
    """
    from PIL import Image, UnidentifiedImageError

    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--images: no folder at {folder}")
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise ValueError(f"--images: no .png or .jpg files in {folder}")
    frames, size = [], None
    for p in paths:
        try:
            with Image.open(p) as im:
                x = np.asarray(im.convert("RGB"), np.float32) / 255.0
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
            raise ValueError(f"--images: cannot read {p} as an image ({type(e).__name__}: {e})") from None
        h, w = x.shape[:2]
        if h % patch_size or w % patch_size:
            raise ValueError(f"--images: {p} is {w}x{h} (width x height); both must be multiples of "
                             f"{patch_size} (the patch size): crop or resize the frames")
        if size is None:
            size = (h, w)
        elif (h, w) != size:
            raise ValueError(f"--images: {p} is {w}x{h}, but {paths[0]} is {size[1]}x{size[0]}; "
                             "all frames must share one size")
        frames.append(x)
    return paths, np.stack(frames)


def parse_overrides(items) -> dict:
    """``["depth=4", "selected_idx=[0,1,2,3]"]`` -> LingbotConfig overrides (JSON values, lists as tuples)."""
    import dataclasses

    from jaxkv.models.lingbot import LingbotConfig

    fields = {f.name for f in dataclasses.fields(LingbotConfig)}
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"--set: expected FIELD=VALUE with FIELD one of {sorted(fields)}, got {item!r}")
        try:
            v = json.loads(value)
        except json.JSONDecodeError:
            v = value
        out[key] = tuple(v) if isinstance(v, list) else v
    return out


def build_model(args, n: int, height: int, width: int):
    """The model: upstream's weights from ``--checkpoint``, else random weights (with a warning)."""
    from flax import nnx

    from jaxkv.models.lingbot import LingbotConfig, LingbotMap
    from jaxkv.models.lingbot.convert import load_lingbot_checkpoint

    overrides = parse_overrides(getattr(args, "set", None))
    if args.checkpoint:
        return load_lingbot_checkpoint(args.checkpoint, **{"height": height, "width": width, **overrides})
    warnings.warn("lingbot demo: random weights (no checkpoint given); the poses and depths it plots are "
                  "meaningless. Pass --checkpoint with upstream's lingbot-map weights.", stacklevel=2)
    common = dict(height=height, width=width, max_frame_num=max(64, n + 8))
    if args.small:
        scale = min(2, n)
        config = LingbotConfig.small(**common, img_size=width, num_scale_frames=scale,
                                     kv_cache_scale_frames=scale, **overrides)
    else:
        config = LingbotConfig(**common, num_scale_frames=min(LingbotConfig.num_scale_frames, n), **overrides)
    return LingbotMap(config, rngs=nnx.Rngs(args.seed))


def plot_trajectory(pose_enc: np.ndarray, path) -> None:
    """Top-down (x, z) camera positions from ``pose_enc[:, :3]``, coloured by frame order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = pose_enc[:, :3]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot(t[:, 0], t[:, 2], color="0.7", lw=1, zorder=1)
    sc = ax.scatter(t[:, 0], t[:, 2], c=np.arange(len(t)), cmap="viridis", s=30, zorder=2)
    fig.colorbar(sc, ax=ax, label="frame")
    ax.set_xlabel("x")
    ax.set_ylabel("z")
    ax.set_title(f"camera positions, top-down ({len(t)} frames)")
    ax.set_aspect("equal", adjustable="datalim")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_depth(image: np.ndarray, depth: np.ndarray, path, title: str = "") -> None:
    """The frame and its predicted depth map side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.imshow(np.clip(image, 0, 1))
    a.set_title(title or "frame")
    im = b.imshow(depth, cmap="magma_r")
    b.set_title("predicted depth")
    fig.colorbar(im, ax=b, fraction=0.046)
    for ax in (a, b):
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> dict:
    """Stream ``args.images`` through the model; write the two plots under ``args.out``; print a summary."""
    import jax
    from tqdm import tqdm

    from jaxkv.models.lingbot import LingbotStream

    paths, frames = load_images(args.images)
    n, height, width = frames.shape[:3]
    t0 = time.perf_counter()
    model = build_model(args, n, height, width)
    build_s = time.perf_counter() - t0
    stream = LingbotStream(model)
    outs, times = [], []
    t_prev = time.perf_counter()
    for out in tqdm(stream.run(list(frames), keyframe_interval=args.keyframe_interval), total=n,
                    unit="frame", desc="lingbot demo"):
        out = jax.device_get(out)
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        outs.append(out)
    pose_enc = np.concatenate([o["pose_enc"] for o in outs])  # [N, 9]
    depth = outs[-1]["depth"][0, ..., 0]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    traj_path, depth_path = out_dir / "trajectory.png", out_dir / "depth.png"
    plot_trajectory(pose_enc, traj_path)
    plot_depth(frames[-1], depth, depth_path, title=paths[-1].name)
    c = model.config
    summary = {
        "frames": n,
        "frame size": f"{width}x{height}",
        "weights": str(args.checkpoint) if args.checkpoint else "random (no checkpoint)",
        "model": f"{c.patch_embed}, depth {c.depth}, {c.tokens_per_frame} tokens/frame",
        "keyframe interval": args.keyframe_interval,
        "model build s": f"{build_s:.1f}",
        "ms/frame (median, after the scale frames)":
            f"{np.median(times[c.num_scale_frames:] or times) * 1e3:.1f}",
        "trajectory": str(traj_path),
        "depth": str(depth_path),
    }
    width_ = max(map(len, summary))
    print()
    for k, v in summary.items():
        print(f"  {k:<{width_}}  {v}")
    print(f"wrote {traj_path}")
    print(f"wrote {depth_path}")
    return summary
