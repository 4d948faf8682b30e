"""Lightning-indexer scores over FP4 indexer keys read in place (Hopper, Mosaic GPU lowering).

DeepSeek-V4's indexer scores every visible compressed entry ``s`` of a request for each
query row: ``I[n, s] = sum_h w[n, h] * relu(q[n, h] . K[s])``. In XLA that means a BF16
copy of every key and an f32 ``[N, H, entries]`` product written and read back, which
makes it the largest part of a long-context decode step (docs/kernels/index_scores.md:
the measurements behind this kernel's choices). This kernel reads each request's
pages of packed E2M1 codes (64 B per 128-dim key) straight from the pool into registers:
a page's codes are one contiguous ``[block_size, 64]`` slab, so no row gather is needed.
The loads are plain ones, the next tile in flight while one computes, not TMA: with its
scale bytes a page is not a whole number of TMA's 8-row tiles, and Pallas does not expose
TMA's rounding of the global shape. A tile of 64 keys is decoded in registers, multiplied
on the tensor cores (``wgmma`` with the keys as the register operand) and reduced over
heads in registers: the codes are read once and one f32 per entry is written.

Packed byte ``c`` of a key holds dims ``2c`` (low nibble) and ``2c + 1`` (high). The kernel
decodes the low and the high nibbles as two 64-column halves and multiplies them by q's
even and odd dims (split beforehand by XLA). The group scales (MXFP4: UE8M0 per 32 dims;
per_entry's NVFP4: E4M3 per 16 times the key's float32 global scale) are gathered and
turned into one f32 multiplier per group by XLA first (4 or 8 per key beside its 64 code
bytes). The kernel multiplies them in float32 as the storage's decoder does, so its BF16
keys equal the reference's bit for bit; only the summation order of the dot products and
of the head sum differs from ``ref_index_scores``.

    q: bf16[N, H, D]          indexer queries, one row per (request, token): row n belongs to
                              request n // T; H a multiple of 64, D = 128
    weights: f32[N, H]        per-head weights (or a ``jaxkv.stacked.Stacked`` row; the CUDA
                              kernel reads it in place)
    pool: u8[L, P, bs * Kb]   every CSA layer's indexer keys (``HybridCacheState.index_keys``);
                              layer ``layer`` is read; bs a multiple of 64
    pages: i32[B, NP]         physical page of each logical page of request b (any value where
                              the page holds no counted entry)
    count: i32[N]             entries row n sees: entries [0, count)
    -> f32[N, NP * bs]        the scores; -inf at and past count, and on pages outside the pool

``ref_index_scores`` is the float32 reference with the same contract. ``index_scores_cuda``
is the same contract in ``jaxkv/cuda/index_scores.cu`` (faster: it also reads the scale
bytes in place; ``auto`` where nvcc is found). Neither has an interpret mode: the tests run
them on a GPU; elsewhere the hybrid cache uses XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cuda import STORAGE_CODES, register_ffi_targets
from jaxkv.formats.numerics import e8m0_to_float
from jaxkv.formats.storage import STORAGES, from_bytes, segment_offsets
from jaxkv.kernels.launch import launch
from jaxkv.stacked import as_flat, row

TILE = 64  # keys per tile: the wgmma M; also heads per wgmma N
i32 = jnp.int32


def _geometry(pool, storage: str, dim: int):
    """(block_size, code bytes per key, groups per key) of an indexer-key pool."""
    codec = STORAGES[storage].index_key(dim)
    return pool.shape[2] // codec.bytes, codec.segments[0], codec.segments[1]


def check(q, weights, pool, layer, pages, count, storage):
    """Trace-time validation: a ``ValueError`` naming the argument."""
    if q.ndim != 3 or q.shape[1] % TILE or q.shape[2] != 128 or q.dtype != jnp.bfloat16:
        raise ValueError(f"q: expected bf16[N, H, 128] with H a multiple of {TILE}, got {q.dtype}{list(q.shape)}")
    N, H, D = q.shape
    if weights.shape != (N, H):
        raise ValueError(f"weights: expected f32[{N}, {H}], got {weights.dtype}{list(weights.shape)}")
    if storage not in STORAGES:
        raise ValueError(f"storage: expected one of {sorted(STORAGES)}, got {storage!r}")
    Kb = STORAGES[storage].index_key(D).bytes
    if pool.ndim != 3 or pool.dtype != jnp.uint8 or pool.shape[2] % (TILE * Kb):
        raise ValueError(
            f"pool: expected u8[layers, pages, block_size * {Kb}] ({storage}) with block_size a "
            f"multiple of {TILE}, got {pool.dtype}{list(pool.shape)}"
        )
    if not 0 <= layer < pool.shape[0]:
        raise ValueError(f"layer: expected 0 <= layer < {pool.shape[0]}, got {layer}")
    if pages.ndim != 2 or pages.dtype != jnp.int32 or N % pages.shape[0]:
        raise ValueError(
            f"pages: expected int32[B, pages_per_request] with B dividing {N}, got {pages.dtype}{list(pages.shape)}"
        )
    if count.shape != (N,) or count.dtype != jnp.int32:
        raise ValueError(f"count: expected int32[{N}], got {count.dtype}{list(count.shape)}")


def group_multipliers(pool, layer: int, pages, *, storage: str, dim: int = 128):
    """f32[B, G, NP * bs]: each key's per-group dequantization multiplier, in key order
    (UE8M0 ``2^(e-127)``; per_entry: E4M3 scale times the key's global scale, one product
    as ``dequantize_nvfp4`` forms it). Reads only the scale bytes of each page."""
    codec = STORAGES[storage].index_key(dim)
    bs, _, G = _geometry(pool, storage, dim)
    off = segment_offsets(codec.segments, bs)
    B, NP = pages.shape
    ids = jnp.clip(pages, 0, pool.shape[1] - 1).reshape(-1)

    def take(o, n):  # u8[B, NP, bs, n / bs]: bytes [o, o + n) of each page
        row = jax.vmap(lambda p: lax.dynamic_slice(pool, (layer, p, o), (1, 1, n))[0, 0])(ids)
        return row.reshape(B, NP, bs, n // bs)

    if storage == "official":
        m = e8m0_to_float(take(off[1], bs * G))
    else:
        s = from_bytes(take(off[1], bs * G), jnp.float8_e4m3fn).astype(jnp.float32)
        m = s * from_bytes(take(off[2], bs * 4), jnp.float32)
    return m.transpose(0, 3, 1, 2).reshape(B, G, NP * bs)


def counted(pages, count, num_pages: int, bs: int):
    """bool[N, NP * bs]: row n scores entry s iff s < count[n] and the page holding s is one of
    the pool's ``num_pages``. An entry on a page outside the pool is masked (-inf), never read
    from a clamped page some other request may own (docs/reliability.md)."""
    B, NP = pages.shape
    N = count.shape[0]
    in_pool = jnp.repeat((pages >= 0) & (pages < num_pages), bs, axis=1)  # [B, NP * bs]
    return (jnp.arange(NP * bs)[None, :] < count[:, None]) & jnp.repeat(in_pool, N // B, axis=0)


def ref_index_scores(q, weights, pool, layer, pages, count, *, storage="official"):
    """float32 reference: decode every key of every page (the storage's codec), then
    ``sum_h w * relu(q . k)``; -inf at and past count."""
    check(q, weights, pool, layer, pages, count, storage)
    N, H, D = q.shape
    B, NP = pages.shape
    codec = STORAGES[storage].index_key(D)
    bs = pool.shape[2] // codec.bytes
    segs = []
    for o, z in zip(segment_offsets(codec.segments, bs), codec.segments):  # page [seg0 x bs][seg1 x bs]...
        segs.append(pool[layer, jnp.clip(pages, 0, pool.shape[1] - 1), o : o + z * bs].reshape(B, NP * bs, z))
    keys = codec.decode(jnp.concatenate(segs, axis=-1)).astype(jnp.bfloat16)  # [B, NP * bs, D]
    keys = jnp.repeat(keys, N // B, axis=0).astype(jnp.float32)
    dots = jnp.einsum("nhd,nsd->nhs", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST)
    w = row(weights).astype(jnp.float32)
    s = jnp.einsum("nhs,nh->ns", jax.nn.relu(dots), w, precision=lax.Precision.HIGHEST)
    return jnp.where(counted(pages, count, pool.shape[1], bs), s, -jnp.inf)


def _tile_meta(pages, count, rows_per_request, tiles_per_program, bs, num_pages):
    """i32[N, chunks, W]: per row and chunk of ``tiles_per_program`` tiles, each tile's page
    (clamped into the pool: the kernel's loads are plain ones, and ``counted`` masks what a
    clamped page gives), then (at ``tiles_per_program``) how many of the chunk's tiles hold
    counted entries."""
    B, NP = pages.shape
    sub = bs // TILE
    NT = NP * sub
    chunks = -(-NT // tiles_per_program)
    tile_page = jnp.repeat(pages, sub, axis=1)  # [B, NT]
    tile_page = jnp.pad(tile_page, ((0, 0), (0, chunks * tiles_per_program - NT)))
    tile_page = jnp.repeat(tile_page.reshape(B, chunks, tiles_per_program), rows_per_request, axis=0)
    need = (count + TILE - 1) // TILE  # tiles row n computes
    todo = jnp.clip(need[:, None] - jnp.arange(chunks)[None, :] * tiles_per_program, 0, tiles_per_program)
    meta = jnp.concatenate([jnp.clip(tile_page, 0, num_pages - 1), todo[..., None].astype(i32)], axis=2)
    return jnp.pad(meta, ((0, 0), (0, 0), (0, -meta.shape[2] % 32)))  # TMA: a multiple of 128 bytes


def _scores(q2, weights, codes, mult, meta, *, layer, rows_per_request, tiles_per_program, groups, sub):
    """f32[N, chunks * tiles_per_program * 64] raw scores (tiles past count: garbage)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    N, _, H, HALF = q2.shape  # q2: bf16[N, 2, H, 64] even dims, odd dims
    chunks = meta.shape[1]
    TPC = tiles_per_program
    GW = HALF // groups  # code bytes (columns) per scale group
    L = plgpu.Layout.WGMMA
    ROW, COL = L.reduce(1), L.reduce(0)

    def decode(code):  # i32 E2M1 codes (sign in bit 3) -> f32, as formats.fp4.e2m1_decode
        mag = code & 7
        f = mag.astype(jnp.float32)
        v = jnp.where(mag < 4, f * 0.5, f - 2.0 + jnp.where(mag == 7, 1.0, 0.0))
        return jnp.where((code & 8) != 0, -v, v)

    def kernel(q_ref, w_ref, meta_ref, codes_ref, mult_ref, out_ref, scoped):
        (q_smem, w_smem, meta_smem, out_smem), ready = scoped
        n, ch = lax.axis_index("row"), lax.axis_index("chunk")
        b = lax.div(n, i32(rows_per_request))
        plgpu.copy_gmem_to_smem(meta_ref.at[n, ch], meta_smem, ready.at[0])
        plgpu.copy_gmem_to_smem(q_ref.at[n], q_smem, ready.at[0])
        plgpu.copy_gmem_to_smem(w_ref.at[n], w_smem, ready.at[0])
        plgpu.barrier_wait(ready.at[0])
        todo = meta_smem[TPC]

        def fetch(i):  # tile i of the chunk, straight from GMEM into registers (a page's codes are rows of 64 B)
            t = ch * TPC + i
            rows = pl.ds(lax.rem(t, i32(sub)) * TILE, TILE)
            code = plgpu.load(codes_ref.at[layer, meta_smem[i], rows], (), layout=L, optimized=False)
            mult = tuple(
                plgpu.load(mult_ref.at[b, g, pl.ds(t * TILE, TILE)], (), layout=ROW, optimized=False)
                for g in range(groups)
            )
            return code, mult

        cols = plgpu.broadcasted_iota(i32, (TILE, HALF), 1, layout=L)

        def body(i, tile):
            code, mult = tile
            nxt = fetch(jnp.minimum(i + 1, todo - 1))  # in flight while this tile computes
            code = code.astype(i32)  # [64 keys, 64 bytes]
            mul = None
            for g in range(groups):
                m = lax.broadcast_in_dim(mult[g], (TILE, HALF), [0])
                mul = m if mul is None else jnp.where(cols >= g * GW, m, mul)
            lo = (decode(code & 15) * mul).astype(jnp.bfloat16)  # dims 0, 2, ..
            hi = (decode(lax.shift_right_logical(code, 4) & 15) * mul).astype(jnp.bfloat16)  # dims 1, 3, ..
            score = None
            for hb in range(H // TILE):
                heads = pl.ds(hb * TILE, TILE)

                def dots(acc_ref):
                    plgpu.wgmma(acc_ref, lo, q_smem.at[0, heads].transpose((1, 0)))
                    plgpu.wgmma(acc_ref, hi, q_smem.at[1, heads].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(dots, plgpu.ACC((TILE, TILE), jnp.float32))  # [64 keys, 64 heads]
                w = lax.broadcast_in_dim(
                    plgpu.load(w_smem.at[heads], (), layout=COL, optimized=False), (TILE, TILE), [1]
                )
                part = (jnp.maximum(s, 0.0) * w).sum(axis=1)
                score = part if score is None else score + part
            out_smem[pl.ds(i * TILE, TILE)] = score
            return nxt

        lax.fori_loop(0, todo, body, fetch(0))  # tile 0's page is in range even when todo is 0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[n, pl.ds(ch * (TPC * TILE), TPC * TILE)])
        plgpu.wait_smem_to_gmem(0)

    def entry(*refs):
        swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((2, H, HALF), jnp.bfloat16, transforms=swz),  # q: even dims, odd dims
            plgpu.SMEM((H,), jnp.float32),
            plgpu.SMEM((meta.shape[2],), i32),
            plgpu.SMEM((TPC * TILE,), jnp.float32),
        )
        pl.run_scoped(
            lambda *scoped: kernel(*refs, (scoped[:4], scoped[4])), *smem, plgpu.Barrier(num_arrivals=3, num_barriers=1)
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((N, chunks * TPC * TILE), jnp.float32),
        grid=(N, chunks),
        grid_names=("row", "chunk"),
    )(q2, weights, meta, codes, mult)


@functools.partial(jax.jit, static_argnames=("layer", "storage"))
def index_scores(q, weights, pool, layer, pages, count, *, storage="official"):
    """The kernel with ``ref_index_scores``' contract."""
    check(q, weights, pool, layer, pages, count, storage)
    N, H, D = q.shape
    B, NP = pages.shape
    bs, code_bytes, groups = _geometry(pool, storage, D)
    tpc = launch("index_scores")["tiles"]
    meta = _tile_meta(pages, count, N // B, tpc, bs, pool.shape[1])
    mult = group_multipliers(pool, layer, pages, storage=storage, dim=D)
    codes = pool.reshape(pool.shape[0], pool.shape[1], pool.shape[2] // code_bytes, code_bytes)  # rows of 64 B
    q2 = q.reshape(N, H, D // 2, 2).transpose(0, 3, 1, 2)  # [N, 2, H, 64]: even dims, odd dims
    raw = _scores(
        q2,
        row(weights).astype(jnp.float32),
        codes,
        mult,
        meta,
        layer=layer,
        rows_per_request=N // B,
        tiles_per_program=tpc,
        groups=groups,
        sub=bs // TILE,
    )
    return jnp.where(counted(pages, count, pool.shape[1], bs), raw[:, : NP * bs], -jnp.inf)


@functools.partial(jax.jit, static_argnames=("layer", "storage"))
def index_scores_cuda(q, weights, pool, layer, pages, count, *, storage="official"):
    """The contract above on ``jaxkv/cuda/index_scores.cu`` through ``jax.ffi``: the scale
    bytes are read in the kernel too (no multipliers from XLA), the masking is the kernel's,
    and H is 64 or 128. Needs an sm_90 GPU and nvcc (the first use builds ``cuda/``)."""
    check(q, weights, pool, layer, pages, count, storage)
    if q.shape[1] > 2 * TILE:
        raise ValueError(f"q: expected 64 or 128 heads for the CUDA kernel, got {q.shape[1]}")
    register_ffi_targets()
    N = q.shape[0]
    bs = _geometry(pool, storage, q.shape[2])[0]
    w, w_offset = as_flat(weights, jnp.float32)
    return jax.ffi.ffi_call("jaxkv_index_scores", jax.ShapeDtypeStruct((N, pages.shape[1] * bs), jnp.float32))(
        q,
        w,
        pool,
        pages,
        count,
        layer=np.int32(layer),
        storage=np.int32(STORAGE_CODES[storage]),
        tiles=np.int32(launch("index_scores_cuda")["tiles"]),
        w_offset=np.int64(w_offset),
    )


__all__ = ["TILE", "check", "counted", "group_multipliers", "index_scores", "index_scores_cuda", "ref_index_scores"]
