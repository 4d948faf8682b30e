"""Launch rules of the attention and cache kernels: the SM count, every key-split choice, and
the Pallas kernels' launch parameters as per-device tables. The evidence for each rule and
table entry is in docs/kernels/launch.md.

* ``sm_count``: the device's SMs, the one place with a fallback for a device that reports none.
* ``wave_splits``: of some allowed key-split counts, the one whose programs fill the SMs'
  waves best; the rule of both prefix kernels, which differ only in the counts they allow:
  ``prefix_splits`` (``frame.attention``'s ``pallas`` and ``cuda``: equal chunks of the
  buffer) and ``prefix_cuda_splits`` (the torch drop-in's ``cuda`` backend: chunks of the
  visible rows, at least ``PREFIX_CUDA_MIN_CHUNK`` keys each).
* ``pool_splits``: key splits of the DeepSeek-V4 pool attention (``hybrid.attention``);
  ``pool_cuda_parts``: the partials per query its ``cuda/`` kernel leaves to merge;
  ``flashmla_sm_parts``: the SM partitions of FlashMLA's split-KV schedule.
* ``TABLES`` / ``launch(kernel, device)``: ``rows`` / ``slots`` (frame append: rows per bulk
  copy, copies per program); ``block_kv`` / ``stages`` (prefix attention: keys per block,
  blocks in flight; ``prefix_attention_cuda``: one of the shapes ``jaxkv/cuda/prefix_attention.cu``
  builds); ``tiles`` (64-key tiles per indexer-scores program). A device without its own
  table uses ``DEFAULT``'s, the device the sweeps ran on; add a table for another GPU by its
  ``device_kind``. (The other ``cuda/`` kernels' launch shapes are constants in their sources.)
"""

from __future__ import annotations

import jax

SM_FALLBACK = 132  # an H100 SXM's SMs: for a device that reports no core count (CPU lowering checks)


def sm_count(device=None) -> int:
    """The streaming multiprocessors of ``device`` (a jax device; default: jax's first), or
    ``SM_FALLBACK`` where it reports none."""
    device = jax.devices()[0] if device is None else device
    return getattr(device, "core_count", None) or SM_FALLBACK


def wave_splits(q_len: int, q_heads: int, counts, sms: int) -> int:
    """Of the key-split counts ``counts`` (ascending; 1 when none), the one whose programs
    (128-query tiles x heads x splits) fill the waves of ``sms`` SMs best, the smallest on a tie."""
    programs = -(-q_len // 128) * q_heads
    sms = max(sms, 1)
    best, best_fill = 1, 0.0
    for n in counts:
        fill = programs * n / (-(-programs * n // sms) * sms)
        if fill > best_fill + 1e-9:
            best, best_fill = n, fill
    return best


def prefix_splits(q_len: int, q_heads: int, rows: int, sms: int | None = None) -> int:
    """Key chunks of ``frame.attention``'s prefix kernels (``pallas``, ``cuda``) over a buffer
    of ``rows`` rows: ``wave_splits`` over the powers of two <= 16 that keep chunks whole
    256-row blocks. ``sms``: None = ``sm_count()``."""
    sms = sm_count() if sms is None else sms
    return wave_splits(q_len, q_heads, [n for n in (1, 2, 4, 8, 16) if rows % (n * 256) == 0], sms)


PREFIX_CUDA_MIN_CHUNK = 4096  # keys per split at least: a split's fixed cost (Q load, pipeline fill, partials)


def prefix_cuda_splits(q_len: int, heads: int, keys: int, sms: int | None = None) -> int:
    """Key splits of ``jaxkv/cuda/prefix_attention.cu`` over ``keys`` visible rows (the torch
    drop-in's ``backend="cuda"``): ``wave_splits`` over 1, 2, 4, 8 with chunks of at least
    ``PREFIX_CUDA_MIN_CHUNK`` keys. ``sms``: None = ``sm_count()``."""
    sms = sm_count() if sms is None else sms
    return wave_splits(q_len, heads, [n for n in (1, 2, 4, 8) if n == 1 or keys >= n * PREFIX_CUDA_MIN_CHUNK], sms)


POOL_BLOCK = 64  # the pool attention kernels' keys per block and heads per program (kernels.pool_attention.BLOCK)


def pool_splits(rows: int, heads: int, blocks: int, sms: int | None = None) -> int:
    """Key splits of the pool attention for ``blocks`` blocks of 64 keys per query row: as few
    blocks per split as the programs (one per query row, 64 heads and split) allow in one wave
    over ``sms`` SMs (None = ``sm_count()``), and no split left without a block. A split's
    blocks run one after another, so at small batches one block per split is fastest."""
    sms = sm_count() if sms is None else sms
    most = max(1, min(blocks, sms // max(rows * (heads // POOL_BLOCK), 1)))
    per = -(-blocks // most)  # blocks per split
    return max(1, -(-blocks // per))


def pool_cuda_parts(heads: int, splits: int) -> int:
    """Partials per query row ``jaxkv/cuda/pool_attention.cu`` leaves for the XLA merge: two splits
    at 64 heads (an odd number of 64-head groups) run as a 2-CTA cluster and merge inside the
    kernel, leaving one; otherwise one per split."""
    return 1 if splits == 2 and (heads // POOL_BLOCK) % 2 == 1 else splits


def flashmla_sm_parts(heads: int, sms: int | None = None) -> int:
    """SM partitions of FlashMLA's split-KV schedule for ``heads`` query heads (64 per
    partition's program): its scheduler metadata and float32 scratch are sized by it."""
    sms = sm_count() if sms is None else sms
    return max(sms // (heads // POOL_BLOCK), 1)


DEFAULT = "NVIDIA H100 80GB HBM3"

TABLES = {
    "NVIDIA H100 80GB HBM3": {
        "frame_append": dict(rows=8, slots=2),
        "prefix_attention": dict(block_kv=256, stages=2),
        "prefix_attention_cuda": dict(
            block_kv=192, stages=2
        ),  # one of the shapes jaxkv/cuda/prefix_attention.cu builds
        "index_scores": dict(tiles=8),  # 64-key tiles per program; not swept
        "index_scores_cuda": dict(tiles=16),  # 64-key tiles per CTA
    },
}


def device_kind() -> str:
    """jax's first device's kind (``"cpu"`` off a GPU, where lowering checks use ``DEFAULT``)."""
    return jax.devices()[0].device_kind


def launch(kernel: str, device: str | None = None) -> dict:
    """The launch parameters of ``kernel`` on ``device`` (a ``device_kind``; default: jax's
    first device's); read at trace time, so a jitted kernel is specialized for the device it
    runs on."""
    table = TABLES.get(device or device_kind(), TABLES[DEFAULT])
    return table.get(kernel, TABLES[DEFAULT][kernel])


__all__ = [
    "DEFAULT",
    "PREFIX_CUDA_MIN_CHUNK",
    "SM_FALLBACK",
    "TABLES",
    "device_kind",
    "flashmla_sm_parts",
    "launch",
    "pool_cuda_parts",
    "pool_splits",
    "prefix_cuda_splits",
    "prefix_splits",
    "sm_count",
    "wave_splits",
]
