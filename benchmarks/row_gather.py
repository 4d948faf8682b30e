"""How fast can an H100 read DeepSeek-V4's scattered pool rows at all, and with how many loads in
flight? The ``cuda`` pool attention reads each key's row (576 bytes of FP8 codes + BF16 rope,
64-byte aligned, and 8 scale bytes elsewhere) from wherever the top-k put it, and its target
is a share of copy bandwidth (docs/kernels/pool_attention.md). This script reads the same
pattern and nothing else (``row_gather.cu``, built on first use into the cache directory), so
the figures say what the memory system gives such rows for a given loader:

* ``by thread``: the attention producer's layout (four threads per row, nine 16-byte loads
  each, the next group's row ids one group ahead) with 128 to 512 threads per SM and 1 to 4
  rows per thread in flight; ``128 threads x 2 rows`` is the 64-head kernel's producer;
* ``bulk copy``: one TMA bulk copy (``cp.async.bulk``) per row into shared memory, two stages
  of G rows;
* ``xla take``: XLA's gather of the same rows (it also writes them), and ``copy``: ``x + 0``
  over 1 GiB (read + write), whose GB/s is the copy bandwidth of the ``of copy`` column.

``--beside``: instead, loaders of one warpgroup (the producer's, other load instructions, bulk
copies) with a second warpgroup in the CTA that runs the 64-head attention's Q K^T-shaped
``wgmma`` products over 128 KiB of shared memory while they load: never (``idle``), back to
back (``busy``), with a 2 us pause after each (``part``), or back to back with A from registers
(half the shared-memory reads). Whether the tensor cores' reads of shared memory slow the loads,
which take longer inside the attention than alone.

The rows: V4-Flash decode at batch B, each request's 512 top-k rows at random in a 1 GiB area
and its 128 window rows contiguous (as ``dsv4_attention.py`` picks them), the same rows on every
call as there (at batch 64, 24 MB: they may partly stay in the 50 MB L2 between calls, for both
scripts). GB/s counts the bytes read (584 per row); kernel time from a profiler trace, median of
three rounds of 20 calls.

    PYTHONPATH=$PWD python benchmarks/row_gather.py [--batches 64,128] [--beside]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import kernel_ms_per_step  # noqa: E402

from jaxkv.cuda.build import kernel_flags, shared_library, source_dir  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_gather.cu")
ROW, SCALE = 576, 8
SMS = 132  # H100 SXM
# (label, mode, rows per thread or per group, threads per CTA, CTAs per SM[, load variant, products' duty])
LOADERS = [
    ("by thread", 0, 2, 128, 1),  # the 64-head attention producer's shape
    ("by thread", 0, 1, 128, 1),
    ("by thread", 0, 4, 128, 1),
    ("by thread", 0, 1, 256, 1),
    ("by thread", 0, 2, 256, 1),
    ("by thread", 0, 1, 512, 1),
    ("by thread", 0, 1, 256, 2),
    ("bulk copy", 1, 32, 128, 1),
    ("bulk copy", 1, 64, 128, 1),
    ("bulk copy", 1, 128, 128, 1),
    ("bulk copy", 1, 64, 128, 2),
]
LOADS = {0: "producer's ld", 1: "plain ld", 2: "ld no L1"}  # row_gather.cu's ld_variant
DUTY = {0: "idle", 1: "busy", 2: "part", 3: "busy, A in registers"}
BESIDE = [("by thread", 2, 2, 256, 1, 0, busy) for busy in (0, 1, 2)] + [
    ("by thread", 2, 1, 256, 1, 0, 0),
    ("by thread", 2, 1, 256, 1, 0, 1),
    ("by thread", 2, 2, 256, 1, 1, 0),
    ("by thread", 2, 2, 256, 1, 1, 1),
    ("by thread", 2, 2, 256, 1, 2, 0),
    ("by thread", 2, 2, 256, 1, 2, 1),
    ("bulk copy", 3, 64, 256, 1, 0, 0),
    ("bulk copy", 3, 64, 256, 1, 0, 1),
    ("bulk copy", 3, 64, 256, 1, 0, 2),
    ("by thread", 2, 2, 256, 1, 0, 3),
    ("bulk copy", 3, 64, 256, 1, 0, 3),
]


def library() -> str:
    """row_gather.cu (it includes jaxkv's ptx.cuh) built by jaxkv.cuda.build into its cache."""
    return str(
        shared_library("bench", "row_gather.so", [SOURCE], kernel_flags("90a"), headers=[source_dir() / "ptx.cuh"])
    )


def row_ids(B: int, M: int, K: int = 512, W: int = 128):
    """i32[B * (K + W)]: per request K random rows of M and W contiguous window rows."""
    r = np.random.default_rng(B)
    picked = np.stack([r.choice(M, K, replace=False) for _ in range(B)])
    home = r.permutation(M // W)[:B] * W
    return jnp.asarray(np.concatenate([picked, home[:, None] + np.arange(W)[None]], 1).reshape(-1).astype(np.int32))


def median_kernel_ms(fn):
    jax.block_until_ready(fn())
    return statistics.median(kernel_ms_per_step(lambda i: jax.block_until_ready(fn()), 20) for _ in range(3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--beside", action="store_true", help="the loaders beside the attention's products (docstring)")
    a = ap.parse_args()
    jax.ffi.register_ffi_target("row_gather", jax.ffi.pycapsule(ctypes.CDLL(library()).RowGather), platform="CUDA")
    M = (1 << 30) // ROW
    codes = jax.random.bits(jax.random.key(0), (M, ROW // 4), jnp.uint32)  # u32[M, 144]: the rows' codes + rope
    scales = jax.random.bits(jax.random.key(1), (M, SCALE // 4), jnp.uint32)  # u32[M, 2]
    x = jnp.ones(((1 << 30) // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + 0)
    copy_gbs = (2 << 30) / median_kernel_ms(lambda: copy(x)) / 1e6
    take = jax.jit(lambda c, s, i: (jnp.take(c, i, axis=0), jnp.take(s, i, axis=0)))
    rows_out = []
    for B in (int(b) for b in a.batches.split(",")):
        ids = row_ids(B, M)
        n = ids.shape[0]
        read = n * (ROW + SCALE)
        for label, mode, rows, threads, per_sm, ld, busy in ((*x, 0, 0)[:7] for x in (BESIDE if a.beside else LOADERS)):
            ctas = SMS * per_sm
            f = jax.jit(
                lambda c, s, i, mode=mode, rows=rows, threads=threads, ctas=ctas, ld=ld, busy=busy: jax.ffi.ffi_call(
                    "row_gather", jax.ShapeDtypeStruct((ctas * threads * 4,), jnp.uint32)
                )(
                    i,
                    c,
                    s,
                    mode=np.int32(mode),
                    rows=np.int32(rows),
                    threads=np.int32(threads),
                    ctas=np.int32(ctas),
                    ld=np.int32(ld),
                    busy=np.int32(busy),
                )
            )
            ms = median_kernel_ms(lambda: f(codes, scales, ids))
            loaders = threads if mode < 2 else 128
            in_flight = (rows * loaders // 4 if mode in (0, 2) else 2 * rows) * per_sm  # rows per SM, at most
            what = (
                f"{per_sm} x {loaders // 32} warps/SM, {rows} row{'s' if rows > 1 else ''}/thread"
                if mode in (0, 2)
                else f"{per_sm} CTA/SM, 2 x {rows} rows"
            )
            if mode >= 2:
                what = f"{what}, {LOADS[ld] + ', ' if mode == 2 else ''}{DUTY[busy]}"
            rows_out.append((B, label, what, in_flight * (ROW + SCALE) / 1024, ms, read / ms / 1e6))
            print(rows_out[-1], flush=True)
        ms = median_kernel_ms(lambda: take(codes, scales, ids))
        rows_out.append((B, "xla take", "gather + write", float("nan"), ms, read / ms / 1e6))
    print(f"\n{jax.devices()[0].device_kind}; copy bandwidth {copy_gbs:.0f} GB/s (x + 0 over 1 GiB, read + write)")
    print(
        f"{'B':>4} {'loader':10} {'shape':50} {'KiB/SM in flight':>16} {'kernel ms':>9} {'GB/s read':>9} {'of copy':>7}"
    )
    for B, label, what, kib, ms, gbs in rows_out:
        print(f"{B:4d} {label:10} {what:50} {kib:16.1f} {ms:9.4f} {gbs:9.0f} {gbs / copy_gbs:7.2f}")


if __name__ == "__main__":
    main()
