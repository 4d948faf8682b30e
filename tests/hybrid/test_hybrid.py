"""jaxkv.hybrid: config, storage bytes, compressor equations, decode == prefill, batches, faults."""

from __future__ import annotations

import dataclasses
import functools

import hybrid_driver as D
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import hybrid as H
from jaxkv.errors import CacheError, Fault
from jaxkv.formats import pack_ds_mla, quantize_mxfp4
from jaxkv.formats.storage import STORAGES, read_items, write_items
from jaxkv.math.compressor import empty_tail, fold_chunk, next_tail
from jaxkv.math.rotation import apply_rope, hadamard, rope_freqs

SMALL = H.HybridConfig(
    compress_ratios=(0, 4, 128), window=32, index_heads=4, top_k=16, block_size=16, max_requests=3, max_context=2048
)


# --- config --------------------------------------------------------------------------------------
def test_presets_and_bytes_per_token():
    f, p = H.V4_FLASH, H.V4_PRO
    assert f.num_layers == 43 and f.compress_ratios[:4] == (0, 0, 4, 128) and f.compress_ratios[-1] == 4
    assert p.num_layers == 61 and p.compress_ratios[:4] == (128, 128, 4, 128)
    assert (f.top_k, p.top_k, f.head_dim, f.rope_dim, f.window, f.index_heads, f.index_dim) == (
        512,
        1024,
        512,
        64,
        128,
        64,
        128,
    )
    fmt = f.storage_format
    assert fmt.entry_bytes == 584 and fmt.index_key_bytes(128) == 68
    n_csa, n_hca = f.compress_ratios.count(4), f.compress_ratios.count(128)
    assert (n_csa, n_hca) == (21, 20)
    assert H.bytes_per_token(f) == pytest.approx(n_csa * (584 + 68) / 4 + n_hca * 584 / 128)
    assert abs(H.bytes_per_token(f) - 3500) < 50  # ≈ 3.5 KB
    assert abs(H.bytes_per_token(p) - 5000) < 50  # ≈ 5.0 KB
    per_entry = dataclasses.replace(f, storage="per_entry")
    assert H.bytes_per_token(per_entry) == pytest.approx(n_csa * (580 + 76) / 4 + n_hca * 580 / 128)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(compress_ratios=()), "compress_ratios"),
        (dict(compress_ratios=(0, 1)), "compress_ratios"),
        (dict(compress_ratios=(4,), storage="fp16"), "storage"),
        (dict(compress_ratios=(4,), head_dim=256), "head_dim"),
        (dict(compress_ratios=(4,), index_dim=96), "index_dim"),
        (dict(compress_ratios=(4,), index_dim=64), "index_dim: expected 128"),
        (dict(compress_ratios=(4,), max_requests=0), "max_requests"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        H.HybridConfig(**kw)


# --- storage ---------------------------------------------------------------------------------------
def test_official_pool_block_is_ds_mla(rng):
    """A block written entry by entry (in shuffled order) is byte-identical to pack_ds_mla."""
    bs = 16
    x = jnp.asarray(rng.normal(size=(bs, 512)) * rng.uniform(0.01, 10, size=(bs, 1)), jnp.bfloat16)
    codec = STORAGES["official"].entry
    pool = jnp.zeros((2, 3, bs * codec.bytes), jnp.uint8)  # [layers, blocks, bytes]
    order = rng.permutation(bs)
    pool = write_items(pool, 1, jnp.full((bs,), 1), jnp.asarray(order), codec.encode(x[order]), codec.segments)
    np.testing.assert_array_equal(np.asarray(pool[1, 1]), np.asarray(pack_ds_mla(x[None]))[0])
    assert not np.asarray(pool[0]).any() and not np.asarray(pool[1, 0]).any() and not np.asarray(pool[1, 2]).any()
    back = codec.decode(read_items(pool, 1, jnp.ones((bs,), jnp.int32), jnp.arange(bs), codec.segments))
    np.testing.assert_allclose(np.asarray(back, np.float32), np.asarray(x, np.float32), rtol=0.07, atol=1e-2)


def test_index_key_bytes(rng):
    x = jnp.asarray(rng.normal(size=(5, 128)), jnp.bfloat16)
    off = STORAGES["official"].index_key(128)
    packed, scales = quantize_mxfp4(x.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(off.encode(x)), np.concatenate([packed, scales], -1))
    for name in STORAGES:
        codec = STORAGES[name].index_key(128)
        y = np.asarray(codec.decode(codec.encode(x)), np.float32)
        err = np.abs(y - np.asarray(x, np.float32))
        assert err.max() <= 0.5 * np.abs(np.asarray(x, np.float32)).max(), name  # FP4: 1 code step at most
        assert np.corrcoef(y.ravel(), np.asarray(x, np.float32).ravel())[0, 1] > 0.97


def test_seed_entry_roundtrip(rng):
    x = jnp.asarray(rng.normal(size=(7, 512)), jnp.bfloat16)
    codec = STORAGES["per_entry"].entry
    b = codec.encode(x)
    assert b.shape == (7, 580) and b.dtype == jnp.uint8
    y = np.asarray(codec.decode(b), np.float32)
    xf = np.asarray(x, np.float32)
    np.testing.assert_array_equal(y[:, 448:], xf[:, 448:])  # RoPE dims stay bf16
    assert np.all(
        np.abs(y[:, :448] - xf[:, :448])
        <= 0.0625 * np.abs(xf[:, :448]) + np.abs(xf).max(1, keepdims=True) / 448 * 2**-9
    )


# --- rope / hadamard --------------------------------------------------------------------------------
def test_hadamard_is_sylvester(rng):
    h = np.array([[1.0]])
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    x = rng.normal(size=(3, 128)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(hadamard(jnp.asarray(x))), x @ h / np.sqrt(128), rtol=1e-5, atol=1e-5)


def test_rope_interleaved_pairs(rng):
    freqs = rope_freqs(64, 160000.0, 16.0, 65536, 32, 1)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    pos = np.array([0, 3, 400, 65000])
    ang = (pos[:, None].astype(np.float32) * freqs).astype(np.float64)  # float32 angles, as DeepSeek's reference
    z = (x[:, 0::2] + 1j * x[:, 1::2]) * np.exp(1j * ang)
    want = np.stack([z.real, z.imag], -1).reshape(4, 64)
    np.testing.assert_allclose(
        np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), freqs)), want, rtol=2e-4, atol=2e-4
    )


