"""Storage families: how a 512-dim entry and a 128-dim indexer key become bytes in a block.

This module is the one owner of the pool byte layout. The jnp codecs here, the Pallas
kernels (``jaxkv.kernels``), the XLA paths of ``jaxkv.hybrid`` and the CUDA build
(``jaxkv.cuda.build`` passes ``cuda_defines()`` to nvcc) all read it from here.

Every pool — a compressed layer's entries, its indexer keys, and each request's SWA ring —
is one ``uint8[num_blocks, block_size * bytes_per_item]`` array per layer (stacked over
the layers that share it). An item is split into
*segments*; a block stores segment 0 of all its items, then segment 1 of all its items,
and so on. For the official family this is exactly the ``ds_mla`` block of FlashMLA /
vLLM / FlashInfer (``bs x 576`` data bytes, then ``bs x 8`` scale bytes), so a pool can be
handed to their kernels as is.

| family | entry (512 dims) | indexer key (128 dims) |
| --- | --- | --- |
| ``official`` | [448 FP8 (UE8M0 per 64) + 64 BF16 rope] 576 B, [7 UE8M0 + pad] 8 B = 584 B | MXFP4: 64 B codes, 4 B UE8M0 = 68 B |
| ``per_entry`` | 448 FP8 B, 128 B BF16 rope, 4 B f32 per-entry scale = 580 B | NVFP4: 64 B codes, 8 B E4M3, 4 B f32 global = 76 B |

``per_entry`` is the layout of the reference DeepSeek-V4 cache design (``docs/glossary.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.formats import (
    dequantize_fp8_per_entry,
    dequantize_mxfp4,
    dequantize_nvfp4,
    ds_mla,
    nvfp4_global_scale,
    quantize_fp8_per_entry,
    quantize_fp8_ue8m0,
    quantize_mxfp4,
    quantize_nvfp4,
)
from jaxkv.formats.fp8 import TILE, dequantize_fp8_ue8m0

# --- the layout's numbers (every other place reads them from here; the entry's are the
# ds_mla block's) ----------------------------------------------------------------------
HEAD_DIM = ds_mla.HEAD_DIM  # a stored entry's dims: NOPE FP8 dims, then ROPE BF16 dims (512)
NOPE = ds_mla.NOPE_DIM  # FP8 dims of an entry (448)
ROPE = ds_mla.ROPE_DIM  # BF16 dims of an entry, its RoPE tail (64)
NOPE_TILES = ds_mla.NUM_TILES  # UE8M0 tiles of the official family (7)
DATA = ds_mla.TOKEN_DATA_BYTES  # bytes of an entry's codes + rope dims (576)
INDEX_DIM = 128  # indexer key width the kernels are built for
KEY_CODES = INDEX_DIM // 2  # E2M1 code bytes of a 128-dim key (64)


def as_bytes(x):
    """x: any[..., n] -> u8[..., n * itemsize] (little-endian memory order)."""
    b = lax.bitcast_convert_type(x, jnp.uint8)
    return b if x.dtype.itemsize == 1 else b.reshape(*x.shape[:-1], -1)


def from_bytes(b, dtype):
    """u8[..., n * itemsize] -> dtype[..., n]."""
    size = jnp.dtype(dtype).itemsize
    if size > 1:
        b = b.reshape(*b.shape[:-1], -1, size)
    return lax.bitcast_convert_type(b, dtype)


@dataclasses.dataclass(frozen=True)
class Codec:
    """One item kind: its byte segments, and the functions to and from those bytes."""

    segments: tuple[int, ...]  # bytes per item of each segment, in block order
    encode: Callable  # bf16[..., dim] -> u8[..., sum(segments)]
    decode: Callable  # u8[..., sum(segments)] -> bf16[..., dim]

    @property
    def bytes(self) -> int:
        return sum(self.segments)


@dataclasses.dataclass(frozen=True)
class Storage:
    name: str
    entry: Codec
    index_key: Callable[[int], Codec]  # by key width

    @property
    def entry_bytes(self) -> int:
        return self.entry.bytes

    def index_key_bytes(self, dim: int) -> int:
        return self.index_key(dim).bytes


# --- official: ds_mla entries, MXFP4 keys -------------------------------------------------
def _ds_mla_encode(x):
    q, scale = quantize_fp8_ue8m0(x[..., :NOPE].astype(jnp.float32))  # f8[..., 448], u8[..., 7]
    pad = jnp.zeros((*scale.shape[:-1], 1), jnp.uint8)
    rope = as_bytes(x[..., NOPE:].astype(jnp.bfloat16))
    return jnp.concatenate([as_bytes(q), rope, scale, pad], axis=-1)


def _ds_mla_decode(b):
    q = from_bytes(b[..., :NOPE], jnp.float8_e4m3fn)
    rope = from_bytes(b[..., NOPE:DATA], jnp.bfloat16)
    return jnp.concatenate([dequantize_fp8_ue8m0(q, b[..., DATA : DATA + NOPE_TILES]), rope], axis=-1)


def _mxfp4_codec(dim: int) -> Codec:
    def encode(x):
        packed, scales = quantize_mxfp4(x.astype(jnp.float32))
        return jnp.concatenate([packed, scales], axis=-1)

    def decode(b):
        return dequantize_mxfp4(b[..., : dim // 2], b[..., dim // 2 :])

    return Codec((dim // 2, dim // 32), encode, decode)


# --- per_entry: one float32 FP8 scale per entry, NVFP4 keys -----------------------------------
def _per_entry_encode(x):
    q, scale = quantize_fp8_per_entry(x[..., :NOPE].astype(jnp.float32))  # f8[..., 448], f32[...]
    rope = as_bytes(x[..., NOPE:].astype(jnp.bfloat16))
    return jnp.concatenate([as_bytes(q), rope, as_bytes(scale[..., None])], axis=-1)


def _per_entry_decode(b):
    q = from_bytes(b[..., :NOPE], jnp.float8_e4m3fn)
    rope = from_bytes(b[..., NOPE:DATA], jnp.bfloat16)
    scale = from_bytes(b[..., DATA : DATA + 4], jnp.float32)[..., 0]
    return jnp.concatenate([dequantize_fp8_per_entry(q, scale), rope], axis=-1)


def _nvfp4_codec(dim: int) -> Codec:
    def encode(x):
        xf = x.astype(jnp.float32)
        g = jax.vmap(nvfp4_global_scale)(xf.reshape(-1, dim)).reshape(*xf.shape[:-1], 1)  # per key
        packed, scales, _ = quantize_nvfp4(xf, g)
        return jnp.concatenate([packed, as_bytes(scales), as_bytes(g)], axis=-1)

    def decode(b):
        h = dim // 2
        scales = from_bytes(b[..., h : h + dim // 16], jnp.float8_e4m3fn)
        g = from_bytes(b[..., h + dim // 16 :], jnp.float32)
        return dequantize_nvfp4(b[..., :h], scales, g)

    return Codec((dim // 2, dim // 16, 4), encode, decode)


STORAGES = {
    "official": Storage(
        "official", Codec((DATA, ds_mla.TOKEN_SCALE_BYTES), _ds_mla_encode, _ds_mla_decode), _mxfp4_codec
    ),
    "per_entry": Storage("per_entry", Codec((NOPE, 2 * ROPE, 4), _per_entry_encode, _per_entry_decode), _nvfp4_codec),
}


def storage_name(name: str, arg: str = "storage") -> str:
    """``name`` if it names a family of ``STORAGES``; a ``ValueError`` naming ``arg`` otherwise."""
    if name not in STORAGES:
        raise ValueError(f"{arg}: expected one of {sorted(STORAGES)}, got {name!r}")
    return name


def entry_bytes(name: str) -> int:
    """Bytes of one 512-dim entry in family ``name``."""
    return STORAGES[name].entry_bytes


def key_bytes(name: str, dim: int = INDEX_DIM) -> int:
    """Bytes of one indexer key of width ``dim`` in family ``name``."""
    return STORAGES[name].index_key_bytes(dim)


def segment_offsets(segments, block_size: int) -> tuple[int, ...]:
    """Byte offset of each segment inside a block of ``block_size`` items."""
    out, off = [], 0
    for z in segments:
        out.append(off * block_size)
        off += z
    return tuple(out)


def cuda_defines() -> list[str]:
    """The layout as nvcc ``-D`` flags for ``jaxkv/cuda/flush_write.cu``: per family its code,
    item bytes and each segment's bytes (``JAXKV_OFFICIAL_ENTRY_SEG0=576``, ...). Scalars
    only: nvcc splits option values at commas."""
    flags = [
        f"-DJAXKV_HEAD_DIM={HEAD_DIM}",
        f"-DJAXKV_NOPE={NOPE}",
        f"-DJAXKV_TILE={TILE}",
        f"-DJAXKV_INDEX_DIM={INDEX_DIM}",
    ]
    for code, name in enumerate(STORAGES):
        st, tag = STORAGES[name], f"-DJAXKV_{name.upper()}"
        flags.append(f"{tag}_CODE={code}")
        for kind, codec in (("ENTRY", st.entry), ("KEY", st.index_key(INDEX_DIM))):
            flags.append(f"{tag}_{kind}_BYTES={codec.bytes}")
            flags += [f"{tag}_{kind}_SEG{i}={z}" for i, z in enumerate(codec.segments)]
    return flags


STORAGE_CODES = {name: code for code, name in enumerate(STORAGES)}  # the CUDA kernels' family argument


# --- block addressing ----------------------------------------------------------------------
def write_items(pool, layer: int, block, slot, items, segments):
    """Scatter items into layer ``layer`` of a stacked segment-major block pool, in place;
    rows whose ``block`` or ``slot`` is out of range are dropped (a slot past its segment
    would land in the next one's bytes).

    pool: u8[layers, num_blocks, block_size * E], block: i32[N], slot: i32[N], items: u8[N, E].
    """
    width = pool.shape[-1]
    bs = width // sum(segments)
    block = jnp.where((slot >= 0) & (slot < bs), block, -1)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0, 1), scatter_dims_to_operand_dims=(0, 1, 2)
    )
    lyr = jnp.full(block.shape, layer, jnp.int32)
    off = 0
    for z in segments:
        idx = jnp.stack([lyr, block, bs * off + slot * z], axis=-1)  # i32[N, 3]
        pool = lax.scatter(
            pool,
            idx,
            items[:, off : off + z],
            dnums,
            mode=lax.GatherScatterMode.FILL_OR_DROP,
            indices_are_sorted=False,
            unique_indices=False,
        )
        off += z
    return pool


def pack_items(items, block_size: int, segments):
    """Items as a fresh segment-major block pool, item m at (block m // block_size, slot
    m % block_size); the last block's spare slots are zeros.

    items: u8[M, E] -> u8[ceil(M / block_size), block_size * E]
    """
    M, E = items.shape
    blocks = -(-M // block_size)
    x = jnp.pad(items, ((0, blocks * block_size - M), (0, 0))).reshape(blocks, block_size, E)
    parts, off = [], 0
    for z in segments:
        parts.append(x[:, :, off : off + z].reshape(blocks, block_size * z))
        off += z
    return jnp.concatenate(parts, axis=1)


def read_items(pool, layer: int, block, slot, segments):
    """Gather items from layer ``layer`` of a stacked segment-major block pool.

    pool: u8[layers, num_blocks, block_size * E], block, slot: i32[...] (clamped into range)
    -> u8[..., E].
    """
    _, nb, width = pool.shape
    bs = width // sum(segments)
    block = jnp.clip(block, 0, nb - 1)
    slot = jnp.clip(slot, 0, bs - 1)
    parts, off = [], 0
    for z in segments:
        region = pool[layer, :, bs * off : bs * (off + z)].reshape(nb, bs, z)
        parts.append(region[block, slot])
        off += z
    return jnp.concatenate(parts, axis=-1)
