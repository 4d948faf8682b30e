"""kernels.compress_decode and kernels.flush_write (cuda/) inside hybrid.compress / write_window: bytes
equal to the XLA path natively on a GPU, Stacked rows equal to slices; the validators everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


# --- fused decode compressor (official storage family) ------------------------------------------
def _decode_run(c, params, x, slots, pos0, steps, impl, drop_block=None):
    """Prefill with the XLA path to ``pos0``, then ``steps`` decode steps (all layers) with
    ``impl``; ``drop_block = (slot, block)`` clears a table cell before every decode flush."""
    import hybrid_driver as D

    from jaxkv import hybrid as H

    B = len(pos0)
    T = max(pos0)
    st = H.init(c)
    st, step = H.prepare_forward(st, slots, jnp.zeros(B, jnp.int32), jnp.asarray(pos0), chunk=T)
    st = D.compress_all(st, step, D.slice_tokens(x, 0, T), params, "xla")
    before = jax.tree.map(np.array, st)  # a host copy: st is donated below
    pos = np.array(pos0)
    for t in range(steps):
        st, step = H.prepare_forward(st, slots, jnp.asarray(pos), chunk=1)
        if drop_block is not None:
            al = st.alloc[0]
            st = st.replace(alloc=(al.replace(table=al.table.at[drop_block].set(-1)),) + st.alloc[1:])
        for layer in range(c.num_layers):
            xl = D.slice_tokens(x, T + t, T + t + 1)[layer]
            st = H.write_window(st, step, layer, xl["kv"], impl=impl)
        st = D.compress_all(st, step, D.slice_tokens(x, T + t, T + t + 1), params, impl)
        pos += 1
    return before, st


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_compress_decode_fused_matches_xla(rng, storage):
    """Decode steps through the fused kernel (and the cuda/ SWA write) give the XLA path's
    cache: CSA and HCA flushes on different steps, a request whose flush finds no block
    (POOL_EXHAUSTED recorded, nothing written for it), and tokens holding a NaN or Inf
    (the kernels' own check: NONFINITE_KV recorded, nothing written for that token)."""
    import hybrid_driver as D

    from jaxkv import hybrid as H
    from jaxkv.errors import Fault

    c = H.HybridConfig(
        compress_ratios=(4, 128, 0),
        window=32,
        index_heads=4,
        top_k=16,
        block_size=16,
        max_requests=5,
        max_context=512,
        storage=storage,
    )
    params = D.make_params(c, rng)
    pos0 = [130, 61, 127, 3, 20]
    x = D.make_inputs(c, rng, len(pos0), max(pos0) + 9)
    T = max(pos0)  # decode step t reads token T + t
    for layer, name, b, t, value in (
        (2, "kv", 1, 2, np.nan),  # SWA-only layer's window
        (0, "iscore", 4, 7, np.inf),  # CSA indexer, on request 4's flush step
        (1, "ckv", 0, 3, -np.inf),
    ):  # HCA (request 2's flush at t = 0 stays)
        x[layer][name] = x[layer][name].at[b, T + t, 5].set(value)
    slots = jnp.asarray([0, 1, 2, 3, 4], jnp.int32)
    want_before, want = _decode_run(c, params, x, slots, pos0, 9, "xla", drop_block=(3, 0))
    _, got = _decode_run(c, params, x, slots, pos0, 9, "cuda", drop_block=(3, 0))
    leaves = jax.tree_util.tree_leaves_with_path
    for (path, w), g, b in zip(
        leaves(want), jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want_before), strict=True
    ):
        w, g, b = np.asarray(w), np.asarray(g), np.asarray(b)
        name = jax.tree_util.keystr(path)
        if w.dtype == np.float32:  # tails: same math, float32 rounding order may differ
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
        elif w.dtype == np.uint8:  # last-bit BF16 differences move a code now and then
            # (in the seed family one moved amax rescales its whole entry / key: more bytes)
            frac = (g != w).mean()
            print(f"{storage} {name}: {frac:.2e} of the bytes differ")  # shown with pytest -rP
            assert frac <= (2e-3 if storage == "official" else 1e-2), f"{name}: {frac:.2e} of the bytes differ"
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
        if name.startswith((".entries", ".index_keys", ".window")):
            assert (w != b).any(), f"{name}: the decode steps wrote nothing"
    nf, pe = int(Fault.NONFINITE_KV), int(Fault.POOL_EXHAUSTED)
    np.testing.assert_array_equal(np.asarray(want.error), [nf, nf, 0, pe, nf, 0])  # and got's: equal above
    # the dropped request's CSA entries stay as the prefill left them (it had none)
    assert int(got.alloc[0].owned[3]) >= 1
    # the entries read back equal (dequantized)
    step = H.Step(
        slot=slots,
        write_slot=slots,
        start=jnp.asarray(pos0) + 9,
        num_tokens=jnp.zeros(5, jnp.int32),
        active=jnp.ones(5, bool),
    )
    for layer in (0, 1):
        (we, cnt), (ge, _) = H.all_entries(want, step, layer, impl="xla"), H.all_entries(got, step, layer, impl="xla")
        assert int(cnt.sum()) > 0
        ge, we = np.asarray(ge, np.float32), np.asarray(we, np.float32)
        np.testing.assert_allclose(ge, we, rtol=0.13, atol=1e-2)  # at most one FP8 code apart
        written = int(cnt.sum()) * ge.shape[-1]  # elements of the entries that exist
        assert (ge != we).sum() <= 0.01 * written


