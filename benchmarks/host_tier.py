"""The hybrid cache's host tier: one long request to pinned host memory and back.

A V4-Flash cache (43 layers, official storage) holds ``--requests`` requests prefilled to
``--context`` tokens, every pool random (``dsv4_step.fill_random``). Timed, each a median of
``--iters`` synchronized calls:

* ``offload``: the request's blocks, ring and tails gathered into a ``RequestImage`` (device);
* ``to_host``: the image copied to pinned host memory (device -> host);
* ``to_device``: back (host -> device);
* ``reload``: the image scattered into an empty slot on fresh blocks (device).

GB/s counts the image's bytes. Each round trip is checked bit-exact: the reloaded request,
offloaded again, gives the same image.

    PYTHONPATH=$PWD python benchmarks/host_tier.py [--context 65536] [--iters 10]
    PYTHONPATH=$PWD python benchmarks/host_tier.py --quick       # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _timing import times_ms
from dsv4_step import fill_random

from jaxkv import hybrid as H
from jaxkv.hybrid import tier


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2, help="request slots (one is moved, one stays empty)")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="CPU-sized: 4 layers, 2K context")
    args = ap.parse_args()
    cfg = dataclasses.replace(H.V4_FLASH, max_requests=args.requests, max_context=args.context)
    if args.quick:
        cfg = dataclasses.replace(cfg, compress_ratios=cfg.compress_ratios[:4], max_context=2048)
    n = cfg.max_context
    state = H.init(cfg)
    B = cfg.max_requests
    state, _ = H.prepare_forward(
        state, jnp.arange(B, dtype=jnp.int32), jnp.zeros(B, jnp.int32), jnp.full(B, n, jnp.int32).at[1:].set(0), chunk=n
    )
    state = fill_random(state, jax.random.key(0))
    jax.block_until_ready(state)
    slot, spare = jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32)
    box = {"s": state, "img": None, "host": None, "dev": None, "at": slot}
    dev = jax.devices()[0]
    print(f"{dev.device_kind}, jax {jax.__version__}; {cfg.num_layers} layers, context {n}", flush=True)

    def off(i=0):  # the request leaves: slot -> image
        box["s"], box["img"] = H.offload(box["s"], box["at"])
        jax.block_until_ready(box["img"])

    def host(i=0):
        box["host"] = tier.to_host(box["img"])
        jax.block_until_ready(box["host"])

    def back(i=0):
        box["dev"] = tier.to_device(box["host"])
        jax.block_until_ready(box["dev"])

    def rel(i=0):  # and comes back, into the other slot each time
        box["at"] = spare if int(box["at"][0]) == int(slot[0]) else slot
        box["s"] = tier._reload(box["s"], box["at"], box["dev"])
        jax.block_until_ready(box["s"])

    first = None
    samples = {k: [] for k in ("offload", "to_host", "to_device", "reload")}
    for _ in range(args.iters + 1):
        for name, fn in zip(samples, (off, host, back, rel)):
            samples[name] += times_ms(fn, 1)
        if first is None:
            first = jax.tree.map(np.asarray, box["img"])
            samples = {k: [] for k in samples}  # the first round compiles
    again = jax.tree.map(np.asarray, box["img"])
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    import jaxkv

    jaxkv.check(box["s"])
    nbytes = sum(x.nbytes for x in jax.tree.leaves(first))
    print(f"\nimage: {nbytes / 2**20:.1f} MiB; every round trip bit-exact ({args.iters} rounds)")
    print("\n| step | ms (median) | GB/s |")
    print("| --- | ---: | ---: |")
    for name, s in samples.items():
        ms = statistics.median(s)
        print(f"| {name} | {ms:.3f} | {nbytes / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
