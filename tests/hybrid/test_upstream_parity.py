"""The hybrid cache against DeepSeek-V4's own inference code, layer by layer.

Upstream's ``inference/`` checkout comes from ``$DSV4_SRC`` (its ``model.py`` and the
pure-torch ``kernel.py``; skipped without it or without torch; CI has neither). One
upstream ``Attention`` module per layer kind (SWA, CSA with its indexer, HCA), random
weights, a prefill from position 0 then decode steps (the schedule upstream's code
supports), two requests. The projections upstream computes (``wkv`` / ``wgate`` of both
compressors, the queries, the window token, the indexer's queries and weights) are taken
from its modules as it runs and fed to jaxkv's ``compress`` / ``index_query`` /
``index_topk`` / ``attention``; then, after every step:

* the stored compressed entries and indexer keys, decoded, equal upstream's caches;
* the indexer scores equal scores computed in float64 from upstream's own FP4 queries and
  keys, and jaxkv's top-k is a top-k of them;
* the attention output over the entries upstream picked equals upstream's ``sparse_attn``.

``kernel.py`` simulates FP8 / FP4 without rounding (its in-place ``act_quant`` keeps
``x / s`` unrounded); the tilelang kernels upstream runs on a GPU round to FP8 E4M3 and
E2M1. The harness swaps in quantizers that round as those kernels do (ml_dtypes and torch
casts, not jaxkv's codecs), so the bytes can be compared.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxkv
from jaxkv import hybrid as H
from jaxkv._backend import OPERATIONS, choices

torch = pytest.importorskip("torch")

SRC = os.environ.get("DSV4_SRC")
INFERENCE = Path(SRC) / "inference" if SRC else None
pytestmark = pytest.mark.skipif(
    INFERENCE is None or not (INFERENCE / "model.py").is_file(),
    reason="needs DeepSeek-V4's inference code in $DSV4_SRC (a checkout holding inference/model.py, "
    "e.g. github.com/Nicooo-Wang/DeepSeek-V4-Pro-code)",
)

B, WINDOW, TOP_K, HEADS = 2, 32, 6, 64
RATIOS = (0, 4, 8)  # SWA, CSA (indexer), HCA (8 here: any ratio but 4 is HCA)
BLOCK = 32  # the kernels take blocks by 32; a CSA request spans two
PREFILL, DECODE = 150, 20  # the ring wraps, both ratios flush in prefill and in decode, prefill leaves tails
# and a prefill shorter than a window: nothing flushes in it, the ring fills and wraps in decode
SCHEDULES = {"long-prefill": (PREFILL, DECODE), "short-prefill": (3, 36)}
MAX_LEN = 256


def _upstream():
    """Upstream's ``model`` module, its quantizers rounding as its GPU kernels do."""
    if str(INFERENCE) not in sys.path:
        sys.path.insert(0, str(INFERENCE))
    import model

    model.act_quant = _act_quant
    model.fp4_act_quant = _fp4_act_quant
    sys.modules["fast_hadamard_transform"] = type(sys)("fast_hadamard_transform")  # what rotate_activation
    sys.modules["fast_hadamard_transform"].hadamard_transform = _hadamard  # imports first (upstream's GPU path)
    model.scale_fmt = "ue8m0"  # Transformer.__init__ sets it from the config (scale_fmt "ue8m0")
    return model


def _pow2_ceil(s):
    """2 ** ceil(log2(s)), exact (the tilelang kernels' bit arithmetic)."""
    m, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


def _act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    """In-place FP8 E4M3 round trip per ``block_size`` tile (kernel_tilelang's act_quant)."""
    assert inplace
    t = x.float().unflatten(-1, (-1, block_size))
    s = t.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / 448)
    if scale_fmt is not None:
        s = _pow2_ceil(s)
    q = (t / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return x.copy_((q * s).flatten(-2).to(x.dtype))


def _fp4_act_quant(x, block_size=32, inplace=True):
    """In-place FP4 E2M1 round trip, power-of-two scale per ``block_size`` (kernel_tilelang's)."""
    assert inplace
    t = x.float().unflatten(-1, (-1, block_size))
    s = _pow2_ceil(t.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126) * (1.0 / 6))
    q = (t / s).clamp(-6, 6).numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return x.copy_((torch.from_numpy(q) * s).flatten(-2).to(x.dtype))


