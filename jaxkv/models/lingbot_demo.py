"""``python -m jaxkv demo --lingbot --images DIR``: a folder of frames through the lingbot-map port.

Reads DIR's .png / .jpg files sorted by name, streams them through ``LingbotStream``
(upstream's weights with ``--checkpoint``, random weights otherwise), and writes
``trajectory.png`` (camera positions, top-down) and ``depth.png`` (the last frame's
depth next to the frame) under ``--out``. ``prepare`` checks everything it can (flags,
checkpoint file, frames, config) before ``run`` builds the model.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import warnings

import numpy as np

from jaxkv import frame

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
            raise ValueError(
                f"--images: {p} is {w}x{h} (width x height); both must be multiples of "
                f"{patch_size} (the patch size): crop or resize the frames"
            )
        if size is None:
            size = (h, w)
        elif (h, w) != size:
            raise ValueError(
                f"--images: {p} is {w}x{h}, but {paths[0]} is {size[1]}x{size[0]}; all frames must share one size"
            )
        frames.append(x)
    return paths, np.stack(frames)


# LingbotConfig's annotations -> (accepted JSON types, what the message says is expected)
_TYPES = {
    "int": (int, "an int"),
    "float": ((int, float), "a number"),
    "bool": (bool, "true or false"),
    "str": (str, "a string"),
    "tuple": (list, "a JSON list"),
}


def parse_overrides(items, flag: str = "--set") -> dict:
    """``["depth=4", "selected_idx=[0,1,2,3]"]`` -> LingbotConfig overrides (JSON values, lists as
    tuples), each checked against its field's type: a ValueError naming ``flag``, the item, what
    was expected and what came."""
    from jaxkv.models.lingbot import LingbotConfig

    fields = {f.name: f.type for f in dataclasses.fields(LingbotConfig)}
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{flag}: expected FIELD=VALUE, got {item!r}")
        if key not in fields:
            raise ValueError(f"{flag} {item}: {key!r} is not a LingbotConfig field; expected one of {sorted(fields)}")
        kind = fields[key] if isinstance(fields[key], str) else getattr(fields[key], "__name__", "")
        try:
            v = json.loads(value)
        except json.JSONDecodeError:
            v = value
        if kind == "str" and not isinstance(v, str):
            v = value  # dtype=bfloat16 and impl=xla need no JSON quotes; 16 is the string "16"
        types, expected = _TYPES.get(kind, (object, "a JSON value"))
        default = getattr(LingbotConfig, key)
        if kind == "tuple" and all(isinstance(d, int) for d in default):
            types, expected = list, "a JSON list of ints (e.g. [0,1,2,3])"
            ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        else:
            ok = isinstance(v, types) and not (isinstance(v, bool) and kind in ("int", "float"))
        if not ok:
            raise ValueError(f"{flag} {item}: expected {expected} for LingbotConfig.{key}, got {value!r}")
        out[key] = tuple(v) if isinstance(v, list) else float(v) if kind == "float" else v
    return out


@dataclasses.dataclass
class Plan:
    """What ``prepare`` learned before building anything: the frames, the config, the
    checkpoint's state dict (None: random weights), and the bytes the run will need."""

    paths: list
    frames: np.ndarray
    config: object  # LingbotConfig
    state_dict: dict | None
    impl_flag: str  # the flag that chose config.impl, for its error messages
    memory: dict  # {what: bytes}, a lower bound (the caches, the frames, the weights)


def prepare(args) -> Plan:
    """Every check the lingbot demo can make before it builds the model: ``--set`` (types,
    fields, the config it gives), ``--impl``, ``--checkpoint`` (what the file is, that it
    reads, that it fits the config), ``--images``. ValueErrors name the flag."""
    from jaxkv.models.lingbot import LingbotConfig, convert
    from jaxkv.models.lingbot.model import aggregator_spec

    overrides = parse_overrides(getattr(args, "set", None))
    for key in ("height", "width"):
        if key in overrides:
            raise ValueError(f"--set {key}={overrides[key]}: the frame size comes from the --images frames")
    impl_flag = "--impl"
    if "impl" in overrides:
        impl_flag = f"--set impl={overrides['impl']}"
        if args.impl != "auto" and args.impl != overrides["impl"]:
            raise ValueError(f"{impl_flag}: --impl {args.impl} says otherwise; give one of them")
    elif args.impl != "auto":
        overrides["impl"] = args.impl
    if overrides.get("impl", "auto") not in frame.IMPLS:
        raise ValueError(f"{impl_flag}: expected one of {frame.IMPLS}, got {overrides['impl']!r}")
    if getattr(args, "kv_dtype", None) == "fp8":
        if overrides.get("kv_dtype", frame.FP8) != frame.FP8:
            raise ValueError(f"--set kv_dtype={overrides['kv_dtype']}: --kv-dtype fp8 says otherwise; give one of them")
        overrides["kv_dtype"] = frame.FP8
    if args.checkpoint:
        convert.checkpoint_kind(args.checkpoint, arg="--checkpoint")  # before reading any image
    paths, frames = load_images(args.images)
    n, height, width = frames.shape[:3]
    sd = None
    if args.checkpoint:
        sd, meta = convert.read_state_dict(args.checkpoint, arg="--checkpoint")
        try:
            config = convert.checkpoint_config(sd, meta, height=height, width=width, **overrides)
        except (ValueError, ArithmeticError) as e:  # the checkpoint's own content, else a field --set gave
            flag = "--set" if overrides and not str(e).startswith("state dict") else "--checkpoint"
            raise ValueError(f"{flag}: {_config_error(e)}") from None
    else:
        common = dict(height=height, width=width, max_frame_num=max(64, n + 8))
        try:
            if args.small:
                scale = min(2, n)
                config = LingbotConfig.small(
                    **{
                        **common,
                        "img_size": width,
                        "num_scale_frames": scale,
                        "kv_cache_scale_frames": scale,
                        **overrides,
                    }
                )
            else:
                config = LingbotConfig(
                    **{**common, "num_scale_frames": min(LingbotConfig.num_scale_frames, n), **overrides}
                )
        except (ValueError, ArithmeticError) as e:
            raise ValueError(f"--set: {_config_error(e)}") from None
    if n > config.max_frame_num:
        raise ValueError(
            f"--images: {n} frames, more than the model's max_frame_num={config.max_frame_num}; "
            f"use fewer frames or --set max_frame_num={n}"
        )
    memory = {"K/V caches": aggregator_spec(config).kv_bytes, "frames": frames.nbytes}
    if sd is not None:  # the state dict is in memory already (float32); the model holds it again
        memory["weights"] = sum(x.size for x in sd.values()) * config.compute_dtype.itemsize
    return Plan(paths, frames, config, sd, impl_flag, memory)


