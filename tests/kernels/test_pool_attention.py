"""kernels.pool_attention_pallas (Mosaic GPU, Hopper) and pool_attention_cuda (cuda/) against their float32
reference on fresh random pools."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv._backend import _flashmla_missing, _pool_cuda_missing, is_hopper
from jaxkv.formats.storage import STORAGES, pack_items
from jaxkv.kernels.pool_attention import (
    BLOCK,
    _decode_rows,
    pool_attention_cuda,
    pool_attention_flashmla,
    pool_attention_pallas,
    ref_partial,
    ref_pool_attention,
    row_scales,
    span_rows,
)
from jaxkv.math import merge_partials
from jaxkv.stacked import Stacked

hopper = pytest.mark.skipif(not is_hopper(), reason="the kernel is Mosaic GPU for Hopper (sm_90); no GPU here")
cuda = pytest.mark.skipif(_pool_cuda_missing() is not None, reason=f"the cuda/ kernel: {_pool_cuda_missing()}")
flashmla = pytest.mark.skipif(_flashmla_missing() is not None, reason=f"FlashMLA: {_flashmla_missing()}")


def _pool(rng, storage, blocks, bs):
    """u8[blocks, bs * E]: every slot a random entry encoded by the storage's codec."""
    codec = STORAGES[storage].entry
    x = jnp.asarray(rng.normal(size=(blocks * bs, 512)) * rng.uniform(0.1, 4, size=(blocks * bs, 1)), jnp.bfloat16)
    return jax.jit(lambda x: pack_items(codec.encode(x), bs, codec.segments))(x)


def _case(rng, storage, N, H, parts):
    """parts: (pool blocks, block size, key blocks) each. Rows random in range; nvalid ragged
    (full, partial and empty blocks; the last query row has no valid key at all)."""
    pools = tuple(_pool(rng, storage, nb, bs) for nb, bs, _ in parts)
    part_blocks = tuple(k for _, _, k in parts)
    rows = np.concatenate([rng.integers(0, nb * bs, size=(N, k * BLOCK)) for nb, bs, k in parts], axis=1)
    nvalid = rng.choice([0, 1, 17, 63, 64, 64], size=(N, sum(part_blocks)))
    nvalid[-1] = 0
    q = jnp.asarray(rng.normal(size=(N, H, 512)), jnp.bfloat16)
    sink = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    return q, pools, part_blocks, jnp.asarray(rows, jnp.int32), jnp.asarray(nvalid, jnp.int32), sink


@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_row_scales_rebuild_the_decoded_rows(rng, storage):
    """The scales the kernel multiplies by, times the FP8 codes, are the codec's decoded rows."""
    q, pools, pb, rows, nvalid, _ = _case(rng, storage, 3, 64, [(5, 64, 2), (4, 8, 1)])
    dec = jax.jit(_decode_rows, static_argnums=(1, 3))(pools, pb, rows, storage).astype(jnp.float32)  # [N, K, 512]
    scales = jax.jit(row_scales, static_argnums=(1, 3))(pools, pb, rows, storage)  # [N, NB * 8, 64]
    N, K = rows.shape
    s = scales.reshape(N, -1, 8, BLOCK).transpose(0, 1, 3, 2).reshape(N, K, 8)
    assert bool(jnp.all(s[..., 7] == 1)) and bool(jnp.all(s > 0))
    codes = dec[..., :448].reshape(N, K, 7, 64) / s[..., :7, None]  # exact: scales are what the codec used
    recoded = (codes.astype(jnp.float8_e4m3fn).astype(jnp.float32) * s[..., :7, None]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(recoded.reshape(N, K, 448), np.float32), np.asarray(dec[..., :448]))


