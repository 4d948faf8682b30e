"""FlashMLA's Hopper sparse FP8 decode (DeepSeek-V4, FlashMLA's "MODEL1") on jaxkv's pool
bytes: an optional contender to jaxkv's own sparse attention, built on first use.

Why it can read jaxkv's pools as they are: the ``official`` storage family is FlashMLA's
MODEL1 block byte for byte (``bs`` x [448 FP8 e4m3 + 64 BF16 rope dims], then ``bs`` x
[7 UE8M0 tile scales + 1 pad]), so a layer's pool is handed over as a view, no copy. The
``per_entry`` family cannot be read: its f32 per-entry scale and entry size are no layout
FlashMLA has (MODEL1 wants UE8M0 per 64 dims after the block's data; V3.2 wants 512 FP8
dims with 4 f32 scales per 128), so there it raises.

Nothing of FlashMLA lives in this package. ``load`` builds FlashMLA's sm90 sparse decode with
jaxkv's launcher into the library ``jaxkv.cuda.flashmla`` builds for ``jax.ffi`` (one build,
one cache: ``jaxkv.cuda.build``), from ``load(src)`` or ``$FLASHMLA_SRC`` -- a checkout with
its ``csrc/cutlass`` submodule, or the trimmed tree ``tools/flashmla_tree.sh`` makes in
``.upstream/flashmla`` -- and calls its ``extern "C"`` launcher through ``ctypes`` with the
tensors' data pointers, as ``torch_bridge.kernels`` calls jaxkv's own kernels. The launcher
does what FlashMLA's torch entry point does on sm90 (the same code path as the FFI handler).

Imports torch, the standard library, ``jaxkv.cuda.flashmla`` and ``torch_bridge.kernels``;
``import jaxkv`` does not import it. jax arrays cross with ``torch.from_dlpack``
(``torch_bridge.to_torch``): zero-copy views. The kernels run on torch's current stream of
the tensors' device.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading

import torch

from jaxkv.cuda import flashmla as _ffi
from jaxkv.cuda.flashmla import HEADS, source_dir
from torch_bridge.kernels import _stream

HEAD_DIM = 512  # q / entry dims FlashMLA's MODEL1 path takes (448 FP8 nope + 64 BF16 rope)
TOPK_BLOCK = 64  # the kernel walks indices 64 at a time: topk and window widths are multiples
# FlashMLA's MODEL1 bytes per token (its api/sparse_decode.h computes it so); equal to
# jaxkv.formats.storage.entry_bytes("official"), which tests/torch_bridge/test_flashmla.py checks.
_NOPE, _ROPE, _TILE = 448, 64, 64
MODEL1_ENTRY_BYTES = _NOPE + 2 * _ROPE + _NOPE // _TILE + 1  # 584
SCHED_INTS = 8  # ints per SM part in FlashMLA's tile schedule (sizeof(DecodingSchedMeta) / 4)

_lock = threading.Lock()
_library = None  # the typed library once loaded


def _typed(lib):
    if not getattr(lib, "_jaxkv_typed", False):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        f = getattr(lib, _ffi.LAUNCHER)
        f.argtypes = [
            p,
            i64,
            i64,
            i64,  # stream, b, s_q, h
            p,
            i64,
            i64,
            i64,  # q and its strides
            p,
            i64,
            i64,
            i64,  # kv, num_blocks, block_size, block stride (bytes)
            p,
            i64,
            i64,
            i64,
            p,  # indices, topk, strides, topk_length
            p,
            i64,
            i64,
            i64,  # extra_kv, num_blocks, block_size, block stride
            p,
            i64,
            i64,
            i64,
            p,  # extra_indices, extra_topk, strides, extra_topk_length
            p,
            ctypes.c_float,
            p,
            p,  # sink, scale, out, lse
            p,
            p,
            i64,
            i32,  # sched, splits, parts, make_schedule
            p,
            p,
            ctypes.c_char_p,
            i64,
        ]  # lse_acc, o_acc, error, error_size
        f.restype = ctypes.c_int
        lib._jaxkv_typed = True
    return lib


def load(src=None, *, verbose: bool = False):
    """The library with FlashMLA's sparse decode (a ``ctypes.CDLL``; its launcher is
    ``jaxkv.cuda.flashmla.LAUNCHER``), built on the first call from ``src`` or
    ``$FLASHMLA_SRC``; later calls return the same library. ``verbose``: print its path.

    ImportError when the FlashMLA tree is not given or lacks a file the build needs (before
    any build), RuntimeError without a CUDA build of torch and a GPU, ``BuildError`` (a
    RuntimeError) with nvcc's output when the build fails."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        source_dir(src)
        if not torch.cuda.is_available() or torch.version.cuda is None:
            raise RuntimeError(
                "FlashMLA: expected a CUDA build of torch and a visible GPU, got "
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) with "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs"
            )
        _library = _typed(_ffi.library(src))
        if verbose:
            print(f"torch_bridge.flashmla: {_library._name}")
        return _library


