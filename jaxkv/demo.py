"""jaxkv demo: stream frames through a lingbot-map-shaped frame cache and print a summary.

Random K/V by default; --model: a synthetic video through the Flax reconstruction model;
--lingbot: a folder of frames through the lingbot-map port. Every flag, the extras a mode
needs, the attention backend, the output paths and the memory the run needs are checked
before anything is built: a mistake is a one-line usage error (exit status 2). Files go
where --plot / --out say, by default into the folder jaxkv-demo/; each path written is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _backend, frame
from jaxkv.errors import check

RESOLUTIONS = {"112x84": 48, "224x224": 256, "518x378": 999, "504x378": 972}  # WxH: 14x14 patches
OUT = "jaxkv-demo"  # the folder every demo writes to unless --out / --plot say otherwise
MODEL_PLOT = "model.png"  # --model's plot in that folder
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")

# pip names of the modules each mode imports, and the extra that installs them (pyproject.toml)
PIP_NAMES = {
    "flax": "flax",
    "PIL": "pillow",
    "matplotlib": "matplotlib",
    "safetensors": "safetensors",
    "torch": "torch",
    "orbax": "orbax-checkpoint",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=int, default=200, help="frames to stream (default 200)")
    p.add_argument(
        "--resolution",
        choices=sorted(RESOLUTIONS),
        default="224x224",
        help="frame size, width x height: 224x224 = 256 patches per frame (default), 518x378 = 999",
    )
    p.add_argument("--layers", type=int, default=24, help="global-attention layers (default 24)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--head-dim", type=int, default=64, help="dims per head (default 64)")
    p.add_argument("--scale-frames", type=int, default=8, help="frames whose patches are pinned (default 8)")
    p.add_argument("--window", type=int, default=64, help="sliding window of recent frames (default 64)")
    p.add_argument("--special", type=int, default=6, help="special tokens per frame (default 6)")
    p.add_argument(
        "--keyframe-every",
        type=int,
        default=0,
        help="defer every frame and keep only every k-th (rollback the rest); 0 = plain appends",
    )
    p.add_argument(
        "--impl",
        choices=frame.IMPLS,
        default="auto",
        help="frame-cache attention backend (default auto: the fastest that runs here); "
        "with --lingbot, the port's LingbotConfig.impl",
    )
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="cache dtype (default bfloat16)"
    )
    p.add_argument(
        "--kv-dtype",
        choices=["fp8"],
        default=None,
        help="K/V cache storage: fp8 = FP8 E4M3 with a bfloat16 scale per token and head, about half "
        "the bytes, attended on the xla path (docs/kernels/frame_cache_fp8.md); default: --dtype. "
        "With --lingbot, the port's global cache (LingbotConfig.kv_dtype)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--model",
        action="store_true",
        help="stream a synthetic video through the Flax reconstruction model (jaxkv.models) instead "
        "of random K/V: --layers frame+global block pairs of --heads x --head-dim, "
        "--special = camera + registers + scale tokens (needs flax, matplotlib)",
    )
    p.add_argument(
        "--keyframe-threshold",
        type=float,
        default=None,
        help="with --model: defer every frame and roll back those whose mean pixel change since the "
        "last keyframe is below this (e.g. 0.01); default: keep every frame",
    )
    p.add_argument(
        "--plot",
        default=None,
        help=f"with --model: the camera-trajectory and latency plot to write, its folder existing "
        f"(.png/.pdf/.svg/.jpg; default {OUT}/{MODEL_PLOT}; '' for none)",
    )
    g = p.add_argument_group("lingbot-map (--lingbot)")
    g.add_argument(
        "--lingbot",
        action="store_true",
        help="stream a folder of frames (--images) through the lingbot-map port (jaxkv.models.lingbot) "
        "and plot its camera trajectory and last depth map (needs flax, matplotlib, pillow, "
        "safetensors: the lingbot extra)",
    )
    g.add_argument(
        "--images",
        default=None,
        help="with --lingbot: folder of .png/.jpg frames, sorted by name, one size, multiples of 14",
    )
    g.add_argument(
        "--checkpoint",
        default=None,
        help="with --lingbot: a convert-lingbot .safetensors file, or upstream's torch checkpoint "
        "(.pt, needs torch); without it the weights are random and the outputs meaningless",
    )
    g.add_argument(
        "--small", action="store_true", help="with --lingbot and no --checkpoint: the ViT-S test config (fast on CPU)"
    )
    g.add_argument(
        "--keyframe-interval",
        type=int,
        default=1,
        help="with --lingbot: keep every N-th frame after the scale frames in the caches (default 1)",
    )
    g.add_argument(
        "--out",
        default=None,
        help=f"with --lingbot: folder for trajectory.png and depth.png, created if its parent exists (default {OUT})",
    )
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="with --lingbot: a LingbotConfig field (JSON value), e.g. --set depth=4 "
        "--set selected_idx=[0,1,2,3]; repeatable",
    )


def cache_dtype(args) -> str:
    """The K/V storage dtype the flags ask for."""
    return frame.FP8 if args.kv_dtype == "fp8" else args.dtype


def make_step(spec: frame.FrameSpec, impl: str, keyframe_every: int):
    """One jitted frame step: random K/V/Q on device, append to all layers, attend per layer."""
    shape = (spec.num_layers, spec.num_streams, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    dt = spec.compute_dtype
    defer = keyframe_every > 0

    def step(state, key, t):
        kk, kv, kq = jax.random.split(key, 3)
        k = jax.random.normal(kk, shape, dt)
        v = jax.random.normal(kv, shape, dt)
        q = jax.random.normal(kq, shape, dt)
        state = frame.append(state, k, v, defer=defer)
        out = [frame.attention(state, layer, q[layer], impl=impl) for layer in range(spec.num_layers)]
        checksum = sum(jnp.sum(o.astype(jnp.float32)) for o in out)
        if defer:
            state = frame.resolve(state, t % keyframe_every == 0)
        return state, checksum

    return jax.jit(step, donate_argnums=0)


def check_args(args) -> None:
    """The flags' values and combinations: a ValueError naming the flag (the CLI prints it as
    a usage error). Reads nothing but ``args``."""
    for flag, low in (
        ("frames", 1),
        ("layers", 1),
        ("heads", 1),
        ("head_dim", 1),
        ("scale_frames", 0),
        ("window", 0),
        ("special", 0),
        ("keyframe_every", 0),
    ):
        if getattr(args, flag) < low:
            raise ValueError(f"--{flag.replace('_', '-')}: expected an int >= {low}, got {getattr(args, flag)}")
    if args.scale_frames + args.window < 1:
        raise ValueError("--scale-frames, --window: expected at least one frame kept (a sum >= 1), got 0 and 0")
    if args.kv_dtype and args.dtype != "bfloat16" and not args.lingbot:
        raise ValueError(
            f"--kv-dtype: an fp8 cache takes K/V in as bfloat16: expected --dtype bfloat16, got {args.dtype}"
        )
    if args.keyframe_threshold is not None and not args.model:
        raise ValueError("--keyframe-threshold: used only with --model (without it, use --keyframe-every)")
    if args.plot is not None and not args.model:
        raise ValueError("--plot: used only with --model (--lingbot writes under --out)")
    if args.model:
        if args.lingbot:
            raise ValueError("--lingbot: not used with --model (pick one)")
        if args.keyframe_every:
            raise ValueError("--keyframe-every: not used with --model (use --keyframe-threshold)")
        if args.special < 2:
            raise ValueError(
                f"--special: with --model, expected an int >= 2 (camera + scale tokens), got {args.special}"
            )
        if args.head_dim % 2 or args.head_dim < 6:
            raise ValueError(
                f"--head-dim: with --model, expected an even int >= 6 (a RoPE over frame, row and "
                f"column), got {args.head_dim}"
            )
    if args.lingbot:
        if not args.images:
            raise ValueError("--images: required with --lingbot (a folder of .png/.jpg frames)")
        if args.keyframe_interval < 1:
            raise ValueError(f"--keyframe-interval: expected an int >= 1, got {args.keyframe_interval}")
        if args.small and args.checkpoint:
            raise ValueError("--small: used only without --checkpoint (the checkpoint sets the architecture)")
    else:
        for flag in ("images", "checkpoint", "small", "set", "out"):
            if getattr(args, flag):
                raise ValueError(f"--{flag}: used only with --lingbot")
        if args.keyframe_interval != 1:
            raise ValueError("--keyframe-interval: used only with --lingbot")


def require(flag: str, modules, install: str) -> None:
    """A ValueError naming ``flag`` and the pip command when a module it needs is not installed."""
    missing = [PIP_NAMES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{flag}: needs {', '.join(missing)}, not installed here: {install}")


def check_output_dir(flag: str, path) -> Path:
    """``path`` as a folder the run can write: existing and writable, or creatable (its parent
    an existing writable folder). Creates nothing."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag}: {path} is a file; expected a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag}: cannot write in {path} (no permission)")
        return path
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: cannot create {path}: {parent} is not an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot create {path}: no permission to write in {parent}")
    return path


