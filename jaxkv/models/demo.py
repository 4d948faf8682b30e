"""``python -m jaxkv demo --model``: stream a synthetic video through the reconstruction model."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxkv.flax import CachedStep, caches, check
from jaxkv.models.reconstructor import ReconstructorConfig, StreamingReconstructor
from jaxkv.models.synthetic import synthetic_video



def run(args) -> dict:
    """Stream ``args.frames`` frames; print a summary table and write ``args.plot``."""
    width, height = (int(x) for x in args.resolution.split("x"))
    if args.special < 2:
        raise ValueError(f"--special: the model needs camera + scale tokens (>= 2), got {args.special}")
    config = ReconstructorConfig(
        height=height, width=width, dim=args.heads * args.head_dim, depth=args.layers, num_heads=args.heads,
        num_registers=args.special - 2, scale_frames=args.scale_frames, sliding_window=args.window,
        max_frames=max(args.frames, 1), keyframe_threshold=args.keyframe_threshold,
        cache_dtype=args.dtype, impl=args.impl,
        **dict.fromkeys(("dtype", "param_dtype"), "bfloat16" if jax.default_backend() == "gpu" else "float32"))
    video = synthetic_video(args.frames, height, width, seed=args.seed)
    model = StreamingReconstructor(config, rngs=nnx.Rngs(args.seed))
    step = CachedStep(model)
    frames = jax.device_put(jnp.asarray(video.frames))
    device = jax.devices()[0]
    cache_bytes = sum(s.spec.kv_bytes for s in caches(model))
    times, outs = [], []
    bar = tqdm(range(args.frames), unit="frame", desc="jaxkv model demo")
    for t in bar:
        t0 = time.perf_counter()
        out = step(frames[t : t + 1])
        out["camera"].block_until_ready()  # timing only; the step itself never syncs
        times.append(time.perf_counter() - t0)
        outs.append(out)
        if t % 5 == 0 or t == args.frames - 1:
            bar.set_postfix(ms=f"{times[-1] * 1e3:.1f}", cache=f"{cache_bytes / 2**20:.0f}MiB")
    model = step.sync()
    check(model)
    outs = jax.device_get(outs)
    camera = np.concatenate([o["camera"] for o in outs])
    keep = np.concatenate([o["keep"] for o in outs])
    steady = times[1:] or times
    state = caches(model)[0]
    summary = {
        "frames streamed": args.frames,
        "frames kept (keyframes)": int(keep.sum()),
        "frames in cache": int(np.asarray(state.num_frames)[0]),
        "visible tokens": int(np.asarray(state.num_valid)[0]),
        "model": f"{config.depth} x (frame + global) blocks, dim {config.dim}, {config.height}x{config.width}, "
                 f"{config.tokens_per_frame} tokens/frame",
        "cache memory": f"{cache_bytes / 2**20:.1f} MiB (K+V, {config.depth} global layers)",
        "ms/frame (median, after the first)": f"{np.median(steady) * 1e3:.2f}",
        "first frame (compile) ms": f"{times[0] * 1e3:.0f}",
        "device": f"{device.platform}: {getattr(device, 'device_kind', device)}",
    }
    if args.plot:
        summary["plot"] = _plot(args.plot, video, camera, keep, np.asarray(times) * 1e3)
    width_ = max(map(len, summary))
    print()
    for k, v in summary.items():
        print(f"  {k:<{width_}}  {v}")
    return summary


def _plot(path: str, video, camera, keep, ms) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    gt = video.positions
    a.plot(gt[:, 0], gt[:, 2], "-", color="0.6", label="synthetic camera path")
    a.scatter(camera[keep, 0], camera[keep, 2], s=14, label="camera head, keyframes")
    a.scatter(camera[~keep, 0], camera[~keep, 2], s=14, marker="x", label="camera head, rolled back")
    a.set(title="camera trajectory (x-z; the head has random weights)", xlabel="x", ylabel="z")
    a.legend(fontsize=8)
    t = np.arange(len(ms))
    b.plot(t, ms, "-o", ms=3)
    b.set(title="per-frame latency (first = compile)", xlabel="frame", ylabel="ms", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
