"""The drop-in ``torch_bridge.FlashInferKVCacheManager`` against the seed's own manager.

Manager level (default): one 24-layer frame step as lingbot-map's aggregator drives a
manager: per block ``append_frame`` + ``evict_frames`` + ``compute_attention``, synchronized
once per frame. The seed (FlashInfer FA2, plan once per frame, run per block) and the drop-in
with each of its backends (``--backends``: "sdpa" and "flashinfer" over the contiguous
visible prefix, "flashinfer-paged-fa2" the seed's paged path over jaxkv buffers) run in this
process on the same device and the same random frames, after enough warm-up frames to fill
the window (8 scale + 64 window), in A-B-..-B-A order; each row is the median ms/frame over
its timed frames of both runs. The last frame's outputs are compared with the seed's (same
visible tokens, different key order).

    python benchmarks/bridge.py --seed-file .seeds/lingbot_map_flashinfer_cache.py
    python benchmarks/bridge.py --device cpu --small     # a CPU smoke run (no seed: it needs FlashInfer)

Model level (``--model``): upstream lingbot-map's GCTStream (``$LINGBOT_MAP_SRC``; random
weights, the released config at 518x378, bf16 autocast, FlashInfer path) streaming
``--model-warm`` + ``--model-iters`` frames after its 8 scale frames, synchronized per frame
as upstream's gct_profile, with its own manager (A) and after
``torch_bridge.use_in_lingbot_map()`` (B: the one-import change; one per ``--model-backends``
entry): one model per manager, the same weights and frames, streamed frame by frame in turn
(A-B, B-A, ...: the host's speed drifts by tens of percent over seconds on the GPU machine, and
this way every manager meets the same drift); the median ms/frame of the timed frames (and of
each half), the host time spent inside the manager's calls, and the last frame's pose_enc /
depth_conf against A's. ``--kernels`` adds each manager's GPU kernel time per frame.

    LINGBOT_MAP_SRC=.upstream/lingbot-map python benchmarks/bridge.py --model [--compile]

``--compile`` applies upstream's ``torch.compile(mode="reduce-overhead")`` targets (gct_profile.py:
frame and backbone blocks, and each global block's pre-attention, FFN and projection, around the
manager's calls) to each model after a few eager frames; the graphs then replay with upstream's
manager or the drop-in between them.

The seed's file is not part of this repository (``../shared/seeds/``); pass its path, or it
falls back to upstream's own ``lingbot_map/layers/flashinfer_cache.py`` under ``$LINGBOT_MAP_SRC``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import torch  # noqa: E402
from _timing import times_ms  # noqa: E402

from torch_bridge import FlashInferKVCacheManager  # noqa: E402
from torch_bridge import backends as M  # noqa: E402

RESOLUTIONS = {"224x224": 262, "518x378": 1005, "small": 38}
SEED = "seed manager (FA2)"


def load_seed(path):
    """The seed's manager class from ``path`` (or upstream's file under $LINGBOT_MAP_SRC), or None."""
    if not path or not os.path.isfile(path):
        src = os.environ.get("LINGBOT_MAP_SRC")
        path = os.path.join(src, "lingbot_map", "layers", "flashinfer_cache.py") if src else None
    if not path or not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("seed_flashinfer_cache", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FlashInferKVCacheManager


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_manager(cls, tpf, layers, device, backend=None, dtype=torch.bfloat16):
    extra = {} if backend is None else {"backend": backend}  # the seed takes no backend
    return cls(
        num_blocks=layers,
        max_num_frames=88,
        tokens_per_frame=tpf,
        num_heads=16,
        head_dim=64,
        dtype=dtype,
        device=device,
        max_total_frames=256,
        **extra,
    )


def frame_step(mgr, layers, frame, out):
    """One frame as lingbot-map drives a manager; ``out[b]`` gets block b's attention."""
    k, v, q = frame
    for b in range(layers):
        mgr.append_frame(b, k[b], v[b])
        mgr.evict_frames(b, scale_frames=8, sliding_window=64)
        out[b] = mgr.compute_attention(b, q[b])
    sync(mgr.device)


