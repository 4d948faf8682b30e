"""jaxkv.flax and jaxkv.models: the NNX streaming layer and model against dense references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from frame_model import FrameModel  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.flax import StreamingGlobalAttention, apply_rope, axial_rope, caches, check  # noqa: E402
from jaxkv.frame import tuning as frame_tuning  # noqa: E402
from jaxkv.models import SMALL, StreamingReconstructor, synthetic_video  # noqa: E402

DIM, HEADS, P, NS = 32, 4, 6, 2
T = P + NS


@pytest.fixture(autouse=True)
def float32_matmuls():
    """These tests hold float32 paths to 1e-4: GPUs run float32 matmuls in TF32 by default
    (the rope test's einsum and the layers' projections failed on an H100 without this)."""
    with jax.default_matmul_precision("highest"):
        yield


def make_layer(seed=0, **kw):
    kw = (
        dict(
            patches_per_frame=P,
            num_special=NS,
            scale_frames=1,
            sliding_window=2,
            max_frames=64,
            cache_dtype="float32",
            impl="reference",
        )
        | kw
    )
    return StreamingGlobalAttention(DIM, HEADS, rngs=nnx.Rngs(seed), **kw)


def frame_rope(t):
    pos = np.stack([np.full(T, t), np.r_[np.zeros(NS), np.arange(1, P + 1)], np.r_[np.zeros(NS), np.arange(P)]], -1)
    return axial_rope(jnp.asarray(pos, jnp.int32), DIM // HEADS)


def seed_visibility(keeps, S, W, P, NS, F):
    """bool[F, F*T] visible keys per frame from the pure-Python model, in video-frame token ids."""
    T = P + NS
    ref, owner = FrameModel(S, W, P, NS, max_frames=10 * F), {}
    vis = np.zeros((F, F * T), bool)
    for i, keep in enumerate(keeps):
        owner[ref.count] = i
        assert ref.append(defer=True)
        for tid in ref.visible_ids():
            vis[i, owner[tid // T] * T + tid % T] = True
        ref.resolve(bool(keep))
    return vis


def stream_vs_dense(layer, xs, ropes, keeps):
    """Stream ``xs`` [F, T, dim] through ``layer`` (deferred, then kept or rolled back) under
    nnx.jit with the module donated -> (streaming outputs f32[F, T, dim], dense reference
    over the visible frames the pure-Python seed model predicts)."""

    @nnx.jit(donate_argnums=0)
    def step(layer, x, cos, sin, keep):
        y = layer(x, cos, sin, defer=True)
        layer.resolve(keep)
        return y

    outs = [
        step(layer, xs[t][None], ropes[t][0][None], ropes[t][1][None], jnp.asarray(bool(keeps[t])))[0]
        for t in range(len(keeps))
    ]
    check(layer)
    s = layer.spec
    vis = seed_visibility(keeps, s.scale_frames, s.sliding_window, s.patches_per_frame, s.num_special, len(keeps))
    want = layer.dense(xs, jnp.stack([r[0] for r in ropes]), jnp.stack([r[1] for r in ropes]), jnp.asarray(vis))
    return np.stack([np.asarray(o, np.float32) for o in outs]), np.asarray(want, np.float32)


def test_axial_rope_matches_numpy_and_is_relative(rng):
    pos = rng.integers(0, 50, size=(7, 3))
    cos, sin = axial_rope(jnp.asarray(pos), 16, theta=100.0)
    # 8 pairs over 3 axes: widths 3, 3, 2
    freqs = np.concatenate([100.0 ** (-np.arange(w) / w) for w in (3, 3, 2)])
    angle = pos[:, np.repeat(np.arange(3), (3, 3, 2))] * freqs
    np.testing.assert_allclose(np.asarray(cos), np.cos(angle), atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angle), atol=1e-5)
    # q(a) . k(b) depends on a - b only: shift every axis by the same offset
    q = jnp.asarray(rng.normal(size=(1, 7, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 7, 2, 16)), jnp.float32)
    dots = lambda p: jnp.einsum("bthd,bshd->bhts", apply_rope(q, *axial_rope(p, 16)), apply_rope(k, *axial_rope(p, 16)))  # noqa: E731
    shift = jnp.asarray(pos) + jnp.asarray([5, -3, 11])
    np.testing.assert_allclose(np.asarray(dots(jnp.asarray(pos))), np.asarray(dots(shift)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="head_dim"):
        axial_rope(jnp.asarray(pos), 15)
    with pytest.raises(ValueError, match="cos, sin"):
        apply_rope(q, cos[:, :3], sin[:, :3])


@pytest.mark.parametrize("keeps", [[1] * 9, [1, 1, 0, 1, 0, 0, 1, 1, 0]])
def test_layer_streaming_equals_dense(rng, keeps):
    """Under nnx.jit with the module donated, each frame's output equals masked dense attention."""
    F = len(keeps)
    layer = make_layer()
    xs = jnp.asarray(rng.normal(size=(F, T, DIM)), jnp.float32)
    got, want = stream_vs_dense(layer, xs, [frame_rope(t) for t in range(F)], keeps)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert int(caches(layer)[0].num_frames[0]) == sum(keeps)


