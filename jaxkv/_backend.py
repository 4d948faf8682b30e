"""The one registry of implementations: for each operation, the names ``impl=`` takes,
what each needs to run here, and what ``impl="auto"`` picks.

Every public function with an ``impl=`` argument chooses it here (``choose``), so the
names, the ``auto`` rule and the error for a missing one are written once. The Pallas
kernels use the Mosaic GPU lowering (frame append and attention, the indexer scores, the
pool attention) and run on Hopper only; the ``cuda/`` kernels (flush-write, fused decode
compressor, FP4 packing, dequant-gather, pool attention), reached through ``jax.ffi``, need a GPU and nvcc.
No kernel uses the Pallas Triton lowering. Off a GPU ``"auto"`` is the XLA path, and an
explicit kernel name raises a ``ValueError`` that says why.

| operation | names | auto |
| --- | --- | --- |
| ``frame.attention`` | reference, xla, cudnn, pallas, cuda | pallas on Hopper (head_dim % 64 == 0), cudnn on other NVIDIA GPUs, xla elsewhere or with pow2 pages / f32 caches; an FP8 cache: cuda on Hopper with nvcc and head_dim 64, else xla. ``cuda`` (``kernels.prefix_attention_cuda``) needs Hopper, nvcc, bf16 or FP8 storage and head_dim 64 |
| ``frame.append`` | xla, pallas, cuda | pallas on Hopper (``kernels.write_frame``, Mosaic GPU), else xla; an FP8 cache: cuda on a GPU with nvcc and head_dim 64 (``kernels.write_frame_fp8``, quantized as written), else xla |
| ``frame.move_rows`` | xla, cuda | cuda on a GPU with nvcc (``kernels.move_rows_cuda``: a frame's page moves in every buffer, one launch), else xla |
| ``hybrid.write`` | xla, cuda | cuda on a GPU with nvcc (``kernels.flush_write``; one token per request: ``kernels.compress_decode``), else xla |
| ``hybrid.gather`` | xla, cuda | cuda on a GPU with nvcc (``kernels.dequant_gather``, ``cuda/``), else xla |
| ``hybrid.index_query`` | xla, cuda | cuda on a GPU with nvcc for bf16 queries (``kernels.index_query_cuda``), else xla |
| ``hybrid.after_reads`` | xla, cuda | as hybrid.write (``kernels.after_cuda``: an FFI call that moves nothing) |
| ``hybrid.entry_rows`` | xla, cuda | as hybrid.write (``kernels.entry_rows_cuda``: a CSA layer's row list for the attention kernels, one launch); chosen by ``hybrid.attention``'s kernel paths |
| ``hybrid.index_scores`` | xla, pallas, cuda | cuda on Hopper with nvcc, 64 or 128 index heads, index_dim 128, block_size a multiple of 64 (``kernels.index_scores_cuda``, ``cuda/``); else pallas on Hopper with index heads a multiple of 64 (``kernels.index_scores``, Mosaic GPU); else xla |
| ``hybrid.index_topk`` (``select=``) | xla, cuda | cuda on a GPU with nvcc and k up to the kernel's bound (``kernels.top_k``: a radix select, ``cuda/``), else xla (``lax.top_k``, which sorts) |
| ``hybrid.attention`` | xla, pallas, cuda, flashmla | cuda on Hopper with nvcc, heads a multiple of 64, block_size and window multiples of 32 (``kernels.pool_attention_cuda``, ``cuda/``; both storage families); else pallas on Hopper with jax >= 0.11 and official storage (``kernels.pool_attention_pallas``, Mosaic GPU); else xla. ``flashmla`` (never auto: ``kernels.pool_attention_flashmla``) needs Hopper, nvcc, ``$FLASHMLA_SRC``, 64 or 128 heads and official storage |
| ``torch.attention`` | sdpa, cuda, flashinfer, flashinfer-paged-fa2, flashinfer-paged-fa3 | the torch drop-in's ``backend=``: sdpa on a CPU or with ``force_fp32``; on CUDA paged FA3 with ``fa3`` and FlashInfer (not for FP8 storage), else the first ``TORCH_AUTO_CUDA`` row the frame's tokens reach whose backend can run, else sdpa. ``cuda`` needs sm_90, nvcc, bf16 or FP8 storage and head_dim 64 |
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from jaxkv.cuda import flashmla
from jaxkv.cuda.build import BuildError, nvcc


def is_hopper() -> bool:
    """Whether jax's first device is an sm_90 GPU (the Mosaic GPU kernels' target)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def _cuda_missing(**_) -> str | None:
    if jax.default_backend() != "gpu":
        return f"expected a CUDA GPU visible to jax, got {jax.devices()[0].device_kind}"
    try:
        nvcc()
    except BuildError as e:
        return str(e)
    return None


