"""RoPE (with YaRN) on interleaved pairs, and the normalized Walsh–Hadamard rotation.

Both follow DeepSeek-V4's reference inference code: RoPE rotates consecutive pairs
``(x[2j], x[2j+1])`` as a complex number by ``pos * freq_j`` (float32 math), and the
indexer rotates its 128-dim keys and queries by ``H / sqrt(n)`` (Sylvester order).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=16)
def rope_freqs(
    dim: int, theta: float, factor: float, original_seq_len: int, beta_fast: int, beta_slow: int
) -> np.ndarray:
    """float32[dim/2] angular frequencies; YaRN-interpolated when ``original_seq_len > 0``."""
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    if original_seq_len > 0:

        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        smooth = (1 - ramp).astype(np.float32)
        freqs = (freqs / np.float32(factor) * (1 - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def apply_rope(x, pos, freqs):
    """x: float[..., 2n] (pairs interleaved), pos: int[...], freqs: f32[n] -> x.dtype[..., 2n]."""
    ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # f32[..., n]
    c, s = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    re = xf[..., 0] * c - xf[..., 1] * s
    im = xf[..., 0] * s + xf[..., 1] * c
    return jnp.stack([re, im], axis=-1).reshape(x.shape).astype(x.dtype)


def apply_rope_tail(x, pos, freqs, rope_dim: int):
    """``apply_rope`` on the last ``rope_dim`` dims of x: float[..., D]; the rest as it is."""
    return jnp.concatenate([x[..., :-rope_dim], apply_rope(x[..., -rope_dim:], pos, freqs)], axis=-1)


def hadamard(x):
    """x: float[..., n], n a power of two -> float32[..., n] = x @ H_n / sqrt(n) (Sylvester H)."""
    n = x.shape[-1]
    y = x.astype(jnp.float32)
    h = 1
    while h < n:  # butterfly: pairs (i, i + h) within blocks of 2h
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        y = jnp.concatenate([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-1)
        h *= 2
    return y.reshape(x.shape) * np.float32(n**-0.5)
