"""Save + restore throughput of a full frame cache (``jaxkv.save`` / ``jaxkv.restore``).

Default: lingbot-map at 518x378 (999 patches + 6 specials per frame), 24 layers, 8 scale +
64 window frames filled with random bf16, ~7 GB of K/V, written to ``--dir`` (local disk).
Each save writes a new checkpoint; each restore reads one back onto the device and checks
every array's checksum. Median of ``--iters`` runs after one warm-up; the table prints last.

    python3 benchmarks/checkpoint.py --dir /tmp/jaxkv-ckpt --iters 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import jax

import jaxkv
from jaxkv import frame


def filled_state(spec):
    state = frame.init(spec)
    keys = jax.random.split(jax.random.key(0), 2 * spec.num_layers)
    rand = jax.jit(lambda key: jax.random.normal(key, state.k[0].shape, spec.jnp_dtype))
    k = tuple(rand(keys[i]) for i in range(spec.num_layers))
    v = tuple(rand(keys[spec.num_layers + i]) for i in range(spec.num_layers))
    return state.replace(k=k, v=v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/jaxkv-ckpt")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--patches", type=int, default=999)
    args = ap.parse_args()
    spec = frame.FrameSpec(
        num_layers=args.layers,
        num_heads=16,
        head_dim=64,
        patches_per_frame=args.patches,
        num_special=6,
        scale_frames=8,
        sliding_window=64,
        max_frames=72,
    )
    state = filled_state(spec)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    saves, restores = [], []
    for i in range(args.iters + 1):
        path = root / f"c{i}"
        t0 = time.perf_counter()
        jaxkv.save(path, state)
        t1 = time.perf_counter()
        back = jaxkv.restore(path, like=state)
        jax.block_until_ready(back)
        t2 = time.perf_counter()
        del back
        shutil.rmtree(path)
        if i:  # the first is the warm-up (compiles the checksum)
            saves.append(t1 - t0)
            restores.append(t2 - t1)
    dev = jax.devices()[0]
    print(
        f"\ndevice: {getattr(dev, 'device_kind', dev.platform)}  jax {jax.__version__}  "
        f"cache {nbytes / 1e9:.2f} GB ({spec.num_layers} layers, {spec.capacity} rows)  dir {root}"
    )
    print(f"{'operation':<10} {'median s':>9} {'GB/s':>7}")
    for name, ts in (("save", saves), ("restore", restores)):
        t = statistics.median(ts)
        print(f"{name:<10} {t:9.2f} {nbytes / t / 1e9:7.2f}")
    t = statistics.median(s + r for s, r in zip(saves, restores))
    print(f"{'both':<10} {t:9.2f} {2 * nbytes / t / 1e9:7.2f}")


if __name__ == "__main__":
    main()
