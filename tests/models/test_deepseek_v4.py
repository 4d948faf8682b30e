"""models.deepseek_v4 without upstream: a request's outputs do not depend on how its tokens
are chunked, the weight loader's FP8 dequantization and its errors, bad inputs. (Parity with
DeepSeek-V4's own code: tests/hybrid/test_upstream_parity.py.)"""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import hybrid as H  # noqa: E402
from jaxkv.models.deepseek_v4 import V4Attention, V4AttentionConfig, load_upstream  # noqa: E402

CACHE = H.HybridConfig(
    compress_ratios=(0, 4, 8),
    window=16,
    index_heads=4,
    top_k=32,
    block_size=8,
    max_requests=2,
    max_context=128,
    original_seq_len=64,
)
CFG = V4AttentionConfig(cache=CACHE, dim=32, num_heads=2, q_lora_rank=16, o_groups=2, o_lora_rank=8)
LENGTH = 60


def _blocks(seed=0):
    """One block per layer, every parameter random (norms near 1, nothing zero)."""
    blocks = []
    for layer in range(CACHE.num_layers):
        block = V4Attention(CFG, layer, rngs=nnx.Rngs(seed + layer))
        for i, (path, v) in enumerate(nnx.to_flat_state(nnx.state(block, nnx.Param))):
            x = jax.random.normal(jax.random.key(1000 * layer + i), v.get_value().shape, jnp.float32)
            x = (
                1 + 0.1 * x
                if "norm" in path[-1]
                else x * (v.get_value().shape[0] ** -0.5 if path[-1] == "kernel" else 1)
            )
            v.set_value(x.astype(v.get_value().dtype))
        blocks.append(nnx.split(block))
    return blocks


@jax.jit
def _step(params, graphs, state, step, x):
    outs = []
    for graph, p in zip(graphs, params):
        state, y = nnx.merge(graph, p)(state, step, x)
        outs.append(y)
    return state, jnp.stack(outs)


def _run(blocks, x, schedule, chunk):
    """Feed x: bf16[B, LENGTH, dim] in steps of ``chunk`` rows (``schedule``: per step, tokens per
    request) -> f32[layers, B, LENGTH, dim], each token's output where it was computed."""
    graphs, params = [g for g, _ in blocks], [p for _, p in blocks]
    run = jax.jit(lambda p, s, st, xx: _step(p, graphs, s, st, xx))
    state, B = H.init(CACHE), x.shape[0]
    out = np.zeros((CACHE.num_layers, B, LENGTH, CFG.dim), np.float32)
    done = np.zeros(B, int)
    for counts in schedule:
        rows = np.zeros((B, chunk, CFG.dim), np.float32)
        for b, n in enumerate(counts):
            rows[b, :n] = x[b, done[b] : done[b] + n]
        state, step = H.prepare_forward(state, jnp.arange(B), jnp.asarray(done), jnp.asarray(counts), chunk=chunk)
        state, y = run(params, state, step, jnp.asarray(rows, jnp.bfloat16))
        for b, n in enumerate(counts):
            out[:, b, done[b] : done[b] + n] = np.asarray(y[:, b, :n], np.float32)
        done += counts
    jaxkv.check(state)
    assert list(done) == [LENGTH] * B
    return out


