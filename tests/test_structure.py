"""The package's structure, checked: layers whose imports point down, modules that import
alone, one owner for the pool byte layout. (DESIGN.md, "Layers".)"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxkv", "torch_bridge")

# Each module may import its own package and lower layers only. Layer of a module: its
# first match here (longest prefix first).
LAYERS = {
    "jaxkv.errors": 0,
    "jaxkv._pytree": 0,
    "jaxkv.formats": 1,
    "jaxkv.stacked": 1,
    "jaxkv.sharding": 1,
    "jaxkv.launch": 1,
    "jaxkv.math": 2,
    "jaxkv.cuda": 2,
    "jaxkv.kernels": 3,
    "jaxkv._backend": 3,
    "jaxkv.compilation": 3,
    "jaxkv.frame": 4,
    "jaxkv.hybrid": 4,
    "jaxkv.checkpoint": 5,
    "jaxkv.flax": 6,
    "jaxkv.models": 7,
    "jaxkv.demo": 8,
    "jaxkv.__main__": 9,
    "jaxkv": 9,
    "torch_bridge": 10,
}
# Function-local imports of the package: only where the imported part needs an optional
# dependency that the importing module must not (the CLI works without flax).
LAZY_OK = {
    ("jaxkv.demo", "jaxkv.models.demo"),
    ("jaxkv.demo", "jaxkv.models.lingbot_demo"),
    ("jaxkv.__main__", "jaxkv.models.lingbot.convert"),
    ("jaxkv.__main__", "jaxkv.models.lingbot_demo"),
}


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


MODULES = dict(_modules())


def _layer(name: str):
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return best, LAYERS[best]


def _group(name: str) -> str:
    """The unit imports are checked between: a subpackage of jaxkv, or a root module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxkv" and len(parts) > 1 else parts[0]


def _imports(path: pathlib.Path, module: str):
    """(imported module, names, at module level?) for every import of our packages."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level + (path.name == "__init__.py") or None]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            target, names = None, None
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, [], id(node) in top or _guarded(tree, node)
            continue
        else:
            continue
        if target.split(".")[0] in PACKAGES:
            at_top = id(node) in top or _guarded(tree, node)
            subs = [n for n in names if f"{target}.{n}" in MODULES]  # ``from pkg import submodule``
            for n in subs:
                yield f"{target}.{n}", [], at_top
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                yield target, rest, at_top


def _guarded(tree, node) -> bool:
    """An import inside a module-level try/if (an optional dependency) counts as top level."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.Try, ast.If)) and any(n is node for n in ast.walk(stmt)):
            return True
    return False


def test_imports_point_down():
    bad = []
    for mod, path in MODULES.items():
        own, rank = _layer(mod)
        for target, _names, _top in _imports(path, mod):
            if _group(target) == _group(mod):
                continue
            t_layer, t_rank = _layer(target)
            if t_rank >= rank:
                bad.append(f"{mod} (layer {rank}) imports {target} (layer {t_rank})")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_no_function_local_imports_between_packages():
    bad = [
        f"{mod} imports {target} inside a function"
        for mod, path in MODULES.items()
        for target, _, top in _imports(path, mod)
        if not top
        and _group(target) != _group(mod)
        and (mod, target) not in LAZY_OK
        and (mod, _group(target)) not in LAZY_OK
    ]
    assert not bad, "\n".join(bad)