def _hopper_and(what: str = "", ok: bool = True, got: str = "") -> str | None:
    """None on a Hopper GPU where ``ok``; else why not: "expected ... (``what``), got ... (``got``)"."""
    if is_hopper() and ok:
        return None
    return (
        f"expected an NVIDIA Hopper GPU (sm_90){', ' + what if what else ''}, got "
        f"{jax.devices()[0].device_kind}{', ' + got if got else ''}"
    )


def _sm90_missing(**_) -> str | None:
    return _hopper_and()


def _hopper_missing(*, head_dim: int = 64, **_) -> str | None:
    return _hopper_and("head_dim a multiple of 64", head_dim % 64 == 0, f"head_dim {head_dim}")


POOL_ATTENTION_JAX = (0, 11)  # older Mosaic GPU refuses its row copies (under 128 bytes: tests/kernels)


def _heads_missing(
    *, heads: int = 64, block_size: int = 64, window: int = 128, storage: str = "official", **_
) -> str | None:
    jax_ok = jax.__version_info__[:2] >= POOL_ATTENTION_JAX
    return _hopper_and(
        f"jax >= {'.'.join(map(str, POOL_ATTENTION_JAX))}, heads a multiple of 64, block_size and "
        "window multiples of 32 and official storage",
        jax_ok and heads % 64 == 0 and block_size % 32 == 0 and window % 32 == 0 and storage == "official",
        f"jax {jax.__version__}, {heads} heads, block_size {block_size}, window {window}, {storage} storage",
    )


def _pool_cuda_missing(*, heads: int = 64, block_size: int = 64, window: int = 128, **_) -> str | None:
    why = _hopper_and(
        "heads a multiple of 64, block_size and window multiples of 32",
        heads % 64 == block_size % 32 == window % 32 == 0,
        f"{heads} heads, block_size {block_size}, window {window}",
    )
    return why or _cuda_missing()


def _flashmla_missing(
    *, heads: int = 64, block_size: int = 64, window: int = 128, storage: str = "official", **_
) -> str | None:
    why = _hopper_and(
        "64 or 128 heads, block_size and window multiples of 32 and official storage",
        heads in flashmla.HEADS and block_size % 32 == window % 32 == 0 and storage == "official",
        f"{heads} heads, block_size {block_size}, window {window}, {storage} storage",
    )
    return why or flashmla.missing()


def _select_missing(*, top_k: int = 512, max_top_k: int = 2048, **_) -> str | None:
    if top_k > max_top_k:
        return f"expected top_k at most {max_top_k} (the kernel sorts its picks in shared memory), got {top_k}"
    return _cuda_missing()


def _query_cuda_missing(*, dtype: str = "bfloat16", **_) -> str | None:
    if dtype != "bfloat16":  # the kernel reads bf16 rows; HybridConfig pins index_dim to 128
        return f"expected bfloat16 queries, got {dtype}"
    return _cuda_missing()


def _attention_auto(**ctx) -> str:
    return "cuda" if _pool_cuda_missing(**ctx) is None else "pallas" if _heads_missing(**ctx) is None else "xla"


def _index_missing(*, index_heads: int = 64, index_dim: int = 128, block_size: int = 64, **_) -> str | None:
    return _hopper_and(
        "index heads a multiple of 64, index_dim 128 and block_size a multiple of 64",
        index_heads % 64 == 0 and index_dim == 128 and block_size % 64 == 0,
        f"{index_heads} heads, index_dim {index_dim}, block_size {block_size}",
    )


def _index_cuda_missing(*, index_heads: int = 64, **ctx) -> str | None:
    why = _index_missing(index_heads=index_heads, **ctx) or _hopper_and(
        "64 or 128 index heads", index_heads <= 128, f"{index_heads} heads"
    )
    return why or _cuda_missing()


def _index_auto(**ctx) -> str:
    return "cuda" if not _index_cuda_missing(**ctx) else "xla" if _index_missing(**ctx) else "pallas"


def _prefix_cuda_missing(*, dtype: str = "bfloat16", head_dim: int = 64, **_) -> str | None:
    why = _hopper_and(
        "bfloat16 or float8_e4m3fn storage and head_dim 64",
        dtype in ("bfloat16", "float8_e4m3fn") and head_dim == 64,
        f"{dtype}, head_dim {head_dim}",
    )
    return why or _cuda_missing()


