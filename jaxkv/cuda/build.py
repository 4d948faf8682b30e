"""jaxkv's one nvcc builder: it finds nvcc, keys the inputs, compiles in parallel and links
atomically into the cache. Every CUDA build of the project goes through here:

* ``build`` / ``library``: the kernels library of this package's sources, one per arch.
  One library serves both sides: XLA FFI handlers for ``jax.ffi`` (``jaxkv.kernels``) and
  ``extern "C"`` launchers for ``ctypes`` (``torch_bridge.kernels``).
* ``jaxkv.cuda.flashmla``: FlashMLA's sparse decode with jaxkv's handler and launcher, the
  same library for ``jax.ffi`` and for ``torch_bridge.flashmla``.
* ``shared_library`` / ``executable`` for anything else (benchmark and test programs).

The sources ship inside the package (``source_dir``) and are compiled on first use, so an
installed wheel builds them as a checkout does. Results live under
``cache_dir()/<kind>/<key>/<name>`` (``$JAXKV_CACHE_DIR``, default ``~/.cache/jaxkv``),
never in the package directory, which may be read-only. The key hashes every source and
header given, the XLA FFI headers, nvcc's version and the flags (which carry the pool layout
from ``jaxkv.formats.storage``, the arch and the include directories; with them the flags
nvcc reads from ``$NVCC_PREPEND_FLAGS`` / ``$NVCC_APPEND_FLAGS``), so an edit, another
toolkit or another FlashMLA tree builds anew and nothing stale is loaded. A result is
written under a temporary name and renamed into place: processes building the same key at
once never load a half-written file.
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

SOURCES = (
    "flush_write.cu",
    "frame_append.cu",
    "dequant_gather.cu",
    "compress_decode.cu",
    "fp4_pack.cu",
    "pool_attention.cu",
    "prefix_attention.cu",
    "top_k.cu",
    "index_scores.cu",
    "index_query.cu",
    "after.cu",
    "move_rows.cu",
    "frame_write_fp8.cu",
    "entry_rows.cu",
)  # the kernels library
HEADERS = ("codes.cuh", "div_rn.cuh", "ffi_handler.cuh", "ptx.cuh", "write_entry.cuh")  # included by the sources
ARCHS = ("90a", "100a")  # what CI compiles; a build for a device uses that device's arch


class BuildError(RuntimeError):
    """nvcc is missing or failed, or the sources are not where the package puts them; the
    message says what was expected and what was found (nvcc's own output included)."""


def source_dir() -> Path:
    """This package's directory: the ``.cu`` / ``.cuh`` sources ship beside this module as
    package data."""
    d = Path(__file__).resolve().parent
    missing = [s for s in SOURCES + HEADERS if not (d / s).is_file()]
    if missing:
        raise BuildError(
            f"CUDA sources: expected {', '.join(SOURCES + HEADERS)} in {d}, missing "
            f"{', '.join(missing)} (an install without jaxkv's package data)"
        )
    return d


def nvcc() -> str:
    """The nvcc to use: ``$NVCC``, else the first on ``PATH``, else ``$CUDA_HOME/bin/nvcc``
    (default ``/usr/local/cuda``)."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise BuildError(
        f"nvcc: expected the CUDA toolkit's nvcc in $NVCC, on PATH or in $CUDA_HOME/bin, found none "
        f"(NVCC={os.environ.get('NVCC', 'unset')}, CUDA_HOME={os.environ.get('CUDA_HOME', 'unset')}); "
        "put the toolkit's bin/ on PATH"
    )


@functools.cache
def nvcc_version(path: str) -> str:
    """``nvcc --version`` of the nvcc at ``path`` (part of every key)."""
    p = subprocess.run([path, "--version"], capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"{path} --version: expected exit 0, got {p.returncode}:\n{p.stderr[-2000:]}")
    return p.stdout


def arch_of(compute_capability) -> str:
    """(9, 0) or "9.0" -> "90a": Hopper and later get their arch-specific target."""
    if isinstance(compute_capability, str):
        compute_capability = tuple(int(p) for p in compute_capability.split("."))
    major, minor = compute_capability
    return f"{major}{minor}" + ("a" if major >= 9 else "")


def gencode(arch: str) -> list[str]:
    """nvcc's flag for SASS of one arch ("90a" -> sm_90a)."""
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def ffi_include() -> str:
    """jax's XLA FFI headers (``xla/ffi/api/ffi.h``), which every handler includes."""
    import jax

    return jax.ffi.include_dir()


def kernel_flags(*archs: str) -> list[str]:
    """nvcc flags of the kernels library for ``archs``, the pool layout among them (``cuda_defines``)."""
    return [
        "-std=c++17",
        "-O3",
        *(g for a in archs for g in gencode(a)),
        "-isystem",
        ffi_include(),
        "-Xcompiler",
        "-fPIC",
        *cuda_defines(),
    ]


def cache_dir() -> Path:
    """Where built results live: ``$JAXKV_CACHE_DIR``, default ``~/.cache/jaxkv``."""
    return Path(os.environ.get("JAXKV_CACHE_DIR", Path.home() / ".cache" / "jaxkv")).expanduser()


ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")  # flags nvcc reads from the environment


def key(files, flags) -> str:
    """The cache key of a build of ``files`` (sources and the headers they include) with
    ``flags``: their bytes, the XLA FFI headers, nvcc's version, the flags and those of
    ``ENV_FLAGS`` (a ``-D`` there changes what is built)."""
    h = hashlib.sha256()
    for f in files:
        data = Path(f).read_bytes()
        h.update(f"{Path(f).name}:{len(data)}:".encode())
        h.update(data)
    for hdr in sorted(Path(ffi_include(), "xla", "ffi", "api").glob("*.h")):
        h.update(hdr.read_bytes())
    h.update(nvcc_version(nvcc()).encode())
    h.update("\0".join([*flags, *(f"{v}={os.environ.get(v, '')}" for v in ENV_FLAGS)]).encode())
    return h.hexdigest()[:16]


def _workers(jobs: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(jobs, cores))


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"nvcc {what}: expected exit 0, got {p.returncode}\n  {' '.join(cmd)}\n{p.stderr[-4000:]}")


