"""hybrid.attention: the XLA path, the kernel path's row building (CPU, through the kernel's
float32 reference) and the kernels (Mosaic GPU on Hopper, cuda/), on caches filled by prepare_forward /
compress / write_window with random inputs, requests at different positions."""

import dataclasses
import importlib

import hybrid_driver as D
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import hybrid as H
from jaxkv._backend import is_hopper
from jaxkv.hybrid.ops import ring_item, ring_positions
from jaxkv.kernels.pool_attention import ref_pool_attention
from jaxkv.math.paging import entry_address

attention = importlib.import_module("jaxkv.hybrid.attention")  # the package exports a function by that name

HEADS = 64 if is_hopper() else 2  # the kernel takes heads by 64; the CPU tests run its reference
CFG = H.HybridConfig(
    compress_ratios=(0, 4, 16), window=32, index_heads=4, top_k=24, block_size=32, max_requests=4, max_context=512
)


LENGTHS = (40, 7, 100)


@pytest.fixture(scope="module")
def filled():
    """One filled cache for the module (compiling the fill is most of these tests' time):
    requests in slots 0, 1, 2 hold ``LENGTHS`` tokens, fed in one ragged chunk."""
    return _filled(np.random.default_rng(21), LENGTHS)


def _filled(rng, lengths, cfg=CFG):
    """(a cache whose requests (slots 0..) hold ``lengths`` tokens, fed in ragged chunks, params)."""
    params = D.make_params(cfg, rng)
    state = H.init(cfg)
    B, T = len(lengths), max(lengths)
    inputs = D.make_inputs(cfg, rng, B, T)
    state, step = H.prepare_forward(state, jnp.arange(B), jnp.zeros(B, jnp.int32), jnp.array(lengths), chunk=T)
    state, _, _ = D.model_step(state, step, inputs, params)
    return state, params


def _copy(state):
    """A copy of the state (the layer ops donate theirs)."""
    return jax.tree.map(jnp.copy, state)


def _layer_inputs(state, rng, step, T, params, layer):
    """(a copy of the state after this layer's compress, q, kv, idx) for the step's tokens."""
    state = _copy(state)
    c = state.config
    B = step.slot.shape[0]
    x = D.make_inputs(c, rng, B, T)[layer]
    q = jnp.asarray(rng.normal(size=(B, T, HEADS, c.head_dim)), jnp.bfloat16)
    idx = None
    if c.kind(layer) == H.CSA:
        state = H.compress(
            state,
            step,
            layer,
            x["ckv"],
            x["cscore"],
            params[layer]["main"],
            index=(x["ikv"], x["iscore"], params[layer]["index"]),
        )
        state, idx = H.index_topk(state, step, layer, H.index_query(state, x["iq"]), x["iw"])
    elif c.kind(layer) == H.HCA:
        state = H.compress(state, step, layer, x["ckv"], x["cscore"], params[layer]["main"])
    return state, q, x["kv"], idx


def _steps(filled, chunk=True):
    """Yields (state, step, T, params) for a decode step and (``chunk``) a ragged prefill chunk."""
    state0, params = filled
    for counts, T in (([1, 1, 1], 1), ([20, 3, 37], 37))[: 1 + chunk]:
        state, step = H.prepare_forward(_copy(state0), jnp.arange(3), jnp.array(LENGTHS), jnp.array(counts), chunk=T)
        yield state, step, T, params


@pytest.fixture
def reference_kernel(monkeypatch):
    """The kernel path with the kernel replaced by its float32 reference: row building on CPU."""

    def ref(q, pools, part_blocks, rows, nvalid, sink, *, storage, scale, splits, spans):
        return ref_pool_attention(q, pools, part_blocks, rows, nvalid, sink, storage=storage, scale=scale, spans=spans)

    monkeypatch.setattr(attention, "pool_attention_pallas", ref)
    choose = attention._backend.choose
    monkeypatch.setattr(
        attention._backend,
        "choose",
        lambda op, impl, **kw: impl if op == "hybrid.attention" else choose(op, impl, **kw),
    )


def _missing(impl):
    """Why the kernel ``impl`` cannot run here for this module's caches, or None."""
    return attention._backend.OPERATIONS["hybrid.attention"].missing[impl](heads=HEADS)


def _valid_rows(out, step):
    """Only rows of real tokens carry meaning."""
    n = np.asarray(step.num_tokens)
    return [np.asarray(out[b, : n[b]], np.float32) for b in range(out.shape[0])]


