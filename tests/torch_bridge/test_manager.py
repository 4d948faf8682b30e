"""torch_bridge.FlashInferKVCacheManager: the seed's _sanity_check scenario, attention equal
to dense attention over exactly the visible tokens, and clear errors. CPU (jaxkv attention)
here; with FlashInfer on a GPU the same tests run its paged attention."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge import FlashInferKVCacheManager  # noqa: E402
from torch_bridge import manager as M  # noqa: E402

from frame_model import FrameModel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
on_gpu = pytest.mark.skipif(DEVICE != "cuda" or not M.FLASHINFER_AVAILABLE, reason="needs CUDA torch and FlashInfer")


def _dense(q, k, v):
    """float64 softmax attention: q [Tq, H, D], k/v [Tk, H, D] (numpy)."""
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def _np(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def _sanity_check_scenario(tokens_per_frame, fa3=False):
    """The seed's _sanity_check: 2 blocks, block 0 gets 100 frames, then block 1 does."""
    num_special = 6
    page_size = tokens_per_frame - num_special
    if fa3:
        page_size = 1 << (page_size - 1).bit_length()
    mgr = FlashInferKVCacheManager(num_blocks=2, max_num_frames=88, tokens_per_frame=tokens_per_frame, num_heads=16,
                                   head_dim=64, dtype=torch.bfloat16, device=DEVICE, num_special_tokens=num_special,
                                   scale_frames=8, sliding_window=64, max_total_frames=200, fa3=fa3)
    gen = torch.Generator(device=DEVICE).manual_seed(tokens_per_frame)
    kv = {}

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE, generator=gen)

    for block in range(2):
        for t in range(100):
            k, v = rand(tokens_per_frame, 16, 64), rand(tokens_per_frame, 16, 64)
            kv[block, t] = (k, v)
            mgr.append_frame(block, k, v)
            mgr.evict_frames(block, scale_frames=8, sliding_window=64)
        n_scale, n_window = len(mgr.scale_patch_pages[block]), len(mgr.live_window_patch_pages[block])
        n_spec, sp_count = len(mgr.all_special_pages[block]), mgr.special_token_count[block]
        assert (n_scale, n_window) == (8, 64)
        assert n_spec == math.ceil(100 * num_special / page_size) and sp_count == 600
        tail = sp_count % page_size
        assert mgr.compute_last_page_len(block) == (page_size if tail == 0 else tail)
        visible = mgr.build_visible_page_table(block)
        assert len(visible) == n_scale + n_window + n_spec
        assert all(pid < mgr.max_patch_pages for pid in visible[: n_scale + n_window])
        assert all(pid >= mgr.max_patch_pages for pid in visible[n_scale + n_window:])
        assert len(set(visible)) == len(visible)
    return mgr, kv, rand