def compile_objects(jobs, out_dir) -> list[str]:
    """Compile each ``(source, flags)`` of ``jobs`` to an object in ``out_dir``, one nvcc per
    source on all cores; the objects' paths, in order."""
    jobs = [(Path(s), list(f)) for s, f in jobs]
    outs = [os.path.join(out_dir, f"{i}_{s.name}.o") for i, (s, _) in enumerate(jobs)]
    compiler = nvcc()

    def one(i: int) -> None:
        source, flags = jobs[i]
        _run([compiler, *flags, "-c", "-o", outs[i], str(source)], f"compiling {source.name}")

    with ThreadPoolExecutor(max_workers=_workers(len(jobs))) as ex:
        list(ex.map(one, range(len(jobs))))
    return outs


def _cached(kind: str, name: str, sources, flags, headers, link: list[str]) -> Path:
    sources, flags = [Path(s) for s in sources], list(flags)
    out = cache_dir() / kind / key([*sources, *headers], flags) / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory() as d:
            objects = compile_objects([(s, flags) for s in sources], d)
            _run([nvcc(), *link, "-o", tmp, *objects], f"linking {name}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: a concurrent builder never loads a half-written file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def shared_library(kind: str, name: str, sources, flags, *, headers=()) -> Path:
    """``cache_dir()/kind/<key>/name``: a shared library of ``sources`` compiled with ``flags``
    (which need ``-Xcompiler -fPIC``), built unless the cache has it. ``headers``: the files
    the sources include, hashed into the key with them."""
    return _cached(kind, name, sources, flags, headers, ["-shared"])


def executable(kind: str, name: str, sources, flags, *, headers=()) -> Path:
    """As ``shared_library``, an executable program."""
    return _cached(kind, name, sources, flags, headers, [])


def library_path(arch: str) -> Path:
    """The path of the kernels library for ``arch`` (e.g. "90a"), compiled if the cache lacks it."""
    src = source_dir()
    return shared_library(
        "cuda", "libjaxkv_cuda.so", [src / s for s in SOURCES], kernel_flags(arch), headers=[src / h for h in HEADERS]
    )


@functools.cache
def library(arch: str) -> ctypes.CDLL:
    """The loaded kernels library for ``arch`` (built on first use)."""
    return ctypes.CDLL(str(library_path(arch)))


def check_compile(archs=ARCHS) -> None:
    """Compile every source of the kernels library for every arch, without linking or loading
    (CI has no GPU); BuildError with nvcc's output on the first failure. One nvcc per source
    for all archs: the host pass runs once."""
    src = source_dir()
    with tempfile.TemporaryDirectory() as d:
        compile_objects([(src / s, kernel_flags(*archs)) for s in SOURCES], d)
