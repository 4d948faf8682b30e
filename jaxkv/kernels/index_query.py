"""The lightning indexer's query in one CUDA kernel: Hadamard rotation, bf16, and the round
trip through the cache's FP4 key format that DeepSeek-V4 scores queries with.

In XLA the rotation's butterflies, the FP4 encoding and its decoding are several small
kernels a CSA layer; in a decode step each is a launch. ``jaxkv/cuda/index_query.cu`` does
all three with 16 elements a lane (strides up to 8 in registers, the longer ones by
shuffles) and gives the reference's values bit for bit: the butterflies run in
``jaxkv.math.hadamard``'s order, so the float32 sums are the same, and the encoders are
the flush-write's (``codes.cuh``).

    q: bf16[..., d] (d a power of two, 32 .. 512) -> bf16[..., d]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cuda import STORAGE_CODES, register_ffi_targets
from jaxkv.formats.storage import STORAGES
from jaxkv.math.rotation import hadamard
from jaxkv.stacked import as_flat, row


def _check(q, storage: str, dtypes=(jnp.bfloat16,)):
    if storage not in STORAGES:
        raise ValueError(f"storage: expected one of {sorted(STORAGES)}, got {storage!r}")
    d = q.shape[-1] if q.ndim else 0
    if q.dtype not in dtypes or not 32 <= d <= 512 or d & (d - 1):
        raise ValueError(
            f"q: expected {'bf16' if len(dtypes) == 1 else 'float'}[..., d] with d a power of two in 32 .. 512, got {q.dtype}{list(q.shape)}"
        )


def ref_index_query(q, storage: str):
    """The jnp reference: ``hadamard(q)`` rounded to bf16, encoded in the storage's index-key
    format and decoded (q may also be float32 or float16 here, or a ``Stacked`` row)."""
    _check(q, storage, (jnp.bfloat16, jnp.float32, jnp.float16))
    codec = STORAGES[storage].index_key(q.shape[-1])
    return codec.decode(codec.encode(hadamard(row(q)).astype(jnp.bfloat16)))


def index_query_cuda(q, storage: str):
    """The kernel: the same values as ``ref_index_query``; a ``Stacked`` row is read in
    place. Needs a GPU and nvcc."""
    _check(q, storage)
    register_ffi_targets()
    d = q.shape[-1]
    flat, offset = as_flat(q)
    out = jax.ffi.ffi_call("jaxkv_index_query", jax.ShapeDtypeStruct((math.prod(q.shape[:-1]), d), jnp.bfloat16))(
        flat, storage=np.int32(STORAGE_CODES[storage]), inv_sqrt=np.float32(d**-0.5), x_offset=np.int64(offset)
    )
    return out.reshape(q.shape)


__all__ = ["index_query_cuda", "ref_index_query"]
