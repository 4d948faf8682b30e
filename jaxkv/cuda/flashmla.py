"""FlashMLA's sm90 sparse FP8 decode, built from a FlashMLA source tree on first use into
one library that serves both sides: an XLA FFI target (``kernels.pool_attention_flashmla``,
``hybrid.attention(impl="flashmla")``) and a C launcher that ``torch_bridge.flashmla`` calls
through ``ctypes``.

Nothing of FlashMLA lives in this package. ``$FLASHMLA_SRC`` names a FlashMLA checkout (with
its ``csrc/cutlass`` submodule) or the trimmed tree ``tools/flashmla_tree.sh`` makes in
``.upstream/flashmla``; ``build`` compiles the scheduler, the combine and the two MODEL1
decode instantiations from it, plus jaxkv's ``flashmla_sparse_decode.cu`` (the handler and
the launcher), through ``jaxkv.cuda.build`` (``$JAXKV_CACHE_DIR``/flashmla/<key>/, the key
hashing the FlashMLA files below, jaxkv's, the FFI headers, the flags and nvcc).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from jaxkv.cuda.build import BuildError, ffi_include, nvcc, shared_library
from jaxkv.cuda.build import source_dir as jaxkv_source_dir
from jaxkv.formats.storage import cuda_defines

SOURCES = (  # FlashMLA csrc/ files compiled: the scheduler, the combine, the sm90 MODEL1 decode
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu",
)
KEYED = SOURCES + (
    "sm90/decode/sparse_fp8/splitkv_mla.cuh",
    "sm90/decode/sparse_fp8/config.h",
    "api/sparse_decode.h",
    "api/common.h",
    "params.h",
)  # hashed into the key
INCLUDES = ("", "kerutils/include", "sm90", "cutlass/include")  # under csrc/, as FlashMLA's setup.py
NVCC_FLAGS = (  # FlashMLA's setup.py, sm_90a only, without -lineinfo and ptxas -v
    "-O3",
    "-std=c++20",
    "-DNDEBUG",
    "-D_USE_MATH_DEFINES",
    "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "--ptxas-options=--register-usage-level=10",
    "-gencode",
    "arch=compute_90a,code=sm_90a",
)
HANDLER = "flashmla_sparse_decode.cu"  # in jaxkv/cuda/ (build.source_dir()): the FFI handler and C launcher
HANDLER_HEADERS = ("ffi_handler.cuh",)  # in jaxkv/cuda/, included by HANDLER: part of the key
FFI_TARGET = "jaxkv_flashmla_sparse_decode"
LAUNCHER = "jaxkv_flashmla_sparse_decode"  # the extern "C" launcher's symbol (torch_bridge.flashmla)
HEADS = (64, 128)  # query heads the sm90 kernel is instantiated for


def source_dir(src=None) -> Path:
    """FlashMLA's ``csrc/`` under ``src`` or ``$FLASHMLA_SRC``; an ImportError naming the
    variable when neither is given or the tree lacks the files the build needs."""
    root = src if src is not None else os.environ.get("FLASHMLA_SRC")
    if not root:
        raise ImportError(
            "expected FLASHMLA_SRC set to a FlashMLA checkout (with its csrc/cutlass submodule) "
            "or to jaxkv's .upstream/flashmla, got it unset"
        )
    csrc = Path(root).expanduser().resolve() / "csrc"
    missing = [f for f in KEYED + ("cutlass/include/cute/tensor.hpp",) if not (csrc / f).is_file()]
    if missing:
        raise ImportError(
            f"expected FLASHMLA_SRC to hold a FlashMLA tree with the sm90 sparse decode, got "
            f"{root}, missing under csrc/: {', '.join(missing)}"
        )
    return csrc


def missing() -> str | None:
    """Why the FlashMLA target cannot be built here, or None (no build is attempted)."""
    try:
        source_dir()
        nvcc()
    except (ImportError, BuildError) as e:
        return str(e)
    return None


def _flags(csrc: Path) -> list[str]:
    return [
        *NVCC_FLAGS,
        "-Xcompiler",
        "-fPIC",
        "-isystem",
        ffi_include(),
        *cuda_defines(),
        *(f"-I{csrc / i}" for i in INCLUDES),
    ]


def build(src=None) -> Path:
    """The shared library (FlashMLA's sm90 sparse decode + jaxkv's handler and launcher),
    compiled if the cache lacks it."""
    csrc = source_dir(src)
    here = jaxkv_source_dir()
    headers = [csrc / f for f in KEYED if f not in SOURCES] + [here / h for h in HANDLER_HEADERS]
    return shared_library(
        "flashmla",
        "libjaxkv_flashmla.so",
        [csrc / s for s in SOURCES] + [here / HANDLER],
        _flags(csrc),
        headers=headers,
    )


@functools.cache
def library(src=None) -> ctypes.CDLL:
    """The loaded library built from ``src`` or ``$FLASHMLA_SRC`` (built on first use)."""
    return ctypes.CDLL(str(build(src)))


@functools.cache
def register_ffi_target() -> str:
    """Build (or load) the library and register ``FFI_TARGET`` with jax, once per process."""
    import jax

    lib = library()
    jax.ffi.register_ffi_target(FFI_TARGET, jax.ffi.pycapsule(lib.JaxkvFlashmlaSparseDecode), platform="CUDA")
    return FFI_TARGET


__all__ = [
    "FFI_TARGET",
    "HEADS",
    "INCLUDES",
    "KEYED",
    "LAUNCHER",
    "NVCC_FLAGS",
    "SOURCES",
    "build",
    "library",
    "missing",
    "register_ffi_target",
    "source_dir",
]
