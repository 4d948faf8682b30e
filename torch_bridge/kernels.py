"""The ``cuda/`` kernels for PyTorch callers, in place on torch tensors: the hybrid
cache's flush (``flush_write``, the tail-state updates) and the frame cache's append
(``frame_append``, the drop-in manager's write).

The tensors may be views of jaxkv state (``torch_bridge.to_torch``): the kernels then
write the very buffers the JAX side owns. Each call is enqueued on torch's current
stream of the tensors' device. The library is the one ``jaxkv.cuda`` builds (nvcc on first
use, cached under ``~/.cache/jaxkv``); its bytes equal ``jaxkv.hybrid.flush``'s jnp refs.

    pool:       u8[NB, bs * E]   one layer's entry pool (e.g. ``to_torch(state.entries[g])[j]``)
    index_pool: u8[NB, bs * K]   one layer's indexer-key pool (CSA), else None
    x:          bf16[N, 512]     finished entries;  xi: bf16[N, 128] rotated keys (CSA)
    block, slot: i32[N]          where each entry goes; blocks outside [0, NB) are skipped
    tails:      f32[R, streams, 3, width];  tail_slot: i32[B] (outside [0, R) skipped)
"""

from __future__ import annotations

import ctypes

import torch

from jaxkv.cuda import STORAGE_CODES, BuildError, arch_of, library
from jaxkv.formats.storage import STORAGES, storage_name


def _lib(device: torch.device):
    lib = library(arch_of(torch.cuda.get_device_capability(device)))
    if not getattr(lib, "_jaxkv_typed", False):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        lib.jaxkv_flush_write.argtypes = [p, p, p, p, p, p, p, i64, i64, i32, i32]
        lib.jaxkv_tail_state.argtypes = [p, p, i64, i32, i32, p, i64]
        lib.jaxkv_frame_append.argtypes = [p, p, p, p, p, p, i64, i64, i64, i32, p, p]
        lib.jaxkv_flush_write.restype = lib.jaxkv_tail_state.restype = lib.jaxkv_frame_append.restype = ctypes.c_int
        lib._jaxkv_typed = True
    return lib


def _check(name, t, dtype, ndim, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.ndim != ndim or not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous CUDA {dtype} tensor of rank {ndim}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}")


def flush_write(pool, x, block, slot, *, storage: str, index_pool=None, xi=None) -> None:
    """Quantize ``x`` (and ``xi``) in ``storage``'s format and write them into ``pool``
    (and ``index_pool``) at ``(block, slot)``, in place."""
    storage = storage_name(storage)
    fmt = STORAGES[storage]
    _check("pool", pool, torch.uint8, 2)
    dev = pool.device
    _check("x", x, torch.bfloat16, 2, dev)
    n = x.shape[0]
    if x.shape[1] != 512:
        raise ValueError(f"x: expected bf16[N, 512], got {tuple(x.shape)}")
    for name, t in (("block", block), ("slot", slot)):
        _check(name, t, torch.int32, 1, dev)
        if t.shape[0] != n:
            raise ValueError(f"{name}: expected i32[{n}], got {tuple(t.shape)}")
    if pool.shape[1] % fmt.entry_bytes:
        raise ValueError(f"pool: expected u8[blocks, block_size * {fmt.entry_bytes}], got {tuple(pool.shape)}")
    bs = pool.shape[1] // fmt.entry_bytes
    if (index_pool is None) != (xi is None):
        raise ValueError("index_pool, xi: expected both (a CSA layer) or neither (HCA)")
    if index_pool is not None:
        _check("index_pool", index_pool, torch.uint8, 2, dev)
        _check("xi", xi, torch.bfloat16, 2, dev)
        want = (pool.shape[0], bs * fmt.index_key_bytes(128))
        if tuple(index_pool.shape) != want or tuple(xi.shape) != (n, 128):
            raise ValueError(f"index_pool, xi: expected u8{list(want)} and bf16[{n}, 128], got "
                             f"{tuple(index_pool.shape)} and {tuple(xi.shape)}")
    stream = torch.cuda.current_stream(dev).cuda_stream
    code = _lib(dev).jaxkv_flush_write(
        stream, pool.data_ptr(), None if index_pool is None else index_pool.data_ptr(), x.data_ptr(),
        None if xi is None else xi.data_ptr(), block.data_ptr(), slot.data_ptr(), n, pool.shape[0], bs,
        STORAGE_CODES[storage])
    _ok(code, "flush_write")


