"""The CSA / HCA compressor: gated softmax pooling of ``ratio`` tokens into one entry.

Math (DeepSeek-V4, eqs. 11-12 and 20-23). Per channel, entry ``i`` of a CSA layer is
``softmax([Z^a_{mi..mi+m-1} + B^a ; Z^b_{m(i-1)..mi-1} + B^b]) . [C^a ; C^b]`` over the 2m
rows (a: the window's own rows, b: the previous window's rows; for i = 0 the b rows are
Z = -inf, C = 0). HCA is the same with one stream and no b rows. Then RMSNorm, RoPE on
the last 64 dims at position ``i * ratio``, and quantization (done by the storage).

Layout of the inputs, as DeepSeek-V4's ``wkv`` / ``wgate`` produce them: CSA
``kv, score: [..., 2c]`` where ``[..., :c]`` is the b-stream (overlap) projection and
``[..., c:]`` the a-stream; HCA ``[..., c]``. The math is per channel, so a CSA layer's
main compressor (c = 512) and its indexer's (128) share one 640-channel tail.

The tail state is not the raw rows but their running softmax: per stream the float32
triple ``(M, S, A)`` = (running max of Z, sum of exp(Z - M), sum of exp(Z - M) * C), so a
tail is ``3 x c`` floats per stream whatever the ratio (the raw rows of an HCA tail are
128 x c). Rows are folded strictly in token order, in decode and in prefill alike, so a
sequence fed token by token gives bit-identical entries to the same sequence in one chunk.
Pooling two streams is the log-sum-exp combination of their triples, and the entry is
``A / S``. CSA keeps three streams per request: the current window's a and b streams and
the previous window's b stream (initialised to M = -inf, S = A = 0, i.e. the paper's
-inf / 0 padding); a flush moves b -> previous b, HCA just restarts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.formats.numerics import round_bf16
from jaxkv.math.rotation import apply_rope_tail, hadamard

M, S, A = 0, 1, 2  # rows of a stream's triple
CUR_A, CUR_B, PREV_B = 0, 1, 2  # CSA streams (HCA has only CUR_A)


def empty_tail(shape_prefix, streams: int, dim: int):
    """f32[*prefix, streams, 3, dim]: every stream empty (M = -inf, S = A = 0)."""
    m = jnp.full((*shape_prefix, streams, 1, dim), -jnp.inf, jnp.float32)
    return jnp.concatenate([m, jnp.zeros((*shape_prefix, streams, 2, dim), jnp.float32)], axis=-2)


def fold_triple(m, s, a, kv, z):
    """``fold`` on the triple's parts (also what the fused decode kernel runs)."""
    m_new = jnp.maximum(m, z)
    keep = jnp.exp(m - m_new)
    w = jnp.exp(z - m_new)
    return m_new, s * keep + w, a * keep + kv * w


def combine_triples(x, y):
    """``combine`` on (M, S, A) tuples."""
    m_new = jnp.maximum(x[M], y[M])
    ex = jnp.exp(x[M] - m_new)
    ey = jnp.exp(y[M] - m_new)
    return m_new, x[S] * ex + y[S] * ey, x[A] * ex + y[A] * ey


def _parts(st):
    return st[..., M, :], st[..., S, :], st[..., A, :]


def fold(st, kv, z):
    """Add one row to a stream. st: f32[..., 3, c]; kv, z: f32[..., c]."""
    return jnp.stack(fold_triple(*_parts(st), kv, z), axis=-2)


def combine(x, y):
    """Pool two streams (log-sum-exp merge). x, y: f32[..., 3, c] -> f32[..., 3, c]."""
    return jnp.stack(combine_triples(_parts(x), _parts(y)), axis=-2)


def pooled(st):
    """The pooled entry ``A / S``: f32[..., 3, c] -> f32[..., c]."""
    return st[..., A, :] / st[..., S, :]