def _assert_paths_agree(rng, filled, impl="pallas"):
    """``impl`` equals impl="xla" for every layer kind, decode and a ragged chunk."""
    for state, step, T, params in _steps(filled):
        for layer in range(state.config.num_layers):
            st, q, kv, idx = _layer_inputs(state, rng, step, T, params, layer)
            sink = jnp.asarray(rng.normal(size=(HEADS,)), jnp.float32)
            # jitted (eager dispatch is most of the CPU time); a fresh lambda: no trace shared with
            # another test, whose kernel may be patched
            run = jax.jit(lambda *a, impl: H.attention(*a[:2], layer, *a[2:], impl=impl), static_argnames="impl")
            x = run(st, step, q, sink, kv, idx, impl="xla")
            k = run(st, step, q, sink, kv, idx, impl=impl)
            for a, b in zip(_valid_rows(x, step), _valid_rows(k, step)):
                np.testing.assert_allclose(b, a, atol=2e-2, rtol=2e-2, err_msg=f"layer {layer}, T={T}")


@pytest.mark.slow
def test_kernel_rows_equal_the_xla_path(rng, filled, reference_kernel):
    """The rows the kernel path reads (ring before the step, own tokens, picked / visible
    entries through block tables) give the XLA path's attention."""
    _assert_paths_agree(rng, filled)


def _jit_attention():
    """``H.attention`` jitted, layer and impl static (eager dispatch of its many small ops is
    most of the CPU time)."""
    return jax.jit(
        lambda *a, layer, impl: H.attention(a[0], a[1], layer, *a[2:], impl=impl), static_argnames=("layer", "impl")
    )


def _decode_layers(rng, filled):
    """Per layer of a decode step: (step, layer, the state after the layer's compress, q, kv,
    idx, sink), fresh random inputs."""
    state, step, T, params = next(_steps(filled, chunk=False))
    for layer in range(state.config.num_layers):
        st, q, kv, idx = _layer_inputs(state, rng, step, T, params, layer)
        yield step, layer, st, q, kv, idx, jnp.asarray(rng.normal(size=(HEADS,)), jnp.float32)


def _assert_stacked_rows_are_the_arrays(rng, filled, impls):
    run = _jit_attention()
    for step, layer, st, q, kv, idx, sink in _decode_layers(rng, filled):
        kvs, qs, sinks = (jnp.stack([-x, x, 2 * x]) for x in (kv, q, sink))
        for impl in impls:
            want = run(st, step, q, sink, kv, idx, layer=layer, impl=impl)
            for args in ((q, sink, H.Stacked(kvs, 1)), (H.Stacked(qs, 1), H.Stacked(sinks, 1), kv)):
                got = run(st, step, *args, idx, layer=layer, impl=impl)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"layer {layer}, {impl}")


def test_stacked_rows_are_the_arrays(rng, filled, reference_kernel):
    """``Stacked`` rows of q, sink and the step's tokens give the same output as the arrays
    they stand for, on both paths and every layer kind."""
    _assert_stacked_rows_are_the_arrays(rng, filled, ("xla", "pallas"))


def test_table_cell_outside_the_pool_is_no_key(rng, filled, reference_kernel):
    """A block table cell that names no block of the pool (unallocated, or past it)
    makes its entries no keys on both paths: the XLA path equals the kernel path's rows
    (the kernel replaced by its reference), and equals the same step with those entries
    never picked."""
    state, step, T, params = next(_steps(filled, chunk=False))
    run = _jit_attention()  # once per layer and path for both cells
    for layer in (1, 2):  # CSA, HCA
        st0, q, kv, idx = _layer_inputs(state, rng, step, T, params, layer)
        g, _ = st0.group(layer)
        al = st0.alloc[g]
        sink = jnp.asarray(rng.normal(size=(HEADS,)), jnp.float32)
        for cell in (-1, 10_000):
            st = st0.replace(
                alloc=st0.alloc[:g] + (al.replace(table=al.table.at[0, 0].set(cell)),) + st0.alloc[g + 1 :]
            )
            x = run(st, step, q, sink, kv, idx, layer=layer, impl="xla")
            k = run(st, step, q, sink, kv, idx, layer=layer, impl="pallas")
            for a, b in zip(_valid_rows(x, step), _valid_rows(k, step)):
                np.testing.assert_allclose(b, a, atol=2e-2, rtol=2e-2, err_msg=f"layer {layer}, cell {cell}")
            if idx is not None:  # request 0's entries in block 0 (the first block_size) never picked: the same output
                bs = st.config.block_size
                dropped = jnp.where((jnp.arange(3)[:, None, None] == 0) & (idx < bs), -1, idx)
                y = run(st, step, q, sink, kv, dropped, layer=layer, impl="xla")
                np.testing.assert_array_equal(np.asarray(y[0], np.float32), np.asarray(x[0], np.float32))


