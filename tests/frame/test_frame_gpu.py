"""The fused attention backends on the GPU against the float32 reference, at lingbot-map-like shapes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import frame
from jaxkv._backend import is_hopper as _is_hopper

pytestmark = pytest.mark.gpu
FUSED = ("cudnn", "xla", "pallas", "cuda") if _is_hopper() else ("cudnn", "xla")  # the prefix kernels are Hopper-only


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("patches,frames,defer_last", [(256, 90, False), (999, 12, True), (37, 20, True)])
def test_fused_backends_match_reference(rng, patches, frames, defer_last):
    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=16,
        head_dim=64,
        patches_per_frame=patches,
        scale_frames=8,
        sliding_window=6,
        max_frames=128,
        num_streams=2,
    )
    state = frame.init(spec)
    shape = (2, 2, spec.tokens_per_frame, 16, 64)
    for t in range(frames):
        k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        state = frame.append(state, k, v, defer=defer_last and t == frames - 1)
    jaxkv.check(state)
    q = jnp.asarray(rng.standard_normal((2, spec.tokens_per_frame, 16, 64)), jnp.bfloat16)
    for layer in range(2):
        ref = frame.attention(state, layer, q, impl="reference").astype(jnp.float32)
        for impl in FUSED:
            out = frame.attention(state, layer, q, impl=impl)
            assert out.dtype == jnp.bfloat16
            assert rel_err(out, ref) < 1e-2, impl  # bf16 operands


def test_auto_on_gpu():
    """Hopper (H100 / H200): the Pallas prefix kernel; other NVIDIA GPUs: cuDNN."""
    spec = frame.FrameSpec(num_layers=1, num_heads=2, head_dim=64, patches_per_frame=8)
    assert frame.default_impl(spec) == ("pallas" if _is_hopper() else "cudnn")
    assert frame.default_impl(spec.__class__(**{**spec.__dict__, "pow2_pages": True})) == "xla"


def test_gqa_queries(rng):
    spec = frame.FrameSpec(num_layers=1, num_heads=2, head_dim=64, patches_per_frame=64, max_frames=16)
    state = frame.init(spec)
    for _ in range(5):
        kv = jnp.asarray(rng.standard_normal((1, 1, 70, 2, 64)), jnp.bfloat16)
        state = frame.append(state, kv, -kv)
    q = jnp.asarray(rng.standard_normal((1, 70, 8, 64)), jnp.bfloat16)
    ref = frame.attention(state, 0, q, impl="reference").astype(jnp.float32)
    for impl in FUSED[:1] + FUSED[2:]:
        assert rel_err(frame.attention(state, 0, q, impl=impl), ref) < 1e-2, impl


def test_frame_state_lives_on_gpu():
    spec = frame.FrameSpec(num_layers=1, num_heads=2, head_dim=64, patches_per_frame=8)
    state = frame.init(spec)
    assert all(d.platform == "gpu" for d in state.k[0].devices())


@pytest.mark.parametrize("lengths", [(3001, 700), (4096, 3072), (1, 2049), (4096, 0)])
def test_cudnn_prefix_matches_reference(rng, lengths):
    """One cuDNN call over the prefix: a prefix may fill the buffer, or be empty (row 0 is
    attended then; ``frame.attention`` zeroes that stream)."""
    from jaxkv.frame.attention import cudnn_attention

    B, T, H, D, Tq = 2, 4096, 4, 64, 262
    k = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, Tq, H, D)), jnp.bfloat16)
    n = jnp.asarray(lengths, jnp.int32)
    mask = jnp.arange(T)[None] < jnp.maximum(n, 1)[:, None]
    ref = frame.ref_attention(q, k, v, mask)
    out = jax.jit(cudnn_attention)(q, k, v, n)
    assert rel_err(out, ref) < 1e-2


def test_traced_layer_attention(rng):
    spec = frame.FrameSpec(num_layers=3, num_heads=4, head_dim=64, patches_per_frame=100, max_frames=16)
    state = frame.init(spec)
    for _ in range(4):
        kv = jnp.asarray(rng.standard_normal((3, 1, 106, 4, 64)), jnp.bfloat16)
        state = frame.append(state, kv, kv * 0.5)
    q = jnp.asarray(rng.standard_normal((1, 106, 4, 64)), jnp.bfloat16)
    for layer in range(3):
        a = frame.attention(state, jnp.int32(layer), q)
        b = frame.attention(state, layer, q, impl="reference").astype(jnp.float32)
        assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("lengths", [(3001, 700), (4096, 0), (1, 2049), (256, 257)])
@pytest.mark.parametrize("dtype,heads", [(jnp.bfloat16, (4, 4)), (jnp.float16, (8, 2))])
@pytest.mark.skipif(not _is_hopper(), reason="the prefix kernel needs a Hopper GPU")
def test_prefix_kernel_matches_reference(rng, splits, lengths, dtype, heads):
    """Lengths on and off block and chunk edges, an empty stream (zeros), GQA, a query
    count that is not a multiple of the kernel's 128-query tile."""
    from jaxkv.kernels import prefix_attention, ref_prefix_attention

    (Hq, H), B, T, D, Tq = heads, 2, 4096, 64, 262
    k = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    q = jnp.asarray(rng.standard_normal((B, Tq, Hq, D)), dtype)
    n = jnp.asarray(lengths, jnp.int32)
    ref = ref_prefix_attention(q, k, v, n)
    out = prefix_attention(q, k, v, n, splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    for b in range(B):
        if lengths[b] == 0:
            assert not np.any(np.asarray(out[b], np.float32)), "an empty prefix attends to nothing: zeros"
        else:
            assert rel_err(out[b], ref[b]) < 1e-2, b


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("lengths", [(3001, 700), (4096, 0), (1, 2049), (128, 129)])
@pytest.mark.parametrize("heads", [(4, 4), (16, 16), (8, 2)])
@pytest.mark.skipif(not _is_hopper(), reason="the cuda prefix kernel needs a Hopper GPU")
def test_prefix_cuda_kernel_matches_reference(rng, splits, lengths, heads):
    """``jaxkv/cuda/prefix_attention.cu`` on the Mosaic kernel's contract: lengths on and off
    block and chunk edges, an empty stream (zeros), GQA, 262 queries (not a multiple of the
    128-query tile); bit-identical when run twice."""
    from jaxkv.kernels import prefix_attention_cuda, ref_prefix_attention

    (Hq, H), B, T, D, Tq = heads, 2, 4096, 64, 262
    k = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, Tq, Hq, D)), jnp.bfloat16)
    n = jnp.asarray(lengths, jnp.int32)
    ref = ref_prefix_attention(q, k, v, n)
    out = prefix_attention_cuda(q, k, v, n, splits=splits)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    for b in range(B):
        if lengths[b] == 0:
            assert not np.any(np.asarray(out[b], np.float32)), "an empty prefix attends to nothing: zeros"
        else:
            assert rel_err(out[b], ref[b]) < 1e-2, b
            err = np.max(np.abs(np.asarray(out[b], np.float32) - np.asarray(ref[b])))
            assert err <= 2e-2 * np.max(np.abs(np.asarray(ref[b]))) + 1e-3, b  # bf16 P and output
    again = prefix_attention_cuda(q, k, v, n, splits=splits)
    assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


