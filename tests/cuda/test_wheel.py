"""The package carries its kernels: a wheel built from this checkout, installed non-editable
into a fresh venv and imported there (cwd outside the checkout, no PYTHONPATH), finds every
CUDA source inside its own site-packages and compiles them for sm_90a and sm_100a (compile
only: CI has nvcc but no GPU). This is also CI's compile check of the sources.

The venv borrows this interpreter's dependencies (jax, numpy, ml_dtypes, tqdm) through a
``.pth`` file instead of downloading them; a ``.pth`` line adds a directory to ``sys.path``
after the venv's own site-packages and runs none of the ``.pth`` files there, so an editable
install of jaxkv in this interpreter is not seen.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxkv.cuda import BuildError
from jaxkv.cuda.build import nvcc

ROOT = Path(__file__).resolve().parents[2]
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".upstream",
    ".seeds",
    ".whl",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
)
DEPENDENCIES = ("jax", "jaxlib", "numpy", "ml_dtypes", "tqdm")  # what `import jaxkv` needs

CHECK = textwrap.dedent("""
    import importlib, json, sys, sysconfig
    import jaxkv
    build = importlib.import_module("jaxkv.cuda.build")
    src = build.source_dir()
    print(json.dumps({"jaxkv": jaxkv.__file__, "purelib": sysconfig.get_paths()["purelib"],
                      "source_dir": str(src), "files": sorted(p.name for p in src.iterdir() if p.suffix in (".cu", ".cuh")),
                      "torch_bridge": importlib.util.find_spec("torch_bridge").origin}), flush=True)
    build.check_compile(("90a", "100a"))  # BuildError with nvcc's output
""")


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def _can_build_offline() -> bool:
    """setuptools (with bdist_wheel) importable here: build without an isolated, downloaded one."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _dependency_dirs() -> list[str]:
    """The sys.path entries this interpreter imports jaxkv's dependencies from."""
    dirs = []
    for name in DEPENDENCIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            d = str(Path(spec.origin).resolve().parents[1])
            if d not in dirs:
                dirs.append(d)
    return dirs


def test_wheel_carries_and_compiles_its_kernels(tmp_path):
    try:
        nvcc()
    except BuildError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the CUDA sources: {e}")
        pytest.skip(f"nvcc not found, nothing to compile: {e}")

    # the wheel, from a copy (a build in the checkout would leave build/ there, stale files and all)
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    shutil.copytree(ROOT, src, ignore=NOT_COPIED)
    offline = ["--no-build-isolation"] if _can_build_offline() else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("jaxkv-*.whl")

    # a fresh venv holding the wheel alone; the dependencies are this interpreter's
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(purelib) / "_jaxkv_test_dependencies.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            str(wheel),
        ]
    )

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["JAXKV_CACHE_DIR"] = str(tmp_path / "cache")
    away = tmp_path / "elsewhere"
    away.mkdir()
    p = _run([str(python), "-c", CHECK], cwd=away, env=env, timeout=1200)
    got = json.loads(p.stdout.splitlines()[0])

    installed = Path(got["purelib"]).resolve()
    assert Path(got["jaxkv"]).resolve().is_relative_to(installed), got  # the venv's copy, not the checkout's
    assert Path(got["torch_bridge"]).resolve().is_relative_to(installed), got
    assert Path(got["source_dir"]).resolve() == installed / "jaxkv" / "cuda", got
    here = sorted(p.name for p in (ROOT / "jaxkv" / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
    assert got["files"] == here, "the wheel lacks or adds CUDA sources"
