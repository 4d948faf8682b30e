"""Fused decode compressor: a CSA / HCA layer's whole per-token cache update in one launch.

For each request of a decode step (one token each) the kernel folds the token's
compressor inputs into the request's running-softmax tail and, where that token completes
a window, does the whole flush: pool (a + previous-b streams for CSA), RMSNorm, RoPE on
the last 64 dims at ``entry * ratio``, FP8 (UE8M0 tiles, ``ds_mla`` bytes, in the
official storage family; one float32 scale per entry in the per_entry family), the indexer key
(RMSNorm, RoPE, Hadamard, MXFP4 / NVFP4), the scatter through the block table, and
the tail's move on (CSA a -> b rotation, HCA reset). Tails, pools and the error field are
updated in place (``input_output_aliases``); a request whose flush finds no block gets
``Fault.POOL_EXHAUSTED`` in its error word. The byte encoders are ``kernels.codes``'.

The math is ``jaxkv.math.compressor`` + ``jaxkv.formats.storage``; the reference is
``hybrid.compress(..., impl="xla")`` on the same step. Two things are computed in a different order, so a BF16 entry can differ from the
reference's in its last bit where the float32 value sits on a rounding boundary (and
its FP8 / FP4 bytes then by one code): the 512- and 128-wide sums of RMSNorm, and the
Hadamard rotation, done as ``y[2b + q] = sum_a H64[a, b] (x[2a] + (-1)^q x[2a+1])``
instead of by butterflies. ``exp``, ``rsqrt``, ``sin``, ``cos`` are the backend's.

Layout inside the kernel: a 512-wide vector is held as its even and odd channels,
``[ROWS, 8, 32]`` each (channel ``64 t + 2 k + parity``: tile ``t`` is one UE8M0 tile, tile 7
the RoPE dims whose pairs are exactly (even, odd)); the 128-wide indexer part as
``[ROWS, 4, 16]`` (channel ``32 g + 2 k + parity``: ``g`` one MXFP4 group; reshaped to
``[ROWS, 8, 8]`` for the NVFP4 groups of 16). Loads and stores use integer-array indexers.
Lowering: Triton (``pltriton.CompilerParams``).

    tails:      f32[L, R, streams, 3, width]  CSA: 3 streams, width 640; HCA: 1, width 512
    kv, score:  float[B, coff * 512]        CSA: [:512] b stream, [512:] a stream
    ikv, iscore: float[B, 256]              CSA only: the indexer's compressor inputs
    bias: f32[ratio, coff * 512]   norm: f32[512]   (ibias f32[ratio, 256], inorm f32[128])
    slot, write_slot, start, num_tokens: i32[B]   (``hybrid.Step``)
    table: i32[R, max_blocks]   pool: u8[L, NB, bs * E]   index_pool: u8[L, NB, bs * K]   (E, K: storage.entry_bytes, key_bytes)
    error: u32[R + 1]

Each of kv, score, bias, norm (and the indexer's) may instead be a ``jaxkv.stacked.Stacked`` row
of an array stacked over layers; the kernel reads that row in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.errors import Fault
from jaxkv.formats.numerics import round_bf16
from jaxkv.math.compressor import CUR_A, CUR_B, PREV_B, A, S, combine_triples, fold_triple
from jaxkv.formats.storage import (HEAD_DIM as HEAD, INDEX_DIM as INDEX, KEY_CODES, NOPE, NOPE_TILES, STORAGES,
                                   entry_bytes, key_bytes, segment_offsets, storage_name)
from jaxkv.kernels.codes import f32_bytes, mxfp4_pairs, nvfp4_pairs, per_entry_codes, ue8m0_tile_codes
from jaxkv.kernels.division import division
from jaxkv.kernels.tuning import launch
from jaxkv.stacked import as_stack, check_stacked

ROWS = 1  # requests per program


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


_bf16 = round_bf16  # f32 -> f32 rounded to bf16, as ``jaxkv.math.compressor.finalize`` rounds


def _kernel(*refs, ratio, csa, nb, bs, layer, R, mb, eps, offsets, storage, div):
    from jax.experimental.pallas import triton as pltriton

    if csa:
        (slot_ref, wslot_ref, start_ref, n_ref, kv_ref, z_ref, bias_ref, norm_ref, ikv_ref, iz_ref, ibias_ref,
         inorm_ref, had_ref, freqs_ref, table_ref, _t, _p, _i, _e, tails_ref, pool_ref, index_ref, err_ref) = refs
    else:
        (slot_ref, wslot_ref, start_ref, n_ref, kv_ref, z_ref, bias_ref, norm_ref, freqs_ref, table_ref, _t, _p, _e,
         tails_ref, pool_ref, err_ref) = refs
    streams = 3 if csa else 1
    official = storage == "official"
    seg, kseg = STORAGES[storage].entry.segments, STORAGES[storage].index_key(INDEX).segments
    off, koff = segment_offsets(seg, bs), segment_offsets(kseg, bs)
    c = HEAD
    load, store = pltriton.load, pltriton.store
    # first row of this layer's kv, score, bias, norm (and the indexer's) in their stacks
    kv_off, z_off, bias_off, norm_off, ikv_off, iz_off, ibias_off, inorm_off = offsets

    i = pl.program_id(0)
    rows = pl.ds(i * ROWS, ROWS)
    slot = load(slot_ref.at[rows])  # i32[ROWS]
    wslot = load(wslot_ref.at[rows])
    start = load(start_ref.at[rows])
    act = (load(n_ref.at[rows]) > 0) & (wslot >= 0) & (wslot < R)
    fill = start % ratio
    done = act & (fill == ratio - 1)  # this token completes window ``entry``
    entry = start // ratio
    blk = load(table_ref.at[slot, jnp.clip(entry // bs, 0, mb - 1)], mask=done, other=-1)
    write = done & (blk >= 0) & (blk < nb)
    missing = done & ~write
    err = load(err_ref.at[slot], mask=missing, other=0)
    store(err_ref.at[slot], err | jnp.uint32(int(Fault.POOL_EXHAUSTED)), mask=missing)
    sl = entry % bs
    prow = jnp.where(write, layer * nb + blk, 0)  # pool row: block ``blk`` of the layer

    def b3(x):  # i32[ROWS] -> [ROWS, 1, 1]
        return x[:, None, None]

    def pool_group(chan, in_off_a, in_off_b, kv_r, z_r, bias_r, offs, shape):
        """Fold the token into one channel group of the tail and pool it.
        chan: i32[ROWS, G, K] channel in the tail; returns the pooled f32 values."""
        def tail(stream, comp, mask):
            row = b3(((layer * R + slot) * streams + stream) * 3 + comp)
            return load(tails_ref.at[jnp.broadcast_to(row, shape), chan], mask=mask, other=0)

        def put(stream, comp, val, mask):
            row = b3(((layer * R + wslot) * streams + stream) * 3 + comp)
            store(tails_ref.at[jnp.broadcast_to(row, shape), chan], val, mask=mask)

        a3, d3 = b3(act), b3(done)
        kv_o, z_o, bias_o = offs
        brow = jnp.broadcast_to(b3(fill + bias_o), shape)
        brows = jnp.broadcast_to(b3(jnp.arange(ROWS) + i * ROWS), shape)

        def inputs(off):
            col = chan + off
            kv = load(kv_r.at[brows + kv_o, col], mask=a3, other=0).astype(jnp.float32)
            z = load(z_r.at[brows + z_o, col], mask=a3, other=0).astype(jnp.float32)
            return kv, z + load(bias_r.at[brow, col], mask=a3, other=0)

        empty = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
        cur_a = fold_triple(*(tail(CUR_A, k, a3) for k in range(3)), *inputs(in_off_a))
        if csa:
            cur_b = fold_triple(*(tail(CUR_B, k, a3) for k in range(3)), *inputs(in_off_b))
            prev_b = tuple(tail(PREV_B, k, d3) for k in range(3))
            st = combine_triples(cur_a, prev_b)
            for k in range(3):
                put(CUR_A, k, jnp.where(d3, empty[k], cur_a[k]), a3)
                put(CUR_B, k, jnp.where(d3, empty[k], cur_b[k]), a3)
                put(PREV_B, k, cur_b[k], d3)
        else:
            st = cur_a
            for k in range(3):
                put(CUR_A, k, jnp.where(d3, empty[k], cur_a[k]), a3)
        return st[A] / st[S]

    def rope(e, o, on, j):
        """RoPE of (even, odd) pairs where ``on``, pair index ``j`` (f32 math, bf16 result)."""
        ang = b3(entry * ratio).astype(jnp.float32) * load(freqs_ref.at[jnp.clip(j, 0, 31)])
        cs, sn = jnp.cos(ang), jnp.sin(ang)
        re, im = _bf16(e * cs - o * sn), _bf16(e * sn + o * cs)
        return jnp.where(on, re, e), jnp.where(on, im, o)

    def norm(e, o, w_ref, chan, width, w_off):
        """bf16 -> RMSNorm (float32 math) -> bf16, on the even / odd halves."""
        e, o = _bf16(e), _bf16(o)
        ms = (jnp.sum(jnp.sum(e * e, axis=2), axis=1) + jnp.sum(jnp.sum(o * o, axis=2), axis=1)) / width
        r = b3(lax.rsqrt(ms + eps))
        return _bf16(load(w_ref.at[chan + w_off]) * (e * r)), _bf16(load(w_ref.at[chan + w_off + 1]) * (o * r))

    # --- main entry: [ROWS, 8, 32] even / odd -----------------------------------------------
    shp = (ROWS, 8, 32)
    t = jnp.arange(8)[None, :, None]
    k = jnp.arange(32)[None, None, :]
    ch = jnp.broadcast_to(t * 64 + 2 * k, shp)  # even channel
    off_a, off_b = (c, 0) if csa else (0, 0)
    offs = (kv_off, z_off, bias_off)
    pe = pool_group(ch, off_a, off_b, kv_ref, z_ref, bias_ref, offs, shp)
    po = pool_group(ch + 1, off_a, off_b, kv_ref, z_ref, bias_ref, offs, shp)
    xe, xo = norm(pe, po, norm_ref, ch, c, norm_off)
    xe, xo = rope(xe, xo, t == NOPE_TILES, jnp.broadcast_to(k, shp))

    w3 = b3(write)
    prow3 = jnp.broadcast_to(b3(prow), shp)
    t2 = jnp.arange(8)[None, :]
    prow2 = jnp.broadcast_to(prow[:, None], (ROWS, 8))
    if official:  # ds_mla: [bs x (448 codes + 128 rope)] [bs x (7 UE8M0 + pad)]
        byte, codes = ue8m0_tile_codes(xe, xo, div=div)  # [ROWS, 8], 2 x [ROWS, 8, 32]
        code_col, rope_col = off[0] + b3(sl) * seg[0], off[0] + b3(sl) * seg[0] + NOPE
        store(pool_ref.at[prow2, off[1] + sl[:, None] * seg[1] + t2], jnp.where(t2 < NOPE_TILES, byte, jnp.uint8(0)),
              mask=write[:, None])
    else:  # per_entry: [bs x 448 codes] [bs x 128 rope] [bs x f32 scale]
        scale, codes = per_entry_codes(xe, xo, div=div)
        code_col, rope_col = off[0] + b3(sl) * seg[0], off[1] + b3(sl) * seg[1]
        c4 = jnp.arange(4)[None, :]
        store(pool_ref.at[jnp.broadcast_to(prow[:, None], (ROWS, 4)), off[2] + sl[:, None] * seg[2] + c4],
              f32_bytes(scale), mask=write[:, None])
    for par, x, q in ((0, xe, codes[0]), (1, xo, codes[1])):
        store(pool_ref.at[prow3, code_col + ch + par], q, mask=w3 & (t < NOPE_TILES))
        raw = lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)  # the rope dims as stored
        col = rope_col + 4 * k + 2 * par
        store(pool_ref.at[prow3, col], (raw & 0xFF).astype(jnp.uint8), mask=w3 & (t == NOPE_TILES))
        store(pool_ref.at[prow3, col + 1], (raw >> 8).astype(jnp.uint8), mask=w3 & (t == NOPE_TILES))

    if not csa:
        return
    # --- indexer key: [ROWS, 4, 16] even / odd ------------------------------------------------
    ishp = (ROWS, 4, 16)
    g = jnp.arange(4)[None, :, None]
    kk = jnp.arange(16)[None, None, :]
    ich = jnp.broadcast_to(g * 32 + 2 * kk, ishp)  # even channel of the 128
    ioffs = (ikv_off, iz_off, ibias_off)
    pe = pool_group(ich + c, INDEX - c, -c, ikv_ref, iz_ref, ibias_ref, ioffs, ishp)
    po = pool_group(ich + c + 1, INDEX - c, -c, ikv_ref, iz_ref, ibias_ref, ioffs, ishp)
    ie, io = norm(pe, po, inorm_ref, ich, INDEX, inorm_off)
    ie, io = rope(ie, io, g >= 2, jnp.broadcast_to((g - 2) * 16 + kk, ishp))
    # Hadamard: y[2b+q] = sum_a H64[a, b] (x[2a] + (-1)^q x[2a+1]) / sqrt(128), a = 16 g + k
    h = load(had_ref.at[...])  # f32[4, 16, 4, 16] = H64[a, b]
    scale = np.float32(INDEX ** -0.5)

    def rotate(u):  # [ROWS, 4, 16] -> [ROWS, 4, 16]
        prod = u[:, :, :, None, None] * h[None]
        return jnp.sum(jnp.sum(prod, axis=1), axis=1) * scale

    ye, yo = _bf16(rotate(ie + io)), _bf16(rotate(ie - io))
    kcol = koff[0] + b3(sl) * KEY_CODES + g * 16 + kk
    if official:  # MXFP4: 4 groups of 32 = 16 pairs, 4 UE8M0 bytes
        packed, kbyte = mxfp4_pairs(ye, yo, div=div)  # [ROWS, 4, 16], [ROWS, 4]
        kscol = koff[1] + sl[:, None] * kseg[1] + jnp.arange(4)[None, :]
    else:  # NVFP4: 8 groups of 16 = 8 pairs, 8 E4M3 bytes, then the f32 global scale
        packed, kbyte, gscale = nvfp4_pairs(ye.reshape(ROWS, 8, 8), yo.reshape(ROWS, 8, 8), div=div)
        packed = packed.reshape(ishp)
        kscol = koff[1] + sl[:, None] * kseg[1] + jnp.arange(8)[None, :]
        gcol = koff[2] + sl[:, None] * kseg[2] + jnp.arange(4)[None, :]
        store(index_ref.at[jnp.broadcast_to(prow[:, None], gcol.shape), gcol], f32_bytes(gscale), mask=write[:, None])
    store(index_ref.at[jnp.broadcast_to(b3(prow), ishp), kcol], packed, mask=b3(write))
    store(index_ref.at[jnp.broadcast_to(prow[:, None], kscol.shape), kscol], kbyte, mask=write[:, None])


def check_compress_decode(tails, kv, score, bias, norm, slot, table, pool, error, *, layer, ratio, index, index_pool,
                          storage):
    """Shapes and dtypes of ``compress_decode``'s arguments: ValueError naming the argument."""
    csa = index is not None
    streams, width, coff = (3, HEAD + INDEX, 2) if csa else (1, HEAD, 1)
    B = slot.shape[0]

    def want(name, x, shape, dtypes):
        if tuple(x.shape) != tuple(shape) or x.dtype not in dtypes:
            names = " or ".join(str(jnp.dtype(d)) for d in dtypes)
            raise ValueError(f"{name}: expected {names}{list(shape)}, got {x.dtype}{list(x.shape)}")

    floats = (jnp.float32, jnp.bfloat16)
    for name, x in (("kv", kv), ("score", score), ("bias", bias), ("norm", norm)) + tuple(
            zip(("index kv", "index score", "index bias", "index norm"), index or ())):
        check_stacked(name, x)
    if tails.ndim != 5:
        raise ValueError(f"tails: expected f32[layers, R, {streams}, 3, {width}], got {tails.dtype}{list(tails.shape)}")
    L, R = tails.shape[:2]
    want("tails", tails, (L, R, streams, 3, width), (jnp.float32,))
    if not 0 <= layer < L or pool.ndim != 3 or pool.shape[0] != L:
        raise ValueError(f"layer: expected a static int in [0, {L}) indexing tails and pool alike, got {layer} with "
                         f"pool {list(pool.shape)}")
    E = entry_bytes(storage_name(storage))
    if pool.dtype != jnp.uint8 or pool.shape[2] % E:
        raise ValueError(f"pool: expected u8[{L}, NB, bs * {E}] ({storage} storage), got {pool.dtype}{list(pool.shape)}")
    want("kv", kv, (B, coff * HEAD), floats)
    want("score", score, (B, coff * HEAD), floats)
    want("bias", bias, (ratio, coff * HEAD), (jnp.float32,))
    want("norm", norm, (HEAD,), (jnp.float32,))
    if slot.ndim != 1 or slot.dtype != jnp.int32:
        raise ValueError(f"slot: expected i32[B], got {slot.dtype}{list(slot.shape)}")
    if table.ndim != 2 or table.shape[0] != R or table.dtype != jnp.int32:
        raise ValueError(f"table: expected i32[{R}, max_blocks], got {table.dtype}{list(table.shape)}")
    want("error", error, (R + 1,), (jnp.uint32,))
    if csa:
        ikv, iscore, ibias, inorm = index
        want("index kv", ikv, (B, 2 * INDEX), floats)
        want("index score", iscore, (B, 2 * INDEX), floats)
        want("index bias", ibias, (ratio, 2 * INDEX), (jnp.float32,))
        want("index norm", inorm, (INDEX,), (jnp.float32,))
        if index_pool is None:
            raise ValueError("index_pool: expected the CSA layer's indexer-key pool with index, got None")
        want("index_pool", index_pool, (*pool.shape[:2], pool.shape[2] // E * key_bytes(storage_name(storage))), (jnp.uint8,))


def _flat(x, dtype=None):
    """An operand or ``Stacked`` row -> (its stack with the row axes flattened into the
    first, the index of the row's first element there)."""
    stack, index = as_stack(x, dtype)
    per = int(np.prod(stack.shape[1:-1], dtype=np.int64)) if stack.ndim > 2 else stack.shape[-1]
    flat = stack.reshape(-1, stack.shape[-1]) if stack.ndim > 2 else stack.reshape(-1)
    return flat, index * per


def compress_decode(tails, kv, score, bias, norm, slot, write_slot, start, num_tokens, table, pool, error, freqs, *,
                    layer: int, ratio: int, eps: float, storage: str, index=None, index_pool=None,
                    interpret: bool = False):
    """The kernel. ``index = (ikv, iscore, ibias, inorm)`` for a CSA layer (with
    ``index_pool``), None for HCA. Each of kv, score, bias, norm and the index tuple may
    be a ``jaxkv.stacked.Stacked`` row, read in place. Returns ``(tails, pool, error)`` or,
    for CSA, ``(tails, pool, index_pool, error)``, all updated in place."""
    return _compress_decode(tails, kv, score, bias, norm, slot, write_slot, start, num_tokens, table, pool, error,
                            freqs, layer=layer, ratio=ratio, eps=eps, storage=storage_name(storage), index=index,
                            index_pool=index_pool, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("layer", "ratio", "eps", "storage", "interpret"),
                   donate_argnames=("tails", "pool", "index_pool", "error"))
def _compress_decode(tails, kv, score, bias, norm, slot, write_slot, start, num_tokens, table, pool, error, freqs, *,
                     layer: int, ratio: int, eps: float, storage: str, index=None, index_pool=None,
                     interpret: bool = False):
    from jax.experimental.pallas import triton as pltriton

    check_compress_decode(tails, kv, score, bias, norm, slot, table, pool, error, layer=layer, ratio=ratio,
                          index=index, index_pool=index_pool, storage=storage)
    csa = index is not None
    R = tails.shape[1]
    L, nb, w = pool.shape
    bs = w // entry_bytes(storage)
    B = slot.shape[0]
    flat_tails = tails.reshape(-1, tails.shape[-1])
    operands = [_flat(kv), _flat(score), _flat(bias, jnp.float32), _flat(norm, jnp.float32)]
    outs = [jax.ShapeDtypeStruct(flat_tails.shape, jnp.float32), jax.ShapeDtypeStruct((L * nb, w), jnp.uint8)]
    aliased = [flat_tails, pool.reshape(L * nb, w)]
    if csa:
        ikv, iscore, ibias, inorm = index
        operands += [_flat(ikv), _flat(iscore), _flat(ibias, jnp.float32), _flat(inorm, jnp.float32)]
        outs.append(jax.ShapeDtypeStruct((L * nb, index_pool.shape[2]), jnp.uint8))
        aliased.append(index_pool.reshape(L * nb, index_pool.shape[2]))
    offsets = tuple(off for _, off in operands) + (0,) * (8 - len(operands))
    args = [slot, write_slot, start, num_tokens] + [a for a, _ in operands]
    if csa:
        args.append(jnp.asarray(_sylvester(64).reshape(4, 16, 4, 16)))
    args += [jnp.asarray(freqs, jnp.float32), table]
    outs.append(jax.ShapeDtypeStruct(error.shape, error.dtype))
    aliased.append(error)
    first = len(args)
    res = pl.pallas_call(
        functools.partial(_kernel, ratio=ratio, csa=csa, nb=nb, bs=bs, layer=layer, R=R, mb=table.shape[1], eps=eps,
                          offsets=offsets, storage=storage, div=division(interpret)),
        out_shape=tuple(outs),
        grid=(pl.cdiv(B, ROWS),),
        input_output_aliases={first + n: n for n in range(len(aliased))},
        compiler_params=pltriton.CompilerParams(num_warps=launch(f"compress_decode/{storage}")["warps"], num_stages=1),
        interpret=interpret,
        name="jaxkv_compress_decode",
    )(*args, *aliased)
    tails = res[0].reshape(tails.shape)
    pool = res[1].reshape(pool.shape)
    if csa:
        return tails, pool, res[2].reshape(index_pool.shape), res[3]
    return tails, pool, res[2]


__all__ = ["check_compress_decode", "compress_decode"]
