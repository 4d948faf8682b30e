"""Weak scaling of both caches over N devices, and the sharded code's cost on one device.

For each device count N (a 1-D ``data`` mesh over the first N devices; ``jaxkv.sharding``):

* hybrid: the V4-Flash decode bookkeeping step (``prepare_forward`` + every layer's SWA
  write and compressor append / flush; the 41 compressed layers' inputs stacked per kind
  of layer, ``hybrid.Stacked`` rows) for ``--requests`` requests *per device*
  (``hybrid.init(config, mesh=...)``: each device owns its requests and their blocks);
* frame: a 24-layer frame step (``frame.append`` + ``frame.attention`` per layer) with one
  video stream per device, scale frames and window full.

Each step is one jitted function with the state donated; its compiled HLO is checked for
collectives (there must be none). With N = 1 the same step also runs on a state made
without a mesh (the unsharded code path), interleaved with the sharded one, and the table
gives the sharded step's overhead. Weak-scaling efficiency is t(1) / t(N): 1.0 is perfect
(on CPU host devices the "devices" share the host's cores, so only the HLO column means
anything there).

    python benchmarks/scaling.py                       # every power of two up to the devices present
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/scaling.py --quick   # CPU-sized
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import times_ms  # noqa: E402
from hybrid_step import make_inputs, make_params, stack_layers  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxkv import frame  # noqa: E402
from jaxkv import hybrid as H

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


def collectives(compiled) -> str:
    found = sorted({m.group(1) for m in COLLECTIVES.finditer(compiled.as_text())})
    return ",".join(found) or "none"


def put(tree, mesh, spec):
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


# ----------------------------------------------------------------------------- hybrid
def decode_step(state, slots, stacked, impl):
    """prepare_forward (rows = slots in order: each device's rows are its own requests) +
    every layer's window write and compressor update, inputs read as ``Stacked`` rows."""
    cfg = state.config
    state, step = H.prepare_forward(state, slots, state.position, chunk=1)
    kv, by_kind = stacked
    seen = {H.CSA: 0, H.HCA: 0}
    for layer in range(cfg.num_layers):
        state = H.write_window(state, step, layer, H.Stacked(kv, layer), impl=impl)
        if cfg.compress_ratios[layer]:
            kind = cfg.kind(layer)
            x, p = jax.tree.map(lambda a, i=seen[kind]: H.Stacked(a, i), by_kind[kind])
            seen[kind] += 1
            index = (x["ikv"], x["iscore"], p["index"]) if kind == H.CSA else None
            state = H.compress(state, step, layer, x["ckv"], x["cscore"], p["main"], index, impl=impl)
    return state


def hybrid_case(cfg, mesh, impl):
    """(state at scattered positions, jitted step, its args) for ``cfg`` on ``mesh`` (None: no mesh)."""
    B = cfg.max_requests
    state = H.init(cfg, mesh=mesh)
    rows = P("data")
    slots = put(jnp.arange(B, dtype=jnp.int32), mesh, rows)
    start = np.random.default_rng(0).integers(cfg.max_context // 8, cfg.max_context // 2, size=B).astype(np.int32)
    T = int(start.max())
    state, step = H.prepare_forward(
        state, slots, put(jnp.zeros(B, jnp.int32), mesh, rows), put(jnp.asarray(start), mesh, rows), chunk=T
    )
    ones = put(jnp.ones((B, T, cfg.head_dim), jnp.bfloat16), mesh, rows)
    for layer in range(cfg.num_layers):  # SWA rings only: prefill content does not matter here
        state = H.write_window(state, step, layer, ones)
    del ones
    key = jax.random.key(0)
    kv, by_kind = stack_layers(cfg, make_inputs(cfg, B, key), make_params(cfg, key))
    kv = put(kv, mesh, P(None, "data"))
    by_kind = {k: (put(x, mesh, P(None, "data")), p) for k, (x, p) in by_kind.items() if x is not None}
    fn = jax.jit(decode_step, donate_argnums=0, static_argnames="impl")
    args = (slots, (kv, by_kind))
    compiled = fn.lower(state, *args, impl=impl).compile()
    return state, compiled, args


# ----------------------------------------------------------------------------- frame
def frame_spec(args, streams):
    return frame.FrameSpec(
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=args.head_dim,
        patches_per_frame=args.patches,
        num_special=6,
        scale_frames=args.scale_frames,
        sliding_window=args.window,
        max_frames=args.warm_frames + 4 * args.iters + 16,
        num_streams=streams,
    )


def frame_step(state, k, v, q):
    state = frame.append(state, k, v)
    outs = [frame.attention(state, layer, q[layer]) for layer in range(state.spec.num_layers)]
    return state, jnp.stack(outs)


def frame_case(spec, mesh):
    state = frame.init(spec, mesh=mesh)
    shape = (spec.num_layers, spec.num_streams, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    ks = jax.random.split(jax.random.key(1), 3)
    k, v, q = (put(jax.random.normal(x, shape, jnp.bfloat16), mesh, P(None, "data")) for x in ks)
    fn = jax.jit(frame_step, donate_argnums=0)
    compiled = fn.lower(state, k, v, q).compile()
    return state, compiled, (k, v, q)


# ----------------------------------------------------------------------------- timing
class Runner:
    """Holds a donated state and steps it; ``one`` is a timed call that synchronizes."""

    def __init__(self, case):
        self.state, self.fn, self.args = case

    def one(self, i=0):
        out = self.fn(self.state, *self.args)
        self.state = out[0] if isinstance(out, tuple) else out
        jax.block_until_ready(out)


def interleaved(runners, warm, iters, rounds=5):
    """Median ms per step of each runner, measured in alternating rounds (drift hits all alike)."""
    for r in runners:
        times_ms(r.one, 0, warmup=warm)
    samples = [[] for _ in runners]
    for _ in range(rounds):
        for s, r in zip(samples, runners):
            s += times_ms(r.one, max(1, iters // rounds))
    return [statistics.median(s) for s in samples]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=None, help="comma-separated device counts (default: powers of two up to all)")
    ap.add_argument("--requests", type=int, default=256, help="hybrid requests per device")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24, help="frame cache layers")
    ap.add_argument("--patches", type=int, default=256, help="patches per frame (224x224: 256; 518x378: 999)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--scale-frames", type=int, default=8)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--warm-frames", type=int, default=80, help="frames before timing (fills scale + window)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--skip", default="", help="hybrid and/or frame")
    ap.add_argument(
        "--quick", action="store_true", help="CPU-sized: 4 layers of V4-Flash, 4 requests, a small frame cache"
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    hybrid_cfg = dataclasses.replace(H.V4_FLASH, max_context=args.context)
    if args.quick:
        args.requests, args.context, args.layers, args.patches, args.heads, args.head_dim = 4, 512, 2, 16, 4, 16
        args.scale_frames, args.window, args.warm_frames, args.iters = 2, 4, 8, 10
        hybrid_cfg = dataclasses.replace(H.V4_FLASH, compress_ratios=H.V4_FLASH.compress_ratios[:4], max_context=512)
    devices = jax.devices()
    counts = (
        [int(n) for n in args.devices.split(",")]
        if args.devices
        else [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= len(devices)]
    )
    impl = "auto"
    rows, skip = [], set(args.skip.split(","))
    print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}")
    for n in counts:
        mesh = Mesh(np.array(devices[:n]), ("data",))
        cases = {}
        if "hybrid" not in skip:
            cfg = dataclasses.replace(hybrid_cfg, max_requests=args.requests * n)
            cases["hybrid"] = [("sharded", hybrid_case(cfg, mesh, impl))]
            if n == 1:
                cases["hybrid"].append(("unsharded", hybrid_case(cfg, None, impl)))
        if "frame" not in skip:
            spec = frame_spec(args, n)
            cases["frame"] = [("sharded", frame_case(spec, mesh))]
            if n == 1:
                cases["frame"].append(("unsharded", frame_case(spec, None)))
        for name, variants in cases.items():
            hlo = collectives(variants[0][1][1])
            runners = [Runner(case) for _, case in variants]
            warm = args.warm_frames if name == "frame" else 5
            ms = interleaved(runners, warm, args.iters)
            row = dict(
                cache=name,
                devices=n,
                ms=ms[0],
                collectives=hlo,
                work=f"{args.requests * n} requests" if name == "hybrid" else f"{n} streams",
            )
            if len(ms) > 1:
                row.update(unsharded_ms=ms[1], overhead=ms[0] / ms[1] - 1)
            rows.append(row)
            print(f"{name} on {n} device(s): {ms[0]:.3f} ms/step, collectives {hlo}", flush=True)
            del runners, variants
    base = {r["cache"]: r["ms"] for r in rows if r["devices"] == 1}
    for r in rows:
        if r["cache"] in base:
            r["efficiency"] = base[r["cache"]] / r["ms"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=devices[0].device_kind, jax=jax.__version__, args=vars(args), rows=rows), f, indent=1)
    print(
        "\n| cache | devices | work | ms/step (sharded) | ms/step (unsharded) | sharded overhead | weak-scaling eff. | collectives |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        un = f"{r['unsharded_ms']:.3f}" if "unsharded_ms" in r else ""
        ov = f"{100 * r['overhead']:+.1f}%" if "overhead" in r else ""
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else ""
        print(
            f"| {r['cache']} | {r['devices']} | {r['work']} | {r['ms']:.3f} | {un} | {ov} | {eff} | {r['collectives']} |"
        )


if __name__ == "__main__":
    main()
