"""The streaming model's global attention against the bare frame cache (issue: Flax model target).

Side by side in one process, same GPU, steady state (scale frames and window full, 80
frames streamed before timing), 518x378 (999 patches + 6 specials), 24 global layers of
16 heads x 64, bf16, median of many frames:

* cache/bare: ``benchmarks/frame_step.py``'s jaxkv step — ``frame.append`` for all 24
  layers + ``frame.attention`` per layer, random K/V/Q.
* model/global-layers: the model's 24 ``StreamingGlobalAttention`` layers alone on fixed
  hidden states (the shared cache's ``begin_frame``, then per layer QKV projection, q/k
  RMSNorm, RoPE, K/V write, attention, output projection), one jitted step (``jaxkv.flax.CachedStep``, caches donated).
* model/step: one whole ``StreamingReconstructor`` frame step (24 frame blocks, 24 global
  blocks, heads) on synthetic video frames, through ``CachedStep``.
* model/step-nnx.jit: the same step through ``nnx.jit`` (module donated): its per-call
  graph traversal on the host.
* model/step-no-global: the same step with the global blocks' attention skipped (their
  MLPs kept), timed interleaved with model/step frame by frame; the median of the
  per-frame differences is the global-attention share inside the model.

    python benchmarks/model_step.py --json model.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import kernel_ms_per_step, times_ms  # noqa: E402
from flax import nnx  # noqa: E402
from frame_step import bench_jaxkv  # noqa: E402

from jaxkv.flax import CachedStep  # noqa: E402
from jaxkv.models import LINGBOT_518, StreamingReconstructor, synthetic_video  # noqa: E402


def _model(layers, frames, dtype):
    import dataclasses

    cfg = dataclasses.replace(LINGBOT_518, depth=layers, max_frames=frames + 8, dtype=dtype, param_dtype=dtype)
    return cfg, StreamingReconstructor(cfg, rngs=nnx.Rngs(0))


def bench_global_layers(layers, warm, iters, dtype, top=0):
    cfg, model = _model(layers, warm + iters, dtype)
    key = jax.random.key(0)
    xs = [
        jax.random.normal(jax.random.fold_in(key, i), (1, cfg.tokens_per_frame, cfg.dim), jnp.dtype(dtype))
        for i in range(3)
    ]

    def layers(m, x, t):
        cos, sin = m.rope(t)
        m.cache.begin_frame()
        return jnp.stack([gb.attn(x, cos, sin) for gb in m.global_blocks])

    step = CachedStep(model, layers)
    hlo_dir = os.environ.get("JAXKV_HLO_DIR")  # write the compiled step's HLO there, to look for copies
    if hlo_dir:
        t0 = jnp.zeros((1,), jnp.int32)
        with open(os.path.join(hlo_dir, "global_layers.hlo.txt"), "w") as fh:
            fh.write(step._step.lower(step.caches, step.rest, xs[0], t0).compile().as_text())

    def one(i):
        step(xs[i % 3], jnp.full((1,), i, jnp.int32)).block_until_ready()

    for i in range(warm):
        one(i)
    ms = times_ms(lambda i: one(warm + i), iters)
    if top:
        kernel_ms_per_step(lambda i: one(warm + iters + i), 5, top)
    return ms


def model_step(layers, warm, iters, dtype, variant="step"):
    """A warmed-up ``one(i)`` running one frame step of ``variant``: step, no-global, nnx.jit."""
    cfg, model = _model(layers, warm + iters, dtype)
    video = jax.device_put(jnp.asarray(synthetic_video(4, cfg.height, cfg.width).frames))

    def no_global(m, images):  # the model's step with each global block's attention left out
        t = m.frame_index.get_value()
        x = m.tokens(images)
        cos, sin = m.rope(t)
        for fb, gb in zip(m.frame_blocks, m.global_blocks):
            x = fb(x, cos, sin)
            x = x + gb.mlp(gb.norm2(x))
        m.frame_index.set_value(t + 1)
        camera, depth = m.heads(x)
        return {"camera": camera, "depth": depth}

    step = CachedStep(model, no_global if variant == "no-global" else None)
    if variant == "nnx.jit":
        jitted = nnx.jit(lambda m, x: m(x), donate_argnums=0)
        step = lambda x: jitted(model, x)  # noqa: E731

    def one(i):
        step(video[i % 4][None])["camera"].block_until_ready()

    for i in range(warm):
        one(i)
    return lambda i: one(warm + i)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warm", type=int, default=80, help="frames before timing (fills scale + window)")
    p.add_argument("--iters", type=int, default=40, help="timed frames per contender")
    p.add_argument("--dtype", default="bfloat16", help="model compute and parameter dtype (the cache is bf16)")
    p.add_argument(
        "--top",
        type=int,
        default=0,
        help="print the N kernels that take the most time (cache/bare and model/global-layers)",
    )
    p.add_argument("--only-layers", action="store_true", help="time cache/bare and model/global-layers only")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}  jax {jax.__version__}", flush=True)
    rows = {}

    def record(name, ms):
        rows[name] = dict(
            median_ms=statistics.median(ms),
            p10_ms=float(np.percentile(ms, 10)),
            p90_ms=float(np.percentile(ms, 90)),
            n=len(ms),
        )
        print(f"  {name:<22} {rows[name]['median_ms']:8.2f} ms/frame", flush=True)

    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"  # the model's "auto" picks the same
    ms, visible = bench_jaxkv(999, args.layers, impl, args.warm, args.iters, top=args.top)
    record("cache/bare", ms)
    record("model/global-layers", bench_global_layers(args.layers, args.warm, args.iters, args.dtype, args.top))
    if args.only_layers:
        return
    # the step with and without global attention, interleaved frame by frame so drift cancels
    full = model_step(args.layers, args.warm, args.iters, args.dtype)
    nog = model_step(args.layers, args.warm, args.iters, args.dtype, "no-global")
    a, b = [], []
    for i in range(args.iters):
        a += times_ms(lambda _: full(i), 1)
        b += times_ms(lambda _: nog(i), 1)
    record("model/step", a)
    record("model/step-no-global", b)
    record(
        "model/step-nnx.jit",
        times_ms(model_step(args.layers, args.warm, args.iters, args.dtype, "nnx.jit"), args.iters),
    )
    bare = rows["cache/bare"]["median_ms"]
    share = statistics.median(x - y for x, y in zip(a, b))
    print(
        f"\nmodel frame step at 518x378, {args.layers} global layers, 16 heads x 64, {args.dtype} — "
        f"{dev.device_kind}, median of {args.iters} frames after {args.warm}; {visible} visible keys per layer"
    )
    print(f"{'contender':<40} {'ms/frame':>9} {'vs cache/bare':>14}")
    for name, r in rows.items():
        print(f"{name:<40} {r['median_ms']:9.2f} {r['median_ms'] / bare:14.2f}")
    print(f"{'global share (median step - no-global)':<40} {share:9.2f} {share / bare:14.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(
                    device=dev.device_kind,
                    jax=jax.__version__,
                    layers=args.layers,
                    rows=rows,
                    global_share_ms=share,
                    visible_keys=visible,
                ),
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
