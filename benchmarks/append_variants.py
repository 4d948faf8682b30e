"""What does writing one frame into 24 layers' K/V cost, and what is the floor?

518x378 shapes (999 patches + 6 specials, H=16, D=64, bf16), steady state, median of many
frames, one jitted step each with the buffers donated:

* frame.append: the library (specials + patches for 24 K and 24 V buffers, bookkeeping)
* frame.append (warm-up): the same while slots still fill (specials move each frame)
* 48 DUS, patches only: one dynamic-update-slice per buffer, nothing else
* 1 DUS, stacked: one dynamic-update-slice into a single [48, T, H, D] array

    python benchmarks/append_variants.py
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
from _timing import times_ms

from jaxkv import frame

L, H, D, P, NS = 24, 16, 64, 999, 6


def med(fn, n=60):
    return statistics.median(times_ms(lambda i: fn(), n, warmup=5))


def main():
    spec = frame.FrameSpec(num_layers=L, num_heads=H, head_dim=D, patches_per_frame=P, max_frames=400)
    T = spec.capacity
    key = jax.random.key(0)
    k = jax.random.normal(key, (L, 1, P + NS, H, D), jnp.bfloat16)
    rows = []

    app = jax.jit(frame.append, donate_argnums=0)
    box = {"s": frame.init(spec)}
    for _ in range(80):
        box["s"] = app(box["s"], k, k)

    def one():
        box["s"] = app(box["s"], k, k)
        box["s"].num_frames.block_until_ready()

    rows.append(("frame.append, steady state", med(one)))
    box["s"] = frame.init(spec)

    def warm():
        if int(box["s"].num_frames[0]) >= 60:
            box["s"] = frame.reset(box["s"])
        box["s"] = app(box["s"], k, k)
        box["s"].num_frames.block_until_ready()

    rows.append(("frame.append, warm-up (+1 host read)", med(warm, 50)))
    box.clear()

    bufs = [jnp.zeros((1, T, H, D), jnp.bfloat16) for _ in range(2 * L)]

    @jax.jit
    def dus48(bufs, k, row):
        return [jax.lax.dynamic_update_slice(b, k[i % L, :, NS:], (0, row, 0, 0)) for i, b in enumerate(bufs)]

    dus48 = jax.jit(dus48, donate_argnums=0)
    st = {"b": bufs, "r": jnp.int32(0)}

    def d48():
        st["b"] = dus48(st["b"], k, st["r"])
        st["b"][-1].block_until_ready()

    rows.append(("48 DUS, patches only", med(d48)))
    del st, bufs

    big = jnp.zeros((2 * L, 1, T, H, D), jnp.bfloat16)

    def dus1(big, k, row):
        upd = jnp.concatenate([k[:, :, NS:], k[:, :, NS:]])
        return jax.lax.dynamic_update_slice(big, upd, (0, 0, row, 0, 0))

    dus1 = jax.jit(dus1, donate_argnums=0)
    st = {"b": big}

    def d1():
        st["b"] = dus1(st["b"], k, jnp.int32(0))
        st["b"].block_until_ready()

    rows.append(("1 DUS, stacked [48, T, H, D]", med(d1)))
    mb = 2 * L * P * H * D * 2 / 1e6
    print(f"\nframe write at 518x378, {L} layers ({mb:.0f} MB of K+V) — {jax.devices()[0].device_kind}")
    print(f"{'variant':<40} {'ms':>7} {'GB/s':>7}")
    for name, ms in rows:
        print(f"{name:<40} {ms:7.3f} {mb / ms:7.0f}")


if __name__ == "__main__":
    main()
