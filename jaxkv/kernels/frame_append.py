"""Frame append: one frame's K/V for every layer written into the frame cache in one launch.

XLA writes a frame as one dynamic-update-slice per buffer and row run (specials, then
patches): 4 * layers * streams small kernels, launch-bound (docs/kernels/frame_append.md). This
kernel (Pallas, Mosaic GPU lowering: ``pl.kernel`` over a ``plgpu.Mesh``) writes them all from one grid:

    program (i, s): buffer i (K or V of one layer and stream), chunks [s * slots, (s + 1) * slots)
    of that stream's writes (specials, then the patch page, then the page's zero padding).

A chunk is ``rows`` contiguous rows (``launch``): one bulk copy (``cp.async.bulk``, no
tensor map, so a row may be any multiple of 16 bytes) into shared memory, one back out at
the destination row; a program puts all its reads in flight before its first write, and
reads its destination rows as two scalars from GMEM (no staging copy to wait for). It waits
only for its writes to leave shared memory: the kernel's end makes them visible.
Buffers are passed as ``jax.Ref``s, so the kernel updates them in place. ``ref_write_frame`` is the plain-jnp
reference with the same contract. Shapes::

    k_bufs, v_bufs: L x dtype[B, T, H*D]   the cache (``FrameCacheState.k`` / ``.v``, heads flattened)
    k, v: dtype[L, B, NS + P, H*D]          the frame, specials first
    special_row, patch_row: i32[B]           where the specials / the patch page go, clipped
                                             into the buffer (``clip_rows``)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cuda import call_in_place
from jaxkv.formats.fp8 import quantize_fp8_rows
from jaxkv.kernels.launch import launch


def _check(k_bufs, v_bufs, k, v, special_row, patch_row, num_special, page_size):
    L, B, tpf, hd = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: expected {k.dtype}{list(k.shape)} like k, got {v.dtype}{list(v.shape)}")
    if len(k_bufs) != L or len(v_bufs) != L:
        raise ValueError(f"k_bufs, v_bufs: expected {L} buffers each, got {len(k_bufs)} and {len(v_bufs)}")
    T = k_bufs[0].shape[1] if k_bufs and k_bufs[0].ndim == 3 else "rows"
    for b in (*k_bufs, *v_bufs):
        if b.ndim != 3 or b.shape[0] != B or b.shape[1] != T or b.shape[2] != hd or b.dtype != k.dtype:
            raise ValueError(f"k_bufs, v_bufs: expected {k.dtype}[{B}, {T}, {hd}] each, got {b.dtype}{list(b.shape)}")
    _check_placement(special_row, patch_row, B, tpf, T if k_bufs else None, num_special, page_size, "k_bufs, v_bufs")


def _check_placement(special_row, patch_row, B, tpf, T, num_special, page_size, bufs_name):
    """Both writers' rule for where a frame goes: i32[B] rows, a page that holds the
    patches, and buffers of ``T`` rows (None: none to check) that hold a page and the specials."""
    for name, r in (("special_row", special_row), ("patch_row", patch_row)):
        if r.shape != (B,) or r.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32[{B}], got {r.dtype}{list(r.shape)}")
    if not 0 <= num_special <= tpf or page_size < tpf - num_special:
        raise ValueError(
            f"num_special, page_size: expected 0 <= {num_special} <= {tpf} and page_size >= "
            f"{tpf - num_special} patches, got page_size {page_size}"
        )
    if T is not None and T < max(page_size, num_special):
        raise ValueError(
            f"{bufs_name}: expected at least {max(page_size, num_special)} rows (a page, the specials), got {T}"
        )


def clip_rows(special_row, patch_row, rows: int, *, num_special: int, page_size: int):
    """The destination rows clipped so that both runs land inside a buffer of ``rows`` rows:
    the one rule of both paths. A negative row clips to 0 (``dynamic_update_slice`` alone
    would count it from the buffer's end first)."""
    return jnp.clip(special_row, 0, rows - num_special), jnp.clip(patch_row, 0, rows - page_size)


def write_rows(buf, x, special_row, patch_row, *, num_special: int, page_size: int):
    """One buffer, in jnp: each stream's specials at ``special_row``, its patches (zero-padded
    to ``page_size`` rows) at ``patch_row`` — two dynamic-update-slices per stream.

    buf: dtype[B, T, ...];  x: [B, NS + P, ...];  special_row, patch_row: i32[B]
    """
    P = x.shape[1] - num_special
    special_row, patch_row = clip_rows(
        special_row, patch_row, buf.shape[1], num_special=num_special, page_size=page_size
    )
    lead = (0,) * (buf.ndim - 2)
    x = x.astype(buf.dtype)
    for b in range(buf.shape[0]):
        if num_special:
            buf = lax.dynamic_update_slice(buf, x[b : b + 1, :num_special], (b, special_row[b]) + lead)
        page = x[b : b + 1, num_special:]
        if page_size > P:  # a page's padding rows are zeros
            page = jnp.concatenate([page, jnp.zeros((1, page_size - P) + page.shape[2:], page.dtype)], axis=1)
        buf = lax.dynamic_update_slice(buf, page, (b, patch_row[b]) + lead)
    return buf


def ref_write_frame(k_bufs, v_bufs, k, v, special_row, patch_row, *, num_special: int, page_size: int):
    """The jnp reference (``jaxkv.frame``'s XLA path): ``write_rows`` on every buffer."""
    _check(k_bufs, v_bufs, k, v, special_row, patch_row, num_special, page_size)
    put = functools.partial(
        write_rows, special_row=special_row, patch_row=patch_row, num_special=num_special, page_size=page_size
    )
    return tuple(map(put, k_bufs, k)), tuple(map(put, v_bufs, v))


def _runs(num_special: int, page_size: int, tpf: int, rows: int):
    """A stream's writes as static runs ``(source row or None for zeros, which of
    (special_row, patch_row) the destination counts from, offset from it, rows, chunk)``,
    each cut into chunks of ``chunk`` rows: chunk ``c`` of a run covers
    ``[min(c * chunk, rows - chunk), + chunk)`` (the last one overlaps its neighbour rather
    than being shorter, so every copy in a run has one static shape)."""
    P = tpf - num_special
    runs = ((0, 0, 0, num_special), (num_special, 1, 0, P), (None, 1, P, page_size - P))
    return tuple((src, anchor, off, n, min(rows, n)) for src, anchor, off, n in runs if n > 0)


def _write_frame_kernel(k, v, special_row, patch_row, bufs, *, num_special: int, page_size: int, R: int, slots: int):
    # k, v: dtype[L, B, tpf, hd]; special_row, patch_row: i32[B];
    # bufs: 2L refs dtype[B, T, hd], written in place
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    L, B, tpf, hd = k.shape
    runs = _runs(num_special, page_size, tpf, R)
    firsts = [0]
    for *_, n, c in runs:
        firsts.append(firsts[-1] + pl.cdiv(n, c))
    splits = pl.cdiv(firsts[-1], slots)  # programs per (buffer, stream), ``slots`` chunks each
    zero_rows = max((c for src, *_, c in runs if src is None), default=0)
    unit = 1024 // math.gcd(hd, 1024)  # a register store fills whole 1024-element tiles
    zero_alloc = max(-(-zero_rows // unit) * unit, 1)

    def body(special_ref, patch_ref, k_ref, v_ref, *refs):
        outs, (stage, zeros, ready) = refs[: 2 * L], refs[2 * L]
        i, s = lax.axis_index("buffer"), lax.axis_index("split")
        if zero_rows:
            zeros[...] = jnp.zeros(zeros.shape, zeros.dtype)
            plgpu.commit_smem()

        for idx in range(2 * L * B):  # static: one branch per buffer and stream
            kv, rest = divmod(idx, L * B)
            l, b = divmod(rest, B)
            src, dst = (k_ref, v_ref)[kv].at[l, b], outs[kv * L + l].at[b]

            def chunks(issue, anchors, src=src, dst=dst):
                for q in range(slots):
                    g = s * slots + q  # this slot's chunk of the stream's writes
                    for r, (src_row, anchor, off, n, c) in enumerate(runs):
                        first = jnp.minimum((g - firsts[r]) * c, n - c)
                        base = anchors[anchor] + off
                        pl.when((g >= firsts[r]) & (g < firsts[r + 1]))(
                            functools.partial(issue, q, src_row, c, first, base, src, dst)
                        )

            def load(q, src_row, c, first, base, src, dst):
                if src_row is not None:
                    plgpu.copy_gmem_to_smem(
                        src.at[pl.ds(src_row + first, c)],
                        stage.at[q, pl.ds(0, c)],
                        ready.at[q],
                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
                    )

            def store(q, src_row, c, first, base, src, dst):
                if src_row is None:
                    plgpu.copy_smem_to_gmem(zeros.at[pl.ds(0, c)], dst.at[pl.ds(base + first, c)])
                else:
                    plgpu.barrier_wait(ready.at[q])
                    plgpu.copy_smem_to_gmem(stage.at[q, pl.ds(0, c)], dst.at[pl.ds(base + first, c)])

            @pl.when(i == idx)
            def _(chunks=chunks, b=b):
                anchors = (special_ref[b], patch_ref[b])  # scalar loads from GMEM, no staging copy
                chunks(load, anchors)  # every slot's read in flight before the first write
                chunks(store, anchors)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage may go; the writes land by kernel end

    scratch = (
        plgpu.SMEM((slots, R, hd), k.dtype),
        plgpu.SMEM((zero_alloc, hd), k.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=slots),
    )
    # pl.kernel, not plgpu.kernel: the latter's vmap wrapper does not take Ref operands (jax 0.10)
    mesh = plgpu.Mesh(grid=(2 * L * B, splits), grid_names=("buffer", "split"))
    pl.kernel(
        lambda *refs: pl.run_scoped(lambda *s: body(*refs, s), *scratch),
        out_type=(),
        mesh=mesh,
        name="jaxkv_frame_append",
    )(special_row, patch_row, k, v, *bufs)


@functools.partial(jax.jit, static_argnames=("num_special", "page_size"), donate_argnums=(0, 1))
def write_frame(k_bufs, v_bufs, k, v, special_row, patch_row, *, num_special: int, page_size: int):
    """Mosaic GPU: write the frame into every layer's K and V buffer in one launch (see the
    module docstring); bytes equal ``ref_write_frame``'s."""
    _check(k_bufs, v_bufs, k, v, special_row, patch_row, num_special, page_size)
    L, B = k.shape[:2]
    T = k_bufs[0].shape[1]
    # clipped in XLA, where the rows are made: the kernel's scalar min / max compare int32
    # unsigned in this lowering
    special_row, patch_row = clip_rows(special_row, patch_row, T, num_special=num_special, page_size=page_size)
    tune = launch("frame_append")
    bufs = [jax.new_ref(b) for b in (*k_bufs, *v_bufs)]
    _write_frame_kernel(
        k,
        v,
        special_row,
        patch_row,
        bufs,
        num_special=num_special,
        page_size=page_size,
        R=tune["rows"],
        slots=tune["slots"],
    )
    out = [r[...] for r in bufs]
    return tuple(out[:L]), tuple(out[L:])


# ---------------------------------------------------------------- an FP8 cache: quantized as written
def _check_fp8(codes, scales, k, v, special_row, patch_row, num_special, page_size):
    L, B, tpf, H, D = k.shape if k.ndim == 5 else (None,) * 5
    if k.ndim != 5 or D != 64 or k.dtype != jnp.bfloat16 or v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(
            f"k, v: expected bfloat16[L, B, tokens, H, 64] each, got {k.dtype}{list(k.shape)}, {v.dtype}{list(v.shape)}"
        )
    for name, bufs, want, dtype in (
        ("codes", codes, (B, None, H, D), jnp.float8_e4m3fn),
        ("scales", scales, (B, None, H), jnp.bfloat16),
    ):
        if len(bufs) != 2 * L:
            raise ValueError(f"{name}: expected {2 * L} buffers (K for each layer, then V), got {len(bufs)}")
        T = bufs[0].shape[1] if bufs[0].ndim > 1 else None
        for i, b in enumerate(bufs):
            if b.dtype != dtype or b.ndim != len(want) or b.shape != tuple(T if w is None else w for w in want):
                raise ValueError(
                    f"{name}[{i}]: expected {jnp.dtype(dtype).name}{[T if w is None else w for w in want]}, got {b.dtype}{list(b.shape)}"
                )
    if scales[0].shape[1] != codes[0].shape[1]:
        raise ValueError(f"scales: expected {codes[0].shape[1]} rows as the codes, got {scales[0].shape[1]}")
    _check_placement(special_row, patch_row, B, tpf, codes[0].shape[1], num_special, page_size, "codes, scales")


def ref_write_frame_fp8(codes, scales, k, v, special_row, patch_row, *, num_special: int, page_size: int):
    """The jnp reference of ``write_frame_fp8``: ``quantize_fp8_rows``, then ``write_rows``
    into every buffer. -> (codes, scales), each K's L buffers then V's."""
    _check_fp8(codes, scales, k, v, special_row, patch_row, num_special, page_size)
    L = k.shape[0]
    (kq, ks), (vq, vs) = quantize_fp8_rows(k), quantize_fp8_rows(v)
    put = functools.partial(
        write_rows, special_row=special_row, patch_row=patch_row, num_special=num_special, page_size=page_size
    )
    q, sc = [*kq, *vq], [*ks, *vs]
    return tuple(put(codes[i], q[i]) for i in range(2 * L)), tuple(put(scales[i], sc[i]) for i in range(2 * L))


def write_frame_fp8(codes, scales, k, v, special_row, patch_row, *, num_special: int, page_size: int):
    """An FP8 cache's frame write from one launch (``jaxkv/cuda/frame_write_fp8.cu``): the
    bf16 frame quantized per row and head as it is written; bytes equal ``ref_write_frame_fp8``'s.

    codes: 2L x float8_e4m3fn[B, T, H, 64]  K's layers, then V's (the cache, in place)
    scales: 2L x bf16[B, T, H]              the same order
    k, v: bf16[L, B, NS + P, H, 64]          the frame, specials first
    special_row, patch_row: i32[B]            where the specials / the patch page go (clipped here)
    """
    _check_fp8(codes, scales, k, v, special_row, patch_row, num_special, page_size)
    L = k.shape[0]
    T = codes[0].shape[1]
    special_row, patch_row = clip_rows(special_row, patch_row, T, num_special=num_special, page_size=page_size)
    attrs = dict(num_special=np.int32(num_special), page_size=np.int32(page_size))
    out = call_in_place("jaxkv_frame_write_fp8", (*codes, *scales), before=(k, v, special_row, patch_row), **attrs)
    return tuple(out[: 2 * L]), tuple(out[2 * L :])
