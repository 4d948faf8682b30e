"""The drop-in manager inside upstream lingbot-map's own GCTStream (``$LINGBOT_MAP_SRC``; skipped
without it), on CPU in float32: ``torch_bridge.use_in_lingbot_map()`` swaps upstream's
``FlashInferKVCacheManager`` for ours, so upstream's FlashInfer model path (``use_sdpa=False``:
the scale phase appending per frame, per-block append / evict / compute_attention, the
non-keyframe append-attend-rollback) runs with our manager ("sdpa" backend here), and it is
compared frame by frame with upstream's own SDPA path (same weights) and with the jaxkv port.

Upstream's lazy construction (``_get_flashinfer_manager``) sizes the manager with
``embed_dim // 64`` heads of 64, right for the released ViT-L only; the ViT-S model here has 16
heads of 24, so its manager is made with the model's heads and set on the aggregator (as that
construction would; ``test_lazy_construction_picks_ours`` covers the lazy path itself).
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flax")

from jaxkv.models.lingbot import (
    LingbotConfig,
    upstream,
)
from torch_bridge import FlashInferKVCacheManager, use_in_lingbot_map  # noqa: E402
from torch_bridge.kernels import prefix_attention_available  # noqa: E402

SRC = upstream.source()
pytestmark = pytest.mark.skipif(
    SRC is None,
    reason="needs an upstream lingbot-map checkout in $LINGBOT_MAP_SRC (e.g. LINGBOT_MAP_SRC=.upstream/lingbot-map)",
)
KEYS = ("pose_enc", "depth", "depth_conf")
# window 3 + 2 scale frames: eviction from frame 6 of 10
CONFIG = LingbotConfig.small(kv_cache_sliding_window=3, kv_cache_scale_frames=2, num_scale_frames=2)


@pytest.fixture
def lingbot_map():
    """Upstream importable, our manager installed; undone afterwards."""
    upstream.import_gct_stream(SRC)  # puts the checkout on sys.path
    from lingbot_map.layers import attention, flashinfer_cache

    before = flashinfer_cache.FlashInferKVCacheManager, attention.FLASHINFER_AVAILABLE
    with use_in_lingbot_map() as handle:
        assert flashinfer_cache.FlashInferKVCacheManager is FlashInferKVCacheManager
        assert attention.FLASHINFER_AVAILABLE
        yield handle
    assert (flashinfer_cache.FlashInferKVCacheManager, attention.FLASHINFER_AVAILABLE) == before


@pytest.fixture
def no_tf32():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def _install_manager(model, config):
    """What upstream's ``_get_flashinfer_manager`` builds, with the model's own heads, float32."""
    agg = model.aggregator
    agg.kv_cache_manager = FlashInferKVCacheManager(
        num_blocks=agg.depth,
        max_num_frames=agg.kv_cache_scale_frames + agg.kv_cache_sliding_window + 16,
        tokens_per_frame=config.tokens_per_frame,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
        device="cpu",
        num_special_tokens=agg.num_special_tokens,
        scale_frames=agg.kv_cache_scale_frames,
        sliding_window=agg.kv_cache_sliding_window,
        max_total_frames=agg.max_frame_num + 100,
        force_fp32=True,
    )
    return agg.kv_cache_manager


def _stream(model, frames, interval):
    with torch.no_grad():
        out = model.inference_streaming(
            upstream.images_nchw(frames), num_scale_frames=CONFIG.num_scale_frames, keyframe_interval=interval
        )
    return {k: out[k][0].float().numpy() for k in KEYS}


def _rel_err(ours, ref):
    """Per frame: max |ours - ref| / max |ref|."""
    axes = tuple(range(1, ref.ndim))
    return np.abs(ours - ref).max(axis=axes) / np.abs(ref).max(axis=axes)


def _frames(n, seed=0):
    return np.random.default_rng(seed).random((n, CONFIG.height, CONFIG.width, 3), np.float32)


def _models():
    """Upstream's FlashInfer-path model (ours inside) and its SDPA-path twin, same weights."""
    ours = upstream.build(CONFIG, SRC, use_sdpa=False)
    ref = upstream.build(CONFIG, SRC, use_sdpa=True)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def test_flashinfer_path_with_dropin_matches_upstream_sdpa(lingbot_map, no_tf32):
    ours, ref = _models()
    mgr = _install_manager(ours, CONFIG)
    assert mgr.backend == "sdpa"
    frames = _frames(10)
    got, want = _stream(ours, frames, 1), _stream(ref, frames, 1)
    for k in KEYS:
        assert got[k].shape == want[k].shape, k
        err = _rel_err(got[k], want[k])
        assert err.max() <= 1e-4, f"{k}: per-frame relative error {err}"
    assert mgr.get_cache_stats() == dict(frame_count=10, scale_pages=2, live_pages=3, free_pages=0, special_tokens=60)
    assert mgr.frame_count == [10] * mgr.num_blocks
    # Without the swap upstream's isinstance check sends the scale phase down its batch-SDPA
    # branch, which never appends: the same manager then gives other outputs (gap G1).
    lingbot_map.undo()
    off = _stream(ours, frames, 1)
    assert _rel_err(off["pose_enc"], want["pose_enc"])[CONFIG.num_scale_frames :].max() > 1e-3
    assert mgr.num_frames == 10 - CONFIG.num_scale_frames


