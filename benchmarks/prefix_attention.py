"""One layer of a frame's attention over the visible prefix, every kernel that can do it.

The shapes of lingbot-map's global attention with 72 frames visible (16 heads, head_dim 64,
bf16): 518x378 (1005 queries over 72,648 keys) and 224x224 (262 over 19,152). Contenders,
in one process on the same random data:

* ``cuda (block_kv, stages)``: ``jaxkv/cuda/prefix_attention.cu`` launched from torch
  (``torch_bridge.kernels.prefix_attention``, what the drop-in's ``backend="cuda"`` runs),
  every launch shape it builds, with ``launch.prefix_cuda_splits``' key splits;
* ``cuda fp8 (block_kv, stages)``: the same kernel over an FP8 cache's codes and scales
  (``torch_bridge.fp8.quantize_rows`` of the same K/V), read in place;
* ``flashinfer fa2 / fa3``: ``flashinfer.single_prefill_with_kv_cache`` over the same prefix
  (the drop-in's ``backend="flashinfer"``), when importable;
* ``jax mosaic`` / ``jax cuda``: ``kernels.prefix_attention`` (Mosaic GPU) and
  ``kernels.prefix_attention_cuda`` on JAX copies of the data, with ``prefix_splits``.

torch contenders: CUDA events around 20 back-to-back calls, per call, median of ``--iters``
after warm-up (the host runs ahead, so Python's per-call cost is hidden where it is shorter). JAX
contenders: kernel time from a profiler trace (``_timing.kernel_ms_per_step``). TFLOP/s
counts 4 Tq n H D.

    cd benchmarks && python prefix_attention.py [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import torch

from jaxkv.kernels.launch import prefix_cuda_splits
from torch_bridge import fp8, kernels

SHAPES = {"518x378": (1005, 72648), "224x224": (262, 19152)}
H, D = 16, 64
LAUNCHES = ((128, 2), (128, 4), (192, 2), (192, 3))


def event_ms(fn, iters: int, warm: int = 5, calls: int = 20) -> float:
    """Median over ``iters`` of CUDA-event time around ``calls`` back-to-back calls, per call:
    the host launches ahead of the GPU, so the figure is GPU time, not Python's."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def jax_rows(q, k, v, n):
    import jax
    import jax.numpy as jnp
    from _timing import kernel_ms_per_step

    from jaxkv.kernels import prefix_attention, prefix_attention_cuda
    from jaxkv.kernels.launch import prefix_splits

    qj, kj, vj = (jnp.asarray(x.float().cpu().numpy(), jnp.bfloat16)[None] for x in (q, k, v))
    nj = jnp.asarray([n], jnp.int32)
    splits = prefix_splits(q.shape[0], H, k.shape[0])
    out = {}
    for name, fn in (("jax mosaic", prefix_attention), ("jax cuda", prefix_attention_cuda)):
        call = lambda i, fn=fn: jax.block_until_ready(fn(qj, kj, vj, nj, splits=splits))  # noqa: E731
        call(0)
        result = np.asarray(fn(qj, kj, vj, nj, splits=splits)[0], np.float32)
        out[f"{name} (splits {splits})"] = (kernel_ms_per_step(call, 10), result)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-jax", action="store_true")
    args = p.parse_args(argv)
    if not kernels.prefix_attention_available("cuda"):
        sys.exit("needs an sm_90 GPU and nvcc (jaxkv/cuda/prefix_attention.cu)")
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}  flashinfer "
        f"{'yes' if flashinfer else 'no'}",
        flush=True,
    )
    rows = []
    for shape in args.shapes:
        Tq, n = SHAPES[shape]
        T = -(-n // 1024) * 1024
        g = torch.Generator(device="cuda").manual_seed(0)
        k, v = (torch.randn((T, H, D), generator=g, device="cuda").bfloat16() for _ in range(2))
        q = torch.randn((Tq, H, D), generator=g, device="cuda").bfloat16()
        flop = 4 * Tq * n * H * D
        splits = prefix_cuda_splits(Tq, H, n, sms)
        ref = kernels.prefix_attention(q, k[:n], v[:n], n, splits=splits)
        found = {}
        for launch in LAUNCHES:
            name = f"cuda {launch} (splits {splits})"
            fn = lambda launch=launch: kernels.prefix_attention(q, k[:n], v[:n], n, splits=splits, launch=launch)  # noqa: E731
            found[name] = (event_ms(fn, args.iters), fn())
        kq, ks = fp8.quantize_rows(k)
        vq, vs = fp8.quantize_rows(v)
        for launch in LAUNCHES:
            run = kernels.PrefixAttention(q.device, H, H, launch=launch)
            run.plan(Tq, n, splits)
            fn = lambda run=run: run.run(q, kq, vq, k_scale=ks, v_scale=vs)  # noqa: E731
            try:
                found[f"cuda fp8 {launch} (splits {splits})"] = (event_ms(fn, args.iters), fn())
            except ValueError as e:  # a launch shape FP8 storage does not build
                print(f"  {shape} cuda fp8 {launch}: {e}", flush=True)
        if flashinfer is not None:
            for backend in ("fa2", "fa3"):
                fn = (
                    lambda backend=backend: flashinfer.single_prefill_with_kv_cache(  # noqa: E731
                        q, k[:n], v[:n], causal=False, kv_layout="NHD", backend=backend
                    )
                )
                found[f"flashinfer {backend}"] = (event_ms(fn, args.iters), fn())
        if not args.no_jax:
            found.update(jax_rows(q, k, v, n))
        want = ref.float().cpu().numpy()
        for name, (ms, out) in found.items():
            got = out.float().cpu().numpy() if isinstance(out, torch.Tensor) else out
            diff = float(np.abs(got - want).max())
            rows.append((shape, name, ms, flop / ms / 1e9, diff))
            print(f"  {shape} {name}: {ms:.4f} ms", flush=True)
    print("\n| shape | contender | ms | TFLOP/s | max abs diff vs the first |\n| --- | --- | ---: | ---: | ---: |")
    for shape, name, ms, tflops, diff in rows:
        print(f"| {shape} | {name} | {ms:.4f} | {tflops:.0f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
