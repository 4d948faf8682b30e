"""FlashMLA's Hopper sparse FP8 decode (DeepSeek-V4, FlashMLA's "MODEL1") on jaxkv's pool
bytes: an optional contender to jaxkv's own sparse attention, built on first use.

Why it can read jaxkv's pools as they are: the ``official`` storage family is FlashMLA's
MODEL1 block byte for byte (``bs`` x [448 FP8 e4m3 + 64 BF16 rope dims], then ``bs`` x
[7 UE8M0 tile scales + 1 pad]), so a layer's pool is handed over as a view, no copy. The
``per_entry`` family cannot be read: its f32 per-entry scale and entry size are no layout
FlashMLA has (MODEL1 wants UE8M0 per 64 dims after the block's data; V3.2 wants 512 FP8
dims with 4 f32 scales per 128), so there it raises.

Nothing of FlashMLA lives in this package. ``load`` compiles the sm90 sparse decode alone
(5 translation units, the binding and stubs written below) from a FlashMLA source tree:
``load(src)`` or ``$FLASHMLA_SRC`` -- a checkout with its ``csrc/cutlass`` submodule, or the
trimmed tree ``tools/flashmla_tree.sh`` makes in ``.upstream/flashmla``. The extension is cached under
``$FLASHMLA_BUILD`` if set, else ``$JAXKV_CACHE_DIR`` (default ``~/.cache/jaxkv``)
``/flashmla/<key>/``, the key hashing the sources, flags, torch and nvcc.

Imports torch, the standard library and ``jaxkv.cuda.flashmla`` (the FlashMLA file list and
flags, shared with the JAX FFI build of the same kernels); ``import jaxkv`` does not import it. jax
arrays cross with ``torch.from_dlpack`` (``torch_bridge.to_torch``): zero-copy views.
The kernels run on torch's current stream of the tensors' device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import threading
from pathlib import Path

import torch

from jaxkv.cuda.flashmla import HEADS, INCLUDES, KEYED, NVCC_FLAGS, SOURCES, source_dir

HEAD_DIM = 512  # q / entry dims FlashMLA's MODEL1 path takes (448 FP8 nope + 64 BF16 rope)
TOPK_BLOCK = 64  # the kernel walks indices 64 at a time: topk and window widths are multiples
# FlashMLA's MODEL1 bytes per token (its api/sparse_decode.h computes it so); equal to
# jaxkv.formats.storage.entry_bytes("official"), which tests/torch_bridge/test_flashmla.py checks.
_NOPE, _ROPE, _TILE = 448, 64, 64
MODEL1_ENTRY_BYTES = _NOPE + 2 * _ROPE + _NOPE // _TILE + 1  # 584

# --- build: the FlashMLA files, includes and nvcc flags are jaxkv.cuda.flashmla's (its FFI build compiles the same) ---
CXX_FLAGS = ("-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations")

# The binding: FlashMLA's api.cpp binds every kernel family; this one binds the sparse decode.
_BINDING = r"""// written by jaxkv torch_bridge.flashmla: FlashMLA's sparse FP8 decode alone
#include <pybind11/pybind11.h>
#include "api/sparse_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA sparse FP8 decode (sm90 MODEL1), built by jaxkv torch_bridge.flashmla";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
"""
BINDING_HEADERS = ("sm100/decode/head64/kernel.h", "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h")
# The kernels left out (V3.2's layout, the sm100 paths): api/sparse_decode.h's dispatcher
# names them, so they are defined here to raise instead of being compiled.
_STUBS = r"""// written by jaxkv torch_bridge.flashmla: kernels this build leaves out raise
#include <torch/extension.h>
#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "sm100/decode/head64/kernel.h"  // BINDING_HEADERS
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

[[noreturn]] static void not_built(const char *what) {
    TORCH_CHECK(false, "FlashMLA (jaxkv build): ", what, " is not built; only the sm90 MODEL1 sparse decode is");
}