def test_keyframes_with_dropin_match_the_port(lingbot_map, no_tf32):
    """keyframe_interval 2: every other streamed frame goes through upstream's non-keyframe flow
    (deferred append, attention, rollback per block) on our manager. Upstream's SDPA path ignores
    the non-keyframe flag, so the reference is the jaxkv port (LingbotStream), same weights."""
    import jax

    from jaxkv.models.lingbot import LingbotStream
    from jaxkv.models.lingbot.convert import from_state_dict

    model = upstream.build(CONFIG, SRC, use_sdpa=False)
    mgr = _install_manager(model, CONFIG)
    frames = _frames(12, seed=1)
    got = _stream(model, frames, 2)
    # 2 scale frames, then keyframes 2, 4, 6, 8, 10 kept; 3, 5, 7, 9, 11 rolled back
    assert mgr.frame_count == [7] * mgr.num_blocks and mgr._pages.frames == 7
    assert mgr.get_cache_stats(mgr.num_blocks - 1) == dict(
        frame_count=7, scale_pages=2, live_pages=3, free_pages=0, special_tokens=42
    )
    port, _ = from_state_dict(CONFIG, upstream.state_dict(model))
    with jax.default_matmul_precision("highest"):
        outs = list(LingbotStream(port, keyframe_interval=2).run(list(frames)))
    for k in KEYS:
        want = np.stack([np.asarray(o[k][0], np.float32) for o in outs])
        err = _rel_err(got[k], want)
        assert err.max() <= 1e-4, f"{k}: per-frame relative error {err}"