def test_xla_path_is_the_driver_reference(rng, filled):
    """The XLA path is window_keys + gather_entries / all_entries + sparse_attention."""
    state, step, _, params = next(_steps(filled, chunk=False))
    for layer in range(3):
        st, q, kv, idx = _layer_inputs(state, rng, step, 1, params, layer)
        sink = params[layer]["sink"]
        q2 = q[:, :, : D.Q_HEADS]
        keys, pos = H.window_keys(st, step, layer, kv)
        parts = [(keys, H.window_mask(pos, step, 1, st.config.window))]
        if idx is not None:
            parts.append((H.gather_entries(st, step, layer, idx), idx >= 0))
        elif st.config.compress_ratios[layer]:
            ent, _ = H.all_entries(st, step, layer)
            parts.append((ent, H.causal_entry_mask(ent.shape[1], step, 1, st.config.compress_ratios[layer])))
        ref = H.sparse_attention(q2, parts, sink, 512**-0.5)
        out = H.attention(st, step, layer, q2, sink, kv, idx, impl="xla")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("impl", ["xla", "pallas", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_reads_its_token_from_the_written_ring(rng, filled, request, impl):
    """A decode step whose write_window ran first (``kv=None``) gives the attention of the
    step with its tokens passed: the ring then holds the token where the position a window
    back was, which the query does not see. Every layer kind."""
    if impl == "pallas" and not is_hopper():
        request.getfixturevalue("reference_kernel")  # the kernel path's rows through the reference
    elif impl != "xla" and _missing(impl):
        pytest.skip(_missing(impl))
    run = _jit_attention()
    for step, layer, st, q, kv, idx, sink in _decode_layers(rng, filled):
        want = run(st, step, q, sink, kv, idx, layer=layer, impl=impl)
        written = H.write_window(_copy(st), step, layer, kv)
        got = run(written, step, q, sink, None, idx, layer=layer, impl=impl)
        stale = run(st, step, q, sink, None, idx, layer=layer, impl=impl)  # the ring without the token
        for a, b, c in zip(_valid_rows(want, step), _valid_rows(got, step), _valid_rows(stale, step)):
            # the same keys in another order: float32 sums apart by rounding, bf16 out
            np.testing.assert_allclose(b, a, atol=1e-2, rtol=1e-2, err_msg=f"layer {layer}, {impl}")
            near, stale_by = np.abs(b - a).max(), np.abs(c - a).max()
            assert stale_by > 4 * near + 2e-3, f"layer {layer}: without the token {stale_by}, with it {near}"


def test_bad_inputs(rng, filled):
    state, step, _, params = next(_steps(filled, chunk=False))
    st, q, kv, idx = _layer_inputs(state, rng, step, 1, params, 1)
    sink = jnp.zeros((HEADS,), jnp.float32) + 0.5
    with pytest.raises(ValueError, match="idx: a CSA layer expects"):
        H.attention(st, step, 1, q, sink, kv, None, impl="xla")
    with pytest.raises(ValueError, match="idx: layer 2 is HCA"):
        H.attention(st, step, 2, q, sink, kv, idx, impl="xla")
    wide = jnp.concatenate([idx, jnp.full(idx.shape[:2] + (st.config.top_k + 1 - idx.shape[2],), -1, idx.dtype)], -1)
    with pytest.raises(ValueError, match=f"idx: expected at most HybridConfig.top_k = {st.config.top_k} picks"):
        H.attention(st, step, 1, q, sink, kv, wide, impl="xla")
    with pytest.raises(ValueError, match="q: expected bf16"):
        H.attention(st, step, 1, q.astype(jnp.float32), sink, kv, idx, impl="xla")
    with pytest.raises(ValueError, match="sink: expected"):
        H.attention(st, step, 1, q, sink[:1], kv, idx, impl="xla")
    with pytest.raises(ValueError, match="kv: expected"):
        H.attention(st, step, 1, q, sink, kv[:, :, :100], idx, impl="xla")
    with pytest.raises(ValueError, match="layer: expected"):
        H.attention(st, step, 7, q, sink, kv, None, impl="xla")
    with pytest.raises(ValueError, match=r"kv: None \(the step's tokens already in the ring"):
        H.attention(st, step, 1, jnp.concatenate([q, q], 1), sink, None, idx, impl="xla")
    with pytest.raises(ValueError, match="impl"):
        H.attention(st, step, 0, q, sink, kv, None, impl="flashmla-nope")
    if not is_hopper():
        with pytest.raises(ValueError, match="Hopper"):
            H.attention(st, step, 0, q, sink, kv, None, impl="pallas")
    if _missing("cuda"):
        with pytest.raises(ValueError, match="impl='cuda' for hybrid.attention: expected"):
            H.attention(st, step, 0, q, sink, kv, None, impl="cuda")
    if _missing("flashmla"):
        with pytest.raises(ValueError, match="impl='flashmla' for hybrid.attention: expected"):
            H.attention(st, step, 0, q, sink, kv, None, impl="flashmla")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "cuda", "flashmla"])
