"""FrameSpec: the static shape of a streaming frame cache, and its memory layout.

Layout of one layer of one stream (``T = spec.capacity`` token rows, ``ps = page_size``)::

    [ slot 0 | slot 1 | ... | slot S+W-1 | tail ....................... | trash ]
      scale slots (S)  window ring (W)      specials, then a staged frame   (ps rows)

* A frame's patches live in one *slot* of ``ps`` rows (the first ``P`` rows hold the
  patches; with power-of-two pages the rest is zero padding). Slots ``0..S-1`` pin the
  scale frames; slots ``S..S+W-1`` are a ring over the sliding window.
* Every frame's special tokens are appended to the tail, which starts right after the
  last occupied slot. While slots are still filling, the tail moves one slot forward per
  frame: the specials sitting in the slot being claimed are moved to the tail's end.
* A deferred frame that arrives when the window is full is *staged* after the specials;
  commit copies it into the oldest window slot, rollback just forgets it.

So with exact pages (``ps == P``) the visible keys are always the prefix
``[0, num_valid)`` of the buffer: attention needs no gather and no mask, only a length.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

ROW_QUANTUM = 2048  # capacity granularity: 16 chunks of 128 rows
FP8 = "float8_e4m3fn"
DTYPES = ("bfloat16", "float16", "float32", FP8)


@dataclasses.dataclass(frozen=True)
class FrameSpec:
    """Static configuration of a frame cache (hashable; a pytree's static field).

    Args:
      num_layers: global-attention layers sharing the page structure.
      num_heads: KV heads per layer.
      head_dim: dims per head.
      patches_per_frame: P, patch tokens per frame.
      num_special: special tokens per frame (camera + registers + scale); they come
        first in each frame's token order.
      scale_frames: S, the first frames whose patches are pinned forever.
      sliding_window: W, most recent non-scale frames whose patches stay visible.
      max_frames: frames whose special tokens fit (special capacity =
        ``max_frames * num_special``); an append past it is a recorded fault, and
        ``jaxkv.frame.grow`` makes room.
      num_streams: B, independent video streams held side by side.
      dtype: K/V storage dtype name: "bfloat16", "float16", "float32", or
        "float8_e4m3fn": FP8 E4M3 with one bfloat16 scale per token and head
        (``jaxkv.formats.quantize_fp8_rows``; the frame's K/V come in as bfloat16,
        ``compute_dtype``). Why that granularity: docs/kernels/frame_cache_fp8.md.
      pow2_pages: round the page size up to a power of two (FlashInfer FA3). The
        padding rows are masked by jaxkv's attention but are part of each page.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    patches_per_frame: int
    num_special: int = 6
    scale_frames: int = 8
    sliding_window: int = 64
    max_frames: int = 1024
    num_streams: int = 1
    dtype: str = "bfloat16"
    pow2_pages: bool = False

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "head_dim", "patches_per_frame", "num_streams", "max_frames"):
            val = getattr(self, name)
            if not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"FrameSpec.{name}: expected a positive int, got {val!r}")
        for name in ("num_special", "scale_frames", "sliding_window"):
            val = getattr(self, name)
            if not isinstance(val, (int, np.integer)) or val < 0:
                raise ValueError(f"FrameSpec.{name}: expected a non-negative int, got {val!r}")
        if self.scale_frames + self.sliding_window < 1:
            raise ValueError("FrameSpec: scale_frames + sliding_window must be at least 1, got 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"FrameSpec.dtype: expected one of {', '.join(map(repr, DTYPES))}, got {self.dtype!r}")

    @property
    def tokens_per_frame(self) -> int:
        return self.num_special + self.patches_per_frame

    @property
    def page_size(self) -> int:
        p = self.patches_per_frame
        return 1 << (p - 1).bit_length() if self.pow2_pages else p

    @property
    def num_slots(self) -> int:
        """Patch slots (= the patch pages of lingbot-map's FlashInferKVCacheManager without headroom): S + W."""
        return self.scale_frames + self.sliding_window

    @property
    def special_capacity(self) -> int:
        return self.max_frames * self.num_special

    @property
    def capacity(self) -> int:
        """Token rows per layer and stream: slots + specials + a staged frame + trash rows.

        Rounded up to a multiple of ``ROW_QUANTUM`` so the prefix kernels can split the
        buffer into equal key chunks of whole blocks by a free reshape
        (``jaxkv.kernels.launch.prefix_splits``).
        """
        rows = (self.num_slots + 2) * self.page_size + self.special_capacity
        return -(-rows // ROW_QUANTUM) * ROW_QUANTUM

    @property
    def trash_row(self) -> int:
        """First of the last ``page_size`` rows: skipped writes land there, nothing reads them."""
        return self.capacity - self.page_size

    @property
    def max_pages(self) -> int:
        """Whole pages in a buffer (rows past ``max_pages * page_size`` are never visible)."""
        return self.capacity // self.page_size

    @property
    def jnp_dtype(self):
        """The dtype K/V are stored in."""
        return jnp.dtype(self.dtype)

    @property
    def quantized(self) -> bool:
        """K/V stored as FP8 codes with a bfloat16 scale per token and head (``k_scale``, ``v_scale``)."""
        return self.dtype == FP8

    @property
    def compute_dtype(self):
        """The dtype a frame's K/V come in as, and queries use: the storage dtype, or
        bfloat16 for an FP8 cache."""
        return jnp.dtype(jnp.bfloat16) if self.quantized else self.jnp_dtype

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K and V buffers (and of their scales, FP8)."""
        rows = 2 * self.num_layers * self.num_streams * self.capacity * self.num_heads
        return rows * (self.head_dim * self.jnp_dtype.itemsize + 2 * self.quantized)

    def with_max_frames(self, max_frames: int) -> FrameSpec:
        return dataclasses.replace(self, max_frames=max_frames)
