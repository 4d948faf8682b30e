"""Whole-model frame step of lingbot-map: the jaxkv port against upstream's own GCTStream.

Random weights, bf16 (upstream: autocast; the port: bf16 matmuls and caches), one stream,
the released config (ViT-L, 3D RoPE, 8 scale frames, 64-frame window). Each contender
streams ``--warm`` frames, then ``--frames`` more are timed one by one (each synced, as
upstream's ``gct_profile.py`` does); ms/frame is their median, peak memory the
framework's peak allocation over the whole run (the port: XLA's allocator; upstream:
torch's), weights included.

Besides the synchronized ms/frame, each contender then queues ``STREAMED`` frames with one
sync at the end (streamed ms/frame) and times each call's return (host ms/frame: launching
a frame); the port also traces ``TRACED`` frames (GPU kernel ms/frame, the costliest kernels
listed) and reports its first frames' seconds (both phases compiled).

Contenders: ``port`` (``LingbotStream``), ``upstream-flashinfer`` (its default backend,
eager), ``upstream-compiled`` (``--compile``: ``gct_profile.py``'s torch.compile
"reduce-overhead" targets on the FlashInfer path). Upstream comes from
``$LINGBOT_MAP_SRC``; without FlashInfer upstream runs its SDPA backend (said in the table).

``--long N`` / ``--long-upstream M``: instead, stream N frames through the port (its own
random weights) and M through upstream's FlashInfer path (either alone), recording memory in
use and the peak every 1,000 frames; prints the growth per 1,000 frames. ``--small``: ViT-S
on whatever device JAX and torch have (a smoke test of this script on CPU). ``--kv-dtype fp8``:
also the port with an FP8 global cache (``LingbotConfig.kv_dtype``), its error column against
upstream eager; with ``--long``, the port's cache.

    LINGBOT_MAP_SRC=... XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/lingbot_step.py --size 518x378
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import kernel_ms_per_step
from flax import nnx

from jaxkv import frame
from jaxkv.models.lingbot import LingbotConfig, LingbotMap, LingbotStream, upstream
from jaxkv.models.lingbot.convert import from_state_dict


def _jax_mem():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)


def _torch_mem():
    import torch

    if not torch.cuda.is_available():
        return 0, 0
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def _torch_sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def video(frames: np.ndarray, n: int):
    """``n`` frames cycling through ``frames`` (a long video without its host memory)."""
    return itertools.islice(itertools.cycle(frames), n)


def run_port(config, frames, warm, sd=None, n=None, every=None):
    """ms per frame (synced each frame; with ``every``: wall time per block) and memory marks.
    sd: upstream's weights, or None for the port's own random init."""
    t = time.perf_counter()
    model = LingbotMap(config, rngs=nnx.Rngs(0)) if sd is None else from_state_dict(config, sd)[0]
    used, peak = _jax_mem()
    print(
        f"port: built and loaded in {time.perf_counter() - t:.1f} s; in use {used / 2**30:.3f} GiB, "
        f"peak {peak / 2**30:.3f} GiB",
        flush=True,
    )
    stream = LingbotStream(model)
    n = len(frames) if n is None else n
    if every is not None:
        _print_step_buffers(stream, frames)
    times, marks, extra = [], [], {}
    timed = every is None
    frames_out = stream.run(video(frames, n + (STREAMED + TRACED if timed else 0)))
    t0 = start = time.perf_counter()
    for i, out in enumerate(itertools.islice(frames_out, n), start=1):
        if i == config.num_scale_frames + 1:
            jax.block_until_ready(out)
            extra["first_s"] = time.perf_counter() - start
            print(f"port: first {i} frames (both phases compiled) in {extra['first_s']:.1f} s", flush=True)
        if every is None or i % every == 0 or i == n:
            jax.block_until_ready(out)
            t = time.perf_counter()
            if every is None:
                if i > warm:
                    times.append(t - t0)
            else:
                times.append((t - t0) / every)
                marks.append((i, *_jax_mem()))
                _print_mark("port", marks[-1], times[-1])
            t0 = t
    last = {k: np.asarray(v, np.float32) for k, v in out.items()}
    if timed:
        extra.update(streamed(lambda: next(frames_out), jax.block_until_ready))
        extra["kernel_ms"] = kernel_ms_per_step(lambda i: jax.block_until_ready(next(frames_out)), TRACED, top=8)
    frames_out.close()
    peak = _jax_mem()[1]
    del stream, model
    return np.array(times) * 1e3, peak, last, marks, extra


STREAMED, TRACED = 20, 5  # frames after the synchronized ones: queued without a sync; profiled


def streamed(step, sync) -> dict:
    """``STREAMED`` frames queued one after another, one sync at the end: ms per frame, and
    the host's ms per frame (until each call returns: what launching the frame costs)."""
    host = []
    t0 = time.perf_counter()
    for _ in range(STREAMED):
        t = time.perf_counter()
        out = step()
        host.append(time.perf_counter() - t)
    sync(out)
    return {"streamed_ms": (time.perf_counter() - t0) / STREAMED * 1e3, "host_ms": float(np.median(host)) * 1e3}


