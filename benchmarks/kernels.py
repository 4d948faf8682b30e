"""The kernels against the XLA path of the same operation, and against copy bandwidth.

For each kernel: the bytes it must move, its time (warm, median), achieved GB/s and the
fraction of the device-to-device copy bandwidth measured in the same run (a 1 GiB
``x + 0`` copy: read + write), against the jnp/XLA reference jitted the same way.

    python benchmarks/kernels.py --json kernels.json

Kernels so far: frame append (24 layers, one stream, lingbot-map shapes at 224x224 and
518x378; the cache buffers are sized as ``FrameSpec`` would for 8 + 64 frames); MXFP4
and NVFP4 (one global scale per key) packing of float32 128-dim indexer keys (2M and 64K keys); the CSA flush-write (entries +
indexer keys into a 64-entry-block pool, both storage families) of 4,096 and 65,536
requests: jnp (xla) against the ``cuda/`` kernel through jax.ffi (cuda); one decode step's
CSA / HCA append + flush of 4,096 and 16,384 requests that all complete a window, both
storage families: the XLA path and the fused cuda/ kernel. With ``--triton DIR`` the
Pallas Triton-lowered kernels they replaced run beside them ('triton').
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _timing import copy_gbps, kernel_ms_per_step, times_ms  # noqa: E402

from jaxkv import frame  # noqa: E402
from jaxkv.formats.storage import STORAGES  # noqa: E402
from jaxkv.hybrid import flush as F  # noqa: E402
from jaxkv.kernels import fp4_pack, frame_append  # noqa: E402
from jaxkv.kernels.dequant_gather import dequant_gather as _dg  # noqa: E402
from jaxkv.kernels.dequant_gather import ref_dequant_gather  # noqa: E402

KERNEL_MS = {}  # (operation, impl) -> GPU kernel time per call from a profiler trace
TRITON_DIR = None  # --triton: a directory of the pre-port kernel modules


def triton_kernels(name):
    """The pre-port (Pallas Triton lowering) module ``name`` from ``--triton DIR``, or None."""
    if not TRITON_DIR:
        return None
    import importlib.util

    if TRITON_DIR not in sys.path:
        sys.path.insert(0, TRITON_DIR)  # the modules import the tuning table of their commit beside them
    spec = importlib.util.spec_from_file_location(f"triton_{name}", os.path.join(TRITON_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_frame_append(P, L, iters):
    spec = frame.FrameSpec(
        num_layers=L,
        num_heads=16,
        head_dim=64,
        patches_per_frame=P,
        num_special=6,
        scale_frames=8,
        sliding_window=64,
        max_frames=128,
    )
    hd = spec.num_heads * spec.head_dim
    key = jax.random.key(0)
    k = jax.random.normal(key, (L, 1, spec.tokens_per_frame, hd), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, jnp.bfloat16)
    sr = jnp.asarray([spec.trash_row - 2 * spec.tokens_per_frame], jnp.int32)
    pr = jnp.asarray([17 * spec.page_size], jnp.int32)
    moved = 2 * 2 * k.nbytes  # read the frame, write it (K and V)
    kw = dict(num_special=spec.num_special, page_size=spec.page_size)
    contenders = [("xla", jax.jit(functools.partial(frame_append.ref_write_frame, **kw), donate_argnums=(0, 1)))]
    if jax.default_backend() == "gpu":
        contenders.append(("pallas", functools.partial(frame_append.write_frame, **kw)))
        if (old := triton_kernels("frame_append")) is not None:
            contenders.append(("triton", functools.partial(old.write_frame, **kw)))
    rows, outs = [], {}
    op = f"frame append {P + 6} tok x {L} layers"
    for name, fn in contenders:
        box = {"b": tuple(tuple(jnp.zeros((1, spec.capacity, hd), jnp.bfloat16) for _ in range(L)) for _ in range(2))}

        def one(i):
            box["b"] = fn(*box["b"], k, v, sr, pr)
            jax.block_until_ready(box["b"])

        for i in range(3):
            one(i)
        rows.append((op, name, moved, statistics.median(times_ms(one, iters))))
        if jax.default_backend() == "gpu":
            KERNEL_MS[op, name] = kernel_ms_per_step(one, 10)
        outs[name] = jax.device_get(box["b"][0][0][0, : int(pr[0]) + spec.page_size])
        box.clear()
    for name in outs:  # every writer leaves the same bytes
        assert (outs[name] == outs["xla"]).all(), f"frame append: {name} differs from xla"
    return rows


def _fp4_contenders(name, ref):
    """xla (the format's jnp), cuda (``kernels.fp4_pack``) and, with --triton, the Pallas kernel it replaced."""
    out = [("xla", ref), ("cuda", getattr(fp4_pack, name))]
    if (old := triton_kernels("fp4_pack")) is not None:
        out.append(("triton", functools.partial(getattr(old, name), interpret=False)))
    return out


def bench_mxfp4(n, iters):
    x = jax.random.normal(jax.random.key(2), (n, 128), jnp.float32)
    moved = x.nbytes + n * (64 + 4)
    rows, outs = [], {}
    op = f"mxfp4 pack {n} keys x 128"
    for name, fn in _fp4_contenders("quantize_mxfp4", jax.jit(fp4_pack.ref_quantize_mxfp4)):
        outs[name] = jax.device_get(fn(x))
        one = lambda i: jax.block_until_ready(fn(x))  # noqa: E731
        rows.append((op, name, moved, statistics.median(times_ms(one, iters))))
        KERNEL_MS[op, name] = kernel_ms_per_step(one, 10)
    for name in outs:  # every contender gives the same bytes
        assert all((a == b).all() for a, b in zip(outs[name], outs["xla"])), f"mxfp4: {name} differs"
    return rows


def bench_nvfp4(n, iters):
    """NVFP4 with one global scale per key (the per_entry storage family's indexer keys)."""
    from jaxkv.formats import nvfp4_global_scale

    x = jax.random.normal(jax.random.key(2), (n, 128), jnp.float32)
    g = jax.vmap(nvfp4_global_scale)(x)
    moved = x.nbytes + g.nbytes + n * (64 + 8)
    rows, outs = [], {}
    op = f"nvfp4 pack {n} keys x 128"
    for name, fn in _fp4_contenders("quantize_nvfp4", jax.jit(jax.vmap(fp4_pack.ref_quantize_nvfp4))):
        outs[name] = [a.view("uint8") for a in jax.device_get(fn(x, g)[:2])]
        one = lambda i: jax.block_until_ready(fn(x, g))  # noqa: E731
        rows.append((op, name, moved, statistics.median(times_ms(one, iters))))
        KERNEL_MS[op, name] = kernel_ms_per_step(one, 10)
    for name in outs:
        assert all((a == b).all() for a, b in zip(outs[name], outs["xla"])), f"nvfp4: {name} differs"
    return rows


def bench_flush_write(n, storage, iters):
    fmt = STORAGES[storage]
    bs, nb = 64, 2 * n // 64
    kb = fmt.index_key_bytes(128)
    key = jax.random.key(3)
    x = jax.random.normal(key, (n, 512), jnp.bfloat16)
    xi = jax.random.normal(jax.random.fold_in(key, 1), (n, 128), jnp.bfloat16)
    cells = jax.random.permutation(jax.random.fold_in(key, 2), nb * bs)[:n].astype(jnp.int32)
    block, slot = cells // bs, cells % bs
    moved = n * (x.shape[1] * 2 + xi.shape[1] * 2 + 8 + fmt.entry_bytes + kb)
    rows, outs = [], {}
    impls = [("xla", F.ref_flush_write), ("cuda", F.flush_write_cuda)]
    if (old := triton_kernels("flush_write")) is not None:
        impls.append(("triton", functools.partial(old.flush_write, interpret=False)))
    for name, fn in impls:
        f = jax.jit(functools.partial(fn, layer=0, storage=storage), donate_argnames=("pool", "index_pool"))
        box = {"p": (jnp.zeros((1, nb, bs * fmt.entry_bytes), jnp.uint8), jnp.zeros((1, nb, bs * kb), jnp.uint8))}

        def one(i):
            box["p"] = f(box["p"][0], x=x, block=block, slot=slot, index_pool=box["p"][1], xi=xi)
            jax.block_until_ready(box["p"])

        for i in range(3):
            one(i)
        op = f"CSA flush-write {n} x {storage}"
        rows.append((op, name, moved, statistics.median(times_ms(one, iters))))
        KERNEL_MS[op, name] = kernel_ms_per_step(one, 10)
        outs[name] = jax.device_get(box.pop("p"))
    for name in outs:  # every writer leaves the same bytes
        assert all((a == b).all() for a, b in zip(outs[name], outs["xla"])), f"flush-write: {name} differs"
    return rows


def bench_fused_flush(n, ratio, iters, storage="official"):
    """One decode step's compressor update of one CSA (ratio 4) or HCA (128) layer for ``n``
    requests that all complete a window: ``hybrid.compress`` with the XLA path (jnp
    pooling + jnp write) and the fused ``cuda/`` kernel (``kernels.compress_decode``: append
    + pool + norm + rope + quantize + scatter), and with --triton the fused Pallas kernel it
    replaced, put in its place. Prints the fraction of entry bytes equal to xla's."""
    from jaxkv import hybrid as H
    from jaxkv.hybrid import ops

    csa = ratio == 4
    cfg = H.HybridConfig(
        compress_ratios=(ratio,), max_requests=n, max_context=2 * ratio, block_size=64, storage=storage
    )
    fmt = STORAGES[storage]
    key = jax.random.key(5)
    ks = jax.random.split(key, 8)
    coff = 2 if csa else 1
    kv = jax.random.normal(ks[0], (n, 1, coff * 512))
    score = jax.random.normal(ks[1], (n, 1, coff * 512))
    params = H.CompressorParams(
        jax.random.normal(ks[2], (ratio, coff * 512)), 1 + 0.1 * jax.random.normal(ks[3], (512,))
    )
    index = None
    if csa:
        index = (
            jax.random.normal(ks[4], (n, 1, 256)),
            jax.random.normal(ks[5], (n, 1, 256)),
            H.CompressorParams(jax.random.normal(ks[6], (ratio, 256)), 1 + 0.1 * jax.random.normal(ks[7], (128,))),
        )
    slots = jnp.arange(n, dtype=jnp.int32)
    pos = jnp.full((n,), ratio - 1, jnp.int32)  # every request completes window 0
    streams, width = (3, 640) if csa else (1, 512)
    # f32 inputs; tails read and written (CSA: 3 streams); entry (+ key) written
    moved = n * (
        4 * (kv.shape[-1] + score.shape[-1])
        + (2 * 256 * 4 if csa else 0)
        + 2 * streams * 3 * width * 4
        + fmt.entry_bytes
        + (fmt.index_key_bytes(128) if csa else 0)
    )
    rows, entries = [], {}
    op = f"{'CSA' if csa else 'HCA'} decode append+flush {n} {storage}"
    fused = ops.compress_decode
    old = triton_kernels("compress_decode")
    for name in ("xla", "cuda") + (("triton",) if old is not None else ()):
        ops.compress_decode = functools.partial(old.compress_decode, interpret=False) if name == "triton" else fused
        jax.clear_caches()  # hybrid.compress is jitted: trace it again with the kernel in place
        state = H.init(cfg)
        state, step = H.prepare_forward(state.replace(position=pos + 0), slots, pos, chunk=1)
        f = jax.jit(functools.partial(H.compress, layer=0, impl="xla" if name == "xla" else "cuda"), donate_argnums=0)
        box = {"s": state}

        def one(i):
            box["s"] = f(box["s"], step, kv=kv, score=score, params=params, index=index)
            box["s"].error.block_until_ready()

        for i in range(3):
            one(i)
        rows.append((op, name, moved, statistics.median(times_ms(one, iters))))
        KERNEL_MS[op, name] = kernel_ms_per_step(one, 10)
        entries[name] = jax.device_get(box.pop("s").entries[0])
    ops.compress_decode = fused
    jax.clear_caches()
    for name in entries:
        print(f"{op}: {name} entry bytes equal to xla's: {(entries[name] == entries['xla']).mean():.5f}")
    return rows


def bench_dequant_gather(tokens, top_k, iters, storage="official"):
    """``tokens`` query tokens selecting ``top_k`` entries each, all distinct, at random
    from a ~610 MB pool (12x the H100's L2)."""
    nb, bs = 16384, 64
    E = STORAGES[storage].entry_bytes
    key = jax.random.key(4)
    pool = jax.random.randint(key, (1, nb, bs * E), 0, 256, jnp.int32).astype(jnp.uint8)
    m = tokens * top_k
    cells = jax.random.permutation(jax.random.fold_in(key, 1), nb * bs)[:m]  # distinct entries
    block, slot = (cells // bs).astype(jnp.int32), (cells % bs).astype(jnp.int32)
    moved = m * (E + 8 + 1024)
    rows = []
    ref = jax.jit(functools.partial(ref_dequant_gather, storage=storage), static_argnums=1)
    contenders = [("xla", ref), ("cuda", functools.partial(_dg, storage=storage))]
    if (old := triton_kernels("dequant_gather")) is not None:
        contenders.append(("triton", functools.partial(old.dequant_gather, storage=storage)))
    outs = {}
    for name, fn in contenders:
        outs[name] = jax.device_get(fn(pool, 0, block, slot))
        one = lambda i: fn(pool, 0, block, slot).block_until_ready()  # noqa: E731
        op = f"dequant-gather {tokens} tok x top-{top_k} {storage}"
        rows.append((op, name, moved, statistics.median(times_ms(one, iters))))
        KERNEL_MS[op, name] = kernel_ms_per_step(one, 10)
    for name in outs:  # every contender gives the same values
        assert (outs[name].view("uint16") == outs["xla"].view("uint16")).all(), f"dequant-gather: {name} differs"
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--only",
        default="",
        help="run only the kernels whose name contains this (append, mxfp4, nvfp4, dequant, flush, fused)",
    )
    p.add_argument(
        "--triton",
        default=None,
        help="a directory holding the kernels' pre-port modules (Pallas Triton "
        "lowering: git show 32ce0a0:jaxkv/kernels/NAME.py for frame_append and dequant_gather, "
        "2e0b118 for fp4_pack, flush_write, compress_decode and their codes.py and division.py, "
        "imports of jaxkv.kernels.{codes,division,tuning} pointed at those files beside them, the "
        "tuning table as triton_tuning.py), run as the 'triton' contender",
    )
    args = p.parse_args(argv)
    global TRITON_DIR
    TRITON_DIR = args.triton
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    copy = copy_gbps(args.iters)
    print(f"device: {dev.device_kind}  jax {jax.__version__}  copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    want = lambda name: args.only in name  # noqa: E731
    for P in (256, 999) if want("append") else ():
        rows += bench_frame_append(P, args.layers, args.iters)
    for n in (1 << 21, 1 << 16) if not interpret and want("mxfp4") else ():  # the cuda/ kernels need a GPU
        rows += bench_mxfp4(n, args.iters)
    for n in (1 << 21, 1 << 16) if not interpret and want("nvfp4") else ():
        rows += bench_nvfp4(n, args.iters)
    if not interpret and want("dequant"):
        for tokens, k in ((64, 512), (256, 512), (256, 1024)):
            rows += bench_dequant_gather(tokens, k, args.iters)
        rows += bench_dequant_gather(256, 512, args.iters, "per_entry")
    if not interpret and want("fused"):
        for storage in ("official", "per_entry"):
            for n in (4096, 16384):
                for ratio in (4, 128):
                    rows += bench_fused_flush(n, ratio, args.iters, storage)
    if not interpret and want("flush"):
        for n in (4096, 65536):
            for storage in ("official", "per_entry"):
                rows += bench_flush_write(n, storage, args.iters)
    print(f"\n{'operation':<36} {'impl':<7} {'MB moved':>9} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'vs xla':>7}")
    out = []
    for op, impl, nbytes, ms in rows:
        xla = next(m for o, i, _, m in rows if o == op and i == "xla")
        gbps = nbytes / ms / 1e6
        out.append(dict(operation=op, impl=impl, bytes=nbytes, ms=ms, gbps=gbps, of_copy=gbps / copy))
        print(f"{op:<36} {impl:<7} {nbytes / 1e6:9.1f} {ms:8.3f} {gbps:8.0f} {gbps / copy:8.2f} {xla / ms:7.2f}")
    if KERNEL_MS:
        print(
            f"\nGPU kernel time only (profiler, 10 calls), same bytes:\n{'operation':<36} {'impl':<7} {'ms':>8} "
            f"{'GB/s':>8} {'of copy':>8}"
        )
        for (op, impl), ms in KERNEL_MS.items():
            nbytes = next(b for o, i, b, _ in rows if o == op and i == impl)
            if ms:
                print(f"{op:<36} {impl:<7} {ms:8.4f} {nbytes / ms / 1e6:8.0f} {nbytes / ms / 1e6 / copy:8.2f}")
                next(r for r in out if r["operation"] == op and r["impl"] == impl)["kernel_ms"] = ms
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__, copy_gbps=copy, rows=out), fh, indent=1)


if __name__ == "__main__":
    main()
