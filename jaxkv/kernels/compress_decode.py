"""Fused decode compressor: a CSA / HCA layer's whole per-token cache update in one launch.

For each request of a decode step (one token each) the kernel folds the token's
compressor inputs into the request's running-softmax tail and, where that token completes
a window, does the whole flush: pool (a + previous-b streams for CSA), RMSNorm, RoPE on
the last 64 dims at ``entry * ratio``, FP8 (UE8M0 tiles, ``ds_mla`` bytes, in the
official storage family; one float32 scale per entry in the per_entry family), the indexer
key (RMSNorm, RoPE, Hadamard, MXFP4 / NVFP4), the scatter through the block table, and
the tail's move on (CSA a -> b rotation, HCA reset). Tails, pools and the error field are
updated in place; a request whose flush finds no block gets ``Fault.POOL_EXHAUSTED`` in
its error word, and a token with a NaN or Inf in kv, score (or the indexer's) changes
nothing and gets ``Fault.NONFINITE_KV`` (``hybrid.compress``'s rule, checked in the kernel).

The kernel is ``jaxkv/cuda/compress_decode.cu`` (one 128-thread CTA per request) reached through
``jax.ffi``, not Pallas: its flush is a scatter of one entry and one key per request to
data-dependent pool rows, with a UE8M0 byte per 64 codes, which Mosaic GPU on Hopper
cannot express (no row scatter, no strided register slices:
``tests/kernels/test_mosaic_limits.py``); its byte encoders are the flush-write's
(``jaxkv/cuda/write_entry.cuh``). Why one fused launch: docs/kernels/cache_writes.md.

The math is ``jaxkv.math.compressor`` + ``jaxkv.formats.storage``, operation for operation
in float32 without contractions; the reference is ``hybrid.compress(..., impl="xla")`` on
the same step. The 512- and 128-wide sums of RMSNorm are added in another order, so a BF16
entry can differ from the reference's in its last bit where the float32 value sits on a
rounding boundary (and its FP8 / FP4 bytes then by one code).

    tails:      f32[L, R, streams, 3, width]  CSA: 3 streams, width 640; HCA: 1, width 512
    kv, score:  float[B, coff * 512]        CSA: [:512] b stream, [512:] a stream
    ikv, iscore: float[B, 256]              CSA only: the indexer's compressor inputs
    bias: f32[ratio, coff * 512]   norm: f32[512]   (ibias f32[ratio, 256], inorm f32[128])
    slot, write_slot, start, num_tokens: i32[B]   (``hybrid.Step``: slot clamped into [0, R),
                                 a write_slot outside it inactive)
    table: i32[R, max_blocks]    a cell outside [0, NB) is no block: nothing written,
                                 POOL_EXHAUSTED; a cell in range is trusted to be the request's
                                 own (the cache keeps its tables: docs/reliability.md)
    pool: u8[L, NB, bs * E]   index_pool: u8[L, NB, bs * K]   (E, K: storage.entry_bytes, key_bytes)
    error: u32[R + 1]

Each of kv, score, bias, norm (and the indexer's) may instead be a ``jaxkv.stacked.Stacked`` row
of an array stacked over layers; the kernel reads that row in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cuda import STORAGE_CODES, register_ffi_targets
from jaxkv.errors import Fault
from jaxkv.formats.storage import HEAD_DIM as HEAD
from jaxkv.formats.storage import INDEX_DIM as INDEX
from jaxkv.formats.storage import entry_bytes, key_bytes, storage_name
from jaxkv.stacked import as_flat, check_stacked


def check_compress_decode(
    tails, kv, score, bias, norm, slot, table, pool, error, *, layer, ratio, index, index_pool, storage
):
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
        zip(("index kv", "index score", "index bias", "index norm"), index or ())
    ):
        check_stacked(name, x)
    if tails.ndim != 5:
        raise ValueError(f"tails: expected f32[layers, R, {streams}, 3, {width}], got {tails.dtype}{list(tails.shape)}")
    L, R = tails.shape[:2]
    want("tails", tails, (L, R, streams, 3, width), (jnp.float32,))
    if not 0 <= layer < L or pool.ndim != 3 or pool.shape[0] != L:
        raise ValueError(
            f"layer: expected a static int in [0, {L}) indexing tails and pool alike, got {layer} with "
            f"pool {list(pool.shape)}"
        )
    E = entry_bytes(storage_name(storage))
    if pool.dtype != jnp.uint8 or pool.shape[2] % E:
        raise ValueError(
            f"pool: expected u8[{L}, NB, bs * {E}] ({storage} storage), got {pool.dtype}{list(pool.shape)}"
        )
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
        want(
            "index_pool",
            index_pool,
            (*pool.shape[:2], pool.shape[2] // E * key_bytes(storage_name(storage))),
            (jnp.uint8,),
        )


def compress_decode(
    tails,
    kv,
    score,
    bias,
    norm,
    slot,
    write_slot,
    start,
    num_tokens,
    table,
    pool,
    error,
    freqs,
    *,
    layer: int,
    ratio: int,
    eps: float,
    storage: str,
    index=None,
    index_pool=None,
):
    """The kernel. ``index = (ikv, iscore, ibias, inorm)`` for a CSA layer (with
    ``index_pool``), None for HCA. Each of kv, score, bias, norm and the index tuple may
    be a ``jaxkv.stacked.Stacked`` row, read in place. Returns ``(tails, pool, error)`` or,
    for CSA, ``(tails, pool, index_pool, error)``, all updated in place. Needs a GPU and
    nvcc (the first use builds ``cuda/``)."""
    return _compress_decode(
        tails,
        kv,
        score,
        bias,
        norm,
        slot,
        write_slot,
        start,
        num_tokens,
        table,
        pool,
        error,
        freqs,
        layer=layer,
        ratio=ratio,
        eps=eps,
        storage=storage_name(storage),
        index=index,
        index_pool=index_pool,
    )


@functools.partial(
    jax.jit,
    static_argnames=("layer", "ratio", "eps", "storage"),
    donate_argnames=("tails", "pool", "index_pool", "error"),
)
def _compress_decode(
    tails,
    kv,
    score,
    bias,
    norm,
    slot,
    write_slot,
    start,
    num_tokens,
    table,
    pool,
    error,
    freqs,
    *,
    layer: int,
    ratio: int,
    eps: float,
    storage: str,
    index=None,
    index_pool=None,
):
    check_compress_decode(
        tails,
        kv,
        score,
        bias,
        norm,
        slot,
        table,
        pool,
        error,
        layer=layer,
        ratio=ratio,
        index=index,
        index_pool=index_pool,
        storage=storage,
    )
    csa = index is not None
    register_ffi_targets()
    names = ("kv", "score", "bias", "norm") + (("ikv", "iscore", "ibias", "inorm") if csa else ())
    dtypes = (None, None, jnp.float32, jnp.float32) * (2 if csa else 1)
    operands = [as_flat(x, d) for x, d in zip((kv, score, bias, norm) + (tuple(index) if csa else ()), dtypes)]
    aliased = (tails, pool) + ((index_pool,) if csa else ()) + (error,)
    steps = [a.astype(jnp.int32) for a in (slot, write_slot, start, num_tokens)]
    call = jax.ffi.ffi_call(
        "jaxkv_compress_decode_" + ("csa" if csa else "hca"),
        tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased),
        input_output_aliases={n: n for n in range(len(aliased))},
    )
    return call(
        *aliased,
        *(a for a, _ in operands),
        jnp.asarray(freqs, jnp.float32),
        *steps,
        table,
        layer=np.int32(layer),
        ratio=np.int32(ratio),
        eps=np.float32(eps),
        storage=np.int32(STORAGE_CODES[storage]),
        fault=np.int32(int(Fault.POOL_EXHAUSTED)),
        nonfinite=np.int32(int(Fault.NONFINITE_KV)),
        **{f"{n}_offset": np.int64(off) for n, (_, off) in zip(names, operands)},
    )


__all__ = ["check_compress_decode", "compress_decode"]