def _span_case(rng, storage, H=64):
    """Three parts whose ids count from a span of their pool: part 0 blocks 2 .. 5 of 9, part
    1 blocks 1 .. 2 of 4, part 2 the whole pool; some ids past the span (masked), some -1.
    Also the same rows as ids of the whole pools (what the spans mean)."""
    q, pools, pb, rows, nvalid, sink = _case(rng, storage, 5, H, [(9, 64, 3), (4, 128, 2), (2, 32, 1)])
    spans = ((2, 3), (1, 1), (0, 2))
    bounds, cols, local = [0, 3, 5, 6], [], []
    for p, (first, count) in enumerate(spans):
        bs = pools[p].shape[1] // STORAGES[storage].entry_bytes
        ids = rng.integers(-1, count * bs + bs // 2, size=(rows.shape[0], (bounds[p + 1] - bounds[p]) * BLOCK))
        local.append(ids)
        cols.append(np.where((ids >= 0) & (ids < count * bs), ids + first * bs, -1))
    local, whole = (jnp.asarray(np.concatenate(c, axis=1), jnp.int32) for c in (local, cols))
    return q, pools, pb, local, whole, nvalid, sink, spans


@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_spans_are_windows_of_the_pools(rng, storage):
    q, pools, pb, local, whole, nvalid, sink, spans = _span_case(rng, storage)
    np.testing.assert_array_equal(np.asarray(span_rows(pools, pb, local, spans, storage)), np.asarray(whole))
    got = ref_pool_attention(q, pools, pb, local, nvalid, sink, storage=storage, spans=spans)
    want = ref_pool_attention(q, pools, pb, whole, nvalid, sink, storage=storage)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.max(jnp.abs(want[:-1]))) > 0.01
    with pytest.raises(ValueError, match=r"spans: expected one \(first, count\) per pool"):
        pool_attention_cuda(q, pools, pb, local, nvalid, sink, storage=storage, spans=((2, 8), (1, 1), (0, 2)))


def test_reference_sink_and_empty_rows(rng):
    q, pools, pb, rows, nvalid, sink = _case(rng, "official", 4, 64, [(6, 64, 2)])
    out = ref_pool_attention(q, pools, pb, rows, nvalid, sink)
    assert bool(jnp.all(out[-1] == 0))  # no valid key: zeros, whatever the sink
    big = ref_pool_attention(q, pools, pb, rows, nvalid, jnp.full((64,), 1e4, jnp.float32))
    assert float(jnp.max(jnp.abs(big))) < 1e-6  # a dominant sink takes all the weight
    assert float(jnp.max(jnp.abs(out[:-1]))) > 0.01


def test_partials_merge_into_the_reference(rng):
    """``ref_partial`` per part, merged by log-sum-exp with the sink (what the FlashMLA
    lowering does with FlashMLA's two pools and the own-token part), equals the reference
    over all parts at once; a part with no valid key has lse -inf."""
    q, pools, pb, rows, nvalid, sink = _case(rng, "official", 5, 64, [(6, 64, 2), (3, 128, 1), (2, 32, 1)])
    nvalid = nvalid.at[0, 2:].set(0)  # row 0: its second and third parts are empty
    bounds = np.cumsum((0,) + pb)
    outs, lses = zip(
        *(
            ref_partial(
                q,
                pools[p : p + 1],
                pb[p : p + 1],
                rows[:, bounds[p] * BLOCK : bounds[p + 1] * BLOCK],
                nvalid[:, bounds[p] : bounds[p + 1]],
            )
            for p in range(3)
        )
    )
    assert bool(jnp.all(lses[1][0] == -jnp.inf)) and bool(jnp.all(jnp.isfinite(lses[0][:-1])))
    merged = merge_partials(jnp.stack(outs, 1)[:, :, None], jnp.stack(lses, 1)[:, :, None], sink=sink)[:, 0]
    ref = ref_pool_attention(q, pools, pb, rows, nvalid, sink)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(ref), rtol=1e-5, atol=1e-5)  # f32 rounding
    assert float(jnp.max(jnp.abs(ref[:-1]))) > 0.01


