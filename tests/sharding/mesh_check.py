"""Both caches on CPU host-device meshes against one device: run by ``test_sharding.py`` in a
fresh process (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before
jax starts). Each per-step op is compiled on the mesh, its HLO checked for collectives,
and the compiled executable run; its outputs must equal the one-device run's bit for bit.

    python tests/sharding/mesh_check.py 8x1 4x2 2x4     # prints one line per mesh, then "ok"
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: hybrid_driver

import hybrid_driver as D  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import frame  # noqa: E402
from jaxkv import hybrid as H

COLLECTIVES = re.compile(
    r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter|collective-broadcast)"
    r"(-start)?\("
)


def collectives(text: str) -> list[str]:
    return sorted({m.group(1) for m in COLLECTIVES.finditer(text)})


class Ops:
    """Compiles each op once per shape, checks its HLO, runs it; records what it saw."""

    def __init__(self, check: bool):
        self.check, self.seen, self.cache = check, {}, {}

    def __call__(self, name, fn, *args):
        key = (name, jax.tree.structure(args), tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
        if key not in self.cache:
            compiled = jax.jit(fn).lower(*args).compile()
            if self.check:
                found = collectives(compiled.as_text())
                assert not found, f"{name}: collectives in the compiled HLO: {found}"
                self.seen[name] = found
            self.cache[key] = compiled
        return self.cache[key](*args)


def equal(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


# ------------------------------------------------------------------------------- frame
FSPEC = frame.FrameSpec(
    num_layers=2,
    num_heads=4,
    head_dim=8,
    patches_per_frame=5,
    num_special=2,
    num_streams=8,
    scale_frames=1,
    sliding_window=2,
    max_frames=12,
)


def frame_run(state, ops, rng):
    """A random frame sequence through every per-step op -> (outputs, state)."""
    s, B, L = FSPEC, FSPEC.num_streams, FSPEC.num_layers
    outs = []
    for t in range(4):
        kv = lambda *lead: jnp.asarray(
            rng.normal(size=lead + (B, s.tokens_per_frame, s.num_heads, s.head_dim)),  # noqa: E731
            jnp.bfloat16,
        )
        defer = jnp.asarray(rng.random(B) < 0.5)
        if t % 2 == 0:
            state = ops("append", lambda st, k, v, d: frame.append(st, k, v, d, impl="xla"), state, kv(L), kv(L), defer)
        else:  # a frame layer by layer: static and traced layer index
            state = ops("begin_frame", frame.begin_frame, state, defer)
            state = ops("write_layer", lambda st, k, v: frame.write_layer(st, 0, k, v), state, kv(), kv())
            state = ops("write_layer(traced)", frame.write_layer, state, jnp.int32(1), kv(), kv())
        q = jnp.asarray(
            rng.normal(size=(B, 3, 2 * s.num_heads, s.head_dim)), jnp.bfloat16
        )  # GQA: 2 q heads per kv head
        for impl in ("xla", "reference"):
            outs.append(ops(f"attention({impl})", lambda st, q, i=impl: frame.attention(st, 1, q, impl=i), state, q))
        outs.append(
            ops("attention(traced)", lambda st, l, q: frame.attention(st, l, q, impl="xla"), state, jnp.int32(0), q)
        )
        state = ops("resolve", frame.resolve, state, jnp.asarray(rng.random(B) < 0.5))
    return outs, state


@functools.cache
def frame_reference(seed):
    return frame_run(frame.init(FSPEC), Ops(False), np.random.default_rng(seed))


def check_frame(mesh, seed=0):
    ref_outs, ref = frame_reference(seed)
    ops = Ops(True)
    outs, st = frame_run(frame.init(FSPEC, mesh=mesh), ops, np.random.default_rng(seed))
    assert st.k[0].sharding.spec == jax.sharding.PartitionSpec("data", None, "model", None), st.k[0].sharding
    equal(ref_outs, outs, "frame attention outputs")
    T = FSPEC.trash_row  # skipped writes land past it: never read, not compared
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(st), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(
            a[:, :T] if a.ndim > 1 else a, b[:, :T] if b.ndim > 1 else b, err_msg="frame state"
        )
    # the eager whole-state ops and the views keep every array where it was, with the one-device values
    half = jnp.arange(FSPEC.num_streams) % 2 == 0
    for name, fn in (("reset", lambda s: frame.reset(s, half)), ("grow", lambda s: frame.grow(s, 24))):
        want, got = fn(ref), fn(st)
        for a, b, c in zip(jax.tree.leaves(st), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert b.sharding.spec == a.sharding.spec, (name, a.sharding.spec, b.sharding.spec)
            b, c = np.asarray(b), np.asarray(c)
            np.testing.assert_array_equal(b[:, :T] if b.ndim > 1 else b, c[:, :T] if c.ndim > 1 else c, err_msg=name)
    for name, fn in (("page_table", frame.page_table), ("visible_token_ids", frame.visible_token_ids)):
        for a, b in zip(jax.tree.leaves(fn(st)), jax.tree.leaves(fn(ref)), strict=True):
            assert a.sharding.spec[:1] == ("data",), (name, a.sharding.spec)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    return ops.seen


# ------------------------------------------------------------------------------- hybrid
HCFG = H.HybridConfig(
    compress_ratios=(0, 4, 8), max_requests=8, max_context=256, top_k=6, block_size=8, index_heads=4, window=8
)


def hybrid_layers(state, step, x, params, ops):
    """Every layer's per-step ops -> (state, outputs)."""
    c, outs = HCFG, []
    for layer in range(c.num_layers):
        xl, p = x[layer], params[layer]
        outs.append(
            ops(f"window_keys/{layer}", lambda st, sp, kv, l=layer: H.window_keys(st, sp, l, kv), state, step, xl["kv"])
        )
        state = ops(f"after_reads/{layer}", lambda st, keys: H.after_reads(st, keys), state, outs[-1][0])
        state = ops(
            f"write_window/{layer}",
            lambda st, sp, kv, l=layer: H.write_window(st, sp, l, kv, impl="xla"),
            state,
            step,
            xl["kv"],
        )
        if xl["kv"].shape[1] == 1:  # a decode step's ring after its write (kv=None: no kv to split)
            outs.append(
                ops(
                    f"window_keys(written)/{layer}", lambda st, sp, l=layer: H.window_keys(st, sp, l, None), state, step
                )
            )
        if c.kind(layer) == H.CSA:
            state = ops(
                f"compress/{layer}",
                lambda st, sp, a, b, pm, i, l=layer: H.compress(st, sp, l, a, b, pm, index=i, impl="xla"),
                state,
                step,
                xl["ckv"],
                xl["cscore"],
                p["main"],
                (xl["ikv"], xl["iscore"], p["index"]),
            )
            iq = ops("index_query", lambda st, q: H.index_query(st, q, impl="xla"), state, xl["iq"])
            state, idx = ops(
                f"index_topk/{layer}",
                lambda st, sp, q, w, l=layer: H.index_topk(st, sp, l, q, w),
                state,
                step,
                iq,
                xl["iw"],
            )
            outs += [
                iq,
                idx,
                ops(
                    f"gather_entries/{layer}",
                    lambda st, sp, i, l=layer: H.gather_entries(st, sp, l, i, impl="xla"),
                    state,
                    step,
                    idx,
                ),
                ops(f"index_keys/{layer}", lambda st, sp, l=layer: H.index_keys(st, sp, l), state, step),
            ]
        elif c.kind(layer) == H.HCA:
            state = ops(
                f"compress/{layer}",
                lambda st, sp, a, b, pm, l=layer: H.compress(st, sp, l, a, b, pm, impl="xla"),
                state,
                step,
                xl["ckv"],
                xl["cscore"],
                p["main"],
            )
            outs.append(
                ops(f"all_entries/{layer}", lambda st, sp, l=layer: H.all_entries(st, sp, l, impl="xla"), state, step)
            )
    return state, outs


