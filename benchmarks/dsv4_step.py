"""A whole DeepSeek-V4-Flash decode step on the hybrid cache: bookkeeping + attention, 43 layers.

One token per request. Per layer, in model order: the compressor update (``compress``:
tail append, flush where a block of ``ratio`` tokens completes), for a CSA layer the
indexer's top-k (``index_query`` + ``index_topk``), the window write (``write_window``),
attention over the cache (``hybrid.attention`` with ``kv=None``: the window ring, which now
holds the token, + the top-k / every visible HCA entry, with the sink; its whole output
written, as a model's output projection would read it), then ``after_reads`` (so the
writes that follow stay in place). A prefill chunk (``--prefill``) attends to its tokens
before writing them. ``prepare_forward`` opens the step. One jitted call per step, state
donated, no host sync.

Requests sit at scattered positions in the last quarter of ``--contexts``; every pool (the
windows, the compressed entries, the indexer keys) holds random rows in the storage
format (the step's cost does not depend on them; random, so no path is special-cased).
Contenders per (requests, context), in one process:

* ``step``: the whole step, attention ``impl="auto"`` (the ``cuda/`` kernel on a GPU with nvcc);
* ``pallas`` (opt-in): the same with the Mosaic GPU attention kernel;
* ``xla`` (opt-in): the same with the attention's dequantize + float32 path;
* ``flashmla`` (opt-in, ``$FLASHMLA_SRC``): the same with FlashMLA's sm90 kernel through jax.ffi;
* ``indexer``: the step without attention (bookkeeping + the indexer's top-k);
* ``indexer-xla`` (opt-in): the same with the indexer's scores on XLA instead of the kernel;
* ``bookkeeping``: the step without indexer and attention;
* ``step-kv`` (opt-in): ``step`` in the prefill order: the token passed to attention (encoded
  for it by a kernel of its own) and the window written after;
* ``step-shared`` (opt-in): ``step`` on a cache whose requests share their first tokens'
  blocks (``hybrid.share`` of slot 0's prefix, the CSA-block-aligned minimum position, then
  each request's own tokens): the same reads through block tables that name shared blocks.

Beside every row, the floor: the cache bytes the step must read (``step_bytes``: indexer
keys, CSA top-k entries, HCA entries, windows) at the copy bandwidth measured in the same run.

The differences split the step: indexer = ``indexer`` - ``bookkeeping``, attention =
``step`` - ``indexer``. Wall is per synchronized step (median); streamed, per step of as
many queued with one sync at the end (a serving loop that overlaps its host); host, until
a queued call returns; kernel is the sum of GPU
kernel time in a profiler trace of the same steps (``--top N`` also lists the whole step's
N costliest kernels). A (requests, context) pair whose cache does not fit is reported as
such. Each contender is a 43-layer compile (about a minute or more on a fresh machine):
pick fewer with ``--contenders`` to stay within one call's time.

    PYTHONPATH=$PWD python benchmarks/dsv4_step.py [--requests 64,256] [--contexts 8192,65536]
        [--contenders step,indexer,bookkeeping,xla] [--top 12]
    PYTHONPATH=$PWD python benchmarks/dsv4_step.py --prefill [--prefill-requests 8 --prompt 8192 --chunk 2048]
    PYTHONPATH=$PWD python benchmarks/dsv4_step.py --quick      # CPU smoke run: 4 layers, 4 requests
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import copy_gbps, gpu_timeline, host_parts, kernel_ms_per_step, times_ms, trace_events
from hybrid_step import make_inputs, make_params, stack_layers, unstack_layers
from jax import lax

from jaxkv import hybrid as H
from jaxkv.formats.storage import pack_items

HEADS = 64  # V4-Flash attention heads
CONTENDERS = {  # name on the command line: (row label, decode_step flags)
    "step": ("step (attention impl=auto)", dict(index=True, attend=True, impl="auto")),
    "pallas": ("step (attention impl=pallas)", dict(index=True, attend=True, impl="pallas")),
    "xla": ("step (attention impl=xla)", dict(index=True, attend=True, impl="xla")),
    "flashmla": ("step (attention impl=flashmla)", dict(index=True, attend=True, impl="flashmla")),
    "indexer": ("bookkeeping + indexer (no attention)", dict(index=True, attend=False, impl="auto")),
    "indexer-xla": ("bookkeeping + indexer impl=xla", dict(index=True, attend=False, impl="auto", index_impl="xla")),
    "bookkeeping": ("bookkeeping alone", dict(index=False, attend=False, impl="auto")),
    "step-shared": ("step, prefix blocks shared", dict(index=True, attend=True, impl="auto")),
    "step-kv": (
        "step, token passed, window written after",
        dict(index=True, attend=True, impl="auto", write_after=True),
    ),
}


def make_extra(cfg, B, key, T=1, *, distinct=True):
    """The layers' attention inputs of T tokens a request, stacked over layers as a model's
    activations would be: ``q`` bf16[n, B, T, 64, 512] and ``sink`` f32[n, 64] (n: every
    layer), for the CSA layers ``iq`` bf16[m, B, T, 64, 128] and ``iw`` f32[m, B, T, 64] (the
    indexer's query and weights; m: every CSA layer). ``distinct=False``: one row for the CSA
    layers and one for the rest (n = 2, m = 1; a layer's cost does not depend on its values,
    and a prefill chunk's 43 distinct q of B x T x 64 x 512 would not fit beside the cache).
    ``extra_rows`` hands each layer its rows."""
    rows = {"q": [], "sink": [], "iq": [], "iw": []}
    if distinct:
        layers = [(layer, cfg.kind(layer) == H.CSA) for layer in range(cfg.num_layers)]
    else:  # row 0 for the layers other than CSA, row 1 for CSA (``extra_rows``)
        layers = [(next((i for i in range(cfg.num_layers) if (cfg.kind(i) == H.CSA) == csa), 0), csa) for csa in (0, 1)]
    for layer, csa in layers:
        ks = jax.random.split(jax.random.fold_in(key, 1000 + layer), 4)
        rows["q"].append(jax.random.normal(ks[0], (B, T, HEADS, cfg.head_dim), jnp.bfloat16))
        rows["sink"].append(jax.random.normal(ks[1], (HEADS,), jnp.float32))
        if csa:
            rows["iq"].append(jax.random.normal(ks[2], (B, T, cfg.index_heads, cfg.index_dim), jnp.bfloat16))
            rows["iw"].append(jax.random.normal(ks[3], (B, T, cfg.index_heads), jnp.float32))
    return {k: jnp.stack(v) for k, v in rows.items() if v}


def extra_rows(cfg, extra):
    """``make_extra``'s arrays as each layer's ``hybrid.Stacked`` rows, read in place by the
    kernels (call it inside the jitted step: passed in, each row would be an argument). With
    as many rows as layers, layer i's; else (``distinct=False``) its kind's."""
    distinct = extra["q"].shape[0] == cfg.num_layers
    out, csa_seen = {}, 0
    for layer in range(cfg.num_layers):
        csa = cfg.kind(layer) == H.CSA
        i = layer if distinct else int(csa)
        e = {"q": H.Stacked(extra["q"], i), "sink": H.Stacked(extra["sink"], i)}
        if csa:
            e["iq"] = H.Stacked(extra["iq"], csa_seen if distinct else 0)
            e["iw"] = H.Stacked(extra["iw"], csa_seen if distinct else 0)
            csa_seen += 1
        out[layer] = e
    return out


FILL_BLOCKS = 4096  # pool blocks refilled per call: bounds the fill's temporaries (256 requests at 64K)


@functools.partial(jax.jit, static_argnames=("n", "dim", "block", "codec"), donate_argnums=0)
def _fill(pools, key, l, b0, *, n, dim, block, codec):
    """Blocks ``b0 .. b0 + n`` of layer ``l`` of a stacked pool u8[L, blocks, block * E]
    refilled with random rows (``l`` and ``b0`` traced: one compile per pool shape)."""
    x = jax.random.normal(key, (n * block, dim), jnp.bfloat16)
    return jax.lax.dynamic_update_slice(pools, pack_items(codec.encode(x), block, codec.segments)[None], (l, b0, 0))


def fill_random(state, key):
    """Every pool of ``state`` holding random rows in its storage format (in place, per layer)."""
    c = state.config
    fmt = c.storage_format
    keys = iter(jax.random.split(key, 4 * c.num_layers + 8))

    def refill(pools, dim, block, codec):
        blocks = pools.shape[1]
        for l in range(pools.shape[0]):
            key = next(keys)
            for b0 in range(0, blocks, FILL_BLOCKS):
                n = min(FILL_BLOCKS, blocks - b0)
                pools = _fill(pools, jax.random.fold_in(key, b0), l, b0, n=n, dim=dim, block=block, codec=codec)
        return pools

    window = refill(state.window, c.head_dim, c.window, fmt.entry)
    entries = tuple(refill(p, c.head_dim, c.block_size, fmt.entry) for p in state.entries)
    index_keys = refill(state.index_keys, c.index_dim, c.block_size, fmt.index_key(c.index_dim))
    return state.replace(window=window, entries=entries, index_keys=index_keys)


def decode_step(
    state,
    slots,
    stacked,
    extra,
    *,
    index: bool,
    attend: bool,
    impl: str,
    index_impl: str = "auto",
    chunk=1,
    write_after: bool = False,
):
    """prepare_forward, then per layer compress -> (indexer top-k) -> (attention) -> after_reads
    -> window write (a decode step writes the window before attention, which then reads the
    token from the ring: ``attention(kv=None)``; ``write_after``: the prefill order, the token
    passed to attention and written after it). ``stacked``: the compressor inputs and weights as ``stack_layers`` gives
    them (a few arrays, not one argument per layer and tensor); ``extra``: ``make_extra``'s.
    Row b is slot ``slots[b]`` = b (every slot, in order: on a mesh each
    device's rows are its own requests). ``chunk``: tokens a request (1: decode; more: a
    prefill chunk, the inputs' token axis). Returns (state, f32[B]: per row, the sum of the
    last layer's reads). Every layer's reads stay live without a sum of their own: after_reads
    takes each layer's whole output, and the writes after it depend on that. Per row, so a
    sharded step sums nothing across devices."""
    cfg = state.config
    inputs, params = unstack_layers(cfg, stacked)  # each layer's rows, read in place
    extra = extra_rows(cfg, extra)
    state, step = H.prepare_forward(state, slots, state.position, chunk=chunk)
    reads = None
    for layer in range(cfg.num_layers):
        x, e = inputs[layer], extra[layer]
        if cfg.compress_ratios[layer]:
            p = params[layer]
            index_kv = (x["ikv"], x["iscore"], p["index"]) if "index" in p else None
            state = H.compress(state, step, layer, x["ckv"], x["cscore"], p["main"], index_kv)
        idx = out = None
        if (index or attend) and cfg.kind(layer) == H.CSA:
            state, idx = H.index_topk(state, step, layer, H.index_query(state, e["iq"]), e["iw"], impl=index_impl)
            out = idx
        first = chunk == 1 and not write_after  # decode: the window written first, attention reads it from the ring
        if first:
            state = H.write_window(state, step, layer, x["kv"])
        if attend:  # a model's output projection reads every element: the barrier has the step write the
            # whole output (and any split merge), as after_reads' use of it does too
            kv = None if first else x["kv"]
            out = lax.optimization_barrier(H.attention(state, step, layer, e["q"], e["sink"], kv, idx, impl=impl))
        if out is not None:
            state = H.after_reads(state, out)
            reads = out
        if not first:
            state = H.write_window(state, step, layer, x["kv"])
    acc = jnp.zeros(slots.shape, jnp.float32)
    if reads is not None:
        acc = reads.astype(jnp.float32).reshape(reads.shape[0], -1).sum(1)
    return state, acc


def step_bytes(cfg, position) -> dict:
    """Bytes of cache one decode step must read with requests at ``position`` (i32[B], the
    tokens before the step's): per CSA layer the indexer keys of every visible entry and the
    top-k entries, per HCA layer every visible entry, per layer the window. The queries and
    outputs (about 0.13 MB a request and layer) are not counted."""
    fmt = cfg.storage_format
    entry, key = fmt.entry_bytes, fmt.index_key_bytes(cfg.index_dim)
    p = np.asarray(position, np.int64) + 1
    out = dict.fromkeys(("indexer keys", "CSA top-k", "HCA entries", "windows"), 0)
    for layer in range(cfg.num_layers):
        out["windows"] += int(np.minimum(p, cfg.window).sum()) * entry
        ratio = cfg.compress_ratios[layer]
        if cfg.kind(layer) == H.CSA:
            out["indexer keys"] += int((p // ratio).sum()) * key
            out["CSA top-k"] += int(np.minimum(p // ratio, cfg.top_k).sum()) * entry
        elif ratio:
            out["HCA entries"] += int((p // ratio).sum()) * entry
    return out


def run_case(B, context, args):
    cfg = dataclasses.replace(H.V4_FLASH, max_requests=B, max_context=context)
    if args.quick:
        cfg = dataclasses.replace(cfg, compress_ratios=cfg.compress_ratios[:4])
    key = jax.random.key(0)
    stacked = stack_layers(cfg, make_inputs(cfg, B, key), make_params(cfg, key))
    extra = make_extra(cfg, B, key)
    slots = jnp.arange(B, dtype=jnp.int32)
    rng = np.random.default_rng(0)
    # steps this run takes after the prefill positions (each contender: compile, 2 warm-up,
    # iters synchronized, iters streamed, 3 profiled, 3 traced)
    margin = 8 + len(args.contenders) * (2 * args.iters + 9)
    start = rng.integers(context * 3 // 4, context - margin, size=B).astype(np.int32)
    need = step_bytes(cfg, start)
    floor_ms = sum(need.values()) / args.gbps / 1e6
    print(
        f"  {B} requests, context {context}: a step reads {sum(need.values()) / 1e9:.2f} GB of cache ("
        + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in need.items())
        + f"): floor {floor_ms:.3f} ms at {args.gbps:.0f} GB/s",
        flush=True,
    )
    states = {}

    def state_for(shared: bool):  # one cache per layout, made when first asked for
        if shared not in states:
            st = states[shared] = make_state(cfg, start, jax.random.fold_in(key, 7), shared)
            used, _ = H.block_counts(st)
            print(f"  {B} requests, context {context}: {used} blocks in use ({'shared' if shared else 'no'} prefix)")
        return states[shared]

    gib = H.nbytes(state_for("step-shared" in args.contenders and len(args.contenders) == 1)) / 2**30
    contenders = [(c, *CONTENDERS[c]) for c in args.contenders]
    box = {}
    rows = []
    for cname, name, kw in contenders:
        box["s"] = state_for(cname == "step-shared")
        fn = jax.jit(functools.partial(decode_step, **kw), donate_argnums=0)

        def run(i, fn=fn):
            box["s"], acc = fn(box["s"], slots, stacked, extra)
            acc.block_until_ready()

        t0 = time.perf_counter()
        run(0)
        print(
            f"  {B} requests, context {context}: {name}: first call (compile + run) {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        with jax.transfer_guard("disallow"):
            ms = statistics.median(times_ms(run, args.iters, warmup=2))
            t0, hosts = time.perf_counter(), []
            for _ in range(args.iters):  # streamed: the steps queued, one sync at the end
                t = time.perf_counter()
                box["s"], acc = fn(box["s"], slots, stacked, extra)
                hosts.append((time.perf_counter() - t) * 1e3)  # host: until the queued call returns
            acc.block_until_ready()
            streamed = (time.perf_counter() - t0) * 1e3 / args.iters
            host = statistics.median(hosts)
        top = args.top if kw["attend"] else 0
        kern = kernel_ms_per_step(run, 3, top=top) if jax.default_backend() == "gpu" else None
        if args.trace is not None and jax.default_backend() == "gpu":
            events = trace_events(run, 3)
            print_trace(name, events)
            if args.trace:
                with gzip.open(f"{args.trace}/{cname}-{B}x{context}.events.json.gz", "wt") as f:
                    json.dump(events, f)
        rows.append((name, ms, streamed, host, kern, sum(need.values()) / 1e9, floor_ms))
        print(
            f"  {B} requests, context {context}: {name}: {ms:.3f} ms synchronized, {streamed:.3f} streamed, host {host:.3f}"
            + ("" if kern is None else f" ({kern:.3f} ms of kernels)"),
            flush=True,
        )
        states[cname == "step-shared"] = box["s"]
    import jaxkv

    for st in states.values():
        jaxkv.check(st)
    return gib, rows


def print_trace(name, events):
    """``--trace``: one synchronized step's host time by part and its GPU timeline."""
    parts, line = host_parts(events, "decode_step"), gpu_timeline(events, "decode_step")
    if parts:
        print(
            f"  {name}: host ms: call {parts['call']:.3f} = dispatch {parts['dispatch']:.3f} + arguments "
            f"{parts['arguments']:.3f} + graph updates {parts['graph_update']:.3f} + launches "
            f"{parts['graph_launch']:.3f} + other thunks {parts['other_thunks']:.3f}; graphs (commands, update, "
            f"launch): {[(n, round(u, 3), round(x, 3)) for n, u, x in parts['graphs']]}"
        )
    if line:
        print(
            f"  {name}: GPU ms: first kernel {line['lead']:.3f} after the call; span {line['span']:.3f} = busy "
            f"{line['busy']:.3f} + idle {line['idle']:.3f} ({line['gaps'][0]} gaps over 5 us: {line['gaps'][1]:.3f}); "
            f"{line['kernels']} kernels"
        )
        for us, before, after in line["longest"]:
            print(f"    gap {us:8.1f} us after {before} before {after}")


def prefill_flops(cfg, start: int, T: int, B: int) -> tuple[float, float]:
    """FLOPs of one prefill chunk (tokens start .. start + T of B requests): attention
    (4 * heads * 512 per query and key: window, the step's tokens, top-k or every visible HCA
    entry) and the indexer's scores (2 * index heads * index_dim per query and visible entry)."""
    t = np.arange(start, start + T, dtype=np.int64) + 1  # tokens a query sees, itself included
    attn = index = 0.0
    for layer in range(cfg.num_layers):
        ratio = cfg.compress_ratios[layer]
        keys = np.minimum(t, cfg.window)
        if cfg.kind(layer) == H.CSA:
            keys = keys + np.minimum(t // ratio, cfg.top_k)
            index += 2 * cfg.index_heads * cfg.index_dim * float((t // ratio).sum())
        elif ratio:
            keys = keys + t // ratio
        attn += 4 * HEADS * cfg.head_dim * float(keys.sum())
    return attn * B, index * B


def prefill(cfg, B: int, prompt: int, T: int, iters: int, impl: str = "auto", index_impl: str = "auto"):
    """B requests' prompts through the layers in chunks of T tokens, ``iters`` + 1 times (the
    first compiles and warms). Returns (ms of each timed chunk, the last chunk's result)."""
    key = jax.random.key(0)
    stacked = stack_layers(cfg, make_inputs(cfg, B, key, T), make_params(cfg, key))
    extra = make_extra(cfg, B, key, T, distinct=False)
    slots = jnp.arange(B, dtype=jnp.int32)
    kw = dict(index=True, attend=True, chunk=T, impl=impl, index_impl=index_impl)
    fn = jax.jit(functools.partial(decode_step, **kw), donate_argnums=0)
    times = []
    for it in range(iters + 1):
        state = H.init(cfg)
        for _ in range(prompt // T):
            t = time.perf_counter()
            state, got = fn(state, slots, stacked, extra)
            got.block_until_ready()
            if it:
                times.append((time.perf_counter() - t) * 1e3)
    import jaxkv

    jaxkv.check(state)
    return times, got


def run_prefill(args):
    """``--prefill``: B requests' prompts through the 43 layers in chunks, each chunk one
    jitted call (the same ops as the decode step, T tokens a request); ms a chunk (median over
    the prompt's chunks and ``--iters`` prompts) and the attention's and indexer's FLOPs over
    it. Then a small case (2 requests, 1K-token prompts in 256-token chunks) through the
    kernels and through ``impl="xla"`` (float32 math): the last chunk's reads, compared."""
    B, prompt, T = args.prefill_requests, args.prompt, args.chunk
    if prompt % T:
        raise SystemExit(f"--prompt: expected a multiple of --chunk = {T}, got {prompt}")
    cfg = dataclasses.replace(H.V4_FLASH, max_requests=B, max_context=prompt)
    if args.quick:
        cfg = dataclasses.replace(cfg, compress_ratios=cfg.compress_ratios[:4])
    t0 = time.perf_counter()
    times, _ = prefill(cfg, B, prompt, T, args.iters)
    print(f"  prefill: {B} x {prompt} in chunks of {T}: {time.perf_counter() - t0:.0f} s in all", flush=True)
    ms = statistics.median(times)
    flops = [prefill_flops(cfg, c * T, T, B) for c in range(prompt // T)]
    attn, index = (sum(f[i] for f in flops) / len(flops) for i in range(2))
    small_b, small_prompt, small_t = (2, 512, 128) if args.quick else (2, 1024, 256)
    small = dataclasses.replace(cfg, max_requests=small_b, max_context=small_prompt)
    _, got = prefill(small, small_b, small_prompt, small_t, 0)
    _, want = prefill(small, small_b, small_prompt, small_t, 0, impl="xla", index_impl="xla")
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    print(f"\nprefill: {B} requests x {prompt} prompt tokens in chunks of {T}, {cfg.num_layers} layers")
    print(
        f"| chunk ms | attention TFLOP / chunk | indexer TFLOP / chunk | (attention + indexer) TFLOP/s "
        f"| vs xla f32 ({small_b} x {small_prompt}, chunks of {small_t}) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {ms:.3f} | {attn / 1e12:.3f} | {index / 1e12:.3f} | {(attn + index) / ms / 1e9:.1f} | {err:.1e} |")


def make_state(cfg, start, key, shared: bool):
    """Every request prefilled to ``start`` (i32[B]), every pool random; ``shared``: the
    requests' first ``min(start)`` tokens (rounded down to a CSA block) are slot 0's, shared."""
    B = cfg.max_requests
    slots = jnp.arange(B, dtype=jnp.int32)
    state = H.init(cfg)
    p0 = 0
    if shared:
        p0 = int(start.min()) // (cfg.indexer_ratio * cfg.block_size) * (cfg.indexer_ratio * cfg.block_size)
        state, _ = H.prepare_forward(state, slots[:1], jnp.zeros(1, jnp.int32), jnp.full(1, p0, jnp.int32), chunk=p0)
        state = H.share(state, slots[1:], jnp.zeros(B - 1, jnp.int32), jnp.full(B - 1, p0, jnp.int32))
    n = jnp.asarray(start - p0)
    state, _ = H.prepare_forward(state, slots, jnp.full(B, p0, jnp.int32), n, chunk=int(n.max()))
    state = fill_random(state, key)
    return jax.block_until_ready(state)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--contexts", default="8192,65536")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--contenders",
        default="step,indexer,bookkeeping",
        help=f"comma-separated, in order, from {', '.join(CONTENDERS)}",
    )
    ap.add_argument("--top", type=int, default=0, help="list the whole step's N costliest kernels")
    ap.add_argument(
        "--trace",
        nargs="?",
        const="",
        metavar="DIR",
        help="per contender, one step's host time by part and GPU timeline, the trace's events saved in DIR "
        "if given (set XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true, or the profiler turns "
        "the step's graphs off)",
    )
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 4 layers, 4 requests, context 2048")
    ap.add_argument("--prefill", action="store_true", help="chunked prefill instead of decode (run_prefill)")
    ap.add_argument("--prefill-requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=8192, help="prefill: prompt tokens a request")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill: tokens a request per chunk")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.contenders = args.contenders.split(",")
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        ap.error(f"--contenders: expected names from {sorted(CONTENDERS)}, got {sorted(unknown)}")
    if args.quick:
        args.requests, args.contexts, args.iters = "4", "2048", min(args.iters, 3)
        args.prefill_requests, args.prompt, args.chunk = 2, 1024, 256
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if args.prefill:
        return run_prefill(args)
    args.gbps = copy_gbps(3 if args.quick else 20)
    print(f"  device copy: {args.gbps:.0f} GB/s (the floor's bandwidth)", flush=True)
    table = []
    for B in map(int, args.requests.split(",")):
        for context in map(int, args.contexts.split(",")):
            try:
                gib, rows = run_case(B, context, args)
            except Exception as e:  # noqa: BLE001 - a pair that does not fit is a row, not the end
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                print(f"  {B} requests, context {context}: does not fit ({str(e).splitlines()[0][:160]})")
                table.append((B, context, None, "does not fit", None, None, None, None, None, None))
                continue
            table += [(B, context, gib, *row) for row in rows]
    fields = (
        "requests",
        "context",
        "cache_gib",
        "contender",
        "ms",
        "streamed_ms",
        "host_ms",
        "kernel_ms",
        "read_gb",
        "floor_ms",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(zip(fields, r)) for r in table], f, indent=1)
    print(f"\ncopy bandwidth {args.gbps:.0f} GB/s; floor: the cache bytes a step reads at it")
    print(
        "| requests | context | cache GiB | contender | wall ms | streamed ms | host ms | kernel ms | GB read | floor ms "
        "| wall / floor |"
    )
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for B, context, gib, name, ms, streamed, host, kern, gb, floor in table:
        f = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
        ratio = "" if ms is None or not floor else f"{ms / floor:.1f}x"
        print(
            f"| {B} | {context} | {'' if gib is None else f'{gib:.2f}'} | {name} | {f(ms)} | {f(streamed)} | {f(host)} "
            f"| {f(kern)} | {f(gb)} "
            f"| {f(floor)} | {ratio} |"
        )


if __name__ == "__main__":
    main()
