"""One decode step of hybrid-cache bookkeeping: 256 requests x the V4-Flash schedule.

The step is ``prepare_forward`` (checks + block allocation for every ratio) then, for
each of the 43 layers, the SWA ring write, and for the 41 compressed layers the tail
append + masked flush (entry and, for CSA, indexer key). One jitted function, state
donated, requests at scattered positions so that some flush every step. Contenders:

* jaxkv step: the whole bookkeeping, jitted, no host sync (run under
  ``jax.transfer_guard("disallow")``), with the flushes written by XLA (``impl="xla"``)
  and, on a GPU, by the fused ``cuda/`` decode kernel (``impl="cuda"``: one launch per
  compressed layer, the SWA writes by the cuda/ flush-write), also with the inputs passed
  as a few arrays stacked per kind of layer, each layer's rows a ``hybrid.Stacked`` read in
  place, instead of ~300 separate arguments; with ``--triton DIR`` (the pre-port
  ``compress_decode.py`` and its helpers, as ``benchmarks/kernels.py --triton`` takes) the
  same two rows with the fused Pallas Triton-lowered kernel it replaced in its place;
* the dispatch floor: a jitted call with the step's arguments that does nothing;
* jaxkv prepare_forward alone;
* seed-style allocation: the dsv4 seed's ``prepare_forward`` logic — a Python loop over
  requests and layers reading each count from the device (``int(x)``) — on the same state.

Kernel time is the sum of GPU kernel durations in a profiler trace of the same steps;
"not kernel" is the wall time it leaves (launch gaps, host work).

    python benchmarks/hybrid_step.py [--requests 256] [--context 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _timing import kernel_ms_per_step, times_ms

from jaxkv import hybrid as H
from jaxkv.hybrid import ops

FUSED = ops.compress_decode  # the fused decode kernel hybrid.compress(impl="cuda") calls


def triton_compress_decode(directory):
    """The pre-port fused kernel (Pallas Triton lowering) from ``directory``, native."""
    import importlib.util
    import sys

    sys.path.insert(0, directory)  # it imports its helpers (codes, division, triton_tuning) from beside it
    spec = importlib.util.spec_from_file_location("triton_compress_decode", f"{directory}/compress_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return functools.partial(mod.compress_decode, interpret=False)


def make_params(cfg, key):
    out = {}
    for layer in cfg.compressed_layers:
        r = cfg.compress_ratios[layer]
        coff = 2 if cfg.kind(layer) == H.CSA else 1
        k1, k2, key = jax.random.split(key, 3)
        p = {
            "main": H.CompressorParams(
                jax.random.normal(k1, (r, coff * cfg.head_dim)), 1 + 0.1 * jax.random.normal(k2, (cfg.head_dim,))
            )
        }
        if coff == 2:
            p["index"] = H.CompressorParams(
                jax.random.normal(k1, (r, 2 * cfg.index_dim)), 1 + 0.1 * jax.random.normal(k2, (cfg.index_dim,))
            )
        out[layer] = p
    return out


def make_inputs(cfg, B, key, T=1):
    """Per-layer inputs of T tokens a request (1: decode), random."""
    out = {}
    for layer in range(cfg.num_layers):
        ks = jax.random.split(jax.random.fold_in(key, layer), 5)
        x = {"kv": jax.random.normal(ks[0], (B, T, cfg.head_dim), jnp.bfloat16)}
        if cfg.compress_ratios[layer]:
            coff = 2 if cfg.kind(layer) == H.CSA else 1
            x["ckv"] = jax.random.normal(ks[1], (B, T, coff * cfg.head_dim))
            x["cscore"] = jax.random.normal(ks[2], (B, T, coff * cfg.head_dim))
            if coff == 2:
                x["ikv"] = jax.random.normal(ks[3], (B, T, 2 * cfg.index_dim))
                x["iscore"] = jax.random.normal(ks[4], (B, T, 2 * cfg.index_dim))
        out[layer] = x
    return out


def bookkeeping(state, slots, inputs, params, impl="xla"):
    """prepare_forward + every layer's SWA write and compressor append/flush. Row b is slot
    ``slots[b]`` = b (every slot, in order: on a mesh each device's rows are its own
    requests, and the positions need no gather across devices)."""
    cfg = state.config
    state, step = H.prepare_forward(state, slots, state.position, chunk=1)
    for layer in range(cfg.num_layers):
        x = inputs[layer]
        state = H.write_window(state, step, layer, x["kv"], impl=impl)
        if cfg.compress_ratios[layer]:
            p = params[layer]
            index = (x["ikv"], x["iscore"], p["index"]) if "index" in p else None
            state = H.compress(state, step, layer, x["ckv"], x["cscore"], p["main"], index, impl=impl)
    return state


def stack_layers(cfg, inputs, params):
    """The per-layer inputs and parameters as a few stacked arrays (one per kind of
    layer and tensor): what a model hands the bookkeeping when they come from its own
    stacked activations and weights, not from ~300 separate arguments."""

    def stack(tree, layers):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[l] for l in layers]) if layers else None

    kinds = {k: [l for l in cfg.compressed_layers if cfg.kind(l) == k] for k in (H.CSA, H.HCA)}
    return (
        jnp.stack([inputs[l]["kv"] for l in range(cfg.num_layers)]),
        {k: (stack(inputs, ls), stack(params, ls)) for k, ls in kinds.items()},
    )


def unstack_layers(cfg, stacked):
    """``stack_layers``' arrays back as per-layer ``(inputs, params)`` whose arrays are
    ``hybrid.Stacked`` rows (read in place by the kernels: no per-layer slice copies). Call it
    inside the jitted step: passed in, each row would be an argument of its own again."""
    kv, by_kind = stacked
    inputs, params = {}, {}
    seen = {H.CSA: 0, H.HCA: 0}
    for layer in range(cfg.num_layers):
        inputs[layer] = {"kv": H.Stacked(kv, layer)}
        if cfg.compress_ratios[layer]:
            kind = cfg.kind(layer)
            x, params[layer] = jax.tree.map(lambda a, i=seen[kind]: H.Stacked(a, i), by_kind[kind])
            inputs[layer].update(x)
            seen[kind] += 1
    return inputs, params


def bookkeeping_stacked(state, slots, stacked, impl="cuda"):
    """``bookkeeping`` on ``stack_layers``' arrays (``unstack_layers``)."""
    return bookkeeping(state, slots, *unstack_layers(state.config, stacked), impl)


