"""The tree is ruff-clean: lint rules and formatting as configured in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("ruff", reason='ruff is in the test extra: pip install -e ".[test]"')


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    p = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, (
        f"ruff {' '.join(command)} . (fix with: ruff check --fix . && ruff format .)\n{p.stdout}{p.stderr}"
    )
