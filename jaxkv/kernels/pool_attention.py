"""Pool attention: DeepSeek-V4 MQA (K = V, head_dim 512) over FP8 pool rows read in place,
with an attention sink. Three lowerings of one contract (shapes below); why each is built
the way it is, with the measurements: docs/kernels/pool_attention.md.

* ``pool_attention_cuda``: ``jaxkv/cuda/pool_attention.cu`` through ``jax.ffi`` (Hopper with nvcc;
  both storage families), warp-specialized: a producer warpgroup loads block j + 1's
  scattered rows and dequantizes them into a swizzled BF16 tile (integer ops and a bf16
  multiply, no conversion instructions) while two consumer warpgroups run block j's
  ``S = Q K^T`` and ``P V`` on ``wgmma``. The fastest, hence ``hybrid.attention``'s ``auto``;
  its time goes to gathering the scattered rows, not to the math or the dequantization.
* ``pool_attention_pallas``: Pallas, Mosaic GPU lowering (Hopper; official storage), below.
* ``pool_attention_flashmla``: FlashMLA's sm90 sparse FP8 decode kernel (its docstring).

A DeepSeek-V4 query attends to rows of up to three pools: a CSA / HCA layer's compressed
entries (picked by ``index_topk``, or all visible), its SWA ring, and the step's own
tokens. The kernels read those rows where they are stored (FP8 codes, BF16 RoPE dims)
and never write BF16 copies. In the Mosaic GPU kernel, per block of 64 rows a producer warpgroup issues one TMA
per row segment (Hopper's TMA has no row gather; the rows of a block are scattered over
the pool), the two compute warpgroups dequantize the block into one swizzled BF16 tile
in shared memory (each half the tiles), then each computes the full ``S = Q K^T`` for
the program's 64 heads and ``P V`` for its half of the 512 output dims on the tensor
cores (``wgmma``), with an online softmax in registers.

The Mosaic GPU kernel copies a row as five TMA copies (four 128-byte code boxes and the
rope) into 128-column buffers: the per-row copies are its cost, and the fewer, wider copies
that would be cheaper read back wrong values on Mosaic GPU (docs/kernels/pool_attention.md).

The Mosaic GPU kernel reads official (``ds_mla``) storage only: per_entry pools are refused
(they fail its GPU test). Row scales (UE8M0 per 64-dim tile) are gathered beforehand (8 B per row, tile-major, by XLA): the kernel
multiplies them in float32 as the reference decoder does, so its BF16 keys equal the
reference's bit for bit. The sink only enters the denominator; it is applied with the
merge of split partials (XLA), which also serves ``splits`` > 1: key blocks cut over
``splits`` programs when the batch alone does not fill the GPU. The CUDA kernel adds it
itself when one partial per query is left (``launch.pool_cuda_parts``: one split, or two at 64 heads,
merged in the kernel): no merge launch, one bf16 rounding of the output.

    q: bf16[N, H, 512]           one query row per (request, token); H a multiple of 64
    pools: tuple of u8[P, bs * E] one pool per part, rows ``block * bs + slot``
    rows: i32[N, NB * 64]        block b's 64 rows, ids into their part's pool; rows past
                                 ``nvalid`` and ids outside the pool are masked (any value);
                                 part p owns a static range of blocks
    nvalid: i32[N, NB]           counted rows of each block, a prefix (0: skip the block;
                                 clamped to [0, 64])
    sink: f32[H]                 per-head logit added to the denominator
    -> bf16[N, H, 512]           zeros for a row with no valid key and sink -inf

q and sink may be ``jaxkv.stacked.Stacked`` rows (of bf16[n, N, H, 512], f32[n, H]): the CUDA
kernel reads them in place, the others slice them. ``spans`` (static, one ``(first, count)``
per part, or None: whole pools) narrows part p to blocks ``first .. first + count`` of its
pool: its ids count rows from block ``first``, and an id at or past ``count`` blocks is
masked. A stacked pool's layer is then a span, and the ids of equal layers are equal arrays
(a step computes them once).

``ref_pool_attention`` is the float32 reference with the same contract. Neither kernel has
an interpret mode: the tests run them on a GPU; off a GPU the hybrid cache uses XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cuda import STORAGE_CODES, flashmla, register_ffi_targets
from jaxkv.formats.storage import HEAD_DIM, NOPE, NOPE_TILES, ROPE, STORAGES, from_bytes, segment_offsets, storage_name
from jaxkv.kernels.dequant_gather import ref_dequant_gather
from jaxkv.kernels.launch import flashmla_sm_parts, pool_cuda_parts
from jaxkv.math.attention import merge_partials
from jaxkv.stacked import as_flat, row

STAGES = 2  # raw blocks in flight (static slots: the loops run over pairs of blocks)
BLOCK = 64  # rows per block (a wgmma N tile); also heads per program (the M tile)
TILES = NOPE_TILES + 1  # 64-dim tiles of an entry: 7 FP8, 1 BF16 rope
CODE_BOXES = (128, 128, 128, NOPE - 384)  # a row's FP8 codes, one TMA box (and SMEM buffer) per 128 columns
LOG2E = math.log2(math.e)
CUDA_PARTS = 3  # pools the cuda/ kernel takes (a V4 layer has entries, its ring, its own tokens)
i32 = jnp.int32


def _check(q, pools, part_blocks, rows, nvalid, sink, storage, lowering="mosaic", spans=None):
    if q.ndim != 3 or q.shape[2] != HEAD_DIM or q.shape[1] % BLOCK or q.dtype != jnp.bfloat16:
        raise ValueError(
            f"q: expected bf16[N, H, {HEAD_DIM}] with H a multiple of {BLOCK}, got {q.dtype}{list(q.shape)}"
        )
    N, H, _ = q.shape
    NB = sum(part_blocks)
    if storage != "official" and lowering == "mosaic":  # per_entry rows fail the GPU test (wrong output)
        raise ValueError(
            f"storage: the kernel reads the official (ds_mla) family, got {storage!r}; "
            "hybrid.attention runs per_entry caches on impl='xla'"
        )
    if len(pools) != len(part_blocks):
        raise ValueError(f"pools: expected one pool per part ({len(part_blocks)}), got {len(pools)}")
    E = STORAGES[storage].entry_bytes
    for p, pool in enumerate(pools):
        if pool.ndim != 2 or pool.dtype != jnp.uint8 or pool.shape[1] % (32 * E):
            raise ValueError(
                f"pools[{p}]: expected u8[blocks, block_size * {E}] ({storage}) with block_size a "
                f"multiple of 32 (TMA tiles), got {pool.dtype}{list(pool.shape)}"
            )
    if rows.shape != (N, NB * BLOCK) or rows.dtype != jnp.int32:
        raise ValueError(f"rows: expected int32[{N}, {NB * BLOCK}], got {rows.dtype}{list(rows.shape)}")
    if nvalid.shape != (N, NB) or nvalid.dtype != jnp.int32:
        raise ValueError(f"nvalid: expected int32[{N}, {NB}], got {nvalid.dtype}{list(nvalid.shape)}")
    if sink.shape != (H,):
        raise ValueError(f"sink: expected f32[{H}], got {sink.dtype}{list(sink.shape)}")
    if 2 * NB + 1 > 256:  # the block list travels in one TMA box (cuda/: 128 blocks of shared memory)
        raise ValueError(f"rows: at most {127 * BLOCK} rows per query, got {NB * BLOCK}")
    if lowering == "cuda" and len(pools) > CUDA_PARTS:
        raise ValueError(f"pools: the cuda/ kernel reads at most {CUDA_PARTS} pools, got {len(pools)}")
    if spans is not None and (
        len(spans) != len(pools)
        or any(not (0 <= f and 0 <= c and f + c <= p.shape[0]) for (f, c), p in zip(spans, pools))
    ):
        raise ValueError(
            f"spans: expected one (first, count) per pool with first + count <= its blocks "
            f"{[p.shape[0] for p in pools]}, got {spans}"
        )


def span_rows(pools, part_blocks, rows, spans, storage):
    """``rows`` with ``spans`` applied: part p's ids as rows of its whole pool (``first`` blocks
    on), -1 where an id falls outside its span. The lowerings without spans of their own
    take these."""
    if spans is None:
        return rows
    E = STORAGES[storage].entry_bytes
    bounds = _part_of(part_blocks)
    cols = []
    for p, pool in enumerate(pools):
        bs = pool.shape[1] // E
        first, count = spans[p]
        ids = rows[:, bounds[p] * BLOCK : bounds[p + 1] * BLOCK]
        cols.append(jnp.where((ids >= 0) & (ids < count * bs), ids + first * bs, -1))
    return jnp.concatenate(cols, axis=1)


def _part_of(part_blocks):
    """Static block boundaries: part p owns blocks [bounds[p], bounds[p + 1])."""
    bounds = [0]
    for n in part_blocks:
        bounds.append(bounds[-1] + n)
    return bounds


def _decode_rows(pools, part_blocks, rows, storage):
    """bf16[N, NB * 64, 512]: every row of every block decoded (the storage's codec)."""
    E = STORAGES[storage].entry_bytes
    bounds = _part_of(part_blocks)
    out = []
    for p, pool in enumerate(pools):
        bs = pool.shape[1] // E
        ids = rows[:, bounds[p] * BLOCK : bounds[p + 1] * BLOCK]
        flat = ref_dequant_gather(pool[None], 0, (ids // bs).reshape(-1), (ids % bs).reshape(-1), storage)
        out.append(flat.reshape(*ids.shape, HEAD_DIM))
    return jnp.concatenate(out, axis=1)


def valid_rows(pools, part_blocks, rows, nvalid, storage):
    """bool[N, NB * 64]: row r of block b is valid iff r < nvalid[b] and its id names a row
    of its part's pool. An id outside the pool is masked, never clamped: a clamped id would
    read a row some other request may own (docs/reliability.md)."""
    E = STORAGES[storage].entry_bytes
    bounds = _part_of(part_blocks)
    size = jnp.concatenate(
        [
            jnp.full(((bounds[p + 1] - bounds[p]) * BLOCK,), pool.shape[0] * (pool.shape[1] // E))
            for p, pool in enumerate(pools)
        ]
    )
    counted = (jnp.arange(BLOCK)[None, None, :] < nvalid[:, :, None]).reshape(nvalid.shape[0], -1)
    return counted & (rows >= 0) & (rows < size[None, :])


def ref_partial(q, pools, part_blocks, rows, nvalid, *, storage="official", scale=None, spans=None):
    """float32 attention over the valid rows alone, no sink: (out f32[N, H, 512] normalized
    by its own sum, lse f32[N, H] natural log, -inf for a row with no valid key), the
    pieces ``merge_partials`` combines with other parts and the sink."""
    q, rows = row(q), span_rows(pools, part_blocks, rows, spans, storage)
    valid = valid_rows(pools, part_blocks, rows, nvalid, storage)
    keys = _decode_rows(pools, part_blocks, rows, storage).astype(jnp.float32)  # [N, K, D]
    keys = jnp.where(valid[..., None], keys, 0.0)  # a masked row's bytes never reach the output (NaN included)
    scale = HEAD_DIM**-0.5 if scale is None else scale
    logits = jnp.einsum("nhd,nkd->nhk", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m[..., None])
    denom = jnp.sum(p, axis=-1)
    out = jnp.einsum("nhk,nkd->nhd", p, keys, precision=lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out, jnp.where(denom > 0, jnp.log(denom) + m, -jnp.inf)


def ref_pool_attention(q, pools, part_blocks, rows, nvalid, sink, *, storage="official", scale=None, spans=None):
    """float32 reference: decode every valid row, softmax with the sink in the denominator."""
    out, lse = ref_partial(q, pools, part_blocks, rows, nvalid, storage=storage, scale=scale, spans=spans)
    return merge_partials(out[:, None, None], lse[:, None, None], sink=row(sink))[:, 0]


def row_scales(pools, part_blocks, rows, storage):
    """f32[N, NB * 8, 64]: the scale of each row's 64-dim tile t (block b's at rows
    ``b * 8 + t``; the rope tile's is 1), read from the pools (8 B per row)."""
    st = STORAGES[storage]
    seg = st.entry.segments
    bounds = _part_of(part_blocks)
    out = []
    for p, pool in enumerate(pools):
        bs = pool.shape[1] // st.entry_bytes
        off = segment_offsets(seg, bs)
        ids = rows[:, bounds[p] * BLOCK : bounds[p + 1] * BLOCK]
        blk, slot = ids // bs, ids % bs
        if storage == "official":  # UE8M0 bytes of the 7 tiles: 2^(e - 127)
            col = off[1] + slot[..., None] * seg[1] + jnp.arange(NOPE_TILES)
            e = pool[blk[..., None], col].astype(jnp.int32)
            s = lax.bitcast_convert_type(jnp.clip(e, 1, 254) << 23, jnp.float32)
        else:  # one float32 per row
            col = off[2] + slot[..., None] * seg[2] + jnp.arange(4)
            s = from_bytes(pool[blk[..., None], col], jnp.float32)
            s = jnp.broadcast_to(s, (*s.shape[:-1], NOPE_TILES))
        s = jnp.concatenate([s, jnp.ones((*s.shape[:-1], 1), jnp.float32)], axis=-1)  # [N, K_p, 8]
        n = s.shape[0]
        out.append(s.reshape(n, -1, BLOCK, TILES).transpose(0, 1, 3, 2).reshape(n, -1, BLOCK))
    return jnp.concatenate(out, axis=1)


def _partials(q, pools, part_blocks, rows, nvalid, scales, *, storage, scale, splits):
    """-> out bf16[N * splits, H, 512] (each split normalized by its own sum), lse2
    f32[N * splits, H] (base 2; -inf: no keys in the split)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    N, H, D = q.shape
    NB = sum(part_blocks)
    bounds = _part_of(part_blocks)
    st = STORAGES[storage]
    seg = st.entry.segments
    E = st.entry_bytes
    # per part: (block size, codes column of slot 0, codes bytes per slot, rope bf16 column of slot 0, per slot)
    geo = []
    for pool in pools:
        bs = pool.shape[1] // E
        off = segment_offsets(seg, bs)
        if storage == "official":  # [bs x (448 codes + 128 rope)] [bs x 8 scales]
            geo.append((bs, off[0], seg[0], (off[0] + NOPE) // 2, seg[0] // 2))
        else:  # [bs x 448 codes] [bs x 128 rope] [bs x 4 scale]
            geo.append((bs, off[0], seg[0], off[1] // 2, seg[1] // 2))
    codes_in = [lax.bitcast_convert_type(p, jnp.float8_e4m3fn) for p in pools]
    rope_in = [from_bytes(p, jnp.bfloat16) for p in pools]
    order = jnp.argsort(nvalid == 0, axis=1, stable=True).astype(i32)  # i32[N, NB] non-empty blocks first
    nblocks = jnp.sum(nvalid > 0, axis=1).astype(i32)  # i32[N]
    meta = jnp.concatenate([order, nvalid, nblocks[:, None]], axis=1)  # i32[N, 2 NB + 1]
    meta = jnp.pad(meta, ((0, 0), (0, -meta.shape[1] % 4)))
    c = scale * LOG2E
    n_parts = len(pools)
    HALF = D // 2

    def kernel(q_ref, meta_ref, rows_ref, scales_ref, *refs):
        codes_refs, rope_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
        out_ref, lse_ref, (smem, bars) = refs[2 * n_parts], refs[2 * n_parts + 1], refs[2 * n_parts + 2]
        q_smem, k_smem, codes_smem, rope_smem, scl_smem, idx_smem, meta_smem, lse_smem = smem
        (q_ready, meta_ready, idx_ready, raw_ready, raw_free, k_ready, k_free) = bars
        n, hg, s = lax.axis_index("row"), lax.axis_index("heads"), lax.axis_index("split")
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _():
            plgpu.copy_gmem_to_smem(meta_ref.at[n], meta_smem, meta_ready.at[0])
            plgpu.copy_gmem_to_smem(q_ref.at[n, pl.ds(hg * BLOCK, BLOCK)], q_smem, q_ready.at[0])

        plgpu.barrier_wait(meta_ready.at[0])
        total = meta_smem[2 * NB]
        per = lax.div(total + (splits - 1), i32(splits))
        j0 = jnp.minimum(s * per, total)
        j1 = jnp.minimum(j0 + per, total)

        def compute(w):  # compute warpgroup w: output dims [w * 256, (w + 1) * 256), its half of the tiles
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_ready.at[0])
            m = plgpu.layout_cast(jnp.full((BLOCK,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((BLOCK,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((BLOCK, HALF), 0, jnp.float32), plgpu.Layout.WGMMA)
            cols_out = pl.ds(w * HALF, HALF)

            def dequant(slot, t):  # tile t of the block in raw slot ``slot`` (static) -> k_smem
                scl = plgpu.load(
                    scl_smem[slot].at[pl.ds(t * BLOCK, BLOCK)], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False
                )
                x = plgpu.load(
                    codes_smem[slot][t // 2].at[:, pl.ds(t % 2 * 64, 64)],
                    (),
                    layout=plgpu.Layout.WGMMA,
                    optimized=False,
                )
                x = x.astype(jnp.float16).astype(jnp.float32) * lax.broadcast_in_dim(scl, (BLOCK, 64), [0])
                k_smem[:, pl.ds(t * 64, 64)] = x.astype(jnp.bfloat16)

            def step(j, carry, slot):  # block j of the list, in raw slot ``slot`` = (j - j0) % 2
                acc, m, l = carry
                b = meta_smem[j]
                nv = meta_smem[NB + b]
                plgpu.barrier_wait(raw_ready.at[slot])
                for t in range(4 * w, min(4 * w + 4, NOPE_TILES)):
                    dequant(slot, t)
                if w == 1:
                    r = plgpu.load(rope_smem[slot], (), layout=plgpu.Layout.WGMMA, optimized=False)
                    k_smem[:, pl.ds(NOPE, ROPE)] = r
                plgpu.commit_smem()
                plgpu.barrier_arrive(raw_free.at[slot])
                plgpu.barrier_arrive(k_ready)
                plgpu.barrier_wait(k_ready)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((BLOCK, BLOCK), jnp.float32))
                cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1, layout=plgpu.Layout.WGMMA)
                sc = jnp.where(cols < nv, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(sc * c - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.bfloat16)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, k_smem.at[:, cols_out])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(k_free)
                plgpu.barrier_wait(k_free)
                return acc, m_new, l

            def pair(i, carry):  # two blocks: the raw slots stay static
                carry = step(j0 + 2 * i, carry, 0)
                return step(j0 + 2 * i + 1, carry, 1)

            count = j1 - j0
            carry = lax.fori_loop(0, lax.div(count, i32(2)), pair, (acc, m, l))
            acc, m, l = lax.fori_loop(0, lax.rem(count, i32(2)), lambda i, c: step(j1 - 1, c, 0), carry)
            has = l > 0
            acc = acc / lax.broadcast_in_dim(jnp.where(has, l, 1.0), acc.shape, [0])
            k_smem[:, cols_out] = acc.astype(jnp.bfloat16)
            if w == 0:
                lse_smem[...] = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), -jnp.inf)
            plgpu.commit_smem()
            plgpu.barrier_arrive(k_ready)
            plgpu.barrier_wait(k_ready)
            if w == 0:
                row = n * splits + s
                plgpu.copy_smem_to_gmem(k_smem, out_ref.at[row, pl.ds(hg * BLOCK, BLOCK)])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, pl.ds(hg * BLOCK, BLOCK)])
                plgpu.wait_smem_to_gmem(0)

        for w in (0, 1):
            pl.when(wg == w)(functools.partial(compute, w))

        @pl.when(wg == 2)
        def _stream():
            plgpu.set_max_registers(40, action="decrease")

            def load(j, slot):  # block j of the list into raw slot ``slot`` (static)
                b = meta_smem[j]
                plgpu.copy_gmem_to_smem(rows_ref.at[n, pl.ds(b * BLOCK, BLOCK)], idx_smem[slot], idx_ready.at[slot])
                for h in range(2):  # f32[8 * 64] in two TMA boxes of 256
                    plgpu.copy_gmem_to_smem(
                        scales_ref.at[n, pl.ds(b * TILES * BLOCK + 256 * h, 256)],
                        scl_smem[slot].at[pl.ds(256 * h, 256)],
                        raw_ready.at[slot],
                    )
                plgpu.barrier_wait(idx_ready.at[slot])
                for p in range(n_parts):
                    bs, c0, cz, r0, rz = geo[p]

                    @pl.when((b >= bounds[p]) & (b < bounds[p + 1]))
                    def _():
                        @pl.loop(0, BLOCK)
                        def _(r):
                            e = idx_smem[slot][r]
                            blk, sl = lax.div(e, i32(bs)), lax.rem(e, i32(bs))
                            base = c0 + sl * cz
                            one = pl.ds(blk, 1), pl.ds(r, 1)  # 2-D boxes: Mosaic's layout inference needs them
                            for k_, w_ in enumerate(CODE_BOXES):  # one buffer per 128-byte column tile
                                plgpu.copy_gmem_to_smem(
                                    codes_refs[p].at[one[0], pl.ds(base + 128 * k_, w_)],
                                    codes_smem[slot][k_].at[one[1], pl.ds(0, w_)],
                                    raw_ready.at[slot],
                                )
                            plgpu.copy_gmem_to_smem(
                                rope_refs[p].at[one[0], pl.ds(r0 + sl * rz, ROPE)],
                                rope_smem[slot].at[one[1]],
                                raw_ready.at[slot],
                            )

            for i in range(STAGES):
                pl.when(j0 + i < j1)(functools.partial(load, j0 + i, i))

            @pl.loop(0, lax.div(jnp.maximum(j1 - j0 - STAGES, 0) + 1, i32(2)))
            def _(i):
                j = j0 + STAGES + 2 * i
                plgpu.barrier_wait(raw_free.at[0])
                load(j, 0)

                @pl.when(j + 1 < j1)
                def _():
                    plgpu.barrier_wait(raw_free.at[1])
                    load(j + 1, 1)

    def entry(*refs):
        tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((BLOCK, D), jnp.bfloat16, transforms=tiles),  # q
            plgpu.SMEM((BLOCK, D), jnp.bfloat16, transforms=tiles),  # dequantized K (then the output)
            [[plgpu.SMEM((BLOCK, 128), jnp.float8_e4m3fn)] * len(CODE_BOXES)] * STAGES,  # raw FP8 codes by 128 columns
            [plgpu.SMEM((BLOCK, ROPE), jnp.bfloat16)] * STAGES,  # raw rope dims
            [plgpu.SMEM((TILES * BLOCK,), jnp.float32)] * STAGES,  # row scales, tile-major
            [plgpu.SMEM((BLOCK,), jnp.int32)] * STAGES,  # the block's row ids
            plgpu.SMEM((meta.shape[1],), jnp.int32),
            plgpu.SMEM((BLOCK,), jnp.float32),
        )
        bars = (
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=(len(CODE_BOXES) + 1) * BLOCK + 2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, bars, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((N * splits, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((N * splits, H), jnp.float32),
        ),
        grid=(N, H // BLOCK, splits),
        grid_names=("row", "heads", "split"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, meta, rows, scales.reshape(N, -1), *codes_in, *rope_in)


def _merge_splits(out, lse, N: int, splits: int, sink):
    """Both kernels' partials (out bf16[N * splits, H, 512], each split normalized by its own
    sum; lse2 f32[N * splits, H]) merged with the sink in the denominator -> bf16[N, H, 512]."""
    _, H, D = out.shape
    out = merge_partials(out.reshape(N, splits, 1, H, D), lse.reshape(N, splits, 1, H), base2=True, sink=sink)
    return out[:, 0].astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("part_blocks", "storage", "scale", "splits", "spans"))
def pool_attention_cuda(
    q, pools, part_blocks, rows, nvalid, sink, *, storage="official", scale=None, splits=1, spans=None
):
    """The pool attention contract (module docstring) on ``jaxkv/cuda/pool_attention.cu`` through
    ``jax.ffi``; both storage families, at most ``CUDA_PARTS`` pools. ``q`` and ``sink`` may be
    ``Stacked`` rows, read in place. Needs an sm_90 GPU and nvcc (the first use builds ``cuda/``)."""
    pools = tuple(pools)
    storage = storage_name(storage)
    _check(q, pools, part_blocks, rows, nvalid, sink, storage, lowering="cuda", spans=spans)
    register_ffi_targets()
    scale = HEAD_DIM**-0.5 if scale is None else scale
    N, H, D = q.shape
    blocks = tuple(part_blocks) + (0,) * (CUDA_PARTS - len(pools))
    spans = tuple(spans or ((0, p.shape[0]) for p in pools)) + ((0, 0),) * (CUDA_PARTS - len(pools))
    pools = pools + (pools[0],) * (CUDA_PARTS - len(pools))  # unused parts own no blocks
    parts = pool_cuda_parts(H, splits)
    q_flat, q_offset = as_flat(q)
    sink_flat, sink_offset = as_flat(sink, jnp.float32)
    out, lse = jax.ffi.ffi_call(
        "jaxkv_pool_attention",
        (jax.ShapeDtypeStruct((N * parts, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((N * parts, H), jnp.float32)),
    )(
        q_flat,
        rows,
        nvalid,
        *pools,
        sink_flat,
        blocks0=np.int32(blocks[0]),
        blocks1=np.int32(blocks[1]),
        blocks2=np.int32(blocks[2]),
        splits=np.int32(splits),
        scale=np.float32(scale),
        storage=np.int32(STORAGE_CODES[storage]),
        q_offset=np.int64(q_offset),
        sink_offset=np.int64(sink_offset),
        **{f"{k}{p}": np.int64(v) for p, span in enumerate(spans) for k, v in zip(("first", "count"), span)},
    )
    return out if parts == 1 else _merge_splits(out, lse, N, parts, row(sink))  # one partial: the sink is in


@functools.partial(jax.jit, static_argnames=("part_blocks", "storage", "scale", "splits", "spans"))
def pool_attention_flashmla(
    q, pools, part_blocks, rows, nvalid, sink, *, storage="official", scale=None, splits=1, spans=None
):
    """The pool attention contract on FlashMLA's sm90 sparse FP8 decode through ``jax.ffi``
    (``jaxkv.cuda.flashmla``: built from ``$FLASHMLA_SRC`` on first use; Hopper, official
    storage, 64 or 128 heads). FlashMLA reads two pools, its cache and its extra cache:
    parts 0 and 1, each row a pool-wide id with -1 past ``nvalid``, and with them the sink.
    A third part (the step's own tokens in ``hybrid.attention``) is attended by XLA
    (``ref_partial``) and merged with FlashMLA's (out, lse) and the sink by log-sum-exp
    here. ``splits`` is unused: FlashMLA plans its own split-KV schedule (a scheduler launch
    per call, then its decode and combine kernels). A decode kernel: its scratch holds float32
    partials of (N + SMs) x H x 512 per call (N query rows), so long prefill chunks belong on
    ``pool_attention_cuda``."""
    pools, q, sink = tuple(pools), row(q), row(sink)
    storage = storage_name(storage)
    if storage != "official" or q.ndim != 3 or q.shape[1] not in flashmla.HEADS:
        raise ValueError(
            f"q, storage: FlashMLA's MODEL1 decode expects official storage and {flashmla.HEADS} "
            f"heads, got {storage!r} and q {q.dtype}{list(q.shape)}"
        )
    _check(q, pools, part_blocks, rows, nvalid, sink, storage, lowering="cuda", spans=spans)
    rows = span_rows(pools, part_blocks, rows, spans, storage)
    N, H, D = q.shape
    flashmla.register_ffi_target()
    scale = HEAD_DIM**-0.5 if scale is None else scale
    E = STORAGES[storage].entry_bytes
    bounds = _part_of(part_blocks)
    valid = valid_rows(pools, part_blocks, rows, nvalid, storage)
    part_ids = []  # i32[N, 1, K_p]: -1 (skipped by FlashMLA) where not valid, as cuda/ skips
    for p in range(min(len(pools), 2)):
        r, v = (x[:, bounds[p] * BLOCK : bounds[p + 1] * BLOCK] for x in (rows, valid))
        part_ids.append(jnp.where(v, r, -1)[:, None])
    extra = len(pools) > 1
    sm_parts = flashmla_sm_parts(H)
    f32 = jnp.float32
    out, lse = jax.ffi.ffi_call(
        flashmla.FFI_TARGET,
        (
            jax.ShapeDtypeStruct((N, 1, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((N, 1, H), f32),
            jax.ShapeDtypeStruct((sm_parts, 8), i32),
            jax.ShapeDtypeStruct((N + 1,), i32),
            jax.ShapeDtypeStruct((N + sm_parts, 1, H), f32),
            jax.ShapeDtypeStruct((N + sm_parts, 1, H, D), f32),
        ),
    )(
        q[:, None],
        pools[0],
        part_ids[0],
        pools[1 if extra else 0],
        part_ids[1 if extra else 0],
        jnp.asarray(sink, f32),
        block_size=np.int32(pools[0].shape[1] // E),
        extra_block_size=np.int32(pools[1].shape[1] // E if extra else 0),
        scale=np.float32(scale),
        with_sink=np.int32(len(pools) <= 2),
    )[:2]
    if len(pools) <= 2:  # the sink is in
        return out[:, 0]
    o, l = ref_partial(
        q,
        pools[2:],
        part_blocks[2:],
        rows[:, bounds[2] * BLOCK :],
        nvalid[:, bounds[2] :],
        storage=storage,
        scale=scale,
    )
    lse = jnp.where(lse[:, 0] == jnp.inf, -jnp.inf, lse[:, 0])  # FlashMLA's lse: +inf for no key
    out = merge_partials(
        jnp.stack([out[:, 0].astype(f32), o], 1)[:, :, None], jnp.stack([lse, l], 1)[:, :, None], sink=sink
    )
    return out[:, 0].astype(jnp.bfloat16)


def _valid_first(pools, part_blocks, rows, nvalid, storage):
    """Each block's valid rows first (``valid_rows``), the rest id -1, and its count the valid
    rows': the Mosaic GPU kernel masks by count alone, and a masked row still enters ``P V``
    with weight 0 (0 x NaN is NaN). Its loads are TMA, which fill a box outside the pool
    with zeros: an id -1 reads nothing, so no byte of a row it may not see reaches it."""
    N = rows.shape[0]
    valid = valid_rows(pools, part_blocks, rows, nvalid, storage).reshape(N, -1, BLOCK)
    order = jnp.argsort(~valid, axis=-1, stable=True)
    rows = jnp.take_along_axis(rows.reshape(N, -1, BLOCK), order, axis=-1)
    count = jnp.sum(valid, axis=-1, dtype=i32)
    rows = jnp.where(jnp.arange(BLOCK) < count[..., None], rows, -1).reshape(N, -1)
    return rows, count


@functools.partial(jax.jit, static_argnames=("part_blocks", "storage", "scale", "splits", "spans"))
def pool_attention_pallas(
    q, pools, part_blocks, rows, nvalid, sink, *, storage="official", scale=None, splits=1, spans=None
):
    """The Mosaic GPU kernel (module docstring: shapes). ``part_blocks``: blocks of each part, static."""
    pools, q, sink = tuple(pools), row(q), row(sink)
    _check(q, pools, part_blocks, rows, nvalid, sink, storage, spans=spans)
    rows = span_rows(pools, part_blocks, rows, spans, storage)
    scale = HEAD_DIM**-0.5 if scale is None else scale
    rows, nvalid = _valid_first(pools, part_blocks, rows, nvalid, storage)
    scales = row_scales(pools, part_blocks, rows, storage)
    out, lse = _partials(
        q, pools, part_blocks, rows, nvalid, scales, storage=storage, scale=float(scale), splits=splits
    )
    return _merge_splits(out, lse, q.shape[0], splits, sink)


__all__ = [
    "pool_attention_cuda",
    "pool_attention_flashmla",
    "pool_attention_pallas",
    "ref_partial",
    "ref_pool_attention",
    "row_scales",
    "span_rows",
]
