"""Weak scaling over N GPUs: one process driving them all, and one process per GPU.

Three steps, each one jitted call with its state donated, the work per GPU fixed:

* ``hybrid``: the V4-Flash decode bookkeeping (``prepare_forward`` + every layer's SWA write
  and compressor append / flush, inputs stacked per kind of layer) for ``--requests``
  requests per GPU;
* ``decode``: the whole V4-Flash decode step of ``dsv4_step.py`` (bookkeeping, the indexer's
  top-k, attention over the cache) for ``--decode-requests`` requests at ``--context`` per GPU;
* ``frame``: a 24-layer frame step (``frame.append`` + ``frame.attention`` per layer), one
  video stream per GPU (``--patches 999``: 518x378), scale frames and window full.

Modes (``--modes``): ``process``: N processes, one per GPU, started by ``python -m jaxkv
launch`` and joined by ``jax.distributed``; each makes the cache on the global N-device
``data`` mesh and steps only its own GPU's part (``docs/sharding.md``). ``single``: one
process, the same mesh over its N GPUs; with N = 1 also a state made without a mesh,
interleaved (the sharded code's overhead).

Every GPU gets the same inputs (one GPU's, repeated along the batch), so every GPU's part
of the state must end bit-identical to the one-GPU run's: the ``same`` column compares
checksums of each GPU's shards after the same steps. The compiled HLO is checked for
collectives (there must be none). Weak-scaling efficiency is t(1) / t(N), t the slowest
process's median ms per step, each step synchronized; ``streamed``: steps queued back to
back, one synchronization per round (a serving loop that does not wait on each step). Per
process, also its step alone (the others waiting: its GPU without contention) and, unless
``--no-unsharded``, the same step on a state made without a mesh on its own GPU (what the
global layout costs). ``dispatch`` is the host time of one call (from the call to its
return, queue empty), ``kernels`` the GPU kernel time per step per GPU (a profiler trace).

    python benchmarks/scaling.py                                   # modes single,process over 1 and all GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python benchmarks/scaling.py --quick --cpu                 # CPU-sized smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
WORKER = "--worker" in sys.argv
if WORKER:  # a process of the per-GPU mode: join the others before jax touches a device
    import jaxkv.launch

    jaxkv.launch.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import kernel_ms_per_step, times_ms  # noqa: E402
from dsv4_step import decode_step as dsv4_decode_step  # noqa: E402
from dsv4_step import fill_random, make_extra  # noqa: E402
from hybrid_step import bookkeeping_stacked, make_inputs, make_params, stack_layers  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxkv import frame  # noqa: E402
from jaxkv import hybrid as H  # noqa: E402
from jaxkv.checkpoint import _barrier, _checksum  # noqa: E402

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


def collectives(compiled) -> str:
    found = sorted({m.group(1) for m in COLLECTIVES.finditer(compiled.as_text())})
    return ",".join(found) or "none"


def put(tree, mesh, spec):
    """``tree`` (one GPU's worth) repeated ``n`` times along the axis ``spec`` splits and
    placed on ``mesh`` (None: as it is)."""
    if mesh is None:
        return tree
    n = mesh.shape["data"]
    axis = list(spec).index("data")

    return jax.tree.map(lambda x: _global(np.concatenate([np.asarray(x)] * n, axis=axis), mesh, spec), tree)


def _global(whole, mesh, spec):
    """The host array ``whole`` as a global array on ``mesh``: each process's devices take
    their parts of it (every process holds all of it)."""
    return jax.make_array_from_callback(whole.shape, NamedSharding(mesh, spec), lambda index: whole[index])


def digests(state) -> dict:
    """{position of the device on the mesh: a checksum of its part of every array of ``state``}
    for this process's devices."""
    lay = state.layout
    order = {d: i for i, d in enumerate(lay.mesh.devices.flat)} if lay is not None else None
    sums = {}
    for x in jax.tree.leaves(state):
        for s in x.addressable_shards:
            pos = order[s.device] if order else 0
            sums.setdefault(pos, []).append(_checksum(s.data) if s.data.size else jnp.zeros(2, jnp.uint32))
    return {str(p): hashlib.sha1(np.asarray(jax.device_get(v)).tobytes()).hexdigest()[:16] for p, v in sums.items()}


# ----------------------------------------------------------------------------- hybrid
def hybrid_state(base, B, mesh, fill: bool):
    """A cache of ``base`` with ``B`` requests per GPU at scattered positions (the same on
    every GPU), its pools random (``fill``) or holding only the prefill's windows."""
    n = 1 if mesh is None else mesh.shape["data"]
    cfg = dataclasses.replace(base, max_requests=B * n)
    rows = P("data")
    start = np.random.default_rng(0).integers(cfg.max_context // 2, cfg.max_context * 3 // 4, size=B).astype(np.int32)
    slots = jnp.arange(B, dtype=jnp.int32) if mesh is None else _slots(B, mesh)
    if fill:  # one GPU's state (dsv4_step's random pools), made on each of this process's GPUs
        like = H.init(cfg, mesh=mesh)
        devices = [None] if mesh is None else [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        parts = [one_gpu_state(dataclasses.replace(base, max_requests=B), start, d) for d in devices]
        return (parts[0] if mesh is None else assemble(like, dict(zip(devices, parts)))), slots
    state = H.init(cfg, mesh=mesh)
    state, step = H.prepare_forward(
        state, slots, put(np.zeros(B, np.int32), mesh, rows), put(start, mesh, rows), chunk=int(start.max())
    )
    ones = put(np.ones((B, int(start.max()), cfg.head_dim), jnp.bfloat16), mesh, rows)
    for layer in range(cfg.num_layers):  # SWA rings only: the bookkeeping does not read the pools
        state = H.write_window(state, step, layer, ones)
    return state, slots


def one_gpu_state(cfg, start, device):
    """``cfg``'s cache on ``device`` (None: the default one), every request prefilled to
    ``start`` and every pool random, as ``dsv4_step.py`` makes it."""
    with jax.default_device(device) if device is not None else contextlib.nullcontext():
        B = cfg.max_requests
        state, _ = H.prepare_forward(
            H.init(cfg),
            jnp.arange(B, dtype=jnp.int32),
            jnp.zeros(B, jnp.int32),
            jnp.asarray(start),
            chunk=int(start.max()),
        )
        return fill_random(state, jax.random.key(7))


def assemble(like, parts: dict):
    """The global state laid out as ``like`` whose part on each of this process's devices is
    ``parts[device]`` (a one-device state of the same local config)."""
    flat_like, tree = jax.tree_util.tree_flatten(like)
    flat_parts = {d: jax.tree.leaves(p) for d, p in parts.items()}
    out = []
    for i, x in enumerate(flat_like):
        shard = x.sharding.shard_shape(x.shape)
        arrays = [
            jax.device_put(flat_parts[d][i], d).reshape(shard)
            for d in x.sharding.addressable_devices_indices_map(x.shape)
        ]
        out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
    return jax.tree_util.tree_unflatten(tree, out)


def _slots(B, mesh):
    """Slots 0 .. B*n - 1 in order, each device's rows its own slots."""
    return _global(np.arange(B * mesh.shape["data"], dtype=np.int32), mesh, P("data"))


def stacked_inputs(base, B, mesh):
    """One GPU's compressor inputs and weights (``stack_layers``), each GPU's rows its own and
    the weights replicated."""
    cfg1 = dataclasses.replace(base, max_requests=B)
    key = jax.random.key(0)
    kv, by_kind = stack_layers(cfg1, make_inputs(cfg1, B, key), make_params(cfg1, key))
    kv = put(kv, mesh, P(None, "data"))
    return kv, {k: (put(x, mesh, P(None, "data")), rep(p, mesh)) for k, (x, p) in by_kind.items() if x is not None}


def hybrid_case(base, B, mesh):
    state, slots = hybrid_state(base, B, mesh, fill=False)
    fn = jax.jit(functools.partial(bookkeeping_stacked, impl="auto"), donate_argnums=0)
    args = (slots, stacked_inputs(base, B, mesh))
    return state, fn.lower(state, *args).compile(), args


def rep(tree, mesh):
    """``tree`` replicated on every device of ``mesh`` (as it is without one)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: _global(np.asarray(x), mesh, P()), tree)


def decode_case(base, B, mesh):
    state, slots = hybrid_state(base, B, mesh, fill=True)
    cfg1 = dataclasses.replace(base, max_requests=B)
    key = jax.random.key(0)
    extra = {
        k: rep(v, mesh) if k == "sink" else put(v, mesh, P(None, "data")) for k, v in make_extra(cfg1, B, key).items()
    }
    fn = jax.jit(functools.partial(dsv4_decode_step, index=True, attend=True, impl="auto"), donate_argnums=0)
    args = (slots, stacked_inputs(base, B, mesh), extra)
    return state, fn.lower(state, *args).compile(), args


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


def frame_case(args, mesh):
    n = 1 if mesh is None else mesh.shape["data"]
    spec = frame_spec(args, n)
    state = frame.init(spec, mesh=mesh)
    shape = (spec.num_layers, 1, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    ks = jax.random.split(jax.random.key(1), 3)
    k, v, q = (put(jax.random.normal(x, shape, jnp.bfloat16), mesh, P(None, "data")) for x in ks)
    fn = jax.jit(frame_step, donate_argnums=0)
    return state, fn.lower(state, k, v, q).compile(), (k, v, q)


# ----------------------------------------------------------------------------- timing
class Runner:
    """Holds a donated state and steps it; ``one`` is a timed call that synchronizes."""

    def __init__(self, case):
        self.state, self.fn, self.args = case
        self.hlo = collectives(self.fn)

    def call(self):
        out = self.fn(self.state, *self.args)
        self.state = out[0] if isinstance(out, tuple) else out
        return out

    def one(self, i=0):
        jax.block_until_ready(self.call())

    def streamed(self, steps):
        """ms per step of ``steps`` calls with one synchronization at the end (the queue kept full)."""
        jax.block_until_ready(self.call())
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.call()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) * 1e3 / steps

    def dispatch(self, i=0):
        """Host ms of one call: from the call to its return, the queue empty before it."""
        t0 = time.perf_counter()
        out = self.call()
        ms = (time.perf_counter() - t0) * 1e3
        jax.block_until_ready(out)
        return ms


def interleaved(runners, warm, iters, rounds=5):
    """Median ms per step of each runner, measured in alternating rounds (drift hits all
    alike), then each one's median dispatch ms and kernel ms per step (per GPU). Before the
    rounds, each runner steps ``iters // 2`` times alone: in a multi-process run the
    processes take turns (the others wait at a barrier), which times each GPU's step with
    no other process stepping; every mode takes the same steps, so the states stay
    comparable bit for bit."""
    for r in runners:
        times_ms(r.one, 0, warmup=warm)
    alone = []
    for r in runners:
        ms = None
        for turn in range(jax.process_count()):
            _barrier(f"alone {turn}")
            if turn == jax.process_index():
                ms = statistics.median(times_ms(r.one, max(1, iters // 2)))
        _barrier("together")
        alone.append(ms)
    samples = [[] for _ in runners]
    streamed = [[] for _ in runners]
    for _ in range(rounds):
        for s, st, r in zip(samples, streamed, runners):
            s += times_ms(r.one, max(1, iters // rounds))
            st.append(r.streamed(max(1, iters // rounds)))
    out = []
    for s, st, r, a in zip(samples, streamed, runners, alone):
        dispatch = statistics.median(r.dispatch() for _ in range(10))
        kern = kernel_ms_per_step(r.one, 3) if jax.default_backend() == "gpu" else None
        out.append(
            dict(
                ms=statistics.median(s),
                streamed_ms=statistics.median(st),
                alone_ms=a,
                dispatch_ms=dispatch,
                kernel_ms=kern,
            )
        )
    return out


CASES = ("hybrid", "decode", "frame")


def run_cases(args, n, mesh, with_unsharded: bool):
    """Rows of this process for every case on ``mesh`` (n GPUs)."""
    build = {
        "hybrid": lambda m: hybrid_case(args.hybrid_cfg, args.requests, m),
        "decode": lambda m: decode_case(args.decode_cfg, args.decode_requests, m),
        "frame": lambda m: frame_case(args, m),
    }
    rows = []
    for name in args.cases:
        variants = [("sharded", mesh)] + ([("unsharded", None)] if with_unsharded else [])
        runners = []
        for _, m in variants:
            t0 = time.perf_counter()
            with jax.default_device(jax.local_devices()[0]):  # without a mesh: this process's GPU
                runners.append(Runner(build[name](m)))
            print(f"{name} on {n} GPU(s): built and compiled in {time.perf_counter() - t0:.0f} s", flush=True)
        _barrier(f"scaling {name}")  # start together: the processes step side by side
        warm = args.warm_frames if name == "frame" else 3
        res = interleaved(runners, warm, args.iters)
        _barrier(f"scaling {name} done")
        row = dict(case=name, devices=n, collectives=runners[0].hlo, digests=digests(runners[0].state), **res[0])
        if with_unsharded:
            row.update(
                unsharded_ms=res[1]["ms"],
                unsharded_dispatch_ms=res[1]["dispatch_ms"],
                unsharded_digests=digests(runners[1].state),
            )
        rows.append(row)
        print(
            f"{name} on {n} GPU(s): {res[0]['ms']:.3f} ms/step, streamed {res[0]['streamed_ms']:.3f}, dispatch {res[0]['dispatch_ms']:.3f} ms"
            + (f"; without a mesh {res[1]['ms']:.3f}, dispatch {res[1]['dispatch_ms']:.3f}" if with_unsharded else "")
            + f", collectives {row['collectives']}",
            flush=True,
        )
        del runners
    return rows


def worker(args):
    """One process of the per-GPU mode: the global mesh over every process's GPUs."""
    n = jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = run_cases(args, n, mesh, with_unsharded=not args.no_unsharded)
    with open(f"{args.json}.p{jax.process_index()}", "w") as f:
        json.dump(rows, f)


def per_process(args, n) -> list[dict]:
    """Run this script as ``n`` processes (``jaxkv launch``); their rows merged per case."""
    out = tempfile.mktemp(prefix="scaling.", suffix=".json")
    cmd = [sys.executable, "-m", "jaxkv", "launch", "--processes", str(n)]
    if args.cpu:
        cmd += ["--cpu-devices", "1"]
    argv = [a for a in sys.argv[1:] if a not in ("--worker",)]
    subprocess.run(cmd + [os.path.abspath(__file__), *argv, "--worker", "--worker-json", out], check=True)
    parts = []
    for i in range(n):
        with open(f"{out}.p{i}") as f:
            parts.append(json.load(f))
        os.unlink(f"{out}.p{i}")
    rows = []
    for case_rows in zip(*parts):
        row = dict(case_rows[0])
        row["ms"] = max(r["ms"] for r in case_rows)  # the slowest process sets the step
        row["per_process_ms"] = [r["ms"] for r in case_rows]
        row["streamed_ms"] = max(r["streamed_ms"] for r in case_rows)
        row["per_process_streamed_ms"] = [r["streamed_ms"] for r in case_rows]
        row["alone_ms"] = [r["alone_ms"] for r in case_rows]
        if "unsharded_ms" in row:
            row["local_ms"] = [r.pop("unsharded_ms") for r in case_rows]
            row.pop("unsharded_ms", None)
        row["dispatch_ms"] = max(r["dispatch_ms"] for r in case_rows)
        ks = [r["kernel_ms"] for r in case_rows if r["kernel_ms"] is not None]
        row["kernel_ms"] = max(ks) if ks else None
        row["digests"] = {k: v for r in case_rows for k, v in r["digests"].items()}
        row["collectives"] = ",".join(sorted({r["collectives"] for r in case_rows}))
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=None, help="comma-separated GPU counts (default: 1 and all)")
    ap.add_argument("--modes", default="single,process", help="single (one process) and/or process (one per GPU)")
    ap.add_argument("--cases", default=",".join(CASES), help="hybrid, decode and/or frame")
    ap.add_argument("--requests", type=int, default=256, help="hybrid bookkeeping: requests per GPU")
    ap.add_argument("--decode-requests", type=int, default=64, help="whole decode step: requests per GPU")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24, help="frame cache layers")
    ap.add_argument("--patches", type=int, default=999, help="patches per frame (224x224: 256; 518x378: 999)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--scale-frames", type=int, default=8)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--warm-frames", type=int, default=80, help="frames before timing (fills scale + window)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument(
        "--quick", action="store_true", help="CPU-sized: 4 layers of V4-Flash, 4 requests, a small frame cache"
    )
    ap.add_argument("--cpu", action="store_true", help="per-process mode on the CPU, one host device each (smoke run)")
    ap.add_argument("--no-unsharded", action="store_true", help="skip the 1-GPU state made without a mesh")
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    args.hybrid_cfg = dataclasses.replace(H.V4_FLASH, max_context=args.context)
    args.decode_cfg = args.hybrid_cfg
    if args.quick:
        args.requests = args.decode_requests = 4
        args.context, args.layers, args.patches, args.heads, args.head_dim = 512, 2, 16, 4, 16
        args.scale_frames, args.window, args.warm_frames, args.iters = 2, 4, 8, 10
        args.hybrid_cfg = args.decode_cfg = dataclasses.replace(
            H.V4_FLASH, compress_ratios=H.V4_FLASH.compress_ratios[:4], max_context=512
        )
    if args.worker:
        args.json = args.worker_json
        return worker(args)
    devices = jax.devices()
    counts = [int(n) for n in args.devices.split(",")] if args.devices else sorted({1, len(devices)})
    modes = args.modes.split(",")
    print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for n in counts:
        if "single" in modes or n == 1:  # the one-GPU baseline is the single mode's n = 1
            mesh = Mesh(np.array(devices[:n]), ("data",))
            rows += [
                dict(r, mode="1 process")
                for r in run_cases(args, n, mesh, with_unsharded=n == 1 and not args.no_unsharded)
            ]
        if "process" in modes and n > 1:
            rows += [dict(r, mode="1 process per GPU") for r in per_process(args, n)]
    report(rows, devices, args)


def report(rows, devices, args):
    base = {r["case"]: r for r in rows if r["devices"] == 1}
    for r in rows:
        b = base.get(r["case"])
        if b:
            r["efficiency"] = b["ms"] / r["ms"]
            one = b["digests"]["0"]
            r["same"] = all(v == one for v in r["digests"].values()) and (
                "unsharded_digests" not in r or all(v == one for v in r["unsharded_digests"].values())
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=devices[0].device_kind, jax=jax.__version__, args=_plain(vars(args)), rows=rows),
                f,
                indent=1,
            )
    work = {
        "hybrid": lambda n: f"{args.requests * n} requests, bookkeeping",
        "decode": lambda n: f"{args.decode_requests * n} requests x {args.context}, whole decode step",
        "frame": lambda n: f"{n} stream(s), {args.layers} layers, {args.patches} patches",
    }
    print(
        "\n| step | work | GPUs | mode | ms/step | streamed | per process (alone) | dispatch ms | kernel ms/GPU | eff. | same as 1 GPU | collectives |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        alone = r["alone_ms"] if "per_process_ms" in r else []
        per = " / ".join(f"{x:.3f} ({a:.3f})" for x, a in zip(r.get("per_process_ms", []), alone))
        if "unsharded_ms" in r:
            per = f"unsharded {r['unsharded_ms']:.3f}"
        if "local_ms" in r:
            per += "; without a mesh " + " / ".join(f"{x:.3f}" for x in r["local_ms"])
        kern = f"{r['kernel_ms'] / (r['devices'] if r['mode'] == '1 process' else 1):.3f}" if r.get("kernel_ms") else ""
        print(
            f"| {r['case']} | {work[r['case']](r['devices'])} | {r['devices']} | {r['mode']} | {r['ms']:.3f} | {r['streamed_ms']:.3f} | {per} | "
            f"{r['dispatch_ms']:.3f} | {kern} | {r.get('efficiency', 0):.2f} | {'yes' if r.get('same') else 'NO'} | "
            f"{r['collectives']} |"
        )


def _plain(d):
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, list, bool, type(None)))}


if __name__ == "__main__":
    main()
