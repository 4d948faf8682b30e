"""The one registry of implementations: for each operation, the names ``impl=`` takes,
what each needs to run here, and what ``impl="auto"`` picks.

Every public function with an ``impl=`` argument resolves it here (``resolve``), so the
names, the ``auto`` rule and the error for a missing one are written once. The Mosaic GPU
kernels (frame append and attention, the indexer scores, the pool attention) run on Hopper
only; the ``cuda/`` kernels need a GPU and nvcc. Three kernels still use the Pallas Triton
lowering that JAX 0.11 deprecates (FP4 packing, the flush-write, the fused decode
compressor); they run natively on a GPU and in Pallas interpret mode elsewhere
(``interpret``). In a jax without that lowering, ``"auto"`` falls back to the XLA path
(same bytes, slower) and an explicit ``impl="pallas"`` raises a ``ValueError`` that says
so, instead of an ImportError from inside a trace. An old name in ``Operation.renamed``
still resolves, with a ``DeprecationWarning``, for one release.

| operation | names | auto |
| --- | --- | --- |
| ``frame.attention`` | reference, xla, cudnn, pallas | pallas on Hopper (head_dim % 64 == 0), cudnn on other NVIDIA GPUs, xla elsewhere or with pow2 pages / f32 caches |
| ``frame.append`` | xla, pallas | pallas on Hopper (``kernels.frame_append``, Mosaic GPU), else xla |
| ``hybrid.write`` | xla, cuda, pallas | pallas on a GPU with the Triton lowering, else xla (cuda: built with nvcc on first use) |
| ``hybrid.gather`` | xla, cuda | cuda on a GPU with nvcc (``kernels.dequant_gather``, ``cuda/``), else xla; ``pallas`` is read as ``cuda`` for one release |
| ``hybrid.index_query`` | xla, pallas | as hybrid.write |
| ``hybrid.index_scores`` | xla, pallas | pallas on Hopper with index heads a multiple of 64, index_dim 128, block_size a multiple of 64 (``kernels.index_scores``, Mosaic GPU), else xla |
| ``hybrid.attention`` | xla, pallas | pallas on Hopper with jax >= 0.11, heads a multiple of 64, block_size and window multiples of 32, official storage (``kernels.pool_attention``, Mosaic GPU), else xla |
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from typing import Callable

import jax

from jaxkv.cuda.build import BuildError, nvcc


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether this jax still has the Pallas Triton lowering the kernels are written for."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return False
    return True


def interpret() -> bool:
    """Interpret mode for the kernels: off a GPU."""
    return jax.default_backend() != "gpu"


def is_hopper() -> bool:
    """Whether jax's first device is an sm_90 GPU (the Mosaic GPU kernels' target)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def auto_impl() -> str:
    """``"pallas"`` on a GPU whose jax has the Triton lowering, else ``"xla"``."""
    return "pallas" if not interpret() and has_triton() else "xla"


def _triton_missing(**_) -> str | None:
    if has_triton():
        return None
    return (f"jax {jax.__version__} has no Pallas Triton lowering (jax.experimental.pallas.triton), which this "
            "kernel uses; pass impl='xla' or impl='auto', which falls back to it")


def _cuda_missing(**_) -> str | None:
    if jax.default_backend() != "gpu":
        return f"expected a CUDA GPU visible to jax, got {jax.devices()[0].device_kind}"
    try:
        nvcc()
    except BuildError as e:
        return str(e)
    return None


def _sm90_missing(**_) -> str | None:
    if is_hopper():
        return None
    return f"expected an NVIDIA Hopper GPU (sm_90), got {jax.devices()[0].device_kind}"


def _hopper_missing(*, head_dim: int = 64, **_) -> str | None:
    if is_hopper() and head_dim % 64 == 0:
        return None
    return (f"expected an NVIDIA Hopper GPU (sm_90) and head_dim a multiple of 64, got "
            f"{jax.devices()[0].device_kind} and head_dim {head_dim}")


POOL_ATTENTION_JAX = (0, 11)  # older Mosaic GPU refuses its row copies (under 128 bytes: tests/kernels)