def test_kernels_import_only_jax_and_lower_layers():
    allowed = {"jaxkv.kernels", "jaxkv.formats", "jaxkv.math", "jaxkv.stacked", "jaxkv.errors", "jaxkv.cuda"}
    bad = [
        f"{mod} imports {target}"
        for mod, path in MODULES.items()
        if _group(mod) == "jaxkv.kernels"
        for target, _, _ in _imports(path, mod)
        if _group(target) not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_no_private_names_across_packages():
    bad = []
    for mod, path in MODULES.items():
        for target, names, _ in _imports(path, mod):
            if _group(target) == _group(mod):
                continue
            private_mod = [p for p in target.split(".")[2:] if p.startswith("_") and p != "__init__"]
            private_names = [n for n in names or () if n.startswith("_")]
            if private_mod or private_names:
                bad.append(f"{mod} imports {target} {private_names or ''}")
    assert not bad, "private modules or names used across packages:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {mod: {t for t, _, _ in _imports(path, mod) if t in MODULES} for mod, path in MODULES.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            # a package's __init__ importing its own submodules is how packages work, not a cycle
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


# Imports each module named in argv in a child forked from a process that has imported no
# module of this repository (only jax, numpy and torch, whose import is most of the time; no
# backend is started, so forking is safe); prints "FAILED <module>" and the traceback per failure.
_IMPORT_EACH = """
import importlib, os, sys, traceback
import jax, jax.numpy, numpy
try:
    import torch
except ImportError:
    pass
assert not [m for m in sys.modules if m.split('.')[0] in ('jaxkv', 'torch_bridge')]
for mod in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(mod)
            os._exit(0)
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            os._exit(1)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    if os.waitpid(pid, 0)[1]:
        print(f"FAILED {mod}:\\n{err}")
print("done")
"""


@pytest.mark.slow
def test_every_module_imports_alone():
    """Each module in a fresh process: no module works only because another was imported first."""
    pytest.importorskip("flax")
    mods = [m for m in MODULES if m.split(".")[0] == "jaxkv" or _torch()]
    p = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *mods], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("done"), p.stdout[-3000:] + p.stderr[-3000:]
    assert "FAILED" not in p.stdout, p.stdout


def _torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _private_jax(tree) -> list[str]:
    """Where ``tree`` reaches into ``jax._src``: an import of it or an attribute ``jax._src``."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name == "jax._src" or a.name.startswith("jax._src.")]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            private = (
                mod == "jax._src"
                or mod.startswith("jax._src.")
                or (mod == "jax" and "_src" in [a.name for a in node.names])
            )
            names = [f"from {mod} import {', '.join(a.name for a in node.names)}"] if private else []
        elif isinstance(node, ast.Attribute) and node.attr == "_src" and isinstance(node.value, ast.Name):
            names = ["jax._src"] if node.value.id == "jax" else []
        else:
            names = []
        hits += [f"line {node.lineno}: {n}" for n in names]
    return hits


def test_private_jax_check_catches_each_form():
    forms = ("import jax._src.cudnn", "from jax._src.cudnn import x", "from jax import _src", "import jax\njax._src.x")
    for src in forms:
        assert _private_jax(ast.parse(src)), src
    assert not _private_jax(ast.parse("import jax\nfrom jax import nn\njax.nn.dot_product_attention"))


def test_no_import_of_private_jax():
    """jax's private modules change without notice: the package uses jax's public API only."""
    bad = [f"{mod}: {h}" for mod, path in MODULES.items() for h in _private_jax(ast.parse(path.read_text()))]
    assert not bad, "uses of jax._src:\n" + "\n".join(bad)


# The pool layout's numbers (entry / key bytes, the ds_mla data segment) belong to
# jaxkv.formats (storage.py, ds_mla.py); everywhere else reads them from there. (Inline PTX
# operands, ``%68`` and ``d[68]`` in the wgmma wrappers, are not layout numbers.)
LAYOUT_LITERALS = re.compile(r"(?<![\w.%\[])(584|580|576|68|76)(?![\w.])")


def test_layout_numbers_have_one_owner():
    bad = []
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + sorted(
        (ROOT / "jaxkv" / "cuda").glob("*.cu*")
    )
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("jaxkv/formats/"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0] if path.suffix == ".py" else line.split("//")[0]
            if LAYOUT_LITERALS.search(code):
                bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "layout numbers outside jaxkv.formats:\n" + "\n".join(bad)


def test_no_module_uses_the_triton_lowering():
    """JAX deprecates Pallas' Triton lowering: the kernels are Mosaic GPU or cuda/ through jax.ffi."""
    pattern = re.compile(r"pallas[. ]+(import\s+)?triton|pltriton|\btriton\.")
    bad = [
        f"{mod}: {line.strip()}"
        for mod, path in MODULES.items()
        for line in path.read_text().splitlines()
        if pattern.search(line.split("#")[0])
    ]
    assert not bad, "\n".join(bad)
