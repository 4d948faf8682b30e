"""``python -m jaxkv demo --model``: stream a synthetic video through the reconstruction model."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxkv.flax import CachedStep, caches, check
from jaxkv.models.reconstructor import ReconstructorConfig, StreamingReconstructor
from jaxkv.models.synthetic import synthetic_video


def config_from_args(args, cache_dtype: str) -> ReconstructorConfig:
    """The model the demo's flags describe (``--resolution`` is width x height), its cache
    stored as ``cache_dtype`` (``jaxkv.demo.cache_dtype``: ``--dtype`` or ``--kv-dtype``)."""
    width, height = (int(x) for x in args.resolution.split("x"))
    return ReconstructorConfig(
        height=height,
        width=width,
        dim=args.heads * args.head_dim,
        depth=args.layers,
        num_heads=args.heads,
        num_registers=args.special - 2,
        scale_frames=args.scale_frames,
        sliding_window=args.window,
        max_frames=max(args.frames, 1),
        keyframe_threshold=args.keyframe_threshold,
        cache_dtype=cache_dtype,
        impl=args.impl,
        **dict.fromkeys(("dtype", "param_dtype"), "bfloat16" if jax.default_backend() == "gpu" else "float32"),
    )


def memory(config: ReconstructorConfig, frames: int) -> dict:
    """{what: bytes} of the run's largest arrays, known before anything is built: the K/V cache
    and the synthetic video (float32, on the host and again on the device)."""
    video = frames * config.height * config.width * 3 * 4
    return {"K/V cache": config.cache_spec.kv_bytes, "synthetic video": 2 * video}


def run(args, config: ReconstructorConfig) -> dict:
    """Stream ``args.frames`` frames through ``config``'s model; print a summary table and
    write ``args.plot`` (a path, or empty for none)."""
    video = synthetic_video(args.frames, config.height, config.width, seed=args.seed)
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
        "model": f"{config.depth} x (frame + global) blocks, dim {config.dim}, {config.width}x{config.height} "
        f"(width x height), {config.tokens_per_frame} tokens/frame",
        "cache memory": f"{cache_bytes / 2**20:.1f} MiB (K+V, {config.depth} global layers)",
        "ms/frame (median, after the first)": f"{np.median(steady) * 1e3:.2f}",
        "first frame (compile) ms": f"{times[0] * 1e3:.0f}",
        "device": f"{device.platform}: {getattr(device, 'device_kind', device)}",
    }
    if args.plot:
        summary["plot"] = str(_plot(args.plot, video, camera, keep, np.asarray(times) * 1e3))
    width_ = max(map(len, summary))
    print()
    for k, v in summary.items():
        print(f"  {k:<{width_}}  {v}")
    if args.plot:
        print(f"wrote {summary['plot']}")
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
    Path(path).parent.mkdir(exist_ok=True)  # the default folder; a --plot path's folder exists (checked)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