def check_output_file(flag: str, path, suffixes=None, *, create_folder: bool = False) -> Path:
    """``path`` as a file the run can write: in an existing writable folder (or, with
    ``create_folder``, one ``check_output_dir`` accepts), not a folder, ending in one of
    ``suffixes``. Creates nothing."""
    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{flag}: expected a file name ending in {' / '.join(suffixes)}, got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a folder; expected a file name")
    folder = path.parent
    if create_folder:
        check_output_dir(flag, folder)
    elif folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag}: {folder} is a file, not a folder to write {path.name} in")
    elif not folder.is_dir():
        raise ValueError(f"{flag}: no folder {folder} to write {path.name} in (create it first)")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write in {folder} (no permission)")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag}: cannot overwrite {path} (no permission)")
    return path


def check_impl(flag: str, impl: str, *, dtype: str, head_dim: int) -> str:
    """The frame-attention backend ``impl`` names here (``auto`` resolved), or a ValueError
    naming ``flag`` that says why it cannot run here (``jaxkv._backend``)."""
    try:
        impl = _backend.choose("frame.attention", impl, pow2_pages=False, dtype=dtype, head_dim=head_dim)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return impl


def memory_limit() -> tuple[int | None, str]:
    """(bytes a run may allocate, what that is): the free memory of jax's first device when
    it reports one (GPUs), else the host's available RAM (CPU arrays live there)."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"free memory of the {dev.device_kind}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def nbytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def check_memory(flag: str, parts: dict, hint: str) -> None:
    """A ValueError naming ``flag`` when the run's arrays (``parts``: {what: bytes}, a lower
    bound) do not fit ``memory_limit()``; checked before anything is allocated."""
    need = sum(parts.values())
    limit, where = memory_limit()
    if limit is not None and need > limit:
        what = ", ".join(f"{k} {nbytes(v)}" for k, v in parts.items())
        raise ValueError(
            f"{flag}: the run needs at least {nbytes(need)} ({what}), more than the {nbytes(limit)} of {where}; {hint}"
        )


def _outputs(args) -> argparse.Namespace:
    """``args`` with the output paths resolved to their defaults and checked writable."""
    args = argparse.Namespace(**vars(args))
    if args.model:
        if args.plot is None:
            args.plot = check_output_file("--plot", Path(OUT) / MODEL_PLOT, PLOT_SUFFIXES, create_folder=True)
        elif args.plot:
            args.plot = check_output_file("--plot", args.plot, PLOT_SUFFIXES)
    if args.lingbot:
        args.out = check_output_dir("--out", OUT if args.out is None else args.out)
    return args


def preflight(args) -> argparse.Namespace:
    """Everything ``run`` can know before it builds anything: the flags, the extras the mode
    needs, and the output paths. Returns ``args`` with the output defaults filled in."""
    check_args(args)
    if args.lingbot:
        require("--lingbot", ("flax", "PIL", "matplotlib"), 'pip install "jaxkv[lingbot]"')
    elif args.model:
        require("--model", ("flax",), 'pip install "jaxkv[flax]"')
        if args.plot != "":
            require("--model", ("matplotlib",), "pip install matplotlib (or pass --plot '' to skip the plot)")
    return _outputs(args)


def run(args) -> dict:
    args = preflight(args)
    if args.lingbot:
        from jaxkv.models import lingbot_demo

        plan = lingbot_demo.prepare(args)  # images, checkpoint, config: no model yet
        c = plan.config
        check_impl(plan.impl_flag, c.impl, dtype=c.kv_dtype or c.dtype, head_dim=c.head_dim)
        weights = plan.memory.get("weights", 0) > sum(plan.memory.values()) / 2
        check_memory(
            "--checkpoint" if weights else "--images",
            plan.memory,
            "the weights need a machine with more memory" if weights else "use fewer or smaller frames",
        )
        return lingbot_demo.run(args, plan)
    if args.model:
        from jaxkv.models import demo as model_demo

        config = model_demo.config_from_args(args, cache_dtype(args))
        check_impl("--impl", args.impl, dtype=config.cache_dtype, head_dim=config.head_dim)
        check_memory(
            "--frames",
            model_demo.memory(config, args.frames),
            "lower --frames or --resolution (or --layers, --heads, --head-dim)",
        )
        return model_demo.run(args, config)
    return run_random(args)


def run_random(args) -> dict:
    """Random K/V through a frame cache of the flags' shape; prints and returns the summary."""
    from tqdm import tqdm

    spec = frame.FrameSpec(
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=args.head_dim,
        patches_per_frame=RESOLUTIONS[args.resolution],
        num_special=args.special,
        scale_frames=args.scale_frames,
        sliding_window=args.window,
        max_frames=max(args.frames, 1),
        dtype=cache_dtype(args),
    )
    impl = check_impl("--impl", args.impl, dtype=spec.dtype, head_dim=spec.head_dim)
    per_frame = 3 * spec.num_layers * spec.num_streams * spec.tokens_per_frame * spec.num_heads * spec.head_dim
    check_memory(
        "--frames",
        {"K/V cache": spec.kv_bytes, "one frame's K/V/Q": per_frame * spec.compute_dtype.itemsize},
        "lower --frames (or --layers, --heads, --head-dim, --resolution)",
    )
    state = frame.init(spec)
    step = make_step(spec, impl, args.keyframe_every)
    key = jax.random.key(args.seed)
    device = jax.devices()[0]
    times = []
    bar = tqdm(range(args.frames), unit="frame", desc=f"jaxkv demo [{impl}]")
    for t in bar:
        key, sub = jax.random.split(key)
        t0 = time.perf_counter()
        state, checksum = step(state, sub, jnp.int32(t))
        checksum.block_until_ready()  # timing only; the step itself never syncs
        times.append(time.perf_counter() - t0)
        if t % 5 == 0 or t == args.frames - 1:
            bar.set_postfix(ms=f"{times[-1] * 1e3:.1f}", cache=f"{spec.kv_bytes / 2**20:.0f}MiB")
    check(state)
    visible = int(np.asarray(state.num_valid)[0])
    row_bytes = spec.head_dim * spec.jnp_dtype.itemsize + 2 * spec.quantized  # an FP8 row's bf16 scale
    visible_bytes = 2 * spec.num_layers * visible * spec.num_heads * row_bytes
    steady = times[1:] or times
    summary = {
        "frames": int(np.asarray(frame.num_frames(state))[0]),
        "visible tokens": visible,
        "cache memory": f"{spec.kv_bytes / 2**20:.1f} MiB (K+V, {spec.num_layers} layers, {spec.dtype})",
        "visible K/V": f"{visible_bytes / 2**20:.1f} MiB",
        "ms/frame (median, after the first)": f"{np.median(steady) * 1e3:.2f}",
        "first frame (compile) ms": f"{times[0] * 1e3:.0f}",
        "backend": impl,
        "device": f"{device.platform}: {getattr(device, 'device_kind', device)}",
    }
    print_summary(summary)
    return summary


def print_summary(summary: dict) -> None:
    width = max(map(len, summary))
    print()
    for k, v in summary.items():
        print(f"  {k:<{width}}  {v}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxkv demo", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        p.error(str(e))
    return 0