def dispatch_floor(state, slots, *args):
    """The same call with the same arguments doing (almost) nothing: the per-call cost."""
    return state.replace(position=state.position + 0 * slots.sum())


def prepare_only(state, slots):
    state, _ = H.prepare_forward(state, slots, state.position[slots], chunk=1)
    return state


def seed_style_prepare(state, slots, positions_before):
    """The dsv4 seed's prepare_forward: per layer, per request, int() of device values."""
    cfg = state.config
    lens = {r: al.owned for r, al in zip(cfg.ratios, state.alloc)}
    free = {r: int(al.num_free) for r, al in zip(cfg.ratios, state.alloc)}
    after = positions_before + 1
    for layer in cfg.compressed_layers:
        m = cfg.compress_ratios[layer]
        new_entries = after // m - positions_before // m
        for b in range(slots.shape[0]):
            n_new = int(new_entries[b])  # device -> host, as the seed does
            if n_new == 0:
                continue
            existing = int(lens[m][int(slots[b])])
            if existing * cfg.block_size < int(after[b]) // m:
                free[m] -= 1
    return free


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--storage", default="official", choices=sorted(H.STORAGES), help="storage family")
    ap.add_argument("--top", type=int, default=0, help="print the N kernels that take the most time")
    ap.add_argument("--hlo", action="store_true", help="print the step's whole-buffer copies and slices")
    ap.add_argument("--json")
    ap.add_argument(
        "--triton",
        default=None,
        help="a directory holding the pre-port fused kernel (compress_decode.py "
        "of 2e0b118 with its helpers; see benchmarks/kernels.py --triton): run it beside the cuda/ one",
    )
    args = ap.parse_args()

    B = args.requests
    cfg = dataclasses.replace(H.V4_FLASH, max_requests=B, max_context=args.context, storage=args.storage)
    key = jax.random.key(0)
    params = make_params(cfg, key)
    inputs = make_inputs(cfg, B, key)
    slots = jnp.arange(B, dtype=jnp.int32)

    # bring requests to scattered positions (one prefill step each, jitted once)
    state = H.init(cfg)
    start = np.random.default_rng(0).integers(args.context // 8, args.context // 2, size=B).astype(np.int32)
    T = int(start.max())
    state, step = H.prepare_forward(state, slots, jnp.zeros(B, jnp.int32), jnp.asarray(start), chunk=T)
    for layer in range(cfg.num_layers):  # SWA rings only: prefill content does not matter here
        state = H.write_window(state, step, layer, jnp.ones((B, T, cfg.head_dim), jnp.bfloat16))
    print(
        f"cache: {H.nbytes(state) / 2**30:.2f} GiB, {cfg.num_layers} layers, {B} requests, device {jax.devices()[0].device_kind}"
    )

    step_fn = jax.jit(bookkeeping, donate_argnums=0)
    prep_fn = jax.jit(prepare_only, donate_argnums=0)
    box = {"s": state}

    def run_step(i):
        box["s"] = step_fn(box["s"], slots, inputs, params)
        box["s"].position.block_until_ready()

    def run_prep(i):
        box["s"] = prep_fn(box["s"], slots)
        box["s"].position.block_until_ready()

    if args.hlo:  # where the compiled step copies or slices whole buffers
        import re

        text = step_fn.lower(box["s"], slots, inputs, params).compile().as_text()
        entry = text[text.rindex("ENTRY") :]
        names = set()
        if args.top:
            names = {
                "%" + n
                for n in ("loop_slice_fusion.1", "loop_slice_fusion", "loop_convert_fusion", "loop_divide_fusion")
            }
        for line in entry.splitlines():
            if line.strip().split(" = ")[0].replace("ROOT ", "") in names:
                print("HLO top:", line.strip()[:400])
        size = {"u8": 1, "s8": 1, "pred": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}
        for line in entry.splitlines():
            m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]", line)
            if not m or m.group(1) not in size:
                continue
            n = size[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))
            if n >= (1 << 24) and re.search(
                r" (copy|copy-start|dynamic-slice|slice)\(|%[\w.-]*(copy|slice)[\w.-]* = ", line
            ):
                print(f"HLO {n / 2**20:8.1f} MiB:", line.strip()[:260])
    rows = []
    for _ in range(3):
        run_step(0)
    with jax.transfer_guard("disallow"):
        step_ms = statistics.median(times_ms(run_step, args.iters, warmup=5))
    kern = kernel_ms_per_step(run_step, 10, top=args.top)
    rows.append(("jaxkv step, XLA (prepare + 43 SWA writes + 41 append/flush)", step_ms, kern))
    fused = [("cuda/", None)]
    if args.triton and jax.default_backend() == "gpu":
        fused.append(("Triton (pre-port)", triton_compress_decode(args.triton)))
    stacked = stack_layers(cfg, inputs, params) if jax.default_backend() == "gpu" else None
    for what, kernel in fused if jax.default_backend() == "gpu" else ():
        ops.compress_decode = kernel or FUSED
        jax.clear_caches()  # hybrid.compress is jitted: trace it again with this kernel in place
        for how, fn, fn_args in (
            ("", jax.jit(functools.partial(bookkeeping, impl="cuda"), donate_argnums=0), (inputs, params)),
            (
                f", inputs as {len(jax.tree.leaves(stacked))} stacked arrays",
                jax.jit(bookkeeping_stacked, donate_argnums=0),
                (stacked,),
            ),
        ):

            def run_impl(i, fn=fn, fn_args=fn_args):
                box["s"] = fn(box["s"], slots, *fn_args)
                box["s"].position.block_until_ready()

            for _ in range(3):
                run_impl(0)
            with jax.transfer_guard("disallow"):
                ms = statistics.median(times_ms(run_impl, args.iters, warmup=5))
            rows.append(
                (f"jaxkv step, fused {what} decode kernels{how}", ms, kernel_ms_per_step(run_impl, 10, top=args.top))
            )
    ops.compress_decode = FUSED
    floor_fn = jax.jit(dispatch_floor, donate_argnums=0, keep_unused=True)
    floors = [("", (inputs, params))]
    if jax.default_backend() == "gpu":
        floors.append((", stacked", (stacked,)))
    for what, floor_args in floors:

        def run_floor(i, floor_args=floor_args):
            box["s"] = floor_fn(box["s"], slots, *floor_args)
            box["s"].position.block_until_ready()

        for _ in range(3):
            run_floor(0)
        n_args = len(jax.tree.leaves((box["s"], slots, floor_args)))
        rows.append(
            (
                f"dispatch floor: a no-op jit call with the step's {n_args} arguments{what}",
                statistics.median(times_ms(run_floor, args.iters, warmup=5)),
                kernel_ms_per_step(run_floor, 10),
            )
        )
    prep_ms = statistics.median(times_ms(run_prep, args.iters, warmup=5))
    rows.append(("jaxkv prepare_forward alone", prep_ms, kernel_ms_per_step(run_prep, 10)))
    pos = box["s"].position[slots]
    seed_ms = statistics.median(times_ms(lambda i: seed_style_prepare(box["s"], slots, pos), 5, warmup=1))
    rows.append(("seed-style prepare_forward (host loop, int() per request)", seed_ms, None))
    import jaxkv

    jaxkv.check(box["s"])

    print(f"\n{'contender':58s} {'wall ms':>9s} {'kernel ms':>10s} {'not kernel':>11s}")
    for name, ms, k in rows:
        ks = f"{k:10.3f}" if k is not None else f"{'n/a':>10s}"
        share = f"{100 * (1 - k / ms):10.0f}%" if k is not None else f"{'n/a':>11s}"
        print(f"{name:58s} {ms:9.3f} {ks} {share}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": jax.devices()[0].device_kind,
                    "requests": B,
                    "context": args.context,
                    "rows": [dict(name=n, wall_ms=m, kernel_ms=k) for n, m, k in rows],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