def bench(cls, tpf, layers, warm, iters, frames, device, backend=None, dtype=torch.bfloat16):
    mgr, out = make_manager(cls, tpf, layers, device, backend, dtype), {}
    times = times_ms(lambda i: frame_step(mgr, layers, frames[i % len(frames)], out), iters, warmup=warm)
    return times, out


def default_backends(device):
    if device.type != "cuda" or not M.FLASHINFER_AVAILABLE:
        return ["sdpa"]
    return ["flashinfer-paged-fa2", "flashinfer", "sdpa"]


def profile(args):
    import cProfile
    import pstats

    tpf, dev, backend = RESOLUTIONS[args.resolutions[0]], args.device, args.backends[0]
    frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))]
    bench(FlashInferKVCacheManager, tpf, args.layers, args.warm, 2, frames, dev, backend)  # compile everything
    prof = cProfile.Profile()
    prof.enable()
    times, _ = bench(FlashInferKVCacheManager, tpf, args.layers, 0, args.iters, frames, dev, backend)
    ms = statistics.median(times)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    print(f"{args.resolutions[0]} {backend}: {ms:.2f} ms/frame under the profiler")


def kernel_breakdown(args, seed_cls):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    dev = args.device
    for res in args.resolutions:
        tpf = RESOLUTIONS[res]
        frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))]
        entries = ([("seed", seed_cls, None)] if seed_cls else []) + [
            (f"drop-in {b}", FlashInferKVCacheManager, b) for b in args.backends
        ]
        for name, cls, backend in entries:
            mgr, out = make_manager(cls, tpf, args.layers, dev, backend), {}
            for _ in range(args.warm):
                frame_step(mgr, args.layers, frames[0], out)
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    frame_step(mgr, args.layers, frames[0], out)
            by = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    kk = by.setdefault(e.name[:60], [0.0, 0])
                    kk[0] += e.device_time
                    kk[1] += 1
            mgr = None  # free its buffers before the next manager
            frames_n = 5
            total = sum(v[0] for v in by.values()) / frames_n / 1e3
            print(f"{res} {name}: {total:.2f} ms of CUDA kernels per frame (5 frames after {args.warm} warm-up)")
            for kname, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:8]:
                print(f"    {t / frames_n / 1e3:8.3f} ms {c / frames_n:6.1f}x  {kname}")
            torch.cuda.empty_cache()


def _seed_usable(seed_cls, device):
    """The seed needs CUDA and FlashInfer: None (and why) where it cannot run."""
    if seed_cls is None:
        return None, "no seed file (--seed-file, or $LINGBOT_MAP_SRC)"
    if device.type != "cuda" or not M.FLASHINFER_AVAILABLE:
        return None, "the seed needs CUDA and FlashInfer"
    return seed_cls, None


