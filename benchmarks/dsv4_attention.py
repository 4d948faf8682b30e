"""DeepSeek-V4 decode attention over the FP8 pools: the ``cuda/`` kernel
(``kernels.pool_attention_cuda``) vs the Mosaic GPU kernel (``kernels.pool_attention_pallas``) vs the XLA path (dequantize the rows, float32 attention) vs
FlashMLA's sm90 sparse decode on the same pool bytes, through jax.ffi (``flashmla``:
``kernels.pool_attention_flashmla``, opt-in with ``--contenders``) and from torch
(``torch_bridge.flashmla``, the same library through ctypes: ``flashmla-torch``, whenever
``FLASHMLA_SRC`` is set and torch with CUDA is importable), per shape: one token per request, top-k entries + a
128-item window, an attention sink. Back-to-back calls (dispatch amortized), median of
``--reps`` rounds after warm-up; TFLOP/s counts QK and PV (4 * H * keys * 512 per token).
The floors beside them: the H100's dense BF16 peak (``PEAK_TFLOPS``) and the device-to-device
copy bandwidth measured in the same run (``x + 0`` over 1 GiB, read + write, kernel time); per
case, ``copy ms`` is a copy kernel of the call's own bytes, the latency floor of a call that
small, and ``floor ms`` the larger of the bytes at copy bandwidth and the FLOPs at peak.

The top-k rows are picked at random from an entry pool of ``--pool-mib`` MiB (1024 by default) and
each request's window lies in a ring pool of an eighth of that, so what one call reads is mostly
not in the 50 MB L2 from the calls before it, as in a model's step where 43 layers' pools pass
between two reads of one layer. ``--pool-mib 0`` gives pools just large enough for the rows (43 MB
at V4-Flash batch 64: L2-warm figures, the script's earlier default).

    PYTHONPATH=$PWD python benchmarks/dsv4_attention.py [--batches 1,64] [--contenders cuda,pallas,xla]
        [--shapes V4-Flash,V4-Pro] [--pool-mib 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from _timing import kernel_ms_per_step  # benchmarks/, the script's directory

from jaxkv.formats.storage import STORAGES, pack_items
from jaxkv.kernels.launch import pool_splits
from jaxkv.kernels.pool_attention import (
    BLOCK,
    pool_attention_cuda,
    pool_attention_flashmla,
    pool_attention_pallas,
    ref_pool_attention,
)

SHAPES = {"V4-Flash": (64, 512), "V4-Pro": (128, 1024)}  # heads, top-k
WINDOW, BS = 128, 64
CODEC = STORAGES["official"].entry  # the pools' rows: u8[584] each
PEAK_TFLOPS = 989.0  # H100 SXM dense BF16 (the FLOP floor)


@functools.partial(jax.jit, static_argnums=1)
def rows_of(key, n):
    """n random rows in the official storage: u8[n, 584]."""
    return CODEC.encode(jax.random.normal(key, (n, 512), jnp.bfloat16))


def pool_of(key, blocks, bs, chunk=1 << 18):
    """A pool of random rows, encoded ``chunk`` rows at a time (a GiB pool in one go would
    hold tens of GiB of the encoder's float32 temporaries)."""
    n = blocks * bs
    keys = jax.random.split(key, -(-n // chunk))
    items = jnp.concatenate([rows_of(k, min(chunk, n - i * chunk)) for i, k in enumerate(keys)])
    return pack_items(items, bs, CODEC.segments)


def case(B, H, K, key, pool_mib=0):
    """One decode batch: q, (entry pool, ring pool), blocks per part, row ids, valid counts, sink.
    The pools hold at least ``pool_mib`` MiB (entries) and ``pool_mib / 8`` MiB (windows)."""
    k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
    nb = max(2 * B * K // BS, 64, pool_mib * 2**20 // (BS * CODEC.bytes))
    rings = max(B, pool_mib * 2**20 // 8 // (WINDOW * CODEC.bytes))
    entries, ring = pool_of(k1, nb, BS), pool_of(k2, rings, WINDOW)
    picked = jax.vmap(lambda k: jax.random.permutation(k, nb * BS)[:K])(jax.random.split(k3, B)).astype(jnp.int32)
    home = jax.random.permutation(k6, rings)[:B]  # each request's ring block
    window = (home[:, None] * WINDOW + jnp.arange(WINDOW)[None, :]).astype(jnp.int32)
    rows = jnp.concatenate([picked, window], axis=1)
    nvalid = jnp.full((B, (K + WINDOW) // BLOCK), BLOCK, jnp.int32)
    q = jax.random.normal(k4, (B, H, 512), jnp.bfloat16)
    sink = jax.random.normal(k5, (H,), jnp.float32)
    return q, (entries, ring), (K // BLOCK, WINDOW // BLOCK), rows, nvalid, sink


def copy_kernel_ms(nbytes):
    """GPU time of one ``x + 0`` over ``nbytes`` / 2 bytes (it reads and writes ``nbytes`` in
    all), from a profiler trace of 10 calls."""
    x = jnp.ones((max(nbytes // 4, 1),), jnp.bfloat16)
    f = jax.jit(lambda x: x + 0)
    jax.block_until_ready(f(x))
    return kernel_ms_per_step(lambda i: jax.block_until_ready(f(x)), 10)


def time_jax(fn, reps, inner=20):
    out = fn()
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(times), out


def flashmla_contender(q, pools, rows, sink, B, H, K):
    """A closure timing FlashMLA on the same device buffers (torch.from_dlpack), or None."""
    if not os.environ.get("FLASHMLA_SRC"):
        return None, "FLASHMLA_SRC not set"
    try:
        import torch

        from torch_bridge import flashmla
    except ImportError as e:
        return None, f"no torch / torch_bridge.flashmla ({e})"
    try:
        flashmla.load()
    except (ImportError, RuntimeError) as e:  # a failed build: say why, time the others
        return None, f"FlashMLA's library did not build or load: {str(e).splitlines()[0][:300]}"
    tq = torch.from_dlpack(q).reshape(B, 1, H, 512)
    pool, ring = (torch.from_dlpack(p) for p in pools)
    idx = torch.from_dlpack(rows[:, :K]).reshape(B, 1, K)
    widx = torch.from_dlpack(rows[:, K:]).reshape(B, 1, WINDOW)
    tsink = torch.from_dlpack(sink)
    sched = flashmla.Schedule()

    def run():
        return flashmla.sparse_decode(
            tq, pool, idx, block_size=BS, sink=tsink, scale=512**-0.5, window=ring, window_indices=widx, schedule=sched
        )[0]

    def timed(reps, inner=20):
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                out = run()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / inner)
        return statistics.median(times), jnp.asarray(jax.dlpack.from_dlpack(out.contiguous())).reshape(B, H, 512)

    return timed, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--contenders", default="cuda,pallas,xla")
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = jax.devices()[0].device_kind
    copy_ms = copy_kernel_ms(2 << 30)
    copy_gbs = (2 << 30) / copy_ms / 1e6 if copy_ms else None
    print(f"copy bandwidth: {copy_gbs or 0:.0f} GB/s (x + 0 over 1 GiB, read + write, kernel time)", flush=True)
    rows_out, floors = [], {}
    for name in a.shapes.split(","):
        H, K = SHAPES[name]
        for B in map(int, a.batches.split(",")):
            q, pools, pb, rows, nvalid, sink = case(B, H, K, jax.random.key(B * 7 + H), a.pool_mib)
            keys = K + WINDOW
            flops = 4 * B * H * keys * 512
            bytes_ = B * keys * 584 + 2 * B * H * 512 * 2
            ref = jax.jit(lambda *x: ref_pool_attention(*x[:2], pb, *x[2:]))(q, pools, rows, nvalid, sink)
            S = pool_splits(B, H, rows.shape[1] // BLOCK)
            small = copy_kernel_ms(bytes_)
            floors[name, B] = (small, max(bytes_ / copy_gbs / 1e6 if copy_gbs else 0, flops / PEAK_TFLOPS / 1e9))
            fns = dict(
                cuda=jax.jit(lambda q, p, r, n, s: pool_attention_cuda(q, p, pb, r, n, s, splits=S)),
                pallas=jax.jit(lambda q, p, r, n, s: pool_attention_pallas(q, p, pb, r, n, s, splits=S)),
                flashmla=jax.jit(lambda q, p, r, n, s: pool_attention_flashmla(q, p, pb, r, n, s)),
                xla=jax.jit(lambda q, p, r, n, s: ref_pool_attention(q, p, pb, r, n, s).astype(jnp.bfloat16)),
            )
            res = {}
            for cname in a.contenders.split(","):
                fn = fns[cname]
                ms, out = time_jax(lambda: fn(q, pools, rows, nvalid, sink), a.reps)
                gpu = kernel_ms_per_step(
                    lambda i: jax.block_until_ready(fn(q, pools, rows, nvalid, sink)),
                    10,
                    top=3 if cname == "cuda" else 0,
                )
                res[cname] = (ms, gpu, float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))))
                print(f"{name} B={B} {cname}: {ms:.4f} ms wall, {gpu} ms kernels", flush=True)
            timed, why = flashmla_contender(q, pools, rows, sink, B, H, K)
            if timed is not None:
                ms, out = timed(a.reps)
                res["flashmla-torch"] = (ms, ms, float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))))
            for cname, (ms, gpu, err) in res.items():
                k = gpu or ms
                rows_out.append(
                    dict(
                        shape=name,
                        batch=B,
                        heads=H,
                        topk=K,
                        impl=cname,
                        ms=ms,
                        kernel_ms=gpu,
                        tflops=flops / k / 1e9,
                        gbs=bytes_ / k / 1e6,
                        max_err=err,
                        splits=S,
                    )
                )
            if why:
                print(f"flashmla-torch skipped: {why}")
    print(
        f"\n{dev}, jax {jax.__version__}; decode, top-k + {WINDOW}-item window, official storage, "
        f"pools of >= {a.pool_mib} MiB"
    )
    print(
        "wall: per call over back-to-back calls (JAX: host dispatch included); kernel: GPU time per call from a "
        "profiler trace (flashmla-torch: CUDA events around back-to-back calls); TFLOP/s and GB/s from kernel time"
    )
    print(
        f"copy bandwidth {copy_gbs or 0:.0f} GB/s, dense BF16 peak {PEAK_TFLOPS:.0f} TFLOP/s; of peak / of copy: "
        "the kernel's TFLOP/s and GB/s against them; copy ms: a copy kernel of the call's bytes"
    )
    print(
        f"{'shape':9} {'B':>4} {'impl':14} {'wall ms':>8} {'kernel ms':>9} {'TFLOP/s':>8} {'of peak':>7} {'GB/s':>7} "
        f"{'of copy':>7} {'max err':>8} {'vs fm-torch':>11}"
    )
    for r in rows_out:
        fm = [
            x
            for x in rows_out
            if x["shape"] == r["shape"] and x["batch"] == r["batch"] and x["impl"] == "flashmla-torch"
        ]
        k = r["kernel_ms"] or r["ms"]
        rel = f"{k / fm[0]['ms']:.2f}x" if fm else "-"
        kern = f"{r['kernel_ms']:9.4f}" if r["kernel_ms"] else f"{'-':>9}"
        of_copy = f"{r['gbs'] / copy_gbs:7.2f}" if copy_gbs else f"{'-':>7}"
        print(
            f"{r['shape']:9} {r['batch']:4d} {r['impl']:14} {r['ms']:8.4f} {kern} {r['tflops']:8.1f} "
            f"{r['tflops'] / PEAK_TFLOPS:7.2f} {r['gbs']:7.0f} {of_copy} {r['max_err']:8.4f} {rel:>11}"
        )
    print(f"\n{'shape':9} {'B':>4} {'copy ms':>8} {'floor ms':>8}")
    for (name, B), (small, floor) in floors.items():
        print(f"{name:9} {B:4d} {small or 0:8.4f} {floor:8.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(
                    device=dev,
                    jax=jax.__version__,
                    copy_gbs=copy_gbs,
                    peak_tflops=PEAK_TFLOPS,
                    floors={f"{n} {b}": v for (n, b), v in floors.items()},
                    rows=rows_out,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
