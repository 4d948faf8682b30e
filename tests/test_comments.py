"""Comments state decisions; the measurements behind them live in docs/ and history in git.

A comment or docstring in the package (``jaxkv/``, ``torch_bridge/``, the CUDA sources)
holds no date, no measured percentage, no issue number and no list of variants "not kept":
those go stale in code and belong on the kernel's docs page (``docs/kernels/``).
"""

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxkv", "torch_bridge")

DIARY = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a measured percentage": re.compile(r"\d(\.\d+)?\s?%(?![sdifxXeEgGr(])"),
    "an issue number": re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE),
    "a variant not kept": re.compile(r"\bnot kept\b(?!\s+in\b)|\btried and not\b", re.IGNORECASE),
}


def _python_comments(text: str):
    """(line, text) of every comment and every docstring-like string statement."""
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and (
            prev is None or prev in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
        ):
            yield tok.start[0], tok.string
        if tok.type not in (tokenize.COMMENT,):
            prev = tok.type


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def _c_comments(text: str):
    for m in _C_COMMENT.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(0)


def _files():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in path.parts:
                yield path


def test_comments_hold_no_diaries():
    found = []
    for path in _files():
        text = path.read_text()
        comments = _python_comments(text) if path.suffix == ".py" else _c_comments(text)
        for line, comment in comments:
            for what, pattern in DIARY.items():
                for m in pattern.finditer(comment):
                    at = line + comment.count("\n", 0, m.start())
                    found.append(f"{path.relative_to(ROOT)}:{at}: {what}: {m.group(0)!r}")
    assert not found, "comments that belong in docs/ or git history:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text, hits",
    [
        ("x = 1  # measured 37% of copy\n", 1),
        ('def f():\n    """Tried on 2026-11-24 and not kept."""\n', 2),
        ("y = a % 4  # modulo is code, not a figure\n", 0),
        ('s = f"{x:.0%}"\n', 0),
        ("# see issue 21\n", 1),
    ],
)
def test_the_check_can_fail(text, hits):
    """The patterns find what they are for in Python comments and docstrings, and not code."""
    n = sum(len(list(p.finditer(c))) for _, c in _python_comments(text) for p in DIARY.values())
    assert n == hits


def test_the_check_reads_c_comments():
    text = "int a = b % 32;  // 64% of copy\n/* 2026-11-20:\n not kept */\n"
    got = [(line, what) for line, c in _c_comments(text) for what, p in DIARY.items() if p.search(c)]
    assert got == [(1, "a measured percentage"), (2, "a date"), (2, "a variant not kept")]
