"""Which cuDNN call shape is fastest for one frame's queries over a long key prefix?

One layer, timed alone (keys far exceed L2), median of many calls, reported x layers,
and the GPU kernel time of one call (profiler; the wall time includes a dispatch):
dense exact-length keys with no mask vs a padded capacity with a key length (jaxkv's
``cudnn_attention``) vs split-KV with key lengths or over a 128-row-multiple buffer with no
mask vs jaxkv's Pallas prefix kernel (``kernels.prefix_attention``: a length that costs nothing).

The split-KV rows time the call shape only: jax's public ``dot_product_attention`` returns
cuDNN's log-sum-exp rounded to bf16, too coarse to merge chunks exactly, so jaxkv's
``cudnn`` backend makes one call (docs/kernels/prefix_attention.md); the printed max |diff|
shows that rounding.

    python benchmarks/attention_variants.py --patches 999
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
from _timing import kernel_ms_per_step, times_ms

from jaxkv.frame.attention import cudnn_attention
from jaxkv.kernels import prefix_attention
from jaxkv.kernels.launch import prefix_splits

H, D, NS = 16, 64, 6


def bench(fn, *args, iters=50):
    call = lambda i: jax.block_until_ready(fn(*args))  # noqa: E731
    wall = statistics.median(times_ms(call, iters, warmup=1))
    return wall, kernel_ms_per_step(call, 10)


def split_kv(q, k, v, splits, lens=None):
    """``splits`` equal key chunks (masked by ``lens`` if given, else all keys valid), merged
    by cuDNN's log-sum-exp as jax's public API returns it (bf16)."""
    B, Tq, Hq, D = q.shape
    n, C = splits, k.shape[1] // splits
    qc = jnp.broadcast_to(q[:, None], (B, n, Tq, Hq, D)).reshape(B * n, Tq, Hq, D)
    kw = {}
    if lens is not None:
        starts = jnp.arange(n, dtype=jnp.int32) * C
        kw["key_value_seq_lengths"] = jnp.clip(lens[:, None] - starts[None], 1, C).reshape(-1)
    out, lse = jax.nn.dot_product_attention(
        qc,
        k.reshape(B * n, C, *k.shape[2:]),
        v.reshape(B * n, C, *v.shape[2:]),
        scale=D**-0.5,
        implementation="cudnn",
        return_residual=True,
        **kw,
    )
    out = out.reshape(B, n, Tq, Hq, D).astype(jnp.float32)
    lse = lse.reshape(B, n, Tq, Hq).astype(jnp.float32)
    if lens is not None:
        lse = jnp.where((lens[:, None] > jnp.arange(n) * C)[:, :, None, None], lse, -jnp.inf)
    w = jnp.exp(lse - jnp.max(lse, axis=1, keepdims=True))
    return (jnp.sum(out * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]).astype(q.dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--patches", type=int, default=999)
    p.add_argument("--frames", type=int, default=72)
    p.add_argument("--specials", type=int, default=720)
    p.add_argument("--layers", type=int, default=24)
    a = p.parse_args()
    Tq = a.patches + NS
    n = a.frames * a.patches + a.specials
    T = -(-(n + 2 * a.patches) // 2048) * 2048
    key = jax.random.key(0)
    k = jax.random.normal(key, (1, T, H, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (1, T, H, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 2), (1, Tq, H, D), jnp.bfloat16)
    ke, ve = k[:, :n], v[:, :n]
    n128 = -(-n // 128) * 128
    ke128, ve128 = k[:, :n128], v[:, :n128]
    lens = jnp.array([n], jnp.int32)
    rows = []

    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    rows.append(("dense exact length, no mask", bench(dense, q, ke, ve)))
    rows.append(("dense 128-multiple, no mask", bench(dense, q, ke128, ve128)))
    padded = jax.jit(
        lambda q, k, v, l: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=l, implementation="cudnn")
    )
    rows.append(("capacity + key length", bench(padded, q, k, v, lens)))
    rows.append(("jaxkv cudnn_attention", bench(jax.jit(cudnn_attention), q, k, v, lens)))
    for s in (2, 4, 8, 16):
        if T % (s * 128) == 0:
            f = jax.jit(lambda q, k, v, l, s=s: split_kv(q, k, v, s, l))
            rows.append((f"split-KV x{s}, key lengths", bench(f, q, k, v, lens)))
    auto = prefix_splits(Tq, H, T)
    for s in sorted({1, 8, auto}):
        f = jax.jit(lambda q, k, v, l, s=s: prefix_attention(q, k, v, l, splits=s))
        rows.append((f"pallas prefix kernel x{s}" + (" (auto)" if s == auto else ""), bench(f, q, k, v, lens)))
    for s in (2, 4, 8):
        if n128 % (s * 128) == 0:
            f = jax.jit(lambda q, k, v, s=s: split_kv(q, k, v, s))
            rows.append((f"split-KV x{s}, 128-multiple, no mask", bench(f, q, ke128, ve128)))
    ref = dense(q, ke128, ve128).astype(jnp.float32)
    for s in (2, 8):
        if n128 % (s * 128) == 0:  # the unmasked split computes what one dense call does
            err = float(jnp.max(jnp.abs(split_kv(q, ke128, ve128, s).astype(jnp.float32) - ref)))
            print(f"split-KV x{s} no mask (bf16 log-sum-exp) vs dense over the same keys: max |diff| {err:.1e}")
    exact = dense(q, ke, ve).astype(jnp.float32)
    got = prefix_attention(q, k, v, lens, splits=auto).astype(jnp.float32)
    print(
        f"pallas prefix kernel x{auto} vs dense over the {n} visible keys: max |diff| "
        f"{float(jnp.max(jnp.abs(got - exact))):.1e}"
    )
    flops = 4 * Tq * n * H * D
    print(f"\none layer: {Tq} queries x {n} keys, H={H}, D={D}, bf16 — {jax.devices()[0].device_kind}")
    print(f"{'variant':<36} {'ms/layer':>9} {'ms x' + str(a.layers):>9} {'kernel ms':>10} {'TFLOP/s':>8}")
    for name, (ms, kms) in rows:
        kt = f"{kms:10.3f}" if kms else "         -"
        print(f"{name:<36} {ms:9.3f} {ms * a.layers:9.2f} {kt} {flops / (kms or ms) / 1e9:8.0f}")


if __name__ == "__main__":
    main()
