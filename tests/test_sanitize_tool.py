"""tools/sanitize.py's reading of compute-sanitizer logs (no GPU: logs in the tool's format)."""

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sanitize", ROOT / "tools" / "sanitize.py")
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)

PASSED = """tests/kernels/test_adversarial.py::test_pool_attention[cuda-official] PASSED [ 1%]
tests/kernels/test_adversarial.py::test_dequant_gather[official] PASSED [ 2%]
"""
HAZARD = """========= Error: Potential RAW hazard detected at __shared__ 0x32600 in block (2,0,0) :
=========     Write Thread (64,0,0) at jaxkv::<unnamed>::pool_attention_kernel(jaxkv::<unnamed>::AttnArgs)+0xc200
=========     Read Thread (192,0,0) at jaxkv::<unnamed>::pool_attention_kernel(jaxkv::<unnamed>::AttnArgs)+0xc4a0
=========     Current Value : 0
"""
UNINIT = """========= Uninitialized __global__ memory read of size 4 bytes
=========     at loop_exponential_fusion+0xd0
=========     by thread (72,0,0) in block (0,0,0)
"""


def _run(text, code=0):
    return dict(code=code, seconds=1.0, **S.parse(text))


def test_reports_are_attributed_to_their_kernel():
    p = S.parse(PASSED + HAZARD + HAZARD + UNINIT)
    assert p["where"] == ["jaxkv::<unnamed>::pool_attention_kernel"] * 2 + ["loop_exponential_fusion"]
    assert ("tests/kernels/test_adversarial.py::test_dequant_gather[official]", "PASSED") in p["results"]


def test_matrix_flags_reports_other_kernels_and_cut_runs():
    lines, clean = S.matrix({"racecheck": _run(PASSED + HAZARD), "memcheck": _run(PASSED)}, list(S.TESTS))
    row = next(ln for ln in lines if ln.startswith("| cuda/pool_attention.cu |"))
    assert "1 reports, 1 tests passed" in row.split("|")[2] and "0 reports, 1 tests passed" in row.split("|")[3]
    assert not clean
    _, clean = S.matrix({"memcheck": _run(PASSED)}, list(S.TESTS))
    assert clean
    _, clean = S.matrix({"initcheck": _run(PASSED + UNINIT)}, list(S.TESTS))
    assert not clean  # a report in a kernel that is not jaxkv's still fails the run
    lines, clean = S.matrix({"memcheck": _run(PASSED, code=None)}, list(S.TESTS))
    assert not clean and any("cut short" in ln for ln in lines)


def test_bad_tool_is_refused():
    with pytest.raises(SystemExit, match="--tools: expected some of memcheck"):
        S.main(["--tools", "memcheck,helgrind"])


def test_probe_reports_read_the_sanitizers_own_count():
    race = "mode\n========= RACECHECK SUMMARY: 100 hazards displayed (124 errors, 0 warnings)\n"
    assert S.probe_reports(race) == 124
    assert S.probe_reports("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n") == 0
    assert S.probe_reports("========= ERROR SUMMARY: 480 errors\n") == 480
    assert S.probe_reports(UNINIT * 3) == 3  # no summary (a run cut short): the reports counted


