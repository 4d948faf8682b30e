"""Every GPU kernel test under compute-sanitizer: memcheck, racecheck, synccheck, initcheck.

    python tools/sanitize.py [--tools memcheck,racecheck,synccheck,initcheck] [--probes]
                             [--out sanitize-logs] [--timeout 3600] [-k EXPR] [TEST_PATH ...]

The tools run side by side on one GPU; each runs ``compute-sanitizer --tool TOOL python -m
pytest -m gpu FILE`` once per test file, in turn (a process the sanitizer brings down runs
again from the test it died in; a test it dies in twice is listed and passed over), with
the settings that make the tools see what matters:

* ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``: every jax buffer its own ``cudaMalloc``, so an
  access past a buffer leaves its allocation (with the default pool allocator it would land
  in a neighbour's bytes and memcheck could not tell);
* XLA's command buffers off (each launch reported by its kernel's name) and its autotuning
  off (autotuning compares scratch buffers it never wrote: initcheck reports that are XLA's);
* ``JAXKV_SANITIZE=1``: ``exhaustive`` tests skip (tests/conftest.py);
* synccheck instruments jaxkv's kernels only: instrumenting torch's and FlashInfer's broke
  their results (the other tools instrument every kernel; initcheck must, to see writes).

``--probes`` first runs ``tools/sanitizer_probes/``: minimal programs whose protocols are
known correct (or known racy), to show which of the kernels' synchronization the installed
racecheck and initcheck can follow. Logs go to ``OUT/TOOL.log``. The matrix printed last
(and written to ``OUT/matrix.md``) has one row per kernel and one column per tool: the
sanitizer's reports attributed to that kernel, and whether the tests that launch it ran to
the end. Exit status 1 when any report, failed test, crashed or unfinished run remains.
docs/reliability.md: what each tool checks, the last matrix, what a tool cannot see.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# kernel (as the sanitizer names it: a substring of the symbol) -> the test files that launch it
KERNELS = {  # kernel: (its symbol in the reports, the tests that launch it), both regular expressions
    "cuda/dequant_gather.cu": ("dequant_gather_kernel", r"test_dequant_gather|test_adversarial.py::test_dequant"),
    "cuda/flush_write.cu: flush": ("flush_write_kernel", r"test_cuda.py::test_flush|adversarial.py::test_flush"),
    "cuda/flush_write.cu: window": ("window_write_kernel", r"test_compress_decode|adversarial.py::test_window"),
    "cuda/flush_write.cu: encode": ("encode_rows_kernel", r"test_cuda.py::test_encode|test_attention"),
    "cuda/flush_write.cu: tails": ("tail_state_kernel", r"test_cuda.py::test_cuda_tail|adversarial.py::test_tail"),
    "cuda/compress_decode.cu": ("compress_decode", r"test_compress_decode|adversarial.py::test_compress_decode"),
    "cuda/fp4_pack.cu": ("fp4_pack_kernel", r"test_fp4_pack"),
    "cuda/index_query.cu": ("index_query_kernel", r"test_index_query|test_indexer"),
    "cuda/pool_attention.cu": (
        "pool_attention_kernel|pool_attention_cluster_kernel",
        r"test_pool_attention.py::\S*cuda|adversarial.py::\S*cuda-",
    ),
    "cuda/prefix_attention.cu": (
        "prefix_attention_kernel|merge_kernel",
        r"torch_bridge/test_prefix|adversarial\S*-cuda",
    ),
    "cuda/frame_append.cu (torch)": ("check_kernel|write_kernel", r"torch_bridge/test_manager"),
    "cuda/top_k.cu": ("top_k_kernel", r"test_top_k.py::test_kernel|test_indexer.py::test_select"),
    "cuda/index_scores.cu": ("index_scores_kernel", r"test_index_scores.py::\S*cuda|adversarial.py::test_index\S*cuda"),
    "cuda/flashmla_sparse_decode.cu": ("flash|sparse|splitkv|combine", r"test_flashmla|adversarial\S*flashmla"),
    "Mosaic GPU: pool attention": (
        "pool_attention_pallas|_partials",
        r"test_pool_attention.py::test_kernel|\[pallas\]",
    ),
    "Mosaic GPU: prefix attention": ("prefix_attention|_partials", r"test_frame_gpu.py::test_prefix|\[\d-pallas\]"),
    "Mosaic GPU: index scores": (
        "index_scores|_scores",
        r"test_index_scores.py::\S*pallas|adversarial.py::test_index\S*pallas",
    ),
    "Mosaic GPU: frame append": ("jaxkv_frame_append", r"test_frame_append.py|adversarial.py::test_frame_append"),
}
# jaxkv's own kernels (FlashMLA's are upstream code, built from $FLASHMLA_SRC)
JAXKV_KERNELS = "|".join(sym for k, (sym, _) in KERNELS.items() if "flashmla" not in k)
TESTS = (  # the hostile table first: a run cut short has covered every kernel
    "tests/kernels/test_adversarial.py",
    "tests/kernels/test_dequant_gather.py",
    "tests/kernels/test_pool_attention.py",
    "tests/kernels/test_index_scores.py",
    "tests/kernels/test_compress_decode.py",
    "tests/kernels/test_frame_append.py",
    "tests/kernels/test_fp4_pack.py",
    "tests/kernels/test_index_query.py",
    "tests/cuda/test_cuda.py",
    "tests/frame/test_frame_gpu.py",
    "tests/hybrid/test_attention.py",
    "tests/hybrid/test_indexer.py",
    "tests/torch_bridge/test_prefix_attention.py",
    "tests/torch_bridge/test_manager.py",
    "tests/torch_bridge/test_flashmla.py",
)
TOOL_FLAGS = {  # racecheck: shared-memory hazards; initcheck: reads of global memory never written
    "memcheck": ["--leak-check", "no"],
    "racecheck": ["--racecheck-report", "hazard"],
    "synccheck": [],
    "initcheck": [],
}
REPORT = re.compile(r"^========= (?:Invalid|Uninitialized|Error|Program hit|Barrier|Race|Potential|Warning)", re.M)
RESULT = re.compile(r"^(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR)", re.M)  # pytest -v: a test's result
STARTED = re.compile(r"^(tests/\S+::\S+) ", re.M)  # pytest -v: a test begun (its result follows)
WHERE = re.compile(r"^=========\s+(?:Write |Read )?(?:Thread \S+ )?at (?:void )?([\w:<>]+)", re.M)


def sanitizer() -> str:
    for c in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if c and os.path.exists(c):
            return c
    raise SystemExit("compute-sanitizer: not found (it ships with the CUDA toolkit, beside nvcc)")


def _env(out: Path) -> dict:
    return dict(
        os.environ,
        XLA_PYTHON_CLIENT_ALLOCATOR="platform",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
        ).strip(),
        JAXKV_SANITIZE="1",
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(out / "xla-cache"),
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )


def run_tool(tool: str, files: list[str], select: list[str], out: Path, timeout: int) -> dict:
    """One sanitizer process per test file, in turn, within ``timeout`` seconds in all. A file
    whose process dies (the sanitizer's own crash: no report, no pytest summary) runs again
    from the test it died in (the tests it reported are deselected); a test it dies in twice
    is listed as crashed and the file goes on past it."""
    log = out / f"{tool}.log"
    pytest = [sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd = [sanitizer(), "--tool", tool, *TOOL_FLAGS[tool], "--target-processes", "all", "--print-limit", "200"]
    if tool == "synccheck":  # jaxkv's kernels only: synccheck's tracking breaks torch's and upstream's
        cmd += ["--kernel-name", "regex=" + JAXKV_KERNELS]  # (docs/reliability.md)
    t0, code, crashed = time.time(), 0, []
    with open(log, "w") as f:  # written as it runs: a run cut short still leaves its log
        for file in files:
            f.write(f"\n=== {file}\n")
            skip: list[str] = []  # reported, or died in twice
            died: list[str] = []
            while True:
                left = timeout - (time.time() - t0)
                f.flush()
                start = f.tell()
                try:
                    if left <= 0:
                        raise subprocess.TimeoutExpired(cmd, timeout)
                    deselect = [a for t in skip for a in ("--deselect", t)]
                    rc = subprocess.run(
                        cmd + pytest + [file] + select + deselect,
                        cwd=ROOT,
                        env=_env(out),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        timeout=left,
                    ).returncode
                except subprocess.TimeoutExpired:
                    f.write(f"\nTIMEOUT after {timeout} s\n")
                    return _result(tool, None, crashed, t0, log)
                if rc in (0, 1, 5):  # 1: a test failed or a report; 5: nothing selected in this file
                    break
                f.flush()
                with open(log, errors="replace") as r:
                    r.seek(start)
                    text = r.read()
                done = [t for t, _ in RESULT.findall(text)]
                began = [t for t in STARTED.findall(text) if t not in done]
                skip += done
                where = began[-1] if began else None
                if where is None:  # it died before any test began: give the file up
                    crashed.append(f"{file} (exit {rc})")
                    break
                if where in died:
                    crashed.append(f"{where} (exit {rc}, twice)")
                    skip.append(where)
                    f.write(f"\n=== {file}: the sanitizer's process died in {where} twice; on past it\n")
                else:
                    died.append(where)
                    f.write(f"\n=== {file}: the sanitizer's process died (exit {rc}); again, from there\n")
            code = max(code, 0 if rc == 5 else rc)
    return _result(tool, code, crashed, t0, log)


def _result(tool, code, crashed, t0, log) -> dict:
    return dict(
        tool=tool, code=code, crashed=crashed, seconds=time.time() - t0, **parse(log.read_text(errors="replace"))
    )


PROBES = ROOT / "tools" / "sanitizer_probes"
# (probe, tool, what the protocol is): a tool that follows the protocol reports 0 for a correct one
PROBE_RUNS = (
    ("sync", "racecheck", "bar.sync on both sides (correct)"),
    ("none", "racecheck", "no barrier (racy: must be reported)"),
    ("arrive", "racecheck", "bar.arrive -> bar.sync, as the attention kernels hand off (correct)"),
    ("mbarrier", "racecheck", "lanes read, __syncwarp, mbarrier arrive -> wait, then write (correct)"),
    ("cluster", "racecheck", "two CTAs write, barrier.cluster, each reads its peer's (correct)"),
    ("merge", "racecheck", "bar.arrive -> bar.sync hand-back, then write, bar.sync, read (correct)"),
    ("tma_store", "initcheck", "Mosaic GPU TMA stores every element, XLA reads them (correct)"),
)


def run_probes(out: Path) -> list[str]:
    """The probes under their tools -> the lines of a table: reports per probe."""
    from jaxkv.cuda.build import nvcc

    exe = out / "racecheck_handoffs"
    subprocess.run(
        [nvcc(), "-arch=sm_90a", "-lineinfo", "-o", str(exe), str(PROBES / "racecheck_handoffs.cu")], check=True
    )
    lines = ["| probe | protocol | tool | reports | exit |", "|---|---|---|---|---|"]
    for probe, tool, what in PROBE_RUNS:
        prog = [str(exe), probe] if tool == "racecheck" else [sys.executable, str(PROBES / "initcheck_tma_store.py")]
        cmd = [sanitizer(), "--tool", tool, *TOOL_FLAGS[tool], "--print-limit", "0", *prog]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(out), capture_output=True, text=True, timeout=600)
        (out / f"probe-{probe}.log").write_text(r.stdout + r.stderr)
        lines.append(f"| {probe} | {what} | {tool} | {probe_reports(r.stdout + r.stderr)} | {r.returncode} |")
    return lines


def probe_reports(text: str) -> int:
    """The sanitizer's own count of its reports (racecheck: hazards; the others: errors)."""
    m = re.search(r"(?:RACECHECK|ERROR) SUMMARY: (?:\d+ hazards displayed \()?(\d+) errors?", text)
    return int(m.group(1)) if m else len(REPORT.findall(text))


def parse(text: str) -> dict:
    """pytest's per-test results (``-v``), and the kernel each sanitizer report names."""
    results = RESULT.findall(text)
    blocks = re.split(r"(?=" + REPORT.pattern[1:] + ")", text, flags=re.M)
    where = [(WHERE.findall(b) or ["?"])[0] for b in blocks if REPORT.match(b)]
    return dict(results=results, where=where)


def matrix(runs: dict, tests: list[str]) -> tuple[list[str], bool]:
    tools = list(runs)
    lines = ["| kernel | " + " | ".join(tools) + " |", "|---" * (len(tools) + 1) + "|"]
    clean = True
    for kernel, (pattern, launched_by) in KERNELS.items():
        row = []
        for tool in tools:
            r = runs[tool]
            hits = sum(bool(re.search(pattern, w)) for w in r["where"])
            ran = [(t, s) for t, s in r["results"] if re.search(launched_by, t)]
            passed = sum(s == "PASSED" for _, s in ran)
            failed = sum(s in ("FAILED", "ERROR") for _, s in ran)
            cell = f"{hits} reports, {passed} tests passed" + (f", {failed} failed" if failed else "")
            if not passed:
                cell = f"{hits} reports, no test of it ran" + (" (run cut short)" if r["code"] is None else "")
            clean &= hits == 0 and failed == 0
            row.append(cell)
        lines.append(f"| {kernel} | " + " | ".join(row) + " |")
    for tool in tools:
        r = runs[tool]
        others = sorted({w for w in r["where"] if not any(re.search(p, w) for p, _ in KERNELS.values())})
        state = "cut short" if r["code"] is None else f"exit {r['code']}"
        done, crashed = len(r["results"]), r.get("crashed", [])
        lines.append(
            f"\n{tool}: {state} after {r['seconds']:.0f} s, {done} tests reported; other kernels: {others or 'none'}"
            + (f"; crashed: {', '.join(crashed)}" if crashed else "")
        )
        clean &= r["code"] == 0 and not others and not crashed
    return lines, clean


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="*", default=list(TESTS))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--out", default="sanitize-logs")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per tool")
    ap.add_argument("-k", default="", help="pytest's -k: run the tests whose names match")
    ap.add_argument(
        "--probes", action="store_true", help="first show what the tools can follow (tools/sanitizer_probes)"
    )
    a = ap.parse_args(argv)
    tools = [t for t in a.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise SystemExit(f"--tools: expected some of {', '.join(TOOLS)}, got {', '.join(bad)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    probes = run_probes(out) + [""] if a.probes else []
    with cf.ThreadPoolExecutor(len(tools)) as ex:
        select = ["-k", a.k] if a.k else []
        runs = dict(zip(tools, ex.map(lambda t: run_tool(t, a.tests, select, out, a.timeout), tools)))
    lines, clean = matrix(runs, a.tests)
    lines = probes + lines
    (out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