def _direct(name, fn, *args):
    return fn(*args)


def hybrid_run(state, ops, rng, params):
    """A prefill (one jitted step, checked whole), then decode steps op by op -> (outputs,
    state). Rows are the slots in order, so each data shard's rows are its own requests."""
    c, B = HCFG, HCFG.max_requests
    slots = jnp.arange(B, dtype=jnp.int32)
    pos = np.zeros(B, np.int32)
    outs = []
    for T in (12, 1, 1, 1):
        n = rng.integers(T // 2, T + 1, size=B).astype(np.int32)
        x = D.make_inputs(c, rng, B, T)

        def step_fn(st, p, n, x, T=T, ops=ops if T == 1 else _direct):
            st, step = ops(
                f"prepare_forward(T={T})", lambda st, s, p, n: H.prepare_forward(st, s, p, n, chunk=T), st, slots, p, n
            )
            st, o = hybrid_layers(st, step, x, params, ops)
            return st, [step] + o

        if T == 1:
            state, o = step_fn(state, jnp.asarray(pos), jnp.asarray(n), x)
        else:
            state, o = ops("prefill step (whole)", step_fn, state, jnp.asarray(pos), jnp.asarray(n), x)
        outs += o
        pos += n
    state = ops("finish", H.finish, state, jnp.asarray([1, 6], jnp.int32))
    return outs, state


@functools.cache
def hybrid_reference(seed):
    params = D.make_params(HCFG, np.random.default_rng(seed + 1))
    return params, hybrid_run(H.init(HCFG), Ops(False), np.random.default_rng(seed), params)


def check_hybrid(mesh, seed=0):
    params, (ref_outs, ref) = hybrid_reference(seed)
    ops = Ops(True)
    outs, st = hybrid_run(H.init(HCFG, mesh=mesh), ops, np.random.default_rng(seed), params)
    equal(ref_outs, outs, "hybrid outputs")
    equal((ref.position, ref.window, ref.tails), (st.position, st.window, st.tails), "hybrid per-request state")
    assert sum(int(x) for x in np.asarray(st.alloc[0].num_free)) == int(ref.alloc[0].num_free) + (
        st.entries[0].shape[1] - ref.entries[0].shape[1]
    )
    return ops.seen


def raises(fn, *words):
    try:
        fn()
    except ValueError as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f"the error does not name {missing}: {e}"
        return str(e)
    raise AssertionError(f"expected a ValueError naming {words}")


def check_bad_input(devices):
    """Meshes that do not divide a sharded dimension; a state used on another mesh."""
    m81 = Mesh(devices.reshape(8, 1), ("data", "model"))
    m24 = Mesh(devices.reshape(2, 4), ("data", "model"))
    m42 = Mesh(devices.reshape(4, 2), ("data", "model"))
    raises(lambda: frame.init(dataclasses.replace(FSPEC, num_streams=4), mesh=m81), "'data'", "num_streams = 4")
    raises(lambda: frame.init(dataclasses.replace(FSPEC, num_heads=2), mesh=m24), "'model'", "num_heads = 2")
    raises(lambda: H.init(dataclasses.replace(HCFG, max_requests=4), mesh=m81), "'data'", "max_requests = 4")
    st = H.init(HCFG, mesh=m42)
    raises(lambda: H.prepare_forward(st, jnp.arange(6, dtype=jnp.int32), jnp.zeros(6, jnp.int32)), "'data'", "= 6")
    # a state laid out on 4x2 with its arrays moved to 2x4: the ops refuse, naming both meshes
    fs = frame.init(FSPEC, mesh=m42)
    moved = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(m24, x.sharding.spec)), fs)
    q = jnp.ones((8, 3, 4, 8), jnp.bfloat16)
    raises(lambda: frame.attention(moved, 0, q), "'data': 4", "'data': 2")
    raises(lambda: frame.resolve(moved, True), "'data': 4", "'data': 2")
    moved = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(m24, x.sharding.spec)), st)
    raises(
        lambda: H.prepare_forward(moved, jnp.arange(8, dtype=jnp.int32), jnp.zeros(8, jnp.int32)),
        "'model': 2",
        "'model': 4",
    )
    # rows naming a slot another shard owns are refused (a fault on their shard), the others proceed
    slots = jnp.asarray([2, 1, 0, 3, 4, 5, 6, 7], jnp.int32)  # 4 shards of 2 rows / 2 slots: rows 0 and 2 swapped
    st, step = H.prepare_forward(st, slots, jnp.zeros(8, jnp.int32))
    assert np.asarray(step.active).tolist() == [False, True, False] + [True] * 5, step.active
    err = np.asarray(st.error)  # per shard: 2 slots, then its bad-row entry
    assert err[2] == err[5] == int(jaxkv.Fault.SLOT_OUT_OF_RANGE) and not err[[0, 1, 3, 4]].any(), err
    try:
        jaxkv.check(st)
    except jaxkv.CacheError as e:
        assert "batch row with a bad slot on data shard 1" in str(e) and "another shard" in str(e), e
    else:
        raise AssertionError("expected a recorded fault")
    print("bad input: ok", flush=True)


def main(shapes):
    devices = np.array(jax.devices())
    assert devices.size == 8, f"expected 8 host devices (XLA_FLAGS), got {devices.size}"
    for shape in shapes:
        d, m = map(int, shape.split("x")) if shape != "bad" else (0, 0)
        if shape == "bad":
            check_bad_input(devices)
            continue
        mesh = Mesh(devices.reshape(d, m), ("data", "model"))
        seen = {**check_frame(mesh), **check_hybrid(mesh)}
        print(
            f"mesh {shape}: {len(seen)} ops compiled, collectives: "
            + ", ".join(f"{k}={v or 'none'}" for k, v in sorted(seen.items())),
            flush=True,
        )
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1:])