def run_upstream(model, frames, warm, s, compile_=False, n=None, every=None):
    """As ``run_port``; ``s`` scale frames first."""
    import torch

    dev = next(model.parameters()).device
    imgs = upstream.images_nchw(frames)[None]
    if compile_:
        upstream.compile_like_gct_profile(model)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        ctx = torch.autocast("cpu", enabled=False)
    n = len(frames) if n is None else n
    times, marks = [], []
    with torch.no_grad(), ctx:
        model.clean_kv_cache()
        torch.compiler.cudagraph_mark_step_begin()
        model.forward(imgs[:, :s].to(dev), num_frame_for_scale=s, num_frame_per_block=s, causal_inference=True)
        _torch_sync()
        t0 = time.perf_counter()
        for i in range(s, n):
            x = imgs[:, i % imgs.shape[1] : i % imgs.shape[1] + 1].to(dev)
            if every is None:
                t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            out = model.forward(x, num_frame_for_scale=s, num_frame_per_block=1, causal_inference=True)
            if every is None:
                _torch_sync()
                if i >= warm:
                    times.append(time.perf_counter() - t0)
            elif (i + 1) % every == 0 or i + 1 == n:
                _torch_sync()
                t = time.perf_counter()
                times.append((t - t0) / every)
                marks.append((i + 1, *_torch_mem()))
                _print_mark("upstream", marks[-1], times[-1])
                t0 = t
        last = {k: out[k][0, 0].float().cpu().numpy() for k in ("pose_enc", "depth", "depth_conf")}
        extra = {}
        if every is None:
            x = imgs[:, s : s + 1].to(dev)

            def step():
                torch.compiler.cudagraph_mark_step_begin()
                return model.forward(x, num_frame_for_scale=s, num_frame_per_block=1, causal_inference=True)

            extra = streamed(step, lambda _: _torch_sync())
    return np.array(times) * 1e3, _torch_mem()[1], last, marks, extra


def _print_step_buffers(stream, frames):
    """XLA's buffers of both phases (temporaries are what a step adds to the memory in use)."""
    c = stream.config
    for phase, x in (("scale", frames[: c.num_scale_frames]), ("stream", frames[:1])):
        args = (jnp.asarray(x[None]),) + ((jnp.asarray(True),) if phase == "stream" else ())
        m = stream.step.lower(*args, phase=phase).compile().memory_analysis()
        print(
            f"port: {phase} step temporaries {m.temp_size_in_bytes / 2**30:.3f} GiB, arguments "
            f"{m.argument_size_in_bytes / 2**30:.3f} GiB (caches donated: {m.alias_size_in_bytes / 2**30:.3f})",
            flush=True,
        )


def _print_mark(name, mark, seconds_per_frame):
    """A memory mark as soon as it is taken (a run cut off by a time limit keeps them)."""
    f, used, peak = mark
    print(
        f"{name}: frame {f}, in use {used / 2**30:.3f} GiB, peak {peak / 2**30:.3f} GiB, "
        f"{seconds_per_frame * 1e3:.2f} ms/frame",
        flush=True,
    )


def _growth(marks):
    """Bytes in use per 1,000 frames between the first and the last mark."""
    if len(marks) < 2:
        return float("nan")
    (f0, b0, _), (f1, b1, _) = marks[0], marks[-1]
    return (b1 - b0) / (f1 - f0) * 1000


def _upstream(config):
    """Upstream's GCTStream with random weights on torch's device, and its attention backend."""
    src = upstream.source()
    if src is None:
        raise SystemExit("set LINGBOT_MAP_SRC to an upstream lingbot-map checkout")
    import torch

    try:
        import flashinfer  # noqa: F401

        backend = "flashinfer" if torch.cuda.is_available() else "sdpa"
    except ImportError as e:  # the offline machine without its wheel: upstream's SDPA backend instead
        print(f"flashinfer not importable ({e}); upstream runs its SDPA backend")
        backend = "sdpa"
    ref = upstream.build(config, src, use_sdpa=backend == "sdpa", perturb=0.0)
    return (ref.cuda() if torch.cuda.is_available() else ref), backend


