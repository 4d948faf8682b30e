"""hybrid.index_scores / index_topk: the XLA path against float64 numpy, the kernel path's
wiring (page tables, counts, rows per request) on CPU through the kernel's float32
reference, and the Mosaic GPU kernel (Hopper), on caches filled by prepare_forward /
compress with random inputs, requests at different positions."""

import dataclasses

import hybrid_driver as D
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import hybrid as H
from jaxkv._backend import is_hopper
from jaxkv.errors import Fault
from jaxkv.hybrid import indexer
from jaxkv.hybrid.indexer import _select, _top_k
from jaxkv.kernels.index_scores import ref_index_scores
from jaxkv.kernels.top_k import ref_top_k_record

# index heads and block size as the kernel takes them (by 64); two pages of entries a request
CFG = H.HybridConfig(
    compress_ratios=(0, 4), window=32, index_heads=64, top_k=24, block_size=64, max_requests=4, max_context=512
)
LENGTHS = (300, 7, 130)


@pytest.fixture(scope="module", params=["official", pytest.param("per_entry", marks=pytest.mark.gpu)])  # CI time
def filled(request):
    rng = np.random.default_rng(5)
    cfg = dataclasses.replace(CFG, storage=request.param)
    params = D.make_params(cfg, rng)
    state = H.init(cfg)
    B, T = len(LENGTHS), max(LENGTHS)
    state, step = H.prepare_forward(state, jnp.arange(B), jnp.zeros(B, jnp.int32), jnp.array(LENGTHS), chunk=T)
    state, _, _ = D.model_step(state, step, D.make_inputs(cfg, rng, B, T), params)
    return state


def _steps(state):
    """(step, T) for a decode step and a ragged prefill chunk (a request with no new entry)."""
    for counts, T in (([1, 1, 1], 1), ([20, 3, 37], 37)):
        _, step = H.prepare_forward(
            jax.tree.map(jnp.copy, state), jnp.arange(3), jnp.array(LENGTHS), jnp.array(counts), chunk=T
        )
        yield step, T


def _query(state, rng, T):
    c = state.config
    q = H.index_query(state, jnp.asarray(rng.normal(size=(3, T, c.index_heads, c.index_dim)), jnp.bfloat16))
    return q, jnp.asarray(rng.normal(size=(3, T, c.index_heads)), jnp.float32)


def test_top_k_in_two_stages_equals_lax(rng):
    s = jnp.asarray(rng.normal(size=(2, 3, 4096)), jnp.float32)
    s = s.at[0, 0, 1000:].set(-jnp.inf).at[1, 2, :300].set(2.5)  # -inf tails and ties
    for k in (5, 512):
        got, want = _top_k(s, k), jax.lax.top_k(s, k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_selection_never_picks_a_nonfinite_score(rng):
    """NaN and +-Inf scores are never picked and take no finite entry's place; past the
    finite entries the row is -1; elsewhere the picks are lax.top_k's."""
    s = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32)
    s = s.at[0, 3].set(jnp.nan).at[0, 7].set(jnp.inf).at[0, 9].set(-jnp.inf).at[1, 10:].set(-jnp.inf)
    got, bad = _select(s, 12, jnp.asarray([64, 10], jnp.int32))
    got = np.asarray(got)
    np.testing.assert_array_equal(np.asarray(bad), [True, False])  # row 1's -inf lie past its 10 visible
    finite = np.where(np.isfinite(np.asarray(s[0])), np.asarray(s[0]), -np.inf)
    np.testing.assert_array_equal(got[0], np.argsort(-finite, kind="stable")[:12])
    assert not {3, 7, 9} & set(got[0].tolist())
    np.testing.assert_array_equal(got[1], np.r_[np.asarray(jax.lax.top_k(s[1, :10], 10)[1]), [-1, -1]])


def test_xla_scores_equal_float64(rng, filled):
    """impl="xla": sum_h w * relu(q . k) over the dequantized keys, -inf where not visible."""
    state = filled
    for step, T in _steps(state):
        q, w = _query(state, rng, T)
        got = np.asarray(H.index_scores(state, step, 1, q, w, impl="xla"))
        keys, _ = H.index_keys(state, step, 1)
        q64, k64 = np.asarray(q, np.float64), np.asarray(keys, np.float64)
        dots = np.einsum("bthd,bnd->bthn", q64, k64, optimize=True)  # BLAS, not einsum's loops
        want = np.einsum("bthn,bth->btn", np.maximum(dots, 0), np.asarray(w, np.float64), optimize=True)
        vis = (np.asarray(step.start)[:, None] + np.arange(T)[None, :] + 1) // 4
        mask = np.arange(want.shape[-1])[None, None, :] < vis[..., None]
        np.testing.assert_array_equal(np.isneginf(got), ~mask)
        np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5 * np.abs(want[mask]).max())


@pytest.fixture
def reference_kernel(monkeypatch):
    """The kernel path with the kernel replaced by its float32 reference: wiring on CPU."""
    monkeypatch.setattr(indexer, "score_kernel", ref_index_scores)
    monkeypatch.setattr(indexer, "index_scores_cuda", ref_index_scores)
    choose = indexer._backend.choose
    monkeypatch.setattr(
        indexer._backend,
        "choose",
        lambda op, impl, **ctx: impl if impl in ("pallas", "cuda") else choose(op, impl, **ctx),
    )


def _real(step, T, *arrays):
    """The rows of real tokens (padding rows' scores are meaningless)."""
    real = np.arange(T)[None, :] < np.asarray(step.num_tokens)[:, None]
    return [np.asarray(a)[real] for a in arrays]


