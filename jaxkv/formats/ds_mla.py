"""The ``ds_mla`` packed block of FlashMLA "MODEL1" / vLLM ``fp8_ds_mla`` / FlashInfer DSV4.

One block of ``bs`` tokens of a 512-dim entry (448 "nope" dims + 64 RoPE dims) is
``bs * 584`` bytes::

    [bs x (448 B fp8 e4m3 nope | 128 B bf16 rope)]   token data, 576 B per token
    [bs x (7 B UE8M0 tile scales | 1 B zero pad)]      8 B per token

The nope part uses ``quantize_fp8_ue8m0`` (64-element tiles); the RoPE part is stored
as raw little-endian bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.formats.fp8 import TILE, dequantize_fp8_ue8m0, quantize_fp8_ue8m0

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
NUM_TILES = NOPE_DIM // TILE  # 7
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
TOKEN_SCALE_BYTES = NUM_TILES + 1  # 8
BYTES_PER_TOKEN = TOKEN_DATA_BYTES + TOKEN_SCALE_BYTES  # 584


def _bytes(x):
    """Any array -> uint8[..., itemsize] in memory (little-endian) order."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def pack_ds_mla(kv):
    """kv: bf16[blocks, block_size, 512] -> uint8[blocks, block_size * 584]."""
    if kv.ndim != 3 or kv.shape[-1] != HEAD_DIM:
        raise ValueError(f"kv: expected shape [blocks, block_size, {HEAD_DIM}], got {tuple(kv.shape)}")
    if kv.dtype != jnp.bfloat16:
        raise ValueError(f"kv: expected dtype bfloat16, got {kv.dtype}")
    nb, bs, _ = kv.shape
    q, scale = quantize_fp8_ue8m0(kv[..., :NOPE_DIM])  # f8[nb, bs, 448], u8[nb, bs, 7]
    rope = _bytes(kv[..., NOPE_DIM:]).reshape(nb, bs, 2 * ROPE_DIM)  # u8[nb, bs, 128]
    data = jnp.concatenate([_bytes(q), rope], axis=-1)  # u8[nb, bs, 576]
    scales = jnp.concatenate([scale, jnp.zeros((nb, bs, 1), jnp.uint8)], axis=-1)  # u8[nb, bs, 8]
    return jnp.concatenate([data.reshape(nb, -1), scales.reshape(nb, -1)], axis=-1)


def split_ds_mla(packed, block_size: int):
    """uint8[blocks, block_size*584] -> (nope f8[blocks, bs, 448], rope bf16[blocks, bs, 64], scale u8[blocks, bs, 7])."""
    if packed.ndim != 2 or packed.dtype != jnp.uint8 or packed.shape[-1] != block_size * BYTES_PER_TOKEN:
        raise ValueError(
            f"packed: expected uint8[blocks, {block_size * BYTES_PER_TOKEN}] for block_size={block_size}, "
            f"got {packed.dtype}{list(packed.shape)}"
        )
    nb = packed.shape[0]
    data = packed[:, : block_size * TOKEN_DATA_BYTES].reshape(nb, block_size, TOKEN_DATA_BYTES)
    scales = packed[:, block_size * TOKEN_DATA_BYTES :].reshape(nb, block_size, TOKEN_SCALE_BYTES)
    nope = jax.lax.bitcast_convert_type(data[..., :NOPE_DIM], jnp.float8_e4m3fn)
    rope = jax.lax.bitcast_convert_type(data[..., NOPE_DIM:].reshape(nb, block_size, ROPE_DIM, 2), jnp.bfloat16)
    return nope, rope, scales[..., :NUM_TILES]


def unpack_ds_mla(packed, block_size: int):
    """uint8[blocks, block_size*584] -> bf16[blocks, block_size, 512]."""
    nope, rope, scale = split_ds_mla(packed, block_size)
    return jnp.concatenate([dequantize_fp8_ue8m0(nope, scale), rope], axis=-1)
