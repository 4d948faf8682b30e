"""The one timing loop the benchmark scripts share: wall clock around calls that synchronize."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax


def times_ms(fn, iters: int, warmup: int = 0) -> list[float]:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``iters`` times; return each call's ms.

    ``fn`` must block until its device work is done (``block_until_ready`` / a sync).
    """
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def copy_gbps(iters: int = 20) -> float:
    """The device's copy bandwidth, GB/s: a 1 GiB ``x + 0`` read and written, median of
    ``iters`` synchronized calls. The floor a memory-bound step is measured against."""
    import jax.numpy as jnp

    x = jnp.ones((1 << 29,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 0)
    ms = sorted(times_ms(lambda i: f(x).block_until_ready(), iters, warmup=3))[iters // 2]
    return 2 * x.nbytes / ms / 1e6


def trace_events(fn, steps: int) -> list[dict]:
    """The complete events ("X") of a profiler trace of ``fn(0) .. fn(steps - 1)``, each with
    its process name as ``"process"`` ([] if the profiler wrote no trace)."""
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for i in range(steps):
            fn(i)
    files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    return load_trace(files[0]) if files else []


def load_trace(path: str) -> list[dict]:
    """A ``*.trace.json.gz``'s complete events, each with its process name as ``"process"``."""
    with gzip.open(path) as f:
        tr = json.load(f).get("traceEvents", [])
    names = {
        e["pid"]: str(e["args"].get("name", "")) for e in tr if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return [dict(e, process=names.get(e.get("pid"), "")) for e in tr if e.get("ph") == "X"]


def _on_gpu(e: dict) -> bool:
    return "GPU" in e["process"] and "host" not in e["process"].lower()


def kernel_ms_per_step(fn, steps: int, top: int = 0):
    """Sum of GPU kernel durations per step from a profiler trace (None if unavailable);
    with ``top``, also print the kernels that take the most time."""
    try:
        events = [e for e in trace_events(fn, steps) if _on_gpu(e)]
        dur = sum(e.get("dur", 0) for e in events)
        if top:
            by = {}
            for e in events:
                k = by.setdefault(e.get("name", "?")[:70], [0, 0])
                k[0] += e.get("dur", 0)
                k[1] += 1
            print(f"top kernels over {steps} steps (us per step, launches per step):")
            for name, (d, cnt) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
                print(f"  {d / steps:8.1f} {cnt / steps:6.1f}  {name}")
            # XLA's own fusions, sorts and copies around the kernels: the glue a step still launches
            glue = [e for e in events if re.match(r"(loop|input|wrapped)_|sort|[Mm]emcpy|copy", e.get("name", ""))]
            print(
                f"  kernels per step: {len(events) / steps:.0f}; XLA's fusions, sorts and copies among them: "
                f"{len(glue) / steps:.0f}, {sum(e.get('dur', 0) for e in glue) / steps:.1f} us"
            )
        return dur / 1e3 / steps if dur else None
    except Exception as exc:  # the profiler is optional here: report, do not fail the benchmark
        print(f"(kernel time unavailable: {exc})")
        return None


def host_parts(events: list[dict], jit_name: str) -> dict | None:
    """One synchronized call's host time by part, from ``trace_events`` of a few calls of the
    jitted function ``jit_name`` (its last call): ms in jit dispatch outside PjRt, in PjRt
    outside the thunks (argument handling), in each CUDA graph's update (re-recording its
    commands after a buffer address changed) and launch, and in the thunks outside graphs;
    with ``graphs``: (commands, update ms, launch ms) per graph. The profiler turns XLA's
    command buffers off unless ``--xla_enable_command_buffers_during_profiling=true`` is in
    ``XLA_FLAGS``: without it every thunk is a launch of its own here."""
    host = [e for e in events if not _on_gpu(e)]
    calls = [e for e in host if e["name"] == f"PjitFunction({jit_name})"]
    if not calls:
        return None
    last = max(calls, key=lambda e: e["ts"])  # nested events share the name: take the outermost
    call = min(
        (e for e in calls if e["ts"] <= last["ts"] and e["ts"] + e["dur"] >= last["ts"] + last["dur"]),
        key=lambda e: e["ts"],
    )
    within = lambda e, o: o["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= o["ts"] + o["dur"]  # noqa: E731
    inside = [e for e in host if within(e, call)]
    first = lambda n: next((e["dur"] / 1e3 for e in inside if e["name"] == n), 0.0)  # noqa: E731
    execute, thunks = first("PjRtCApiLoadedExecutable::Execute"), first("[0] GpuExecutable::ExecuteThunks")
    graphs = []
    for g in (e for e in inside if re.fullmatch(r"command_buffer_\d+", e["name"])):
        parts = {e["name"]: e for e in inside if within(e, g) and e["name"].startswith("command_buffer::")}
        some = parts.get("command_buffer::execute") or parts.get("command_buffer::update") or {}
        graphs.append(
            (
                int(some.get("args", {}).get("num_commands", 0)),
                parts.get("command_buffer::update", {}).get("dur", 0) / 1e3,
                parts.get("command_buffer::execute", {}).get("dur", 0) / 1e3,
            )
        )
    update, launch = sum(g[1] for g in graphs), sum(g[2] for g in graphs)
    return dict(
        call=call["dur"] / 1e3,
        dispatch=call["dur"] / 1e3 - execute,
        arguments=execute - thunks,
        graph_update=update,
        graph_launch=launch,
        other_thunks=thunks - update - launch,
        graphs=graphs,
    )


def gpu_timeline(events: list[dict], jit_name: str, gap_us: float = 5.0) -> dict | None:
    """The last synchronized call of ``jit_name`` on the GPU's clock, from ``trace_events``:
    ms from the call's start to its first kernel (``lead``), from first kernel start to last
    kernel end (``span``), kernels busy within it (``busy``, overlaps merged), the idle rest
    (``idle``) and, of that, gaps longer than ``gap_us`` (``gaps``: count, ms) with the five
    longest as (us, kernel before, kernel after). Tells a step bound by its kernels from one
    whose GPU waits on the host or on launches between kernels."""
    host = [e for e in events if not _on_gpu(e) and e["name"] == f"PjitFunction({jit_name})"]
    if not host:
        return None
    start = max(e["ts"] for e in host)
    gpu = sorted((e for e in events if _on_gpu(e) and e["ts"] >= start and e.get("dur", 0) > 0), key=lambda e: e["ts"])
    if not gpu:
        return None
    busy, gaps, end = 0.0, [], gpu[0]["ts"]
    prev = None
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, (prev or {}).get("name", "?")[:48], e["name"][:48]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = end - gpu[0]["ts"]
    long = [g for g in gaps if g[0] > gap_us]
    return dict(
        lead=(gpu[0]["ts"] - start) / 1e3,
        span=span / 1e3,
        busy=busy / 1e3,
        idle=(span - busy) / 1e3,
        gaps=(len(long), sum(g[0] for g in long) / 1e3),
        longest=sorted(long, key=lambda g: -g[0])[:5],
        kernels=len(gpu),
    )


def child_rows(script: str, modes: list[str], settings: dict, args: list[str]) -> dict:
    """Run ``script --child MODE *args`` once per mode, each in its own process with the
    mode's XLA flags appended to ``XLA_FLAGS`` (XLA reads its flags once per process); each
    child prints one ``ROW <json>`` line. -> {mode: row}, a failed child said and skipped
    (SystemExit for a mode not in ``settings``, or when none ran)."""
    import subprocess
    import sys

    bad = [m for m in modes if m not in settings]
    if bad:
        raise SystemExit(f"--modes: expected names of {', '.join(settings)}, got {', '.join(bad)}")
    rows = {}
    for mode in modes:
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {settings[mode]}".strip())
        run = subprocess.run(
            [sys.executable, os.path.abspath(script), "--child", mode, *args], env=env, capture_output=True, text=True
        )
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line is None:
            print(f"{mode}: the child failed (rc {run.returncode}):\n{run.stderr[-2000:]}", flush=True)
            continue
        rows[mode] = json.loads(line[4:])
        print(f"{mode}: {rows[mode]}", flush=True)
    if not rows:
        raise SystemExit("no setting ran")
    return rows
