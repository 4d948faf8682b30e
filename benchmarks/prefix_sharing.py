"""Prefix sharing at DeepSeek-V4-Flash's scale: the blocks a shared-prefix workload holds, the
prompt tokens it computes, and the tokens a hit at any length re-feeds.

The workload of the serving loop (``jaxkv.models.dsv4_serving``) at full size: ``--prompts``
system prompts of ``--shared`` tokens, each the start of ``--requests / --prompts`` requests
with ``--unique`` tokens of their own, all resident at once. The blocks come from the real
allocator (``prepare_forward``, ``share``) on a cache with V4-Flash's window, ratios and
block size, one layer per kind (every layer of a ratio shares its allocator, so the counts
are those of all 43 layers); no model runs (the bytes are not looked at).

* without sharing: every request prefilled from token 0;
* with sharing: each prompt prefilled once into a snapshot slot, every request started from
  it (``share`` of the whole snapshot: nothing re-fed), then its own tokens.

    PYTHONPATH=$PWD python benchmarks/prefix_sharing.py          # CPU, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxkv import hybrid as H


def prefill(state, slots, start, n):
    slots = np.asarray(slots, np.int32)
    state, _ = H.prepare_forward(
        state, jnp.asarray(slots), jnp.full(len(slots), start, jnp.int32), jnp.full(len(slots), n, jnp.int32), chunk=n
    )
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--shared", type=int, default=8192)
    ap.add_argument("--unique", type=int, default=1024)
    args = ap.parse_args()
    n, p = args.requests, args.prompts
    total = args.shared + args.unique
    cfg = dataclasses.replace(
        H.V4_FLASH, compress_ratios=(0, 4, 128), max_requests=n + p, max_context=-(-total // 1024) * 1024
    )
    per_prompt = np.arange(n) % p

    plain = prefill(H.init(cfg), np.arange(n), 0, total)
    plain_used, _ = H.block_counts(plain)
    del plain

    st = prefill(H.init(cfg), n + np.arange(p), 0, args.shared)  # the snapshots
    st = H.share(st, np.arange(n), n + per_prompt, np.full(n, args.shared))
    st = prefill(st, np.arange(n), args.shared, args.unique)
    assert not np.asarray(st.error).any(), "a fault in the shared run"
    used, named = H.block_counts(st)
    computed, computed_plain = p * args.shared + n * args.unique, n * total

    print(f"V4-Flash schedule (window {cfg.window}, ratios {cfg.ratios}, {cfg.block_size} entries per block)")
    print(f"workload: {n} requests, {p} prompts x {args.shared} shared tokens, {args.unique} unique each\n")
    print("| | blocks held | prompt tokens computed |")
    print("| --- | ---: | ---: |")
    print(f"| without sharing | {plain_used:,} | {computed_plain:,} |")
    print(f"| with sharing | {used:,} ({used / plain_used:.3f}x) | {computed:,} ({computed / computed_plain:.3f}x) |")
    print(f"| (blocks the tables name, with sharing) | {named:,} | |")

    print("\nA hit ending inside another request (re-fed from `refeed_start`):\n")
    print("| prefix length | re-fed tokens |")
    print("| ---: | ---: |")
    worst = 0
    for length in (256, 257, 300, 1000, 4095, 4097, 8191, 8192, 65535, 65536):
        k = length - H.refeed_start(H.V4_FLASH, length)
        worst = max(worst, k)
        print(f"| {length:,} | {k} |")
    worst = max(worst, max(L - H.refeed_start(H.V4_FLASH, L) for L in range(256, 70_000)))
    print(f"| every length 256 .. 69,999: at most | {worst} |")


if __name__ == "__main__":
    main()
