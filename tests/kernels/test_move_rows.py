"""kernels.ref_move_rows / move_rows_cuda: a span of rows moved inside many buffers, against
a numpy model of the moves, bit for bit, on random bytes of the frame cache's dtypes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.kernels import move_rows_cuda, ref_move_rows

IMPLS = [pytest.param(ref_move_rows, id="xla"), pytest.param(move_rows_cuda, id="cuda", marks=pytest.mark.gpu)]


def _bufs(rng, B, R, count):
    """Buffers of the frame cache's kinds in turn: FP8 codes, bf16 scales, bf16 K/V, i32 ids,
    and a 3-byte row that no vector copy can take. Floats are finite (XLA on a CPU may quiet a
    signalling NaN as it copies), integers random bytes."""
    kinds = (
        (ml_dtypes.float8_e4m3fn, (4, 64)),
        (jnp.bfloat16, (4,)),
        (jnp.bfloat16, (2, 64)),
        (np.int32, ()),
        (np.uint8, (3,)),
    )
    out = []
    for i in range(count):
        dtype, tail = kinds[i % len(kinds)]
        if np.issubdtype(np.dtype(dtype), np.integer):
            out.append(rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=(B, R) + tail, dtype=dtype))
        else:
            out.append((rng.normal(size=(B, R) + tail) * 4).astype(dtype))
    return out


def _model(bufs, moves, rows):
    out = [b.copy() for b in bufs]
    for b, src, dst in moves:
        for x in out:
            x[b, dst : dst + rows] = x[b, src : src + rows].copy()
    return out


def _disjoint_moves(rng, B, R, rows, per_stream):
    """Per stream, spans of ``rows`` rows on distinct pages (shifted by one random offset): no
    move's rows touch another's."""
    moves = []
    for b in range(B):
        pages = rng.permutation(R // rows)[: 2 * per_stream]
        shift = int(rng.integers(0, R % rows + 1))
        for src, dst in pages.reshape(per_stream, 2):
            moves.append((b, int(src) * rows + shift, int(dst) * rows + shift))
    return np.asarray(rng.permutation(moves), np.int32)


@pytest.mark.parametrize("move", IMPLS)
@pytest.mark.parametrize("count", [5, 101])  # 101: past one launch's 96 buffers
def test_moves_match_the_model(rng, move, count):
    B, R, rows = 2, 45, 7
    bufs = _bufs(rng, B, R, count)
    moves = _disjoint_moves(rng, B, R, rows, per_stream=2)
    want = _model(bufs, moves, rows)
    got = jax.jit(lambda b, m: move(b, m, rows=rows), donate_argnums=0)(tuple(map(jnp.asarray, bufs)), moves)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8), err_msg=f"buffer {i}")


@pytest.mark.gpu
def test_cuda_skips_a_move_outside_the_buffer(rng):
    """A stream or span past the buffer is not written (XLA would clamp it): nothing lands outside."""
    B, R, rows = 2, 16, 4
    bufs = _bufs(rng, B, R, 5)
    moves = np.asarray([[2, 0, 4], [0, 14, 0], [1, 0, 13], [-1, 0, 4], [1, 8, 0]], np.int32)
    got = move_rows_cuda(tuple(map(jnp.asarray, bufs)), moves, rows=rows)
    want = _model(bufs, moves[-1:], rows)  # only the last move is inside
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("move", IMPLS)
def test_empty_buffers_and_no_moves_pass_through(rng, move):
    bufs = (jnp.zeros((2, 0, 4), jnp.bfloat16), jnp.asarray(_bufs(rng, 2, 8, 1)[0]))
    got = move(bufs, np.zeros((0, 3), np.int32), rows=2)
    np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint8), np.asarray(bufs[1]).view(np.uint8))
    assert got[0].shape == (2, 0, 4)


@pytest.mark.parametrize(
    "moves, rows, bufs, match",
    [
        (np.zeros((1, 2), np.int32), 2, [(2, 8)], "moves: expected int32\\[M, 3\\]"),
        (np.zeros((1, 3), np.int64), 2, [(2, 8)], "moves: expected int32"),
        (np.zeros((1, 3), np.int32), 0, [(2, 8)], "rows: expected an int >= 1"),
        (np.zeros((1, 3), np.int32), 9, [(2, 8)], "bufs\\[0\\]: expected \\[streams, rows >= 9"),
        (np.zeros((1, 3), np.int32), 2, [(2, 8), (3, 8)], "bufs\\[1\\]: expected 2 streams"),
    ],
)
def test_bad_arguments_are_named(moves, rows, bufs, match):
    with pytest.raises(ValueError, match=match):
        ref_move_rows(tuple(jnp.zeros(s, jnp.int32) for s in bufs), moves, rows=rows)
