"""Which cuDNN call shape is fastest for one frame's queries over a long key prefix?

One layer, timed alone (keys far exceed L2), median of many calls, reported x layers:
dense exact-length keys with no mask vs a padded capacity with a key length vs split-KV.

    python benchmarks/attention_variants.py --patches 999
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from _timing import times_ms
from jaxkv.frame.attention import cudnn_attention

H, D, NS = 16, 64, 6


def bench(fn, *args, iters=50):
    return statistics.median(times_ms(lambda i: fn(*args).block_until_ready(), iters, warmup=1))


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
    padded = jax.jit(lambda q, k, v, l: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=l,
                                                                     implementation="cudnn"))
    rows.append(("capacity + key length", bench(padded, q, k, v, lens)))
    for s in (1, 2, 4, 8, 16):
        f = jax.jit(lambda q, k, v, l, s=s: cudnn_attention(q, k, v, l, splits=s))
        rows.append((f"split-KV x{s}", bench(f, q, k, v, lens)))
    flops = 4 * Tq * n * H * D
    print(f"\none layer: {Tq} queries x {n} keys, H={H}, D={D}, bf16 — {jax.devices()[0].device_kind}")
    print(f"{'variant':<32} {'ms/layer':>9} {'ms x' + str(a.layers):>9} {'TFLOP/s':>8}")
    for name, ms in rows:
        print(f"{name:<32} {ms:9.3f} {ms * a.layers:9.2f} {flops / ms / 1e9:8.0f}")


if __name__ == "__main__":
    main()
