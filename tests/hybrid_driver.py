"""A minimal DeepSeek-V4 attention block over the hybrid cache, shared by the tests.

Random per-token inputs stand in for the model's projections; ``layer_step`` does what a
V4 layer does with its cache: read the window, write it, compress (CSA / HCA), pick
entries (indexer top-k or all), and attend with a sink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import hybrid as H

Q_HEADS = 2


def make_params(config, rng):
    """Per layer: compressor params (and the indexer's), and an attention sink."""
    out = {}
    for layer, ratio in enumerate(config.compress_ratios):
        p = {"sink": jnp.asarray(rng.normal(size=(Q_HEADS,)), jnp.float32)}
        if ratio:
            coff = 2 if config.kind(layer) == H.CSA else 1
            p["main"] = H.CompressorParams(
                bias=jnp.asarray(rng.normal(size=(ratio, coff * config.head_dim)), jnp.float32),
                norm=jnp.asarray(1 + 0.1 * rng.normal(size=(config.head_dim,)), jnp.float32),
            )
            if coff == 2:
                p["index"] = H.CompressorParams(
                    bias=jnp.asarray(rng.normal(size=(ratio, 2 * config.index_dim)), jnp.float32),
                    norm=jnp.asarray(1 + 0.1 * rng.normal(size=(config.index_dim,)), jnp.float32),
                )
        out[layer] = p
    return out


def make_inputs(config, rng, B, T):
    """Per layer, random per-token inputs f32/bf16[B, T, ...] (never zeros)."""
    c = config
    out = {}
    for layer, ratio in enumerate(c.compress_ratios):
        x = {
            "kv": jnp.asarray(rng.normal(size=(B, T, c.head_dim)), jnp.bfloat16),
            "q": jnp.asarray(rng.normal(size=(B, T, Q_HEADS, c.head_dim)), jnp.bfloat16),
        }
        if ratio:
            coff = 2 if c.kind(layer) == H.CSA else 1
            x["ckv"] = jnp.asarray(rng.normal(size=(B, T, coff * c.head_dim)), jnp.float32)
            x["cscore"] = jnp.asarray(rng.normal(size=(B, T, coff * c.head_dim)), jnp.float32)
            if coff == 2:
                x["ikv"] = jnp.asarray(rng.normal(size=(B, T, 2 * c.index_dim)), jnp.float32)
                x["iscore"] = jnp.asarray(rng.normal(size=(B, T, 2 * c.index_dim)), jnp.float32)
                x["iq"] = jnp.asarray(rng.normal(size=(B, T, c.index_heads, c.index_dim)), jnp.bfloat16)
                x["iw"] = jnp.asarray(rng.uniform(0.1, 1.0, size=(B, T, c.index_heads)), jnp.float32)
        out[layer] = x
    return out


def slice_tokens(inputs, t0, t1):
    return {l: {k: v[:, t0:t1] for k, v in x.items()} for l, x in inputs.items()}


def layer_step(state, step, layer, x, p):
    """One layer's cache work for a step -> (state, attention out f32[B, T, H, D], top-k or None)."""
    c = state.config
    kind = c.kind(layer)
    T = x["kv"].shape[1]
    keys, key_pos = H.window_keys(state, step, layer, x["kv"])
    state = H.write_window(state, step, layer, x["kv"])
    parts = [(keys, H.window_mask(key_pos, step, T, c.window))]
    idx = None
    if kind == H.CSA:
        state = H.compress(
            state, step, layer, x["ckv"], x["cscore"], p["main"], index=(x["ikv"], x["iscore"], p["index"])
        )
        state, idx = H.index_topk(state, step, layer, H.index_query(state, x["iq"]), x["iw"])
        parts.append((H.gather_entries(state, step, layer, idx), idx >= 0))
    elif kind == H.HCA:
        state = H.compress(state, step, layer, x["ckv"], x["cscore"], p["main"])
        ent, _ = H.all_entries(state, step, layer)
        parts.append((ent, H.causal_entry_mask(ent.shape[1], step, T, c.compress_ratios[layer])))
    out = H.sparse_attention(x["q"], parts, p["sink"], c.head_dim**-0.5)
    return state, out, idx


def _model_step(state, step, inputs, params):
    outs, idxs = {}, {}
    for layer in range(state.config.num_layers):
        state, outs[layer], idxs[layer] = layer_step(state, step, layer, inputs[layer], params[layer])
    return state, outs, idxs


model_step = jax.jit(_model_step, donate_argnums=0)  # one executable per shape: fast tests


def compress_all(state, step, x, params, impl):
    """Every compressed layer's ``compress`` (with its indexer stream on CSA) for ``x``."""
    for layer in state.config.compressed_layers:
        xl, p = x[layer], params[layer]
        index = (xl["ikv"], xl["iscore"], p["index"]) if "index" in p else None
        state = H.compress(state, step, layer, xl["ckv"], xl["cscore"], p["main"], index, impl=impl)
    return state


def assert_same_request(a, sa, b, sb, length):
    """Request ``sa`` of cache ``a`` and ``sb`` of ``b`` hold ``length`` tokens and the same
    bytes: entries and indexer keys through their block tables, ring, tails."""
    c = a.config
    assert int(a.position[sa]) == int(b.position[sb]) == length
    for layer in c.compressed_layers:
        n = length // c.compress_ratios[layer]
        np.testing.assert_array_equal(entries_bytes(a, layer, sa, n), entries_bytes(b, layer, sb, n))
        if c.kind(layer) == H.CSA:
            np.testing.assert_array_equal(index_key_bytes(a, layer, sa, n), index_key_bytes(b, layer, sb, n))
    np.testing.assert_array_equal(np.asarray(a.window[:, sa]), np.asarray(b.window[:, sb]))
    for ta, tb in zip(a.tails, b.tails):
        np.testing.assert_array_equal(np.asarray(ta[:, sa]), np.asarray(tb[:, sb]))


def assert_same_outputs(outs_a, outs_b):
    """Per step, per layer: bit-identical attention outputs."""
    for oa, ob in zip(outs_a, outs_b, strict=True):
        for layer in oa:
            np.testing.assert_array_equal(np.asarray(oa[layer]), np.asarray(ob[layer]))


def entries_bytes(state, layer, slot, count):
    """u8[count, E] of a request's first ``count`` entries, read through its block table."""
    c = state.config
    g, j = state.group(layer)
    table = np.asarray(state.alloc[g].table[slot])
    pool = np.asarray(state.entries[g][j])
    return _read(pool, table, count, c.block_size, c.storage_format.entry.segments)


def index_key_bytes(state, layer, slot, count):
    c = state.config
    g, j = state.group(layer)
    table = np.asarray(state.alloc[g].table[slot])
    pool = np.asarray(state.index_keys[j])
    return _read(pool, table, count, c.block_size, c.storage_format.index_key(c.index_dim).segments)


def _read(pool, table, count, bs, segments):
    """numpy transcription of the segment-major block layout (independent of storage.read_items)."""
    rows = []
    for e in range(count):
        blk, s = table[e // bs], e % bs
        assert blk >= 0, f"entry {e} has no block"
        parts, off = [], 0
        for z in segments:
            parts.append(pool[blk, bs * off + s * z : bs * off + (s + 1) * z])
            off += z
        rows.append(np.concatenate(parts))
    return np.stack(rows) if rows else np.zeros((0, sum(segments)), np.uint8)
