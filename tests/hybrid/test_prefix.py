"""Prefix sharing (``hybrid.share`` / ``complete_share``): a request started from another's
first tokens holds the same bytes, and decodes to the same outputs, as one fed from scratch;
shared blocks are freed only when their last holder lets go."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import hybrid as H
from jaxkv.hybrid.step import holders

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: hybrid_driver
import hybrid_driver as D  # noqa: E402


def _config(storage="official", **kw):
    base = dict(compress_ratios=(0, 4, 8), max_requests=6, max_context=64, top_k=4, block_size=4, index_heads=2)
    base.update(kw)
    return H.HybridConfig(window=8, storage=storage, **base)


def _feed(state, slot, inputs, params, lo, hi, T=4):
    """Positions ``lo .. hi - 1`` of ``inputs`` (one row) into ``slot``, ``T`` at a time ->
    (state, attention outputs of each step)."""
    outs = []
    for p in range(lo, hi, T):
        n = min(T, hi - p)
        x = D.slice_tokens(inputs, p, p + T)
        if n < T:  # pad the last chunk: the rows past num_tokens are ignored
            x = jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, T - n)] + [(0, 0)] * (a.ndim - 2)), x)
        state, step = H.prepare_forward(
            state, jnp.asarray([slot], jnp.int32), jnp.asarray([p], jnp.int32), jnp.asarray([n], jnp.int32), chunk=T
        )
        state, out, _ = D.model_step(state, step, x, params)
        outs.append(out)
    return state, outs


def _check_blocks(state):
    """Every block is free (once) or named by some table, never both; none leaks."""
    for al in state.alloc:
        nb = al.free.shape[0]
        free = np.asarray(al.free[: int(al.num_free)])
        held = np.asarray(holders(al.table, nb))
        assert len(set(free.tolist())) == len(free), "a block is on the free stack twice"
        assert not held[free].any(), "a block on the free stack is still named by a table"
        assert int(al.num_free) + int((held > 0).sum()) == nb, "a block is neither free nor held"


@pytest.mark.parametrize("storage", ["official", pytest.param("per_entry", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "length", [56, 37, pytest.param(22, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)]
)
def test_shared_prefix_decodes_bit_identically(storage, length, rng):
    """Slot 0 holds 56 tokens; slot 2 shares its first ``length`` (the whole of it, or fewer:
    re-fed from ``refeed_start``), then both it and a request fed from scratch take 6 more
    tokens: same entries, indexer keys, ring, tails, and bit-identical attention outputs."""
    c = _config(storage)
    params = D.make_params(c, rng)
    tokens = D.make_inputs(c, rng, 1, 64)
    source_len, more = 56, 6

    ref, _ = _feed(H.init(c), 1, tokens, params, 0, length)
    st, _ = _feed(H.init(c), 0, tokens, params, 0, source_len)
    used_by_source = [int(al.free.shape[0] - al.num_free) for al in st.alloc]

    st = H.share(st, [2], [0], [length])
    start = H.refeed_start(c, length, source_len)
    assert int(st.position[2]) == start
    assert start == length if length == source_len else length - start <= c.window + 2 * c.indexer_ratio
    st, _ = _feed(st, 2, tokens, params, start, length)
    st = H.complete_share(st, [2], [0], [length])
    jaxkv.check(st)
    D.assert_same_request(ref, 1, st, 2, length)
    _check_blocks(st)
    for r, al in zip(c.ratios, st.alloc):  # blocks wholly before the re-fed entries: the source's own
        k, total = (start // r) // c.block_size, -(-(length // r) // c.block_size)
        np.testing.assert_array_equal(np.asarray(al.table[2, :k]), np.asarray(al.table[0, :k]))
        assert not set(np.asarray(al.table[2, k:total]).tolist()) & set(np.asarray(al.table[0]).tolist())
    copied = sum(int(al.free.shape[0] - al.num_free) - u for al, u in zip(st.alloc, used_by_source))
    assert copied == sum(-(-(length // r) // c.block_size) - (start // r) // c.block_size for r in c.ratios)

    ref, out_ref = _feed(ref, 1, tokens, params, length, length + more, T=1)
    st, out = _feed(st, 2, tokens, params, length, length + more, T=1)
    D.assert_same_outputs(out_ref, out)
    D.assert_same_request(ref, 1, st, 2, length + more)


def test_shared_blocks_live_until_the_last_holder_finishes(rng):
    """Two requests share a source's blocks; finishing the source frees only what no other
    table names; finishing the sharers then frees the rest; the blocks never double up."""
    c = _config()
    params = D.make_params(c, rng)
    tokens = D.make_inputs(c, rng, 1, 64)
    st, _ = _feed(H.init(c), 0, tokens, params, 0, 48)
    st = H.share(st, [1, 3], [0, 0], [48, 40])
    st, _ = _feed(st, 3, tokens, params, H.refeed_start(c, 40), 40)
    st = H.complete_share(st, [3], [0], [40])
    _check_blocks(st)
    before = [int(al.num_free) for al in st.alloc]
    table0 = np.asarray(st.alloc[0].table[0])
    st = H.finish(st, jnp.asarray([0], jnp.int32))
    _check_blocks(st)
    still = np.asarray(holders(st.alloc[0].table, st.alloc[0].free.shape[0]))
    assert all(still[b] > 0 for b in table0[:2])  # the sharers' blocks stay
    assert int(st.alloc[0].num_free) - before[0] < int((table0 >= 0).sum())
    st = H.finish(st, jnp.asarray([1, 3], jnp.int32))
    _check_blocks(st)
    assert [int(al.num_free) for al in st.alloc] == [al.free.shape[0] for al in st.alloc]
    st = H.finish(st, jnp.asarray([1], jnp.int32))  # again: a fault, nothing freed twice
    with pytest.raises(jaxkv.CacheError, match="finish of a slot that holds nothing"):
        jaxkv.check(st)
    _check_blocks(st)


def test_share_refusals_leave_the_others_untouched(rng):
    """A busy destination, a source too short, the slot itself, out of range, an empty length,
    complete_share before the re-feed: a fault on that row, the cache otherwise as it was;
    mis-shaped or mistyped arguments: ValueError naming them."""
    c = _config(pool_tokens=1)
    params = D.make_params(c, rng)
    tokens = D.make_inputs(c, rng, 1, 64)
    st, _ = _feed(H.init(c), 0, tokens, params, 0, 24)
    st, _ = _feed(st, 1, tokens, params, 0, 8)
    before = jax.tree.map(np.asarray, st)

    def unchanged(out):
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(out)):
            if "error" not in jax.tree_util.keystr(path):
                np.testing.assert_array_equal(x, np.asarray(y), err_msg=jax.tree_util.keystr(path))

    for dst, src, length, msg in (
        (1, 0, 8, "not empty"),
        (2, 0, 30, "fewer tokens than asked"),
        (2, 2, 8, "the slot itself"),
        (2, 9, 8, "out of range"),
        (9, 0, 8, "out of range"),
        (2, 0, 0, "length < 1"),
    ):
        out = H.share(jax.tree.map(jnp.asarray, before), [dst], [src], [length])
        with pytest.raises(jaxkv.CacheError, match=msg):
            jaxkv.check(out)
        unchanged(out)

    out = H.complete_share(jax.tree.map(jnp.asarray, before), [2], [0], [16])  # slot 2 never shared
    with pytest.raises(jaxkv.CacheError, match="complete_share before the slot was re-fed"):
        jaxkv.check(out)
    unchanged(out)
    with pytest.raises(ValueError, match=r"src: expected shape \(2,\), got \(1,\)"):
        H.share(H.init(c), [1, 2], [0], [4, 4])
    with pytest.raises(ValueError, match="length: expected an integer array"):
        H.share(H.init(c), [1], [0], [4.0])
