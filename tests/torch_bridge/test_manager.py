"""torch_bridge.FlashInferKVCacheManager: the seed's _sanity_check scenario, attention equal
to dense attention over exactly the visible tokens, the contiguous visible prefix, and clear
errors. Every backend that can run here: "sdpa" on CPU; on a GPU with FlashInfer also
"flashinfer" and the paged ones (GPU-marked tests compare them with "sdpa")."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from frame_model import FrameModel  # noqa: E402

from jaxkv.frame import NONE  # noqa: E402
from torch_bridge import FlashInferKVCacheManager, fp8, kernels  # noqa: E402
from torch_bridge import backends as B  # noqa: E402
from torch_bridge import pages as P  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_FLASHINFER_GPU = DEVICE == "cuda" and B.FLASHINFER_AVAILABLE
HAS_CUDA_KERNEL = DEVICE == "cuda" and kernels.prefix_attention_available(DEVICE)
on_gpu = pytest.mark.skipif(not HAS_FLASHINFER_GPU, reason="needs CUDA torch and FlashInfer")


def _backends_here():
    out = ["sdpa"]
    if HAS_CUDA_KERNEL:
        out.append("cuda")
    if HAS_FLASHINFER_GPU:
        out += ["flashinfer", "flashinfer-paged-fa2"]
        if torch.cuda.get_device_capability()[0] >= 9:  # FlashInfer's FA3 kernels are sm90+
            out.append("flashinfer-paged-fa3")
    return out


BACKENDS_HERE = _backends_here()


def _dense(q, k, v):
    """float64 softmax attention: q [Tq, H, D], k/v [Tk, H, D] (numpy)."""
    s = np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)) / math.sqrt(q.shape[-1])  # BLAS, not einsum's loops
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.matmul(p, v.transpose(1, 0, 2)).transpose(1, 0, 2)


def _np(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def _sanity_check_scenario(tokens_per_frame, backend="auto"):
    """The seed's _sanity_check: 2 blocks, block 0 gets 100 frames, then block 1 does."""
    num_special = 6
    page_size = tokens_per_frame - num_special
    if backend == "flashinfer-paged-fa3":
        page_size = 1 << (page_size - 1).bit_length()
    mgr = FlashInferKVCacheManager(
        num_blocks=2,
        max_num_frames=88,
        tokens_per_frame=tokens_per_frame,
        num_heads=16,
        head_dim=64,
        dtype=torch.bfloat16,
        device=DEVICE,
        num_special_tokens=num_special,
        scale_frames=8,
        sliding_window=64,
        max_total_frames=200,
        backend=backend,
    )
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
        assert all(pid >= mgr.max_patch_pages for pid in visible[n_scale + n_window :])
        assert len(set(visible)) == len(visible)
    return mgr, kv, rand


