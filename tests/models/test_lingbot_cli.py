"""``python -m jaxkv demo --lingbot`` and ``python -m jaxkv convert-lingbot``: outputs and clean errors."""

import pathlib

import numpy as np
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("safetensors")
pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

from jaxkv.__main__ import main  # noqa: E402

FRAMES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "frames"
TINY = ["--set", "depth=4", "--set", "selected_idx=[0,1,2,3]", "--set", "camera_num_iterations=2"]


def _demo(images, out, *extra):
    return main(["demo", "--lingbot", "--images", str(images), "--small", "--out", str(out), *TINY, *extra])


def test_demo_on_example_frames_writes_both_plots(tmp_path, capsys):
    with pytest.warns(UserWarning, match="random weights"):
        assert _demo(FRAMES, tmp_path / "out", "--keyframe-interval", "2") == 0
    printed = capsys.readouterr().out
    for name in ("trajectory.png", "depth.png"):
        path = tmp_path / "out" / name
        assert path.stat().st_size > 0 and str(path) in printed
        with Image.open(path) as im:
            im.verify()
    assert "frames" in printed and "112x84 (width x height)" in printed
    # 2 scale frames in one call, then 6 streamed: the median is over the 5 after the first (its compile)
    assert "first streamed frame (compile) ms" in printed
    median = next(ln for ln in printed.splitlines() if "ms/frame (median, streamed frames after the first)" in ln)
    assert float(median.split()[-1]) > 0
    assert f"wrote {tmp_path / 'out' / 'trajectory.png'}" in printed


def _error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_demo_bad_inputs_are_clean_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no .png or .jpg files in" in _error(capsys, "demo", "--lingbot", "--images", str(empty))
    assert str(tmp_path / "nope") in _error(capsys, "demo", "--lingbot", "--images", str(tmp_path / "nope"))

    odd = tmp_path / "odd"
    odd.mkdir()
    Image.fromarray(np.zeros((100, 100, 3), np.uint8)).save(odd / "a.png")
    err = _error(capsys, "demo", "--lingbot", "--images", str(odd))
    assert "a.png" in err and "100x100" in err and "14" in err

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(mixed / "a.png")
    Image.fromarray(np.zeros((28, 42, 3), np.uint8)).save(mixed / "b.png")
    assert "b.png is 42x28" in _error(capsys, "demo", "--lingbot", "--images", str(mixed))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.png").write_bytes(b"\x89PNG not really")
    assert "broken.png" in _error(capsys, "demo", "--lingbot", "--images", str(bad))

    assert "--images" in _error(capsys, "demo", "--lingbot")
    assert "--keyframe-interval" in _error(
        capsys, "demo", "--lingbot", "--images", str(FRAMES), "--keyframe-interval", "0"
    )
    assert "--set" in _error(capsys, "demo", "--lingbot", "--images", str(FRAMES), "--small", "--set", "nope=1")
    assert "--checkpoint" in _error(capsys, "demo", "--checkpoint", "x.pt")
    fp8 = ("demo", "--lingbot", "--images", str(FRAMES), "--small", "--kv-dtype", "fp8")
    assert "--set kv_dtype=None: --kv-dtype fp8 says otherwise" in _error(capsys, *fp8, "--set", "kv_dtype=null")
    assert "the Pallas kernels read and write bf16 / f16 rows" in _error(capsys, *fp8, "--impl", "pallas")


def test_demo_kv_dtype_is_the_global_cache_storage(tmp_path):
    """--kv-dtype fp8 with --lingbot: the port's LingbotConfig.kv_dtype (its global cache)."""
    import argparse

    from jaxkv import demo, frame
    from jaxkv.models import lingbot_demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = demo.preflight(p.parse_args(["--lingbot", "--images", str(FRAMES), "--small", "--out", str(tmp_path)]))
    assert lingbot_demo.prepare(args).config.kv_dtype is None
    args.kv_dtype = "fp8"
    assert lingbot_demo.prepare(args).config.kv_dtype == frame.FP8


def test_convert_lingbot_round_trip(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from flax import nnx

    from jaxkv.models.lingbot import LingbotConfig, LingbotMap
    from jaxkv.models.lingbot.convert import load_lingbot_checkpoint, to_upstream, upstream_key

    config = LingbotConfig.small(depth=4, selected_idx=(0, 1, 2, 3), camera_num_iterations=2)
    model = LingbotMap(config, rngs=nnx.Rngs(3))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    sd = {upstream_key(p): torch.from_numpy(np.array(to_upstream(p, np.asarray(v.get_value())))) for p, v in flat}
    torch.save({"model": sd}, tmp_path / "ckpt.pt")
    out = tmp_path / "lingbot.safetensors"
    assert (
        main(
            [
                "convert-lingbot",
                str(tmp_path / "ckpt.pt"),
                str(out),
                "--height",
                "42",
                "--width",
                "56",
                "--set",
                "selected_idx=[0,1,2,3]",
                "--set",
                "camera_num_iterations=2",
            ]
        )
        == 0
    )
    assert str(out) in capsys.readouterr().out
    again = load_lingbot_checkpoint(out)
    assert (again.config.height, again.config.width, again.config.depth) == (42, 56, 4)
    np.testing.assert_array_equal(
        np.asarray(again.aggregator.camera_token[...]), np.asarray(model.aggregator.camera_token[...])
    )

    missing = tmp_path / "missing.pt"
    err = _error(capsys, "convert-lingbot", str(missing), str(tmp_path / "x.safetensors"))
    assert str(missing) in err