def _cudnn_missing(*, dtype: str = "bfloat16", **_) -> str | None:
    if jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16"):
        return None
    return f"expected an NVIDIA GPU with cuDNN and a bfloat16 or float16 cache, got {jax.devices()[0].device_kind}, {dtype}"


def _float_cache_missing(*, dtype: str = "bfloat16", **_) -> str | None:
    if dtype == "float8_e4m3fn":  # the Pallas kernels read and write bf16 / f16 rows
        return "the Pallas kernels read and write bf16 / f16 rows: an FP8 cache takes impl='xla' or 'cuda'"
    return None


def _frame_kernel_missing(check):
    return lambda **ctx: _float_cache_missing(**ctx) or check(**ctx)


def _fp8_append_missing(*, dtype: str = "bfloat16", head_dim: int = 64, **_) -> str | None:
    if dtype != "float8_e4m3fn" or head_dim != 64:  # the kernel quantizes bf16 rows of 64
        return f"expected an FP8 cache (float8_e4m3fn) with head_dim 64, got {dtype}, head_dim {head_dim}"
    return _cuda_missing()


def _frame_append_auto(*, dtype: str = "bfloat16", head_dim: int = 64, **_) -> str:
    if dtype == "float8_e4m3fn":
        return "xla" if _fp8_append_missing(dtype=dtype, head_dim=head_dim) else "cuda"
    return "pallas" if is_hopper() else "xla"


def _frame_attention_auto(*, pow2_pages: bool = False, dtype: str = "bfloat16", head_dim: int = 64, **_) -> str:
    if dtype == "float8_e4m3fn":  # read in place by the cuda kernel, else dequantized block by block
        return "xla" if pow2_pages or _prefix_cuda_missing(dtype=dtype, head_dim=head_dim) else "cuda"
    if jax.default_backend() == "gpu" and not pow2_pages and dtype in ("bfloat16", "float16"):
        return "pallas" if is_hopper() and head_dim % 64 == 0 else "cudnn"
    return "xla"


# The torch drop-in's attention backends (``torch_bridge.FlashInferKVCacheManager(backend=)``).
# Context, from the torch side: device (str, "cpu" or "cuda:0"), flashinfer (importable),
# cuda_kernel (``jaxkv/cuda/prefix_attention.cu`` runs on that device), dtype (the storage's, str),
# head_dim, force_fp32, fa3, tokens_per_frame. "auto" on CUDA without fa3: the first row whose
# token bound the frame reaches and whose backend can run (docs/torch.md has the measurements).
TORCH_AUTO_CUDA = ((0, "cuda"), (512, "flashinfer"), (0, "flashinfer-paged-fa2"))
TORCH_CUDA_ONLY = ("cuda", "flashinfer", "flashinfer-paged-fa2", "flashinfer-paged-fa3")


def _torch_missing(
    name: str,
    *,
    device: str = "cpu",
    flashinfer: bool = False,
    cuda_kernel: bool = False,
    dtype: str = "bfloat16",
    head_dim: int = 64,
    force_fp32: bool = False,
    **_,
) -> str | None:
    if name in TORCH_CUDA_ONLY and str(device).split(":")[0] != "cuda":
        return f"it needs a CUDA device, and device is {device}"
    if name.startswith("flashinfer") and not flashinfer:
        return "flashinfer is not importable"
    if name == "cuda" and not cuda_kernel:
        return "jaxkv/cuda/prefix_attention.cu needs an sm_90 GPU and nvcc"
    if name == "cuda" and force_fp32:
        return "force_fp32 needs float32 attention and the cuda kernel is bf16 (use 'sdpa' or 'auto')"
    if name.startswith("flashinfer") and force_fp32:
        return "force_fp32 needs float32 attention and FlashInfer has no float32 kernels (use 'sdpa' or 'auto')"
    if name == "cuda" and (dtype not in ("bfloat16", "float8_e4m3fn") or head_dim != 64):
        return f"the cuda kernel expects bfloat16 storage and head_dim 64, got {dtype} and head_dim {head_dim}"
    if name.startswith("flashinfer-paged") and dtype == "float8_e4m3fn":
        return "FP8 storage is attended through its dequantized visible rows (sdpa, cuda, flashinfer), not pages"
    return None