def test_bad_inputs(rng):
    q, pools, pb, rows, nvalid, sink = _case(rng, "official", 2, 64, [(4, 64, 1)])
    with pytest.raises(ValueError, match="q: expected bf16"):
        pool_attention_pallas(q.astype(jnp.float32), pools, pb, rows, nvalid, sink)
    with pytest.raises(ValueError, match="q: expected bf16"):
        pool_attention_pallas(q[:, :48], pools, pb, rows, nvalid, sink[:48])
    with pytest.raises(ValueError, match="rows: expected int32"):
        pool_attention_pallas(q, pools, pb, rows[:, :32], nvalid, sink)
    with pytest.raises(ValueError, match="nvalid: expected int32"):
        pool_attention_pallas(q, pools, pb, rows, nvalid[:, :0], sink)
    with pytest.raises(ValueError, match="sink: expected"):
        pool_attention_pallas(q, pools, pb, rows, nvalid, sink[:8])
    with pytest.raises(ValueError, match=r"pools\[0\]: expected u8"):
        pool_attention_pallas(q, (pools[0][:, :100],), pb, rows, nvalid, sink)
    with pytest.raises(ValueError, match="storage: the kernel reads the official"):
        pool_attention_pallas(q, pools, pb, rows, nvalid, sink, storage="per_entry")
    # the cuda/ kernel's checks run before it looks for a GPU
    with pytest.raises(ValueError, match="q: expected bf16"):
        pool_attention_cuda(q.astype(jnp.float32), pools, pb, rows, nvalid, sink)
    with pytest.raises(ValueError, match="pools: the cuda/ kernel reads at most 3"):
        pool_attention_cuda(q, pools * 4, pb * 4, jnp.tile(rows, (1, 4)), jnp.tile(nvalid, (1, 4)), sink)
    with pytest.raises(ValueError, match="storage: expected one of"):
        pool_attention_cuda(q, pools, pb, rows, nvalid, sink, storage="fp8")
    # FlashMLA's: before it looks for its source tree
    with pytest.raises(ValueError, match="FlashMLA's MODEL1 decode expects official storage"):
        pool_attention_flashmla(q, pools, pb, rows, nvalid, sink, storage="per_entry")
    q3, sink3 = jnp.concatenate([q] * 3, axis=1), jnp.concatenate([sink] * 3)
    with pytest.raises(ValueError, match=r"\(64, 128\) heads, got 'official' and q bfloat16\[2, 192, 512\]"):
        pool_attention_flashmla(q3, pools, pb, rows, nvalid, sink3)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("H,splits", [(64, 1), (128, 3)])
def test_kernel_matches_reference(rng, H, splits):
    storage = "official"  # per_entry is refused (test_bad_inputs)
    # three parts as a V4 layer has them: compressed entries (64-slot blocks), a ring, own tokens
    q, pools, pb, rows, nvalid, sink = _case(rng, storage, 5, H, [(9, 64, 3), (4, 128, 2), (2, 32, 1)])
    ref = ref_pool_attention(q, pools, pb, rows, nvalid, sink)
    out = pool_attention_pallas(q, pools, pb, rows, nvalid, sink, storage=storage, splits=splits)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    assert err <= 2e-2 * float(jnp.max(jnp.abs(ref))) + 1e-3, err
    again = pool_attention_pallas(q, pools, pb, rows, nvalid, sink, storage=storage, splits=splits)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))  # deterministic


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("H,splits", [(64, 1), (64, 2), (64, 8), (128, 1), (128, 3)])
def test_cuda_kernel_matches_reference(rng, storage, H, splits):
    """Three parts as a V4 layer has them, ragged counts (full, partial, empty blocks; a query
    with no key), ids past the counts out of range (odd rows) or in range (even rows: real
    rows the kernel must not attend to), a first block empty (row 0) and every block full
    (row 1), more splits than some queries have blocks. Error bound: P and the output round to bf16 (8
    bits), so |err| <= 2e-2 max|ref| + 1e-3."""
    q, pools, pb, rows, nvalid, sink = _case(rng, storage, 7, H, [(9, 64, 3), (4, 128, 2), (2, 32, 1)])
    nvalid = nvalid.at[0, 0].set(0).at[1].set(BLOCK)
    past = jnp.arange(rows.shape[1])[None] % BLOCK >= jnp.repeat(nvalid, BLOCK, axis=1)
    rows = jnp.where(past & (jnp.arange(rows.shape[0]) % 2 == 1)[:, None], 1 << 30, rows)
    ref = ref_pool_attention(q, pools, pb, jnp.where(rows < (1 << 30), rows, 0), nvalid, sink, storage=storage)
    out = pool_attention_cuda(q, pools, pb, rows, nvalid, sink, storage=storage, splits=splits)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    assert err <= 2e-2 * float(jnp.max(jnp.abs(ref))) + 1e-3, err
    assert bool(jnp.all(out[-1] == 0))  # no valid key
    again = pool_attention_cuda(q, pools, pb, rows, nvalid, sink, storage=storage, splits=splits)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))  # deterministic
    # q and sink as Stacked rows (the last of two), read in place: the same bits
    q2, s2 = Stacked(jnp.stack([-q, q]), 1), Stacked(jnp.stack([sink + 1.0, sink]), 1)
    stacked = pool_attention_cuda(q2, pools, pb, rows, nvalid, s2, storage=storage, splits=splits)
    np.testing.assert_array_equal(np.asarray(stacked, np.float32), np.asarray(out, np.float32))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_cuda_kernel_sink_extremes(rng, splits):
    """The sink where the kernel adds it (one split, or two merged in the kernel at 64 heads)
    and where XLA does (3): a sink far above every score takes all the weight, one of -inf
    none; both against the reference."""
    q, pools, pb, rows, nvalid, _ = _case(rng, "official", 4, 64, [(9, 64, 3), (4, 128, 2)])
    for sink in (jnp.full((64,), 1e4, jnp.float32), jnp.full((64,), -jnp.inf, jnp.float32)):
        ref = ref_pool_attention(q, pools, pb, rows, nvalid, sink)
        out = pool_attention_cuda(q, pools, pb, rows, nvalid, sink, splits=splits).astype(jnp.float32)
        assert bool(jnp.all(jnp.isfinite(out)))
        err = float(jnp.max(jnp.abs(out - ref)))
        assert err <= 2e-2 * float(jnp.max(jnp.abs(ref))) + 1e-3, (float(sink[0]), err)
    assert float(jnp.max(jnp.abs(ref[:-1]))) > 0.01  # -inf: the keys alone


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("splits", [1, 2])
def test_cuda_kernel_decodes_rows_exactly(rng, storage, splits):
    """One valid key per query and no sink: the output is that key's row (softmax weight 1,
    P V exact in float32), so it must equal the codec's decoded row bit for bit. Rows scaled
    by 2^-100 .. 2^100 spread the scales (official: 2^-13 .. 2^94 with the encoder's floor);
    q is scaled by 2^-110 so that the scores stay small."""
    codec, N = STORAGES[storage].entry, 15
    x = rng.normal(size=(N * 64, 512)) * np.exp2(rng.choice(np.arange(-100, 101, 20), size=(N * 64, 1)))
    pools = (jax.jit(lambda x: pack_items(codec.encode(x), 64, codec.segments))(jnp.asarray(x, jnp.bfloat16)),)
    rows = jnp.asarray(rng.integers(0, N * 64, size=(N, 2 * BLOCK)), jnp.int32)
    nvalid = jnp.asarray(np.tile([[1, 0]], (N, 1)), jnp.int32)
    q = jnp.asarray(rng.normal(size=(N, 64, 512)) * 2.0**-110, jnp.bfloat16)
    out = pool_attention_cuda(
        q, pools, (2,), rows, nvalid, jnp.full((64,), -jnp.inf, jnp.float32), storage=storage, splits=splits
    )
    dec = _decode_rows(pools, (2,), rows[:, :1], storage)  # bf16[N, 1, 512]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.broadcast_to(np.asarray(dec, np.float32), out.shape))


