"""kernels.ref_entry_rows / entry_rows_cuda: a CSA layer's picks as pool attention's row list,
against a numpy model written from the rule, bit for bit, on random picks and tables with
every kind of miss (none, not yet visible, unallocated block, block past the pool, slot past
the table, a hole before the last valid pick)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import entry_rows_cuda, ref_entry_rows

IMPLS = [pytest.param(ref_entry_rows, id="xla"), pytest.param(entry_rows_cuda, id="cuda", marks=pytest.mark.gpu)]


def _model(entry, table, slot, limit, rest, rest_valid, block_size, pool_blocks):
    N, k = entry.shape
    T = N // slot.shape[0]
    K = -(-k // 64) * 64
    rows = np.full((N, K), -1, np.int32)
    counts = np.zeros((N, K // 64), np.int32)
    for n in range(N):
        s = min(max(int(slot[n // T]), 0), table.shape[0] - 1)
        last = 0
        for j in range(k):
            e = int(entry[n, j])
            if not 0 <= e < limit[n]:
                continue
            blk = int(table[s, min(e // block_size, table.shape[1] - 1)])
            if 0 <= blk < pool_blocks:
                rows[n, j] = blk * block_size + e % block_size
                last = j + 1
        counts[n] = np.clip(last - 64 * np.arange(K // 64), 0, 64)
    return np.concatenate([rows, rest], 1), np.concatenate([counts, rest_valid], 1)


def _inputs(rng, B, T, k, C, *, block_size=64, R=6, MB=9, pool_blocks=20):
    N = B * T
    table = rng.integers(-1, pool_blocks + 3, size=(R, MB), dtype=np.int32)  # -1, in the pool, past it
    slot = rng.integers(0, R, size=B).astype(np.int32)
    slot[0] = R + 2  # past the table: clamped into it
    limit = rng.integers(0, MB * block_size + 50, size=N).astype(np.int32)
    entry = rng.integers(-3, MB * block_size + 80, size=(N, k)).astype(np.int32)
    entry[:, k // 2 :] = np.where(rng.random((N, k - k // 2)) < 0.5, -1, entry[:, k // 2 :])  # -1 tails, holes
    rest = rng.integers(-1, 10_000, size=(N, C)).astype(np.int32)
    rest_valid = rng.integers(0, 65, size=(N, C // 64)).astype(np.int32)
    return (entry, table, slot, limit, rest, rest_valid), dict(block_size=block_size, pool_blocks=pool_blocks)


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("B,T,k,C", [(3, 1, 512, 192), (2, 5, 100, 128), (4, 2, 64, 0), (1, 3, 0, 64)])
def test_rows_match_the_model(rng, fn, B, T, k, C):
    args, kw = _inputs(rng, B, T, k, C)
    want = _model(*args, **kw)
    got = jax.jit(lambda *a: fn(*a, **kw))(*(jnp.asarray(a) for a in args))
    for g, w, name in zip(got, want, ("rows", "nvalid")):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)


@pytest.mark.parametrize("fn", IMPLS)
def test_every_pick_valid_counts_whole_blocks(rng, fn):
    """All picks valid: the count is k, so every block but the partial last one holds 64 rows."""
    B, T, k, bs = 2, 1, 200, 64
    table = np.arange(2 * 8, dtype=np.int32).reshape(2, 8)
    entry = np.stack([rng.permutation(8 * bs)[:k] for _ in range(B * T)]).astype(np.int32)
    args = (entry, table, np.arange(B, dtype=np.int32), np.full(B * T, 8 * bs, np.int32),
            np.zeros((B * T, 64), np.int32), np.full((B * T, 1), 7, np.int32))  # fmt: skip
    rows, nvalid = fn(*(jnp.asarray(a) for a in args), block_size=bs, pool_blocks=16)
    np.testing.assert_array_equal(np.asarray(nvalid), [[64, 64, 64, 8, 7]] * 2)
    b = np.arange(B)[:, None]
    np.testing.assert_array_equal(np.asarray(rows)[:, :k], table[b, entry // bs] * bs + entry % bs)
    np.testing.assert_array_equal(np.asarray(rows)[:, k:256], -1)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "entry": a["entry"].astype(jnp.int16)}, "entry: expected int32"),
        (lambda a: {**a, "limit": a["limit"][:-1]}, "limit: expected int32"),
        (lambda a: {**a, "rest": a["rest"][:, :10]}, "rest: expected int32"),
        (lambda a: {**a, "rest_valid": a["rest_valid"][:, :1]}, "rest_valid: expected"),
        (lambda a: {**a, "slot": a["slot"][:2]}, "slot: expected"),
    ],
)
def test_bad_input_names_the_argument(rng, change, match):
    (entry, table, slot, limit, rest, rest_valid), kw = _inputs(rng, 3, 1, 64, 128)
    a = dict(entry=entry, table=table, slot=slot, limit=limit, rest=rest, rest_valid=rest_valid)
    a = change({n: jnp.asarray(x) for n, x in a.items()})
    with pytest.raises(ValueError, match=match):
        ref_entry_rows(**a, **kw)
    with pytest.raises(ValueError, match="block_size: expected an int"):
        ref_entry_rows(*(jnp.asarray(x) for x in (entry, table, slot, limit, rest, rest_valid)), block_size=0,
                       pool_blocks=4)  # fmt: skip
