"""One JAX process per GPU: start them (``python -m jaxkv launch``) and join them (``initialize``).

A process that drives several GPUs launches every kernel of a step once per GPU from one
host thread; one process per GPU launches only its own, so N GPUs step in one GPU's time
(docs/sharding.md, measured in benchmarks/RESULTS.md). The launcher starts N copies of a
script on this host, each seeing one GPU (``CUDA_VISIBLE_DEVICES``) and told the coordinator,
the process count and its own id through the environment (``JAXKV_COORDINATOR``,
``JAXKV_NUM_PROCESSES``, ``JAXKV_PROCESS_ID``). The script calls
``initialize()`` before it touches a device; ``jax.devices()`` is then the global device
list, a cache made with ``init(spec, mesh=Mesh(jax.devices(), ("data",)))`` gives each
process its own streams or requests, and ``Layout.local_rows`` / ``Layout.my_rows`` move a
batch's rows in and out. Several hosts: the same command on each, with ``--hosts``,
``--host-index`` and ``--coordinator``. Everything joining is ``jax.distributed``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "JAXKV_COORDINATOR", "JAXKV_NUM_PROCESSES", "JAXKV_PROCESS_ID"
ENV = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
TIMEOUT = "JAXKV_INIT_TIMEOUT"  # seconds a process waits for the others to join
DEFAULT_TIMEOUT = 120
GRACE_S = 5  # after one process fails, how long the others get to exit before they are killed


def initialize(timeout_s: int | None = None) -> int:
    """Join this process to the others the launcher started (``jax.distributed.initialize``);
    returns this process's id. Call it before anything touches a device.

    timeout_s: how long to wait for every process to join (default ``$JAXKV_INIT_TIMEOUT``,
      else 120 s); past it, jax ends the process (status -6) after this module names the
      coordinator and the count on stderr: never a silent hang.
    """
    missing = [k for k in ENV if not os.environ.get(k)]
    if missing:
        raise RuntimeError(
            f"{missing[0]}: not set, so this process cannot find the others; start the script with "
            f"`python -m jaxkv launch --processes N script.py ...`, or set {', '.join(ENV)} in each "
            "process's environment (docs/sharding.md)"
        )
    coordinator = os.environ[COORDINATOR]
    n, me = _int_env(NUM_PROCESSES, 1), _int_env(PROCESS_ID, 0)
    if me >= n:
        raise RuntimeError(f"{PROCESS_ID}: expected an id below {NUM_PROCESSES} = {n}, got {me}")
    timeout = timeout_s if timeout_s is not None else _int_env(TIMEOUT, 1, DEFAULT_TIMEOUT)

    # jax aborts the process (a C++ fatal error) when the others do not join in time: say which
    # setting to look at first, on stderr, just before that happens
    warn = threading.Timer(
        max(timeout - 1, 0.5),
        lambda: print(
            f"jaxkv: process {me} of {n} has waited {timeout} s ({TIMEOUT}) for all {n} processes to join "
            f"the coordinator at {coordinator} ({COORDINATOR}); is every process started, and process 0 "
            "reachable there?",
            file=sys.stderr,
            flush=True,
        ),
    )
    warn.daemon = True
    warn.start()
    try:
        jax.distributed.initialize(coordinator, num_processes=n, process_id=me, initialization_timeout=timeout)
    finally:
        warn.cancel()
    sys.excepthook = _exit_on_error(sys.excepthook)
    return me


def _exit_on_error(hook):
    """An uncaught exception ends the process at once: at a normal exit, jax waits (up to its
    shutdown timeout) for every other process to reach the same barrier, so a process that
    failed would otherwise hang until they all finish, and the launcher could not stop them."""

    def excepthook(*exc):
        hook(*exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    return excepthook


def _int_env(name: str, low: int, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None and default is not None:
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise RuntimeError(f"{name}: expected an integer, got {raw!r}") from None
    if value < low:
        raise RuntimeError(f"{name}: expected an integer >= {low}, got {value}")
    return value


# ----------------------------------------------------------------------------- the launcher
def add_arguments(p: argparse.ArgumentParser):
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="processes on this host (default: one per visible GPU; with --cpu-devices: required)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="K",
        help="run each process on the CPU with K host devices (tests, a machine without GPUs)",
    )
    p.add_argument(
        "--hosts", type=int, default=1, metavar="H", help="hosts taking part, each running this same command"
    )
    p.add_argument("--host-index", type=int, default=0, metavar="I", help="this host's index among --hosts")
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordinator (default: a free port on localhost; required with --hosts > 1)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds a process waits for the others to join ({TIMEOUT})",
    )
    p.add_argument("script", help="the Python script each process runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")


def visible_gpus() -> list[str]:
    """The GPU ids this host's processes may use: ``CUDA_VISIBLE_DEVICES`` if set, else
    ``nvidia-smi``'s list (no jax import: the launcher must not take a GPU itself)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g for g in given.split(",") if g.strip() and g.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def plan(args) -> list[dict]:
    """Each local process's environment additions; a ValueError names a flag that cannot work."""
    if args.hosts < 1 or not 0 <= args.host_index < args.hosts:
        raise ValueError(f"--host-index: expected 0 <= index < --hosts = {args.hosts}, got {args.host_index}")
    if args.hosts > 1 and not args.coordinator:
        raise ValueError("--coordinator: required with --hosts > 1 (process 0's HOST:PORT, the same on every host)")
    if args.timeout < 1:
        raise ValueError(f"--timeout: expected seconds >= 1, got {args.timeout}")
    gpus = [] if args.cpu_devices else visible_gpus()
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise ValueError(f"--cpu-devices: expected K >= 1, got {args.cpu_devices}")
    n = args.processes
    if n is None:
        if not gpus:
            raise ValueError("--processes: no GPU is visible here; give --processes N (and --cpu-devices K for CPU)")
        n = len(gpus)
    if n < 1:
        raise ValueError(f"--processes: expected N >= 1, got {n}")
    if gpus and n > len(gpus):
        raise ValueError(f"--processes: {n} processes, but this host shows {len(gpus)} GPU(s) ({','.join(gpus)})")
    coordinator = args.coordinator or f"localhost:{_free_port()}"
    envs = []
    for i in range(n):
        env = {COORDINATOR: coordinator, NUM_PROCESSES: str(n * args.hosts), PROCESS_ID: str(args.host_index * n + i)}
        env[TIMEOUT] = str(args.timeout)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        if args.cpu_devices:
            env["JAX_PLATFORMS"] = "cpu"
            flags = os.environ.get("XLA_FLAGS", "")
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        envs.append(env)
    return envs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _relay(stream, prefix: str, out):
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()
    stream.close()


