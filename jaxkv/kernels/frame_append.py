"""Frame append: one frame's K/V for every layer written into the frame cache in one launch.

XLA writes a frame as one dynamic-update-slice per buffer and row run (specials, then
patches): 4 * layers * streams small kernels, launch-bound (``benchmarks/RESULTS.md``). This
Pallas kernel (Triton lowering: ``compiler_params=pltriton.CompilerParams``; deprecated
from jax 0.11 but present in 0.11.2) writes them all from one grid:

    program (i, j): buffer i (K or V of one layer and stream), row block j of that
    stream's frame (specials block first, then the patch page's blocks).

Buffers are aliased in and out (updated in place). ``ref_write_frame`` is the plain-jnp
reference with the same contract. Shapes::

    k_bufs, v_bufs: L x dtype[B, T, H*D]   the cache (``FrameCacheState.k`` / ``.v``, heads flattened)
    k, v: dtype[L, B, NS + P, H*D]          the frame, specials first
    special_row, patch_row: i32[B]           where the specials / the patch page go
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.kernels.tuning import launch


def _check(k_bufs, v_bufs, k, v, special_row, patch_row, num_special, page_size):
    L, B, tpf, hd = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: expected {k.dtype}{list(k.shape)} like k, got {v.dtype}{list(v.shape)}")
    if len(k_bufs) != L or len(v_bufs) != L:
        raise ValueError(f"k_bufs, v_bufs: expected {L} buffers each, got {len(k_bufs)} and {len(v_bufs)}")
    for b in (*k_bufs, *v_bufs):
        if b.ndim != 3 or b.shape[0] != B or b.shape[2] != hd or b.dtype != k.dtype:
            raise ValueError(f"k_bufs, v_bufs: expected {k.dtype}[{B}, rows, {hd}], got {b.dtype}{list(b.shape)}")
    for name, r in (("special_row", special_row), ("patch_row", patch_row)):
        if r.shape != (B,) or r.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32[{B}], got {r.dtype}{list(r.shape)}")
    if not 0 <= num_special <= tpf or page_size < tpf - num_special:
        raise ValueError(f"num_special, page_size: expected 0 <= {num_special} <= {tpf} and page_size >= "
                         f"{tpf - num_special} patches, got page_size {page_size}")


def write_rows(buf, x, special_row, patch_row, *, num_special: int, page_size: int):
    """One buffer, in jnp: each stream's specials at ``special_row``, its patches (zero-padded
    to ``page_size`` rows) at ``patch_row`` — two dynamic-update-slices per stream.

    buf: dtype[B, T, ...];  x: [B, NS + P, ...];  special_row, patch_row: i32[B]
    """
    P = x.shape[1] - num_special
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
    put = functools.partial(write_rows, special_row=special_row, patch_row=patch_row, num_special=num_special,
                            page_size=page_size)
    return tuple(map(put, k_bufs, k)), tuple(map(put, v_bufs, v))


def _kernel(rows_ref, k_ref, v_ref, *refs, L, B, num_special, page_size, tpf, ROWS):
    # rows_ref: i32[2, B] (special_row; patch_row); k_ref, v_ref: [L, B, tpf, hd];
    # refs: 2L input buffers (aliased, unused) then the same 2L as outputs.
    from jax.experimental.pallas import triton as pltriton

    outs = refs[2 * L :]
    i, j = pl.program_id(0), pl.program_id(1)
    ns_blocks = pl.cdiv(num_special, ROWS)
    r = jnp.arange(ROWS, dtype=jnp.int32)
    for idx in range(2 * L * B):  # static: one branch per buffer and stream
        kv, rest = divmod(idx, L * B)
        l, b = divmod(rest, B)
        src, dst = (k_ref, v_ref)[kv], outs[kv * L + l]

        def copy(src_start, dst_start, n_src, n_dst, first, src=src, dst=dst, l=l, b=b):
            # rows [first, first + ROWS) of a run: read n_src of them, write n_dst (zeros past n_src)
            x = pltriton.load(src.at[jnp.int32(l), jnp.int32(b), pl.ds(src_start + first, ROWS), :],
                              mask=(first + r < n_src)[:, None], other=0)
            pltriton.store(dst.at[jnp.int32(b), pl.ds(dst_start + first, ROWS), :], x,
                           mask=(first + r < n_dst)[:, None])

        @pl.when((i == idx) & (j < ns_blocks))
        def _(copy=copy, b=b):
            copy(0, rows_ref[0, b], num_special, num_special, j * ROWS)

        @pl.when((i == idx) & (j >= ns_blocks))
        def _(copy=copy, b=b):
            copy(num_special, rows_ref[1, b], tpf - num_special, page_size, (j - ns_blocks) * ROWS)


@functools.partial(jax.jit, static_argnames=("num_special", "page_size", "interpret"), donate_argnums=(0, 1))
def write_frame(k_bufs, v_bufs, k, v, special_row, patch_row, *, num_special: int, page_size: int,
                interpret: bool = False):
    """Pallas: write the frame into every layer's K and V buffer in one launch (see module docstring)."""
    _check(k_bufs, v_bufs, k, v, special_row, patch_row, num_special, page_size)
    from jax.experimental.pallas import triton as pltriton

    L, B, tpf, hd = k.shape
    tune = launch("frame_append")
    ROWS = tune["rows"]
    blocks = pl.cdiv(num_special, ROWS) + pl.cdiv(page_size, ROWS)
    bufs = (*k_bufs, *v_bufs)
    rows = jnp.stack([special_row, patch_row])
    out = pl.pallas_call(
        functools.partial(_kernel, L=L, B=B, num_special=num_special, page_size=page_size, tpf=tpf, ROWS=ROWS),
        out_shape=tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs),
        grid=(2 * L * B, blocks),
        input_output_aliases={3 + n: n for n in range(2 * L)},
        compiler_params=pltriton.CompilerParams(num_warps=tune["warps"], num_stages=1),
        interpret=interpret,
        name="jaxkv_frame_append",
    )(rows, k, v, *bufs)
    return tuple(out[:L]), tuple(out[L:])