def test_layer_streaming_equals_dense_fp8_cache(rng):
    """An FP8 cache: the stream equals dense attention over K/V rounded as FP8 stores them."""
    keeps = [1, 1, 0, 1, 0, 1]
    layer = make_layer(cache_dtype="float8_e4m3fn", impl="xla")
    xs = jnp.asarray(rng.normal(size=(len(keeps), T, DIM)), jnp.float32)
    got, want = stream_vs_dense(layer, xs, [frame_rope(t) for t in range(len(keeps))], keeps)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    assert caches(layer)[0].k[0].dtype == jnp.float8_e4m3fn


def test_scan_over_stacked_layers_equals_unrolled(rng):
    """nnx.vmap-made layers driven by nnx.scan match the same layers called in a Python loop."""
    L, F = 3, 4
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), L)

    @nnx.vmap(in_axes=0, out_axes=0)
    def make_stack(key):
        return StreamingGlobalAttention(
            DIM,
            HEADS,
            patches_per_frame=P,
            num_special=NS,
            scale_frames=1,
            sliding_window=2,
            max_frames=64,
            cache_dtype="float32",
            impl="xla",
            rngs=nnx.Rngs(key),
        )

    stack = make_stack(keys)
    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
    unrolled = []
    for l in range(L):
        layer = make_layer(impl="xla")
        nnx.update(layer, jax.tree.map(lambda a: a[l], params))
        unrolled.append(layer)

    @nnx.jit
    def scan_step(stack, x, cos, sin):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, h):
            return layer(h, cos, sin)

        return body(stack, x)

    @nnx.jit
    def loop_step(layers, x, cos, sin):
        for layer in layers:
            x = layer(x, cos, sin)
        return x

    for t in range(F):
        x = jnp.asarray(rng.normal(size=(1, T, DIM)), jnp.float32)
        cos, sin = frame_rope(t)
        a = scan_step(stack, x, cos[None], sin[None])
        b = loop_step(nnx.List(unrolled), x, cos[None], sin[None])
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    stacked_state = caches(stack)[0]
    assert stacked_state.num_frames.shape == (L, 1)
    np.testing.assert_array_equal(np.asarray(stacked_state.num_frames), [[F]] * L)


