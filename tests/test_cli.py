"""The command line's first hour: every mistake is one usage line naming the flag (exit
status 2, no traceback), found before any model is built or any file written; missing
extras say what to pip install; ``--help`` lists both commands.

In-process ``main([...])`` calls (one jax import for the file); the checks under test stop
before anything is built, which the ``nothing_built`` fixture enforces.
"""

import importlib.util
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxkv import demo, frame
from jaxkv.__main__ import main

HAS = {m: importlib.util.find_spec(m) is not None for m in ("flax", "safetensors", "PIL", "matplotlib", "torch")}
lingbot = pytest.mark.skipif(
    not all(HAS[m] for m in ("flax", "safetensors", "PIL", "matplotlib")), reason="needs the lingbot extra"
)
flax = pytest.mark.skipif(not HAS["flax"], reason="needs flax")
cpu_only = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU backends run on a GPU")
FRAMES = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "frames"


@pytest.fixture
def nothing_built(monkeypatch, tmp_path):
    """Run in an empty folder; fail the test if a cache or model is built or a file written there."""

    def built(*a, **k):
        raise AssertionError("a cache or model was built")

    monkeypatch.setattr(frame, "init", built)
    if HAS["flax"]:
        from jaxkv.models import demo as model_demo
        from jaxkv.models import lingbot_demo
        from jaxkv.models.lingbot import convert

        monkeypatch.setattr(model_demo, "StreamingReconstructor", built)
        monkeypatch.setattr(lingbot_demo, "build_model", built)
        monkeypatch.setattr(convert, "from_state_dict", built)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert not list(cwd.iterdir()), "something was written"