def run(args) -> int:
    """Start the processes, relay their output line by line (prefixed ``[id]``), wait; the
    first to fail stops the others (after ``GRACE_S``) and gives the exit status."""
    envs = plan(args)
    if not os.path.isfile(args.script):
        raise ValueError(f"script: expected a Python file, got {args.script!r} (not a file)")
    cmd = [sys.executable, args.script, *args.args]
    procs, relays = [], []
    for env in envs:
        p = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        t = threading.Thread(target=_relay, args=(p.stdout, f"[{env[PROCESS_ID]}] ", sys.stdout), daemon=True)
        t.start()
        procs.append(p)
        relays.append(t)
    status = 0
    try:
        while None in [p.poll() for p in procs]:  # a list: poll every process each time
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0].returncode
                _stop(procs)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    for t in relays:
        t.join(timeout=5)
    codes = [p.wait() for p in procs]
    if status == 0:
        status = next((c for c in codes if c), 0)
    if status:
        bad = [envs[i][PROCESS_ID] for i, c in enumerate(codes) if c]
        print(f"jaxkv launch: process(es) {', '.join(bad)} exited with status {status}", file=sys.stderr)
    return 1 if status < 0 else status


def _stop(procs):
    """SIGTERM every process still running, SIGKILL what is left after ``GRACE_S``."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


__all__ = ["ENV", "add_arguments", "initialize", "plan", "run", "visible_gpus"]