@pytest.mark.parametrize("branch_free", [False, True])
def test_layer_faults_and_bad_inputs(rng, monkeypatch, request, branch_free):
    """Bad input is refused; a fault is recorded and changes no row a reader sees, with the
    branching frame step and with the branch-free one (a GPU's default, forced here)."""
    monkeypatch.setattr(frame_tuning, "SYNCING_CONTROL_FLOW", (jax.devices()[0].platform,) if branch_free else ())
    jax.clear_caches()  # the flag is read when tracing: no trace of either kind outlives the test
    request.addfinalizer(jax.clear_caches)
    layer = make_layer()
    cos, sin = frame_rope(0)
    with pytest.raises(ValueError, match=r"x: expected \[streams=1, tokens_per_frame=8, dim=32\]"):
        layer(jnp.zeros((1, T + 1, DIM)), cos[None], sin[None])
    with pytest.raises(ValueError, match="impl"):
        make_layer(impl="fast")
    x = jnp.asarray(rng.normal(size=(1, T, DIM)), jnp.float32)
    layer(x, cos[None], sin[None])
    before = jax.device_get(caches(layer)[0])  # eager calls donate the old state: copy it out
    layer.resolve(False)  # nothing pending: a recorded fault, nothing else changes
    with pytest.raises(jaxkv.CacheError, match="rollback with nothing to roll back"):
        check(layer)
    after = caches(layer)[0]
    assert int(after.num_frames[0]) == int(before.num_frames[0]) == 1
    # every row a reader can see; the trash rows past them take the branch-free step's
    # skipped row moves
    live = after.spec.trash_row
    np.testing.assert_array_equal(np.asarray(after.token_id)[:, :live], np.asarray(before.token_id)[:, :live])
    layer.reset()
    check(layer)
    assert int(caches(layer)[0].num_frames[0]) == 0


def test_model_streaming_equals_dense_with_keyframes():
    """The model's streaming output per frame equals a dense forward over the frames the cache showed it."""
    F = 12
    cfg = dataclasses.replace(SMALL, keyframe_threshold=0.01)
    video = synthetic_video(F, cfg.height, cfg.width, seed=3)
    model = StreamingReconstructor(cfg, rngs=nnx.Rngs(1))
    step = nnx.jit(lambda m, x: m(x), donate_argnums=0)
    frames = jax.device_put(jnp.asarray(video.frames))
    outs = []
    with jax.transfer_guard_device_to_host("disallow"):  # the step never reads a device value
        for i in range(F):
            outs.append(step(model, frames[i : i + 1]))
    outs = jax.device_get(outs)
    jaxkv.flax.check(model)
    keep = np.array([o["keep"][0] for o in outs])
    assert keep[: cfg.scale_frames].all() and 0 < (~keep).sum() < F - cfg.scale_frames  # some frames rolled back
    np.testing.assert_array_equal(keep[cfg.scale_frames :], video.moving[cfg.scale_frames :])
    vis = seed_visibility(keep, cfg.scale_frames, cfg.sliding_window, cfg.patches_per_frame, cfg.num_special, F)
    ref_model = StreamingReconstructor(cfg, rngs=nnx.Rngs(1))
    camera, depth = nnx.jit(lambda m, x, v: m.dense(x, v))(ref_model, frames, jnp.asarray(vis))
    np.testing.assert_allclose(np.concatenate([o["camera"] for o in outs]), np.asarray(camera), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([o["depth"] for o in outs]), np.asarray(depth), rtol=1e-4, atol=1e-4)
    # the mask matters: attending to every past frame gives a different answer
    full = np.repeat(np.tril(np.ones((F, F), bool)), cfg.tokens_per_frame, axis=1)
    camera_full, _ = nnx.jit(lambda m, x, v: m.dense(x, v))(ref_model, frames, jnp.asarray(full))
    assert np.abs(np.asarray(camera_full) - np.asarray(camera)).max() > 1e-2
    # every global layer holds the same frames
    counts = {int(s.num_frames[0]) for s in caches(model)}
    assert counts == {int(keep.sum())}
    model.reset()
    assert {int(s.num_frames[0]) for s in caches(model)} == {0}


