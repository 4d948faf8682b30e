"""DeepSeek-V4-Flash's lightning indexer on the hybrid cache: one CSA layer's scores and top-k.

One query token per request, requests at scattered positions in the last quarter of the
context, the indexer-key pool holding random MXFP4 keys. Contenders, in one process:

* ``xla, f32 (before)``: every key dequantized to BF16, then float32 copies and a float32
  HIGHEST matmul, then ``lax.top_k`` (the formulation ``hybrid.index_topk`` had before the
  kernel; kept here as the baseline);
* ``xla``: ``index_topk(impl="xla", select="xla")``: BF16 keys and queries, float32 sums,
  XLA's top-k (a sort);
* ``pallas + sort``: ``kernels.index_scores`` (FP4 keys read in place) + XLA's top-k;
* ``pallas + select``: ``kernels.index_scores`` + ``kernels.top_k`` (a radix select): what
  ``index_topk`` runs by default on Hopper;
* ``cuda + select``: ``kernels.index_scores_cuda`` (``cuda/``) + ``kernels.top_k``: what
  ``index_topk`` runs by default on Hopper with nvcc;
* ``pallas scores``, ``cuda scores``: ``index_scores(impl=)`` alone; the selection alone on
  the same scores: ``lax.top_k``, the indexer's two-stage XLA top-k, and ``kernels.top_k``.
  Each of these also as the sum of its GPU kernels' durations from a profiler trace
  (``kernel ms``).

Floors: the FP4 key bytes of the visible entries at the measured device-copy bandwidth, and
their FLOPs (2 * heads * 128 per entry) at the H100's dense BF16 peak. Wall per synchronized
call, median of ``--iters``; agreement: the kernel's scores against the xla path's.

    PYTHONPATH=$PWD python benchmarks/dsv4_indexer.py [--requests 64,256] [--contexts 8192,65536]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _timing import copy_gbps, kernel_ms_per_step, times_ms
from dsv4_step import fill_random

from jaxkv import hybrid as H
from jaxkv._backend import is_hopper
from jaxkv.hybrid.indexer import _top_k
from jaxkv.kernels.top_k import top_k as select_kernel

PEAK_TFLOPS = 989.0  # H100 SXM dense BF16


def _before(state, step, layer, q, w, k):
    """The pre-kernel formulation: float32 copies, HIGHEST matmul, top-k."""
    keys, _ = H.index_keys(state, step, layer)
    hi = jax.lax.Precision.HIGHEST
    dots = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys.astype(jnp.float32), precision=hi)
    s = jnp.einsum("bthn,bth->btn", jax.nn.relu(dots), w, precision=hi)
    s = jnp.where(H.causal_entry_mask(s.shape[-1], step, 1, state.config.compress_ratios[layer]), s, -jnp.inf)
    val, idx = jax.lax.top_k(s, k)
    return jnp.where(jnp.isfinite(val), idx, -1)


def run_case(B, context, iters, gbps):
    cfg = dataclasses.replace(H.V4_FLASH, compress_ratios=(4,), max_requests=B, max_context=context)
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    slots = jnp.arange(B, dtype=jnp.int32)
    start = rng.integers(context * 3 // 4, context - 8, size=B).astype(np.int32)
    state = H.init(cfg)
    state, _ = H.prepare_forward(state, slots, jnp.zeros(B, jnp.int32), jnp.asarray(start), chunk=int(start.max()))
    state = fill_random(state, jax.random.fold_in(key, 7))
    state, step = H.prepare_forward(state, slots, state.position[slots], chunk=1)
    q = H.index_query(
        state, jax.random.normal(jax.random.fold_in(key, 1), (B, 1, cfg.index_heads, cfg.index_dim), jnp.bfloat16)
    )
    w = jax.random.normal(jax.random.fold_in(key, 2), (B, 1, cfg.index_heads), jnp.float32)
    k = min(cfg.top_k, cfg.max_entries(4))
    fns = {
        "xla, f32 (before)": jax.jit(lambda s, p, q, w: _before(s, p, 0, q, w, k)),
        "xla": jax.jit(lambda s, p, q, w: H.index_topk(s, p, 0, q, w, impl="xla", select="xla")[1]),
        "pallas + sort": jax.jit(lambda s, p, q, w: H.index_topk(s, p, 0, q, w, impl="pallas", select="xla")[1]),
        "pallas + select": jax.jit(lambda s, p, q, w: H.index_topk(s, p, 0, q, w, impl="pallas", select="cuda")[1]),
        "cuda + select": jax.jit(lambda s, p, q, w: H.index_topk(s, p, 0, q, w, impl="cuda", select="cuda")[1]),
        "pallas scores": jax.jit(lambda s, p, q, w: H.index_scores(s, p, 0, q, w, impl="pallas")),
        "cuda scores": jax.jit(lambda s, p, q, w: H.index_scores(s, p, 0, q, w, impl="cuda")),
    }
    ref = jax.jit(lambda s, p, q, w: H.index_scores(s, p, 0, q, w, impl="xla"))(state, step, q, w)
    scores, err, same = ref, {}, float("nan")
    fin = jnp.isfinite(ref)
    if is_hopper():
        for kern in ("pallas", "cuda"):
            scores = fns[f"{kern} scores"](state, step, q, w)
            err[kern] = float(
                jnp.max(jnp.where(fin, jnp.abs(scores - ref), 0)) / jnp.max(jnp.where(fin, jnp.abs(ref), 0))
            )
        same = float(jnp.mean(fns["cuda + select"](state, step, q, w) == fns["xla"](state, step, q, w)))
    else:  # the kernels are Hopper only
        fns = {n: f for n, f in fns.items() if not n.startswith(("pallas", "cuda"))}
    selects = {
        "top-k: lax.top_k": jax.jit(lambda s: jax.lax.top_k(s, k)[1]),
        "top-k: two stages": jax.jit(lambda s: _top_k(s, k)[1]),
        "top-k: select kernel": jax.jit(lambda s: select_kernel(s, k)),
    }
    if jax.default_backend() != "gpu":  # the kernel needs a CUDA GPU
        selects.pop("top-k: select kernel")
    else:
        picks = {n: np.asarray(f(scores)) for n, f in selects.items()}
        same_k = np.array_equal(picks["top-k: select kernel"], picks["top-k: lax.top_k"])
        print(f"  select kernel picks == lax.top_k's: {same_k}", flush=True)
    rows = []
    for name, f in fns.items():
        ms = statistics.median(times_ms(lambda i, f=f: jax.block_until_ready(f(state, step, q, w)), iters, warmup=3))
        kms = float("nan")
        if name.endswith("scores"):
            kms = kernel_ms_per_step(lambda i, f=f: jax.block_until_ready(f(state, step, q, w)), 10) or kms
        rows.append((name, ms, kms))
    for name, f in selects.items():
        ms = statistics.median(times_ms(lambda i, f=f: jax.block_until_ready(f(scores)), iters, warmup=3))
        kms = kernel_ms_per_step(lambda i, f=f: jax.block_until_ready(f(scores)), 10) or float("nan")
        rows.append((name, ms, kms))
    visible = float(jnp.sum((start + 1) // 4))
    byts = visible * cfg.storage_format.index_key_bytes(cfg.index_dim)
    flops = visible * 2 * cfg.index_heads * cfg.index_dim
    floor_ms = max(byts / gbps / 1e6, flops / PEAK_TFLOPS / 1e9)
    print(
        f"  {B} requests, context {context}: kernels vs xla scores max rel err "
        f"{', '.join(f'{k} {v:.2e}' for k, v in err.items()) or '-'}, "
        f"top-k positions equal {same:.4f}, floor {floor_ms:.4f} ms",
        flush=True,
    )
    return [(B, context, name, ms, kms, byts / ms / 1e6, flops / ms / 1e9, floor_ms) for name, ms, kms in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--contexts", default="8192,65536")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    gbps = copy_gbps()
    print(f"  device copy: {gbps:.0f} GB/s", flush=True)
    table = []
    for B in map(int, args.requests.split(",")):
        for context in map(int, args.contexts.split(",")):
            table += run_case(B, context, args.iters, gbps)
    print("\n| requests | context | contender | ms | kernel ms | key GB/s | TFLOP/s | floor ms |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for B, context, name, ms, kms, gb, tf, floor in table:
        print(f"| {B} | {context} | {name} | {ms:.4f} | {kms:.4f} | {gb:.0f} | {tf:.1f} | {floor:.4f} |")


if __name__ == "__main__":
    main()