namespace sm90::decode::sparse_fp8 {
template<> void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 64>(const SparseAttnDecodeParams &) { not_built("the V3.2 layout"); }
template<> void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(const SparseAttnDecodeParams &) { not_built("the V3.2 layout"); }
}
namespace sm100::decode::head64 {
template<> void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams &) { not_built("sm100"); }
template<> void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams &) { not_built("sm100"); }
}
namespace sm100::fwd_for_small_topk::head128 {
template<> void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(const SparseAttnDecodeParams &) { not_built("sm100"); }
}
"""

_lock = threading.Lock()
_module = None


def _nvcc_version() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        raise RuntimeError("FlashMLA build: no CUDA toolkit found (torch's CUDA_HOME is None); set CUDA_HOME")
    nvcc = Path(CUDA_HOME) / "bin" / "nvcc"
    return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout


def _key(csrc: Path) -> str:
    h = hashlib.sha256()
    for f in KEYED:
        h.update((csrc / f).read_bytes())
    for part in (_BINDING, _STUBS, " ".join(CXX_FLAGS), " ".join(NVCC_FLAGS), torch.__version__,
                 str(torch.version.cuda), _nvcc_version()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_dir(csrc: Path) -> Path:
    """Where the extension of ``csrc`` is built: ``$FLASHMLA_BUILD``, else the keyed cache."""
    if os.environ.get("FLASHMLA_BUILD"):
        return Path(os.environ["FLASHMLA_BUILD"]).expanduser()
    cache = Path(os.environ.get("JAXKV_CACHE_DIR", Path.home() / ".cache" / "jaxkv"))
    return cache / "flashmla" / _key(csrc)


def load(src=None, *, verbose: bool = False):
    """The compiled extension (``sparse_decode_fwd``), built on the first call from ``src``
    or ``$FLASHMLA_SRC``; later calls return the same module."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        csrc = source_dir(src)
        absent = [h for h in BINDING_HEADERS if not (csrc / h).is_file()]
        if absent:  # the FFI build needs only the sm90 files; this binding's dispatcher names the rest
            raise ImportError(f"{csrc.parent}: FlashMLA's torch binding also needs {', '.join(absent)} under csrc/ "
                              "(its api/sparse_decode.h includes them)")
        if not torch.cuda.is_available() or torch.version.cuda is None:
            raise RuntimeError("FlashMLA needs a CUDA build of torch and a GPU")
        from torch.utils import cpp_extension

        out = build_dir(csrc)
        out.mkdir(parents=True, exist_ok=True)
        glue = []
        for name, text in (("jaxkv_binding.cpp", _BINDING), ("jaxkv_stubs.cpp", _STUBS)):
            path = out / name
            if not path.is_file() or path.read_text() != text:  # rewritten only on change: no rebuild
                path.write_text(text)
            glue.append(str(path))
        _module = cpp_extension.load(
            name="jaxkv_flashmla", sources=glue + [str(csrc / s) for s in SOURCES],
            extra_include_paths=[str(csrc / i) for i in INCLUDES], extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=list(NVCC_FLAGS), build_directory=str(out), verbose=verbose)
        return _module


# --- the call ------------------------------------------------------------------------------
@dataclasses.dataclass
class Schedule:
    """FlashMLA's split-KV tile schedule, made by the first ``sparse_decode`` given this
    object and reused by later ones: valid while the shapes and the ``topk_length`` /
    ``window_length`` values stay the same (a decode step's layers share one)."""

    tile_scheduler_metadata: torch.Tensor | None = None  # i32[num_sm_parts, 8]
    num_splits: torch.Tensor | None = None  # i32[B + 1]


def _check(name, t, dtype, ndim, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.ndim != ndim or not t.is_cuda:
        raise ValueError(f"{name}: expected a CUDA {dtype} tensor of rank {ndim}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
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
        raise ValueError(f"{name}: expected an official-family pool u8[num_blocks, {block_size} * "
                         f"{MODEL1_ENTRY_BYTES}], got {tuple(pool.shape)} (the per_entry family cannot be read)")
    if pool.data_ptr() % 16 or pool.stride(0) % 16:  # the kernel loads 16 B vectors from each block
        raise ValueError(f"{name}: expected 16-byte aligned blocks (an even block_size), got block stride "
                         f"{pool.stride(0)} B at address {pool.data_ptr():#x}")
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


def sparse_decode(q, pool, indices, *, block_size: int, sink, scale: float, window=None, window_indices=None,
                  topk_length=None, window_length=None, schedule: Schedule | None = None):
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
    mod = load()
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
        raise ValueError(f"indices: expected i32[{B}, {T}, K] with K a positive multiple of {TOPK_BLOCK}, "
                         f"got {tuple(indices.shape)}")
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
            raise ValueError(f"window_indices: expected i32[{B}, {T}, W] with W a positive multiple of "
                             f"{TOPK_BLOCK}, got {tuple(w)}")
    elif window_length is not None:
        raise ValueError("window_length: given without window")
    sched = schedule if schedule is not None else Schedule()
    out, lse, sched.tile_scheduler_metadata, sched.num_splits = mod.sparse_decode_fwd(
        q, k_cache, indices, topk_length, sink, sched.tile_scheduler_metadata, sched.num_splits,
        extra, window_indices, window_length, HEAD_DIM, float(scale))
    return out, lse


__all__ = ["Schedule", "entry_ids", "kv_view", "load", "sparse_decode", "window_ids"]
