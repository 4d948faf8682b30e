"""ms per frame of a full 24-layer frame step (append + attention), jaxkv backends vs FlashInfer.

Contenders, side by side in one process on the same GPU, steady state (scale frames and
window full), random bf16 data, warm, median of many frames:

* jaxkv/<impl>: ``frame.append`` (all layers) + ``frame.attention`` per layer, one jitted
  step with the state donated; ``pallas`` (the prefix kernel, ``auto`` on Hopper),
  ``cuda`` (the same design in ``jaxkv/cuda/prefix_attention.cu``), ``cudnn`` (one cuDNN
  call with the key length) and ``xla``.
* jaxkv/cuda-fp8: the same step on an FP8 cache (``FrameSpec(dtype="float8_e4m3fn")``):
  the append quantizes as it writes (the cuda kernel, ``auto``), the cuda kernel reads the codes in place
  (``auto``); ``vs pallas`` compares it with the bf16 step of jaxkv/pallas.
  ``frame.append`` writes K/V with the Pallas kernel on a GPU (``impl="auto"``);
  jaxkv/cudnn+xla-append writes them with XLA's dynamic-update-slices instead.
* jaxkv/append-only(/xla, -fp8, -fp8/xla): the same step without attention (what the cache
  update costs; -fp8: an FP8 cache's, quantizing as it writes: ``auto`` is the cuda kernel,
  /xla XLA's fusions).
* moves/<impl>(-fp8): one page move alone (what ``begin_frame``, a commit or a rollback
  makes) in every layer's buffers and token_id: ``kernels.ref_move_rows`` (XLA, a slice and
  an update per buffer) against ``kernels.move_rows_cuda`` (one launch; ``auto`` on a GPU).
* cudnn/bare: ``jax.nn.dot_product_attention`` on 24 separate contiguous K/V arrays with
  the same key count, no cache update (a floor for the attention part).
* flashinfer/fa2, flashinfer/fa3: the seed's design — one page per frame, specials packed
  into pages, host-side page lists, ``plan()`` once per frame step, ``run()`` per layer
  over ``BatchPrefillWithPagedKVCacheWrapper`` (fa3 with power-of-two pages).

    python benchmarks/frame_step.py --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import kernel_ms_per_step, times_ms  # noqa: E402

from jaxkv import frame, kernels  # noqa: E402
from jaxkv.frame.state import ROW_BUFFERS  # noqa: E402

RES = {"224x224": 256, "518x378": 999}
# (name, frame.attention impl, K/V storage) of the jaxkv contenders
CONTENDERS = (
    ("jaxkv/pallas", "pallas", "bfloat16"),
    ("jaxkv/cuda", "cuda", "bfloat16"),
    ("jaxkv/cuda-fp8", "cuda", "float8_e4m3fn"),
    ("jaxkv/cudnn", "cudnn", "bfloat16"),
    ("jaxkv/xla", "xla", "bfloat16"),
)
HLO_DIR = os.environ.get("JAXKV_HLO_DIR")  # write the compiled step's HLO there, to look for copies
H, D, NS, S, W = 16, 64, 6, 8, 64


# ----------------------------------------------------------------------------- jaxkv
def _spec(P, L, kv_dtype, max_frames):
    return frame.FrameSpec(
        dtype=kv_dtype, num_layers=L, num_heads=H, head_dim=D, patches_per_frame=P, num_special=NS,
        scale_frames=S, sliding_window=W, max_frames=max_frames,
    )  # fmt: skip


def bench_jaxkv(P, L, impl, warm, iters, attend=True, top=0, append_impl="auto", kv_dtype="bfloat16"):
    spec = _spec(P, L, kv_dtype, max_frames=warm + iters + 8)
    key = jax.random.key(0)
    sets = []
    for i in range(3):
        ks = jax.random.split(jax.random.fold_in(key, i), 3)
        shape = (L, 1, spec.tokens_per_frame, H, D)
        sets.append(tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in ks))

    def step(state, k, v, q):
        state = frame.append(state, k, v, impl=append_impl)
        if not attend:
            return state, state.num_valid
        outs = [frame.attention(state, layer, q[layer], impl=impl) for layer in range(L)]
        return state, jnp.stack(outs)

    step = jax.jit(step, donate_argnums=0)
    box = {"state": frame.init(spec)}
    if HLO_DIR and attend:
        with open(os.path.join(HLO_DIR, f"step_{impl}_{P}.hlo.txt"), "w") as fh:
            fh.write(step.lower(box["state"], *sets[0]).compile().as_text())

    def one(i):
        box["state"], out = step(box["state"], *sets[i % 3])
        out.block_until_ready()

    for i in range(warm):
        one(i)
    ms = times_ms(one, iters)
    if top:
        kernel_ms_per_step(one, 5, top)
    visible = int(np.asarray(box["state"].num_valid)[0])
    box.clear()
    return ms, visible


def bench_moves(P, L, impl, iters, kv_dtype="bfloat16"):
    """One page move (page 0 to the trash page) in every row buffer of an L-layer cache."""
    spec = _spec(P, L, kv_dtype, max_frames=128)
    state = frame.init(spec)
    box = {"bufs": (*(x for name in ROW_BUFFERS for x in getattr(state, name)), state.token_id)}
    moves = jnp.asarray([[0, 0, spec.trash_row]], jnp.int32)
    move = kernels.move_rows_cuda if impl == "cuda" else kernels.ref_move_rows
    step = jax.jit(lambda bufs, m: move(bufs, m, rows=spec.page_size), donate_argnums=0)

    def one(i):
        box["bufs"] = step(box["bufs"], moves)
        jax.block_until_ready(box["bufs"])

    for i in range(5):
        one(i)
    return times_ms(one, iters)


def bench_bare_cudnn(P, L, visible, iters):
    T = visible + 512
    key = jax.random.key(1)
    ks = [jax.random.normal(jax.random.fold_in(key, i), (1, T, H, D), jnp.bfloat16) for i in range(L)]
    vs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (1, T, H, D), jnp.bfloat16) for i in range(L)]
    q = jax.random.normal(key, (L, 1, P + NS, H, D), jnp.bfloat16)
    n = jnp.array([visible], jnp.int32)

    @jax.jit
    def step(q, ks, vs, n):
        return jnp.stack(
            [
                jax.nn.dot_product_attention(q[l], ks[l], vs[l], key_value_seq_lengths=n, implementation="cudnn")
                for l in range(L)
            ]
        )

    for _ in range(3):
        step(q, ks, vs, n).block_until_ready()
    return times_ms(lambda i: step(q, ks, vs, n).block_until_ready(), iters)


# ----------------------------------------------------------------------------- FlashInfer (seed design)
class SeedStylePagedCache:
    """The seed's two-stream page design, written for this benchmark: one patch page per
    frame, specials packed into append-only pages, Python lists of page ids per layer."""

    def __init__(self, torch, flashinfer, L, P, max_frames, fa3):
        self.torch, self.L, self.P = torch, L, P
        self.ps = 1 << (P - 1).bit_length() if fa3 else P
        self.n_patch = S + W + 16
        n_pages = self.n_patch + -(-max_frames * NS // self.ps) + 16
        dev = "cuda"
        self.pools = [torch.zeros(n_pages, 2, self.ps, H, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
        self.scale = [[] for _ in range(L)]
        self.window = [[] for _ in range(L)]
        self.free = [list(range(self.n_patch)) for _ in range(L)]
        self.special_pages = [[] for _ in range(L)]
        self.free_special = [list(range(self.n_patch, n_pages)) for _ in range(L)]
        self.n_special = [0] * L
        self.ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.ws, kv_layout="NHD", backend="fa3" if fa3 else "fa2"
        )
        self.qo_indptr = torch.tensor([0, P + NS], dtype=torch.int32, device=dev)

    def append(self, l, k, v):
        pid = self.free[l].pop()
        self.pools[l][pid, 0, : self.P] = k[NS:]
        self.pools[l][pid, 1, : self.P] = v[NS:]
        (self.scale[l] if len(self.scale[l]) < S else self.window[l]).append(pid)
        written = 0
        while written < NS:
            off = self.n_special[l] % self.ps
            if off == 0:
                self.special_pages[l].append(self.free_special[l].pop())
            n = min(NS - written, self.ps - off)
            page = self.special_pages[l][-1]
            self.pools[l][page, 0, off : off + n] = k[written : written + n]
            self.pools[l][page, 1, off : off + n] = v[written : written + n]
            self.n_special[l] += n
            written += n
        while len(self.window[l]) > W:
            self.free[l].append(self.window[l].pop(0))

    def attention(self, l, q):
        torch = self.torch
        if l == 0:
            pages = self.scale[0] + self.window[0] + self.special_pages[0]
            tail = self.n_special[0] % self.ps
            last = self.P if not self.special_pages[0] else (tail or self.ps)
            self.wrapper.plan(
                self.qo_indptr,
                torch.tensor([0, len(pages)], dtype=torch.int32, device="cuda"),
                torch.tensor(pages, dtype=torch.int32, device="cuda"),
                torch.tensor([last], dtype=torch.int32, device="cuda"),
                num_qo_heads=H,
                num_kv_heads=H,
                head_dim_qk=D,
                page_size=self.ps,
                causal=False,
                pos_encoding_mode="NONE",
                q_data_type=torch.bfloat16,
            )
        return self.wrapper.run(q, self.pools[l])


def bench_flashinfer(P, L, fa3, warm, iters):
    import flashinfer
    import torch

    cache = SeedStylePagedCache(torch, flashinfer, L, P, warm + iters + 8, fa3)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [
        tuple(torch.randn(L, P + NS, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(3)
    ]

    def one(i):
        k, v, q = sets[i % 3]
        for l in range(L):
            cache.append(l, k[l], v[l])
            cache.attention(l, q[l])
        torch.cuda.synchronize()

    for i in range(warm):
        one(i)
    return times_ms(one, iters)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resolutions", default="224x224,518x378")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warm", type=int, default=80, help="frames before timing (fills scale + window)")
    p.add_argument("--iters", type=int, default=40, help="timed frames per contender")
    p.add_argument("--skip", default="", help="comma-separated contenders to skip")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}  jax {jax.__version__}", flush=True)
    rows = []

    def record(res, name, ms, visible):
        row = dict(
            resolution=res,
            contender=name,
            median_ms=statistics.median(ms),
            p10_ms=float(np.percentile(ms, 10)),
            p90_ms=float(np.percentile(ms, 90)),
            visible_keys=visible,
            n=len(ms),
        )
        rows.append(row)
        print(
            f"  {res} {name:<20} {row['median_ms']:8.2f} ms/frame  (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})",
            flush=True,
        )

    for res in args.resolutions.split(","):
        P = RES[res]
        visible = None
        for name, impl, kv_dtype in CONTENDERS:
            if name in skip:
                continue
            ms, visible = bench_jaxkv(P, args.layers, impl, args.warm, args.iters, kv_dtype=kv_dtype)
            record(res, name, ms, visible)
        if "jaxkv/cudnn+xla-append" not in skip:
            ms, _ = bench_jaxkv(P, args.layers, "cudnn", args.warm, args.iters, append_impl="xla")
            record(res, "jaxkv/cudnn+xla-append", ms, visible)
        for append_impl in ("auto", "xla"):
            ms, vis = bench_jaxkv(P, args.layers, "cudnn", args.warm, args.iters, attend=False, append_impl=append_impl)
            record(res, "jaxkv/append-only" + ("" if append_impl == "auto" else "/xla"), ms, vis)
        for append_impl in ("auto", "xla"):
            name = "jaxkv/append-only-fp8" + ("" if append_impl == "auto" else "/xla")
            if name not in skip:
                ms, vis = bench_jaxkv(
                    P, args.layers, "xla", args.warm, args.iters, attend=False, append_impl=append_impl,
                    kv_dtype="float8_e4m3fn",
                )  # fmt: skip
                record(res, name, ms, vis)
        visible = visible or vis
        for impl in ("xla", "cuda"):
            for kv_dtype, tag in (("bfloat16", ""), ("float8_e4m3fn", "-fp8")):
                if f"moves/{impl}{tag}" not in skip:
                    record(res, f"moves/{impl}{tag}", bench_moves(P, args.layers, impl, args.iters, kv_dtype), 0)
        if "cudnn/bare" not in skip:
            record(res, "cudnn/bare", bench_bare_cudnn(P, args.layers, visible, args.iters), visible)
        for fa3 in (False, True):
            name = f"flashinfer/{'fa3' if fa3 else 'fa2'}"
            if name in skip:
                continue
            try:
                record(res, name, bench_flashinfer(P, args.layers, fa3, args.warm, args.iters), visible)
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                print(f"  {res} {name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    print(
        f"\nframe step, {args.layers} layers, H={H}, D={D}, S={S}, W={W}, bf16 queries (K/V bf16 unless -fp8) — {dev.device_kind}, "
        f"median of {args.iters} frames after {args.warm}"
    )
    print(
        f"{'resolution':<10} {'contender':<20} {'ms/frame':>9} {'vs pallas':>9} {'vs fa2':>7} {'vs fa3':>7} {'keys':>7}"
    )
    for r in rows:
        base = {c: x["median_ms"] for x in rows if x["resolution"] == r["resolution"] for c in [x["contender"]]}
        pal, fa2, fa3 = base.get("jaxkv/pallas"), base.get("flashinfer/fa2"), base.get("flashinfer/fa3")
        f = lambda b, w=7: f"{r['median_ms'] / b:{w}.2f}" if b else " " * (w - 1) + "-"  # noqa: E731
        print(
            f"{r['resolution']:<10} {r['contender']:<20} {r['median_ms']:9.2f} {f(pal, 9)} {f(fa2)} {f(fa3)} "
            f"{r['visible_keys']:>7}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
