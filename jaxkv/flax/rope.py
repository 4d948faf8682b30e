"""Axial rotary embeddings: one RoPE table over several position axes (frame, row, column).

A streaming model rotates q and k *before* the keys enter the cache, so cached keys never
need re-rotation: relative positions between frames come out of the dot product.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def axial_rope(positions, head_dim: int, theta: float = 100.0):
    """cos / sin tables of a RoPE whose frequencies are split over the position axes.

    positions: int[..., A]  one position per axis (e.g. A = 3: frame, row, column)
    returns (cos, sin): f32[..., head_dim // 2] each; the ``head_dim // 2`` frequency
      pairs are dealt to the A axes in contiguous sections, as evenly as possible, and
      each section runs the usual ``theta^(-2i/d)`` ladder over its own width.
    """
    positions = jnp.asarray(positions)
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even number, got {head_dim}")
    if positions.ndim < 1:
        raise ValueError(f"positions: expected int[..., axes], got shape {positions.shape}")
    half, axes = head_dim // 2, positions.shape[-1]
    if half < axes:
        raise ValueError(f"head_dim: expected >= 2 * {axes} (one pair per axis), got {head_dim}")
    widths = [half // axes + (i < half % axes) for i in range(axes)]
    freqs = np.concatenate([theta ** (-np.arange(w, dtype=np.float64) / w) for w in widths]).astype(np.float32)
    axis_of = np.repeat(np.arange(axes), widths)  # which position axis drives each pair
    angle = positions[..., axis_of].astype(jnp.float32) * freqs
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x, cos, sin):
    """Rotate pairs ``(x[..., i], x[..., i + D/2])`` (half-split layout) in float32.

    x: float[B, T, H, D];  cos, sin: f32[B, T, D/2] or f32[T, D/2]  -> x.dtype[B, T, H, D]
    """
    d = x.shape[-1]
    if cos.shape[-1] * 2 != d or cos.shape != sin.shape:
        raise ValueError(f"cos, sin: expected f32[..., {d // 2}] of equal shape, got {cos.shape} and {sin.shape}")
    c, s = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)