# --- the call ------------------------------------------------------------------------------
@dataclasses.dataclass
class Schedule:
    """FlashMLA's split-KV tile schedule, made by the first ``sparse_decode`` given this
    object and reused by later ones: valid while the shapes and the ``topk_length`` /
    ``window_length`` values stay the same (a decode step's layers share one)."""

    tile_scheduler_metadata: torch.Tensor | None = None  # i32[num_sm_parts, 8]
    num_splits: torch.Tensor | None = None  # i32[B + 1]


def _ptr(t):
    return None if t is None else t.data_ptr()


def _check(name, t, dtype, ndim, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.ndim != ndim or not t.is_cuda:
        raise ValueError(
            f"{name}: expected a CUDA {dtype} tensor of rank {ndim}, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim, got strides {tuple(t.stride())}")


def kv_view(pool, block_size: int, name: str = "pool"):
    """pool: u8[num_blocks, block_size * E] -> u8[num_blocks, block_size, 1, E], the same
    memory: FlashMLA's ``k_cache`` (it reads the segment-major block through row stride E)."""
    _check(name, pool, torch.uint8, 2)
    nb, width = pool.shape
    if block_size <= 0 or width % block_size or width // block_size != MODEL1_ENTRY_BYTES:
        raise ValueError(
            f"{name}: expected an official-family pool u8[num_blocks, {block_size} * "
            f"{MODEL1_ENTRY_BYTES}], got {tuple(pool.shape)} (the per_entry family cannot be read)"
        )
    if pool.data_ptr() % 16 or pool.stride(0) % 16:  # the kernel loads 16 B vectors from each block
        raise ValueError(
            f"{name}: expected 16-byte aligned blocks (an even block_size), got block stride "
            f"{pool.stride(0)} B at address {pool.data_ptr():#x}"
        )
    return pool.unflatten(1, (block_size, 1, MODEL1_ENTRY_BYTES))


def entry_ids(entries, block_table, block_size: int):
    """Per-request entry numbers -> the pool-wide ids FlashMLA reads
    (``block_table[b, s // block_size] * block_size + s % block_size``); -1 stays -1.

    entries: i32[B, T, K] (-1 = none, e.g. ``hybrid.index_topk``), block_table: i32[B, max_blocks]
    -> i32[B, T, K]."""
    valid = entries >= 0
    s = torch.where(valid, entries, 0).long()
    blk = torch.gather(block_table.long(), 1, (s // block_size).flatten(1)).view_as(s)
    return torch.where(valid, blk * block_size + s % block_size, -1).to(torch.int32)


def window_ids(slot, position, window: int, T: int = 1):
    """The SWA ring's ids for FlashMLA's extra cache: request slot ``r``'s ring is block
    ``r`` of ``window`` items, position ``p`` at item ``p % window``. Query ``t`` of row
    ``b`` (at ``position[b] + t``) sees positions ``(p - window, p]``, not below 0.

    slot, position: i32[B] -> i32[B, T, window] (-1 = none)."""
    p = position.long()[:, None, None] + torch.arange(T, device=position.device)[None, :, None]  # [B, T, 1]
    kp = p - torch.arange(window, device=position.device)[None, None, :]  # [B, T, window], newest first
    ids = slot.long()[:, None, None] * window + kp % window
    return torch.where(kp >= 0, ids, -1).to(torch.int32)


def sparse_decode(
    q,
    pool,
    indices,
    *,
    block_size: int,
    sink,
    scale: float,
    window=None,
    window_indices=None,
    topk_length=None,
    window_length=None,
    schedule: Schedule | None = None,
):
    """Sparse MQA over FP8 entries (K = V, 512 dims) with an attention sink, FlashMLA's sm90
    MODEL1 kernel: softmax over the ``indices`` entries of ``pool`` and the ``window_indices``
    items of ``window`` together, the sink's ``exp(sink)`` added to the denominator.

    q:              bf16[B, T, H, 512]      H = 64 or 128
    pool:           u8[NB, block_size * E]  one layer's entry pool, official family   # u8[num_blocks, block_size * 584]
    indices:        i32[B, T, K]            pool-wide ids block * block_size + slot (``entry_ids``), -1 = none, K % 64 == 0
    sink:           f32[H]                  per-head sink logit
    scale:          softmax scale of q . k
    window:         u8[R, window * E]       one layer's SWA rings (one block a request), or None   # u8[R, window * 584]
    window_indices: i32[B, T, W]            ids slot * window + item (``window_ids``), -1 = none, W % 64 == 0
    topk_length:    i32[B] or None          only the first topk_length[b] of ``indices`` are read
    window_length:  i32[B] or None          likewise for ``window_indices``
    schedule:       reuse FlashMLA's tile schedule across calls (``Schedule``)

    Returns (out bf16[B, T, H, 512], lse f32[B, H, T]): lse is over the entries alone (the
    sink not in it), natural log; a row with no valid entry gives out 0 and lse +inf.
    Only the value -1 marks padding: any other negative id is read as a (huge) block.
    """
    lib = load()
    _check("q", q, torch.bfloat16, 4)
    dev = q.device
    B, T, H, D = q.shape
    if D != HEAD_DIM or H not in HEADS:
        raise ValueError(f"q: expected bf16[B, T, H, {HEAD_DIM}] with H in {HEADS}, got {tuple(q.shape)}")
    k_cache = kv_view(pool, block_size)
    if k_cache.device != dev:
        raise ValueError(f"pool: expected device {dev}, got {k_cache.device}")
    _check("indices", indices, torch.int32, 3, dev)
    if indices.shape[:2] != (B, T) or indices.shape[2] % TOPK_BLOCK or indices.shape[2] == 0:
        raise ValueError(
            f"indices: expected i32[{B}, {T}, K] with K a positive multiple of {TOPK_BLOCK}, got {tuple(indices.shape)}"
        )
    _check("sink", sink, torch.float32, 1, dev)
    if sink.shape != (H,) or not sink.is_contiguous():
        raise ValueError(f"sink: expected contiguous f32[{H}], got {tuple(sink.shape)}")
    for name, t in (("topk_length", topk_length), ("window_length", window_length)):
        if t is not None:
            _check(name, t, torch.int32, 1, dev)
            if t.shape != (B,) or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous i32[{B}], got {tuple(t.shape)}")
    extra = None
    if (window is None) != (window_indices is None):
        raise ValueError("window, window_indices: expected both (the SWA part) or neither")
    if window is not None:
        _check("window", window, torch.uint8, 2, dev)
        if window.shape[1] % MODEL1_ENTRY_BYTES:
            raise ValueError(f"window: expected u8[R, window * {MODEL1_ENTRY_BYTES}], got {tuple(window.shape)}")
        extra = kv_view(window, window.shape[1] // MODEL1_ENTRY_BYTES, "window")
        _check("window_indices", window_indices, torch.int32, 3, dev)
        w = window_indices.shape
        if w[:2] != (B, T) or w[2] % TOPK_BLOCK or w[2] == 0:
            raise ValueError(
                f"window_indices: expected i32[{B}, {T}, W] with W a positive multiple of {TOPK_BLOCK}, got {tuple(w)}"
            )
    elif window_length is not None:
        raise ValueError("window_length: given without window")
    if B == 0 or T == 0:
        raise ValueError(f"q: expected at least one request and one token, got {tuple(q.shape)}")
    # FlashMLA's entry point: max(SMs / s_q / (h_q / 64), 1) SM parts on sm90
    parts = max(torch.cuda.get_device_properties(dev).multi_processor_count // T // (H // 64), 1)
    sched = schedule if schedule is not None else Schedule()
    make = sched.tile_scheduler_metadata is None
    if make:
        sched_t = torch.empty((parts, SCHED_INTS), dtype=torch.int32, device=dev)
        splits_t = torch.empty((B + 1,), dtype=torch.int32, device=dev)
    else:
        sched_t, splits_t = sched.tile_scheduler_metadata, sched.num_splits
        for name, t, shape in (
            ("schedule.tile_scheduler_metadata", sched_t, (parts, SCHED_INTS)),
            ("schedule.num_splits", splits_t, (B + 1,)),
        ):
            _check(name, t, torch.int32, len(shape), dev)
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(
                    f"{name}: expected contiguous i32{list(shape)} (made for these shapes), got {tuple(t.shape)}"
                )
    out = torch.empty((B, T, H, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((B, T, H), dtype=torch.float32, device=dev)
    lse_acc = torch.empty((B + parts, T, H), dtype=torch.float32, device=dev)
    o_acc = torch.empty((B + parts, T, H, HEAD_DIM), dtype=torch.float32, device=dev)
    err = ctypes.create_string_buffer(1024)
    guard = torch.cuda.device(dev) if torch.cuda.current_device() != dev.index else contextlib.nullcontext()
    with guard:
        code = getattr(lib, _ffi.LAUNCHER)(
            _stream(dev),
            B,
            T,
            H,
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cache.data_ptr(),
            k_cache.shape[0],
            block_size,
            k_cache.stride(0),
            indices.data_ptr(),
            indices.shape[2],
            indices.stride(0),
            indices.stride(1),
            _ptr(topk_length),
            _ptr(extra),
            0 if extra is None else extra.shape[0],
            0 if extra is None else extra.shape[1],
            0 if extra is None else extra.stride(0),
            _ptr(window_indices),
            0 if extra is None else window_indices.shape[2],
            0 if extra is None else window_indices.stride(0),
            0 if extra is None else window_indices.stride(1),
            _ptr(window_length),
            sink.data_ptr(),
            float(scale),
            out.data_ptr(),
            lse.data_ptr(),
            sched_t.data_ptr(),
            splits_t.data_ptr(),
            parts,
            int(make),
            lse_acc.data_ptr(),
            o_acc.data_ptr(),
            err,
            len(err),
        )
    if code != 0:
        raise RuntimeError(err.value.decode(errors="replace") or f"flashmla sparse decode: error {code}")
    sched.tile_scheduler_metadata, sched.num_splits = sched_t, splits_t
    return out, lse.transpose(1, 2)


__all__ = ["Schedule", "entry_ids", "kv_view", "load", "sparse_decode", "window_ids"]