def _config_error(e: Exception) -> str:
    """LingbotConfig's ValueErrors name the field; anything else it raises (num_heads=0 divides
    by zero) is said as such."""
    return str(e) if isinstance(e, ValueError) else f"LingbotConfig refuses these values ({type(e).__name__}: {e})"


def build_model(args, plan: Plan):
    """The model: the checkpoint's weights, else random weights (with a warning)."""
    from flax import nnx

    from jaxkv.models.lingbot import LingbotMap
    from jaxkv.models.lingbot.convert import model_from_state_dict

    if plan.state_dict is not None:
        return model_from_state_dict(plan.config, plan.state_dict, arg="--checkpoint")
    warnings.warn(
        "lingbot demo: random weights (no checkpoint given); the poses and depths it plots are "
        "meaningless. Pass --checkpoint with upstream's lingbot-map weights.",
        stacklevel=3,
    )
    return LingbotMap(plan.config, rngs=nnx.Rngs(args.seed))


def timing(times, num_scale_frames: int) -> dict:
    """The summary's timing rows from the seconds between yielded frames: the scale frames run
    as one call (with its compile); the first streamed frame compiles the streaming step, so
    the per-frame median is over the streamed frames after it, and says when there are none."""
    s = min(num_scale_frames, len(times))
    rows = {f"scale frames ({s}, one call with its compile) s": f"{sum(times[:s]):.1f}"}
    streamed = list(times[s:])
    key = "ms/frame (median, streamed frames after the first)"
    if not streamed:
        rows[key] = f"none: all {len(times)} frames were scale frames (one call)"
        return rows
    rows["first streamed frame (compile) ms"] = f"{streamed[0] * 1e3:.0f}"
    rows[key] = (
        f"{np.median(streamed[1:]) * 1e3:.1f}"
        if len(streamed) > 1
        else "none: one streamed frame, timed with its compile above"
    )
    return rows


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


def run(args, plan: Plan | None = None) -> dict:
    """Stream ``args.images`` through the model; write the two plots under ``args.out``
    (created if missing; its parent exists); print a summary and each path written."""
    import jax
    from tqdm import tqdm

    from jaxkv.models.lingbot import LingbotStream

    plan = plan or prepare(args)
    paths, frames, c = plan.paths, plan.frames, plan.config
    n = len(frames)
    t0 = time.perf_counter()
    model = build_model(args, plan)
    build_s = time.perf_counter() - t0
    stream = LingbotStream(model)
    outs, times = [], []
    t_prev = time.perf_counter()
    for out in tqdm(
        stream.run(list(frames), keyframe_interval=args.keyframe_interval), total=n, unit="frame", desc="lingbot demo"
    ):
        out = jax.device_get(out)
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        outs.append(out)
    pose_enc = np.concatenate([o["pose_enc"] for o in outs])  # [N, 9]
    depth = outs[-1]["depth"][0, ..., 0]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(exist_ok=True)
    traj_path, depth_path = out_dir / "trajectory.png", out_dir / "depth.png"
    plot_trajectory(pose_enc, traj_path)
    plot_depth(frames[-1], depth, depth_path, title=paths[-1].name)
    summary = {
        "frames": n,
        "frame size": f"{c.width}x{c.height} (width x height)",
        "weights": str(args.checkpoint) if args.checkpoint else "random (no checkpoint)",
        "model": f"{c.patch_embed}, depth {c.depth}, {c.tokens_per_frame} tokens/frame",
        "keyframe interval": args.keyframe_interval,
        "model build s": f"{build_s:.1f}",
        **timing(times, c.num_scale_frames),
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
