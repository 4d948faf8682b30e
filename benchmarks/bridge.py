"""The drop-in ``torch_bridge.FlashInferKVCacheManager`` against the seed's own manager.

One 24-layer frame step as lingbot-map's aggregator drives a manager: per block
``append_frame`` + ``evict_frames`` + ``compute_attention`` (FlashInfer FA2, plan once per
frame, run per block), synchronized once per frame. Both managers run in this process on
the same GPU and the same random frames, after enough warm-up frames to fill the window
(8 scale + 64 window); the two run in A-B-B-A order and each reports the median ms/frame
over its timed frames of both runs. The last frame's outputs of
the two are compared (same visible tokens, different page order).

    python benchmarks/bridge.py --seed-file .seeds/lingbot_map_flashinfer_cache.py

The seed's file is not part of this repository (``../shared/seeds/``); pass its path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import torch  # noqa: E402

from _timing import times_ms  # noqa: E402
from torch_bridge import FlashInferKVCacheManager  # noqa: E402

RESOLUTIONS = {"224x224": 262, "518x378": 1005}


def load_seed(path):
    spec = importlib.util.spec_from_file_location("seed_flashinfer_cache", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FlashInferKVCacheManager


def make_manager(cls, tpf, layers):
    return cls(num_blocks=layers, max_num_frames=88, tokens_per_frame=tpf, num_heads=16, head_dim=64,
               dtype=torch.bfloat16, device=torch.device("cuda"), max_total_frames=256)


def frame_step(mgr, layers, frame, out):
    """One frame as lingbot-map drives a manager; ``out[b]`` gets block b's attention."""
    k, v, q = frame
    for b in range(layers):
        mgr.append_frame(b, k[b], v[b])
        mgr.evict_frames(b, scale_frames=8, sliding_window=64)
        out[b] = mgr.compute_attention(b, q[b])
    torch.cuda.synchronize()


def bench(cls, tpf, layers, warm, iters, frames):
    mgr, out = make_manager(cls, tpf, layers), {}
    times = times_ms(lambda i: frame_step(mgr, layers, frames[i % len(frames)], out), iters, warmup=warm)
    return times, out


def profile(args):
    import cProfile
    import pstats

    tpf = RESOLUTIONS[args.resolutions[0]]
    frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))]
    bench(FlashInferKVCacheManager, tpf, args.layers, args.warm, 2, frames)  # compile everything
    prof = cProfile.Profile()
    prof.enable()
    times, _ = bench(FlashInferKVCacheManager, tpf, args.layers, 0, args.iters, frames)
    ms = statistics.median(times)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    print(f"{args.resolutions[0]}: {ms:.2f} ms/frame under the profiler")


def kernel_breakdown(args, seed_cls):
    from torch.profiler import ProfilerActivity, profile as tprofile

    for res in args.resolutions:
        tpf = RESOLUTIONS[res]
        frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))]
        for name, cls in (("seed", seed_cls), ("drop-in", FlashInferKVCacheManager)):
            mgr, out = make_manager(cls, tpf, args.layers), {}
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed-file", default=".seeds/lingbot_map_flashinfer_cache.py")
    p.add_argument("--resolutions", nargs="+", default=list(RESOLUTIONS), choices=list(RESOLUTIONS))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warm", type=int, default=80)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile the drop-in's host side over --iters frames")
    p.add_argument("--kernels", action="store_true", help="torch-profile 5 frames of each manager: GPU time by kernel")
    args = p.parse_args(argv)
    seed_cls = load_seed(args.seed_file)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}  torch {torch.__version__}  jax {jax.__version__}", flush=True)
    if args.profile:
        return profile(args)
    if args.kernels:
        return kernel_breakdown(args, seed_cls)
    rows = []
    for res in args.resolutions:
        tpf = RESOLUTIONS[res]
        g = torch.Generator(device="cuda").manual_seed(0)
        frames = [tuple(torch.randn(args.layers, tpf, 16, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                        for _ in range(3)) for _ in range(2)]
        outs, times = {}, {}
        seed, ours = ("seed manager (FA2)", seed_cls), ("jaxkv drop-in (FA2)", FlashInferKVCacheManager)
        for name, cls in (seed, ours, ours, seed):  # ABBA: clock or thermal drift hits both alike
            t, outs[name] = bench(cls, tpf, args.layers, args.warm, args.iters, frames)
            times.setdefault(name, []).extend(t)
            print(f"  {res} {name}: {statistics.median(t):.2f} ms/frame", flush=True)
            torch.cuda.empty_cache()
        for name in (seed[0], ours[0]):
            rows.append(dict(resolution=res, manager=name, ms_per_frame=statistics.median(times[name])))
        a, b = outs[seed[0]], outs[ours[0]]
        diff = max(float((a[l].float() - b[l].float()).abs().max()) for l in range(args.layers))
        rows[-1]["max_abs_diff_vs_seed"] = diff
    print(f"\n{'resolution':<10} {'manager':<22} {'ms/frame':>9} {'vs seed':>8}")
    for r in rows:
        base = next(x["ms_per_frame"] for x in rows if x["resolution"] == r["resolution"] and x["manager"].startswith("seed"))
        extra = f"   max |out - seed out| {r['max_abs_diff_vs_seed']:.1e}" if "max_abs_diff_vs_seed" in r else ""
        print(f"{r['resolution']:<10} {r['manager']:<22} {r['ms_per_frame']:9.2f} {r['ms_per_frame'] / base:8.2f}{extra}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
