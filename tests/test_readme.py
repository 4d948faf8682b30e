"""The code blocks of README.md and docs/ run as written and print what they say.

Python blocks. Each runs in a fresh interpreter (working directory: a temporary one;
PYTHONPATH: this repository) and must exit 0. Its first line names the extra it needs
(``# needs: pip install -e ".[flax]"``; ``pip install -e .`` for none): a block whose extra
is not installed here is skipped, saying so. A line ``print(...)  # text`` promises that
``text`` is a line of the block's output: the promised lines must come out in that order
(``...`` in a promise stands for any text). Markers on the line before a fence:

* ``<!-- gpu -->``: the block needs a CUDA GPU (the test is marked ``gpu``: skipped without one);
* ``<!-- slow -->``: the block takes more than a few seconds on a CPU (a model to compile):
  the test is marked ``slow`` (on a CPU it runs with ``JAXKV_LONG=1``).

Shell blocks (``bash``). Each command runs if it is cheap (``SHELL_RUN``: a ``--help``); any
other must match a reason in ``SHELL_NOT_RUN`` (a skip that says why), else the test fails.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# extra -> modules it installs (pyproject.toml's optional dependencies)
EXTRAS = {
    "cuda": (),  # checked as a GPU: blocks that need one carry <!-- gpu -->
    "torch": ("torch",),
    "flashinfer": ("torch", "flashinfer"),
    "flax": ("flax",),
    "checkpoint": ("orbax.checkpoint",),
    "lingbot": ("flax", "safetensors", "PIL", "matplotlib"),
    "notebooks": ("flax", "matplotlib", "nbclient", "ipykernel", "nbformat"),
    "test": ("pytest", "hypothesis"),
}

# Shell commands that are run: cheap and side-effect free.
SHELL_RUN = re.compile(r"^(python -m jaxkv|jaxkv)( [a-z-]+)? --help$")
# Shell commands that are not run, by pattern, with the reason.
SHELL_NOT_RUN = [
    (r"^pip install", "installs packages here; .ci/run runs the README's test command in a fresh venv"),
    (r"^python -m jaxkv demo .*--lingbot", "lingbot-map demos: tests/models/test_lingbot_cli.py runs them small"),
    (r"^python -m jaxkv demo", "a minute or more on a CPU; tests/test_demo.py runs the demo at small sizes"),
    (
        r"^python -m jaxkv convert-lingbot ",
        "needs upstream's checkpoint; tests/models/test_lingbot_cli.py converts one",
    ),
    (r"^python -m jaxkv launch ", "starts processes per GPU; tests/sharding/test_launcher.py runs the launcher on CPU"),
    (r"^(JAXKV_LONG=1 )?python -m pytest", "runs tests: the long Hypothesis profile takes about an hour"),
    (r"^\S+=\S+ .*python3? (benchmarks|-m pytest)", "needs an upstream checkout and a GPU"),
    (r"^(cd benchmarks && )?python3? benchmarks/|^python3? [a-z_]+\.py", "a benchmark: needs a GPU"),
    (r"^tools/flashmla_tree.sh|^git clone", "needs a FlashMLA or DeepSeek-V4 checkout (network)"),
    (r"^python3? tools/sanitize.py", "runs the GPU tests under compute-sanitizer: needs a GPU"),
]


def _blocks():
    """(page, index, lang, code, markers) of every fenced block of the pages."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i, n = 0, 0
        while i < len(lines):
            m = re.match(r"^( *)```(\w*)\s*$", lines[i])  # a fence, maybe indented in a list item
            if not m:
                i += 1
                continue
            indent, lang = len(m.group(1)), m.group(2)
            markers = set(re.findall(r"<!--\s*([a-z-]+)\s*-->", lines[i - 1])) if i else set()
            j = i + 1
            while not lines[j].strip().startswith("```"):
                j += 1
            if lang in ("python", "bash"):
                n += 1
                code = "\n".join(line[indent:] for line in lines[i + 1 : j]) + "\n"
                out.append((page.relative_to(ROOT).as_posix(), n, lang, code, markers))
            i = j + 1
    return out


BLOCKS = _blocks()
PY = [b for b in BLOCKS if b[2] == "python"]
SH = [
    (page, n, line.strip())
    for page, n, lang, code, _ in BLOCKS
    if lang == "bash"
    for line in code.splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]