def test_lazy_construction_picks_ours(lingbot_map):
    """Upstream's own lazy construction builds our manager once the swap is in."""
    model = upstream.build(CONFIG, SRC, use_sdpa=False)
    agg = model.aggregator
    assert agg.kv_cache_manager is None
    agg.kv_cache_force_fp32 = True
    mgr = agg._get_flashinfer_manager(torch.device("cpu"), torch.float32, tokens_per_frame=CONFIG.tokens_per_frame)
    assert type(mgr) is FlashInferKVCacheManager and mgr.backend == "sdpa" and mgr.dtype == torch.float32
    assert (mgr.num_blocks, mgr.tokens_per_frame, mgr.scale_frames, mgr.sliding_window) == (24, 18, 2, 3)
    assert (mgr.num_heads, mgr.head_dim) == (CONFIG.dim // 64, 64)  # upstream's ViT-L assumption
    assert agg._get_flashinfer_manager(torch.device("cpu"), torch.float32) is mgr
    model.clean_kv_cache()  # upstream's reset call
    assert mgr.num_frames == 0


def test_install_with_a_backend_and_bad_backend(lingbot_map):
    from lingbot_map.layers import flashinfer_cache

    with pytest.raises(ValueError, match="backend: expected one of"):
        use_in_lingbot_map("jaxkv")
    with use_in_lingbot_map("sdpa"):
        cls = flashinfer_cache.FlashInferKVCacheManager
        assert issubclass(cls, FlashInferKVCacheManager) and cls is not FlashInferKVCacheManager
        mgr = cls(
            num_blocks=1,
            max_num_frames=8,
            tokens_per_frame=10,
            num_heads=2,
            head_dim=8,
            dtype=torch.bfloat16,
            device="cpu",
            num_special_tokens=2,
        )
        assert mgr.backend == "sdpa" and isinstance(mgr, FlashInferKVCacheManager)
    assert flashinfer_cache.FlashInferKVCacheManager is FlashInferKVCacheManager  # the outer install again


def test_install_with_an_fp8_cache(lingbot_map):
    """kv_dtype=torch.float8_e4m3fn: upstream's own lazy construction (which passes bf16)
    builds an FP8 manager; a kv_dtype that is no storage dtype is refused."""
    from lingbot_map.layers import flashinfer_cache

    with pytest.raises(ValueError, match="kv_dtype: expected None or one of"):
        use_in_lingbot_map(kv_dtype=torch.int8)
    with use_in_lingbot_map("sdpa", kv_dtype=torch.float8_e4m3fn):
        assert flashinfer_cache.FlashInferKVCacheManager is not FlashInferKVCacheManager
        model = upstream.build(CONFIG, SRC, use_sdpa=False)
        agg = model.aggregator
        agg.kv_cache_force_fp32 = False
        mgr = agg._get_flashinfer_manager(torch.device("cpu"), torch.bfloat16, tokens_per_frame=CONFIG.tokens_per_frame)
        assert isinstance(mgr, FlashInferKVCacheManager) and mgr.backend == "sdpa"
        assert mgr.dtype == torch.float8_e4m3fn and mgr.compute_dtype == torch.bfloat16
        k = torch.randn(CONFIG.tokens_per_frame, mgr.num_heads, mgr.head_dim)
        mgr.append_frame(0, k, k)
        assert mgr.compute_attention(0, k).dtype == torch.bfloat16


@pytest.mark.skipif(not os.environ.get("JAXKV_LONG"), reason="ViT-L (1.2 B parameters, twice): JAXKV_LONG=1")
def test_vitl_lazy_path_matches_upstream_sdpa(lingbot_map, no_tf32):
    """The released backbone width (16 heads of 64, so upstream's own lazy construction builds
    our manager) at a small frame size, float32 (``kv_cache_force_fp32``)."""
    config = LingbotConfig.small(
        patch_embed="dinov2_vitl14_reg", kv_cache_sliding_window=3, kv_cache_scale_frames=2, num_scale_frames=2
    )
    ours = upstream.build(config, SRC, use_sdpa=False)
    ours.aggregator.kv_cache_force_fp32 = True
    frames = _frames(8)
    got = _stream(ours, frames, 1)
    mgr = ours.aggregator.kv_cache_manager
    assert type(mgr) is FlashInferKVCacheManager and mgr.num_frames == 8
    ref = upstream.build(config, SRC, use_sdpa=True)
    ref.load_state_dict(ours.state_dict())
    del ours
    want = _stream(ref, frames, 1)
    for k in KEYS:
        err = _rel_err(got[k], want[k])
        assert err.max() <= 1e-4, f"{k}: per-frame relative error {err}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="reduce-overhead compiles to CUDA graphs: needs a CUDA GPU")
def test_dropin_between_reduce_overhead_graphs_gpu(lingbot_map):
    """Upstream compiles the modules around the manager's calls with ``torch.compile(mode=
    "reduce-overhead")`` (gct_profile.py): each global block's pre-attention, FFN and output
    projection become CUDA graphs, and the drop-in runs between them on their (graph-owned)
    q / k / v. Here with the released width (16 heads of 64, so ``auto`` is the drop-in's
    fastest backend on this GPU), bf16, keyframe and non-keyframe frames: the compiled model
    gives the eager model's outputs, frame by frame, to bf16 precision. Only the global blocks
    are compiled (the frame blocks never meet the manager; ``benchmarks/bridge.py --model
    --compile`` runs all of gct_profile's targets)."""
    config = LingbotConfig.small(
        patch_embed="dinov2_vitl14_reg", kv_cache_sliding_window=3, kv_cache_scale_frames=2, num_scale_frames=2
    )
    model = upstream.build(config, SRC, use_sdpa=False).cuda()
    images = upstream.images_nchw(_frames(9, seed=2)).to(torch.bfloat16)  # bf16 tokens: a bf16 manager

    def stream():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.inference_streaming(images, num_scale_frames=2, keyframe_interval=2)
        return {k: out[k][0].float().cpu().numpy() for k in KEYS}

    eager = stream()  # also fills upstream's RoPE table cache outside any graph
    mgr = model.aggregator.kv_cache_manager
    assert type(mgr) is FlashInferKVCacheManager and mgr.dtype == torch.bfloat16
    if prefix_attention_available("cuda"):
        assert mgr.backend == "cuda"
    for b in model.aggregator.global_blocks:
        b.attn_pre = torch.compile(b.attn_pre, mode="reduce-overhead")
        b.ffn_residual = torch.compile(b.ffn_residual, mode="reduce-overhead")
        b.attn.proj = torch.compile(b.attn.proj, mode="reduce-overhead")
    stream()  # records the graphs
    compiled = stream()  # replays them
    assert model.aggregator.kv_cache_manager is mgr and mgr.frame_count == [6] * mgr.num_blocks
    for k in KEYS:
        err = _rel_err(compiled[k], eager[k])
        assert err.max() <= 3e-2, f"{k}: per-frame relative error {err} (backend {mgr.backend})"