def _visible_kv(kv, block, model, mgr=None):
    """The K/V of exactly the visible tokens (the FrameModel oracle), in token-id order; for
    the paged FA3 backend also the zero padding rows of each patch page, which it attends as
    the seed's does (a staged frame sits in the tail, unpadded)."""
    ids = np.asarray(model.visible_ids())
    frames = sorted(set((ids // model.tpf).tolist()))
    host = {f: (_np(kv[block, f][0]), _np(kv[block, f][1])) for f in frames}  # one copy per frame
    k = np.stack([host[i // model.tpf][0][i % model.tpf] for i in ids])
    v = np.stack([host[i // model.tpf][1][i % model.tpf] for i in ids])
    if mgr is not None and mgr.backend == "flashinfer-paged-fa3":
        slots = min(len(model.scale) + len(model.window), model.S + model.W)
        pad = np.zeros((slots * (mgr.page_size - model.P),) + k.shape[1:])
        k, v = np.concatenate([k, pad]), np.concatenate([v, pad])
    return k, v


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_seed_sanity_check_scenario(backend):
    tpf = 262
    mgr, kv, rand = _sanity_check_scenario(tpf, backend)
    assert mgr.backend == backend
    assert mgr.compute_last_page_len(0) == (88 if backend != "flashinfer-paged-fa3" else 600 - 2 * 256)
    model = FrameModel(8, 64, tpf - 6, 6, 200)
    for _ in range(100):
        model.append(False)
    for block in (0, 1):  # block 1 lagged 100 frames behind block 0 and still holds its own frames
        q = rand(tpf, 16, 64)
        out = mgr.compute_attention(block, q)
        assert out.shape == (tpf, 16, 64)
        k, v = _visible_kv(kv, block, model, mgr)
        np.testing.assert_allclose(_np(out), _dense(_np(q), k, v), atol=2e-2, rtol=2e-2)
    assert mgr.get_cache_stats(1) == dict(
        frame_count=100, scale_pages=8, live_pages=64, free_pages=0, special_tokens=600
    )
    mgr.reset()
    assert mgr.frame_count[0] == 0 and mgr.num_frames == 0 and mgr.compute_last_page_len(0) == tpf - 6
    assert mgr.get_cache_stats() == dict(frame_count=0, scale_pages=0, live_pages=0, free_pages=72, special_tokens=0)


class StandIn:
    """FlashInfer's two entry points the manager calls, as dense torch attention over what
    they are given (the kernels' semantics: the paged one attends the planned pages in order,
    all rows of each but the last, padding included); counts plans. Lets the FlashInfer code
    paths (prefix views, plan inputs, page geometry, plan reuse) run on CPU."""

    plans = 0

    @staticmethod
    def single_prefill_with_kv_cache(q, k, v, *, causal, kv_layout, backend):
        assert not causal and kv_layout == "NHD" and backend in ("auto", "fa2", "fa3")
        assert k._is_view() and v._is_view() and k.is_contiguous() and v.is_contiguous()  # prefix views, no copy
        return _sdpa(q, k, v)

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace, kv_layout, backend):
            assert kv_layout == "NHD" and backend in ("fa2", "fa3")

        def plan(
            self,
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            *,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            causal,
            pos_encoding_mode,
            q_data_type,
        ):
            assert not causal and pos_encoding_mode == "NONE" and qo_indptr.device.type == "cpu"
            StandIn.plans += 1
            self.pages = kv_indices[int(kv_indptr[0]) : int(kv_indptr[1])].tolist()
            self.rows = (len(self.pages) - 1) * page_size + int(last_page_len[0])

        def run(self, q, paged_kv):
            k, v = (torch.cat([x[i] for i in self.pages])[: self.rows] for x in paged_kv)
            return _sdpa(q, k, v)


def _sdpa(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    )
    return out[0].transpose(0, 1).contiguous()


class _PrefixStandIn:
    """``kernels.PrefixAttention``'s semantics on CPU: keys [0, kv_len) of the whole buffers."""

    def __init__(self, device, heads, kv_heads):
        assert heads == kv_heads
        self.plans = []

    def plan(self, q_len, kv_len, splits=1):
        assert splits >= 1
        self.plans.append((q_len, kv_len))

    def run(self, q, k, v, k_scale=None, v_scale=None):
        q_len, kv_len = self.plans[-1]
        assert q.shape[0] == q_len and q.is_contiguous() and k.shape == v.shape and k.shape[0] >= kv_len
        k, v = k[:kv_len], v[:kv_len]
        if k_scale is not None:  # FP8 codes read in place: the kernel decodes bf16(code * scale)
            k, v = fp8.dequantize_rows(k, k_scale[:kv_len]), fp8.dequantize_rows(v, v_scale[:kv_len])
        return _sdpa(q, k, v)


@pytest.fixture
def stand_in(monkeypatch):
    """Pretend FlashInfer and the cuda kernel run here, with ``StandIn`` and dense torch attention."""
    context = B.backend_context
    monkeypatch.setattr(B, "flashinfer", StandIn)
    monkeypatch.setattr(B, "FLASHINFER_AVAILABLE", True)
    monkeypatch.setattr(B, "backend_context", lambda *a, **k: {**context(*a, **k), "device": "cuda:0"})
    monkeypatch.setattr(kernels, "PrefixAttention", _PrefixStandIn)
    monkeypatch.setattr(kernels, "prefix_attention_available", lambda device: True)
    StandIn.plans = 0
    return StandIn


STAND_INS = [f"stand-in:{b}" for b in B.BACKENDS if b not in ("auto", "sdpa")]
# (backend, storage dtype, force_fp32): bf16 and fp16 on every backend, float32 (the seed's
# force_fp32 path) on "sdpa", the only float32 one; on CPU the FlashInfer backends' code
# paths with stand-in kernels.
CASES = (
    [
        (b, dt, False)
        for b in BACKENDS_HERE
        for dt in (torch.bfloat16, torch.float16)
        if b != "cuda" or dt == torch.bfloat16
    ]
    + [("sdpa", torch.float32, True)]
    + ([] if DEVICE == "cuda" else [(b, torch.bfloat16, False) for b in STAND_INS])
)


@pytest.mark.parametrize("backend, dtype, force_fp32", CASES)
def test_attention_equals_dense_over_visible_tokens(backend, dtype, force_fp32, request):
    """Lockstep blocks through the scale frames, window eviction and deferred frames committed
    (execute_deferred_eviction) or rolled back, like keyframe selection; inputs arrive in float32
    (upstream appends float32 k under autocast) and are cast to the storage dtype."""
    if backend.startswith("stand-in:"):
        request.getfixturevalue("stand_in")
        backend = backend.split(":", 1)[1]
    L, H, D, P, NS, S, W = 3, 2, 64, 12, 2, 2, 3  # head_dim 64: FlashInfer has no FA2 kernel for 16
    tpf = P + NS
    mgr = FlashInferKVCacheManager(
        num_blocks=L,
        max_num_frames=8,
        tokens_per_frame=tpf,
        num_heads=H,
        head_dim=D,
        dtype=dtype,
        device=DEVICE,
        num_special_tokens=NS,
        scale_frames=S,
        sliding_window=W,
        max_total_frames=4,
        force_fp32=force_fp32,
        backend=backend,
    )
    assert mgr.dtype == dtype and mgr.backend == backend
    model = FrameModel(S, W, P, NS, 10**6)
    rs = np.random.default_rng(7 + force_fp32)
    kv = {}
    tol = 1e-5 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 4e-3)

    def rand():  # float32 in, rounded to the storage dtype as the manager stores it
        return torch.tensor(rs.normal(size=(tpf, H, D)), dtype=torch.float32, device=DEVICE)

    for _step in range(24):  # more frames than max_total_frames: the special capacity grows
        defer = bool(rs.random() < 0.4)
        mgr._defer_eviction = defer
        f = model.count
        model.append(defer)
        outs = []
        for b in range(L):
            k, v = rand(), rand()
            kv[b, f] = (k.to(dtype), v.to(dtype))
            mgr.append_frame(b, k, v)
            mgr.evict_frames(b, scale_frames=S, sliding_window=W, num_register_tokens=NS - 2)
            q = rand()
            out = mgr.compute_attention(b, q)
            assert out.dtype == (torch.float32 if force_fp32 else dtype) and out.shape == (tpf, H, D)
            outs.append((q.to(dtype), out))
        for b, (q, out) in enumerate(outs):
            k, v = _visible_kv(kv, b, model, mgr)
            np.testing.assert_allclose(_np(out), _dense(_np(q), k, v), atol=tol, rtol=tol)
        stats = mgr.get_cache_stats(L - 1)
        assert stats["frame_count"] == model.count and stats["scale_pages"] == len(model.scale)
        assert stats["live_pages"] == len(model.window) and stats["special_tokens"] == model.count * NS
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


@pytest.mark.parametrize("backend", ["flashinfer-paged-fa2", "flashinfer-paged-fa3", "cuda"])
def test_plan_once_per_frame_also_on_non_keyframes(stand_in, backend):
    """Upstream's non-keyframe step appends (deferred), attends and rolls back block by block:
    the plan depends on the page counters alone, so it is made once per frame, not per block
    (a paged plan costs the host one wait on the previous plan's event; the cuda backend's
    plan, its checks and key splits)."""
    L, H, D, P, NS, S, W = 4, 2, 64, 12, 2, 2, 3
    mgr = FlashInferKVCacheManager(L, 8, P + NS, H, D, torch.bfloat16, DEVICE, NS, S, W, 64, backend=backend)
    assert mgr.page_size == (16 if backend.endswith("fa3") else 12)
    plans = (lambda: len(mgr._attention.prefix.plans)) if backend == "cuda" else (lambda: stand_in.plans)  # noqa: E731
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rand = lambda: torch.randn(P + NS, H, D, generator=g, device=DEVICE)  # noqa: E731
    for t in range(12):
        before = plans()
        key = t < S or t % 2 == 0
        for b in range(L):
            if key:
                mgr.append_frame(b, rand(), rand())
                mgr.evict_frames(b, S, W)
                mgr.compute_attention(b, rand())
            else:  # FlashInferBlock.forward's skip_append branch
                prev, mgr._defer_eviction = mgr._defer_eviction, True
                mgr.append_frame(b, rand(), rand())
                mgr.compute_attention(b, rand())
                mgr.rollback_last_frame(b)
                mgr._defer_eviction = prev
        assert plans() - before == 1, t
    assert mgr.num_frames == S + 5


def test_visible_keys_are_one_prefix():
    """With exact pages the visible keys are rows [0, n) of every buffer, n from the host mirror
    alone: through the scale frames, window eviction, deferred frames kept or rolled back and the
    special capacity growing, the device's visible token ids (``frame.visible_token_ids``,
    ``frame.page_table``) are exactly rows [0, n), every row of it visible, they are the tokens the
    oracle says are visible, and the K/V rows hold those tokens' K/V."""
    from jaxkv import frame

    L, H, D, P, NS, S, W = 2, 1, 8, 5, 3, 2, 3
    tpf = P + NS
    mgr = FlashInferKVCacheManager(
        num_blocks=L,
        max_num_frames=8,
        tokens_per_frame=tpf,
        num_heads=H,
        head_dim=D,
        dtype=torch.float32,
        device=DEVICE,
        num_special_tokens=NS,
        scale_frames=S,
        sliding_window=W,
        max_total_frames=4,
        force_fp32=True,
    )
    model = FrameModel(S, W, P, NS, 10**6)
    rs = np.random.default_rng(3)
    kv = {}

    def check():
        p, st = mgr._pages, mgr.state
        n = p.visible_rows()
        assert n == int(st.num_valid[0])
        if p.num_pages():
            assert n == (p.num_pages() - 1) * mgr.page_size + p.last_page_len()
        ids = np.asarray(frame.visible_token_ids(st))[0]
        assert (ids[:n] >= 0).all() and (ids[n:] < 0).all()  # the prefix, all of it
        assert sorted(ids[:n].tolist()) == model.visible_ids()
        table = frame.page_table(st)
        pages = np.asarray(table.indices[0, : int(table.num_pages[0])])
        assert sorted(pages.tolist()) == list(range(len(pages)))  # the visible pages tile [0, n)
        for b in range(L):
            for kind in (0, 1):  # K, V
                got = _np((mgr._k, mgr._v)[kind][b][:n])
                want = np.stack([_np(kv[b, i // tpf][kind][i % tpf]) for i in ids[:n]] or [got[:0]])
                np.testing.assert_array_equal(got, want.reshape(got.shape))

    for _step in range(30):
        defer = bool(rs.random() < 0.4)
        mgr._defer_eviction = defer
        f = model.count
        model.append(defer)
        for b in range(L):
            k, v = (torch.tensor(rs.normal(size=(tpf, H, D)), dtype=torch.float32, device=DEVICE) for _ in range(2))
            kv[b, f] = (k, v)
            mgr.append_frame(b, k, v)
            mgr.evict_frames(b, scale_frames=S, sliding_window=W)
        check()
        if defer:
            keep = bool(rs.random() < 0.5)
            for b in range(L):
                (
                    mgr.execute_deferred_eviction(b, scale_frames=S, sliding_window=W)
                    if keep
                    else mgr.rollback_last_frame(b)
                )
            model.resolve(keep)
            mgr._defer_eviction = False
            check()


@pytest.mark.parametrize("S, W, pow2", [(2, 3, False), (1, 0, False), (0, 2, True), (2, 3, True)])
def test_host_mirror_equals_device_bookkeeping(S, W, pow2):
    """The manager takes rows, moves and page ids from its host mirror (``pages.Pages``), never
    from the device: over random appends, deferred commits and rollbacks they must equal
    what ``jaxkv.frame`` computes on the device."""
    import jax.numpy as jnp

    from jaxkv import frame
    from jaxkv.frame import ops

    spec = frame.FrameSpec(
        num_layers=1,
        num_heads=1,
        head_dim=8,
        patches_per_frame=5,
        num_special=3,
        scale_frames=S,
        sliding_window=W,
        max_frames=64,
        pow2_pages=pow2,
    )
    meta = frame.init(spec).replace(k=(), v=())
    start, calls = meta, []
    pages = P.Pages(spec)
    rs = np.random.default_rng(S * 10 + W + pow2)

    def device_moves(m):  # i32[M, 3] (stream, src, dst); dst = trash where no move is made
        return [(int(src), int(dst)) for _, src, dst in np.asarray(m) if dst != spec.trash_row]

    for _ in range(40):
        if pages.pending != NONE:
            keep = bool(rs.random() < 0.5)
            calls.append((P.RESOLVE, keep))
            meta, m = ops.resolve_moves(meta, keep)
            assert pages.resolve(keep) == device_moves(m)
        else:
            defer = bool(rs.random() < 0.4)
            calls.append((P.BEGIN, defer))
            meta, m = ops.begin_frame_moves(meta, defer)
            moves, special_row, patch_row = pages.begin(defer)
            assert moves == device_moves(m)
            assert (special_row, patch_row) == (int(meta.write_special_row[0]), int(meta.write_patch_row[0]))
        table = frame.page_table(meta)
        assert pages.num_pages() == int(table.num_pages[0])
        assert pages.page_ids() == np.asarray(table.indices[0, : pages.num_pages()]).tolist()
        assert pages.last_page_len() == int(table.last_page_len[0])
        assert tuple(pages.c) == tuple(int(getattr(meta, name)[0]) for name in pages.c._fields)
        # the visible rows: one prefix [0, n) (power-of-two pages: less each slot's padding)
        n = pages.visible_rows()
        assert n == int(meta.num_valid[0])
        tid = np.asarray(meta.token_id[0, :n])
        pad = (np.arange(n) < frame.plan.slots(pages.c) * spec.page_size) & (
            np.arange(n) % spec.page_size >= spec.patches_per_frame
        )
        np.testing.assert_array_equal(tid >= 0, ~pad)
    assert int(jnp.max(meta.error)) == 0
    # The manager replays its queued bookkeeping in one batched call: the same state.
    padded = np.zeros((P.REPLAY, 2), np.int32)
    padded[: len(calls)] = calls
    replayed = P.replay(start, padded)
    for name in (
        "token_id",
        "num_frames",
        "num_scale",
        "num_window",
        "window_head",
        "num_special",
        "pending",
        "write_patch_row",
        "write_special_row",
        "error",
    ):
        np.testing.assert_array_equal(
            np.asarray(getattr(replayed, name)), np.asarray(getattr(meta, name)), err_msg=name
        )


def _snapshot(mgr):
    """Everything a failed call must leave alone: host counters, jaxkv's state, K/V."""
    st = mgr.state_dict()
    return (
        tuple(mgr._pages.c),
        mgr._pages.version,
        list(mgr.frame_count),
        mgr._defer_eviction,
        {k: v.clone() for k, v in st.items() if k != "spec"},
    )


def _same(a, b):
    return a[:4] == b[:4] and a[4].keys() == b[4].keys() and all(torch.equal(a[4][k], b[4][k]) for k in a[4])


@pytest.mark.parametrize("poison", ["nan in K", "bf16 overflow in V"])
@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_nonfinite_kv_goes_to_the_trash_as_a_sticky_fault(backend, poison):
    """A frame whose K or V holds a NaN or an Inf (here after the cast of a float32 input to
    bf16) is written to the trash rows: every other row equals a run fed the clean frame,
    attention stays finite, and check() raises NONFINITE_KV until reset, also after a
    state_dict round trip."""
    from jaxkv import CacheError, Fault

    def make():
        return FlashInferKVCacheManager(
            num_blocks=2,
            max_num_frames=8,
            tokens_per_frame=10,
            num_heads=2,
            head_dim=64,
            dtype=torch.bfloat16,
            device=DEVICE,
            num_special_tokens=3,
            scale_frames=1,
            sliding_window=2,
            backend=backend,
        )

    g = torch.Generator().manual_seed(7)
    frames = [
        (torch.randn(10, 2, 64, generator=g).to(DEVICE), torch.randn(10, 2, 64, generator=g).to(DEVICE))
        for _ in range(5)
    ]  # the last one past the window: eviction moves rows first
    bad, good = make(), make()
    for t, (k, v) in enumerate(frames):
        for blk in range(2):
            good.append_frame(blk, k + blk, v - blk)
            kb, vb = k + blk, v - blk
            if (t, blk) == (4, 1):
                kb, vb = kb.clone(), vb.clone()
                if poison == "nan in K":
                    kb[5, 1, 7] = float("nan")
                else:
                    vb[2, 0, 3] = 3.4e38  # finite in float32, Inf in bf16
            bad.append_frame(blk, kb, vb)
        if t < 4:
            bad.check()  # nothing recorded yet
    rows = bad._rows.cpu()
    with pytest.raises(CacheError) as e:
        bad.check()
    assert e.value.faults == {0: Fault.NONFINITE_KV}
    T = bad.spec.trash_row
    for blk in range(2):
        same = torch.ones(T, dtype=torch.bool)
        if blk == 1:
            same[rows] = False  # the poisoned frame's rows keep what they held
        for x, y in ((bad._k[blk], good._k[blk]), (bad._v[blk], good._v[blk])):
            assert torch.isfinite(x[:T]).all()
            assert torch.equal(x[:T][same.to(x.device)], y[:T][same.to(y.device)])
    assert torch.isfinite(bad.compute_attention(1, frames[0][0])).all()
    other = make()
    other.load_state_dict(bad.state_dict())
    with pytest.raises(CacheError):
        other.check()
    bad.reset()
    bad.check()


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_bad_input_raises_and_leaves_the_cache_unchanged(backend):
    mgr = FlashInferKVCacheManager(
        num_blocks=2,
        max_num_frames=8,
        tokens_per_frame=10,
        num_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=DEVICE,
        num_special_tokens=3,
        scale_frames=1,
        sliding_window=2,
        backend=backend,
    )
    k = torch.randn(10, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rollback"):
        mgr.rollback_last_frame(0)
    for t in range(4):  # past the window: eviction has happened
        for b in range(2):
            mgr.append_frame(b, k + t, k - t)
    other = "cpu" if DEVICE == "cuda" else "meta"
    bad = [
        (lambda: mgr.append_frame(2, k, k), "block_idx"),
        (lambda: mgr.append_frame(-1, k, k), "block_idx"),
        (lambda: mgr.append_frame(True, k, k), "block_idx"),
        (lambda: mgr.append_frame(0.0, k, k), "block_idx"),
        (lambda: mgr.append_frame(0, k[:9], k), r"k: expected a tensor of shape \[10, 2, 64\]"),
        (lambda: mgr.append_frame(0, k, k[:, :1]), "v: expected a tensor of shape"),
        (lambda: mgr.append_frame(0, k.numpy() if DEVICE == "cpu" else k.cpu().numpy(), k), "k: expected a tensor"),
        (lambda: mgr.append_frame(0, k, k.to(torch.int32)), "v: expected a floating-point tensor"),
        (lambda: mgr.append_frame(0, k.to(other), k), f"k: expected device {mgr.device}"),
        (lambda: mgr.compute_attention(0, k.to(torch.int64)), "q: expected a floating-point tensor"),
        (lambda: mgr.compute_attention(0, k.to(other)), f"q: expected device {mgr.device}"),
        (lambda: mgr.compute_attention(0, k[:, :, :8]), "q: expected a tensor of shape"),
        (lambda: mgr.compute_attention(5, k), "block_idx"),
        (lambda: mgr.evict_frames(0, scale_frames=1, sliding_window=64), "sliding_window"),
        (lambda: mgr.evict_frames(0, 1, 2, cross_frame_special=False), "cross_frame_special"),
        (lambda: mgr.evict_frames(0, 1, 2, include_scale_frames=False), "include_scale_frames"),
        (lambda: mgr.evict_frames(0, 1, 2, camera_only=True), "camera_only"),
        (lambda: mgr.evict_frames(0, 1, 2, num_register_tokens=4), "num_register_tokens"),
        (lambda: mgr.evict_frames(3, 1, 2), "block_idx"),
        (lambda: mgr.execute_deferred_eviction(0, 1, 2, camera_only=True), "camera_only"),
        (lambda: mgr.execute_deferred_eviction(0, 1, 2, cross_frames=True), "cross_frames"),
        (lambda: mgr.get_cache_stats(2), "block_idx"),
    ]
    before = _snapshot(mgr)
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
        assert _same(_snapshot(mgr), before), match  # the failed call changed nothing
    with pytest.raises(RuntimeError, match="_defer_eviction"):
        mgr.rollback_last_frame(0)
    assert _same(_snapshot(mgr), before)
    mgr.evict_frames(0, 1, 2, True, True, False, 1)  # the cache's own flags are fine
    mgr._defer_eviction = True
    mgr.append_frame(0, k, k)
    with pytest.raises(RuntimeError, match="deferred"):  # block 1 first, then a new frame
        mgr.append_frame(1, k, k) or mgr.append_frame(1, k, k)
    fresh = FlashInferKVCacheManager(2, 8, 10, 2, 64, torch.bfloat16, DEVICE, 3, 1, 2, backend=backend)
    assert torch.equal(fresh.compute_attention(1, k), torch.zeros_like(k))  # no frame yet
    q16 = fresh.compute_attention(0, k.half())  # another float dtype is cast
    assert q16.dtype == torch.float16 and not q16.any()
    with pytest.raises(ValueError, match="tokens_per_frame"):
        FlashInferKVCacheManager(1, 8, 6, 2, 8, torch.bfloat16, DEVICE)


def test_backend_errors_and_choice():
    """The manager's ``backend=`` is the registry's ``torch.attention`` operation, fed by what
    the torch side knows (``backend_context``); refusals name ``backend``."""
    from jaxkv import _backend

    for bad in ("jaxkv", "fa2", "SDPA", None):
        with pytest.raises(
            ValueError,
            match=r"backend: expected one of \('auto', 'sdpa', 'cuda', 'flashinfer'.*got "
            + repr(bad).replace("(", r"\("),
        ):
            FlashInferKVCacheManager(1, 8, 10, 2, 64, torch.bfloat16, DEVICE, 2, backend=bad)

    def check(backend, device, force_fp32=False, dtype=torch.bfloat16, head_dim=64):
        _backend.choose("torch.attention", backend, **B.backend_context(device, dtype, head_dim, force_fp32=force_fp32))

    with pytest.raises(ValueError, match="backend: .*got 'cuda': .*needs a CUDA device"):
        check("cuda", "cpu")
    if DEVICE == "cuda":
        why = "force_fp32" if HAS_CUDA_KERNEL else "sm_90"
        with pytest.raises(ValueError, match="backend: .*got 'cuda': .*" + why):
            check("cuda", "cuda:0", True)
    for fi in ("flashinfer", "flashinfer-paged-fa2", "flashinfer-paged-fa3"):
        with pytest.raises(ValueError, match="backend: .*needs a CUDA device"):
            check(fi, "cpu")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="needs a CUDA device"):
            FlashInferKVCacheManager(1, 8, 10, 2, 64, torch.bfloat16, "cpu", 2, backend="flashinfer")
    assert B.backend_context("cpu", torch.float16, 64)["dtype"] == "float16"
    # fa3 keeps its power-of-two pages only on the paged FA3 backend
    mgr = FlashInferKVCacheManager(1, 8, 10, 2, 64, torch.bfloat16, DEVICE, 3, fa3=True, backend="sdpa")
    assert mgr.page_size == 7 and mgr.fa3


@on_gpu
@pytest.mark.gpu
def test_auto_backend_on_gpu():
    assert FlashInferKVCacheManager(2, 88, 262, 16, 64, torch.bfloat16, "cuda").backend == (
        "cuda" if HAS_CUDA_KERNEL else "flashinfer-paged-fa2"
    )
    assert FlashInferKVCacheManager(2, 88, 1005, 16, 64, torch.bfloat16, "cuda").backend == (
        "cuda" if HAS_CUDA_KERNEL else "flashinfer"
    )
    fa3 = FlashInferKVCacheManager(2, 88, 1005, 16, 64, torch.bfloat16, "cuda", fa3=True)
    assert fa3.backend == "flashinfer-paged-fa3" and fa3.page_size == 1024


def _frames(n, L, tpf, H, D, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [
        tuple(torch.randn(L, tpf, H, D, generator=g, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        for _ in range(n)
    ]


def _run(mgr, frames, defer_every=0, stall=0):
    """Stream ``frames`` (every ``defer_every``-th deferred, then rolled back on odd frames,
    kept on even ones) with no sync; -> every block's output of every frame. ``stall``: GPU
    clock cycles of sleep queued on torch's stream before each block's step, so the host
    runs far ahead of the GPU (the timing of a loaded GPU, or of a sanitizer)."""
    outs = []
    for t, (k, v, q) in enumerate(frames):
        defer = bool(defer_every) and t % defer_every == defer_every - 1
        mgr._defer_eviction = defer
        for b in range(mgr.num_blocks):
            if stall:
                torch.cuda._sleep(stall)
            mgr.append_frame(b, k[b], v[b])
            mgr.evict_frames(b, mgr.scale_frames, mgr.sliding_window)
            outs.append(mgr.compute_attention(b, q[b]))
        if defer:
            for b in range(mgr.num_blocks):
                if t % 2:
                    mgr.rollback_last_frame(b)
                else:
                    mgr.execute_deferred_eviction(b, mgr.scale_frames, mgr.sliding_window)
            mgr._defer_eviction = False
    return outs


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("stall", [0, 200_000], ids=["", "host-ahead"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS_HERE if b != "sdpa"])
def test_gpu_backends_equal_sdpa(backend, stall):
    """FlashInfer's prefix and paged kernels against torch's SDPA over the same cache, at the
    released model's frame size (1005 tokens: FA3 pages of 1024 hold 25 zero rows, which it attends
    as the seed does, so that backend is held to dense attention over the visible tokens plus those
    rows), 40 frames streamed with no sync: the host runs ahead of the GPU, which is where the
    paged plan's pinned buffer would be overwritten before its copy ran without the event.
    host-ahead: a sleep queued before each step keeps the GPU far behind the host, the first
    manager dropped (its buffers' views with it) while its attention is still queued."""
    L, H, D, tpf, S, W = 2, 16, 64, 1005, 2, 6
    frames = _frames(40, L, tpf, H, D)
    make = lambda b: FlashInferKVCacheManager(L, 16, tpf, H, D, torch.bfloat16, "cuda", 6, S, W, 64, backend=b)  # noqa
    got = _run(make(backend), frames, defer_every=3, stall=stall)
    if backend != "flashinfer-paged-fa3":
        want = _run(make("sdpa"), frames, defer_every=3, stall=stall)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        return
    model, kv = FrameModel(S, W, tpf - 6, 6, 10**6), {}
    mgr = make(backend)
    for t, (k, v, q) in enumerate(frames[:12]):
        model.append(False)
        for b in range(L):
            kv[b, t] = (k[b], v[b])
            mgr.append_frame(b, k[b], v[b])
        for b in range(L):
            kk, vv = _visible_kv(kv, b, model, mgr)
            np.testing.assert_allclose(
                _np(mgr.compute_attention(b, q[b])), _dense(_np(q[b]), kk, vv), atol=2e-2, rtol=2e-2
            )


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA torch")
@pytest.mark.parametrize("backend", [b for b in BACKENDS_HERE if b in B.PREFIX_BACKENDS])
def test_gpu_prefix_backends_never_sync(backend):
    """Steady-state frames (window full, keyframes and non-keyframes) under torch's sync debug
    mode "error": the append, the bookkeeping and the prefix attention make no host sync."""
    L, H, D, tpf = 2, 16, 64, 262
    mgr = FlashInferKVCacheManager(L, 16, tpf, H, D, torch.bfloat16, "cuda", 6, 2, 3, 4096, backend=backend)
    frames = _frames(12, L, tpf, H, D)
    _run(mgr, frames, defer_every=2)  # warm: kernels loaded, window full
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(mgr, frames, defer_every=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


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


def _manager(backend):
    return FlashInferKVCacheManager(
        num_blocks=2,
        max_num_frames=8,
        tokens_per_frame=10,
        num_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=DEVICE,
        num_special_tokens=2,
        scale_frames=1,
        sliding_window=3,
        max_total_frames=16,
        backend=backend,
    )


@pytest.mark.parametrize("backend", [b for b in BACKENDS_HERE if b != "flashinfer-paged-fa3"])
@pytest.mark.parametrize("via", ["state_dict", "files"])
def test_save_and_continue_bit_identically(tmp_path, via, backend):
    """Stream, save (state_dict or jaxkv checkpoint files), load into a fresh manager, stream
    on: every output equals the uninterrupted manager's. (FA3 needs 8 patches at least for
    its power-of-two pages; the page structure is the same.)"""
    whole = _manager(backend)
    want = _stream(whole, 12, 0)
    first = _manager(backend)
    got = _stream(first, 7, 0)
    second = _manager(backend)
    if via == "state_dict":
        second.load_state_dict(first.state_dict())
    else:
        first.save(tmp_path / "mgr")
        second.restore(tmp_path / "mgr")
    got += _stream(second, 5, 7)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    other = FlashInferKVCacheManager(
        num_blocks=2,
        max_num_frames=8,
        tokens_per_frame=10,
        num_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=DEVICE,
        num_special_tokens=2,
        scale_frames=1,
        sliding_window=4,
        max_total_frames=16,
    )
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"spec differs.*sliding_window=3 \(this manager: 4\)"):
        other.load_state_dict(first.state_dict())
    after = other.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "spec")  # nothing changed