def fold_chunk(tail, kv, z, start, n, ratio: int, overlap: bool):
    """Fold a request's chunk of tokens into its tail, window by window.

    tail: f32[streams, 3, c] (3 streams for CSA, 1 for HCA)
    kv, z: f32[T, rows, c]  this step's tokens, per stream they feed (CSA: rows = 2, the
      a then the b stream; HCA: 1), ``z`` with the positional bias added
    start: i32[]  position of the chunk's first token; n: i32[] tokens that are real (<= T)
    Returns (windows f32[NW + 1, streams, 3, c], pooled f32[NW, c], complete bool[NW]):
    ``windows[w]`` is the tail state of relative window ``w`` (0 = the window ``start``
    falls in) after the chunk, with index NW an empty window; ``pooled[w]`` its entry
    (a/b-combined for CSA), valid where ``complete[w]``.
    """
    T = kv.shape[0]
    c = tail.shape[-1]
    streams = tail.shape[0]
    fill = start % ratio
    nw = (ratio - 1 + T + ratio - 1) // ratio  # windows a chunk of T tokens can touch
    wins = jnp.concatenate([tail[None], jnp.broadcast_to(empty_tail((), streams, c), (nw, streams, 3, c))], axis=0)

    def step(r, wins):
        t = jnp.arange(nw + 1) * ratio + r - fill  # token feeding row r of each window
        valid = (t >= 0) & (t < n)
        kv_r, z_r = kv[jnp.clip(t, 0, T - 1)], z[jnp.clip(t, 0, T - 1)]  # f32[NW+1, rows, c]
        if overlap:  # the previous-b stream folds no rows
            new = wins.at[:, :PREV_B].set(fold(wins[:, :PREV_B], kv_r, z_r))
        else:
            new = fold(wins, kv_r, z_r)
        return jnp.where(valid[:, None, None, None], new, wins)

    if T == 1:  # decode: the one token lands in window 0, row ``fill``
        wins = step(fill, wins)
    else:
        wins = lax.fori_loop(0, ratio, step, wins)

    complete = (jnp.arange(nw) + 1) * ratio <= fill + n
    if overlap:
        prev_b = jnp.concatenate([tail[None, PREV_B], wins[: nw - 1, CUR_B]], axis=0)  # [NW, 3, c]
        pool_st = combine(wins[:nw, CUR_A], prev_b)
    else:
        pool_st = wins[:nw, CUR_A]
    return wins, pooled(pool_st), complete


def next_tail(tail, wins, start, n, ratio: int, overlap: bool):
    """The tail after the chunk: the window the next token falls in (a fresh one if the
    chunk ended on a boundary), with, for CSA, the last complete window's b stream as
    the previous-b stream."""
    w_last = (start % ratio + n) // ratio
    new = wins[w_last]
    if overlap:
        prev_b = jnp.where(w_last >= 1, wins[jnp.maximum(w_last - 1, 0), CUR_B], tail[PREV_B])
        new = new.at[PREV_B].set(prev_b)
    return new


def rms_norm(x, weight, eps: float):
    """DeepSeek's RMSNorm: float32 math on bf16 values, the result rounded to bf16
    (``round_bf16``). x: f32[..., c] holding bf16 values, weight: f32[c] -> f32[..., c]."""
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return round_bf16(weight * y)


def finalize(p, entry_index, ratio: int, norm_weight, freqs, eps: float, rope_dim: int, rotate: bool):
    """Pooled float32 entries -> the BF16 entries that get quantized.

    p: f32[..., c]; entry_index: i32[...]; norm_weight: f32[c]; freqs: f32[rope_dim/2].
    bf16 -> RMSNorm -> bf16 -> RoPE on the last ``rope_dim`` dims at ``entry_index * ratio``
    -> bf16; indexer keys (``rotate``) then get the Hadamard rotation -> bf16. Every bf16
    rounding is explicit (``round_bf16``), so the bytes do not depend on how XLA fuses.
    """
    x = rms_norm(round_bf16(p), norm_weight, eps)
    x = round_bf16(apply_rope_tail(x, entry_index * ratio, freqs, rope_dim))  # the other dims are bf16 already
    if rotate:
        x = round_bf16(hadamard(x))
    return x.astype(jnp.bfloat16)  # exact: the values are bf16 already


def ref_pool_sequence(kv, score, bias, ratio: int, overlap: bool):
    """Reference: every complete window of a whole sequence at once, by eqs. 11-12 / 20-23.

    kv, score: f32[N, coff*c] for positions 0..N-1; bias: f32[ratio, coff*c]
    -> f32[N // ratio, c], softmax over the (2m or m) rows per channel, summed.
    """
    n_ent = kv.shape[0] // ratio
    c = kv.shape[-1] // (2 if overlap else 1)
    kv = kv[: n_ent * ratio].reshape(n_ent, ratio, -1)
    z = score[: n_ent * ratio].reshape(n_ent, ratio, -1) + bias
    if overlap:
        pad_kv = jnp.zeros((1, ratio, c), jnp.float32)
        pad_z = jnp.full((1, ratio, c), -jnp.inf, jnp.float32)
        kv_b = jnp.concatenate([pad_kv, kv[:-1, :, :c]], axis=0)
        z_b = jnp.concatenate([pad_z, z[:-1, :, :c]], axis=0)
        kv = jnp.concatenate([kv[:, :, c:], kv_b], axis=1)  # [n, 2m, c]
        z = jnp.concatenate([z[:, :, c:], z_b], axis=1)
    return jnp.sum(kv * jax.nn.softmax(z, axis=1), axis=1)
