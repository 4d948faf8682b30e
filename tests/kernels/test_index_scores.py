"""kernels.index_scores (Mosaic GPU) and kernels.index_scores_cuda (cuda/), Hopper, against
their float32 reference on fresh random pools."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv._backend import is_hopper
from jaxkv.formats.fp4 import e2m1_decode, unpack_nibbles
from jaxkv.formats.storage import STORAGES, pack_items, segment_offsets
from jaxkv.kernels.index_scores import group_multipliers, index_scores, index_scores_cuda, ref_index_scores

hopper = pytest.mark.skipif(not is_hopper(), reason="the kernels are written for Hopper (sm_90); no such GPU here")
KERNELS = {"pallas": index_scores, "cuda": index_scores_cuda}


def _case(rng, storage, *, B=3, T=1, H=64, bs=64, pages=3, layers=2, counts=None):
    """A pool of random keys (each layer's pages shuffled over the pool), queries, weights,
    page tables and ragged counts (empty, partial tile, whole pages)."""
    codec = STORAGES[storage].index_key(128)
    P = B * pages + 3
    x = rng.normal(size=(layers * P * bs, 128)) * rng.uniform(0.05, 8, size=(layers * P * bs, 1))
    pool = jax.jit(lambda x: pack_items(codec.encode(x), bs, codec.segments))(jnp.asarray(x, jnp.float32))
    pool = pool.reshape(layers, P, -1)
    q = jnp.asarray(rng.normal(size=(B * T, H, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(B * T, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[: B * pages].reshape(B, pages), jnp.int32)
    if counts is None:
        full = pages * bs
        counts = rng.choice([0, 1, 63, 64, 65, bs + 7, full - 1, full], size=B * T)
    return q, w, pool, table, jnp.asarray(counts, jnp.int32)


@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_multipliers_rebuild_the_decoded_keys(rng, storage):
    """The kernel's inputs (E2M1 codes of each page's code slab, times the per-group
    multipliers) are the codec's decoded keys bit for bit."""
    q, w, pool, table, count = _case(rng, storage, bs=128, pages=2)
    codec = STORAGES[storage].index_key(128)
    bs = pool.shape[2] // codec.bytes
    B, NP = table.shape
    mult = group_multipliers(pool, 1, table, storage=storage)  # [B, G, NP * bs]
    G = mult.shape[1]
    codes = pool[1, table, : bs * 64].reshape(B, NP * bs, 64)
    vals = e2m1_decode(unpack_nibbles(codes))  # [B, K, 128]
    keys = (vals.reshape(B, NP * bs, G, -1) * mult.transpose(0, 2, 1)[..., None]).reshape(B, NP * bs, 128)
    segs = [
        pool[1, table, o : o + z * bs].reshape(B, NP * bs, z)
        for o, z in zip(segment_offsets(codec.segments, bs), codec.segments)
    ]
    want = codec.decode(jnp.concatenate(segs, axis=-1)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(keys.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(want))


def test_reference_masks_past_count(rng):
    q, w, pool, table, count = _case(rng, "official", counts=[0, 70, 192])
    s = np.asarray(ref_index_scores(q, w, pool, 0, table, count))
    assert np.all(np.isneginf(s[0]))
    assert np.all(np.isfinite(s[1, :70])) and np.all(np.isneginf(s[1, 70:]))
    assert np.all(np.isfinite(s[2])) and np.std(s[2]) > 1.0


def test_bad_inputs(rng):
    q, w, pool, table, count = _case(rng, "official")
    with pytest.raises(ValueError, match="q: expected bf16"):
        ref_index_scores(q.astype(jnp.float32), w, pool, 0, table, count)
    with pytest.raises(ValueError, match="q: expected bf16"):
        ref_index_scores(q[:, :32], w[:, :32], pool, 0, table, count)
    with pytest.raises(ValueError, match="weights: expected"):
        ref_index_scores(q, w[:, :8], pool, 0, table, count)
    with pytest.raises(ValueError, match="pool: expected"):
        ref_index_scores(q, w, pool[..., :-68], 0, table, count)
    with pytest.raises(ValueError, match="layer: expected"):
        ref_index_scores(q, w, pool, 2, table, count)
    with pytest.raises(ValueError, match="pages: expected"):
        ref_index_scores(q, w, pool, 0, table[:2], count)
    with pytest.raises(ValueError, match="count: expected"):
        ref_index_scores(q, w, pool, 0, table, count[:2])
    with pytest.raises(ValueError, match="storage: expected"):
        ref_index_scores(q, w, pool, 0, table, count, storage="seed-nope")
    q3, w3 = jnp.concatenate([q] * 3, axis=1), jnp.concatenate([w] * 3, axis=1)
    with pytest.raises(ValueError, match="q: expected 64 or 128 heads for the CUDA kernel, got 192"):
        index_scores_cuda(q3, w3, pool, 0, table, count)  # refused at trace time, before any build


def _assert_close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    scale = np.abs(want[fin]).max()
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5 * scale)  # f32 sums, another order


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("T,H,bs", [(1, 64, 64), (2, 128, 128)])
def test_kernel_equals_reference(rng, kernel, storage, T, H, bs):
    q, w, pool, table, count = _case(rng, storage, B=5, T=T, H=H, bs=bs, pages=4)
    got = KERNELS[kernel](q, w, pool, 1, table, count, storage=storage)
    _assert_close(got, ref_index_scores(q, w, pool, 1, table, count, storage=storage))
    again = KERNELS[kernel](q, w, pool, 1, table, count, storage=storage)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))  # run to run: bit for bit


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_long_rows(rng, kernel):
    """Many tiles per row: several programs per row, pages shuffled over a large pool."""
    q, w, pool, table, count = _case(rng, "official", B=4, pages=40, counts=[2560, 1, 1000, 2559])
    _assert_close(KERNELS[kernel](q, w, pool, 0, table, count), ref_index_scores(q, w, pool, 0, table, count))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_cuda_kernel_pages_outside_the_pool(rng, storage):
    """A page table entry outside the pool (-1, or past its pages) masks that page's entries
    (-inf) and is never read; the entries around it score as the reference does."""
    q, w, pool, table, count = _case(rng, storage, B=3, pages=4, counts=[256, 200, 130])
    table = table.at[0, 1].set(-1).at[1, 3].set(pool.shape[1] + 5).at[2, 0].set(-7)
    got = np.asarray(index_scores_cuda(q, w, pool, 0, table, count, storage=storage))
    want = np.asarray(ref_index_scores(q, w, pool, 0, table, count, storage=storage))
    assert np.all(np.isneginf(got[0, 64:128])) and np.all(np.isneginf(got[2, :64]))
    _assert_close(got, want)
