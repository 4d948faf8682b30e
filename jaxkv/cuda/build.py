"""Build ``cuda/*.cu`` with nvcc on first use and cache the shared library by a key.

The key hashes the sources, the XLA FFI headers they include, the nvcc version and the
flags (which carry the pool layout from ``jaxkv.formats.storage``), so an edit or a new toolkit rebuilds and nothing stale is loaded. Libraries live
under ``$JAXKV_CACHE_DIR`` (default ``~/.cache/jaxkv``)/``cuda/<key>/``, never in the
package directory. One library serves both sides: XLA FFI handlers for ``jax.ffi`` and
``extern "C"`` launchers for ``ctypes`` (``torch_bridge.kernels``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxkv.formats.storage import cuda_defines

SOURCES = ("flush_write.cu", "frame_append.cu", "dequant_gather.cu", "compress_decode.cu", "fp4_pack.cu",
           "pool_attention.cu", "prefix_attention.cu")
HEADERS = ("codes.cuh", "div_rn.cuh", "ffi_handler.cuh", "ptx.cuh", "write_entry.cuh")  # included by the sources: part of the cache key
ARCHS = ("90a", "100a")  # what CI compiles; a build for a device uses that device's arch


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries its output."""


def source_dir() -> Path:
    """This package's directory: the ``.cu`` / ``.cuh`` sources ship beside this module as
    package data, so an installed wheel builds them as a checkout does."""
    d = Path(__file__).resolve().parent
    missing = [s for s in SOURCES + HEADERS if not (d / s).is_file()]
    if missing:
        raise BuildError(f"CUDA sources: expected {', '.join(SOURCES + HEADERS)} in {d}, missing "
                         f"{', '.join(missing)} (an install without jaxkv's package data)")
    return d


def nvcc() -> str:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise BuildError("nvcc not found: put the CUDA toolkit's bin/ on PATH, or set NVCC or CUDA_HOME")


def arch_of(compute_capability) -> str:
    """(9, 0) or "9.0" -> "90a": Hopper and later get their arch-specific target."""
    if isinstance(compute_capability, str):
        compute_capability = tuple(int(p) for p in compute_capability.split("."))
    major, minor = compute_capability
    return f"{major}{minor}" + ("a" if major >= 9 else "")


def _ffi_include() -> str:
    import jax

    return jax.ffi.include_dir()


def _flags(arch: str) -> list[str]:
    """nvcc flags, the pool layout among them (``formats.storage.cuda_defines``): part of the key."""
    return ["-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-isystem", _ffi_include(),
            "-Xcompiler", "-fPIC", *cuda_defines()]


def _key(arch: str) -> str:
    h = hashlib.sha256()
    src = source_dir()
    for s in SOURCES + HEADERS:
        h.update((src / s).read_bytes())
    for hdr in sorted(Path(_ffi_include(), "xla", "ffi", "api").glob("*.h")):
        h.update(hdr.read_bytes())
    h.update(subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout.encode())
    h.update(" ".join(_flags(arch)).encode())
    return h.hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"nvcc failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-4000:]}")


def _objects(sources, flags: list[str], d: str, tag: str = "") -> list[str]:
    """Compile each source into ``d`` (objects named by ``tag``), one nvcc per source on all
    cores (``cuda/``'s seven take ~45 s one after another; the largest alone ~8 s)."""
    outs = [os.path.join(d, f"{tag}{i}_{Path(s).name}.o") for i, s in enumerate(sources)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(outs), os.cpu_count() or 1))) as ex:
        list(ex.map(lambda so: _run([nvcc(), *flags, "-c", "-o", so[1], str(so[0])]), zip(sources, outs)))
    return outs


def link_cached(out: Path, sources, flags: list[str]) -> Path:
    """``out``, a shared library of ``sources`` compiled with ``flags`` (``_objects``) and
    linked, unless it already exists; written atomically."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory() as d:
            _run([nvcc(), "-shared", "-o", tmp, *_objects(sources, flags, d)])
        os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("JAXKV_CACHE_DIR", Path.home() / ".cache" / "jaxkv")) / "cuda"


def build(arch: str) -> Path:
    """The shared library for ``arch`` (e.g. "90a"), compiling it if the cache lacks it."""
    return link_cached(cache_dir() / _key(arch) / "libjaxkv_cuda.so", [source_dir() / s for s in SOURCES],
                       _flags(arch))


@functools.lru_cache(maxsize=None)
def library(arch: str) -> ctypes.CDLL:
    """The loaded library for ``arch`` (built on first use)."""
    return ctypes.CDLL(str(build(arch)))


def check_compile(archs=ARCHS) -> None:
    """Compile every source for every arch, without linking or loading (CI has no GPU)."""
    with tempfile.TemporaryDirectory() as d:
        for arch in archs:
            _objects([source_dir() / s for s in SOURCES], _flags(arch), d, tag=arch)
