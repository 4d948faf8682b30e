"""Launch parameters of the Pallas kernels, as data keyed by device.

``rows``: the frame append's rows per bulk copy; ``slots``: its copies per program;
``block_kv`` / ``stages``: the prefix attention's keys per block and blocks in flight
(Mosaic GPU; ``prefix_attention_cuda``: one of the shapes ``cuda/prefix_attention.cu``
builds); ``tiles``: 64-key tiles per indexer-scores program. (The other ``cuda/`` kernels'
launch shapes are constants in their sources.) A device without its own table uses ``DEFAULT``'s, the
device the sweeps ran on; their figures are in ``benchmarks/RESULTS.md``
("Launch-parameter sweeps"). Add a table for another GPU by its ``device_kind``.
"""

from __future__ import annotations

import jax

DEFAULT = "NVIDIA H100 80GB HBM3"

TABLES = {
    "NVIDIA H100 80GB HBM3": {
        "frame_append": dict(rows=8, slots=2),
        "prefix_attention": dict(block_kv=256, stages=2),
        "prefix_attention_cuda": dict(block_kv=192, stages=2),  # one of the shapes cuda/prefix_attention.cu builds
        "index_scores": dict(tiles=8),  # 64-key tiles per program; not swept
    },
}


def device_kind() -> str:
    """jax's first device's kind (``"cpu"`` off a GPU, where lowering checks use ``DEFAULT``)."""
    return jax.devices()[0].device_kind


def launch(kernel: str, device: str | None = None) -> dict:
    """The launch parameters of ``kernel`` on ``device`` (default: jax's first device);
    read at trace time, so a jitted kernel is specialized for the device it runs on."""
    table = TABLES.get(device or device_kind(), TABLES[DEFAULT])
    return table.get(kernel, TABLES[DEFAULT][kernel])


__all__ = ["DEFAULT", "TABLES", "device_kind", "launch"]
