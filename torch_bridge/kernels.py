"""The ``cuda/`` kernels for PyTorch callers, in place on torch tensors: the hybrid
cache's flush (``flush_write``, the tail-state updates), the frame cache's append
(``frame_append``, the drop-in manager's write) and attention over a buffer's visible
prefix (``prefix_attention``, the drop-in's ``backend="cuda"``).

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
import functools

import torch

from jaxkv.cuda import STORAGE_CODES, BuildError, arch_of, library
from jaxkv.formats.storage import STORAGES, storage_name
from jaxkv.kernels.launch import launch as launch_params

_LIBS: dict = {}  # torch.device -> the typed library (a dict lookup per launch, not a device query)


def _lib(device: torch.device):
    lib = _LIBS.get(device)
    if lib is None:
        lib = _LIBS[device] = _typed(library(arch_of(torch.cuda.get_device_capability(device))))
    return lib


def _typed(lib):
    if not getattr(lib, "_jaxkv_typed", False):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        lib.jaxkv_flush_write.argtypes = [p, p, p, p, p, p, p, i64, i64, i32, i32]
        lib.jaxkv_tail_state.argtypes = [p, p, i64, i32, i32, p, i64]
        lib.jaxkv_frame_append.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i32, p, p]
        lib.jaxkv_prefix_attention.argtypes = [
            p,
            p,
            p,
            p,
            p,
            i32,
            p,
            p,
            p,
            i64,
            i32,
            i32,
            i32,
            i32,
            i64,
            i64,
            i64,
            i64,
            i32,
            ctypes.c_float,
            i32,
            i32,
        ]
        fp8 = lib.jaxkv_prefix_attention.argtypes
        lib.jaxkv_prefix_attention_fp8.argtypes = fp8[:4] + [p, p] + fp8[4:18] + [i64, i64] + fp8[18:]
        for f in (
            lib.jaxkv_flush_write,
            lib.jaxkv_tail_state,
            lib.jaxkv_frame_append,
            lib.jaxkv_prefix_attention,
            lib.jaxkv_prefix_attention_fp8,
        ):
            f.restype = ctypes.c_int
        lib._jaxkv_typed = True
    return lib


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch


def _stream(device: torch.device) -> int:
    """torch's current stream on ``device`` as a ``cudaStream_t`` (the raw query where torch has
    it: cheaper per launch than a ``torch.cuda.Stream``; docs/torch.md)."""
    if _RAW_STREAM is not None and device.index is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _check(name, t, dtype, ndim, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.ndim != ndim or not t.is_cuda or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous CUDA {dtype} tensor of rank {ndim}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
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
            raise ValueError(
                f"index_pool, xi: expected u8{list(want)} and bf16[{n}, 128], got "
                f"{tuple(index_pool.shape)} and {tuple(xi.shape)}"
            )
    stream = _stream(dev)
    code = _lib(dev).jaxkv_flush_write(
        stream,
        pool.data_ptr(),
        None if index_pool is None else index_pool.data_ptr(),
        x.data_ptr(),
        None if xi is None else xi.data_ptr(),
        block.data_ptr(),
        slot.data_ptr(),
        n,
        pool.shape[0],
        bs,
        STORAGE_CODES[storage],
    )
    _ok(code, "flush_write")


def _tail_state(tails, tail_slot, streams: int) -> None:
    _check("tails", tails, torch.float32, 4)
    _check("tail_slot", tail_slot, torch.int32, 1, tails.device)
    if tuple(tails.shape[1:3]) != (streams, 3):
        raise ValueError(f"tails: expected f32[R, {streams}, 3, width], got {tuple(tails.shape)}")
    stream = _stream(tails.device)
    code = _lib(tails.device).jaxkv_tail_state(
        stream, tails.data_ptr(), tails.shape[0], streams, tails.shape[3], tail_slot.data_ptr(), tail_slot.shape[0]
    )
    _ok(code, "tail state")


def csa_rotate_state(tails, tail_slot) -> None:
    """After a CSA flush: previous-b <- current-b, current a / b emptied (in place)."""
    _tail_state(tails, tail_slot, 3)


def hca_reset_state(tails, tail_slot) -> None:
    """After an HCA flush: the stream emptied (in place)."""
    _tail_state(tails, tail_slot, 1)


_APPEND_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # jaxkv/cuda/frame_append.cu's codes
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
    per-frame hot path) beyond what keeps the writes inside the buffers; dtypes, devices and
    contiguity are checked here.

        k, v:        dtype[N, H, D] contiguous     the frame (dtype bf16, fp16 or fp32)
        kbuf, vbuf:  dtype[T, H, D] contiguous     one layer's buffers
        rows:        i64[N]                        destination rows; one outside [0, T) goes to trash_row
        scratch:     i32[APPEND_SCRATCH]           working space (any contents)
        sticky:      bool[]                        set to True for a bad frame, never cleared
    """
    dev = kbuf.device
    if not (k.dtype == v.dtype == kbuf.dtype == vbuf.dtype) or k.dtype not in _APPEND_DTYPES:
        raise ValueError(
            f"k, v, kbuf, vbuf: expected one dtype of {list(_APPEND_DTYPES)}, got "
            f"{k.dtype}, {v.dtype}, {kbuf.dtype}, {vbuf.dtype}"
        )
    for name, t in (
        ("k", k),
        ("v", v),
        ("kbuf", kbuf),
        ("vbuf", vbuf),
        ("rows", rows),
        ("scratch", scratch),
        ("sticky", sticky),
    ):
        if t.device != dev or not t.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous tensor on {dev}, got {t.device}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}"
            )
    if (
        rows.dtype != torch.int64
        or scratch.dtype != torch.int32
        or scratch.numel() < APPEND_SCRATCH
        or sticky.dtype != torch.bool
    ):
        raise ValueError(
            f"rows, scratch, sticky: expected i64[N], i32[>={APPEND_SCRATCH}], bool[], got "
            f"{rows.dtype}, {scratch.dtype}[{scratch.numel()}], {sticky.dtype}"
        )
    if k.shape != v.shape or kbuf.shape != vbuf.shape or k[0].shape != kbuf[0].shape or rows.shape != k.shape[:1]:
        raise ValueError(  # the kernel trusts these sizes: a smaller buffer would be written past its end
            f"k, v, kbuf, vbuf, rows: expected k, v [N, *row], kbuf, vbuf [T, *row] and rows [N], got "
            f"{list(k.shape)}, {list(v.shape)}, {list(kbuf.shape)}, {list(vbuf.shape)}, {list(rows.shape)}"
        )
    if not 0 <= trash_row < kbuf.shape[0]:
        raise ValueError(f"trash_row: expected a row in [0, {kbuf.shape[0]}), got {trash_row}")
    row_bytes = k[0].numel() * k.element_size()
    code = _lib(dev).jaxkv_frame_append(
        _stream(dev),
        k.data_ptr(),
        v.data_ptr(),
        kbuf.data_ptr(),
        vbuf.data_ptr(),
        rows.data_ptr(),
        k.shape[0],
        row_bytes,
        trash_row,
        kbuf.shape[0],
        _APPEND_DTYPES[k.dtype],
        scratch.data_ptr(),
        sticky.data_ptr(),
    )
    _ok(code, "frame_append")


