"""The math the caches and kernels share, with no cache state: attention and its merge,
the CSA / HCA compressor, RoPE and the Hadamard rotation. Imports only jax and numpy."""

from jaxkv.math.attention import merge_partials, ref_attention

__all__ = ["merge_partials", "ref_attention"]
