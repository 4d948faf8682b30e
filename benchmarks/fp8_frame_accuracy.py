"""How fine an FP8 frame cache's scales must be: attention error by scale granularity.

    python benchmarks/fp8_frame_accuracy.py [--frames 16] [--tokens 256] [--seed 0]

Runs anywhere (CPU is fine): an accuracy table, not a timing. K/V are synthetic, shaped like
lingbot-map's: K and Q after a per-head LayerNorm (lingbot-map normalizes q and k) with
per-channel gains (log-normal) and a few outlier channels, then RoPE; V with per-channel
gains and outlier channels. A query frame attends to ``frames`` cached frames. For each way
of storing K/V it prints the relative error (max |error| / max |output|, and RMS error / RMS
output) of the attention output against float32 K/V, and the bytes per 64-dim head row.
docs/kernels/frame_cache_fp8.md holds the latest table and the choice it made.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.formats import fp8
from jaxkv.math.attention import ref_attention


def synthetic(rng, frames, tokens, heads=4, dim=64):
    """(q f32[1, tokens, H, D], k, v f32[1, frames * tokens, H, D])."""

    def normed(n, gain):
        x = rng.normal(size=(1, n, heads, dim))
        x = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
        return x * gain

    gain = lambda outliers: (
        np.exp(rng.normal(0, 0.5, size=(heads, dim)))
        * np.where(  # noqa: E731
            np.isin(np.arange(dim), rng.choice(dim, 2, replace=False)), outliers, 1.0
        )
    )
    kg = gain(6.0)
    q, k = normed(tokens, kg), normed(frames * tokens, kg)
    pos = np.arange(frames * tokens) % tokens  # a frame's tokens: positions repeat per frame
    ang = pos[:, None] * 100.0 ** (-np.arange(dim // 2) / (dim // 2))
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    rot = lambda x, c, s: np.concatenate([x[..., ::2] * c - x[..., 1::2] * s, x[..., ::2] * s + x[..., 1::2] * c], -1)  # noqa: E731
    k = rot(k, cos, sin)
    q = rot(q, cos[:, :tokens], sin[:, :tokens])
    v = rng.normal(size=(1, frames * tokens, heads, dim)) * gain(10.0)
    return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


def pow2(x):
    """FP8 with one power-of-two (UE8M0) scale per row of the last axis."""
    return fp8.dequantize_fp8_ue8m0(*fp8.quantize_fp8_ue8m0(x, tile=x.shape[-1]), jnp.float32, tile=x.shape[-1])


def per_page(x, page):
    """FP8 with one power-of-two scale per ``page`` rows and head: [1, N, H, D] -> float32."""
    n = x.shape[1]
    g = x.reshape(1, n // page, page, *x.shape[2:]).transpose(0, 1, 3, 2, 4)
    back = pow2(g.reshape(*g.shape[:3], -1))  # [1, pages, H, page * D]
    return back.reshape(1, n // page, x.shape[2], page, x.shape[3]).transpose(0, 1, 3, 2, 4).reshape(x.shape)


def per_channel(x, page):
    """FP8 with one float32 scale per channel over ``page`` rows and head."""
    n = x.shape[1]
    g = x.reshape(1, n // page, page, *x.shape[2:]).transpose(0, 1, 3, 4, 2)  # [1, pages, H, D, page]
    back = fp8.dequantize_fp8_per_entry(*fp8.quantize_fp8_per_entry(g), jnp.float32)
    return back.transpose(0, 1, 4, 2, 3).reshape(x.shape)


STORAGE = {  # name -> (store K or V as, bytes per 64-dim head row)
    "bf16": (lambda x, page: x.astype(jnp.bfloat16).astype(jnp.float32), 128),
    "fp8, bf16 scale per token and head (quantize_fp8_rows)": (
        lambda x, page: fp8.dequantize_fp8_rows(*fp8.quantize_fp8_rows(x), jnp.float32),
        66,
    ),
    "fp8, f32 scale per token and head": (
        lambda x, page: fp8.dequantize_fp8_per_entry(*fp8.quantize_fp8_per_entry(x), jnp.float32),
        68,
    ),
    "fp8, pow2 scale per token and head": (lambda x, page: pow2(x), 65),
    "fp8, pow2 scale per page and head": (per_page, 64),
    "fp8, f32 scale per channel, page and head": (per_channel, 64),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per frame (a page)")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args(argv)
    rows = {name: [] for name in STORAGE}
    for seed in range(a.seeds):
        q, k, v = synthetic(np.random.default_rng(seed), a.frames, a.tokens)
        mask = jnp.ones((1, k.shape[1]), bool)
        exact = np.asarray(ref_attention(q, k, v, mask))
        for name, (store, _) in STORAGE.items():
            out = np.asarray(ref_attention(q, store(k, a.tokens), store(v, a.tokens), mask))
            err = out - exact
            rows[name].append((np.abs(err).max() / np.abs(exact).max(), np.sqrt((err**2).mean() / (exact**2).mean())))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {a.frames} frames x {a.tokens} tokens, {a.seeds} seeds")
    print("\n| storage | bytes per head row | max error | RMS error |\n|---|---:|---:|---:|")
    for name, (_, nbytes) in STORAGE.items():
        mx, rms = np.max(rows[name], axis=0)
        print(f"| {name} | {nbytes} | {mx:.2e} | {rms:.2e} |")


if __name__ == "__main__":
    main()
