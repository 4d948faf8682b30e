"""Repeated transformer blocks unrolled or under ``lax.scan``: what a frame's host and GPU pay.

The lingbot-map port unrolls its 24-block stacks, so a frame is a few thousand kernels in a
few CUDA graphs (XLA command buffers). A ``scan`` over stacked weights would make each stack
one loop body: fewer graph nodes, if XLA puts the loop itself into the graph (its ``WHILE``
and ``CONDITIONAL`` command types, off by default). This script measures that trade on 24
ViT-L blocks as the port's backbone runs them (one 518x378 frame: 1,036 tokens x 1,024,
16 heads, bf16 matmuls, float32 residual), with and without a per-block read of one of 24
cache buffers picked by the layer index (``lax.switch``, as a scanned global block would
read its layer's cache).

Contenders (one process per XLA setting, side by side in it): ``unrolled`` (a Python loop),
``scan`` (``lax.scan`` over the stacked weights), the same two with the cache read
(``+cache``: unrolled reads its layer's buffer directly). Per cell: host ms (until the call
returns), synchronized ms, streamed ms (calls queued, one sync), medians.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/scan_blocks.py
    python benchmarks/scan_blocks.py --small --modes default   # CPU smoke run
"""

from __future__ import annotations

import argparse
import time

from _timing import child_rows

SETTINGS = {
    "default": "",
    "while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "no_graphs": "--xla_gpu_enable_command_buffer=",
}
ITERS = 30


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    L, T, C, H, F, R = (4, 64, 128, 4, 256, 256) if args.small else (24, 1036, 1024, 16, 4096, 8192)
    bf = jnp.bfloat16
    impl = "cudnn" if jax.default_backend() == "gpu" else None

    def norm(x):
        m = x.mean(-1, keepdims=True)
        return (x - m) * lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-6)

    def block(p, x, cache=None):
        """x: f32[1, T, C]; cache: None (attention within x) or bf16[1, R, H, C/H] keys = values."""
        q, k, v = jnp.moveaxis((norm(x).astype(bf) @ p["qkv"]).reshape(1, T, 3, H, C // H), 2, 0)
        k, v = (k, v) if cache is None else (cache, cache)
        o = jax.nn.dot_product_attention(q, k, v, implementation=impl)
        x = x + (o.reshape(1, T, C) @ p["proj"]).astype(jnp.float32) * p["g"]
        return x + (jax.nn.gelu(norm(x).astype(bf) @ p["fc1"]) @ p["fc2"]).astype(jnp.float32) * p["g"]

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 8 + L))
    w = lambda *shape: (0.02 * jax.random.normal(next(keys), shape)).astype(bf)  # noqa: E731
    stacked = {"qkv": w(L, C, 3 * C), "proj": w(L, C, C), "fc1": w(L, C, F), "fc2": w(L, F, C)}
    stacked["g"] = jnp.full((L, C), 0.1, jnp.float32)
    per_block = [{n: a[i] for n, a in stacked.items()} for i in range(L)]
    caches = tuple(w(1, R, H, C // H) for _ in range(L))
    x = jax.random.normal(next(keys), (1, T, C), jnp.float32)

    def unrolled(ps, x, caches=None):
        for i, p in enumerate(ps):
            x = block(p, x, None if caches is None else caches[i])
        return x

    def scanned(sp, x, caches=None):
        def body(x, pi):
            p, i = pi
            if caches is None:
                return block(p, x), None
            read = [lambda x, p=p, c=c: block(p, x, c) for c in caches]
            return lax.switch(i, read, x), None

        return lax.scan(body, x, (sp, jnp.arange(L)))[0]

    cases = {
        "unrolled": (jax.jit(unrolled), (per_block, x)),
        "scan": (jax.jit(scanned), (stacked, x)),
        "unrolled+cache": (jax.jit(unrolled), (per_block, x, caches)),
        "scan+cache": (jax.jit(scanned), (stacked, x, caches)),
    }
    row = {"device": jax.devices()[0].device_kind, "cases": {}}
    outs = {}
    for name, (f, a) in cases.items():
        t0 = time.perf_counter()
        outs[name] = jax.block_until_ready(f(*a))
        compile_s = time.perf_counter() - t0
        for _ in range(5):
            jax.block_until_ready(f(*a))
        hosts, syncs = [], []
        for _ in range(ITERS):
            t = time.perf_counter()
            y = f(*a)
            hosts.append(time.perf_counter() - t)
            jax.block_until_ready(y)
            syncs.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        for _ in range(ITERS):
            y = f(*a)
        jax.block_until_ready(y)
        row["cases"][name] = {
            "host_ms": 1e3 * float(np.median(hosts)),
            "sync_ms": 1e3 * float(np.median(syncs)),
            "streamed_ms": 1e3 * (time.perf_counter() - t0) / ITERS,
            "compile_s": compile_s,
        }
    for a, b in (("unrolled", "scan"), ("unrolled+cache", "scan+cache")):  # the same math either way
        err = float(jnp.abs(outs[a] - outs[b]).max())
        if not err <= 1e-3 * float(jnp.abs(outs[a]).max()):
            raise SystemExit(f"{b} differs from {a}: max abs {err}")
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--small", action="store_true", help="4 small blocks (smoke test)")
    p.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import json

        print("ROW", json.dumps(child(args)), flush=True)
        return
    modes = args.modes.split(",")
    rows = child_rows(__file__, modes, SETTINGS, ["--small"] * args.small)
    device = next(iter(rows.values()))["device"]
    print(f"\n24 ViT-L blocks, one 518x378 frame, {device}: ms per call, medians of {ITERS}")
    print(f"{'setting':<11}{'contender':<16}{'host':>8}{'sync':>8}{'streamed':>10}{'compile s':>11}")
    for mode, row in rows.items():
        for name, r in row["cases"].items():
            print(
                f"{mode:<11}{name:<16}{r['host_ms']:>8.2f}{r['sync_ms']:>8.2f}"
                f"{r['streamed_ms']:>10.2f}{r['compile_s']:>11.1f}"
            )


if __name__ == "__main__":
    main()
