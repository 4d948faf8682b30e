"""``python -m jaxkv demo``: stream random frames through a lingbot-map-shaped frame cache."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.errors import check
from jaxkv import frame

RESOLUTIONS = {"112x84": 48, "224x224": 256, "518x378": 999, "504x378": 972}  # 14x14 patches


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=int, default=200, help="frames to stream (default 200)")
    p.add_argument("--resolution", choices=sorted(RESOLUTIONS), default="224x224",
                   help="input resolution: 224x224 = 256 patches per frame (default), 518x378 = 999")
    p.add_argument("--layers", type=int, default=24, help="global-attention layers (default 24)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--head-dim", type=int, default=64, help="dims per head (default 64)")
    p.add_argument("--scale-frames", type=int, default=8, help="frames whose patches are pinned (default 8)")
    p.add_argument("--window", type=int, default=64, help="sliding window of recent frames (default 64)")
    p.add_argument("--special", type=int, default=6, help="special tokens per frame (default 6)")
    p.add_argument("--keyframe-every", type=int, default=0,
                   help="defer every frame and keep only every k-th (rollback the rest); 0 = plain appends")
    p.add_argument("--impl", choices=frame.IMPLS, default="auto", help="attention backend (default auto)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="cache dtype (default bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--model", action="store_true",
                   help="stream a synthetic video through the Flax reconstruction model (jaxkv.models) instead "
                        "of random K/V: --layers frame+global block pairs of --heads x --head-dim, "
                        "--special = camera + registers + scale tokens (needs flax)")
    p.add_argument("--keyframe-threshold", type=float, default=None,
                   help="with --model: defer every frame and roll back those whose mean pixel change since the "
                        "last keyframe is below this (e.g. 0.01); default: keep every frame")
    p.add_argument("--plot", default="jaxkv_model_demo.png",
                   help="with --model: where to write the camera-trajectory and latency plot "
                        "(default jaxkv_model_demo.png; '' for none)")
    g = p.add_argument_group("lingbot-map (--lingbot)")
    g.add_argument("--lingbot", action="store_true",
                   help="stream a folder of frames (--images) through the lingbot-map port (jaxkv.models.lingbot) "
                        "and plot its camera trajectory and last depth map (needs flax, matplotlib, pillow)")
    g.add_argument("--images", default=None,
                   help="with --lingbot: folder of .png/.jpg frames, sorted by name, one size, multiples of 14")
    g.add_argument("--checkpoint", default=None,
                   help="with --lingbot: upstream's weights (.pt) or a convert-lingbot .safetensors; "
                        "without it the weights are random and the outputs meaningless")
    g.add_argument("--small", action="store_true",
                   help="with --lingbot and no --checkpoint: the ViT-S test config (fast on CPU)")
    g.add_argument("--keyframe-interval", type=int, default=1,
                   help="with --lingbot: keep every N-th frame after the scale frames in the caches (default 1)")
    g.add_argument("--out", default="lingbot_demo",
                   help="with --lingbot: folder for trajectory.png and depth.png (default lingbot_demo)")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="with --lingbot: a LingbotConfig field (JSON value), e.g. --set depth=4 "
                        "--set selected_idx=[0,1,2,3]; repeatable")


def make_step(spec: frame.FrameSpec, impl: str, keyframe_every: int):
    """One jitted frame step: random K/V/Q on device, append to all layers, attend per layer."""
    shape = (spec.num_layers, spec.num_streams, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    dt = spec.jnp_dtype
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
    """The flags' values: a ValueError naming the flag (the CLI prints it as a usage error)."""
    for flag, low in (("frames", 1), ("layers", 1), ("heads", 1), ("head_dim", 1), ("scale_frames", 0),
                      ("window", 0), ("special", 0), ("keyframe_every", 0)):
        if getattr(args, flag) < low:
            raise ValueError(f"--{flag.replace('_', '-')}: expected an int >= {low}, got {getattr(args, flag)}")
    if args.keyframe_threshold is not None and not args.model:
        raise ValueError("--keyframe-threshold: used only with --model (without it, use --keyframe-every)")
    if args.lingbot:
        if args.model:
            raise ValueError("--lingbot: not used with --model (pick one)")
        if not args.images:
            raise ValueError("--images: required with --lingbot (a folder of .png/.jpg frames)")
        if args.keyframe_interval < 1:
            raise ValueError(f"--keyframe-interval: expected an int >= 1, got {args.keyframe_interval}")
        if args.small and args.checkpoint:
            raise ValueError("--small: used only without --checkpoint (the checkpoint sets the architecture)")
    else:
        for flag in ("images", "checkpoint", "small", "set"):
            if getattr(args, flag):
                raise ValueError(f"--{flag}: used only with --lingbot")
        if args.keyframe_interval != 1:
            raise ValueError("--keyframe-interval: used only with --lingbot")


def run(args) -> dict:
    check_args(args)
    if args.lingbot:
        from jaxkv.models import lingbot_demo

        return lingbot_demo.run(args)
    if args.model:
        if args.keyframe_every:
            raise ValueError("--keyframe-every: not used with --model (use --keyframe-threshold)")
        from jaxkv.models import demo as model_demo

        return model_demo.run(args)
    from tqdm import tqdm

    spec = frame.FrameSpec(
        num_layers=args.layers, num_heads=args.heads, head_dim=args.head_dim,
        patches_per_frame=RESOLUTIONS[args.resolution], num_special=args.special,
        scale_frames=args.scale_frames, sliding_window=args.window, max_frames=max(args.frames, 1),
        dtype=args.dtype,
    )
    impl = frame.default_impl(spec) if args.impl == "auto" else args.impl
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
    steady = times[1:] or times
    summary = {
        "frames": int(np.asarray(frame.num_frames(state))[0]),
        "visible tokens": visible,
        "cache memory": f"{spec.kv_bytes / 2**20:.1f} MiB (K+V, {spec.num_layers} layers)",
        "visible K/V": f"{2 * spec.num_layers * visible * spec.num_heads * spec.head_dim * spec.jnp_dtype.itemsize / 2**20:.1f} MiB",
        "ms/frame (median, after the first)": f"{np.median(steady) * 1e3:.2f}",
        "first frame (compile) ms": f"{times[0] * 1e3:.0f}",
        "backend": impl,
        "device": f"{device.platform}: {getattr(device, 'device_kind', device)}",
    }
    width = max(map(len, summary))
    print()
    for k, v in summary.items():
        print(f"  {k:<{width}}  {v}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxkv demo", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    run(args)
    return 0
