"""The one timing loop the benchmark scripts share: wall clock around calls that synchronize."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax


def times_ms(fn, iters: int, warmup: int = 0) -> list[float]:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``iters`` times; return each call's ms.

    ``fn`` must block until its device work is done (``block_until_ready`` / a sync).
    """
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def copy_gbps(iters: int = 20) -> float:
    """The device's copy bandwidth, GB/s: a 1 GiB ``x + 0`` read and written, median of
    ``iters`` synchronized calls. The floor a memory-bound step is measured against."""
    import jax.numpy as jnp

    x = jnp.ones((1 << 29,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 0)
    ms = sorted(times_ms(lambda i: f(x).block_until_ready(), iters, warmup=3))[iters // 2]
    return 2 * x.nbytes / ms / 1e6


def kernel_ms_per_step(fn, steps: int, top: int = 0):
    """Sum of GPU kernel durations per step from a profiler trace (None if unavailable);
    with ``top``, also print the kernels that take the most time."""
    d = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(d):
            for i in range(steps):
                fn(i)
        files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            return None
        with gzip.open(files[0]) as f:
            tr = json.load(f)
        gpu_pids = {
            e["pid"]
            for e in tr.get("traceEvents", [])
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and "GPU" in str(e.get("args", {}).get("name", ""))
            and "host" not in str(e["args"]["name"]).lower()
        }
        events = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("pid") in gpu_pids]
        dur = sum(e.get("dur", 0) for e in events)
        if top:
            by = {}
            for e in events:
                k = by.setdefault(e.get("name", "?")[:70], [0, 0])
                k[0] += e.get("dur", 0)
                k[1] += 1
            print(f"top kernels over {steps} steps (us per step, launches per step):")
            for name, (d, cnt) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
                print(f"  {d / steps:8.1f} {cnt / steps:6.1f}  {name}")
            # XLA's own fusions, sorts and copies around the kernels: the glue a step still launches
            glue = [e for e in events if re.match(r"(loop|input|wrapped)_|sort|[Mm]emcpy|copy", e.get("name", ""))]
            print(
                f"  kernels per step: {len(events) / steps:.0f}; XLA's fusions, sorts and copies among them: "
                f"{len(glue) / steps:.0f}, {sum(e.get('dur', 0) for e in glue) / steps:.1f} us"
            )
        return dur / 1e3 / steps if dur else None
    except Exception as exc:  # the profiler is optional here: report, do not fail the benchmark
        print(f"(kernel time unavailable: {exc})")
        return None