def test_kernel_equals_xla_on_gpu(rng, filled, impl):
    why = _missing(impl)
    if why:
        pytest.skip(why)
    _assert_paths_agree(rng, filled, impl)
    _assert_stacked_rows_are_the_arrays(rng, filled, (impl,))  # cuda: read in place


@pytest.mark.gpu
def test_cuda_kernel_reads_per_entry_caches(rng):
    why = _missing("cuda")
    if why:
        pytest.skip(why)
    cfg = dataclasses.replace(CFG, storage="per_entry")
    _assert_paths_agree(rng, _filled(np.random.default_rng(22), LENGTHS, cfg), "cuda")


def _decode_step(state, slots, inputs, params, q, ordered, write_first=False):
    """A decode step in model order: compress -> top-k -> attention -> (after_reads) -> window
    write; ``write_first``: the window written before attention, which reads the token from it."""
    c = state.config
    state, step = H.prepare_forward(state, slots, state.position[slots], chunk=1)
    outs = []
    for layer in range(c.num_layers):
        x, p = inputs[layer], params[layer]
        idx = None
        if c.kind(layer) == H.CSA:
            state = H.compress(
                state, step, layer, x["ckv"], x["cscore"], p["main"], index=(x["ikv"], x["iscore"], p["index"])
            )
            state, idx = H.index_topk(state, step, layer, H.index_query(state, x["iq"]), x["iw"])
        elif c.kind(layer) == H.HCA:
            state = H.compress(state, step, layer, x["ckv"], x["cscore"], p["main"])
        if write_first:
            state = H.write_window(state, step, layer, x["kv"])
        out = H.attention(state, step, layer, q, p["sink"], None if write_first else x["kv"], idx, impl="xla")
        outs.append(out)
        if ordered:
            state = H.after_reads(state, out)
        if not write_first:
            state = H.write_window(state, step, layer, x["kv"])
    return state, jnp.stack(outs)  # every layer's output, not a sum: a GPU sum may take another order


