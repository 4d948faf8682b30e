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
``torch_bridge.use_in_lingbot_map()`` (B: the one-import change; one run per
``--model-backends`` entry), in A-B-B-A order on the same model, frames and weights; the
median ms/frame of the timed frames, and the last frame's pose_enc / depth_conf against A's.

    LINGBOT_MAP_SRC=.upstream/lingbot-map python benchmarks/bridge.py --model

The seed's file is not part of this repository (``../shared/seeds/``); pass its path, or it
falls back to upstream's own ``lingbot_map/layers/flashinfer_cache.py`` under ``$LINGBOT_MAP_SRC``.
"""

from __future__ import annotations

import argparse
import contextlib
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
from torch_bridge import manager as M  # noqa: E402

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


def make_manager(cls, tpf, layers, device, backend=None):
    extra = {} if backend is None else {"backend": backend}  # the seed takes no backend
    return cls(num_blocks=layers, max_num_frames=88, tokens_per_frame=tpf, num_heads=16, head_dim=64,
               dtype=torch.bfloat16, device=device, max_total_frames=256, **extra)


def frame_step(mgr, layers, frame, out):
    """One frame as lingbot-map drives a manager; ``out[b]`` gets block b's attention."""
    k, v, q = frame
    for b in range(layers):
        mgr.append_frame(b, k[b], v[b])
        mgr.evict_frames(b, scale_frames=8, sliding_window=64)
        out[b] = mgr.compute_attention(b, q[b])
    sync(mgr.device)


