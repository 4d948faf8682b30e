"""FlashMLA's sm90 sparse FP8 decode as an XLA FFI target, built from a FlashMLA source tree
on first use: ``kernels.pool_attention_flashmla`` and ``hybrid.attention(impl="flashmla")``.

Nothing of FlashMLA lives in this package. ``$FLASHMLA_SRC`` names a FlashMLA checkout (with
its ``csrc/cutlass`` submodule) or the trimmed tree ``tools/flashmla_tree.sh`` makes in
``.upstream/flashmla``; ``build`` compiles
the scheduler, the combine and the two MODEL1 decode instantiations from it, plus jaxkv's
handler ``cuda/flashmla_sparse_decode.cu`` (``build.link_cached``, as ``cuda/``: one nvcc
per file on all cores), and caches the library (``$JAXKV_CACHE_DIR``/flashmla-ffi/<key>/, the key hashing the
sources, the FFI headers, the flags and nvcc). ``torch_bridge.flashmla`` builds the same
sources as a torch extension and takes the lists below from here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

from jaxkv.cuda.build import BuildError, _ffi_include, cache_dir, link_cached, nvcc, source_dir as jaxkv_source_dir
from jaxkv.formats.storage import cuda_defines

SOURCES = (  # FlashMLA csrc/ files compiled: the scheduler, the combine, the sm90 MODEL1 decode
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu",
)
KEYED = SOURCES + ("sm90/decode/sparse_fp8/splitkv_mla.cuh", "sm90/decode/sparse_fp8/config.h",
                   "api/sparse_decode.h", "api/common.h", "params.h")  # hashed into the key
INCLUDES = ("", "kerutils/include", "sm90", "cutlass/include")  # under csrc/, as FlashMLA's setup.py
NVCC_FLAGS = (  # FlashMLA's setup.py, sm_90a only, without -lineinfo and ptxas -v
    "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "--use_fast_math", "--ptxas-options=--register-usage-level=10",
    "-gencode", "arch=compute_90a,code=sm_90a",
)
HANDLER = "flashmla_sparse_decode.cu"  # in jaxkv/cuda/ (build.source_dir()): the FFI handler, jaxkv's
HANDLER_HEADERS = ("ffi_handler.cuh",)  # in jaxkv/cuda/, included by HANDLER: part of the key
FFI_TARGET = "jaxkv_flashmla_sparse_decode"
HEADS = (64, 128)  # query heads the sm90 kernel is instantiated for


def source_dir(src=None) -> Path:
    """FlashMLA's ``csrc/`` under ``src`` or ``$FLASHMLA_SRC``; an ImportError naming the
    variable when neither is given or the tree lacks the files the build needs."""
    root = src if src is not None else os.environ.get("FLASHMLA_SRC")
    if not root:
        raise ImportError("expected FLASHMLA_SRC set to a FlashMLA checkout (with its csrc/cutlass submodule) "
                          "or to jaxkv's .upstream/flashmla, got it unset")
    csrc = Path(root).expanduser().resolve() / "csrc"
    missing = [f for f in KEYED + ("cutlass/include/cute/tensor.hpp",) if not (csrc / f).is_file()]
    if missing:
        raise ImportError(f"expected FLASHMLA_SRC to hold a FlashMLA tree with the sm90 sparse decode, got "
                          f"{root}, missing under csrc/: {', '.join(missing)}")
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
    return [*NVCC_FLAGS, "-Xcompiler", "-fPIC", "-isystem", _ffi_include(), *cuda_defines(),
            *(f"-I{csrc / i}" for i in INCLUDES)]


def _key(csrc: Path) -> str:
    h = hashlib.sha256()
    for f in KEYED:
        h.update((csrc / f).read_bytes())
    for f in (HANDLER,) + HANDLER_HEADERS:
        h.update((jaxkv_source_dir() / f).read_bytes())
    for hdr in sorted(Path(_ffi_include(), "xla", "ffi", "api").glob("*.h")):
        h.update(hdr.read_bytes())
    h.update(subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout.encode())
    h.update(" ".join(NVCC_FLAGS + tuple(cuda_defines())).encode())
    return h.hexdigest()[:16]


def build(src=None) -> Path:
    """The shared library (FlashMLA's sm90 sparse decode + jaxkv's FFI handler), compiled if
    the cache lacks it."""
    csrc = source_dir(src)
    out = cache_dir().parent / "flashmla-ffi" / _key(csrc) / "libjaxkv_flashmla.so"
    return link_cached(out, [csrc / s for s in SOURCES] + [jaxkv_source_dir() / HANDLER], _flags(csrc))


@functools.lru_cache(maxsize=None)
def register_ffi_target() -> str:
    """Build (or load) the library and register ``FFI_TARGET`` with jax, once per process."""
    import jax

    lib = ctypes.CDLL(str(build()))
    jax.ffi.register_ffi_target(FFI_TARGET, jax.ffi.pycapsule(lib.JaxkvFlashmlaSparseDecode), platform="CUDA")
    return FFI_TARGET


__all__ = ["FFI_TARGET", "HEADS", "INCLUDES", "KEYED", "NVCC_FLAGS", "SOURCES", "build", "missing",
           "register_ffi_target", "source_dir"]
