"""Tuning constants of the frame cache, as data; chosen by sweeps whose figures are in
``benchmarks/RESULTS.md`` ("Launch-parameter sweeps") or by the measurements quoted here."""

import jax

# Platforms where XLA reads a ``cond`` / ``while`` predicate on the host: a sync in the
# frame step (XLA GPU). There the frame ops avoid data-dependent control flow: a frame's
# row moves always run (to the trash rows when not needed) and the ``xla`` attention of a
# few queries takes one masked pass over the whole buffer. Measured on an H100 at 518x378
# (lingbot-map port, 1.16 B parameters): host time per step 34 -> 16 ms, pipelined step
# 42 -> 29 ms. On a CPU the branches are free and the branch-free forms cost more (the
# same port at 1/8 size: 133 -> 241 ms per frame).
SYNCING_CONTROL_FLOW = ("gpu",)

# ``xla`` backend where control flow syncs: at most this many queries per KV head (tokens
# x GQA group) take the one-pass form, ``math.ref_attention`` (it reads every row). The step
# figures above were taken with a product-and-sum form of the same pass; in isolation both
# forms took the same time (H100, one query, 16 heads x 128, 10,240 f32 rows: 0.80 ms).
XLA_ONE_PASS_QUERIES = 8


def branch_free() -> bool:
    """Whether the default device's platform syncs on control flow (``SYNCING_CONTROL_FLOW``)."""
    return jax.devices()[0].platform in SYNCING_CONTROL_FLOW
