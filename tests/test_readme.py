"""README's examples run as written."""

import pathlib
import re

import numpy as np
import pytest

pytest.importorskip("flax")


def _run_example(heading: str) -> dict:
    """Run the first python block after README's ``## heading``; its globals."""
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text.split(f"## {heading}", 1)[1], re.S).group(1)
    scope = {}
    exec(compile(code, f"README.md ({heading})", "exec"), scope)  # noqa: S102 - our own README
    return scope


def test_readme_flax_example_runs():
    scope = _run_example("Flax NNX")
    out = scope["out"]
    assert out["camera"].shape == (1, 9) and out["depth"].shape == (1, 42, 56)
    kept = int(scope["caches"](scope["step"].sync())[0].num_frames[0])
    assert 0 < kept < 20  # the hovering frames were rolled back


def test_readme_checkpoint_example_runs():
    scope = _run_example("Durable state")
    assert scope["state"].spec.num_layers == 2 and (scope["path"] / "jaxkv.json").is_file()


def test_readme_lingbot_example_runs():
    scope = _run_example("lingbot-map on jaxkv")
    outs = scope["outs"]
    assert len(outs) == 6 and outs[-1]["pose_enc"].shape == (1, 9)
    assert outs[-1]["depth"].shape == (1, 42, 56, 1) and outs[-1]["depth_conf"].shape == (1, 42, 56)
    assert all(bool((o["depth"] > 0).all()) for o in outs)  # exp activation: finite and positive


def test_readme_deepseek_v4_example_runs():
    scope = _run_example("DeepSeek-V4's attention block")
    y, state = scope["y"], scope["state"]
    assert y.shape == (2, 1, 128) and bool(np.isfinite(np.asarray(y, np.float32)).all())
    assert np.asarray(state.position[:2]).tolist() == [163, 163]
