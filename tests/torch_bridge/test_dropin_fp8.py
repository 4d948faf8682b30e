"""The torch drop-in with an FP8 cache (``dtype=torch.float8_e4m3fn``): jaxkv's bytes, its
attention over the dequantized visible tokens, refusals, faults and checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from frame_model import FrameModel  # noqa: E402
from test_manager import BACKENDS_HERE, DEVICE, _dense, _np, _visible_kv  # noqa: E402

from jaxkv import CacheError, Fault, _backend  # noqa: E402
from jaxkv.formats import dequantize_fp8_rows, quantize_fp8_rows  # noqa: E402
from torch_bridge import FlashInferKVCacheManager, fp8  # noqa: E402
from torch_bridge.backends import PREFIX_BACKENDS  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_BACKENDS = [b for b in BACKENDS_HERE if b in PREFIX_BACKENDS]


def _jaxkv_rows(x: torch.Tensor):
    """jaxkv.formats' codes (as bytes) and scales of bf16 rows: the rule's owner."""
    codes, scale = quantize_fp8_rows(jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16))
    return np.asarray(codes).view(np.uint8), np.asarray(scale).astype(np.float32)


def test_quantize_rows_gives_jaxkvs_bytes():
    """Codes and scales bit-equal to jaxkv.formats.quantize_fp8_rows over rows of every
    magnitude (subnormal codes within a row included), zero rows and non-finite rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 4, 64, generator=g) * torch.logspace(-8, 4, 96)[:, None, None]
    x[1, 2] = 0.0
    x[2, 0, 5] = float("nan")
    x[3, 3, 9] = float("inf")
    x[4, 1, :] = 1e-35  # a bf16 subnormal row
    x = x.to(torch.bfloat16).to(DEVICE)
    codes, scale = fp8.quantize_rows(x)
    want_codes, want_scale = _jaxkv_rows(x)
    assert codes.dtype == FP8 and scale.dtype == torch.bfloat16
    np.testing.assert_array_equal(codes.view(torch.uint8).cpu().numpy(), want_codes)
    np.testing.assert_array_equal(scale.float().cpu().numpy(), want_scale)
    assert torch.isnan(scale[2, 0]) and torch.isnan(scale[3, 3]) and scale[1, 2] == 0
    back = fp8.dequantize_rows(codes, scale)
    want = dequantize_fp8_rows(jnp.asarray(want_codes.view(jnp.float8_e4m3fn)), jnp.asarray(want_scale))
    np.testing.assert_array_equal(_np(back), np.asarray(want, np.float64))


def _manager(backend, dtype=FP8, max_total_frames=4, **kw):
    args = dict(num_blocks=3, max_num_frames=8, tokens_per_frame=14, num_heads=2, head_dim=64)
    args.update(dtype=dtype, device=DEVICE, num_special_tokens=2, scale_frames=2, sliding_window=3)
    return FlashInferKVCacheManager(**args, max_total_frames=max_total_frames, backend=backend, **kw)


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_attention_over_the_dequantized_visible_tokens(backend):
    """Lockstep blocks through the scale frames, window eviction and deferred frames kept or
    rolled back: each output equals float64 attention over exactly the visible tokens as
    jaxkv's FP8 rule stores them (the special capacity grows on the way); against the bf16
    cache the largest difference of any output element was 0.10 (unit-variance K/V)."""
    L, P, NS, S, W, H, D = 3, 12, 2, 2, 3, 2, 64
    mgr, ref = _manager(backend), _manager(backend, torch.bfloat16)
    assert mgr.dtype == FP8 and mgr.compute_dtype == torch.bfloat16
    model = FrameModel(S, W, P, NS, 10**6)
    rs = np.random.default_rng(11)
    kv, worst = {}, 0.0

    def rand():
        return torch.tensor(rs.normal(size=(P + NS, H, D)), dtype=torch.float32, device=DEVICE)

    def stored(x):  # the bf16 frame through jaxkv's FP8 rows
        c, s = _jaxkv_rows(x.to(torch.bfloat16))
        return np.asarray(dequantize_fp8_rows(jnp.asarray(c.view(jnp.float8_e4m3fn)), jnp.asarray(s)), np.float64)

    for _ in range(16):
        defer = bool(rs.random() < 0.4)
        mgr._defer_eviction = ref._defer_eviction = defer
        f = model.count
        model.append(defer)
        outs = []
        for b in range(L):
            k, v, q = rand(), rand(), rand()
            kv[b, f] = (torch.from_numpy(stored(k)), torch.from_numpy(stored(v)))
            for m in (mgr, ref):
                m.append_frame(b, k, v)
            out = mgr.compute_attention(b, q)
            assert out.dtype == torch.bfloat16 and out.shape == (P + NS, H, D)
            outs.append((q.to(torch.bfloat16), out, ref.compute_attention(b, q)))
        for b, (q, out, out_bf16) in enumerate(outs):
            k, v = _visible_kv(kv, b, model)
            np.testing.assert_allclose(_np(out), _dense(_np(q), k, v), atol=2e-2, rtol=2e-2, err_msg=f"{f} {b} {defer}")
            worst = max(worst, float((out.float() - out_bf16.float()).abs().max()))
        if defer:
            keep = bool(rs.random() < 0.5)
            for b in range(L):
                for m in (mgr, ref):
                    if keep:
                        m.execute_deferred_eviction(b, scale_frames=S, sliding_window=W)
                    else:
                        m.rollback_last_frame(b)
            model.resolve(keep)
            mgr._defer_eviction = ref._defer_eviction = False
    assert 0.0 < worst < 0.15, worst  # FP8's 3 mantissa bits
    mgr.check()
    cache = lambda m: sum(t.numel() * t.element_size() for t in (*m._k, *m._v, *m._k_scale, *m._v_scale))  # noqa: E731
    assert cache(mgr) <= 0.53 * cache(ref)