def _hadamard(x, scale):
    """fast_hadamard_transform's transform: float32 sums, scaled, rounded to x's dtype once
    (kernel.py's fallback multiplies in bf16 and rounds twice)."""
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return ((x.float() @ h) * scale).to(x.dtype)


def _modules(model, seed, top_k=TOP_K):
    """Upstream's Attention for each layer of RATIOS, with random weights."""
    args = model.ModelArgs(
        max_batch_size=B,
        max_seq_len=MAX_LEN,
        dtype="bf16",
        scale_fmt="ue8m0",
        expert_dtype=None,
        scale_dtype="fp32",
        dim=64,
        n_heads=HEADS,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window_size=WINDOW,
        compress_ratios=RATIOS,
        index_n_heads=4,
        index_topk=top_k,
        original_seq_len=64,
    )  # small: YaRN's interpolation shows at these positions
    torch.manual_seed(seed)
    layers = []
    for layer in range(len(RATIOS)):
        with model.set_dtype(torch.bfloat16):
            attn = model.Attention(layer, args)
        with torch.no_grad():
            for name, p in attn.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
                elif name.endswith("ape") or name == "attn_sink":
                    p.copy_(torch.randn_like(p, dtype=torch.float32))
                else:
                    p.copy_(torch.randn_like(p, dtype=torch.float32) * p.shape[-1] ** -0.5)
        layers.append(attn)
    return args, layers


class _Recorder:
    """What one upstream layer computes in a step, taken as it runs (hooks and wrappers)."""

    def __init__(self, model, attn):
        self.model, self.attn, self.got = model, attn, {}
        hooks = [(attn.wkv, "window_raw")]
        if attn.compress_ratio:
            hooks += [(attn.compressor.wkv, "ckv"), (attn.compressor.wgate, "cscore")]
        if getattr(attn, "indexer", None) is not None:
            ix = attn.indexer
            hooks += [(ix.compressor.wkv, "ikv"), (ix.compressor.wgate, "iscore"), (ix.weights_proj, "iw")]
        for module, key in hooks:
            module.register_forward_hook(lambda m, i, o, key=key: self.got.__setitem__(key, o.detach().clone()))

    def run(self, x, start):
        model, got = self.model, self.got
        got.clear()
        sparse_attn, rotate = model.sparse_attn, model.rotate_activation

        def rec_attn(q, kv, sink, idx, scale):
            o = sparse_attn(q, kv, sink, idx, scale)
            got.update(q=q.clone(), kv=kv.clone(), idx=idx.clone(), out=o.clone())
            return o

        def rec_rotate(v):
            out = rotate(v)
            if v.ndim == 4:  # the indexer's queries (its keys are [B, n, 128]); fp4-rounded in place after
                got.update(iq=v.clone(), iq_fp4=out)
            return out

        model.sparse_attn, model.rotate_activation = rec_attn, rec_rotate
        try:
            with torch.no_grad():
                self.attn(x, start)
        finally:
            model.sparse_attn, model.rotate_activation = sparse_attn, rotate
        got["iq_fp4"] = got.get("iq_fp4", torch.zeros(0)).clone()
        return got


def _config(args):
    return H.HybridConfig(
        compress_ratios=RATIOS,
        window=WINDOW,
        index_heads=args.index_n_heads,
        index_dim=args.index_head_dim,
        top_k=args.index_topk,
        block_size=BLOCK,
        max_requests=B,
        max_context=MAX_LEN,
        storage="official",
        rope_theta=args.compress_rope_theta,
        rope_factor=args.rope_factor,
        original_seq_len=args.original_seq_len,
        beta_fast=args.beta_fast,
        beta_slow=args.beta_slow,
    )


def _j(t, dtype=None):
    a = jnp.asarray(t.detach().float().numpy())
    return a if dtype is None else a.astype(dtype)


def _np(t):
    return t.detach().float().numpy()


def _params(c):
    return H.CompressorParams(bias=_j(c.ape), norm=_j(c.norm.weight))


def _window_token(got, T, start):
    """bf16[B, T, 512]: the step's own tokens as upstream attends to them (after RoPE and FP8)."""
    return got["kv"][:, :T] if start == 0 else got["kv"][:, start % WINDOW][:, None]


