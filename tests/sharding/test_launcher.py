"""One process per device (``jaxkv.launch``): the launcher, ``initialize``, and a checkpoint
written by two processes and restored by one. Every check runs in fresh processes on the
CPU (``--cpu-devices``), so this process's jax is untouched."""

import os
import pathlib
import subprocess
import sys
import time

import pytest

from jaxkv import launch
from jaxkv.__main__ import parser

HERE = pathlib.Path(__file__).resolve().parent


def _launch(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_checkpoint_by_two_processes_restores_in_one(tmp_path):
    """Two processes (2 CPU devices each) save a frame and a hybrid cache from the global
    4-device mesh; one process with 4 devices restores them bit for bit and steps on; the
    hybrid cache onto another shard count is refused."""
    p = _launch("--processes", "2", "--cpu-devices", "2", str(HERE / "launched_check.py"), "save", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[0] process 0: saved" in p.stdout and "[1] process 1: saved" in p.stdout, p.stdout[-2000:]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    r = subprocess.run(
        [sys.executable, str(HERE / "launched_check.py"), "restore", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("restore: ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_a_failing_process_stops_the_others(tmp_path):
    """Process 1 raises; process 0 would sleep a minute: the launcher stops it and returns
    process 1's status, well before the minute."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import time, jaxkv.launch\n"
        "me = jaxkv.launch.initialize()\n"
        "if me == 1:\n    raise ValueError('process 1 fails')\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    p = _launch("--processes", "2", "--cpu-devices", "1", str(script))
    assert p.returncode == 1 and "[1] ValueError: process 1 fails" in p.stdout, p.stdout[-2000:] + p.stderr
    assert "exited with status 1" in p.stderr and time.monotonic() - t0 < 45


def test_initialize_without_the_launcher_names_the_setting():
    r = subprocess.run(
        [sys.executable, "-c", "import jaxkv.launch; jaxkv.launch.initialize()"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("JAXKV_")},
    )
    assert r.returncode == 1 and "JAXKV_COORDINATOR: not set" in r.stderr and "jaxkv launch" in r.stderr, r.stderr


def test_a_process_whose_peers_never_come_says_so_and_ends():
    """Process 1 of 2 with no process 0: it names the coordinator and the timeout, then jax
    ends it: no hang."""
    env = {launch.COORDINATOR: "localhost:1", launch.NUM_PROCESSES: "2", launch.PROCESS_ID: "1"}
    r = subprocess.run(
        [sys.executable, "-c", "import jaxkv.launch; jaxkv.launch.initialize(timeout_s=3)"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode != 0 and "process 1 of 2 has waited 3 s" in r.stderr and "localhost:1" in r.stderr, r.stderr


def _args(*argv):
    p, _ = parser()
    return p.parse_args(["launch", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--processes", "0", "--cpu-devices", "1", "x.py"), "--processes: expected N >= 1, got 0"),
        (("--cpu-devices", "0", "--processes", "2", "x.py"), "--cpu-devices: expected K >= 1, got 0"),
        (("--hosts", "2", "--processes", "1", "--cpu-devices", "1", "x.py"), "--coordinator: required"),
        (("--hosts", "2", "--host-index", "2", "--coordinator", "h:1", "x.py"), "--host-index: expected 0 <= index"),
        (("--timeout", "0", "--processes", "1", "--cpu-devices", "1", "x.py"), "--timeout: expected seconds >= 1"),
    ],
)
def test_bad_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        launch.plan(_args(*argv))


def test_plan_gives_each_process_its_gpu_and_id(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    envs = launch.plan(_args("--hosts", "2", "--host-index", "1", "--coordinator", "head:1234", "x.py"))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5"]
    assert [e[launch.PROCESS_ID] for e in envs] == ["2", "3"]
    assert {e[launch.NUM_PROCESSES] for e in envs} == {"4"} and {e[launch.COORDINATOR] for e in envs} == {"head:1234"}
    with pytest.raises(ValueError, match="--processes: 3 processes, but this host shows 2 GPU"):
        launch.plan(_args("--processes", "3", "x.py"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="--processes: no GPU is visible here"):
        launch.plan(_args("x.py"))


def test_the_scripts_flags_pass_through():
    """A script flag that abbreviates launcher flags (``--host``: ``--hosts``, ``--host-index``)
    is the script's, as is one that names a launcher flag."""
    args = _args("--processes", "1", "--cpu-devices", "1", "x.py", "--host", "h", "--timeout", "3")
    assert args.args == ["--host", "h", "--timeout", "3"] and args.timeout == launch.DEFAULT_TIMEOUT


def test_a_missing_script_is_a_usage_error(capsys):
    from jaxkv.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["launch", "--processes", "1", "--cpu-devices", "1", "no_such_script.py"])
    assert e.value.code == 2 and "script: expected a Python file, got 'no_such_script.py'" in capsys.readouterr().err


def test_a_process_count_that_does_not_divide_the_streams(tmp_path):
    """Three streams over two processes: each process's init raises, naming the mesh axis,
    the processes and num_streams; the launcher returns the failure."""
    script = tmp_path / "three.py"
    script.write_text(
        "import jaxkv.launch\n"
        "jaxkv.launch.initialize()\n"
        "import jax, numpy as np\n"
        "from jax.sharding import Mesh\n"
        "from jaxkv import frame\n"
        "spec = frame.FrameSpec(num_layers=1, num_heads=2, head_dim=8, patches_per_frame=4, num_streams=3)\n"
        "frame.init(spec, mesh=Mesh(np.array(jax.devices()), ('data',)))\n"
    )
    p = _launch("--processes", "2", "--cpu-devices", "1", str(script))
    assert p.returncode == 1, p.stdout[-2000:]
    assert "axis 'data' has 2 devices on 2 processes, which does not divide FrameSpec.num_streams = 3" in p.stdout, (
        p.stdout[-2000:]
    )