def test_frame_step_has_no_host_control_flow(rng):
    """XLA GPU reads a cond / while predicate on the host: a frame step (append with
    deferral, attention of a frame and of one token, resolve) holds neither."""
    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=4,
        head_dim=64,
        patches_per_frame=37,
        num_special=6,
        scale_frames=2,
        sliding_window=3,
        max_frames=64,
    )
    k = jnp.asarray(rng.standard_normal((2, 1, spec.tokens_per_frame, 4, 64)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((1, spec.tokens_per_frame, 4, 64)), jnp.bfloat16)

    def step(state, k, q, defer):
        state = frame.append(state, k, k, defer=defer)
        out = frame.attention(state, 0, q) + frame.attention(state, 1, q[:, :1], impl="xla")[:, :1]
        return frame.resolve(state, ~defer), out

    text = jax.jit(step).lower(frame.init(spec), k, q, jnp.asarray([True])).as_text()
    assert not re.findall(r"stablehlo\.(while|case|if)\b", text)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("lengths", [(3001, 700), (4096, 0), (1, 129)])
@pytest.mark.parametrize("heads", [(16, 16), (3, 1)])
@pytest.mark.skipif(not _is_hopper(), reason="the cuda prefix kernel needs a Hopper GPU")
def test_prefix_cuda_kernel_reads_fp8_rows(rng, splits, lengths, heads):
    """FP8 codes and scales read in place equal the bf16 kernel over the same rows dequantized to
    bf16, bit for bit (the decode is bf16(code * scale), one rounding), and the float32
    reference within bf16's bound. Rows of very different magnitude (scales 2^-12..2^12), a
    zero row (scale 0), one KV head (odd heads: the scale pair's other half)."""
    from jaxkv.formats import dequantize_fp8_rows, quantize_fp8_rows
    from jaxkv.kernels import prefix_attention_cuda, ref_prefix_attention

    (Hq, H), B, T, D, Tq = heads, 2, 4096, 64, 262
    gain = 2.0 ** rng.uniform(-12, 12, size=(B, T, H, 1))

    def rows():
        x = rng.standard_normal((B, T, H, D)) * gain
        x[:, 5] = 0.0
        return quantize_fp8_rows(jnp.asarray(x, jnp.bfloat16))

    (k8, ks), (v8, vs) = rows(), rows()
    q = jnp.asarray(rng.standard_normal((B, Tq, Hq, D)) * 2.0**-6, jnp.bfloat16)  # logits of order 1 for typical rows
    n = jnp.asarray(lengths, jnp.int32)
    out = prefix_attention_cuda(q, k8, v8, n, splits=splits, k_scale=ks, v_scale=vs)
    as_bf16 = [dequantize_fp8_rows(x, s, jnp.bfloat16) for x, s in ((k8, ks), (v8, vs))]
    same = prefix_attention_cuda(q, *as_bf16, n, splits=splits)
    assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(same).view(np.uint16))
    ref = ref_prefix_attention(q, k8, v8, n, k_scale=ks, v_scale=vs)
    for b in range(B):
        if lengths[b] == 0:
            assert not np.any(np.asarray(out[b], np.float32)), "an empty prefix attends to nothing: zeros"
        else:
            assert rel_err(out[b], ref[b]) < 2e-2, b


@pytest.mark.skipif(not _is_hopper(), reason="the cuda prefix kernel needs a Hopper GPU")
def test_fp8_cache_attention_auto_is_the_cuda_kernel(rng):
    """On Hopper an FP8 cache's ``auto`` attention is the cuda kernel reading it in place; it
    matches the float32 reference over the dequantized rows through eviction and a deferred frame."""
    from jaxkv.frame.attention import default_impl

    spec = frame.FrameSpec(
        num_layers=2, num_heads=16, head_dim=64, patches_per_frame=999, scale_frames=2, sliding_window=3,
        max_frames=64, dtype="float8_e4m3fn",
    )  # fmt: skip
    assert default_impl(spec) == "cuda"
    state = frame.init(spec)
    shape = (2, 1, spec.tokens_per_frame, 16, 64)
    for t in range(8):
        k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        state = frame.append(state, k, k * 0.5 + 0.25, defer=t == 7)
    q = jnp.asarray(rng.standard_normal((1, spec.tokens_per_frame, 16, 64)) * 0.2, jnp.bfloat16)
    for layer in range(2):
        out = frame.attention(state, layer, q)
        ref = frame.attention(state, layer, q, impl="reference")
        assert rel_err(out, ref) < 2e-2, layer
