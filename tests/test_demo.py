"""``python -m jaxkv demo`` runs, reports what it did, and keeps the right frames."""

import subprocess
import sys

from jaxkv import demo
from jaxkv.__main__ import main


def test_demo_summary(capsys):
    assert main(["demo", "--frames", "7", "--layers", "1", "--heads", "2", "--head-dim", "8",
                 "--scale-frames", "2", "--window", "3"]) == 0
    out = capsys.readouterr().out
    for key in ("frames", "visible tokens", "cache memory", "ms/frame", "backend", "device"):
        assert key in out
    assert "frames                              7" in out
    # visible: 2 scale + 3 window frames of 256 patches, and 7 x 6 specials
    assert f"visible tokens                      {5 * 256 + 7 * 6}" in out


def test_demo_keyframes_roll_back_the_rest():
    import argparse

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    summary = demo.run(p.parse_args(["--frames", "9", "--layers", "1", "--heads", "2", "--head-dim", "8",
                                     "--keyframe-every", "3"]))
    assert summary["frames"] == 3  # frames 0, 3, 6 kept


def test_demo_help_lists_every_flag():
    out = subprocess.run([sys.executable, "-m", "jaxkv", "demo", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--frames", "--resolution", "--layers", "--heads", "--head-dim", "--scale-frames", "--window",
                 "--special", "--keyframe-every", "--impl", "--dtype", "--seed", "--model", "--keyframe-threshold",
                 "--plot"):
        assert flag in out


def test_model_demo_streams_keyframes_and_plots(tmp_path):
    import pytest

    pytest.importorskip("flax")
    p = argparse_parser()
    plot = tmp_path / "model.png"
    summary = demo.run(p.parse_args(["--model", "--frames", "14", "--layers", "1", "--heads", "2", "--head-dim", "8",
                                     "--resolution", "112x84", "--scale-frames", "2", "--window", "3",
                                     "--keyframe-threshold", "0.01", "--plot", str(plot)]))
    assert plot.stat().st_size > 10_000  # a PNG with two panels
    # the synthetic camera hovers on frames 6-8: those three are rolled back
    assert summary["frames kept (keyframes)"] == summary["frames in cache"] == 11
    # visible: 2 scale + 3 window frames of 48 patches, and 11 x 6 specials
    assert summary["visible tokens"] == 5 * 48 + 11 * 6
    with pytest.raises(ValueError, match="--keyframe-every"):
        demo.run(p.parse_args(["--model", "--keyframe-every", "2"]))


def argparse_parser():
    import argparse

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p


import pytest  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--frames", "0"], "--frames: expected an int >= 1, got 0"),
    (["--layers", "0"], "--layers: expected an int >= 1, got 0"),
    (["--window", "-1"], "--window: expected an int >= 0, got -1"),
    (["--keyframe-threshold", "0.01"], "--keyframe-threshold: used only with --model"),
])
def test_demo_bad_flags_are_usage_errors(capsys, argv, message):
    """A mistaken flag prints usage and what is wrong (exit status 2), never a traceback."""
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