def _torch_auto(**ctx) -> str:
    if ctx.get("force_fp32") or str(ctx.get("device", "cpu")).split(":")[0] != "cuda":
        return "sdpa"
    if ctx.get("fa3") and _torch_missing("flashinfer-paged-fa3", **ctx) is None:
        return "flashinfer-paged-fa3"
    tokens = ctx.get("tokens_per_frame", 0)
    return next((b for least, b in TORCH_AUTO_CUDA if tokens >= least and _torch_missing(b, **ctx) is None), "sdpa")


@dataclasses.dataclass(frozen=True)
class Operation:
    """One operation's implementations.

    names: what ``impl=`` takes besides ``"auto"``; auto(**context) -> a name;
    missing: name -> check(**context) returning why it cannot run here, or None;
    arg: the argument that takes the name, for error messages; refusal: the message for a
    name that cannot run here (fields ``arg``, ``impl``, ``operation``, ``choices``, ``why``).
    """

    name: str
    names: tuple[str, ...]
    auto: Callable[..., str]
    missing: dict[str, Callable[..., str | None]] = dataclasses.field(default_factory=dict)
    arg: str = "impl"
    refusal: str = "{arg}={impl!r} for {operation}: {why}"

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto",) + self.names


def _cuda_op(name: str, names: tuple[str, ...] = ("xla", "cuda")) -> Operation:
    return Operation(name, names, lambda **_: "xla" if _cuda_missing() else "cuda", {"cuda": _cuda_missing})


OPERATIONS = {
    op.name: op
    for op in (
        Operation(
            "frame.attention",
            ("reference", "xla", "cudnn", "pallas", "cuda"),
            _frame_attention_auto,
            {"cudnn": _cudnn_missing, "pallas": _frame_kernel_missing(_hopper_missing), "cuda": _prefix_cuda_missing},
        ),
        Operation(
            "frame.append",
            ("xla", "pallas", "cuda"),
            _frame_append_auto,
            {"pallas": _frame_kernel_missing(_sm90_missing), "cuda": _fp8_append_missing},
        ),
        _cuda_op("frame.move_rows"),
        _cuda_op("hybrid.write"),
        _cuda_op("hybrid.gather"),
        Operation(
            "hybrid.index_query",
            ("xla", "cuda"),
            lambda **ctx: "xla" if _query_cuda_missing(**ctx) else "cuda",
            {"cuda": _query_cuda_missing},
        ),
        _cuda_op("hybrid.after_reads"),
        _cuda_op("hybrid.entry_rows"),
        Operation(
            "hybrid.index_scores",
            ("xla", "pallas", "cuda"),
            _index_auto,
            {"pallas": _index_missing, "cuda": _index_cuda_missing},
        ),
        Operation(
            "hybrid.index_topk",
            ("xla", "cuda"),
            lambda **ctx: "xla" if _select_missing(**ctx) else "cuda",
            {"cuda": _select_missing},
            arg="select",
        ),
        Operation(
            "hybrid.attention",
            ("xla", "pallas", "cuda", "flashmla"),
            _attention_auto,
            {"pallas": _heads_missing, "cuda": _pool_cuda_missing, "flashmla": _flashmla_missing},
        ),
        Operation(
            "torch.attention",
            ("sdpa",) + TORCH_CUDA_ONLY,
            _torch_auto,
            {n: functools.partial(_torch_missing, n) for n in TORCH_CUDA_ONLY},
            arg="backend",
            refusal="{arg}: expected one of {choices} that can run here, got {impl!r}: {why}",
        ),
    )
}


def choices(operation: str) -> tuple[str, ...]:
    """The names ``impl=`` takes for ``operation``, ``"auto"`` first."""
    return OPERATIONS[operation].choices


def choose(operation: str, impl: str, **context) -> str:
    """The implementation ``impl`` names for ``operation`` here: ``"auto"`` resolved by the
    operation's rule (``context``: what the rule reads, e.g. ``head_dim``); a ``ValueError``
    naming the argument (``impl``, or the operation's ``arg``) for an unknown name or one that
    cannot run here."""
    op = OPERATIONS[operation]
    if impl not in op.choices:
        raise ValueError(f"{op.arg}: expected one of {op.choices} for {operation}, got {impl!r}")
    if impl == "auto":
        return op.auto(**context)
    why = op.missing.get(impl, lambda **_: None)(**context)
    if why:
        raise ValueError(op.refusal.format(arg=op.arg, impl=impl, operation=operation, choices=op.choices, why=why))
    return impl