def _fake_sanitizer(tmp_path, monkeypatch, crash_if, before_any=False):
    """A sanitizer that runs nothing: for the file it is given it prints test_a, test_b and
    test_c (less those deselected) as passed, and dies like a segfault in test_b (or,
    ``before_any``, before a test begins) when ``crash_if`` (Python over ``f``, the file, and
    ``tmp``, a folder to keep marks in) holds."""
    fake = tmp_path / "fake-sanitizer"
    fake.write_text(
        "#!/usr/bin/env python3\nimport pathlib, sys\n"
        "f = next(a for a in sys.argv if a.endswith('.py') and '/' in a)\n"
        f"tmp = pathlib.Path({str(tmp_path)!r})\n"
        f"if {before_any} and ({crash_if}):\n"
        "    sys.exit(139)\n"
        "for t in ('test_a', 'test_b', 'test_c'):\n"
        "    if f + '::' + t in sys.argv:\n"
        "        continue\n"
        f"    if t == 'test_b' and ({crash_if}):\n"
        "        print(f + '::test_b ', flush=True)\n"
        "        sys.exit(139)\n"
        "    print(f + '::' + t + ' PASSED')\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(S, "sanitizer", lambda: str(fake))


def test_one_process_per_file_so_a_crash_costs_one_file(tmp_path, monkeypatch):
    """A test the process dies in every time is listed as crashed and the file goes on past
    it; its other tests are counted once; the next file still runs; the crash fails the matrix."""
    _fake_sanitizer(tmp_path, monkeypatch, "'crash' in f")
    files = ["tests/kernels/test_crash.py", "tests/kernels/test_adversarial.py"]
    r = S.run_tool("memcheck", files, [], tmp_path, timeout=60)
    assert [t for t, _ in r["results"]] == [
        files[0] + "::test_a",
        files[0] + "::test_c",
        files[1] + "::test_a",
        files[1] + "::test_b",
        files[1] + "::test_c",
    ]
    assert r["crashed"] == ["tests/kernels/test_crash.py::test_b (exit 139, twice)"]
    lines, clean = S.matrix({"memcheck": r}, files)
    assert not clean and "crashed: tests/kernels/test_crash.py::test_b (exit 139, twice)" in lines[-1]


def test_a_process_that_dies_before_any_test_gives_the_file_up(tmp_path, monkeypatch):
    _fake_sanitizer(tmp_path, monkeypatch, "'crash' in f", before_any=True)
    files = ["tests/kernels/test_crash.py", "tests/kernels/test_adversarial.py"]
    r = S.run_tool("memcheck", files, [], tmp_path, timeout=60)
    assert [t for t, _ in r["results"]] == [files[1] + "::test_a", files[1] + "::test_b", files[1] + "::test_c"]
    assert r["crashed"] == ["tests/kernels/test_crash.py (exit 139)"]


def test_a_process_that_dies_once_runs_again_from_there(tmp_path, monkeypatch):
    """The sanitizer's process dying once (intermittent, as seen on the GPU machine): the file
    runs again with the tests it reported deselected; every test counted once, no crash."""
    _fake_sanitizer(tmp_path, monkeypatch, "not (tmp / 'died').exists() and (tmp / 'died').touch() is None")
    files = ["tests/kernels/test_adversarial.py"]
    r = S.run_tool("memcheck", files, [], tmp_path, timeout=60)
    assert [t for t, _ in r["results"]] == [files[0] + "::test_a", files[0] + "::test_b", files[0] + "::test_c"]
    assert r["crashed"] == [] and r["code"] == 0
    assert "the sanitizer's process died (exit 139); again, from there" in (tmp_path / "memcheck.log").read_text()
    _, clean = S.matrix({"memcheck": r}, files)
    assert clean


def test_synccheck_instruments_jaxkv_kernels_only(tmp_path, monkeypatch):
    """synccheck gets a kernel filter that names jaxkv's kernels and not torch's or
    FlashMLA's; initcheck gets none (a write by a kernel it skips would look unwritten)."""
    import re

    argv = tmp_path / "argv"
    fake = tmp_path / "fake-sanitizer"
    fake.write_text(f"#!/usr/bin/env python3\nimport sys\nopen({str(argv)!r}, 'a').write(repr(sys.argv) + '\\n')\n")
    fake.chmod(0o755)
    monkeypatch.setattr(S, "sanitizer", lambda: str(fake))
    for tool in ("synccheck", "initcheck"):
        S.run_tool(tool, ["tests/kernels/test_adversarial.py"], [], tmp_path, timeout=60)
    sync, init = (eval(line) for line in argv.read_text().splitlines())
    assert "--kernel-name" not in init
    pattern = sync[sync.index("--kernel-name") + 1].removeprefix("regex=")
    ours = ["jaxkv::<unnamed>::compress_decode_kernel<true>", "jaxkv::check_kernel", "jaxkv_frame_append"]
    theirs = ["flash_fwd_splitkv_mla_fp8_sparse_kernel", "at::native::vectorized_elementwise_kernel<4>"]
    assert all(re.search(pattern, k) for k in ours)
    assert not any(re.search(pattern, k) for k in theirs)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc not on PATH (CI has it)")
def test_racecheck_probes_compile(tmp_path):
    exe = tmp_path / "handoffs"
    src = ROOT / "tools" / "sanitizer_probes" / "racecheck_handoffs.cu"
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