@pytest.mark.gpu
@flashmla
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("parts", [[(9, 64, 3), (4, 128, 2), (2, 32, 1)], [(9, 64, 3), (4, 128, 2)], [(4, 128, 2)]])
def test_flashmla_matches_reference(rng, H, parts):
    """FlashMLA's kernel through jax.ffi (its cache and extra cache: parts 0 and 1; a third
    part by XLA), on the same bytes: ragged counts, out-of-range ids past the counts (sent as
    -1), a query with no key. Same bound as the cuda/ kernel (bf16 P and output)."""
    q, pools, pb, rows, nvalid, sink = _case(rng, "official", 7, H, parts)
    rows = jnp.where(jnp.arange(rows.shape[1])[None] % BLOCK >= jnp.repeat(nvalid, BLOCK, axis=1), 1 << 30, rows)
    ref = ref_pool_attention(q, pools, pb, jnp.where(rows < (1 << 30), rows, 0), nvalid, sink)
    out = pool_attention_flashmla(q, pools, pb, rows, nvalid, sink)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    assert err <= 2e-2 * float(jnp.max(jnp.abs(ref))) + 1e-3, err
    assert bool(jnp.all(out[-1] == 0))  # no valid key
    again = pool_attention_flashmla(q, pools, pb, rows, nvalid, sink)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))  # deterministic


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("splits", [1, 2])
def test_cuda_kernel_reads_spans(rng, storage, splits):
    """Ids counted from each part's span, those past it masked: the kernel's output is the
    same as with the whole pools' ids, bit for bit."""
    q, pools, pb, local, whole, nvalid, sink, spans = _span_case(rng, storage)
    got = pool_attention_cuda(q, pools, pb, local, nvalid, sink, storage=storage, splits=splits, spans=spans)
    want = pool_attention_cuda(q, pools, pb, whole, nvalid, sink, storage=storage, splits=splits)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0.01