# --- compressor equations -----------------------------------------------------------------------------
def numpy_pool(kv, score, bias, m, overlap):
    """Eqs. 11-12 (CSA, overlap) and 20-23 (HCA) written out, float64, one entry at a time."""
    kv, score, bias = (np.asarray(a, np.float64) for a in (kv, score, bias))
    c = kv.shape[1] // (2 if overlap else 1)
    out = []
    for i in range(kv.shape[0] // m):
        a = slice(m * i, m * (i + 1))
        if overlap:
            ca, za = kv[a, c:], score[a, c:] + bias[:, c:]
            if i == 0:  # padding: Z^b = -inf, C^b = 0
                cb, zb = np.zeros((m, c)), np.full((m, c), -np.inf)
            else:
                b = slice(m * (i - 1), m * i)
                cb, zb = kv[b, :c], score[b, :c] + bias[:, :c]
            z = np.concatenate([za, zb])
            cc = np.concatenate([ca, cb])
        else:
            z, cc = score[a] + bias, kv[a]
        s = np.exp(z - z.max(0))
        out.append((s / s.sum(0) * cc).sum(0))
    return np.stack(out)


@pytest.mark.parametrize("m, overlap", [(4, True), (128, False), (8, False)])
def test_compressor_matches_equations(rng, m, overlap):
    c, coff, N = 64, 2 if overlap else 1, 5 * m + 3
    kv = rng.normal(size=(N, coff * c)).astype(np.float32)
    score = (2 * rng.normal(size=(N, coff * c))).astype(np.float32)
    bias = rng.normal(size=(m, coff * c)).astype(np.float32)
    want = numpy_pool(kv, score, bias, m, overlap)
    np.testing.assert_allclose(
        np.asarray(H.ref_pool_sequence(jnp.asarray(kv), jnp.asarray(score), jnp.asarray(bias), m, overlap)),
        want,
        rtol=1e-5,
        atol=1e-6,
    )

    z = score + bias[np.arange(N) % m]
    if overlap:  # fold_chunk takes per-stream rows: a = [c:], b = [:c]
        kv = np.stack([kv[:, c:], kv[:, :c]], 1)
        z = np.stack([z[:, c:], z[:, :c]], 1)
    else:
        kv, z = kv[:, None], z[:, None]
    tail0 = empty_tail((), 3 if overlap else 1, c)
    one = functools.partial(fold_chunk, ratio=m, overlap=overlap)
    _, pooled, complete = jax.jit(one)(tail0, jnp.asarray(kv), jnp.asarray(z), 0, N)
    assert np.asarray(complete).sum() == N // m
    np.testing.assert_allclose(np.asarray(pooled)[: N // m], want, rtol=1e-5, atol=1e-6)

    # the same sequence in uneven chunks, the tail carried between them: bit-identical entries
    got, tail, pos = [], tail0, 0
    for size in (1, m - 1, 2, 3 * m + 1, N - (m + 3 + 3 * m + 1) + 1):
        size = min(size, N - pos)
        wins, pooled, complete = jax.jit(one)(
            tail, jnp.asarray(kv[pos : pos + size]), jnp.asarray(z[pos : pos + size]), pos, size
        )
        got += [p for p, ok in zip(np.asarray(pooled), np.asarray(complete)) if ok]
        tail = next_tail(tail, wins, pos, size, m, overlap)
        pos += size
    assert pos == N
    np.testing.assert_array_equal(
        np.stack(got), np.asarray(jax.jit(one)(tail0, jnp.asarray(kv), jnp.asarray(z), 0, N)[1])[: N // m]
    )


def numpy_entry(pooled, i, m, norm_w, config):
    """bf16 -> RMSNorm -> bf16 -> RoPE at i*m, written out in numpy."""
    x = np.asarray(jnp.asarray(pooled, jnp.bfloat16), np.float64)
    y = x / np.sqrt((x * x).mean() + config.norm_eps) * norm_w
    y = np.asarray(jnp.asarray(y.astype(np.float32), jnp.bfloat16), np.float64)
    f = rope_freqs(
        64, config.rope_theta, config.rope_factor, config.original_seq_len, config.beta_fast, config.beta_slow
    )
    zc = (y[448::2] + 1j * y[449::2]) * np.exp(1j * (np.float32(i * m) * f).astype(np.float64))
    y[448::2], y[449::2] = zc.real, zc.imag
    return y


@pytest.mark.parametrize("storage", ["official", pytest.param("per_entry", marks=pytest.mark.slow)])
def test_stored_entries_match_numpy_pipeline(rng, storage):
    cfg = dataclasses.replace(SMALL, storage=storage)
    params = D.make_params(cfg, rng)
    N = 300
    inputs = D.make_inputs(cfg, rng, 1, N)
    state = H.init(cfg)
    state, step = H.prepare_forward(state, jnp.array([1]), jnp.array([0]), chunk=N)
    state, _, _ = D.model_step(state, step, inputs, params)
    jaxkv.check(state)
    for layer in (1, 2):
        m = cfg.compress_ratios[layer]
        x = inputs[layer]
        pooled = numpy_pool(x["ckv"][0], x["cscore"][0], params[layer]["main"].bias, m, m == 4)
        got, cnt = H.all_entries(state, step, layer)
        assert int(cnt[0]) == N // m
        got = np.asarray(got[0, : N // m], np.float64)
        for i in range(N // m):
            want = numpy_entry(pooled[i], i, m, np.asarray(params[layer]["main"].norm), cfg)
            # FP8 E4M3: half a step of 2**-3 relative (normal range), half a subnormal step
            # 2**-9 * scale below it; the scale is per 64-tile (official) or per entry (seed);
            # plus one bf16 step of the normed value, which the backends may round apart.
            group_amax = (
                np.abs(want[:448]).reshape(7, 64).max(1).repeat(64)
                if storage == "official"
                else np.abs(want[:448]).max()
            )
            bound = (2**-4 + 2**-7) * np.abs(want[:448]) + group_amax / 448 * 2**-9 + 1e-6
            assert np.all(np.abs(got[i, :448] - want[:448]) <= bound), (layer, i)
            np.testing.assert_allclose(got[i, 448:], want[448:], rtol=2e-2, atol=2e-2)


# --- decode == prefill -------------------------------------------------------------------------------------
N_TOKENS = 600


@functools.partial(jax.jit, static_argnames="n")
def _decode_all(state, inputs, params, n):
    def body(state, t):
        x = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, t, 1, axis=1), inputs)
        state, step = H.prepare_forward(state, jnp.array([0]), t[None], chunk=1)
        state, outs, idxs = D.model_step(state, step, x, params)
        return state, (outs, idxs)

    return jax.lax.scan(body, state, jnp.arange(n))


def _prefill(state, inputs, params, chunks, pad_to=None):
    """Feed ``chunks`` tokens at a time; with ``pad_to``, every chunk is padded to that many
    tokens (``num_tokens`` says how many are real): one executable for all of them."""
    outs, idxs, pos = [], [], 0
    for size in chunks:
        T = pad_to or size
        x = D.slice_tokens(inputs, pos, pos + size)
        x = jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, T - size)] + [(0, 0)] * (a.ndim - 2), constant_values=1), x)
        state, step = H.prepare_forward(state, jnp.array([0]), jnp.array([pos]), jnp.array([size]), chunk=T)
        state, o, i = D.model_step(state, step, x, params)
        outs.append({l: None if a is None else a[:, :size] for l, a in o.items()})
        idxs.append({l: None if a is None else a[:, :size] for l, a in i.items()})
        pos += size
    cat = lambda *a: None if a[0] is None else jnp.concatenate(a, axis=1)  # noqa: E731
    return state, {l: cat(*[o[l] for o in outs]) for l in outs[0]}, {l: cat(*[i[l] for i in idxs]) for l in idxs[0]}


def same_bytes(a, b, decode, what, step=2**-3):
    """Stored entries from two paths. The pooled values are folded in the same order in
    both, but the last bit of a value can still move — XLA's vectorised and scalar sin/cos
    differ (RoPE), and on a GPU a multiply-add may be contracted into an FMA in one fusion
    and not the other — and then round to a neighbouring code. So: all within one
    quantization step (FP8: 2**-3 relative; FP4: half the group maximum), and on CPU at
    least 95% of the entries bit for bit."""
    rows_same = np.all(a == b, axis=-1)
    if jax.default_backend() == "cpu":  # on a GPU an HCA entry folds 128 rows: most differ in some bit
        assert rows_same.mean() >= 0.95, f"{what}: only {rows_same.mean():.1%} of entries bit-identical"
    x = np.asarray(decode(jnp.asarray(a)), np.float32)
    y = np.asarray(decode(jnp.asarray(b)), np.float32)
    tol = step * np.maximum(np.abs(x), np.abs(y)) + 2**-9 * np.abs(x).max(-1, keepdims=True)
    assert np.all(np.abs(x - y) <= tol), f"{what}: entries differ by more than one quantization step"


def test_decode_equals_prefill(rng):
    """600 tokens one at a time (one jitted scan, no host round trip) vs the whole sequence
    at once and in uneven chunks: the same entries and indexer keys (see ``same_bytes``),
    the same top-k, the same attention outputs."""
    cfg = SMALL
    params = D.make_params(cfg, rng)
    inputs = D.make_inputs(cfg, rng, 1, N_TOKENS)
    dec_state, (dec_out, dec_idx) = _decode_all(H.init(cfg), inputs, params, N_TOKENS)
    jaxkv.check(dec_state)
    runs = {
        "whole": _prefill(H.init(cfg), inputs, params, (N_TOKENS,)),
        "chunks": _prefill(H.init(cfg), inputs, params, (167, 1, 250, 182), pad_to=250),
    }
    for name, (pre_state, pre_out, pre_idx) in runs.items():
        jaxkv.check(pre_state)
        for layer in (1, 2):
            cnt = N_TOKENS // cfg.compress_ratios[layer]
            same_bytes(
                D.entries_bytes(dec_state, layer, 0, cnt),
                D.entries_bytes(pre_state, layer, 0, cnt),
                cfg.storage_format.entry.decode,
                f"{name}: layer {layer} entries",
            )
        same_bytes(
            D.index_key_bytes(dec_state, 1, 0, N_TOKENS // 4),
            D.index_key_bytes(pre_state, 1, 0, N_TOKENS // 4),
            cfg.storage_format.index_key(cfg.index_dim).decode,
            f"{name}: index keys",
            step=0.5,
        )
        # top-k: the same entries, except where two scores tie to within float noise
        got = np.asarray(dec_idx[1])[:, 0, 0]  # [t, k]
        want = np.asarray(pre_idx[1])[0]
        same = np.all(np.sort(got, -1) == np.sort(want, -1), axis=-1)
        assert same.mean() > 0.99, f"{name}: top-k differs at {np.flatnonzero(~same)[:10]}"
        assert (got[-1] >= 0).all() and len(set(got[-1])) == cfg.top_k
        for layer in range(cfg.num_layers):
            d = np.asarray(dec_out[layer])[:, 0, 0]  # [t, H, D]
            p = np.asarray(pre_out[layer])[0]
            ok = same[:, None, None] if layer == 1 else True
            d, p = np.where(ok, d, 0), np.where(ok, p, 0)
            if cfg.compress_ratios[layer] == 0:  # raw window only: no quantized entry involved
                np.testing.assert_allclose(d, p, rtol=2e-4, atol=2e-4, err_msg=f"{name}: layer {layer}")
                continue
            # an entry may sit one FP8 code apart between the paths (same_bytes allows it; on a
            # GPU more often), and the outputs that read it move with it: up to ~0.11 seen on an
            # H100, so one code step, 0.25. Everything else stays within float noise: on CPU
            # at most 0.1% of the outputs may be off by more than 2e-4.
            np.testing.assert_allclose(d, p, rtol=0.25, atol=0.25, err_msg=f"{name}: layer {layer}")
            if jax.default_backend() == "cpu":
                loose = np.abs(d - p) > 2e-4 * (1 + np.abs(p))
                assert loose.mean() < 1e-3, f"{name}: layer {layer}: {loose.mean():.2%} of outputs beyond 2e-4"


def test_attention_reference_is_dense_softmax(rng):
    """sparse_attention with one key set equals softmax(qk, sink) v written out in numpy."""
    B, T, Hh, K, Dd = 2, 3, 2, 7, 16
    q = rng.normal(size=(B, T, Hh, Dd)).astype(np.float32)
    k = rng.normal(size=(B, T, K, Dd)).astype(np.float32)
    mask = rng.uniform(size=(B, T, K)) > 0.3
    sink = rng.normal(size=(Hh,)).astype(np.float32)
    got = np.asarray(
        H.sparse_attention(
            jnp.asarray(q),
            [
                (jnp.asarray(k[:, :, :3]), jnp.asarray(mask[:, :, :3])),
                (jnp.asarray(k[:, :, 3:]), jnp.asarray(mask[:, :, 3:])),
            ],
            jnp.asarray(sink),
            0.25,
        )
    )
    l = np.einsum("bthd,btkd->bthk", q, k) * 0.25
    l = np.where(mask[:, :, None], l, -np.inf)
    mx = np.maximum(l.max(-1), sink)
    p = np.exp(l - mx[..., None])
    want = np.einsum("bthk,btkd->bthd", p, k) / (p.sum(-1) + np.exp(sink - mx))[..., None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- batches ---------------------------------------------------------------------------------------------------
def test_batch_requests_at_different_positions(rng):
    """Three requests, ragged prefill chunks then decode, flushing on different steps; each
    request's entries equal those of the same tokens fed alone."""
    cfg = dataclasses.replace(SMALL, max_context=1024)
    params = D.make_params(cfg, rng)
    lengths = (301, 260, 150)
    seqs = [jax.tree.map(np.asarray, D.make_inputs(cfg, rng, 1, n)) for n in lengths]  # numpy: no eager op compiles
    slots = (2, 0, 1)
    plan = [(37, 250, 3), (200, 1, 0), (1, 1, 64), (63, 8, 83)]  # tokens per request per step
    state = H.init(cfg)
    pos = [0, 0, 0]
    flush_steps = {s: [] for s in slots}
    T = 256  # one padded token axis for every step: one executable
    for counts in plan:
        batch = {}
        for l in range(cfg.num_layers):
            batch[l] = {}
            for key in seqs[0][l]:
                rows = []
                for r in range(3):
                    a = seqs[r][l][key][:, pos[r] : pos[r] + counts[r]]
                    rows.append(np.concatenate([a, np.full((1, T - a.shape[1]) + a.shape[2:], 7.0, a.dtype)], axis=1))
                batch[l][key] = jnp.asarray(np.concatenate(rows, axis=0))
        before = [p // 4 for p in pos]
        state, step = H.prepare_forward(state, jnp.array(slots), jnp.array(pos), jnp.array(counts), chunk=T)
        state, _, _ = D.model_step(state, step, batch, params)
        jaxkv.check(state)
        for r in range(3):
            pos[r] += counts[r]
            if pos[r] // 4 > before[r]:
                flush_steps[slots[r]].append(len(flush_steps[slots[r]]))
    assert pos == list(lengths)
    np.testing.assert_array_equal(np.asarray(state.position)[list(slots)], lengths)
    for r, slot in enumerate(slots):
        alone = H.init(cfg)
        alone, step = H.prepare_forward(alone, jnp.array([0]), jnp.array([0]), jnp.array([lengths[r]]), chunk=320)
        padded = jax.tree.map(
            lambda a: jnp.asarray(np.concatenate([a, np.ones((1, 320 - a.shape[1]) + a.shape[2:], a.dtype)], 1)),
            seqs[r],
        )
        alone, _, _ = D.model_step(alone, step, padded, params)
        for layer in (1, 2):
            cnt = lengths[r] // cfg.compress_ratios[layer]
            np.testing.assert_array_equal(
                D.entries_bytes(state, layer, slot, cnt), D.entries_bytes(alone, layer, 0, cnt)
            )
    # typed views: each row's table and count, pools read in place (the same bytes)
    last = H.Step(
        slot=jnp.array(slots),
        write_slot=jnp.array(slots),
        start=jnp.array(lengths),
        num_tokens=jnp.zeros(3, jnp.int32),
        active=jnp.ones(3, bool),
    )
    v = H.layer_view(state, last, 1)
    assert v.kind == H.CSA and v.ratio == 4 and v.index_keys is not None
    np.testing.assert_array_equal(np.asarray(v.num_entries), [n // 4 for n in lengths])
    np.testing.assert_array_equal(np.asarray(v.block_table), np.asarray(state.alloc[0].table)[list(slots)])
    assert v.entries is state.entries[0] and H.layer_view(state, last, 0).entries is None
    # requests own disjoint blocks
    for al in state.alloc:
        t = np.asarray(al.table)
        used = t[t >= 0]
        assert len(used) == len(set(used.tolist()))


# --- faults -------------------------------------------------------------------------------------------------------
def _tiny(**kw):
    return dataclasses.replace(SMALL, **kw)


def test_faults_leave_requests_untouched(rng):
    cfg = _tiny()
    params = D.make_params(cfg, rng)
    state = H.init(cfg)
    x = D.make_inputs(cfg, rng, 2, 8)
    state, step = H.prepare_forward(state, jnp.array([0, 1]), jnp.array([0, 0]), chunk=8)
    state, _, _ = D.model_step(state, step, x, params)
    jaxkv.check(state)
    snapshot = jax.tree.map(np.asarray, state)

    cases = [
        ((0, 1), (7, 8), Fault.POSITION_BACKWARDS, 0),
        ((0, 1), (8, 9), Fault.POSITION_GAP, 1),
        ((0, 5), (8, 0), Fault.SLOT_OUT_OF_RANGE, cfg.max_requests),
        ((1, 1), (8, 8), Fault.SLOT_REPEATED, cfg.max_requests),
    ]
    for slots, positions, fault, owner in cases:
        s2, step = H.prepare_forward(
            jax.tree.map(jnp.asarray, snapshot), jnp.array(slots), jnp.array(positions), chunk=8
        )
        s2, _, _ = D.model_step(s2, step, x, params)
        err = np.asarray(s2.error)
        assert err[owner] & fault, (fault, err)
        with pytest.raises(CacheError, match="request slot|bad slot"):
            jaxkv.check(s2)
        for _r, (sl, ok) in enumerate(zip(slots, np.asarray(step.active))):
            if not ok and 0 <= sl < cfg.max_requests and slots.count(sl) == 1:  # refused row: its request unchanged
                assert int(s2.position[sl]) == snapshot.position[sl]
                np.testing.assert_array_equal(np.asarray(s2.window[:, sl]), snapshot.window[:, sl])
                for g in range(len(s2.tails)):
                    for j in range(len(s2.tails[g])):
                        np.testing.assert_array_equal(np.asarray(s2.tails[g][j][sl]), snapshot.tails[g][j][sl])
            if ok:  # the other rows went ahead
                assert int(s2.position[sl]) == snapshot.position[sl] + 8

    # too many tokens for the context, and a count beyond the chunk
    s2, step = H.prepare_forward(
        jax.tree.map(jnp.asarray, snapshot), jnp.array([0, 1]), jnp.array([8, 8]), jnp.array([9, 2]), chunk=8
    )
    assert np.asarray(step.active).tolist() == [False, True] and np.asarray(s2.error)[0] & Fault.CONTEXT_EXHAUSTED


def test_pool_exhausted(rng):
    cfg = _tiny(pool_tokens=4 * 16 * 2, max_requests=3)  # CSA pool: 2 + 3 blocks of 16 entries (64 tokens each)
    nb = cfg.num_blocks(4)
    params = D.make_params(cfg, rng)
    state = H.init(cfg)
    T = 64 * (nb - 1)
    x = D.make_inputs(cfg, rng, 3, T)
    state, step = H.prepare_forward(
        state, jnp.array([0, 1, 2]), jnp.zeros(3, jnp.int32), jnp.array([T, 64, 64]), chunk=T
    )
    assert np.asarray(step.active).tolist() == [True, True, False]
    assert np.asarray(state.error)[2] & Fault.POOL_EXHAUSTED and not np.asarray(state.error)[:2].any()
    assert int(state.position[2]) == 0 and int(state.alloc[0].num_free) == 0
    state, _, _ = D.model_step(state, step, x, params)
    with pytest.raises(CacheError, match="pool exhausted"):
        jaxkv.check(state)
    # finishing request 0 returns its blocks; request 2 then gets in
    state = H.finish(jaxkv.clear_errors(state), jnp.array([0]))
    assert int(state.alloc[0].num_free) == nb - 1 and int(state.position[0]) == 0
    state, step = H.prepare_forward(state, jnp.array([2]), jnp.array([0]), jnp.array([64]), chunk=T)
    assert bool(step.active[0])
    jaxkv.check(state)


def test_bad_inputs_raise_at_trace_time(rng):
    cfg = _tiny()
    params = D.make_params(cfg, rng)
    state = H.init(cfg)
    state, step = H.prepare_forward(state, jnp.array([0]), jnp.array([0]), chunk=4)
    x = D.make_inputs(cfg, rng, 1, 4)
    with pytest.raises(ValueError, match="kv: expected dtype bfloat16"):
        H.write_window(state, step, 0, x[0]["kv"].astype(jnp.float32))
    with pytest.raises(ValueError, match=r"kv: expected shape \[1, T, 512\]"):
        H.write_window(state, step, 0, x[0]["kv"][..., :256])
    with pytest.raises(ValueError, match="layer: expected a static int"):
        H.write_window(state, step, 3, x[0]["kv"])
    with pytest.raises(ValueError, match="layer: expected a CSA or HCA layer"):
        H.compress(state, step, 0, x[1]["ckv"], x[1]["cscore"], params[1]["main"])
    with pytest.raises(ValueError, match="index: expected"):
        H.compress(state, step, 1, x[1]["ckv"], x[1]["cscore"], params[1]["main"])
    with pytest.raises(ValueError, match="params: expected bias"):
        H.compress(state, step, 2, x[2]["ckv"], x[2]["cscore"], params[1]["main"])
    with pytest.raises(ValueError, match="positions: expected shape"):
        H.prepare_forward(state, jnp.array([0, 1]), jnp.array([0]))
    with pytest.raises(ValueError, match="slots: expected an integer"):
        H.prepare_forward(state, jnp.array([0.0]), jnp.array([0]))


def test_eager_wrapper_raises(rng):
    cfg = _tiny()
    cache = H.HybridCache(cfg)
    x = D.make_inputs(cfg, rng, 1, 4)
    cache.prepare_forward(jnp.array([0]), jnp.array([0]), chunk=4)
    cache.write_window(0, x[0]["kv"])
    with pytest.raises(CacheError, match="position went backwards"):
        cache.prepare_forward(jnp.array([0]), jnp.array([2]), chunk=4)


def test_eager_index_topk_raises_on_a_nonfinite_score(rng):
    cfg = _tiny()
    csa = cfg.compress_ratios.index(4)
    cache = H.HybridCache(cfg)
    cache.prepare_forward(jnp.array([0]), jnp.array([0]), chunk=8)
    q = H.index_query(cache.state, jnp.asarray(rng.normal(size=(1, 8, cfg.index_heads, cfg.index_dim)), jnp.bfloat16))
    w = jnp.asarray(rng.normal(size=(1, 8, cfg.index_heads)), jnp.float32)
    idx = cache.index_topk(csa, q, w)
    assert idx.shape == (1, 8, min(cfg.top_k, cfg.max_entries(4)))
    with pytest.raises(CacheError, match="non-finite indexer scores"):
        cache.index_topk(csa, q, w.at[0, 7, 0].set(jnp.nan))
