"""The Mosaic GPU kernels lower for CUDA on any machine (compile-only, like nvcc for ``cuda/``).

jax lowers a ``plgpu.kernel`` to its Mosaic GPU module without a GPU
(``lower(lowering_platforms=("cuda",))``), so a kernel that breaks one of Mosaic GPU's rules
(a copy whose bytes do not divide among a warpgroup's threads, a TMA tiling the global
shape does not divide, a layout a register op does not take) fails here, in CI, before a GPU
run. It proves nothing about the values (the GPU tests do) and nothing about ptxas.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxkv._backend import POOL_ATTENTION_JAX
from jaxkv.formats.storage import STORAGES
from jaxkv.kernels.frame_append import write_frame
from jaxkv.kernels.index_scores import index_scores
from jaxkv.kernels.pool_attention import pool_attention_pallas
from jaxkv.kernels.prefix_attention import prefix_attention

S = jax.ShapeDtypeStruct
i32, bf16, f32, u8 = jnp.int32, jnp.bfloat16, jnp.float32, jnp.uint8


def _lower(fn, *args):
    """The Mosaic GPU module text of ``fn(*args)`` lowered for CUDA (skips where this jax cannot)."""
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except (ImportError, ModuleNotFoundError) as e:  # a jaxlib without the Mosaic GPU dialect
        pytest.skip(f"this jaxlib cannot lower Mosaic GPU kernels: {e}")
    text = lowered.as_text()
    assert "mosaic_gpu" in text, "expected a Mosaic GPU custom call in the lowered module"
    return text


@pytest.mark.parametrize("L,B,NS,P,page,HD", [(2, 1, 6, 37, 37, 64), (3, 2, 0, 20, 32, 1024), (2, 1, 17, 5, 8, 64)])
def test_frame_append_lowers(L, B, NS, P, page, HD):
    bufs = [S((B, 160, HD), bf16)] * L
    frame = S((L, B, NS + P, HD), bf16)
    text = _lower(
        lambda kb, vb, k, v, sr, pr: write_frame(kb, vb, k, v, sr, pr, num_special=NS, page_size=page),
        bufs,
        bufs,
        frame,
        frame,
        S((B,), i32),
        S((B,), i32),
    )
    assert "stablehlo.copy" not in text  # the buffers go in as Refs, with no copy around the call


@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("rows_per_request,heads,block_size", [(1, 64, 64), (2, 128, 128)])
def test_index_scores_lowers(storage, rows_per_request, heads, block_size):
    Kb = STORAGES[storage].index_key(128).bytes
    B, NP = 3, 4
    N = B * rows_per_request
    args = (
        S((N, heads, 128), bf16),
        S((N, heads), f32),
        S((2, 20, block_size * Kb), u8),
        S((B, NP), i32),
        S((N,), i32),
    )
    _lower(lambda q, w, pool, pages, count: index_scores(q, w, pool, 1, pages, count, storage=storage), *args)


@pytest.mark.xfail(
    jax.__version_info__[:2] < POOL_ATTENTION_JAX,
    raises=NotImplementedError,
    strict=True,
    reason="this jax's Mosaic GPU refuses copies under 128 bytes (the kernel's per-row copies), so "
    "hybrid.attention's auto rule asks for jax >= 0.11",
)
@pytest.mark.parametrize("heads,top_k,splits", [(64, 512, 1), (128, 1024, 2)])
def test_pool_attention_lowers(heads, top_k, splits):
    E = STORAGES["official"].entry_bytes
    B, bs, window = 4, 64, 128
    part_blocks = (top_k // 64, window // 64)
    args = (
        S((B, heads, 512), bf16),
        (S((64, bs * E), u8), S((B, window * E), u8)),
        S((B, top_k + window), i32),
        S((B, sum(part_blocks)), i32),
        S((heads,), f32),
    )
    _lower(
        lambda q, pools, rows, nvalid, sink: pool_attention_pallas(
            q, pools, part_blocks, rows, nvalid, sink, splits=splits
        ),
        *args,
    )


@pytest.mark.parametrize("dtype,splits", [(bf16, 1), (jnp.float16, 2)])
def test_prefix_attention_lowers(dtype, splits):
    args = (S((2, 128, 8, 64), dtype), S((2, 512, 2, 64), dtype), S((2, 512, 2, 64), dtype), S((2,), i32))
    _lower(lambda q, k, v, n: prefix_attention(q, k, v, n, splits=splits), *args)