def _assert_paths_agree(state, step, T, q, w, impl):
    """A kernel's scores (impl) and impl="xla"'s: -inf at the same entries, float32 sums in
    another order elsewhere (real rows); returns how many finite scores were compared."""
    got, want = _real(
        step, T, H.index_scores(state, step, 1, q, w, impl=impl), H.index_scores(state, step, 1, q, w, impl="xla")
    )
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5 * np.abs(want[fin]).max())
    return fin.sum()


@pytest.mark.parametrize("impl", ["pallas", "cuda"])
def test_kernel_path_equals_xla(rng, filled, reference_kernel, impl):
    state = filled
    for step, T in _steps(state):
        q, w = _query(state, rng, T)
        assert _assert_paths_agree(state, step, T, q, w, impl) > 100


def _assert_stacked_weights_are_the_array(state, step, q, w, impl):
    """Weights as a ``Stacked`` row (the middle of three) give the array's scores exactly."""
    want = H.index_scores(state, step, 1, q, w, impl=impl)
    got = H.index_scores(state, step, 1, q, H.Stacked(jnp.stack([-w, w, 2 * w]), 1), impl=impl)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("impl", ["xla", "pallas", "cuda"])
def test_stacked_weights(rng, filled, reference_kernel, impl):
    step, T = next(_steps(filled))
    _assert_stacked_weights_are_the_array(filled, step, *_query(filled, rng, T), impl)


@pytest.mark.gpu
@pytest.mark.skipif(not is_hopper(), reason="the kernels are written for Hopper (sm_90)")
@pytest.mark.parametrize("impl", ["pallas", "cuda"])
def test_kernel_equals_xla_on_gpu(rng, filled, impl):
    state = filled
    for step, T in _steps(state):
        q, w = _query(state, rng, T)
        _assert_paths_agree(state, step, T, q, w, impl)
        _assert_stacked_weights_are_the_array(state, step, q, w, impl)
        top, ref = _real(
            step,
            T,
            H.index_topk(state, step, 1, q, w, impl=impl)[1],
            H.index_topk(state, step, 1, q, w, impl="xla")[1],
        )
        np.testing.assert_array_equal(top < 0, ref < 0)
        assert (top == ref).mean() > 0.99  # the same entries, but for near-ties


@pytest.mark.gpu
def test_select_kernel_equals_xla(rng, filled):
    """select="cuda" (the radix-select kernel) picks exactly select="xla"'s entries, in order,
    on the same scores; -1 where fewer entries are visible than k."""
    state = filled
    for step, T in _steps(state):
        q, w = _query(state, rng, T)
        for k in (None, 200):
            got = H.index_topk(state, step, 1, q, w, k, impl="xla", select="cuda")[1]
            want = H.index_topk(state, step, 1, q, w, k, impl="xla", select="xla")[1]
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert (np.asarray(got) < 0).any()


def _assert_nonfinite_is_a_sticky_fault(state, rng, impl, select):
    for step, T in _steps(state):
        q, w = _query(state, rng, T)
        new, clean = H.index_topk(state, step, 1, q, w, impl=impl, select=select)
        np.testing.assert_array_equal(np.asarray(new.error), np.asarray(state.error))  # finite: no fault
        q_bad, w_bad = q.at[0, 0, 3, 5].set(jnp.nan), w.at[2, 0, 7].set(jnp.inf)
        new, idx = H.index_topk(state, step, 1, q_bad, w_bad, impl=impl, select=select)
        err = np.asarray(new.error) & ~np.asarray(state.error)
        assert err[0] & Fault.NONFINITE_SCORES and err[2] & Fault.NONFINITE_SCORES and not err[1], err
        idx = np.asarray(idx)
        assert (idx[0, 0] == -1).all()  # the NaN query's row
        np.testing.assert_array_equal(idx[1], np.asarray(clean)[1])
        for a, b in zip(jax.tree.leaves(new.replace(error=state.error)), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        with pytest.raises(jaxkv.CacheError, match="non-finite indexer scores"):
            jaxkv.check(new)


@pytest.mark.parametrize("select", ["xla", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_nonfinite_scores_are_a_sticky_fault(rng, filled, reference_kernel, impl, select):
    """A NaN in request 0's indexer query, an Inf in request 2's weights: those requests get
    NONFINITE_SCORES and request 1 nothing; no non-finite score is picked (request 0's first row
    picks none); the state is otherwise the same arrays' values. impl "cuda": the kernel path's
    own masks, with the kernel replaced by its reference (CPU). select "cuda": the top-k
    kernel records the fault itself."""
    _assert_nonfinite_is_a_sticky_fault(filled, rng, impl, select)


def test_recording_select_wiring(rng, filled, reference_kernel, monkeypatch):
    """select="cuda"'s path with its kernel replaced by ``ref_top_k_record`` (CPU): the
    request words it is handed are the step's slots' (the same checks as above)."""
    monkeypatch.setattr(indexer, "top_k_record", ref_top_k_record)
    _assert_nonfinite_is_a_sticky_fault(filled, rng, "xla", "cuda")


def test_bad_impl(rng, filled):
    state = filled
    step, T = next(_steps(state))
    q, w = _query(state, rng, T)
    with pytest.raises(ValueError, match="impl"):
        H.index_scores(state, step, 1, q, w, impl="triton-nope")
    with pytest.raises(ValueError, match="select: expected one of"):
        H.index_topk(state, step, 1, q, w, select="sort")
    if not is_hopper():
        with pytest.raises(ValueError, match="Hopper"):
            H.index_topk(state, step, 1, q, w, impl="pallas")
