"""Where the lingbot-map port's host time goes: its stream step, per frame, by XLA setting.

The port's frame is one jitted call whose thousands of kernels XLA launches as a few large
CUDA graphs (command buffers). What a synchronized frame costs beyond its kernels is the
host's: jit dispatch, PjRt's handling of the 1,400-odd arguments, re-recording a graph whose
buffer addresses changed since the last call, and launching each graph node by node. This
script measures those parts on the released config (random weights, one stream, the cache
filled by streaming from empty; no upstream checkout needed).

XLA reads its flags once per process, so each setting runs in a child process: ``default``;
``skip_temp`` (``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``: temporaries at stable
addresses through VMM remapping); ``no_graphs`` (command buffers off: one launch per
kernel). In each, two frame sources: ``fixed`` (the same device buffer every frame) and
``upload`` (each frame copied from host memory, as ``LingbotStream`` does). Per cell: host
ms (until the call returns), synchronized ms and streamed ms (25 frames queued, one sync),
medians. ``--trace`` adds a child that keeps command buffers on under the profiler
(``--xla_enable_command_buffers_during_profiling=true``) and prints one synchronized
frame's host time by part (``_timing.host_parts``) and per graph.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python benchmarks/lingbot_host.py [--trace]
    PYTHONPATH=$PWD python benchmarks/lingbot_host.py --small --modes default   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time

from _timing import child_rows, host_parts, trace_events

SETTINGS = {
    "default": "",
    "skip_temp": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    "no_graphs": "--xla_gpu_enable_command_buffer=",
    "trace": "--xla_enable_command_buffers_during_profiling=true",
}
FILL, TIMED = 76, 25  # frames streamed before timing (the 72-frame window full), frames per timing


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxkv.models.lingbot import LingbotConfig, LingbotMap, LingbotStream

    w, h = map(int, args.size.split("x"))
    config = (
        LingbotConfig.small(max_frame_num=256) if args.small else LingbotConfig(height=h, width=w, max_frame_num=256)
    )
    stream = LingbotStream(LingbotMap(config, rngs=nnx.Rngs(0)))
    host = np.random.default_rng(0).random((4, 1, 1, config.height, config.width, 3), np.float32)
    fixed, key = jnp.asarray(host[0]), jnp.asarray(True)
    frame = {"fixed": lambda i: fixed, "upload": lambda i: jnp.asarray(host[i % 4])}
    call = lambda x: stream.step(x, key, phase="stream")  # noqa: E731
    t0 = time.perf_counter()
    jax.block_until_ready(call(fixed))
    row = {
        "first_s": time.perf_counter() - t0,
        "device": jax.devices()[0].device_kind,
        "size": f"{config.width}x{config.height}",
    }
    for _ in range(FILL):
        out = call(fixed)
    jax.block_until_ready(out)
    if args.child == "trace":
        events = trace_events(lambda i: jax.block_until_ready(call(frame["upload"](i))), 3)
        row["parts"] = host_parts(events, "pure")
        return row
    for source, make in frame.items():
        hosts, syncs = [], []
        for i in range(TIMED):
            x = make(i)
            t = time.perf_counter()
            out = call(x)
            hosts.append(time.perf_counter() - t)
            jax.block_until_ready(out)
            syncs.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        for i in range(TIMED):
            out = call(make(i))
        jax.block_until_ready(out)
        row[source] = {
            "host_ms": 1e3 * float(np.median(hosts)),
            "sync_ms": 1e3 * float(np.median(syncs)),
            "streamed_ms": 1e3 * (time.perf_counter() - t0) / TIMED,
        }
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="518x378", help="WxH, multiples of 14")
    p.add_argument("--modes", default="default,skip_temp,no_graphs", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--trace", action="store_true", help="also one frame's host time by part (a profiler trace)")
    p.add_argument("--small", action="store_true", help="ViT-S config (smoke test)")
    p.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("ROW", json.dumps(child(args)), flush=True)
        return
    modes = args.modes.split(",") + (["trace"] if args.trace else [])
    rows = child_rows(__file__, modes, SETTINGS, ["--size", args.size] + ["--small"] * args.small)
    first = next(iter(rows.values()))
    print(f"\nlingbot-map port, stream step, {first['size']}, {first['device']}: ms per frame, medians of {TIMED}")
    print(f"{'setting':<12}{'frames':<8}{'host':>8}{'sync':>8}{'streamed':>10}{'first s':>9}")
    for mode, row in rows.items():
        for source in ("fixed", "upload"):
            if source in row:
                r = row[source]
                print(
                    f"{mode:<12}{source:<8}{r['host_ms']:>8.2f}{r['sync_ms']:>8.2f}"
                    f"{r['streamed_ms']:>10.2f}{row['first_s']:>9.1f}"
                )
    parts = rows.get("trace", {}).get("parts")
    if parts:
        print("\none synchronized frame's host time (uploaded frame, command buffers on under the profiler), ms")
        for k in ("call", "dispatch", "arguments", "graph_update", "graph_launch", "other_thunks"):
            print(f"  {k:<14}{parts[k]:8.3f}")
        print("  per graph: commands, update ms, launch ms")
        for n, u, x in parts["graphs"]:
            print(f"  {n:>8}{u:>9.3f}{x:>9.3f}")


if __name__ == "__main__":
    main()