def _params(blocks):
    params = []
    for page, n, _lang, code, markers in blocks:
        marks = [pytest.mark.gpu] if "gpu" in markers else []
        if "slow" in markers:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(code, markers, id=f"{page}:{n}", marks=marks))
    return params


def _needs(code: str) -> list[str]:
    first = code.splitlines()[0]
    m = re.match(r'^# needs: pip install -e (\.|"\.\[([a-z,]+)\]")(\s|$)', first)
    assert m, f'first line: expected  # needs: pip install -e .  or  # needs: pip install -e ".[extra]", got {first!r}'
    extras = m.group(2).split(",") if m.group(2) else []
    unknown = [e for e in extras if e not in EXTRAS]
    assert not unknown, f"first line names extras pyproject.toml does not have: {unknown}"
    return extras


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def _promises(code: str) -> list[str]:
    """The lines ``print(...)  # text`` promise, in order."""
    out = []
    for line in code.splitlines():
        left, sep, text = line.partition("  # ")
        if sep and left.strip().startswith("print("):
            out.append(text.strip())
    return out


def _check_output(stdout: str, promises: list[str]) -> None:
    lines = [line.rstrip() for line in stdout.splitlines()]
    at = 0
    for text in promises:
        pattern = re.compile(".*".join(map(re.escape, text.split("..."))))
        for k in range(at, len(lines)):
            if pattern.fullmatch(lines[k]):
                at = k + 1
                break
        else:
            raise AssertionError(f"promised output line {text!r} not printed (in order); the block printed:\n{stdout}")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_every_page_has_blocks_and_every_block_is_tested():
    readme = [b for b in BLOCKS if b[0] == "README.md"]
    assert sum(b[2] == "python" for b in readme) >= 3, "README.md: expected the frame, hybrid and torch examples"
    with_lang = sum(len(re.findall(r"^ *```(?:python|bash)\s*$", p.read_text(), re.MULTILINE)) for p in PAGES)
    assert with_lang == len(PY) + sum(b[2] == "bash" for b in BLOCKS)


@pytest.mark.parametrize("code, markers", _params(PY))
def test_python_block(code, markers, tmp_path):
    missing = [(e, mod) for e in _needs(code) for mod in EXTRAS[e] if not _installed(mod)]
    if missing:
        pytest.skip(f"needs the {missing[0][0]!r} extra: {missing[0][1]} is not installed")
    promises = _promises(code)
    assert promises, "the block prints nothing it promises: print what its comments claim"
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900, check=False
    )
    assert p.returncode == 0, f"exit status {p.returncode}\n{p.stdout}\n{p.stderr[-6000:]}"
    _check_output(p.stdout, promises)


@pytest.mark.parametrize("command", [pytest.param(c, id=f"{page}:{n}:{c[:40]}") for page, n, c in SH])
def test_shell_command(command, tmp_path):
    command = command.split("  #", 1)[0].strip()
    if not SHELL_RUN.match(command):
        reason = next((why for pattern, why in SHELL_NOT_RUN if re.search(pattern, command)), None)
        assert reason, f"{command!r}: add it to SHELL_RUN (cheap) or SHELL_NOT_RUN (with the reason it is not run)"
        pytest.skip(f"not run: {reason}")
    args = shlex.split(command)
    args = [sys.executable, "-m", "jaxkv", *args[1:]] if args[0] == "jaxkv" else [sys.executable, *args[1:]]
    p = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0 and p.stdout.startswith("usage:"), f"{command}: {p.returncode}\n{p.stdout}\n{p.stderr}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    """Every relative link of README.md and docs/ names a file that exists, and its
    ``#anchor`` a heading of that file."""
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # not inside code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                heads = {_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.MULTILINE)}
                if anchor not in heads:
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_front_door_and_results_stay_short():
    """README is a front door and RESULTS a reference: what grows goes to docs/ (and history to git)."""
    for name, limit in (("README.md", 200), ("benchmarks/RESULTS.md", 300)):
        n = len((ROOT / name).read_text().splitlines())
        assert n <= limit, f"{name}: {n} lines, expected at most {limit}; move detail to docs/"