@pytest.mark.slow
def test_outputs_do_not_depend_on_chunking():
    """Ragged prefill chunks (with padding rows) and token-by-token decode give each token the
    same output: the cache holds the same entries whatever the chunking (top_k covers every
    entry here, so score near-ties cannot pick differently)."""
    blocks = _blocks()
    x = np.random.default_rng(0).normal(size=(2, LENGTH, CFG.dim)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    ragged = _run(blocks, x, [[23, 5], [1, 30], [0, 1], [17, 9], [19, 15]], 32)
    single = _run(blocks, x, [[1, 1]] * LENGTH, 1)
    scale = np.abs(single).max()
    assert scale > 0.1
    np.testing.assert_allclose(ragged, single, atol=4e-3 * scale)  # measured on CPU: 3.4e-5 * scale


def _upstream_weights(block, rng, fp8=()):
    """Random tensors under upstream's names and shapes for ``block``'s kind; the linear weights
    named in ``fp8`` as FP8 E4M3 with E8M0 scales per 128 x 128 block."""
    c, hc = CFG, CACHE
    D, G = hc.head_dim, c.o_groups
    shapes = {
        "wq_a.weight": (c.q_lora_rank, c.dim),
        "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.num_heads * D, c.q_lora_rank),
        "wkv.weight": (D, c.dim),
        "kv_norm.weight": (D,),
        "wo_a.weight": (G * c.o_lora_rank, c.num_heads * D // G),
        "wo_b.weight": (c.dim, G * c.o_lora_rank),
        "attn_sink": (c.num_heads,),
    }
    ratio = hc.compress_ratios[block.layer]
    if ratio:
        coff = 2 if block.kind == H.CSA else 1
        shapes.update(
            {
                "compressor.wkv.weight": (coff * D, c.dim),
                "compressor.wgate.weight": (coff * D, c.dim),
                "compressor.ape": (ratio, coff * D),
                "compressor.norm.weight": (D,),
            }
        )
    if block.kind == H.CSA:
        i = hc.index_dim
        shapes.update(
            {
                "indexer.wq_b.weight": (hc.index_heads * i, c.q_lora_rank),
                "indexer.weights_proj.weight": (hc.index_heads, c.dim),
                "indexer.compressor.wkv.weight": (2 * i, c.dim),
                "indexer.compressor.wgate.weight": (2 * i, c.dim),
                "indexer.compressor.ape": (ratio, 2 * i),
                "indexer.compressor.norm.weight": (i,),
            }
        )
    out = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    for name in fp8:
        w = out[f"{name}.weight"]
        rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        exps = rng.integers(-3, 3, size=(rows, cols))
        out[f"{name}.scale"] = np.ldexp(1.0, exps).astype(ml_dtypes.float8_e8m0fnu)
        out[f"{name}.weight"] = w.astype(ml_dtypes.float8_e4m3fn)
    return out


def test_load_upstream_places_every_tensor():
    """Each upstream tensor lands in its parameter (linear weights transposed, wo_a per group,
    FP8 weights times their block scales), for every layer kind."""
    rng = np.random.default_rng(1)
    for layer in range(CACHE.num_layers):
        block = V4Attention(CFG, layer, rngs=nnx.Rngs(0))
        w = _upstream_weights(block, rng, fp8=("wq_b", "wo_b"))
        load_upstream(block, w)
        np.testing.assert_array_equal(
            np.asarray(block.wq_a.kernel[...], np.float32),
            np.asarray(jnp.asarray(w["wq_a.weight"].T, jnp.bfloat16), np.float32),
        )
        scale = np.repeat(np.repeat(w["wq_b.scale"].astype(np.float32), 128, 0), 128, 1)
        want = w["wq_b.weight"].astype(np.float32) * scale[: w["wq_b.weight"].shape[0], : w["wq_b.weight"].shape[1]]
        np.testing.assert_array_equal(
            np.asarray(block.wq_b.kernel[...], np.float32), np.asarray(jnp.asarray(want.T, jnp.bfloat16), np.float32)
        )
        G, R, Dg = block.wo_a.shape
        np.testing.assert_array_equal(
            np.asarray(block.wo_a[1, 2], np.float32),
            np.asarray(jnp.asarray(w["wo_a.weight"][R + 2], jnp.bfloat16), np.float32),
        )
        np.testing.assert_array_equal(np.asarray(block.sink[...]), w["attn_sink"])
        if block.compressor is not None:
            np.testing.assert_array_equal(
                np.asarray(block.compressor.wgate.kernel[...]), w["compressor.wgate.weight"].T
            )
            np.testing.assert_array_equal(np.asarray(block.compressor.ape[...]), w["compressor.ape"])
        if block.kind == H.CSA:
            np.testing.assert_array_equal(
                np.asarray(block.index_compressor.norm[...]), w["indexer.compressor.norm.weight"]
            )
    # wo_a, not a linear here, is FP8 in DeepSeek's checkpoints: dequantized by its scales too
    block = V4Attention(CFG, 0, rngs=nnx.Rngs(0))
    w = _upstream_weights(block, rng, fp8=("wo_a",))
    load_upstream(block, w)
    scale = np.repeat(np.repeat(w["wo_a.scale"].astype(np.float32), 128, 0), 128, 1)
    want = w["wo_a.weight"].astype(np.float32) * scale[: w["wo_a.weight"].shape[0], : w["wo_a.weight"].shape[1]]
    G, R, Dg = block.wo_a.shape
    np.testing.assert_array_equal(
        np.asarray(block.wo_a[...], np.float32).reshape(G * R, Dg),
        np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32),
    )


def test_load_upstream_torch_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    block = V4Attention(CFG, 1, rngs=nnx.Rngs(0))
    w = _upstream_weights(block, rng)
    load_upstream(block, {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in w.items()})
    np.testing.assert_array_equal(
        np.asarray(block.index_weights.kernel[...], np.float32),
        np.asarray(jnp.asarray(w["indexer.weights_proj.weight"].T, jnp.bfloat16), np.float32),
    )


def test_bad_inputs():
    rng = np.random.default_rng(3)
    block = V4Attention(CFG, 2, rngs=nnx.Rngs(0))  # HCA
    good = _upstream_weights(block, rng)
    before = np.asarray(block.wkv.kernel[...], np.float32)
    with pytest.raises(ValueError, match=r"weights: expected the .* HCA layer, missing \['attn_sink'\]"):
        load_upstream(block, {k: v for k, v in good.items() if k != "attn_sink"})
    with pytest.raises(ValueError, match=r"unexpected \['indexer.wq_b.weight'\]"):
        load_upstream(block, {**good, "indexer.wq_b.weight": good["wq_b.weight"]})
    with pytest.raises(ValueError, match=r"weights: wo_a.weight: expected shape"):
        load_upstream(block, {**good, "wo_a.weight": good["wo_a.weight"].T})
    fp8 = _upstream_weights(block, rng, fp8=("wkv",))
    with pytest.raises(ValueError, match=r"wkv.weight is FP8 but wkv.scale .* is missing"):
        load_upstream(block, {k: v for k, v in fp8.items() if k != "wkv.scale"})
    np.testing.assert_array_equal(np.asarray(block.wkv.kernel[...], np.float32), before)  # nothing half-loaded

    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 3\)"):
        V4Attention(CFG, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="o_groups: expected a divisor of num_heads=2"):
        V4AttentionConfig(cache=CACHE, dim=32, num_heads=2, o_groups=3)
    state, step = H.prepare_forward(H.init(CACHE), jnp.arange(2), jnp.zeros(2, jnp.int32), chunk=3)
    with pytest.raises(ValueError, match=r"x: expected bf16\[2, T, 32\], got float32\[2, 3, 32\]"):
        block(state, step, jnp.zeros((2, 3, 32), jnp.float32))
    other = H.init(CACHE.__class__(**{**CACHE.__dict__, "window": 32}))
    with pytest.raises(ValueError, match="state: expected a cache of this block's config.cache"):
        block(other, step, jnp.zeros((2, 3, 32), jnp.bfloat16))