PORT, PORT_FP8 = "port (jaxkv)", "port (jaxkv, fp8 cache)"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="518x378", help="WxH, multiples of 14")
    p.add_argument("--warm", type=int, default=80)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--compile", action="store_true", help="also upstream's torch.compile path (slow to build)")
    p.add_argument("--long", type=int, default=0, help="stream this many frames through the port (memory run)")
    p.add_argument("--long-upstream", type=int, default=0, help="and this many through upstream")
    p.add_argument("--every", type=int, default=1000, help="frames between memory marks in --long")
    p.add_argument("--small", action="store_true", help="ViT-S config (smoke test)")
    p.add_argument(
        "--kv-dtype",
        choices=["fp8"],
        default=None,
        help="also the port with an FP8 global cache, a row beside the bf16 port; with --long, the port's cache",
    )
    args = p.parse_args()
    w, h = map(int, args.size.split("x"))
    n = args.warm + args.frames
    total = max(n, args.long, args.long_upstream)
    base = LingbotConfig.small() if args.small else LingbotConfig()
    config = base.replace(height=h, width=w, max_frame_num=total + 100, dtype="float32" if args.small else "bfloat16")
    frames = np.random.default_rng(0).random((min(n, 160), h, w, 3), np.float32)
    device = jax.devices()[0].device_kind
    if args.long or args.long_upstream:
        rows = {}
        if args.long:  # a memory run: the port on its own random weights, before torch is imported
            port = config.replace(kv_dtype=frame.FP8) if args.kv_dtype else config
            rows[PORT_FP8 if args.kv_dtype else PORT] = run_port(port, frames, 0, None, n=args.long, every=args.every)
        if args.long_upstream:
            ref, backend = _upstream(config)
            rows[f"upstream {backend}"] = run_upstream(
                ref, frames, 0, config.num_scale_frames, n=args.long_upstream, every=args.every
            )
        _print_long_table(w, h, config, device, args.every, rows)
        return
    ref, backend = _upstream(config)
    sd = upstream.state_dict(ref)
    rows = {PORT: run_port(config, frames, args.warm, sd)}
    _print_row(PORT, rows[PORT])
    if args.kv_dtype:
        rows[PORT_FP8] = run_port(config.replace(kv_dtype=frame.FP8), frames, args.warm, sd)
        _print_row(PORT_FP8, rows[PORT_FP8])
    rows[f"upstream {backend}"] = run_upstream(ref, frames, args.warm, config.num_scale_frames)
    _print_row(f"upstream {backend}", rows[f"upstream {backend}"])
    if args.compile:
        t = time.perf_counter()
        rows["upstream compiled"] = run_upstream(ref, frames, args.warm, config.num_scale_frames, compile_=True)
        print(f"upstream compiled: {time.perf_counter() - t:.1f} s with its torch.compile builds", flush=True)
    ref_ms = np.median(rows[f"upstream {backend}"][0])
    eager_last = rows[f"upstream {backend}"][2]
    print(
        f"\nlingbot-map frame step, {w}x{h}, {config.dtype}, {device}, median of {args.frames} frames after {args.warm}; "
        f"streamed: {STREAMED} frames queued, one sync; host: until each queued call returns; kernel: a trace of "
        f"{TRACED} frames"
    )
    print(
        f"{'contender':<24}{'ms/frame':>10}{'p90':>8}{'streamed':>10}{'host':>8}{'kernel':>8}{'first s':>9}"
        f"{'x upstream':>12}{'peak GiB':>10}{'last-frame rel err':>20}"
    )
    for name, (t, peak, last, _, extra) in rows.items():
        # upstream rows: the bf16 port against them; the FP8 port: it against upstream eager
        err = 0.0 if name == PORT else _rel_err(last, eager_last) if name == PORT_FP8 else _rel_err(rows[PORT][2], last)
        cols = [extra.get(k) for k in ("streamed_ms", "host_ms", "kernel_ms", "first_s")]
        cols = [float("nan") if v is None else v for v in cols]
        print(
            f"{name:<24}{np.median(t):>10.2f}{np.percentile(t, 90):>8.2f}"
            + "".join(f"{v:>{wd}.{p}f}" for v, wd, p in zip(cols, (10, 8, 8, 9), (2, 2, 2, 1)))
            + f"{np.median(t) / ref_ms:>12.2f}{peak / 2**30:>10.2f}{err:>20.3g}"
        )


def _rel_err(port_last, upstream_last) -> float:
    """The port's last-frame outputs against upstream's: max abs error over max abs value."""
    return max(
        float(np.abs(port_last[k][0] - upstream_last[k]).max() / np.abs(upstream_last[k]).max())
        for k in ("pose_enc", "depth_conf")
    )


def _print_long_table(w, h, config, device, every, rows):
    print(f"\nlingbot-map long video, {w}x{h}, {config.dtype}, {device}: memory in use every {every} frames")
    print(f"{'contender':<24}{'frames':>8}{'in use GiB':>12}{'peak GiB':>10}{'ms/frame':>10}")
    for name, (t, _, _, marks, _) in rows.items():
        for (f, used, peak), ms in zip(marks, t):
            print(f"{name:<24}{f:>8}{used / 2**30:>12.3f}{peak / 2**30:>10.3f}{ms:>10.2f}")
    for name, (_, peak, _, marks, _) in rows.items():
        print(
            f"{name:<24} peak {peak / 2**30:.3f} GiB after {marks[-1][0]} frames; "
            f"growth {_growth(marks) / 2**20:.2f} MiB per 1,000 frames"
        )


def _print_row(name, row):
    """One contender's figures as soon as it is done (a run cut off by a time limit keeps them)."""
    t, peak = row[0], row[1]
    print(
        f"{name}: {np.median(t):.2f} ms/frame (p90 {np.percentile(t, 90):.2f}), peak {peak / 2**30:.2f} GiB", flush=True
    )


if __name__ == "__main__":
    main()
