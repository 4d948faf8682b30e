"""Tuning constants of the frame cache, as data; the measurements behind them are in
docs/frame.md. (The kernels' launch rules and tables: ``jaxkv.kernels.launch``.)"""

import jax

# Platforms where XLA reads a ``cond`` / ``while`` predicate on the host: a sync in the
# frame step (XLA GPU). There the frame ops avoid data-dependent control flow: a frame's
# row moves always run (to the trash rows when not needed) and the ``xla`` attention of a
# few queries takes one masked pass over the whole buffer. On a CPU the branches are free
# and the branch-free forms cost more, so they stay there (docs/frame.md).
SYNCING_CONTROL_FLOW = ("gpu",)

# ``xla`` backend where control flow syncs: at most this many queries per KV head (tokens
# x GQA group) take the one-pass form, ``math.ref_attention`` (it reads every row).
XLA_ONE_PASS_QUERIES = 8


def branch_free() -> bool:
    """Whether the default device's platform syncs on control flow (``SYNCING_CONTROL_FLOW``)."""
    return jax.devices()[0].platform in SYNCING_CONTROL_FLOW
