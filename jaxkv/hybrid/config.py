"""HybridConfig: the static shape of a DeepSeek-V4 style hybrid cache, and its presets.

A layer's kind comes from ``compress_ratios[layer]``: 0 = sliding window only (SWA),
4 = compressed sparse attention (CSA: overlapping a/b windows, lightning indexer, top-k),
128 = heavily compressed attention (HCA: one stream, attention over every entry). Every
layer also keeps the raw sliding window of its last ``window`` tokens.
"""

from __future__ import annotations

import dataclasses
import math

from jaxkv.formats.storage import INDEX_DIM, STORAGES, Storage, storage_name

SWA, CSA, HCA = "swa", "csa", "hca"


def _v4_ratios(num_layers: int, first: tuple[int, ...]) -> tuple[int, ...]:
    rest = num_layers - len(first)
    return first + tuple(4 if i % 2 == 0 else 128 for i in range(rest))


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Static configuration (hashable: it is a static field of the cache state).

    Args:
      compress_ratios: per layer 0 (SWA), a ratio with an indexer (CSA, ``indexer_ratio``)
        or any other ratio > 1 (HCA).
      head_dim, rope_dim: stored entry width (512) and its RoPE tail (last 64 dims, kept
        in BF16; the other 448 are FP8).
      window: raw tokens each layer keeps per request (the SWA ring).
      index_heads, index_dim: lightning-indexer query heads and key width (128: the width
        the key formats' flush and the kernels are built for).
      top_k: compressed entries each query attends to in a CSA layer.
      block_size: compressed entries per block of the paged pool.
      max_requests: request slots (R).
      max_context: most tokens one request may reach (sizes its block tables).
      pool_tokens: raw tokens the pools hold over all requests together (default
        ``max_requests * max_context``); a step that needs more blocks than are free
        is refused for the requests that do not fit (``Fault.POOL_EXHAUSTED``).
      storage: ``"official"`` (ds_mla entries with UE8M0 tiles, MXFP4 indexer keys) or
        ``"per_entry"`` (FP8 + float32 per-entry scale, NVFP4 indexer keys). Layouts and
        their bytes: ``jaxkv.formats.storage``.
      norm_eps, rope_theta, rope_factor, original_seq_len, beta_fast, beta_slow:
        RMSNorm epsilon and the YaRN RoPE of compressed entries (DeepSeek-V4's
        ``compress_rope_theta`` and ``rope_scaling``); ``original_seq_len=0`` is plain RoPE.
    """

    compress_ratios: tuple[int, ...]
    head_dim: int = 512
    rope_dim: int = 64
    window: int = 128
    index_heads: int = 64
    index_dim: int = 128
    indexer_ratio: int = 4
    top_k: int = 512
    block_size: int = 64
    max_requests: int = 16
    max_context: int = 65536
    pool_tokens: int | None = None
    storage: str = "official"
    norm_eps: float = 1e-6
    rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        if not self.compress_ratios:
            raise ValueError("compress_ratios: expected at least one layer, got ()")
        bad = [r for r in self.compress_ratios if r < 0 or r == 1]
        if bad:
            raise ValueError(f"compress_ratios: expected 0 (SWA) or a ratio >= 2, got {bad[0]}")
        object.__setattr__(self, "storage", storage_name(self.storage))
        for name in ("head_dim", "window", "index_heads", "top_k", "block_size", "max_requests", "max_context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if self.head_dim - self.rope_dim != 448 or self.rope_dim != 64:
            raise ValueError(
                f"head_dim, rope_dim: the stored formats are 448 FP8 + 64 BF16 dims, got head_dim={self.head_dim}, "
                f"rope_dim={self.rope_dim}"
            )
        if self.index_dim != INDEX_DIM:
            raise ValueError(
                f"index_dim: expected {INDEX_DIM} (DeepSeek-V4's indexer key width, which the key "
                f"formats' flush and kernels are built for), got {self.index_dim}"
            )
        if self.pool_tokens is not None and self.pool_tokens <= 0:
            raise ValueError(f"pool_tokens: expected a positive int or None, got {self.pool_tokens}")

    # --- layer schedule ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    def kind(self, layer: int) -> str:
        r = self.compress_ratios[layer]
        return SWA if r == 0 else CSA if r == self.indexer_ratio else HCA

    @property
    def ratios(self) -> tuple[int, ...]:
        """Distinct compression ratios, ascending; one block allocator each."""
        return tuple(sorted({r for r in self.compress_ratios if r}))

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r)

    @property
    def index_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.kind(i) == CSA)

    # --- capacities -----------------------------------------------------------------
    @property
    def storage_format(self) -> Storage:
        return STORAGES[self.storage]

    def max_entries(self, ratio: int) -> int:
        return self.max_context // ratio

    def max_blocks_per_request(self, ratio: int) -> int:
        return max(1, math.ceil(self.max_entries(ratio) / self.block_size))

    def num_blocks(self, ratio: int) -> int:
        """Physical blocks of a ratio's pool: ``pool_tokens`` worth of entries, plus one
        partially filled block per request."""
        tokens = self.max_requests * self.max_context if self.pool_tokens is None else self.pool_tokens
        full = math.ceil(tokens // ratio / self.block_size)
        return min(full + self.max_requests, self.max_requests * self.max_blocks_per_request(ratio))


def bytes_per_token(config: HybridConfig) -> float:
    """Cache bytes one raw token costs at long context, summed over layers.

    Counts the compressed entries (``entry_bytes / ratio``) and the CSA indexer keys
    (``index_key_bytes / ratio``); the fixed-size SWA ring and compressor tails are
    excluded (item bytes: ``jaxkv.formats.storage``).
    """
    fmt = config.storage_format
    total = 0.0
    for layer, ratio in enumerate(config.compress_ratios):
        if ratio:
            total += fmt.entry_bytes / ratio
            if config.kind(layer) == CSA:
                total += fmt.index_key_bytes(config.index_dim) / ratio
    return total


V4_FLASH = HybridConfig(compress_ratios=_v4_ratios(43, (0, 0)), top_k=512)
V4_PRO = HybridConfig(compress_ratios=_v4_ratios(61, (128, 128)), top_k=1024)