def test_after_reads_keeps_the_pools_in_place(rng, filled):
    """Reading a layer's pools (attention, top-k) and then writing them (write_window, the next
    compress) in one jitted step: with after_reads between them the compiled step holds no copy
    of a whole pool, and after_reads changes no value. (Without it XLA copies the stacked pools
    layer after layer: benchmarks/RESULTS.md, dsv4_step.py.)"""
    state, params = filled
    c = state.config
    slots = jnp.arange(3, dtype=jnp.int32)
    inputs = D.make_inputs(c, rng, 3, 1)
    q = jnp.asarray(rng.normal(size=(3, 1, D.Q_HEADS, c.head_dim)), jnp.bfloat16)  # the params' sinks: Q_HEADS
    pools = {tuple(x.shape) for x in (state.window, *state.entries, state.index_keys)}
    step = jax.jit(_decode_step, donate_argnums=0, static_argnames=("ordered", "write_first"))
    for first in (False, True):  # both orders of the window write
        text = step.lower(_copy(state), slots, inputs, params, q, ordered=True, write_first=first).compile().as_text()
        copies = [
            line
            for line in text.splitlines()
            if " copy(" in line and any(f"u8[{','.join(map(str, s))}]" in line for s in pools)
        ]
        assert not copies, (first, copies[:3])
    out = jnp.asarray(rng.normal(size=(3, 1, D.Q_HEADS, c.head_dim)), jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(H.after_reads(_copy(state), out))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ordered_state, outs = step(_copy(state), slots, inputs, params, q, ordered=True)
    plain_state, outs0 = step(_copy(state), slots, inputs, params, q, ordered=False)
    # two compiled programs: XLA may fuse the attention's sums differently around after_reads'
    # ordering (on an H100 one output of 9216 came out one bf16 step apart), so one step is allowed
    np.testing.assert_allclose(
        np.asarray(outs.astype(jnp.float32)), np.asarray(outs0.astype(jnp.float32)), rtol=2.0**-7, atol=1e-6
    )
    assert float(jnp.max(jnp.abs(outs.astype(jnp.float32)))) > 0.01
    for a, b in zip(jax.tree.leaves(ordered_state), jax.tree.leaves(plain_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ring_and_entry_addresses(rng):
    """ring_item / ring_positions / entry_address against a numpy transcription: the ring
    before a step holds, at item i, the latest position before start that is i mod window;
    entry e sits at item e % bs of block table[slot, e // bs] (-1: none)."""
    W = 8
    start = rng.integers(0, 40, size=6).astype(np.int32)
    step = H.Step(
        slot=jnp.zeros(6, jnp.int32),
        write_slot=jnp.zeros(6, jnp.int32),
        start=jnp.asarray(start),
        num_tokens=jnp.ones(6, jnp.int32),
        active=jnp.ones(6, bool),
    )
    pos = np.asarray(ring_positions(step, W))
    for b, s in enumerate(start):
        want = [max([p for p in range(s) if p % W == i], default=-1) for i in range(W)]
        assert pos[b].tolist() == want, (s, pos[b], want)
    held = pos >= 0
    assert (np.asarray(ring_item(jnp.asarray(pos), W))[held] == np.nonzero(held)[1]).all()

    bs, R, MB = 4, 3, 5
    table = rng.integers(-1, 50, size=(R, MB)).astype(np.int32)
    slot = rng.integers(0, R, size=(R, 1)).astype(np.int32)
    entry = rng.integers(-1, MB * bs, size=(R, 7)).astype(np.int32)
    blk, item = (np.asarray(a) for a in entry_address(jnp.asarray(table), jnp.asarray(slot), jnp.asarray(entry), bs))
    for r in range(R):
        for k in range(7):
            e = entry[r, k]
            assert blk[r, k] == (table[slot[r, 0], e // bs] if e >= 0 else -1)
            assert e < 0 or item[r, k] == e % bs


def test_visibility_rules(rng):
    """window_mask / window_first and entry_visible / causal_entry_mask against their
    definitions: ``p - window < pos <= p``; ``0 <= s < (p + 1) // ratio``."""
    B, T, W, ratio = 3, 5, 6, 4
    start = rng.integers(0, 30, size=B).astype(np.int32)
    step = H.Step(
        slot=jnp.zeros(B, jnp.int32),
        write_slot=jnp.zeros(B, jnp.int32),
        start=jnp.asarray(start),
        num_tokens=jnp.full(B, T, jnp.int32),
        active=jnp.ones(B, bool),
    )
    p = start[:, None] + np.arange(T)[None, :]
    key_pos = rng.integers(-1, 40, size=(B, 9)).astype(np.int32)
    want = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] > p[..., None] - W) & (key_pos[:, None, :] <= p[..., None])
    np.testing.assert_array_equal(np.asarray(H.window_mask(jnp.asarray(key_pos), step, T, W)), want)
    np.testing.assert_array_equal(np.asarray(attention.window_first(step, T, W)), p - W + 1)
    e = rng.integers(-1, 12, size=(B, T, 7)).astype(np.int32)
    want = (e >= 0) & (e < ((p + 1) // ratio)[..., None])
    np.testing.assert_array_equal(np.asarray(attention.entry_visible(jnp.asarray(e), step, T, ratio)), want)
    np.testing.assert_array_equal(
        np.asarray(H.causal_entry_mask(12, step, T, ratio)),
        np.arange(12)[None, None, :] < ((p + 1) // ratio)[..., None],
    )