def test_model_bad_inputs():
    with pytest.raises(ValueError, match="height, width"):
        dataclasses.replace(SMALL, height=43)
    model = StreamingReconstructor(SMALL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"images: expected f32\[streams=1, 42, 56, 3\]"):
        model(jnp.ones((1, 56, 42, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "xla"])
def test_layer_streaming_equals_dense_gpu_bf16(rng, impl):
    """The GPU backends over a bf16 cache against the float32 dense reference."""
    dim, heads, p, ns, F = 256, 4, 48, 6, 8
    keeps = [1, 1, 0, 1, 1, 0, 1, 1]
    layer = StreamingGlobalAttention(
        dim,
        heads,
        patches_per_frame=p,
        num_special=ns,
        scale_frames=1,
        sliding_window=3,
        max_frames=64,
        cache_dtype="bfloat16",
        impl=impl,
        dtype=jnp.bfloat16,
        rngs=nnx.Rngs(0),
    )
    xs = jnp.asarray(rng.normal(size=(F, p + ns, dim)), jnp.bfloat16)
    pos = lambda t: np.stack(
        [
            np.full(p + ns, t),
            np.r_[np.zeros(ns), np.arange(p) // 8 + 1],  # noqa: E731
            np.r_[np.zeros(ns), np.arange(p) % 8 + 1],
        ],
        -1,
    )
    ropes = [axial_rope(jnp.asarray(pos(t), jnp.int32), dim // heads) for t in range(F)]
    got, want = stream_vs_dense(layer, xs, ropes, keeps)
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


def test_cached_step_equals_nnx_jit_and_syncs(rng):
    cfg = dataclasses.replace(SMALL, keyframe_threshold=0.01)
    video = jnp.asarray(synthetic_video(9, cfg.height, cfg.width, seed=5).frames)
    a = StreamingReconstructor(cfg, rngs=nnx.Rngs(2))
    b = StreamingReconstructor(cfg, rngs=nnx.Rngs(2))
    jitted = nnx.jit(lambda m, x: m(x), donate_argnums=0)
    step = jaxkv.flax.CachedStep(b)
    for i in range(9):
        want, got = jitted(a, video[i : i + 1]), step(video[i : i + 1])
        np.testing.assert_array_equal(np.asarray(got["keep"]), np.asarray(want["keep"]))
        np.testing.assert_allclose(np.asarray(got["camera"]), np.asarray(want["camera"]), rtol=1e-5, atol=1e-5)
    b = step.sync()
    for sa, sb in zip(caches(a), caches(b), strict=True):
        np.testing.assert_array_equal(np.asarray(sa.token_id), np.asarray(sb.token_id))
        np.testing.assert_allclose(np.asarray(sa.k[0]), np.asarray(sb.k[0]), rtol=1e-5, atol=1e-5)
    assert int(caches(b)[0].num_frames[0]) == int(caches(a)[0].num_frames[0]) < 9  # hover frames rolled back
    step(video[:1])  # the step goes on after a sync: it kept its own copy


def test_shared_cache_layers(rng):
    """Layers sharing one FrameCacheModule: bookkeeping once, each layer its own buffers; misuse is refused."""
    from jaxkv import frame
    from jaxkv.flax import FrameCacheModule

    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=HEADS,
        head_dim=DIM // HEADS,
        patches_per_frame=P,
        num_special=NS,
        scale_frames=1,
        sliding_window=2,
        max_frames=64,
        dtype="float32",
    )
    shared = FrameCacheModule(spec)
    layers = [
        StreamingGlobalAttention(DIM, HEADS, cache=shared, layer=i, impl="reference", rngs=nnx.Rngs(i))
        for i in range(2)
    ]
    owned = [make_layer(seed=i) for i in range(2)]
    for i in range(2):
        nnx.update(owned[i], nnx.state(layers[i], nnx.Param))
    for t in range(5):
        x = jnp.asarray(rng.normal(size=(1, T, DIM)), jnp.float32)
        cos, sin = frame_rope(t)
        shared.begin_frame()
        for a, b in zip(layers, owned):
            np.testing.assert_allclose(
                np.asarray(a(x, cos[None], sin[None])), np.asarray(b(x, cos[None], sin[None])), rtol=1e-5, atol=1e-6
            )
    assert len(caches(nnx.List(layers))) == 1  # one state, shared
    with pytest.raises(ValueError, match="defer: a shared cache"):
        layers[0](x, cos[None], sin[None], defer=True)
    with pytest.raises(ValueError, match="resolve: this layer's cache is shared"):
        layers[0].resolve(True)
    with pytest.raises(ValueError, match=r"layer: expected 0 <= layer < 2"):
        StreamingGlobalAttention(DIM, HEADS, cache=shared, layer=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cache: expected 2 heads x 16 dims"):
        StreamingGlobalAttention(DIM, 2, cache=shared, layer=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="patches_per_frame"):
        StreamingGlobalAttention(DIM, HEADS, rngs=nnx.Rngs(0))


def test_hybrid_cache_as_nnx_state(rng):
    """A DeepSeek-V4 hybrid cache held in an nnx.Cache updates in place under nnx.jit."""
    from jaxkv import hybrid as H

    cfg = H.HybridConfig(
        compress_ratios=(0, 4, 16), window=8, index_heads=2, top_k=4, block_size=4, max_requests=2, max_context=64
    )

    class Decoder(nnx.Module):
        def __init__(self):
            self.kv = nnx.Cache(H.init(cfg))

        def __call__(self, kv, pos):
            state, step = H.prepare_forward(self.kv.get_value(), jnp.arange(2), pos)
            state = H.write_window(state, step, 0, kv)
            self.kv.set_value(state)
            return H.window_keys(state, step, 0, kv)[0]

    m = Decoder()
    step = nnx.jit(lambda m, kv, pos: m(kv, pos), donate_argnums=0)
    for t in range(5):
        kv = jnp.asarray(rng.normal(size=(2, 1, cfg.head_dim)), jnp.bfloat16)
        step(m, kv, jnp.full((2,), t, jnp.int32))
    (state,) = caches(m)
    np.testing.assert_array_equal(np.asarray(state.position), [5, 5])
    check(m)
    bad = nnx.jit(lambda m, kv, pos: m(kv, pos))
    bad(m, kv, jnp.asarray([9, 5], jnp.int32))  # request 0 skips ahead: a recorded fault
    with pytest.raises(jaxkv.CacheError, match="position skips ahead"):
        check(m)
    np.testing.assert_array_equal(np.asarray(caches(m)[0].position), [5, 6])  # the refused request stayed


def test_model_caches_save_restore_and_continue(tmp_path):
    """Stream, save_caches, restore_caches into a fresh model, stream on: the outputs equal
    an uninterrupted model's, bit for bit (keyframes rolled back on both sides of the cut)."""
    F, N = 10, 6
    cfg = dataclasses.replace(SMALL, keyframe_threshold=0.01)
    frames = jnp.asarray(synthetic_video(F, cfg.height, cfg.width, seed=3).frames)
    step = nnx.jit(lambda m, x: m(x))
    whole = StreamingReconstructor(cfg, rngs=nnx.Rngs(1))
    want = [jax.device_get(step(whole, frames[i : i + 1])) for i in range(F)]
    first = StreamingReconstructor(cfg, rngs=nnx.Rngs(1))
    for i in range(N):
        step(first, frames[i : i + 1])
    path = jaxkv.flax.save_caches(tmp_path / "model", first)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [f"cache{i}" for i in range(len(caches(first)))] + ["others"]
    )
    second = StreamingReconstructor(cfg, rngs=nnx.Rngs(1))
    jaxkv.flax.restore_caches(path, second)
    for i in range(N, F):
        got = jax.device_get(step(second, frames[i : i + 1]))
        for key in ("camera", "depth", "keep"):
            np.testing.assert_array_equal(got[key], want[i][key], err_msg=f"frame {i} {key}")
    with pytest.raises(FileExistsError, match="exists"):
        jaxkv.flax.save_caches(path, first)
    layer = make_layer(impl="xla")
    with pytest.raises(
        jaxkv.CheckpointError,
        match=r"holds \d+ cache states and \d+ other cache variables, module StreamingGlobalAttention has 1 and 0",
    ):
        jaxkv.flax.restore_caches(path, layer)