def _tail_state(tails, tail_slot, streams: int) -> None:
    _check("tails", tails, torch.float32, 4)
    _check("tail_slot", tail_slot, torch.int32, 1, tails.device)
    if tuple(tails.shape[1:3]) != (streams, 3):
        raise ValueError(f"tails: expected f32[R, {streams}, 3, width], got {tuple(tails.shape)}")
    stream = torch.cuda.current_stream(tails.device).cuda_stream
    code = _lib(tails.device).jaxkv_tail_state(stream, tails.data_ptr(), tails.shape[0], streams, tails.shape[3],
                                               tail_slot.data_ptr(), tail_slot.shape[0])
    _ok(code, "tail state")


def csa_rotate_state(tails, tail_slot) -> None:
    """After a CSA flush: previous-b <- current-b, current a / b emptied (in place)."""
    _tail_state(tails, tail_slot, 3)


def hca_reset_state(tails, tail_slot) -> None:
    """After an HCA flush: the stream emptied (in place)."""
    _tail_state(tails, tail_slot, 1)


_APPEND_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # cuda/frame_append.cu's codes
APPEND_SCRATCH = 256  # i32 words frame_append's scratch holds


def frame_append_available(device) -> bool:
    """Whether ``frame_append`` runs on ``device``: CUDA, and the library builds (nvcc)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _lib(device)
    except BuildError:
        return False
    return True


def frame_append(k, v, kbuf, vbuf, rows, trash_row: int, scratch, sticky) -> None:
    """Write the rows of ``k`` / ``v`` into ``kbuf`` / ``vbuf`` at ``rows``, or, if either
    holds a NaN or an Inf, every row at ``trash_row`` and ``sticky`` set (decided on the
    device: two launches, no host sync). Shapes are the caller's to check (the manager's
    per-frame hot path); dtypes, devices and contiguity are checked here.

        k, v:        dtype[N, H, D] contiguous     the frame (dtype bf16, fp16 or fp32)
        kbuf, vbuf:  dtype[T, H, D] contiguous     one layer's buffers
        rows:        i64[N]                        destination rows, in [0, T)
        scratch:     i32[APPEND_SCRATCH]           working space (any contents)
        sticky:      bool[]                        set to True for a bad frame, never cleared
    """
    dev = kbuf.device
    if not (k.dtype == v.dtype == kbuf.dtype == vbuf.dtype) or k.dtype not in _APPEND_DTYPES:
        raise ValueError(f"k, v, kbuf, vbuf: expected one dtype of {list(_APPEND_DTYPES)}, got "
                         f"{k.dtype}, {v.dtype}, {kbuf.dtype}, {vbuf.dtype}")
    for name, t in (("k", k), ("v", v), ("kbuf", kbuf), ("vbuf", vbuf), ("rows", rows), ("scratch", scratch),
                    ("sticky", sticky)):
        if t.device != dev or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor on {dev}, got {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    if rows.dtype != torch.int64 or scratch.dtype != torch.int32 or scratch.numel() < APPEND_SCRATCH \
            or sticky.dtype != torch.bool:
        raise ValueError(f"rows, scratch, sticky: expected i64[N], i32[>={APPEND_SCRATCH}], bool[], got "
                         f"{rows.dtype}, {scratch.dtype}[{scratch.numel()}], {sticky.dtype}")
    row_bytes = k[0].numel() * k.element_size()
    code = _lib(dev).jaxkv_frame_append(
        torch.cuda.current_stream(dev).cuda_stream, k.data_ptr(), v.data_ptr(), kbuf.data_ptr(), vbuf.data_ptr(),
        rows.data_ptr(), k.shape[0], row_bytes, trash_row, _APPEND_DTYPES[k.dtype], scratch.data_ptr(),
        sticky.data_ptr())
    _ok(code, "frame_append")


__all__ = ["APPEND_SCRATCH", "csa_rotate_state", "flush_write", "frame_append", "frame_append_available",
           "hca_reset_state"]