def _picked(got, T, start, ratio):
    """i32[B, T, TOP_K]: the compressed entries upstream's sparse_attn read (-1: none)."""
    wlen = min(T, WINDOW) if start == 0 else WINDOW
    offset = T if start == 0 else WINDOW
    ids = _np(got["idx"][..., wlen:]).astype(np.int64)
    ids = np.where(ids >= 0, ids - offset, -1)
    out = np.full((B, T, TOP_K), -1, np.int32)
    out[..., : ids.shape[-1]] = ids
    return jnp.asarray(out)


def _assert_entries_match(want, got, what):
    """Decoded entries: the same values, but for rare last-bit differences of a BF16 RoPE dim (the
    pooled value comes out of float32 math done in another order). A flipped FP8 / FP4 code would
    differ by far more (measured: 99.99% identical, none off by more than 6e-5)."""
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    assert want.shape == got.shape, what
    if not want.size:
        return
    same = np.mean(want == got)
    assert same >= 0.999, f"{what}: only {same:.4f} of the values are identical"
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=0, err_msg=what)


IMPLS = [i for i in choices("hybrid.attention") if i != "auto"]


def _skip_missing(impl):
    if impl != "xla" and (
        why := OPERATIONS["hybrid.attention"].missing[impl](
            heads=HEADS, block_size=BLOCK, window=WINDOW, storage="official"
        )
    ):
        pytest.skip(why)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("impl", IMPLS)
def test_layers_match_upstream(impl, schedule):
    _skip_missing(impl)
    prefill, decode = SCHEDULES[schedule]
    model = _upstream()
    args, layers = _modules(model, seed=0)
    recorders = [_Recorder(model, attn) for attn in layers]
    cfg = _config(args)
    state = H.init(cfg)
    x_all = torch.randn(B, prefill + decode, args.dim, dtype=torch.float32).to(torch.bfloat16)
    compress = jax.jit(H.compress, static_argnums=2)
    topk = jax.jit(H.index_topk, static_argnums=2)
    scores = jax.jit(H.index_scores, static_argnums=2)
    attend = jax.jit(H.attention, static_argnums=2, static_argnames="impl")
    write = jax.jit(H.write_window, static_argnums=2)

    start = 0
    for T in [prefill] + [1] * decode:
        state, step = H.prepare_forward(state, jnp.arange(B), jnp.full((B,), start), chunk=T)
        x = x_all[:, start : start + T]
        for layer, (attn, rec) in enumerate(zip(layers, recorders)):
            got = rec.run(x, start)
            ratio, where = RATIOS[layer], f"layer {layer} (ratio {RATIOS[layer]}), tokens {start}..{start + T - 1}"
            kv = _j(_window_token(got, T, start), jnp.bfloat16)
            idx = None
            if ratio:
                index = None
                if getattr(attn, "indexer", None) is not None:
                    index = (_j(got["ikv"]), _j(got["iscore"]), _params(attn.indexer.compressor))
                state = compress(state, step, layer, _j(got["ckv"]), _j(got["cscore"]), _params(attn.compressor), index)
                n = (start + T) // ratio
                entries, _ = H.all_entries(state, step, layer)
                _assert_entries_match(_np(attn.kv_cache[:, WINDOW : WINDOW + n]), entries[:, :n], f"entries, {where}")
            if getattr(attn, "indexer", None) is not None:
                ix = attn.indexer
                _assert_entries_match(
                    _np(ix.kv_cache[:, :n]), H.index_keys(state, step, layer)[0][:, :n], f"indexer keys, {where}"
                )
                iq = H.index_query(state, _j(got["iq"], jnp.bfloat16))
                np.testing.assert_array_equal(
                    np.asarray(iq, np.float32), _np(got["iq_fp4"]), err_msg=f"indexer queries, {where}"
                )
                iw = _j(got["iw"] * (ix.softmax_scale * ix.n_heads**-0.5))
                _assert_topk(
                    scores(state, step, layer, iq, iw),
                    topk(state, step, layer, iq, iw),
                    _np(got["iq_fp4"]).astype(np.float64),
                    _np(ix.kv_cache[:, :n]).astype(np.float64),
                    np.asarray(iw, np.float64),
                    start,
                    T,
                    ratio,
                    where,
                )
                idx = _picked(got, T, start, ratio)
            out = attend(state, step, layer, _j(got["q"], jnp.bfloat16), _j(attn.attn_sink), kv, idx, impl=impl)
            want = _np(got["out"])
            np.testing.assert_allclose(
                np.asarray(out, np.float32),
                want,
                atol=2e-2 * np.abs(want).max() + 1e-3,
                err_msg=f"attention output, {where}",
            )
            state = write(state, step, layer, kv)
        start += T
    jaxkv.check(state)  # no fault recorded on the way