def _visible_kv(kv, block, model):
    tpf = model.tpf
    ks, vs = [], []
    for tid in model.visible_ids():
        k, v = kv[block, tid // tpf]
        ks.append(_np(k[tid % tpf]))
        vs.append(_np(v[tid % tpf]))
    return np.stack(ks), np.stack(vs)


@pytest.mark.slow
def test_seed_sanity_check_scenario():
    tpf = 262
    mgr, kv, rand = _sanity_check_scenario(tpf)
    assert mgr.compute_last_page_len(0) == 88
    model = FrameModel(8, 64, tpf - 6, 6, 200)
    for _ in range(100):
        model.append(False)
    for block in (0, 1):  # block 1 lagged 100 frames behind block 0 and still holds its own frames
        q = rand(tpf, 16, 64)
        out = mgr.compute_attention(block, q)
        assert out.shape == (tpf, 16, 64)
        k, v = _visible_kv(kv, block, model)
        np.testing.assert_allclose(_np(out), _dense(_np(q), k, v), atol=2e-2, rtol=2e-2)
    mgr.reset()
    assert mgr.frame_count[0] == 0 and mgr.num_frames == 0 and mgr.compute_last_page_len(0) == tpf - 6


@pytest.mark.parametrize("force_fp32, fa3", [(False, False), (True, False), (True, True)])
def test_attention_equals_dense_over_visible_tokens(force_fp32, fa3):
    """Lockstep blocks with deferred frames committed or rolled back, like keyframe selection.
    (fa3 pads pages to 16 rows; FlashInfer's FA3 would attend the padding as the seed's does,
    so that case runs on jaxkv's masked reference attention.)"""
    L, H, D, P, NS, S, W = 3, 2, 64, 12, 2, 2, 3  # head_dim 64: FlashInfer has no FA2 kernel for 16
    tpf = P + NS
    mgr = FlashInferKVCacheManager(num_blocks=L, max_num_frames=8, tokens_per_frame=tpf, num_heads=H, head_dim=D,
                                   dtype=torch.bfloat16, device=DEVICE, num_special_tokens=NS, scale_frames=S,
                                   sliding_window=W, max_total_frames=4, force_fp32=force_fp32, fa3=fa3)
    model = FrameModel(S, W, P, NS, 10 ** 6)
    rs = np.random.default_rng(7 + force_fp32)
    dtype = torch.float32 if force_fp32 else torch.bfloat16
    kv = {}
    for step in range(24):  # more frames than max_total_frames: the special capacity grows
        defer = bool(rs.random() < 0.4)
        mgr._defer_eviction = defer
        f = model.count
        model.append(defer)
        outs = []
        for b in range(L):
            k = torch.tensor(rs.normal(size=(tpf, H, D)), dtype=dtype, device=DEVICE)
            v = torch.tensor(rs.normal(size=(tpf, H, D)), dtype=dtype, device=DEVICE)
            kv[b, f] = (k, v)
            mgr.append_frame(b, k, v)
            mgr.evict_frames(b, scale_frames=S, sliding_window=W)
            q = torch.tensor(rs.normal(size=(tpf, H, D)), dtype=dtype, device=DEVICE)
            outs.append((q, mgr.compute_attention(b, q)))
        for b, (q, out) in enumerate(outs):
            k, v = _visible_kv(kv, b, model)
            tol = 1e-5 if force_fp32 else 2e-2
            np.testing.assert_allclose(_np(out), _dense(_np(q), k, v), atol=tol, rtol=tol)
        if defer:
            keep = bool(rs.random() < 0.5)
            for b in range(L):
                if keep:
                    mgr.execute_deferred_eviction(b, scale_frames=S, sliding_window=W)
                else:
                    mgr.rollback_last_frame(b)
            model.resolve(keep)
            mgr._defer_eviction = False
        assert mgr.num_frames == model.count
        assert mgr.special_token_count == [model.count * NS] * L
    mgr.check()


@pytest.mark.parametrize("S, W, pow2", [(2, 3, False), (1, 0, False), (0, 2, True), (2, 3, True)])
def test_host_mirror_equals_device_bookkeeping(S, W, pow2):
    """The manager takes rows, moves and page ids from its host mirror (``_Pages``), never
    from the device: over random appends, deferred commits and rollbacks they must equal
    what ``jaxkv.frame`` computes on the device."""
    import jax.numpy as jnp

    from jaxkv import frame
    from jaxkv.frame import ops

    spec = frame.FrameSpec(num_layers=1, num_heads=1, head_dim=8, patches_per_frame=5, num_special=3,
                           scale_frames=S, sliding_window=W, max_frames=64, pow2_pages=pow2)
    meta = frame.init(spec).replace(k=(), v=())
    start, calls = meta, []
    pages = M._Pages(spec)
    rs = np.random.default_rng(S * 10 + W + pow2)

    def device_moves(m):  # i32[M, 3] (stream, src, dst); dst = trash where no move is made
        return [(int(src), int(dst)) for _, src, dst in np.asarray(m) if dst != spec.trash_row]

    for _ in range(40):
        if pages.pending != M.NONE:
            keep = bool(rs.random() < 0.5)
            calls.append((M.RESOLVE, keep))
            meta, m = ops.resolve_moves(meta, keep)
            assert pages.resolve(keep) == device_moves(m)
        else:
            defer = bool(rs.random() < 0.4)
            calls.append((M.BEGIN, defer))
            meta, m = ops.begin_frame_moves(meta, defer)
            moves, special_row, patch_row = pages.begin(defer)
            assert moves == device_moves(m)
            assert (special_row, patch_row) == (int(meta.write_special_row[0]), int(meta.write_patch_row[0]))
        table = frame.page_table(meta)
        assert pages.num_pages() == int(table.num_pages[0])
        assert pages.page_ids() == np.asarray(table.indices[0, : pages.num_pages()]).tolist()
        assert pages.last_page_len() == int(table.last_page_len[0])
        assert tuple(pages.c) == tuple(int(getattr(meta, name)[0]) for name in pages.c._fields)
    assert int(jnp.max(meta.error)) == 0
    # The manager replays its queued bookkeeping in one batched call: the same state.
    padded = np.zeros((M.REPLAY, 2), np.int32)
    padded[: len(calls)] = calls
    replayed = M._replay(start, padded)
    for name in ("token_id", "num_frames", "num_scale", "num_window", "window_head", "num_special", "pending",
                 "write_patch_row", "write_special_row", "error"):
        np.testing.assert_array_equal(np.asarray(getattr(replayed, name)), np.asarray(getattr(meta, name)), err_msg=name)


def test_errors():
    mgr = FlashInferKVCacheManager(num_blocks=2, max_num_frames=8, tokens_per_frame=10, num_heads=2, head_dim=8,
                                   dtype=torch.bfloat16, device=DEVICE, num_special_tokens=2, scale_frames=1,
                                   sliding_window=2)
    k = torch.randn(10, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="block_idx"):
        mgr.append_frame(2, k, k)
    with pytest.raises(ValueError, match="k: expected a tensor of shape"):
        mgr.append_frame(0, k[:9], k)
    with pytest.raises(ValueError, match="rollback"):
        mgr.rollback_last_frame(0)
    mgr.append_frame(0, k, k)
    with pytest.raises(RuntimeError, match="_defer_eviction"):
        mgr.rollback_last_frame(0)
    with pytest.raises(ValueError, match="sliding_window"):
        mgr.evict_frames(0, scale_frames=1, sliding_window=64)
    with pytest.raises(ValueError, match="tokens_per_frame"):
        FlashInferKVCacheManager(1, 8, 6, 2, 8, torch.bfloat16, DEVICE)
    assert mgr.num_frames == 1  # the failed calls changed nothing
    assert torch.equal(mgr.compute_attention(1, k), torch.zeros_like(k))  # block 1 has no frame yet


@on_gpu
@pytest.mark.gpu
def test_flashinfer_backend_selected():
    mgr = FlashInferKVCacheManager(2, 88, 262, 16, 64, torch.bfloat16, "cuda")
    assert mgr.backend == "flashinfer-fa2"


def _stream(mgr, steps, seed0):
    """Frames ``seed0 ..`` for every block, every third one deferred then kept or rolled back;
    -> attention outputs of each block at each frame."""
    H, D, tpf = mgr.num_heads, mgr.head_dim, mgr.tokens_per_frame
    outs = []
    for t in range(seed0, seed0 + steps):
        gen = torch.Generator(device=DEVICE).manual_seed(t)
        mgr._defer_eviction = t % 3 == 2
        for b in range(mgr.num_blocks):
            k, v, q = (torch.randn(tpf, H, D, generator=gen, device=DEVICE).to(torch.bfloat16) for _ in range(3))
            mgr.append_frame(b, k, v)
            outs.append(mgr.compute_attention(b, q).float().cpu())
        if t % 3 == 2:
            for b in range(mgr.num_blocks):
                if t % 2 == 0:
                    mgr.execute_deferred_eviction(b, scale_frames=mgr.scale_frames, sliding_window=mgr.sliding_window)
                else:
                    mgr.rollback_last_frame(b)
    return outs


def _manager():
    return FlashInferKVCacheManager(num_blocks=2, max_num_frames=8, tokens_per_frame=10, num_heads=2, head_dim=64,
                                    dtype=torch.bfloat16, device=DEVICE, num_special_tokens=2, scale_frames=1,
                                    sliding_window=3, max_total_frames=16)


@pytest.mark.parametrize("via", ["state_dict", "files"])
def test_save_and_continue_bit_identically(tmp_path, via):
    """Stream, save (state_dict or jaxkv checkpoint files), load into a fresh manager, stream
    on: every output equals the uninterrupted manager's."""
    whole = _manager()
    want = _stream(whole, 12, 0)
    first = _manager()
    got = _stream(first, 7, 0)
    second = _manager()
    if via == "state_dict":
        second.load_state_dict(first.state_dict())
    else:
        first.save(tmp_path / "mgr")
        second.restore(tmp_path / "mgr")
    got += _stream(second, 5, 7)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    other = FlashInferKVCacheManager(num_blocks=2, max_num_frames=8, tokens_per_frame=10, num_heads=2, head_dim=64,
                                     dtype=torch.bfloat16, device=DEVICE, num_special_tokens=2, scale_frames=1,
                                     sliding_window=4, max_total_frames=16)
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"spec differs.*sliding_window=3 \(this manager: 4\)"):
        other.load_state_dict(first.state_dict())
    after = other.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "spec")  # nothing changed
