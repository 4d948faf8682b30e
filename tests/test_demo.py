"""``python -m jaxkv demo`` runs, reports what it did, and keeps the right frames."""

import pytest

from jaxkv import demo
from jaxkv.__main__ import main


def test_demo_summary(capsys):
    assert (
        main(
            [
                "demo",
                "--frames",
                "7",
                "--layers",
                "1",
                "--heads",
                "2",
                "--head-dim",
                "8",
                "--scale-frames",
                "2",
                "--window",
                "3",
            ]
        )
        == 0
    )
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
    summary = demo.run(
        p.parse_args(["--frames", "9", "--layers", "1", "--heads", "2", "--head-dim", "8", "--keyframe-every", "3"])
    )
    assert summary["frames"] == 3  # frames 0, 3, 6 kept


def test_demo_fp8_cache_keeps_the_frames_in_fewer_bytes():
    """--kv-dtype fp8: every frame kept, in (head_dim + 2) / (2 head_dim) of the bf16 cache's
    bytes (an FP8 code per dim, a bf16 scale per token and head)."""
    from jaxkv import frame

    argv = ["--frames", "7", "--layers", "1", "--scale-frames", "2", "--window", "3", "--kv-dtype", "fp8"]
    got = demo.run(argparse_parser().parse_args(argv))  # 16 heads x 64 dims at 224x224: 256 patches
    assert got["frames"] == 7 and got["visible tokens"] == 5 * 256 + 7 * 6
    assert got["backend"] == "xla"  # auto: no kernel takes an FP8 cache yet
    bf16 = frame.FrameSpec(1, 16, 64, 256, 6, scale_frames=2, sliding_window=3, max_frames=7).kv_bytes
    mib = float(got["cache memory"].split()[0])
    assert "float8_e4m3fn" in got["cache memory"] and mib * 2**20 / bf16 == pytest.approx((64 + 2) / 128, rel=2e-2)


def test_demo_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--frames",
        "--resolution",
        "--layers",
        "--heads",
        "--head-dim",
        "--scale-frames",
        "--window",
        "--special",
        "--keyframe-every",
        "--impl",
        "--dtype",
        "--kv-dtype",
        "--seed",
        "--model",
        "--keyframe-threshold",
        "--plot",
        "--lingbot",
        "--images",
        "--checkpoint",
        "--small",
        "--keyframe-interval",
        "--out",
        "--set",
    ):
        assert flag in out


def test_model_demo_streams_keyframes_and_plots(tmp_path, monkeypatch, capsys):
    pytest.importorskip("flax")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    p = argparse_parser()
    summary = demo.run(
        p.parse_args(
            [
                "--model",
                "--frames",
                "14",
                "--layers",
                "1",
                "--heads",
                "2",
                "--head-dim",
                "8",
                "--resolution",
                "112x84",
                "--scale-frames",
                "2",
                "--window",
                "3",
                "--keyframe-threshold",
                "0.01",
            ]
        )
    )
    plot = tmp_path / demo.OUT / demo.MODEL_PLOT  # the default: one named folder, announced
    assert plot.stat().st_size > 10_000  # a PNG with two panels
    assert f"wrote {demo.OUT}/{demo.MODEL_PLOT}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.OUT]
    assert "112x84 (width x height)" in summary["model"]  # the flag's order
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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frames", "0"], "--frames: expected an int >= 1, got 0"),
        (["--layers", "0"], "--layers: expected an int >= 1, got 0"),
        (["--window", "-1"], "--window: expected an int >= 0, got -1"),
        (["--keyframe-threshold", "0.01"], "--keyframe-threshold: used only with --model"),
        (["--scale-frames", "0", "--window", "0"], "--scale-frames, --window: expected at least one frame kept"),
        (["--model", "--special", "1"], "--special: with --model, expected an int >= 2 (camera + scale tokens), got 1"),
        (["--model", "--head-dim", "5"], "--head-dim: with --model, expected an even int >= 6"),
        (["--model", "--keyframe-every", "2"], "--keyframe-every: not used with --model (use --keyframe-threshold)"),
        (["--model", "--lingbot"], "--lingbot: not used with --model (pick one)"),
        (["--small"], "--small: used only with --lingbot"),
        (
            ["--kv-dtype", "fp8", "--dtype", "float32"],
            "--kv-dtype: an fp8 cache takes K/V in as bfloat16: expected --dtype bfloat16, got float32",
        ),
        (
            ["--kv-dtype", "fp8", "--impl", "pallas"],
            "--impl: impl='pallas' for frame.attention: the Pallas kernels read and write bf16 / f16 rows",
        ),
    ],
)
def test_demo_bad_flags_are_usage_errors(capsys, argv, message):
    """A mistaken flag prints usage and what is wrong (exit status 2), never a traceback."""
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err
