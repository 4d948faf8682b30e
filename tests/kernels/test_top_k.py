"""kernels.top_k (jaxkv/cuda/top_k.cu, a radix select) against kernels.ref_top_k, and the
reference against numpy's stable argsort: random rows, heavy ties, signed zeros, NaN / Inf,
rows with fewer finite scores than k, rows held in shared memory and rows read from HBM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import _backend
from jaxkv.errors import Fault
from jaxkv.kernels.top_k import MAX_K, ref_top_k, ref_top_k_record, top_k, top_k_record


def _numpy_top_k(s, k):
    """The meaning, independently: non-finite never picked, -0.0 == +0.0, ties to the lower
    index, best first, -1 past the finite scores."""
    s = np.where(np.isfinite(s), s, -np.inf).astype(np.float64) + 0.0
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    return np.where(np.take_along_axis(s, order, -1) > -np.inf, order, -1)


def _rows(rng, kind, shape):
    if kind == "normal":
        return rng.normal(size=shape).astype(np.float32)
    if kind == "ties":  # a handful of values: most keys equal the k-th
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    if kind == "relu":  # weighted ReLU sums: many exact zeros of either sign, few positives
        x = np.maximum(rng.normal(size=shape) - 2.0, 0.0) * rng.choice([-1.0, 1.0], size=shape)
        return np.where(rng.random(shape) < 0.5, -0.0, x).astype(np.float32)
    if kind == "nonfinite":  # NaN / +-Inf sprinkled, one row mostly -inf (fewer finite than k)
        x = rng.normal(size=shape).astype(np.float32)
        bad = rng.random(shape)
        x[bad < 0.02] = np.nan
        x[(bad >= 0.02) & (bad < 0.04)] = np.inf
        x[(bad >= 0.04) & (bad < 0.06)] = -np.inf
        x[0, 5:] = -np.inf
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "ties", "relu", "nonfinite"])
def test_reference_is_the_stated_rule(rng, kind):
    s = _rows(rng, kind, (4, 300))
    for k in (1, 17, 300):
        np.testing.assert_array_equal(np.asarray(ref_top_k(jnp.asarray(s), k)), _numpy_top_k(s, k))


def _visible(rng, s):
    """Per row a visible count; one row's first non-finite score just inside it, one's just
    outside (its check must not see it), one row with none visible."""
    rows, n = s.shape
    vis = rng.integers(0, n + 1, size=rows).astype(np.int32)
    bad = ~np.isfinite(s)
    for r in range(rows):
        if bad[r].any():
            first = int(np.argmax(bad[r]))
            vis[r] = first + 1 if r % 3 == 0 else first if r % 3 == 1 else 0
    return vis


def test_reference_flags_nonfinite_visible_scores(rng):
    s = _rows(rng, "nonfinite", (9, 300))
    vis = _visible(rng, s)
    idx, bad = ref_top_k(jnp.asarray(s), 17, jnp.asarray(vis))
    np.testing.assert_array_equal(np.asarray(idx), _numpy_top_k(s, 17))
    want = np.array([(~np.isfinite(s[r, : vis[r]])).any() for r in range(len(s))])
    np.testing.assert_array_equal(np.asarray(bad), want)
    assert want.any() and not want.all()


def _record_case(rng, B=6, T=3, n=300):
    """Scores of B requests x T rows with NaN / Inf here and there, their visible counts,
    error words with other bits already set, and slots: two out of range (-1 and past the
    words) and the rest a permutation of some words."""
    s = _rows(rng, "nonfinite", (B * T, n))
    vis = _visible(rng, s).reshape(B, T)
    error = rng.integers(0, 2**32, size=B + 3, dtype=np.uint64).astype(np.uint32)
    error &= ~np.uint32(int(Fault.NONFINITE_SCORES))
    slot = rng.permutation(B + 3)[:B].astype(np.int32)
    slot[1], slot[4] = -1, B + 3
    return s.reshape(B, T, n), vis, error, slot


def test_reference_records_into_the_request_words(rng):
    s, vis, error, slot = _record_case(rng)
    idx, got = ref_top_k_record(
        jnp.asarray(s), 17, jnp.asarray(vis), jnp.asarray(error), jnp.asarray(slot), Fault.NONFINITE_SCORES
    )
    np.testing.assert_array_equal(
        np.asarray(idx), _numpy_top_k(s.reshape(-1, s.shape[-1]), 17).reshape(*s.shape[:2], 17)
    )
    want = error.copy()
    for b in range(len(slot)):
        bad = any((~np.isfinite(s[b, t, : vis[b, t]])).any() for t in range(s.shape[1]))
        if bad and 0 <= slot[b] < len(error):
            want[slot[b]] |= np.uint32(int(Fault.NONFINITE_SCORES))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (want != error).any() and (want == error).any()  # some words recorded, some not


def test_bad_arguments():
    s = jnp.zeros((2, 4096), jnp.float32)
    with pytest.raises(ValueError, match="k: expected at most"):
        top_k(s, MAX_K + 1)
    with pytest.raises(ValueError, match="k: expected 1 <= k <= 4096"):
        ref_top_k(s, 4097)
    with pytest.raises(ValueError, match="scores: expected f32"):
        top_k(s.astype(jnp.bfloat16), 4)
    with pytest.raises(ValueError, match=r"visible: expected int\[2\], got float32\[2\]"):
        top_k(s, 4, jnp.zeros(2, jnp.float32))
    with pytest.raises(ValueError, match=r"visible: expected int\[2\], got int32\[3\]"):
        ref_top_k(s, 4, jnp.zeros(3, jnp.int32))
    seen, words = jnp.zeros(2, jnp.int32), jnp.zeros(5, jnp.uint32)
    with pytest.raises(ValueError, match=r"error: expected u32\[words\], got int32\[5\]"):
        top_k_record(s, 4, seen, words.astype(jnp.int32), jnp.zeros(2, jnp.int32), Fault.NONFINITE_SCORES)
    with pytest.raises(ValueError, match=r"slot: expected int32\[2\] \(one per request\), got int32\[3\]"):
        ref_top_k_record(s, 4, seen, words, jnp.zeros(3, jnp.int32), Fault.NONFINITE_SCORES)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="select='cuda'"):
            _backend.choose("hybrid.index_topk", "cuda", top_k=512, max_top_k=MAX_K)
    with pytest.raises(ValueError, match="select='cuda'.*top_k at most 2048"):
        _backend.choose("hybrid.index_topk", "cuda", top_k=4096, max_top_k=MAX_K)
    assert _backend.choose("hybrid.index_topk", "auto", top_k=4096, max_top_k=MAX_K) == "xla"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "relu", "nonfinite"])
@pytest.mark.parametrize(
    "rows, n, ks",
    [
        (3, 100, (1, 7, 100)),
        (5, 1001, (64, 512, 1001)),  # n not a multiple of 4
        (64, 16384, (512, 2048)),  # V4-Flash at 64K context: the row in shared memory
        (2, 70001, (1, 1024)),  # too long for shared memory: every pass reads HBM
    ],
)
def test_kernel_equals_reference(rng, kind, rows, n, ks):
    raw = _rows(rng, kind, (rows, n))
    s, vis = jnp.asarray(raw), jnp.asarray(_visible(rng, raw))
    for k in ks:
        got = np.asarray(jax.jit(top_k, static_argnums=1)(s, k))
        np.testing.assert_array_equal(got, np.asarray(ref_top_k(s, k)), err_msg=f"k={k}")
        idx, bad = jax.jit(top_k, static_argnums=1)(s, k, vis)  # the picks do not move; the flags are the rule's
        want_idx, want_bad = ref_top_k(s, k, vis)
        np.testing.assert_array_equal(np.asarray(idx), got, err_msg=f"k={k}")
        np.testing.assert_array_equal(np.asarray(bad), np.asarray(want_bad), err_msg=f"k={k}")


@pytest.mark.gpu
def test_kernel_batch_axes_and_determinism(rng):
    s = jnp.asarray(_rows(rng, "ties", (2, 3, 5000)))
    got = np.asarray(top_k(s, 300))
    assert got.shape == (2, 3, 300)
    np.testing.assert_array_equal(got, np.asarray(ref_top_k(s, 300)))
    np.testing.assert_array_equal(got, np.asarray(top_k(s, 300)))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3])
def test_record_kernel_equals_reference(rng, T):
    """Picks and error words bit for bit: the fault in the words of the requests with a NaN /
    Inf among a row's visible scores, other bits kept, out-of-range slots recording nothing."""
    s, vis, error, slot = (jnp.asarray(a) for a in _record_case(rng, T=T))
    args = (s, 17, vis, error, slot, Fault.NONFINITE_SCORES)
    (idx, got), (ref_idx, want) = top_k_record(*args), ref_top_k_record(*args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(want) != np.asarray(error)).any()