def test_refusals_name_the_argument():
    """FP8 with force_fp32, a paged backend for FP8 storage, an FP8 checkpoint into a bf16
    manager: ValueErrors naming what differs; auto with fa3 does not pick paged FA3 for FP8."""
    with pytest.raises(ValueError, match="dtype: torch.float8_e4m3fn .* force_fp32"):
        _manager("sdpa", force_fp32=True)
    ctx = dict(device="cuda:0", flashinfer=True, cuda_kernel=True, head_dim=64, fa3=True, tokens_per_frame=1005)
    for paged in ("flashinfer-paged-fa2", "flashinfer-paged-fa3"):
        with pytest.raises(ValueError, match="FP8 storage is attended through its dequantized visible rows"):
            _backend.choose("torch.attention", paged, dtype="float8_e4m3fn", **ctx)
    assert _backend.choose("torch.attention", "auto", dtype="float8_e4m3fn", **ctx) != "flashinfer-paged-fa3"
    assert _backend.choose("torch.attention", "auto", dtype="bfloat16", **ctx) == "flashinfer-paged-fa3"
    src, dst = _manager("sdpa"), _manager("sdpa", torch.bfloat16)
    src.append_frame(0, torch.randn(14, 2, 64, device=DEVICE), torch.randn(14, 2, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"spec differs.*dtype='float8_e4m3fn' \(this manager: 'bfloat16'\)"):
        dst.load_state_dict(src.state_dict())


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_nonfinite_frame_goes_to_the_trash(backend):
    """A frame holding a NaN: no code or scale of any other row changes against a run fed a
    clean frame, attention stays finite, check() raises NONFINITE_KV, also after a
    state_dict round trip; a later run continues bit-identically from the round trip."""
    g = torch.Generator().manual_seed(5)
    frames = [tuple(torch.randn(14, 2, 64, generator=g).to(DEVICE) for _ in range(3)) for _ in range(7)]
    bad, good = _manager(backend, max_total_frames=16), _manager(backend, max_total_frames=16)
    for t, (k, v, _) in enumerate(frames[:6]):
        for blk in range(3):
            good.append_frame(blk, k + blk, v)
            kb = (k + blk).clone()
            if (t, blk) == (5, 2):
                kb[4, 1, 3] = float("nan")
            bad.append_frame(blk, kb, v)
    with pytest.raises(CacheError) as e:
        bad.check()
    assert e.value.faults == {0: Fault.NONFINITE_KV}
    T, rows = bad.spec.trash_row, bad._rows.cpu()
    for blk in range(3):
        same = torch.ones(T, dtype=torch.bool)
        if blk == 2:
            same[rows] = False  # the poisoned frame's rows keep what they held
        for name in ("_k", "_v", "_k_scale", "_v_scale"):
            x, y = getattr(bad, name)[blk][:T].cpu(), getattr(good, name)[blk][:T].cpu()
            assert torch.equal(x.view(torch.uint8)[same], y.view(torch.uint8)[same]), name
    assert torch.isfinite(bad.compute_attention(2, frames[0][2])).all()
    other = _manager(backend, max_total_frames=16)
    other.load_state_dict(bad.state_dict())
    with pytest.raises(CacheError):
        other.check()
    k, v, q = frames[6]
    for m in (bad, other):
        for blk in range(3):
            m.append_frame(blk, k, v)
    for blk in range(3):
        assert torch.equal(bad.compute_attention(blk, q), other.compute_attention(blk, q))