def manager_table(args, seed_cls):
    dev = args.device
    seed_cls, why = _seed_usable(seed_cls, dev)
    if why:
        print(f"(no seed row: {why})")
    rows = []
    for res in args.resolutions:
        tpf = RESOLUTIONS[res]
        g = torch.Generator(device=dev).manual_seed(0)
        frames = [
            tuple(
                torch.randn(args.layers, tpf, 16, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3)
            )
            for _ in range(2)
        ]
        bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
        entries = ([(SEED, seed_cls, None, bf16)] if seed_cls else []) + [
            (f"jaxkv drop-in ({b})", FlashInferKVCacheManager, b, bf16) for b in args.backends
        ]
        if args.fp8:  # the FP8 cache: the prefix backends attend its dequantized visible rows
            entries += [
                (f"jaxkv drop-in ({b}, FP8 cache)", FlashInferKVCacheManager, b, fp8)
                for b in args.backends
                if b in M.PREFIX_BACKENDS
            ]
        outs, times = {}, {}
        for name, cls, backend, dtype in entries + entries[::-1]:  # A-B-..-B-A: drift hits all alike
            t, outs[name] = bench(cls, tpf, args.layers, args.warm, args.iters, frames, dev, backend, dtype)
            times.setdefault(name, []).extend(t)
            print(f"  {res} {name}: {statistics.median(t):.2f} ms/frame", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        ref = outs[entries[0][0]]
        for name, *_ in entries:
            row = dict(resolution=res, manager=name, ms_per_frame=statistics.median(times[name]))
            if name != entries[0][0]:
                row["max_abs_diff"] = max(
                    float((outs[name][l].float() - ref[l].float()).abs().max()) for l in range(args.layers)
                )
            rows.append(row)
    print(f"\n{'resolution':<10} {'manager':<36} {'ms/frame':>9} {'vs first':>8}")
    for r in rows:
        base = next(x["ms_per_frame"] for x in rows if x["resolution"] == r["resolution"])
        extra = f"   max |out - first out| {r['max_abs_diff']:.1e}" if "max_abs_diff" in r else ""
        print(
            f"{r['resolution']:<10} {r['manager']:<36} {r['ms_per_frame']:9.2f} {r['ms_per_frame'] / base:8.2f}{extra}"
        )
    return rows


# ---------------------------------------------------------------- --model: upstream's GCTStream
MODEL_KEYS = ("pose_enc", "depth_conf")


def stream_in_turn(entries, images, scale_frames, warm, interval, trace=None):
    """``entries``: (name, model, install) with one model per manager. Each model streams the same
    frames (a fresh manager from ``install``: upstream builds it lazily at the first forward; the
    scale frames at once), then frame by frame in turn, A-B then B-A, each frame synced, so that
    a drift of the host's speed or the GPU's clocks reaches every manager alike -> {name: (timed
    ms list, last frame's outputs, manager, host ms per timed frame inside the manager's calls)}.
    ``trace``: a ``torch.profiler.profile`` whose schedule starts with the streamed frames,
    stepped after each frame of every entry."""
    S = images.shape[1]
    times, outs, hosts = {}, {}, {}
    with (
        torch.no_grad(),
        torch.amp.autocast(images.device.type, dtype=torch.bfloat16),
        trace or contextlib.nullcontext(),
    ):
        for name, model, install in entries:
            with install():
                model.aggregator.kv_cache_manager = None
                model.clean_kv_cache()
                torch.compiler.cudagraph_mark_step_begin()
                model.forward(
                    images[:, :scale_frames],
                    num_frame_for_scale=scale_frames,
                    num_frame_per_block=scale_frames,
                    causal_inference=True,
                )
            sync(images.device)
            times[name], hosts[name] = [], _time_manager_calls(model.aggregator.kv_cache_manager)
        for i in range(scale_frames, S):
            key = interval <= 1 or (i - scale_frames) % interval == 0
            for name, model, install in entries if (i - scale_frames) % 2 == 0 else entries[::-1]:
                if i - scale_frames == warm:
                    hosts[name].clear()
                with install():
                    if not key:
                        model._set_skip_append(True)
                    t0 = time.perf_counter()
                    torch.compiler.cudagraph_mark_step_begin()
                    out = model.forward(
                        images[:, i : i + 1],
                        num_frame_for_scale=scale_frames,
                        num_frame_per_block=1,
                        causal_inference=True,
                    )
                    sync(images.device)
                    times[name].append((time.perf_counter() - t0) * 1e3)
                    if not key:
                        model._set_skip_append(False)
                outs[name] = {k: out[k].float().clone() for k in MODEL_KEYS} if i == S - 1 else None
            if trace is not None:
                trace.step()
    runs = {}
    for name, model, _ in entries:
        mgr = model.aggregator.kv_cache_manager
        for call in MANAGER_CALLS:
            mgr.__dict__.pop(call, None)
        runs[name] = (times[name][warm:], outs[name], mgr, sum(hosts[name].values()) / max(1, S - scale_frames - warm))
    return runs


MANAGER_CALLS = (
    "append_frame",
    "evict_frames",
    "compute_attention",
    "execute_deferred_eviction",
    "rollback_last_frame",
)


def _time_manager_calls(mgr):
    """Wrap the manager's per-block calls (on the instance) to add up the host time spent in
    them (no sync: what the manager costs the Python thread) -> {call: ms so far}."""
    host = {}

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                host[name] = host.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

        return call

    for name in MANAGER_CALLS:
        if hasattr(mgr, name):
            setattr(mgr, name, timed(name, getattr(mgr, name)))
    return host


def model_table(args):
    from jaxkv.models.lingbot import LingbotConfig, upstream
    from torch_bridge import use_in_lingbot_map

    src = upstream.source()
    if src is None:
        sys.exit("--model needs an upstream lingbot-map checkout in $LINGBOT_MAP_SRC")
    if not torch.cuda.is_available() or not M.FLASHINFER_AVAILABLE:
        sys.exit("--model needs CUDA and FlashInfer (upstream's own manager, run A, is FlashInfer's)")
    sf = args.scale_frames
    n = sf + args.model_warm + args.model_iters
    config = LingbotConfig().replace(
        height=378, width=518, max_frame_num=n + 16, num_scale_frames=sf, kv_cache_scale_frames=sf
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    images = torch.rand(1, n, 3, config.height, config.width, device="cuda", generator=g).to(torch.bfloat16)
    names = ["upstream manager"] + [f"jaxkv drop-in ({b})" for b in args.model_backends]
    installs = {
        name: (contextlib.nullcontext if i == 0 else functools.partial(use_in_lingbot_map, b))
        for i, (name, b) in enumerate(zip(names, [None, *args.model_backends]))
    }
    models = {}
    for name in names:  # one model per manager, the same weights (the same seed)
        with installs[name]():
            models[name] = upstream.build(config, src, use_sdpa=False, perturb=0.0).cuda()
        if args.compile:
            # Upstream's RoPE fills its cos/sin table cache at first use. If that first use is
            # inside a reduce-overhead graph, the cached table is CUDA-graph memory that the next
            # replay overwrites ("accessing tensor output of CUDAGraphs that has been
            # overwritten"): a few eager frames first, as upstream's demo effectively does.
            stream_in_turn([(name, models[name], installs[name])], images[:, : sf + 2], sf, 0, 1)
            upstream.compile_like_gct_profile(models[name])
    runs = stream_in_turn(
        [(name, models[name], installs[name]) for name in names], images, sf, args.model_warm, args.keyframe_interval
    )
    rows = []
    for name in names:
        t, out, mgr, h = runs[name]
        kind = f"{type(mgr).__module__}.{type(mgr).__name__}" + (f" [{mgr.backend}]" if name != names[0] else "")
        row = dict(
            manager=name,
            kind=kind,
            ms_per_frame=statistics.median(t),
            manager_host_ms=h,
            ms_per_frame_halves=[statistics.median(t[: len(t) // 2]), statistics.median(t[len(t) // 2 :])],
        )
        if name != names[0]:
            for k in MODEL_KEYS:
                a, b = runs[names[0]][1][k], out[k]
                row[f"rel_err_{k}"] = float((b - a).abs().max() / a.abs().max())
        rows.append(row)
        print(
            f"  {name} ({kind}): {row['ms_per_frame']:.2f} ms/frame (halves {row['ms_per_frame_halves'][0]:.2f}, "
            f"{row['ms_per_frame_halves'][1]:.2f}), {h:.2f} ms of it in manager calls (host)",
            flush=True,
        )
    if args.kernels:  # after the timed runs: the profiler slows the host
        for name, row in zip(names, rows):
            row["gpu_ms"] = model_kernels(name, models[name], installs[name], images, sf, args.keyframe_interval)
    print(
        f"\nGCTStream 518x378 bf16, {sf} scale frames, {args.model_warm} warm + {args.model_iters} timed frames, "
        f"keyframe_interval {args.keyframe_interval}{', compiled' if args.compile else ''}"
    )
    print(
        f"{'manager':<36} {'ms/frame':>9} {'vs A':>6} {'manager host ms':>15} {'GPU ms':>7}  "
        "last frame vs A (max rel err)"
    )
    base = rows[0]["ms_per_frame"]
    for r in rows:
        errs = "  ".join(f"{k} {r['rel_err_' + k]:.1e}" for k in MODEL_KEYS if "rel_err_" + k in r)
        gpu = f"{r['gpu_ms']:7.2f}" if "gpu_ms" in r else f"{'-':>7}"
        print(
            f"{r['manager']:<36} {r['ms_per_frame']:9.2f} {r['ms_per_frame'] / base:6.2f} "
            f"{r['manager_host_ms']:15.2f} {gpu}  {errs}"
        )
    return rows


def model_kernels(name, model, install, images, sf, interval, frames=5):
    """GPU kernel time of the last ``frames`` streamed frames, by kernel, against their wall
    time: where wall > kernels, the host (Python, launches) is what the frame waits for."""
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as tprofile

    done = []
    steps = images.shape[1] - sf
    prof = tprofile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=steps - frames - 1, warmup=1, active=frames),
        on_trace_ready=lambda p: done.append(p.key_averages()),
    )
    t = stream_in_turn([(name, model, install)], images, sf, steps - frames, interval, trace=prof)[name][0]
    torch.cuda.empty_cache()
    ka = done[-1]
    gpu = sorted(
        (e for e in ka if e.device_type.name == "CUDA" and not e.key.startswith("ProfilerStep")),
        key=lambda e: -e.device_time_total,
    )
    total = sum(e.device_time_total for e in gpu) / frames / 1e3
    print(f"\n{name}: {statistics.mean(t):.2f} ms/frame wall under the profiler, {total:.2f} ms of GPU kernels")
    for e in gpu[:8]:
        print(f"    {e.device_time_total / frames / 1e3:8.3f} ms {e.count / frames:6.1f}x  {e.key[:70]}")
    cpu = sorted((e for e in ka if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    print("  host, by self CPU time:")
    for e in cpu[:10]:
        print(f"    {e.self_cpu_time_total / frames / 1e3:8.3f} ms {e.count / frames:6.1f}x  {e.key[:70]}")
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed-file", default=".seeds/lingbot_map_flashinfer_cache.py")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=[b for b in M.BACKENDS if b != "auto"],
        help="drop-in backends to time (default: every one that can run on --device)",
    )
    p.add_argument("--resolutions", nargs="+", default=["224x224", "518x378"], choices=list(RESOLUTIONS))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warm", type=int, default=80)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument(
        "--small",
        action="store_true",
        help="smoke run: 'small' frames (38 tokens), 2 layers, 10 warm-up + 5 timed frames",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--fp8", action="store_true", help="also the drop-in with an FP8 cache (prefix backends)")
    p.add_argument("--profile", action="store_true", help="cProfile the drop-in's host side over --iters frames")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="torch-profile 5 frames of each manager: GPU time by kernel "
        "(with --model: after the table, host time too)",
    )
    g = p.add_argument_group("--model: upstream's GCTStream with its own manager vs the drop-in")
    g.add_argument("--model", action="store_true")
    g.add_argument("--model-backends", nargs="+", default=["auto"], choices=list(M.BACKENDS))
    g.add_argument("--model-warm", type=int, default=80)
    g.add_argument("--model-iters", type=int, default=40)
    g.add_argument("--scale-frames", type=int, default=8)
    g.add_argument("--keyframe-interval", type=int, default=1)
    g.add_argument("--compile", action="store_true", help="torch.compile as upstream's gct_profile")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.small:
        args.resolutions, args.layers, args.warm, args.iters = ["small"], 2, 10, 5
    if args.backends is None:
        args.backends = default_backends(args.device)
    dev = torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"
    print(
        f"device: {dev}  torch {torch.__version__}  jax {jax.__version__}  "
        f"flashinfer {'yes' if M.FLASHINFER_AVAILABLE else 'no'}",
        flush=True,
    )
    if args.model:
        rows = model_table(args)
    else:
        seed_cls = load_seed(args.seed_file)
        if args.profile:
            return profile(args)
        if args.kernels:
            return kernel_breakdown(args, seed_cls)
        rows = manager_table(args, seed_cls)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