def bench(cls, tpf, layers, warm, iters, frames, device, backend=None):
    mgr, out = make_manager(cls, tpf, layers, device, backend), {}
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
    from torch.profiler import ProfilerActivity, profile as tprofile

    dev = args.device
    for res in args.resolutions:
        tpf = RESOLUTIONS[res]
        frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))]
        entries = ([("seed", seed_cls, None)] if seed_cls else []) + \
            [(f"drop-in {b}", FlashInferKVCacheManager, b) for b in args.backends]
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
        frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device=dev, dtype=torch.bfloat16, generator=g)
                        for _ in range(3)) for _ in range(2)]
        entries = ([(SEED, seed_cls, None)] if seed_cls else []) + \
            [(f"jaxkv drop-in ({b})", FlashInferKVCacheManager, b) for b in args.backends]
        outs, times = {}, {}
        for name, cls, backend in entries + entries[::-1]:  # A-B-..-B-A: clock or thermal drift hits all alike
            t, outs[name] = bench(cls, tpf, args.layers, args.warm, args.iters, frames, dev, backend)
            times.setdefault(name, []).extend(t)
            print(f"  {res} {name}: {statistics.median(t):.2f} ms/frame", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        ref = outs[entries[0][0]]
        for name, _, _ in entries:
            row = dict(resolution=res, manager=name, ms_per_frame=statistics.median(times[name]))
            if name != entries[0][0]:
                row["max_abs_diff"] = max(float((outs[name][l].float() - ref[l].float()).abs().max())
                                          for l in range(args.layers))
            rows.append(row)
    print(f"\n{'resolution':<10} {'manager':<36} {'ms/frame':>9} {'vs first':>8}")
    for r in rows:
        base = next(x["ms_per_frame"] for x in rows if x["resolution"] == r["resolution"])
        extra = f"   max |out - first out| {r['max_abs_diff']:.1e}" if "max_abs_diff" in r else ""
        print(f"{r['resolution']:<10} {r['manager']:<36} {r['ms_per_frame']:9.2f} {r['ms_per_frame'] / base:8.2f}"
              f"{extra}")
    return rows


# ---------------------------------------------------------------- --model: upstream's GCTStream
MODEL_KEYS = ("pose_enc", "depth_conf")


def stream_model(model, images, scale_frames, warm, interval):
    """A fresh manager (upstream builds it lazily at the first forward, from the class installed
    now), the scale frames at once, then frame by frame synced per frame -> (timed ms list,
    last frame's outputs, the manager)."""
    model.aggregator.kv_cache_manager = None
    model.clean_kv_cache()
    S, dev = images.shape[1], images.device
    times = []
    with torch.no_grad(), torch.amp.autocast(dev.type, dtype=torch.bfloat16):
        torch.compiler.cudagraph_mark_step_begin()
        model.forward(images[:, :scale_frames], num_frame_for_scale=scale_frames,
                      num_frame_per_block=scale_frames, causal_inference=True)
        sync(dev)
        for i in range(scale_frames, S):
            key = interval <= 1 or (i - scale_frames) % interval == 0
            if not key:
                model._set_skip_append(True)
            t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            out = model.forward(images[:, i:i + 1], num_frame_for_scale=scale_frames, num_frame_per_block=1,
                                causal_inference=True)
            sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
            if not key:
                model._set_skip_append(False)
    last = {k: out[k].float().clone() for k in MODEL_KEYS}
    return times[warm:], last, model.aggregator.kv_cache_manager


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
    config = LingbotConfig().replace(height=378, width=518, max_frame_num=n + 16, num_scale_frames=sf,
                                     kv_cache_scale_frames=sf)
    model = upstream.build(config, src, use_sdpa=False, perturb=0.0).cuda()
    if args.compile:
        upstream.compile_like_gct_profile(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    images = torch.rand(1, n, 3, config.height, config.width, device="cuda", generator=g).to(torch.bfloat16)
    names = ["upstream manager"] + [f"jaxkv drop-in ({b})" for b in args.model_backends]
    outs, times, kinds = {}, {}, {}
    for name in names + names[::-1]:  # A-B-B-A
        backend = None if name == names[0] else args.model_backends[names.index(name) - 1]
        with (use_in_lingbot_map(backend) if backend else contextlib.nullcontext()):
            t, outs[name], mgr = stream_model(model, images, sf, args.model_warm, args.keyframe_interval)
        kinds[name] = f"{type(mgr).__module__}.{type(mgr).__name__}" + (f" [{mgr.backend}]" if backend else "")
        times.setdefault(name, []).extend(t)
        print(f"  {name} ({kinds[name]}): {statistics.median(t):.2f} ms/frame", flush=True)
        del mgr
        torch.cuda.empty_cache()
    rows = []
    for name in names:
        row = dict(manager=name, kind=kinds[name], ms_per_frame=statistics.median(times[name]))
        if name != names[0]:
            for k in MODEL_KEYS:
                a, b = outs[names[0]][k], outs[name][k]
                row[f"rel_err_{k}"] = float((b - a).abs().max() / a.abs().max())
        rows.append(row)
    print(f"\nGCTStream 518x378 bf16, {sf} scale frames, {args.model_warm} warm + {args.model_iters} timed frames, "
          f"keyframe_interval {args.keyframe_interval}{', compiled' if args.compile else ''}")
    print(f"{'manager':<36} {'ms/frame':>9} {'vs A':>6}  last frame vs A (max rel err)")
    base = rows[0]["ms_per_frame"]
    for r in rows:
        errs = "  ".join(f"{k} {r['rel_err_' + k]:.1e}" for k in MODEL_KEYS if "rel_err_" + k in r)
        print(f"{r['manager']:<36} {r['ms_per_frame']:9.2f} {r['ms_per_frame'] / base:6.2f}  {errs}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed-file", default=".seeds/lingbot_map_flashinfer_cache.py")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", nargs="+", default=None, choices=[b for b in M.BACKENDS if b != "auto"],
                   help="drop-in backends to time (default: every one that can run on --device)")
    p.add_argument("--resolutions", nargs="+", default=["224x224", "518x378"], choices=list(RESOLUTIONS))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warm", type=int, default=80)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--small", action="store_true", help="smoke run: 'small' frames (38 tokens), 2 layers, "
                   "10 warm-up + 5 timed frames")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile the drop-in's host side over --iters frames")
    p.add_argument("--kernels", action="store_true", help="torch-profile 5 frames of each manager: GPU time by kernel")
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
    print(f"device: {dev}  torch {torch.__version__}  jax {jax.__version__}  "
          f"flashinfer {'yes' if M.FLASHINFER_AVAILABLE else 'no'}", flush=True)
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