def test_compress_decode_bad_inputs(rng):
    """The kernel's validator names the argument, what it expected and what came."""
    from jaxkv import hybrid as H
    from jaxkv.kernels.compress_decode import compress_decode

    c = H.HybridConfig(compress_ratios=(128,), max_requests=2, max_context=256, block_size=16, storage="per_entry")
    st, step = H.prepare_forward(H.init(c), jnp.arange(2), jnp.zeros(2, jnp.int32), chunk=1)
    kv = jnp.asarray(rng.normal(size=(2, 512)), jnp.float32)
    args = (
        st.tails[0],
        kv,
        kv,
        jnp.ones((128, 512)),
        jnp.ones(512),
        step.slot,
        step.write_slot,
        step.start,
        step.num_tokens,
        st.alloc[0].table,
        st.entries[0],
        st.error,
        jnp.ones(32),
    )
    kw = dict(layer=0, ratio=128, eps=1e-6)
    with pytest.raises(ValueError, match=r"pool: expected u8\[1, NB, bs \* 584\] \(official storage\), got uint8"):
        compress_decode(*args, storage="official", **kw)
    with pytest.raises(ValueError, match="storage: expected one of"):
        compress_decode(*args, storage="fp8", **kw)
    with pytest.raises(ValueError, match=r"kv: expected float32 or bfloat16\[2, 512\], got float32\[2, 256\]"):
        compress_decode(args[0], kv[:, :256], *args[2:], storage="per_entry", **kw)
    with pytest.raises(ValueError, match="layer: expected a static int in"):
        compress_decode(*args, storage="per_entry", **{**kw, "layer": 1})


@pytest.mark.parametrize(
    "impl", [pytest.param("xla", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_stacked_rows_equal_slices(rng, impl):
    """Layer inputs and compressor params passed as ``Stacked`` rows of per-kind stacks
    (read in place by the kernels) give the same cache bytes as the sliced arrays."""
    import hybrid_driver as D

    from jaxkv import hybrid as H

    c = H.HybridConfig(
        compress_ratios=(0, 4, 128, 4, 128),
        window=32,
        index_heads=4,
        top_k=16,
        block_size=16,
        max_requests=3,
        max_context=512,
    )
    params = D.make_params(c, rng)
    pos0 = [3, 126, 127]  # flushes of both ratios on the decode steps
    x = D.make_inputs(c, rng, 3, 2)
    slots = jnp.arange(3, dtype=jnp.int32)
    kinds = {k: [l for l in c.compressed_layers if c.kind(l) == k] for k in (H.CSA, H.HCA)}
    kv_all = jnp.stack([x[l]["kv"] for l in range(c.num_layers)])  # bf16[L, B, T, D]
    stacks = {
        k: (
            jax.tree.map(lambda *a: jnp.stack(a), *[x[l] for l in ls]),
            jax.tree.map(lambda *a: jnp.stack(a), *[params[l] for l in ls]),
        )
        for k, ls in kinds.items()
    }
    states = []
    for stacked in (False, True):
        st = H.init(c)
        st, _ = H.prepare_forward(st, slots, jnp.zeros(3, jnp.int32), jnp.asarray(pos0), chunk=max(pos0))
        pos = np.array(pos0)
        for t in range(2):
            st, step = H.prepare_forward(st, slots, jnp.asarray(pos), chunk=1)
            for layer in range(c.num_layers):
                xl, p = D.slice_tokens(x, t, t + 1)[layer], params[layer]
                kv = H.Stacked(kv_all[:, :, t : t + 1], layer) if stacked else xl["kv"]
                keys, _ = H.window_keys(st, step, layer, kv)
                np.testing.assert_array_equal(
                    np.asarray(keys[:, -1], np.float32),
                    np.asarray(H.window_keys(st, step, layer, xl["kv"], impl="xla")[0][:, -1], np.float32),
                )
                st = H.write_window(st, step, layer, kv, impl=impl)
                if not c.compress_ratios[layer]:
                    continue
                if stacked:
                    kind = c.kind(layer)
                    i = kinds[kind].index(layer)
                    xs, ps = stacks[kind]

                    def rowof(a, i=i):
                        return H.Stacked(a[:, :, t : t + 1], i) if a.ndim == 4 else H.Stacked(a, i)

                    xl = {k: rowof(v) for k, v in xs.items()}
                    p = {
                        k: H.CompressorParams(H.Stacked(v.bias, i), H.Stacked(v.norm, i))
                        for k, v in ps.items()
                        if k != "sink"
                    }
                index = (xl["ikv"], xl["iscore"], p["index"]) if "index" in p else None
                st = H.compress(st, step, layer, xl["ckv"], xl["cscore"], p["main"], index, impl=impl)
            pos += 1
        states.append(st)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(states[0]), jax.tree_util.tree_leaves(states[1])):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
    assert np.asarray(states[1].entries[0]).any() and np.asarray(states[1].entries[1]).any()
    with pytest.raises(ValueError, match=r"kv: expected Stacked.index a static int in \[0, 5\)"):
        H.write_window(st, step, 0, H.Stacked(kv_all[:, :, :1], 5), impl=impl)
    with pytest.raises(ValueError, match=r"params.bias: expected Stacked.index"):
        H.compress(
            st,
            step,
            2,
            x[2]["ckv"][:, :1],
            x[2]["cscore"][:, :1],
            H.CompressorParams(H.Stacked(stacks[H.HCA][1]["main"].bias, 2), params[2]["main"].norm),
            impl=impl,
        )
