"""The lingbot-map port without upstream: resampling against torch, streaming against a
replay, the converter's round trips and its errors. (Parity with upstream:
tests/test_lingbot_parity.py.)"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("safetensors")


from jaxkv.models.lingbot import (  # noqa: E402
    LingbotConfig,
    LingbotMap,
    LingbotStream,
    convert,
)
from jaxkv.models.lingbot.layers import bicubic_aa_matrix, bilinear_matrix  # noqa: E402

TINY = LingbotConfig.small(depth=4, selected_idx=(0, 1, 2, 3), camera_num_iterations=2)


@pytest.fixture(scope="module")
def model():
    m = LingbotMap(TINY, rngs=nnx.Rngs(1))
    # LayerScale gains and tokens away from their near-zero init, so every branch counts
    for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        if path[-1] in ("gamma", "camera_token", "register_token", "scale_token"):
            v.set_value(jax.random.normal(jax.random.key(len(path)), v.get_value().shape) * 0.3)
    return m


def _frames(n, seed=0, config=TINY):
    return list(np.random.default_rng(seed).random((n, config.height, config.width, 3), np.float32))


_STREAMS = {}


def _run(m, frames, interval=1):
    """One LingbotStream per model: the keyframe choice is a traced argument, nothing recompiles."""
    stream = _STREAMS.setdefault(id(m), LingbotStream(m))
    return [jax.tree.map(np.asarray, o) for o in stream.run(frames, keyframe_interval=interval)]


@pytest.mark.parametrize("n_in,n_out", [(4, 3), (37, 27), (37, 37), (3, 8)])
def test_resampling_matches_torch(n_in, n_out):
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 2, n_in, n_in + 1, dtype=torch.float64)
    aa = torch.nn.functional.interpolate(x, size=(n_out, n_out + 2), mode="bicubic", antialias=True)
    ours = np.einsum(
        "ih,nchw,jw->ncij", bicubic_aa_matrix(n_in, n_out), x.numpy(), bicubic_aa_matrix(n_in + 1, n_out + 2)
    )
    np.testing.assert_allclose(ours, aa.numpy(), rtol=1e-10, atol=1e-10)
    bl = torch.nn.functional.interpolate(x.float(), size=(n_out, n_out + 2), mode="bilinear", align_corners=True)
    ours = np.einsum(
        "ih,nchw,jw->ncij", bilinear_matrix(n_in, n_out), x.float().numpy(), bilinear_matrix(n_in + 1, n_out + 2)
    )
    np.testing.assert_allclose(ours, bl.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_non_keyframes_leave_no_trace(model):
    """Streaming with interval 2 equals streaming only the keyframes, for every keyframe's output:
    the skipped frames were attended and rolled back (camera RoPE off, so positions agree)."""
    frames = _frames(7)
    with jax.default_matmul_precision("highest"):
        every2 = _run(model, frames, interval=2)
        keys_only = _run(model, frames[:2] + frames[2::2])
    for a, b in zip(every2[:2] + every2[2::2], keys_only):
        for k in ("pose_enc", "depth", "depth_conf"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert not np.allclose(every2[3]["pose_enc"], every2[4]["pose_enc"])


@pytest.mark.slow  # a second model's compile; tests/frame/test_fp8.py checks the cache itself
def test_fp8_cache_tracks_the_float_cache(model):
    """The port with an FP8 global cache (``kv_dtype``) against its float32 cache, the same
    weights, 10 frames with every other one rolled back and the window evicting: every output
    within FP8's bound, stated here."""
    m8 = LingbotMap(TINY.replace(kv_dtype="float8_e4m3fn"), rngs=nnx.Rngs(1))
    nnx.update(m8, nnx.state(model, nnx.Param))
    assert m8.aggregator.cache.state.get_value().k[0].dtype == np.dtype("float8_e4m3fn")
    frames = _frames(10, seed=5)
    want, got = _run(model, frames, interval=2), _run(m8, frames, interval=2)
    # measured on a CPU: 3.2e-3, 2.2e-4, 2.4e-4
    for k, bound in (("pose_enc", 2e-2), ("depth", 5e-3), ("depth_conf", 5e-3)):
        err = max(np.abs(g[k] - w[k]).max() / np.abs(w[k]).max() for g, w in zip(got, want))
        assert err < bound, (k, err)


def test_outputs_shapes_and_finite(model):
    outs = _run(model, _frames(4, seed=3))
    c = TINY
    assert outs[0]["pose_enc"].shape == (1, 9)
    assert outs[-1]["depth"].shape == (1, c.height, c.width, 1) and outs[-1]["depth_conf"].shape == (
        1,
        c.height,
        c.width,
    )
    assert all(np.isfinite(o[k]).all() for o in outs for k in o)
    assert (outs[-1]["depth"] > 0).all() and (outs[-1]["depth_conf"] > 1).all()