def _heads_missing(*, heads: int = 64, block_size: int = 64, window: int = 128, storage: str = "official",
                   **_) -> str | None:
    if (is_hopper() and heads % 64 == 0 and block_size % 32 == 0 and window % 32 == 0 and storage == "official"
            and jax.__version_info__[:2] >= POOL_ATTENTION_JAX):
        return None
    return (f"expected an NVIDIA Hopper GPU (sm_90), jax >= {'.'.join(map(str, POOL_ATTENTION_JAX))}, heads a "
            f"multiple of 64, block_size and window multiples of 32 and official storage, got "
            f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {heads} heads, block_size {block_size}, "
            f"window {window}, {storage} storage")


def _index_missing(*, index_heads: int = 64, index_dim: int = 128, block_size: int = 64, **_) -> str | None:
    if is_hopper() and index_heads % 64 == 0 and index_dim == 128 and block_size % 64 == 0:
        return None
    return (f"expected an NVIDIA Hopper GPU (sm_90), index heads a multiple of 64, index_dim 128 and block_size a "
            f"multiple of 64, got {jax.devices()[0].device_kind}, {index_heads} heads, index_dim {index_dim}, "
            f"block_size {block_size}")


def _frame_attention_auto(*, pow2_pages: bool = False, dtype: str = "bfloat16", head_dim: int = 64, **_) -> str:
    if jax.default_backend() == "gpu" and not pow2_pages and dtype in ("bfloat16", "float16"):
        return "pallas" if is_hopper() and head_dim % 64 == 0 else "cudnn"
    return "xla"


@dataclasses.dataclass(frozen=True)
class Operation:
    """One operation's implementations.

    names: what ``impl=`` takes besides ``"auto"``; auto(**context) -> a name;
    missing: name -> check(**context) returning why it cannot run here, or None.
    """

    name: str
    names: tuple[str, ...]
    auto: Callable[..., str]
    missing: dict[str, Callable[..., str | None]] = dataclasses.field(default_factory=dict)
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)  # old name -> name, kept one release

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto",) + self.names


def _triton_op(name: str, names: tuple[str, ...]) -> Operation:
    return Operation(name, names, lambda **_: auto_impl(), {"pallas": _triton_missing})


OPERATIONS = {op.name: op for op in (
    Operation("frame.attention", ("reference", "xla", "cudnn", "pallas"), _frame_attention_auto,
              {"pallas": _hopper_missing}),
    Operation("frame.append", ("xla", "pallas"), lambda **_: "pallas" if is_hopper() else "xla",
              {"pallas": _sm90_missing}),
    _triton_op("hybrid.write", ("xla", "cuda", "pallas")),
    Operation("hybrid.gather", ("xla", "cuda"), lambda **_: "xla" if _cuda_missing() else "cuda",
              {"cuda": _cuda_missing}, renamed={"pallas": "cuda"}),
    _triton_op("hybrid.index_query", ("xla", "pallas")),
    Operation("hybrid.index_scores", ("xla", "pallas"),
              lambda **ctx: "xla" if _index_missing(**ctx) else "pallas", {"pallas": _index_missing}),
    Operation("hybrid.attention", ("xla", "pallas"),
              lambda **ctx: "xla" if _heads_missing(**ctx) else "pallas", {"pallas": _heads_missing}),
)}


def choices(operation: str) -> tuple[str, ...]:
    """The names ``impl=`` takes for ``operation``, ``"auto"`` first."""
    return OPERATIONS[operation].choices


def resolve(operation: str, impl: str, **context) -> str:
    """The implementation ``impl`` names for ``operation`` here: ``"auto"`` resolved by the
    operation's rule (``context``: what the rule reads, e.g. ``head_dim``); a ``ValueError``
    naming ``impl`` for an unknown name or one that cannot run here."""
    op = OPERATIONS[operation]
    if impl in op.renamed:
        warnings.warn(f"impl={impl!r} for {operation} is now impl={op.renamed[impl]!r}", DeprecationWarning,
                      stacklevel=3)
        impl = op.renamed[impl]
    if impl not in op.choices:
        raise ValueError(f"impl: expected one of {op.choices} for {operation}, got {impl!r}")
    if impl == "auto":
        return op.auto(**context)
    why = op.missing.get(impl, lambda **_: None)(**context)
    if why:
        raise ValueError(f"impl={impl!r} for {operation}: {why}")
    return impl
