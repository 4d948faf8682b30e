"""The one timing loop the benchmark scripts share: wall clock around calls that synchronize."""

from __future__ import annotations

import time


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
