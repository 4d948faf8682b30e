"""Whole-model frame step of lingbot-map: the jaxkv port against upstream's own GCTStream.

Random weights, bf16 (upstream: autocast; the port: bf16 matmuls and caches), one stream,
the released config (ViT-L, 3D RoPE, 8 scale frames, 64-frame window). Each contender
streams ``--warm`` frames, then ``--frames`` more are timed one by one (each synced, as
upstream's ``gct_profile.py`` does); ms/frame is their median, peak memory the
framework's peak allocation over the whole run.

Contenders: ``port`` (``LingbotStream``), ``upstream-flashinfer`` (its default backend,
eager), ``upstream-compiled`` (``--compile``: ``gct_profile.py``'s torch.compile
"reduce-overhead" targets on the FlashInfer path). Upstream comes from
``$LINGBOT_MAP_SRC``; FlashInfer must be importable.

    LINGBOT_MAP_SRC=... XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/lingbot_step.py --size 518x378
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxkv.models.lingbot import LingbotConfig, LingbotMap, LingbotStream, upstream
from jaxkv.models.lingbot.convert import load_state_dict


def run_port(config, frames, warm, sd):
    model = LingbotMap(config)
    load_state_dict(model, sd)
    stream = LingbotStream(model)
    times = []
    t0 = None
    for i, out in enumerate(stream.run(frames)):
        jax.block_until_ready(out)
        t = time.perf_counter()
        if t0 is not None and i >= warm:
            times.append(t - t0)
        t0 = t
    dev = jax.devices()[0]
    peak = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0)
    last = {k: np.asarray(v, np.float32) for k, v in out.items()}
    del stream, model
    return np.array(times) * 1e3, peak, last


def run_upstream(model, frames, warm, compile_=False):
    import torch

    dev = "cuda"
    imgs = upstream.images_nchw(frames)[None]
    if compile_:
        agg = model.aggregator
        for i, b in enumerate(agg.frame_blocks):
            agg.frame_blocks[i] = torch.compile(b, mode="reduce-overhead")
        for i, b in enumerate(agg.patch_embed.blocks):
            agg.patch_embed.blocks[i] = torch.compile(b, mode="reduce-overhead")
        for b in agg.global_blocks:
            b.attn_pre = torch.compile(b.attn_pre, mode="reduce-overhead")
            b.ffn_residual = torch.compile(b.ffn_residual, mode="reduce-overhead")
            b.attn.proj = torch.compile(b.attn.proj, mode="reduce-overhead")
    torch.cuda.reset_peak_memory_stats()
    s = 8
    times = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.clean_kv_cache()
        torch.compiler.cudagraph_mark_step_begin()
        model.forward(imgs[:, :s].to(dev), num_frame_for_scale=s, num_frame_per_block=s, causal_inference=True)
        torch.cuda.synchronize()
        for i in range(s, imgs.shape[1]):
            x = imgs[:, i:i + 1].to(dev)
            t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            out = model.forward(x, num_frame_for_scale=s, num_frame_per_block=1, causal_inference=True)
            torch.cuda.synchronize()
            if i >= warm:
                times.append(time.perf_counter() - t0)
    last = {k: out[k][0, 0].float().cpu().numpy() for k in ("pose_enc", "depth", "depth_conf")}
    return np.array(times) * 1e3, torch.cuda.max_memory_allocated(), last


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="518x378", help="WxH, multiples of 14")
    p.add_argument("--warm", type=int, default=80)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--compile", action="store_true", help="also upstream's torch.compile path (slow to build)")
    args = p.parse_args()
    w, h = map(int, args.size.split("x"))
    src = upstream.source()
    if src is None:
        raise SystemExit("set LINGBOT_MAP_SRC to an upstream lingbot-map checkout")
    import torch

    n = args.warm + args.frames
    config = LingbotConfig(height=h, width=w, max_frame_num=n + 100, dtype="bfloat16")
    frames = np.random.default_rng(0).random((n, h, w, 3), np.float32)
    try:
        import flashinfer  # noqa: F401
        backend = "flashinfer"
    except ImportError as e:  # the offline machine without its wheel: upstream's SDPA backend instead
        print(f"flashinfer not importable ({e}); upstream runs its SDPA backend")
        backend = "sdpa"
    ref = upstream.build(config, src, use_sdpa=backend == "sdpa", perturb=0.0).cuda()
    sd = upstream.state_dict(ref)
    rows = {}
    rows["port (jaxkv)"] = run_port(config, frames, args.warm, sd)
    rows[f"upstream {backend}"] = run_upstream(ref, frames, args.warm)
    if args.compile:
        rows["upstream compiled"] = run_upstream(ref, frames, args.warm, compile_=True)
    base = np.median(rows[f"upstream {backend}"][0])
    port_last = rows["port (jaxkv)"][2]
    print(f"\nlingbot-map frame step, {w}x{h}, bf16, {jax.devices()[0].device_kind}, "
          f"median of {args.frames} frames after {args.warm}")
    print(f"{'contender':<22}{'ms/frame':>10}{'p90':>8}{'x upstream':>12}{'peak GiB':>10}{'last-frame rel err':>20}")
    for name, (t, peak, last) in rows.items():
        err = max(float(np.abs(port_last[k][0] - last[k]).max() / np.abs(last[k]).max())
                  for k in ("pose_enc", "depth_conf")) if name != "port (jaxkv)" else 0.0
        print(f"{name:<22}{np.median(t):>10.2f}{np.percentile(t, 90):>8.2f}{np.median(t) / base:>12.2f}"
              f"{peak / 2**30:>10.2f}{err:>20.3g}")


if __name__ == "__main__":
    main()
