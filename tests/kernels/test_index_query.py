"""kernels.index_query_cuda (jaxkv/cuda/index_query.cu) against its jnp reference on a GPU,
through hybrid.index_query too; the validators and the reference everywhere."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import hybrid as H
from jaxkv.formats.storage import STORAGES
from jaxkv.kernels import index_query_cuda, ref_index_query
from jaxkv.math.rotation import hadamard


def _queries(rng, shape):
    """Normal rows at magnitudes from 1e-6 to 1e4 (one per row), so scales span the range."""
    x = rng.normal(size=shape) * rng.choice([1e-6, 1e-3, 1.0, 50.0, 1e4], size=(*shape[:-1], 1))
    return jnp.asarray(x, jnp.bfloat16)


def test_reference_is_the_codec_round_trip(rng):
    """The reference: the Hadamard rotation rounded to bf16, through each storage's index-key codec."""
    q = _queries(rng, (3, 4, 128))
    for storage in STORAGES:
        codec = STORAGES[storage].index_key(128)
        want = codec.decode(codec.encode(hadamard(q).astype(jnp.bfloat16)))
        got = ref_index_query(q, storage)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        # FP4 keeps about one significant bit: near the rotation, not equal to it (rows below
        # MXFP4's amax floor round to zero, so the median row is the check)
        rot = np.asarray(hadamard(q), np.float32)
        err = np.abs(np.asarray(got, np.float32) - rot).max(-1) / np.abs(rot).max(-1)
        assert 0 < np.median(err) < 0.5


def test_bad_inputs():
    q = jnp.ones((2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="storage: expected one of"):
        ref_index_query(q, "fp8")
    with pytest.raises(ValueError, match=r"q: expected bf16\[..., d\] with d a power of two"):
        index_query_cuda(q.astype(jnp.float32), "official")
    with pytest.raises(ValueError, match=r"q: expected float\[..., d\] with d a power of two"):
        ref_index_query(jnp.ones((2, 96), jnp.bfloat16), "official")
    st = H.init(H.HybridConfig(compress_ratios=(4,), max_requests=2, max_context=64, block_size=16))
    with pytest.raises(ValueError, match=r"q: expected bf16\[..., 128\]"):
        H.index_query(st, jnp.ones((2, 1, 4, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="impl: expected one of"):
        H.index_query(st, jnp.ones((2, 1, 4, 128), jnp.bfloat16), impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("storage", sorted(STORAGES))
@pytest.mark.parametrize("shape", [(2, 3, 5, 128), (7, 64), (33, 256), (4, 32)])
def test_kernel_equals_reference(rng, storage, shape):
    """Bit for bit, at every magnitude, with an all-zero row and rows holding NaN and Inf."""
    q = np.asarray(_queries(rng, shape), np.float32)
    flat = q.reshape(-1, shape[-1])
    flat[0] = 0.0
    if flat.shape[0] > 2:
        flat[1, 3] = np.nan
        flat[2, -1] = np.inf
    q = jnp.asarray(q, jnp.bfloat16)
    got = np.asarray(index_query_cuda(q, storage), np.float32)
    want = np.asarray(ref_index_query(q, storage), np.float32)
    np.testing.assert_array_equal(got, want)
    assert got.shape == q.shape and np.nanmax(np.abs(got)) > 0  # the NaN rows aside, not all zero
    # a Stacked row is read in place: the middle of three
    stack = jnp.stack([-q, q, 2 * q])
    np.testing.assert_array_equal(np.asarray(index_query_cuda(H.Stacked(stack, 1), storage), np.float32), want)


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_reference_reads_a_stacked_row(rng, storage):
    q = _queries(rng, (2, 1, 4, 128))
    stack = jnp.stack([q, -q])
    want = np.asarray(ref_index_query(-q, storage), np.float32)
    np.testing.assert_array_equal(np.asarray(ref_index_query(H.Stacked(stack, 1), storage), np.float32), want)
    st = H.init(H.HybridConfig(compress_ratios=(4,), max_requests=2, max_context=64, block_size=16, storage=storage))
    got = H.index_query(st, H.Stacked(stack, 1), impl="xla")
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_index_query_picks_the_kernel(rng, storage):
    """hybrid.index_query: impl="cuda" and "xla" agree exactly; float32 queries go to xla on auto."""
    c = H.HybridConfig(compress_ratios=(4,), max_requests=2, max_context=64, block_size=16, storage=storage)
    st = H.init(c)
    q = _queries(rng, (2, 3, 5, 128))
    got = H.index_query(st, q, impl="cuda")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(H.index_query(st, q, impl="xla"), np.float32))
    q32 = q.astype(jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(H.index_query(st, q32), np.float32), np.asarray(ref_index_query(q32, storage), np.float32)
    )
    with pytest.raises(ValueError, match="impl='cuda' for hybrid.index_query: expected bfloat16 queries"):
        H.index_query(st, q32, impl="cuda")