PREFIX_HEAD_DIM = 64  # jaxkv/cuda/prefix_attention.cu


def prefix_attention_available(device) -> bool:
    """Whether ``prefix_attention`` runs on ``device``: an sm_90 GPU, and the library builds."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return frame_append_available(device)


def _strides(name, t, rank):
    """(batch, row) strides in elements of a [.., rows, heads, 64] tensor whose heads are contiguous."""
    if t.stride(-1) != 1 or t.stride(-2) != PREFIX_HEAD_DIM:
        raise ValueError(
            f"{name}: expected its last two dims [heads, {PREFIX_HEAD_DIM}] contiguous, got strides {tuple(t.stride())}"
        )
    return (t.stride(0) if rank == 4 else 0), t.stride(-3)


@functools.cache
def _prefix_launch(device: torch.device) -> tuple[int, int]:
    """The device's row of ``jaxkv.kernels.launch`` ("prefix_attention_cuda"), looked up once."""
    shape = launch_params("prefix_attention_cuda", torch.cuda.get_device_name(device))
    return shape["block_kv"], shape["stages"]


def prefix_attention(q, k, v, kv_len: int, *, scale=None, splits: int = 1, out=None, launch=None):
    """Attention of ``q`` over the keys ``[0, kv_len)`` of ``k`` / ``v`` (``jaxkv/cuda/prefix_attention.cu``,
    on torch's current stream; ``jaxkv.kernels.prefix_attention_cuda``'s kernel). bf16,
    head_dim 64, sm_90.

        q:      bf16[Tq, Hq, 64]   (or [B, Tq, Hq, 64]) heads contiguous, rows strided
        k, v:   bf16[T, H, 64]     (or [B, T, H, 64]) likewise; Hq a multiple of H (GQA)
        kv_len: int                visible keys, the same for every batch entry (clipped to T)
        splits: key chunks run by separate CTAs and merged (few queries: fills the SMs)
        out:    bf16 like q, contiguous (written and returned), or None
        launch: (block_kv, stages), one of the shapes the kernel builds; None: the device's
                row of ``jaxkv.kernels.launch`` ("prefix_attention_cuda")
    -> bf16 like q; zeros where kv_len == 0
    """
    batched = q.ndim == 4
    rank = 4 if batched else 3
    for name, t in (("q", q), ("k", k), ("v", v)):
        if (
            not isinstance(t, torch.Tensor)
            or t.ndim != rank
            or t.dtype != torch.bfloat16
            or not t.is_cuda
            or t.shape[-1] != PREFIX_HEAD_DIM
        ):
            raise ValueError(
                f"{name}: expected a CUDA bfloat16 tensor [{'B, ' if batched else ''}rows, heads, "
                f"{PREFIX_HEAD_DIM}], got {getattr(t, 'dtype', type(t).__name__)} "
                f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', '?')}"
            )
    dev = q.device
    if k.device != dev or v.device != dev or k.shape != v.shape or k.stride() != v.stride():
        raise ValueError(
            f"k, v: expected alike and on {dev}, got {tuple(k.shape)} on {k.device} and {tuple(v.shape)} on {v.device}"
        )
    B = q.shape[0] if batched else 1
    Tq, Hq = q.shape[-3], q.shape[-2]
    T, H = k.shape[-3], k.shape[-2]
    if (batched and k.shape[0] != B) or Hq % H:
        raise ValueError(
            f"k: expected [{f'{B}, ' if batched else ''}T, H, 64] with {Hq} a multiple of H, got {tuple(k.shape)}"
        )
    if splits < 1:
        raise ValueError(f"splits: expected >= 1, got {splits}")
    qb, qr = _strides("q", q, rank)
    kb, kr = _strides("k", k, rank)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != dev or not out.is_contiguous():
        raise ValueError(
            f"out: expected a contiguous bf16 tensor {tuple(q.shape)} on {dev}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    scale = PREFIX_HEAD_DIM**-0.5 if scale is None else float(scale)
    _launch_prefix(
        _lib(dev).jaxkv_prefix_attention,
        dev,
        q,
        k,
        v,
        max(0, min(int(kv_len), T)),
        out,
        B,
        Tq,
        Hq,
        T,
        H,
        qb,
        qr,
        kb,
        kr,
        splits,
        scale,
        launch or _prefix_launch(dev),
    )
    return out


def _launch_prefix(fn, dev, q, k, v, kv_len, out, B, Tq, Hq, T, H, qb, qr, kb, kr, splits, scale, launch, scales=()):
    """One launch of ``jaxkv/cuda/prefix_attention.cu`` (arguments checked by the caller); a key-split
    launch gets its f32 partials and log-sum-exps from torch's allocator, on this stream.
    scales: () for bf16 K/V; for FP8 codes, (k_scale, v_scale) bf16[rows, H], contiguous."""
    part = lse = None
    if splits > 1:
        part = torch.empty((B * splits, Tq, Hq, PREFIX_HEAD_DIM), dtype=torch.float32, device=dev)
        lse = torch.empty((B * splits, Hq, Tq), dtype=torch.float32, device=dev)
    block_kv, stages = launch
    fp8 = [x.data_ptr() for x in scales]
    code = fn(
        _stream(dev),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        *fp8,
        None,
        kv_len,
        out.data_ptr(),
        None if part is None else part.data_ptr(),
        None if lse is None else lse.data_ptr(),
        B,
        Tq,
        Hq,
        T,
        H,
        qb,
        qr,
        kb,
        kr,
        *((0, H) if fp8 else ()),
        splits,
        scale,
        block_kv,
        stages,
    )
    if code == 801:
        raise ValueError(f"prefix_attention: expected an sm_90 GPU, got {torch.cuda.get_device_name(dev)}")
    if code == 1:
        raise ValueError(f"launch: expected a shape jaxkv/cuda/prefix_attention.cu builds, got {(block_kv, stages)}")
    _ok(code, "prefix_attention")


class PrefixAttention:
    """``prefix_attention`` split as FlashInfer splits its wrappers: ``plan`` (host side: the
    checks and everything the launches of one step share) once, then ``run`` per layer,
    checked only against the plan. The drop-in manager plans once per frame, so a layer's
    attention costs one launch and a few attribute reads of host time.

        q, out: bf16[q_len, heads, 64] contiguous
        k, v:   bf16[rows, kv_heads, 64] contiguous (one layer's whole buffers), rows >= kv_len;
                the keys [0, kv_len) are attended; or an FP8 cache's codes (float8_e4m3fn or
                their uint8 view, rows even) with ``run``'s k_scale, v_scale bf16[rows, kv_heads]
    """

    def __init__(self, device, heads: int, kv_heads: int, *, scale=None, launch=None):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not prefix_attention_available(device):
            raise ValueError(f"device: expected an sm_90 CUDA GPU where the jaxkv library builds, got {device}")
        if heads < 1 or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"heads, kv_heads: expected heads a multiple of kv_heads, got {heads}, {kv_heads}")
        self.device, self.heads, self.kv_heads = device, heads, kv_heads
        self.scale = PREFIX_HEAD_DIM**-0.5 if scale is None else float(scale)
        self.launch = launch or _prefix_launch(device)
        self._fn = _lib(device).jaxkv_prefix_attention
        self._fn_fp8 = _lib(device).jaxkv_prefix_attention_fp8
        self._q_shape = None  # (q_len, heads, 64) once planned
        self._kv_len = self._splits = 0

    def plan(self, q_len: int, kv_len: int, splits: int = 1) -> None:
        """The next runs attend ``q_len`` query rows over keys ``[0, kv_len)``, in ``splits`` key
        chunks merged by the launch (``jaxkv.kernels.launch.prefix_cuda_splits`` picks them)."""
        for name, x, low in (("q_len", q_len, 1), ("kv_len", kv_len, 0), ("splits", splits, 1)):
            if isinstance(x, bool) or not isinstance(x, int) or x < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {x!r}")
        self._q_shape = (q_len, self.heads, PREFIX_HEAD_DIM)
        self._kv_len, self._splits = kv_len, splits

    def run(self, q, k, v, out=None, k_scale=None, v_scale=None):
        """Attention of one layer -> ``out`` (or a new tensor), bf16[q_len, heads, 64]. With
        ``k_scale`` / ``v_scale``, k and v are FP8 codes read in place (class docstring)."""
        fp8 = k_scale is not None or v_scale is not None
        kv_dtypes = (torch.float8_e4m3fn, torch.uint8) if fp8 else (torch.bfloat16,)
        if self._q_shape is None:
            raise RuntimeError("PrefixAttention.run: call plan() first")
        if q.shape != self._q_shape or q.dtype != torch.bfloat16 or q.device != self.device or not q.is_contiguous():
            raise ValueError(
                f"q: expected a contiguous bf16 tensor {list(self._q_shape)} on {self.device} (the "
                f"plan), got {q.dtype} {tuple(q.shape)} on {q.device}"
            )
        T = k.shape[0]
        if (
            k.shape != v.shape
            or k.shape[1:] != (self.kv_heads, PREFIX_HEAD_DIM)
            or T < self._kv_len
            or k.dtype not in kv_dtypes
            or v.dtype not in kv_dtypes
            or k.device != self.device
            or v.device != self.device
            or not (k.is_contiguous() and v.is_contiguous())
        ):
            raise ValueError(
                f"k, v: expected contiguous {'FP8 codes' if fp8 else 'bf16'} [rows >= {self._kv_len}, "
                f"{self.kv_heads}, {PREFIX_HEAD_DIM}] on {self.device}, got {k.dtype} {tuple(k.shape)} on "
                f"{k.device} and {v.dtype} {tuple(v.shape)} on {v.device}"
            )
        scales = ()
        if fp8:
            for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
                if (
                    not isinstance(x, torch.Tensor)
                    or x.shape != k.shape[:2]
                    or x.dtype != torch.bfloat16
                    or x.device != self.device
                    or not x.is_contiguous()
                ):
                    raise ValueError(
                        f"{name}: expected a contiguous bf16 tensor {list(k.shape[:2])} on {self.device} (a scale "
                        f"per row and head), got {getattr(x, 'dtype', type(x).__name__)} "
                        f"{tuple(getattr(x, 'shape', ()))}"
                    )
            if T % 2:
                raise ValueError(f"k: expected an even number of rows for FP8 codes, got {T}")
            scales = (k_scale, v_scale)
        if out is None:
            out = torch.empty(self._q_shape, dtype=torch.bfloat16, device=self.device)
        elif (
            out.shape != self._q_shape
            or out.dtype != torch.bfloat16
            or out.device != self.device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out: expected a contiguous bf16 tensor {list(self._q_shape)} on {self.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )
        Tq, Hq, n = self._q_shape[0], self.heads, self._kv_len
        # The kernel sees rows [0, n) only (its key splits divide those rows, as for k[:n]).
        _launch_prefix(
            self._fn_fp8 if fp8 else self._fn,
            self.device,
            q,
            k,
            v,
            n,
            out,
            1,
            Tq,
            Hq,
            n,
            self.kv_heads,
            0,
            Hq * PREFIX_HEAD_DIM,
            0,
            self.kv_heads * PREFIX_HEAD_DIM,
            self._splits,
            self.scale,
            self.launch,
            scales,
        )
        return out


__all__ = [
    "APPEND_SCRATCH",
    "PREFIX_HEAD_DIM",
    "PrefixAttention",
    "csa_rotate_state",
    "flush_write",
    "frame_append",
    "frame_append_available",
    "hca_reset_state",
    "prefix_attention",
    "prefix_attention_available",
]