def _assert_topk(s, picked, q, keys, w, start, T, ratio, where):
    """jaxkv's scores equal float64 scores of upstream's FP4 queries and keys, and its picks are
    a top-k of them (ties within the float32 error may go either way)."""
    s, picked = np.asarray(s, np.float64), np.asarray(picked)
    want = np.einsum("bthd,bnd->bthn", q, keys)
    want = (np.maximum(want, 0) * w[..., None]).sum(2)  # [B, T, n]
    pos = start + np.arange(T)
    visible = np.arange(keys.shape[1])[None, :] < ((pos + 1) // ratio)[:, None]  # [T, n]
    want = np.where(visible[None], want, -np.inf)
    n = keys.shape[1]
    tol = 1e-5 * np.abs(np.where(np.isfinite(want), want, 0)).max(initial=0) + 1e-6
    np.testing.assert_allclose(
        np.where(np.isfinite(want), s[..., :n], 0),
        np.where(np.isfinite(want), want, 0),
        atol=tol,
        rtol=1e-5,
        err_msg=f"indexer scores, {where}",
    )
    assert np.all(np.isneginf(s[..., :n][~np.isfinite(want)])), f"indexer scores of unseen entries, {where}"
    for b in range(B):
        for t in range(T):
            row = want[b, t]
            k = min(TOP_K, int(np.isfinite(row).sum()))
            chosen = picked[b, t][picked[b, t] >= 0]
            assert len(chosen) == k and len(set(chosen.tolist())) == k, f"top-k count, {where}, row {b}, token {t}"
            kth = np.sort(row)[::-1][k - 1] if k else np.inf
            assert np.all(row[chosen] >= kth - tol), f"top-k misses a better entry, {where}, row {b}, token {t}"


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_block_matches_upstream(impl):
    """``models.deepseek_v4.V4Attention`` with upstream's weights gives upstream's layer output
    (measured with impl="xla": within 0.9% of max|out|, bf16 matmuls rounded in other places)."""
    _skip_missing(impl)
    from flax import nnx

    from jaxkv.models.deepseek_v4 import V4Attention, V4AttentionConfig, load_upstream

    model = _upstream()
    # top-k above the entries a request reaches: both pick every visible entry. Upstream scores in
    # bf16, so near-ties pick differently (test_layers_match_upstream checks the picks)
    args, layers = _modules(model, seed=1, top_k=64)
    cfg = V4AttentionConfig(
        cache=_config(args),
        dim=args.dim,
        num_heads=HEADS,
        q_lora_rank=args.q_lora_rank,
        o_groups=args.o_groups,
        o_lora_rank=args.o_lora_rank,
        rope_theta=args.rope_theta,
        norm_eps=args.norm_eps,
    )
    blocks = []
    for layer, attn in enumerate(layers):
        block = V4Attention(cfg, layer, rngs=nnx.Rngs(layer))
        load_upstream(block, attn.state_dict())
        blocks.append(nnx.split(block))

    @jax.jit
    def run(params, state, step, x):
        outs = []
        for (graph, _), p in zip(blocks, params):
            state, y = nnx.merge(graph, p)(state, step, x, impl=impl)
            outs.append(y)
        return state, outs

    state = H.init(cfg.cache)
    x_all = torch.randn(B, PREFILL + DECODE, args.dim, dtype=torch.float32).to(torch.bfloat16)
    start = 0
    for T in [PREFILL] + [1] * DECODE:
        state, step = H.prepare_forward(state, jnp.arange(B), jnp.full((B,), start), chunk=T)
        x = x_all[:, start : start + T]
        state, outs = run([p for _, p in blocks], state, step, _j(x, jnp.bfloat16))
        for layer, (attn, y) in enumerate(zip(layers, outs)):
            with torch.no_grad():
                want = _np(attn(x, start))
            np.testing.assert_allclose(
                np.asarray(y, np.float32),
                want,
                atol=2e-2 * np.abs(want).max(),
                err_msg=f"layer {layer} (ratio {RATIOS[layer]}), tokens {start}..{start + T - 1}",
            )
        start += T
    jaxkv.check(state)