def usage_error(capsys, *argv) -> str:
    """The one error line of ``main(argv)``, which must exit with status 2 and no traceback."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    return lines[0].split(": error: ", 1)[1]


# ---------------------------------------------------------------- help


def test_help_lists_both_commands_and_points_at_the_docs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    commands = out.split("commands:")[1]
    assert "    demo " in commands and "    convert-lingbot" in commands and "lingbot-map weights ->" in commands
    assert "docs/cli.md" in out and "Exit status" in out


def test_python_dash_m_runs_the_same_parser():
    out = subprocess.run([sys.executable, "-m", "jaxkv", "--help"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: python -m jaxkv") and "convert-lingbot" in out


# ---------------------------------------------------------------- missing extras


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--model"], '--model: needs flax, not installed here: pip install "jaxkv[flax]"'),
        (
            ["demo", "--lingbot", "--images", "x"],
            '--lingbot: needs flax, not installed here: pip install "jaxkv[lingbot]"',
        ),
        (
            ["convert-lingbot", "a.pt", "b.safetensors"],
            'convert-lingbot: needs flax, not installed here: pip install "jaxkv[lingbot]"',
        ),
    ],
)
def test_a_missing_extra_names_the_pip_command(capsys, monkeypatch, nothing_built, argv, message):
    monkeypatch.setitem(sys.modules, "flax", None)
    assert usage_error(capsys, *argv) == message


def test_torch_bridge_without_torch_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    for name in [m for m in sys.modules if m.split(".")[0] == "torch_bridge"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "jaxkv\[torch\]"') as e:
        import torch_bridge  # noqa: F401
    assert e.value.name == "torch"


def test_save_and_restore_without_orbax_name_the_pip_command(monkeypatch, tmp_path):
    import jaxkv

    state = frame.init(frame.FrameSpec(num_layers=1, num_heads=1, head_dim=8, patches_per_frame=4))
    monkeypatch.setitem(sys.modules, "orbax", None)
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    for call in (lambda: jaxkv.save(tmp_path / "ck", state), lambda: jaxkv.restore(tmp_path / "ck")):
        with pytest.raises(ModuleNotFoundError, match=r'pip install "jaxkv\[checkpoint\]"'):
            call()
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- backends


@cpu_only
@pytest.mark.parametrize("impl", ["cudnn", "pallas", "cuda"])
def test_a_backend_that_cannot_run_here_is_refused_up_front(capsys, nothing_built, impl):
    err = usage_error(capsys, "demo", "--impl", impl, "--frames", "2", "--layers", "1")
    assert err.startswith(f"--impl: impl={impl!r} for frame.attention: expected ") and "got cpu" in err


@cpu_only
@flax
def test_model_demo_refuses_its_backend_before_building(capsys, nothing_built):
    assert usage_error(capsys, "demo", "--model", "--impl", "cudnn").startswith("--impl: impl='cudnn'")


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("mode", [[], ["--model"]])
def test_a_run_that_cannot_fit_says_how_much_it_needs(capsys, nothing_built, mode):
    if mode and not HAS["flax"]:
        pytest.skip("needs flax")
    err = usage_error(capsys, "demo", *mode, "--frames", "1000000000")
    assert err.startswith("--frames: the run needs at least ") and "(K/V cache 536.4 TiB" in err
    assert "more than the " in err and "lower --frames" in err


def test_the_memory_check_compares_against_the_limit(monkeypatch):
    monkeypatch.setattr(demo, "memory_limit", lambda: (1000, "free memory of the test GPU"))
    demo.check_memory("--frames", {"K/V cache": 600, "video": 400}, "lower it")  # fits exactly
    with pytest.raises(
        ValueError,
        match=r"^--frames: the run needs at least 1001 B \(K/V cache 601 B, video 400 B\), "
        r"more than the 1000 B of free memory of the test GPU; lower it$",
    ):
        demo.check_memory("--frames", {"K/V cache": 601, "video": 400}, "lower it")


# ---------------------------------------------------------------- output paths


def test_output_defaults_go_to_one_named_folder(nothing_built):
    p = __import__("argparse").ArgumentParser()
    demo.add_arguments(p)
    if HAS["flax"] and HAS["matplotlib"]:
        args = demo.preflight(p.parse_args(["--model"]))
        assert str(args.plot) == f"{demo.OUT}/{demo.MODEL_PLOT}"
    if all(HAS[m] for m in ("flax", "PIL", "matplotlib")):
        assert str(demo.preflight(p.parse_args(["--lingbot", "--images", "x"])).out) == demo.OUT
    # nothing_built: the folder is created by the run that writes into it, not by the checks


@flax
def test_unwritable_plot_paths_are_refused_before_the_run(capsys, nothing_built):
    (nothing_built.parent / "afile").write_text("x")
    (nothing_built.parent / "adir").mkdir()
    cases = {
        "/nonexistent/x.png": "--plot: no folder /nonexistent to write x.png in (create it first)",
        str(nothing_built.parent / "afile" / "x.png"): f"--plot: {nothing_built.parent / 'afile'} is a file, "
        "not a folder to write x.png in",
        str(nothing_built.parent / "adir"): "--plot: expected a file name ending in .png / .pdf / .svg / .jpg / "
        f".jpeg, got '{nothing_built.parent / 'adir'}'",
        "plot.xyz": "--plot: expected a file name ending in .png / .pdf / .svg / .jpg / .jpeg, got 'plot.xyz'",
    }
    for plot, message in cases.items():
        assert usage_error(capsys, "demo", "--model", "--plot", plot) == message
    assert (
        usage_error(capsys, "demo", "--plot", "x.png")
        == "--plot: used only with --model (--lingbot writes under --out)"
    )
    assert usage_error(capsys, "demo", "--out", "x") == "--out: used only with --lingbot"


@lingbot
def test_unwritable_out_folders_are_refused_before_the_run(capsys, nothing_built):
    afile = nothing_built.parent / "afile"
    afile.write_text("x")
    base = ["demo", "--lingbot", "--images", str(FRAMES), "--small", "--out"]
    assert usage_error(capsys, *base, str(afile)) == f"--out: {afile} is a file; expected a folder"
    deep = nothing_built.parent / "no" / "such"
    assert (
        usage_error(capsys, *base, str(deep)) == f"--out: cannot create {deep}: {deep.parent} is not an existing folder"
    )


@lingbot
def test_convert_lingbot_checks_its_output_first(capsys, nothing_built, tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "w.safetensors"
    save_file({"a": np.zeros(3, np.float32)}, str(src))
    assert (
        usage_error(capsys, "convert-lingbot", str(src), "out.bin")
        == "out: expected a file name ending in .safetensors, got 'out.bin'"
    )
    assert (
        usage_error(capsys, "convert-lingbot", str(src), str(tmp_path / "none" / "o.safetensors"))
        == f"out: no folder {tmp_path / 'none'} to write o.safetensors in (create it first)"
    )


# ---------------------------------------------------------------- checkpoints


def _bad_checkpoints(tmp_path) -> dict:
    """{file: the error's text after 'FLAG: PATH '} for files that are not checkpoints."""
    from safetensors.numpy import save_file

    d = tmp_path / "ckpts"
    d.mkdir()
    (d / "empty.safetensors").write_bytes(b"")
    save_file({"w": np.zeros((64, 64), np.float32)}, str(d / "whole.safetensors"))
    data = (d / "whole.safetensors").read_bytes()
    (d / "cut.safetensors").write_bytes(data[: len(data) // 2])
    (d / "noise.safetensors").write_bytes(b"\x07" * 100)
    header = json.dumps({"w": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (d / "dtype.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    (d / "lfs.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    (d / "image.pt").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    (d / "notes.txt").write_text("hello")
    return {
        "empty.safetensors": "is empty (0 bytes); expected a safetensors file",
        "cut.safetensors": "is not a valid safetensors file (its tensors need 16384 bytes of data, the file holds",
        "noise.safetensors": "is not a valid safetensors file (its header length field says",
        "dtype.safetensors": "is not a readable safetensors file (SafetensorError: ",
        "lfs.safetensors": "is a Git LFS pointer, not the weights (fetch them: git lfs pull)",
        "image.pt": "(.pt, 48 bytes) is a PNG image; expected a safetensors file",
        "notes.txt": "(.txt, 5 bytes) is not a format jaxkv reads (it starts with bytes 68 65 6c 6c 6f)",
    }


@lingbot
def test_a_bad_checkpoint_file_says_what_it_is(capsys, nothing_built, tmp_path):
    for name, what in _bad_checkpoints(tmp_path).items():
        path = tmp_path / "ckpts" / name
        err = usage_error(capsys, "demo", "--lingbot", "--images", str(FRAMES), "--checkpoint", str(path))
        assert err.startswith(f"--checkpoint: {path} ") and what in err, err
        err = usage_error(capsys, "convert-lingbot", str(path), "out.safetensors")
        assert err.startswith(f"checkpoint: {path} ") and what in err, err
    assert (
        usage_error(capsys, "convert-lingbot", str(tmp_path / "none.pt"), "o.safetensors")
        == f"checkpoint: no checkpoint file at {tmp_path / 'none.pt'}"
    )


@lingbot
def test_a_torch_checkpoint_without_torch_names_the_pip_command(capsys, monkeypatch, nothing_built, tmp_path):
    (tmp_path / "w.pt").write_bytes(b"PK\x03\x04 a zip archive")
    monkeypatch.setitem(sys.modules, "torch", None)
    err = usage_error(capsys, "demo", "--lingbot", "--images", str(FRAMES), "--checkpoint", str(tmp_path / "w.pt"))
    assert err == (
        "--checkpoint: w.pt is a torch checkpoint; reading it needs torch, not installed here: "
        'pip install "jaxkv[torch]", or convert it once where torch is installed: '
        "python -m jaxkv convert-lingbot"
    )


@lingbot
def test_library_calls_name_their_own_argument(tmp_path):
    from jaxkv.models.lingbot.convert import load_lingbot_checkpoint

    (tmp_path / "e.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"^path: .* is empty \(0 bytes\)"):
        load_lingbot_checkpoint(tmp_path / "e.safetensors")


# ---------------------------------------------------------------- --set


@lingbot
@pytest.mark.parametrize(
    "item, message",
    [
        ("depth=abc", "--set depth=abc: expected an int for LingbotConfig.depth, got 'abc'"),
        ("depth=4.5", "--set depth=4.5: expected an int for LingbotConfig.depth, got '4.5'"),
        ("enable_point=1", "--set enable_point=1: expected true or false for LingbotConfig.enable_point, got '1'"),
        (
            'selected_idx=[0,1,"a",3]',
            '--set selected_idx=[0,1,"a",3]: expected a JSON list of ints (e.g. [0,1,2,3]) for LingbotConfig.selected_idx, '
            "got '[0,1,\"a\",3]'",
        ),
        ("nope=1", "--set nope=1: 'nope' is not a LingbotConfig field; expected one of ["),
        ("depth", "--set: expected FIELD=VALUE, got 'depth'"),
        (
            "impl=foo",
            "--set impl=foo: expected one of ('auto', 'reference', 'xla', 'cudnn', 'pallas', 'cuda'), got 'foo'",
        ),
        ("height=42", "--set height=42: the frame size comes from the --images frames"),
        ("num_heads=0", "--set: LingbotConfig refuses these values (ZeroDivisionError: "),
        ("depth=2", "--set: selected_idx: expected 4 increasing block indices below depth=2, got (4, 11, 17, 23)"),
    ],
)
def test_set_values_are_checked_before_the_model_is_built(capsys, nothing_built, item, message):
    err = usage_error(capsys, "demo", "--lingbot", "--images", str(FRAMES), "--small", "--set", item)
    assert err.startswith(message), err


@lingbot
@cpu_only
def test_set_impl_that_cannot_run_here_is_refused_before_the_model_is_built(capsys, nothing_built):
    err = usage_error(capsys, "demo", "--lingbot", "--images", str(FRAMES), "--small", "--set", "impl=pallas")
    assert err.startswith("--set impl=pallas: impl='pallas' for frame.attention: expected an NVIDIA Hopper GPU")
    err = usage_error(capsys, "demo", "--lingbot", "--images", str(FRAMES), "--small", "--impl", "cudnn")
    assert err.startswith("--impl: impl='cudnn' for frame.attention: expected an NVIDIA GPU with cuDNN")


# ---------------------------------------------------------------- summaries


@flax
def test_lingbot_timing_says_when_no_frame_was_streamed():
    from jaxkv.models.lingbot_demo import timing

    key = "ms/frame (median, streamed frames after the first)"
    rows = timing([2.0] + [0.0007] * 7, 8)
    assert rows[key] == "none: all 8 frames were scale frames (one call)"
    assert rows["scale frames (8, one call with its compile) s"] == "2.0"
    assert timing([2.0, 0.001, 1.5], 2)[key] == "none: one streamed frame, timed with its compile above"
    rows = timing([2.0, 0.001, 1.5, 0.010, 0.012, 0.011], 2)
    assert rows[key] == "11.0" and rows["first streamed frame (compile) ms"] == "1500"


@flax
def test_model_demo_cache_spec_is_the_models():
    from flax import nnx

    from jaxkv.flax import caches
    from jaxkv.models import SMALL, StreamingReconstructor

    model = nnx.eval_shape(lambda: StreamingReconstructor(SMALL, rngs=nnx.Rngs(0)))  # shapes only
    assert caches(model)[0].spec == SMALL.cache_spec