def test_converted_file_round_trips_without_torch(model, tmp_path):
    out = convert.save_converted(model, tmp_path / "lingbot.safetensors")
    again = convert.load_lingbot_checkpoint(out)
    assert again.config == TINY
    a = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert a.keys() == b.keys()
    for p in a:  # every weight and the config equal: the same model (no second compile to show it)
        np.testing.assert_array_equal(np.asarray(a[p].get_value()), np.asarray(b[p].get_value()), err_msg=str(p))


def _upstream_dict(m):
    flat = nnx.to_flat_state(nnx.state(m, nnx.Param))
    return {convert.upstream_key(p): convert.to_upstream(p, np.asarray(v.get_value())) for p, v in flat}


def test_torch_pickle_both_layouts(model, tmp_path):
    torch = pytest.importorskip("torch")
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in _upstream_dict(model).items()}
    sd["aggregator.patch_embed.mask_token"] = torch.zeros(1, TINY.dim)  # upstream carries it; unused
    for i, obj in enumerate(({"model": sd}, sd)):
        torch.save(obj, tmp_path / f"ckpt{i}.pt")
        with pytest.warns(UserWarning, match="mask_token"):
            m = convert.load_lingbot_checkpoint(
                tmp_path / f"ckpt{i}.pt",
                depth=4,
                selected_idx=(0, 1, 2, 3),
                camera_num_iterations=2,
                height=42,
                width=56,
                dtype="float32",
                num_scale_frames=2,
                kv_cache_scale_frames=2,
                kv_cache_sliding_window=3,
                max_frame_num=64,
            )
        np.testing.assert_array_equal(
            np.asarray(m.aggregator.camera_token[...]), np.asarray(model.aggregator.camera_token[...])
        )


def test_torch_pickle_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    (tmp_path / "x.pt").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ValueError, match="needs torch"):
        convert.read_state_dict(tmp_path / "x.pt")


def test_bad_checkpoints_name_their_keys_and_load_nothing(model):
    sd = _upstream_dict(model)
    before = np.asarray(model.aggregator.camera_token[...]).copy()
    bad = dict(sd)
    bad["aggregator.camera_token"] = bad["aggregator.camera_token"] + 1  # would change the model if loaded
    del bad["depth_head.norm.weight"]
    bad["aggregator.extra.weight"] = np.zeros(3, np.float32)
    bad["aggregator.frame_blocks.0.attn.qkv.weight"] = np.zeros((5, 5), np.float32)
    with pytest.raises(ValueError) as e:
        convert.load_state_dict(model, bad)
    msg = str(e.value)
    assert "depth_head.norm.weight" in msg and "aggregator.extra.weight" in msg
    assert "aggregator.frame_blocks.0.attn.qkv.weight" in msg and "nothing was loaded" in msg
    np.testing.assert_array_equal(np.asarray(model.aggregator.camera_token[...]), before)


def test_other_patch_size_is_rejected(model):
    sd = _upstream_dict(model)
    sd["aggregator.patch_embed.patch_embed.proj.weight"] = np.zeros((TINY.dim, 3, 16, 16), np.float32)
    with pytest.raises(ValueError, match="proj.weight"):
        convert.load_state_dict(model, sd)
    with pytest.raises(ValueError, match="patch_size=16"):  # 42x56 frames do not fit 16-pixel patches
        convert.config_from_state_dict(sd, height=42, width=56, selected_idx=(0, 1, 2, 3))


def test_frames_of_another_size_are_refused(model):
    """A frame that is not the model's [H, W, 3], or not the stream's batch: a ValueError
    naming the frame and both shapes, before anything runs for it."""
    stream = _STREAMS.setdefault(id(model), LingbotStream(model))
    h, w = TINY.height, TINY.width
    with pytest.raises(ValueError, match=rf"frame 0 has shape \[{h}, {w + 14}, 3\], expected \[{h}, {w}, 3\]"):
        next(stream.run([np.zeros((h, w + 14, 3), np.float32)]))
    frames = _frames(2)
    frames[1] = np.stack([frames[1]] * 2)  # two streams where the stream has one
    with pytest.raises(ValueError, match=rf"frame 1 has shape \[2, {h}, {w}, 3\], expected \[{h}, {w}, 3\]"):
        next(stream.run(frames))


def test_bad_frames_and_configs():
    with pytest.raises(ValueError, match="kv_dtype: expected None or 'float8_e4m3fn', got 'int8'"):
        TINY.replace(kv_dtype="int8")
    with pytest.raises(ValueError, match="height, width"):
        LingbotConfig.small(height=40)
    with pytest.raises(ValueError, match="enable_3d_rope"):
        LingbotConfig.small(enable_3d_rope=True)
    with pytest.raises(ValueError, match="keyframe_interval"):
        LingbotStream.__init__(object.__new__(LingbotStream), None, keyframe_interval=0)
