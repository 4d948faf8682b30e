"""jaxkv.cuda.build, the one nvcc builder, with a stand-in nvcc (a script that logs its
arguments and writes its -o file): keys, caching, atomic results, errors. Runs anywhere."""

from __future__ import annotations

import importlib
import os
import pathlib
import stat

import pytest

from jaxkv.cuda import BuildError

B = importlib.import_module("jaxkv.cuda.build")  # the module (jaxkv.cuda.build is also the function)

FAKE = """#!/bin/sh
echo "$@" >> "{log}"
[ "$1" = "--version" ] && {{ echo "fake nvcc {version}"; exit 0; }}
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift;; esac
  shift
done
[ -n "{fail}" ] && {{ echo "error: {fail}" >&2; exit 2; }}
echo built > "$out"
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    def make(version="1.0", fail=""):
        path = tmp_path / f"nvcc-{version}-{bool(fail)}"
        path.write_text(FAKE.format(log=tmp_path / "log", version=version, fail=fail))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("NVCC", str(path))
        return path

    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path / "cache"))
    for v in B.ENV_FLAGS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(B, "ffi_include", lambda: str(tmp_path))  # no FFI headers to hash
    return make


def _calls(tmp_path):
    log = tmp_path / "log"
    return [line for line in log.read_text().splitlines() if line != "--version"] if log.exists() else []


def test_builds_once_per_key_and_rebuilds_on_any_input(tmp_path, fake_nvcc, monkeypatch):
    fake_nvcc()
    a, h = tmp_path / "a.cu", tmp_path / "a.cuh"
    a.write_text("// a\n")
    h.write_text("// h\n")
    lib = B.shared_library("t", "liba.so", [a], ["-O3"], headers=[h])
    assert lib.read_text() == "built\n" and lib.parent.parent == tmp_path / "cache" / "t"
    compile_, link = _calls(tmp_path)
    assert compile_.startswith("-O3 -c -o ") and compile_.endswith(str(a)) and link.startswith("-shared -o ")
    assert os.listdir(lib.parent) == ["liba.so"]  # no temporary left beside it
    n = len(_calls(tmp_path))
    assert B.shared_library("t", "liba.so", [a], ["-O3"], headers=[h]) == lib and len(_calls(tmp_path)) == n  # cached

    keys = {lib.parent.name}
    h.write_text("// h, edited\n")
    keys.add(B.shared_library("t", "liba.so", [a], ["-O3"], headers=[h]).parent.name)
    keys.add(B.shared_library("t", "liba.so", [a], ["-O2"], headers=[h]).parent.name)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DJAXKV_FLUSH_ROWS=8")  # nvcc reads it
    keys.add(B.shared_library("t", "liba.so", [a], ["-O2"], headers=[h]).parent.name)
    B.nvcc_version.cache_clear()
    fake_nvcc(version="2.0")
    keys.add(B.shared_library("t", "liba.so", [a], ["-O2"], headers=[h]).parent.name)
    assert len(keys) == 5  # a header, the flags, nvcc's flags from the environment, the toolkit: each a new key


def test_a_failed_compile_names_what_was_expected_and_leaves_nothing(tmp_path, fake_nvcc):
    fake_nvcc(fail="no such intrinsic")
    a = tmp_path / "a.cu"
    a.write_text("// a\n")
    with pytest.raises(BuildError, match=r"(?s)nvcc compiling a\.cu: expected exit 0, got 2.*no such intrinsic"):
        B.executable("t", "prog", [a], ["-O3"])
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_missing_nvcc_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    with pytest.raises(
        BuildError,
        match=r"nvcc: expected the CUDA toolkit's nvcc in \$NVCC, on PATH or in "
        r"\$CUDA_HOME/bin, found none \(NVCC=unset, CUDA_HOME=.*/cuda\)",
    ):
        B.nvcc()


def test_sources_are_package_data():
    d = B.source_dir()
    assert d == pathlib.Path(B.__file__).resolve().parent
    assert all((d / f).is_file() for f in B.SOURCES + B.HEADERS)
