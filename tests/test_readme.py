"""README's examples run as written."""

import pathlib
import re

import pytest

pytest.importorskip("flax")


def test_readme_flax_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = text.split("## Flax NNX", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md (Flax NNX)", "exec"), scope)  # noqa: S102 - our own README
    out = scope["out"]
    assert out["camera"].shape == (1, 9) and out["depth"].shape == (1, 42, 56)
    kept = int(scope["caches"](scope["step"].sync())[0].num_frames[0])
    assert 0 < kept < 20  # the hovering frames were rolled back


def test_readme_checkpoint_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = text.split("## Durable state", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md (Durable state)", "exec"), scope)  # noqa: S102 - our own README
    assert scope["state"].spec.num_layers == 2 and (scope["path"] / "jaxkv.json").is_file()
